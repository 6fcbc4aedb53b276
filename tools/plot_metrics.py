"""Draw loss and accuracy against epoch from the metrics.jsonl of one or more runs.

    python tools/plot_metrics.py runs/cpu_gloo_1proc runs/cpu_gloo_4proc -o curves.png

One line per run, labelled with its folder name and world size.
"""

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draws to a file; no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from shared.errors import UserError  # noqa: E402
from shared.metrics import read_records  # noqa: E402

PANELS = (("train_loss", "train loss"), ("eval_loss", "eval loss"), ("eval_accuracy", "eval accuracy"))


def read_run(run_dir):
    """The run's records, as the scripts read them: a last line that a killed run cut short is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"error: {path} does not exist: pass run folders that hold a metrics.jsonl.")
    try:
        records = read_records(Path(run_dir), keys=["epoch"])  # toy_mlp's too
    except (OSError, ValueError, UserError) as error:  # ValueError: not UTF-8
        sys.exit(f"error: {path} could not be read ({error}): pass run folders that hold a metrics.jsonl.")
    if not records:
        sys.exit(f"error: {path} has no epochs yet: pass a run that finished at least one epoch.")
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", help="folders holding metrics.jsonl (a script's --output_dir)")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG file to write")
    args = parser.parse_args()

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for run_dir in args.run_dirs:
        records = read_run(run_dir)
        label = Path(run_dir).resolve().name + (f" ({records[-1]['world_size']} proc)" if "world_size" in records[-1] else "")
        epochs = [record["epoch"] for record in records]
        for axis, (key, _) in zip(axes, PANELS):
            if key not in records[0]:  # toy_mlp records no eval loss
                continue
            axis.plot(epochs, [record.get(key, math.nan) for record in records], marker="o", label=label)  # nan: a gap
    for axis, (_, title) in zip(axes, PANELS):
        axis.set(title=title, xlabel="epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize="small")
        else:
            axis.text(0.5, 0.5, "not recorded by these runs", ha="center", transform=axis.transAxes)
    figure.tight_layout()
    try:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.output, dpi=100)
    except (OSError, ValueError) as error:  # a folder there, or a format matplotlib does not write (its ValueError)
        sys.exit(f"error: {args.output} could not be written ({error}): pass a .png, .pdf or .svg file name in a folder you can write in.")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
