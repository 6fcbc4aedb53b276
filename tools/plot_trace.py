"""Draw one profiled step of each process from --profile's traces: where backward runs, and where
DDP's all-reduce of the gradient buckets runs beside it.

    python tools/plot_trace.py runs/mnist_conv/profile [runs/other/profile ...] -o step.png

For each trace_rank<N>.json in the folders, the last recorded training step (as tools/step_time.py counts them): one row for the main thread's
phases (forward, backward, optimizer; the gaps between them are the waits) and one row for the all-reduces the
communication thread ran, on the same time axis from the step's start. On a CPU these are gloo's
all-reduces themselves; on a GPU they are the host's calls that queue NCCL's, whose kernels run later on
the device (tools/step_time.py counts those, in its device columns).
"""

import argparse
import sys
from pathlib import Path

from step_time import DEVICE_CATEGORIES, host_steps, none_trained_alone, read_trace, trace_files, training_step

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "all-reduce": "tab:green", "optimizer": "tab:purple"}


def last_step(trace, path="a trace"):
    """The duration of the trace's last training step and the spans to draw in it, in ms from its start."""
    # The host's events: on a GPU, Kineto repeats forward's and the optimizer's annotations on the device's rows.
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and event.get("cat") not in DEVICE_CATEGORIES]
    steps = host_steps(events)
    if not steps:
        sys.exit(f"error: {path} holds no recorded step: pass the profile folder of a run trained with --profile long enough to "
                 "record its steps.")
    # Not the run's end, nor one that held an evaluation or a save: what step_time.py counts.
    trained = [(step, parts) for step in steps if (parts := training_step(step, events, steps[0]["tid"]))]
    if not trained:
        sys.exit(none_trained_alone(path))
    step, (inside, _, forward, autograd) = max(trained, key=lambda trained_step: trained_step[0]["ts"])
    start = step["ts"]

    def spans(test):
        return [((event["ts"] - start) / 1000, event["dur"] / 1000) for event in inside if test(event["name"])]

    return step["dur"] / 1000, {
        "forward": [((forward["ts"] - start) / 1000, forward["dur"] / 1000)],
        "backward": [((autograd[0] - start) / 1000, (autograd[1] - autograd[0]) / 1000)],
        "optimizer": spans(lambda name: name.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))),
        "all-reduce": spans(lambda name: name in ("gloo:all_reduce", "nccl:all_reduce")),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile_dirs", nargs="+", help="the profile/ folders of runs made with --profile")
    parser.add_argument("-o", "--output", default="step.png")
    args = parser.parse_args()
    traces = []
    for folder in args.profile_dirs:
        found = trace_files(folder)
        if not found:
            sys.exit(f"error: {folder} holds no trace_rank*.json: pass the profile/ folder of a run made with --profile.")
        traces += found

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(traces), 1, figsize=(12, 1.6 * len(traces) + 0.6), squeeze=False)
    for axis, path in zip(axes[:, 0], traces):
        length, phases = last_step(read_trace(path), path)
        for row, names in ((1, ("forward", "backward", "optimizer")), (0, ("all-reduce",))):
            for name in names:
                axis.broken_barh(phases[name], (row - 0.35, 0.7), color=COLORS[name], label=name)
        axis.set_yticks([0, 1], ["communication", "main thread"])
        axis.set_xlim(0, length)
        axis.set_title(f"{path.parent.parent.name}, {path.stem.replace('trace_', '')}: one step, {length:.1f} ms", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms from the start of the step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    figure.legend(unique.values(), unique.keys(), loc="upper right", ncol=4, fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    try:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.output, dpi=110)
    except (OSError, ValueError) as error:  # a folder there, or a format matplotlib does not write (its ValueError)
        sys.exit(f"error: {args.output} could not be written ({error}): pass a .png, .pdf or .svg file name in a folder you can write in.")
    print(f"Wrote {args.output}")


if __name__ == "__main__":
    main()
