"""--profile: torch.profiler over a window of training steps, through accelerator.profile.

After SKIP steps (start-up, DDP's first-step bucket rebuild) and WARMUP more, ACTIVE steps are
recorded on every process, and each writes a Chrome/Perfetto trace to
<output_dir>/profile/trace_rank<N>.json (open it at https://ui.perfetto.dev). `python
tools/step_time.py <output_dir>/profile` reads them into a table of where a step's time went. The
profiler only observes: a profiled run trains the weights of one that is not. A run that fails inside
the window writes no trace (one stopped on a signal, on every process at the same step, does).
"""

import contextlib
import os
import sys
import types

import torch
from accelerate.utils import ProfileKwargs

from shared import stop_together
from shared.errors import Stopped
from shared.run_folder import PROFILE_FOLDER

SKIP, WARMUP, ACTIVE = 5, 2, 5
# A checkpoint's save in a trace (shared/checkpoints.py labels it): tools/step_time.py leaves out the step that holds one.
SAVE_SPAN = "checkpoint save"


def off():
    """The stand-in for accelerator.profile() without --profile: its step() does nothing."""
    return contextlib.nullcontext(types.SimpleNamespace(step=lambda: None))


def window(accelerator, output_dir, model):
    """Every process must profile the same steps under this (its trace write is a gather): accelerator.profile's
    handler for --profile, with the schedule and the trace each process writes."""
    folder = output_dir / PROFILE_FOLDER
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's start/stop notices and, on a CPU, its search for GPUs
    _label_forward(accelerator.unwrap_model(model, keep_torch_compile=False))

    def write(profiler):  # every process, at the same step: a write that fails on any stops all in one sentence
        trace = folder / f"trace_rank{accelerator.process_index}.json"
        with stop_together.if_write_fails(trace, "free space or fix the folder, or train without --profile."):
            folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(trace))
            if accelerator.is_main_process:  # those an earlier launch at more processes left are not this run's
                ours = {f"trace_rank{rank}.json" for rank in range(accelerator.num_processes)}
                for stale in (path for path in folder.glob("trace_rank*.json") if path.name not in ours):
                    stale.unlink(missing_ok=True)
        accelerator.print(f"--profile wrote a trace per process to {folder}: `python tools/step_time.py {folder}` "
                          "shows where a step's time went.")

    return _Window(on_trace_ready=write,  # torch's default activities: the CPU, and the GPU where there is one
                   schedule_option={"skip_first": SKIP, "wait": 0, "warmup": WARMUP, "active": ACTIVE, "repeat": 1})


class _Window(ProfileKwargs):
    """accelerate's ProfileKwargs, whose profiler also says so when the run ended before the window did."""

    def build(self):
        profiler = super().build()
        profiler.__class__ = _SaysWhenEmpty
        return profiler


class _SaysWhenEmpty(torch.profiler.profile):
    def __exit__(self, *exception):
        failed = exception[0] is not None and not issubclass(exception[0], Stopped)  # maybe on this process alone
        recorded_nothing = self.step_num <= SKIP + WARMUP  # at SKIP + WARMUP, torch would write what came after the loop
        if failed or recorded_nothing:  # no trace: a failure's write would wait for every process while the others train on
            self.on_trace_ready = None
        super().__exit__(*exception)
        if recorded_nothing and exception[0] is None and os.environ.get("RANK", "0") == "0":
            print(f"--profile recorded nothing: the run took {self.step_num} steps, and the profiler skips {SKIP} and warms up "
                  f"for {WARMUP} before it records {ACTIVE}: train longer (--num_epochs, or a smaller --batch_size).",
                  file=sys.stderr, flush=True)


def _label_forward(module):
    """Mark each forward call of the model as `forward` in the trace (DDP labels its own wrapper; a
    single process or FSDP have none)."""
    labels = []
    module.register_forward_pre_hook(lambda *_: labels.append(torch.autograd.profiler.record_function("forward").__enter__()))
    module.register_forward_hook(lambda *_: labels.pop().__exit__(None, None, None))
