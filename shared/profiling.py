"""--profile: torch.profiler over a window of training steps, through accelerate's profiler context.

After SKIP steps (start-up, DDP's first-step bucket rebuild) and WARMUP more, ACTIVE steps are
recorded on every process. Each process writes a Chrome/Perfetto trace to
<output_dir>/profile/trace_rank<N>.json (open it at https://ui.perfetto.dev or chrome://tracing),
and the main process prints one table of where a step's time went on each process, also saved as
<output_dir>/profile/step_time.json. The profiler only observes: a profiled run trains the same
weights as one that is not.

The table reads each process's main thread in the trace (the host's time: on a GPU, kernels run
asynchronously and appear on their own rows of the trace):
- forward: the model's forward call (a label this module adds around it);
- backward: from the first to the last of autograd's functions;
- all-reduce wait: from the end of backward until DDP has copied the averaged gradients back, the
  part of gloo's or NCCL's all-reduce that backward did not hide;
- optimizer: the optimizer's step and zero_grad;
- data and loop: the rest of the step (the next batch, metrics, Python);
and, beside them, how much of the all-reduce ran while backward was still computing.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import ProfileKwargs, gather_object

SKIP, WARMUP, ACTIVE = 5, 2, 5
PHASES = ("forward", "backward", "all-reduce wait", "optimizer", "data and loop")


class _Off:
    def step(self):
        pass


def off():
    """The stand-in for accelerator.profile() without --profile: its step() does nothing."""
    return contextlib.nullcontext(_Off())


def window(accelerator, output_dir, model):
    """accelerator.profile's handler for --profile: the schedule, and what to write when the window ends."""
    folder = Path(output_dir) / "profile"
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's start/stop notices and, on a CPU, its search for GPUs
    _label_forward(accelerator.unwrap_model(model, keep_torch_compile=False))

    def write(profiler):
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"trace_rank{accelerator.process_index}.json"
        profiler.export_chrome_trace(str(trace))
        rows = gather_object([{"process": accelerator.process_index, **step_time(json.loads(trace.read_text()))}])
        if accelerator.is_main_process:
            (folder / "step_time.json").write_text(json.dumps(rows, indent=1))
            accelerator.print(table(rows, folder))

    activities = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return _Window(activities=activities, on_trace_ready=write,
                   schedule_option={"skip_first": SKIP, "wait": 0, "warmup": WARMUP, "active": ACTIVE, "repeat": 1})


class _Window(ProfileKwargs):
    """accelerate's ProfileKwargs, whose profiler also says so when the run ended before the window did."""

    def build(self):
        profiler = super().build()
        profiler.__class__ = _SaysWhenEmpty
        return profiler


class _SaysWhenEmpty(torch.profiler.profile):
    def __exit__(self, *exception):
        super().__exit__(*exception)
        if self.step_num < SKIP + WARMUP + 1 and exception[0] is None and os.environ.get("RANK", "0") == "0":
            print(f"--profile recorded nothing: the run took {self.step_num} steps, and the profiler skips {SKIP} and warms up "
                  f"for {WARMUP} before it records {ACTIVE}: train longer (--num_epochs, or a smaller --batch_size).",
                  file=sys.stderr, flush=True)


def _label_forward(module):
    """Mark each forward call of the model as `forward` in the trace (DDP labels its own wrapper; a
    single process or FSDP have none)."""
    labels = []
    module.register_forward_pre_hook(lambda *_: labels.append(torch.autograd.profiler.record_function("forward").__enter__()))
    module.register_forward_hook(lambda *_: labels.pop().__exit__(None, None, None))


def step_time(trace):
    """Milliseconds per step in each phase on the trace's main thread, averaged over its ProfilerSteps."""
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and event.get("cat") != "kernel"]
    steps = [event for event in events if event["name"].startswith("ProfilerStep#")]
    main = steps[0]["tid"] if steps else None
    totals = dict.fromkeys(PHASES + ("step", "all-reduce under backward"), 0.0)
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [event for event in events if start <= event["ts"] < end]
        on_main = [event for event in inside if event["tid"] == main]

        def total(prefix):
            return sum(event["dur"] for event in on_main if event["name"].startswith(prefix))

        autograd = [event for event in inside if event["name"].startswith("autograd::engine::evaluate_function")]
        backward = (min(event["ts"] for event in autograd), max(event["ts"] + event["dur"] for event in autograd)) if autograd else (start, start)
        copies = [event for event in on_main if event["name"].startswith("torch.distributed.ddp.reducer::copy_bucket_to_grad")]
        wait = max(0.0, max((event["ts"] + event["dur"] for event in copies), default=backward[1]) - backward[1])
        reduces = [event for event in inside if event["name"] in ("gloo:all_reduce", "nccl:all_reduce")]
        hidden = sum(max(0.0, min(event["ts"] + event["dur"], backward[1]) - max(event["ts"], backward[0])) for event in reduces)
        phases = {"forward": total("DistributedDataParallel.forward") or total("forward"), "backward": backward[1] - backward[0],
                  "all-reduce wait": wait, "optimizer": total("Optimizer.step#") + total("Optimizer.zero_grad#")}
        phases["data and loop"] = max(0.0, step["dur"] - sum(phases.values()))
        for name, value in {**phases, "step": step["dur"], "all-reduce under backward": hidden}.items():
            totals[name] += value
    return {name: round(value / max(len(steps), 1) / 1000, 3) for name, value in totals.items()} | {"steps": len(steps)}


def table(rows, folder):
    """The rows of step_time as a table, one line per process."""
    columns = ("step",) + PHASES + ("all-reduce under backward",)
    lines = [f"Where a step's time went, ms per step over {rows[0]['steps']} profiled steps (traces in {folder}):",
             "| process | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {row['process']} | " + " | ".join(f"{row[name]:.2f}" for name in columns) + " |" for row in rows]
    return "\n".join(lines)
