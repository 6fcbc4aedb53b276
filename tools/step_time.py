"""Where a training step's time went, from the traces that a run's --profile wrote:

    python tools/step_time.py runs/mnist_conv/profile

prints a table with a row per process (every trace_rank<N>.json in the folder), in ms per step
averaged over the recorded steps, and saves it as step_time.json beside the traces.

Steps are the host's ProfilerStep#N annotations that trained one batch (one forward call of the model);
one that also holds an evaluation (the window crossed an epoch's end) or a checkpoint's save, or none
(the span open when the run ended, which torch closes only then) is left out and counted as such. On a GPU, Kineto repeats each
step on the device's rows (gpu_user_annotation), which mark where its kernels ran and are not counted again.
The host's phases, from each process's main thread (on a GPU: the time the host spent issuing them):
- forward: the model's forward call; backward: from the first to the last of autograd's functions,
  on any thread (on a GPU autograd runs on a device thread of its own);
- optimizer: the optimizer's step and zero_grad; data and loop: the rest of the step.
DDP's gradient all-reduce:
- on a CPU (gloo: no kernels in the trace), `all-reduce wait` is the host's wait from the end of
  backward until DDP has copied the averaged gradients back (copy_bucket_to_grad, on whichever thread
  runs it), and `all-reduce under backward` is gloo's all-reduce time while backward still computed;
- on a GPU the host never waits on NCCL, so both come from the device timeline: the time NCCL's
  kernels ran while no other kernel did (the step waits for it: `all-reduce wait`), and while other
  kernels ran beside them (`all-reduce under backward`), a broadcast's left out (DDP's of BatchNorm's
  buffers, in forward); `device busy` is the time any kernel ran, the step's floor on that device.
"""

import argparse
import json
import re
import sys
from pathlib import Path

HOST_PHASES = ("forward", "backward", "all-reduce wait", "optimizer", "data and loop")
DEVICE_CATEGORIES = ("kernel", "gpu_user_annotation", "gpu_memcpy", "gpu_memset")  # a GPU trace's device rows
SAVE_SPAN = "checkpoint save"  # shared/profiling.py's (a test keeps them the same): this tool imports no torch


def host_steps(events):
    """The host's ProfilerStep#N spans (not their copies on the device's rows)."""
    return [event for event in events if event.get("cat") == "user_annotation" and event["name"].startswith("ProfilerStep#")]


def none_trained_alone(where):
    """The sentence for traces whose every recorded step also held an evaluation or a save (--checkpointing_steps 1, say)."""
    return (f"error: every step recorded in {where} also held an evaluation, a checkpoint's save or no training: profile again "
            "with checkpoints further apart (--checkpointing_steps) or longer epochs, so that steps 8 to 12 train alone.")


def training_step(step, host, main):
    """A ProfilerStep span's host events, those of its main thread, its forward and its backward's (start, end); None where
    it is not one training step: it held an evaluation's forwards too, a checkpoint's save, or no training."""
    start, end = step["ts"], step["ts"] + step["dur"]
    inside = [event for event in host if start <= event["ts"] < end]
    on_main = [event for event in inside if event["tid"] == main]
    forwards = [event for event in on_main if event["name"] == "DistributedDataParallel.forward"] or [
        event for event in on_main if event["name"] == "forward"]
    backward = backward_span(inside)
    if len(forwards) != 1 or backward is None or any(event["name"] == SAVE_SPAN for event in on_main):
        return None
    return inside, on_main, forwards[0], backward


def backward_span(events):
    """(start, end) of autograd's functions among events, on any thread; None if there are none."""
    autograd = [event for event in events if event["name"].startswith("autograd::engine::evaluate_function")]
    return (min(event["ts"] for event in autograd), max(event["ts"] + event["dur"] for event in autograd)) if autograd else None


def merged(intervals):
    """Sorted, non-overlapping (start, end) covering the same time as the intervals."""
    spans = []
    for start, end in sorted(intervals):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def overlap(start, end, spans):
    return sum(max(0.0, min(end, span_end) - max(start, span_start)) for span_start, span_end in spans)


def step_time(trace):
    """Milliseconds per step in each phase, averaged over the trace's recorded steps."""
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X"]
    steps = host_steps(events)
    main = steps[0]["tid"] if steps else None
    host = [event for event in events if event.get("cat") not in DEVICE_CATEGORIES]
    kernels = [event for event in events if event.get("cat") == "kernel"]
    # Kineto marks each step on the device once per stream that ran in it (compute, NCCL's): the step there
    # spans all of them, from the first mark's start to the last one's end.
    on_device = {}
    for event in (event for event in events if event.get("cat") == "gpu_user_annotation"):
        first, last = on_device.get(event["name"], (event["ts"], event["ts"] + event["dur"]))
        on_device[event["name"]] = (min(first, event["ts"]), max(last, event["ts"] + event["dur"]))
    totals, left_out = {}, 0
    for step in steps:
        if (trained := training_step(step, host, main)) is None:
            left_out += 1
            continue
        inside, on_main, forward, backward = trained
        start, end = step["ts"], step["ts"] + step["dur"]

        def total(prefix):
            return sum(event["dur"] for event in on_main if event["name"].startswith(prefix))

        phases = {"forward": forward["dur"], "backward": backward[1] - backward[0],
                  "optimizer": total("Optimizer.step#") + total("Optimizer.zero_grad#")}
        if kernels:  # the device timeline of this step: its kernels, where Kineto marked the step on the device
            device_start, device_end = on_device.get(step["name"], (start, end))
            ran = [event for event in kernels if device_start <= event["ts"] < device_end]
            # The gradients' collectives (FSDP's all-gathers and reduce-scatters too), not a broadcast: DDP's of BatchNorm's
            # buffers before each forward counts as the device's work, for fewer or larger buckets would not shorten it.
            nccl = [event for event in ran if "nccl" in event["name"].lower() and "broadcast" not in event["name"].lower()]
            compute = merged((event["ts"], event["ts"] + event["dur"]) for event in ran if "nccl" not in event["name"].lower())
            hidden = sum(overlap(event["ts"], event["ts"] + event["dur"], compute) for event in nccl)
            phases["data and loop"] = max(0.0, step["dur"] - sum(phases.values()))
            phases["all-reduce wait"] = sum(event["dur"] for event in nccl) - hidden
            phases["device busy"] = sum(span_end - span_start for span_start, span_end in merged(
                (event["ts"], event["ts"] + event["dur"]) for event in ran))
        else:
            copies = [event for event in inside if event["name"].startswith("torch.distributed.ddp.reducer::copy_bucket_to_grad")]
            phases["all-reduce wait"] = max(0.0, max((event["ts"] + event["dur"] for event in copies), default=backward[1]) - backward[1])
            phases["data and loop"] = max(0.0, step["dur"] - sum(phases.values()))
            # gloo's all-reduces of different buckets may run at once, on threads of their own: their time, counted once
            reduces = merged((event["ts"], event["ts"] + event["dur"]) for event in inside if event["name"] in ("gloo:all_reduce", "nccl:all_reduce"))
            hidden = overlap(*backward, reduces)
        for name, value in {"step": step["dur"], **phases, "all-reduce under backward": hidden}.items():
            totals[name] = totals.get(name, 0.0) + value
    counted = len(steps) - left_out
    row = {name: round(value / max(counted, 1) / 1000, 3) for name, value in totals.items()}
    return row | {"steps": counted, "left out": left_out, "timeline": "device" if kernels else "host"}


def table(rows, folder):
    """The rows of step_time as a table, one line per process."""
    columns = ("step",) + HOST_PHASES + ("all-reduce under backward",) + (("device busy",) if "device busy" in rows[0] else ())
    left_out = f", {rows[0]['left out']} more left out that held an evaluation, a checkpoint's save or no training" if rows[0]["left out"] else ""
    lines = [f"Where a step's time went, ms per step over {rows[0]['steps']} profiled training steps{left_out} (traces in {folder}; "
             f"the all-reduce columns from the {rows[0]['timeline']} timeline):",
             "| process | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {row['process']} | " + " | ".join(f"{row[name]:.2f}" for name in columns) + " |" for row in rows]
    return "\n".join(lines)


def trace_files(folder):
    """The trace_rank<N>.json files in a profile folder, by rank (2 before 10); a file of another name there is not one."""
    return sorted((path for path in Path(folder).glob("trace_rank*.json") if re.fullmatch(r"trace_rank\d+\.json", path.name)), key=rank_of)


def rank_of(trace_path):
    return int(re.sub(r"\D", "", trace_path.name))


def read_trace(path):
    """A Chrome trace that --profile wrote, or a one-sentence exit naming the file that is no trace."""
    try:
        trace = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # cut short by a killed run, or not JSON
        sys.exit(f"error: {path} could not be read as a trace ({error}): profile the run again, or pass another profile folder.")
    if not (isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)):  # JSON, but not the trace --profile writes
        sys.exit(f"error: {path} could not be read as a trace (it holds no traceEvents list): profile the run again, "
                 "or pass another profile folder.")
    return trace


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the profile folder of a run that --profile recorded (<output_dir>/profile)")
    folder = parser.parse_args().folder
    rows = [{"process": rank_of(path), **step_time(read_trace(path))} for path in trace_files(folder)]
    if not rows or not all(row["steps"] or row["left out"] for row in rows):
        sys.exit(f"error: {folder} holds no trace_rank*.json, or one without a recorded step: pass the profile folder of a run "
                 "trained with --profile long enough to record its steps.")
    if not all(row["steps"] for row in rows):
        sys.exit(none_trained_alone(folder))
    try:
        (folder / "step_time.json").write_text(json.dumps(rows, indent=1))
    except OSError as error:
        sys.exit(f"error: {folder / 'step_time.json'} could not be written ({error}): make the folder writable, or copy it to one that is.")
    print(table(rows, folder))


if __name__ == "__main__":
    main()
