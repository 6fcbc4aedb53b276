"""Training samples per second of each MNIST-family script, against the tutorial recipe and the ceilings.

    python benchmarks/throughput.py                       # prints markdown tables, writes throughput.png/.json
    python benchmarks/throughput.py --processes 1 2 --scripts cpu_gloo.py --repeats 5

For 1, 2 and 4 processes on this machine's CPU, in one run, on the same data: each script through
its real command line with the default in-memory pipeline and with --data_pipeline torchvision;
the tutorials' plain recipe (benchmarks/baselines.py); raw DDP on the in-memory path; and the
ceilings (compute only, and the Accelerate-prepared model on in-memory batches with no loader).
A run's figure is its fastest epoch of 2..N in global training samples per second (epoch 1 warms
up; on a shared machine other work only ever slows an epoch down, so the fastest is the closest to
what the code itself costs, and every variant is read the same way). Each variant runs --repeats
times in rotating rounds; a figure is the median over rounds, and a ratio the median of the ratios
within rounds (a shared machine drifts; ratios within a round cancel most of it). Each process gets
cores / processes threads (at least 1), except "tutorial recipe", which runs as the tutorials do:
at torch's default, one thread per core in every process. "tutorial recipe, matched threads" is
the same recipe given the scripts' threads, a stricter comparison. The tutorial recipe starts its
processes as the tutorials do (torch.multiprocessing, one session); raw DDP and the step ceiling
start theirs as `accelerate launch` starts the scripts' (torchrun: a session each), because on this
machine the process layout alone moves a run's speed (6-8% at 4 processes on 2 cores; see
benchmarks/README.md).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import baselines  # noqa: E402
from mnist_files import write_mnist_layout  # noqa: E402

from shared.metrics import read_records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# script -> training samples of the benchmark's data (the conv net's steps take longest)
TRAIN_SAMPLES = {"cpu_gloo.py": 24000, "seq_net.py": 24000, "mnist_conv.py": 6000}


def write_data(root, num_train):
    """Random digits-shaped data in torchvision's layout: speed does not depend on what they show."""
    rng = np.random.default_rng(0)
    for name in ("MNIST", "FashionMNIST"):
        write_mnist_layout(root, name, rng.integers(0, 256, (num_train, 28, 28)), rng.integers(0, 10, num_train),
                           rng.integers(0, 256, (500, 28, 28)), rng.integers(0, 10, 500))


def script_args(script, data_dir, pipeline, num_epochs, output_dir):
    """The script's path and arguments, as the benchmark runs it."""
    args = [str(REPO / "scripts" / script), "--data_dir", str(data_dir), "--output_dir", str(output_dir),
            "--overwrite_output_dir", "--num_epochs", str(num_epochs), "--data_pipeline", pipeline,
            "--no_split_batches"]  # each process takes the whole batch, as in the baselines it is compared with
    if script == "cpu_gloo.py":
        args += ["--log_interval", "1000000"]
    return args


def script_rate(script, processes, data_dir, pipeline, num_epochs, workdir):
    """Run the script as a user would and read samples_per_sec back from its metrics.jsonl."""
    output_dir = Path(workdir) / f"{Path(script).stem}_{pipeline}_{processes}"
    launcher = [baselines.PYTHON, str(REPO / "scripts" / "launch.py"), "--config_file",
                str(REPO / "accelerate_configs" / "cpu.yaml"), "--num_processes", str(processes)]
    command = ([baselines.PYTHON] if processes == 1 else launcher) + script_args(script, data_dir, pipeline, num_epochs, output_dir)
    records = run_script(command, {**os.environ, "OMP_NUM_THREADS": str(baselines.threads_for(processes))}, output_dir)
    assert records[-1]["world_size"] == processes
    return max(r["samples_per_sec"] for r in records[1:])


def run_script(command, env, output_dir):
    """Run a script's command line; the records of its metrics.jsonl. Stops the benchmark if it failed."""
    finished = subprocess.run(command, env=env, capture_output=True, text=True)  # progress bars included, unshown
    if finished.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{finished.stderr[-3000:]}")
    return read_metrics(output_dir)


def read_metrics(output_dir):
    """The records of a run's metrics.jsonl, one per epoch, as the scripts read them: a last line still being written is not one."""
    return read_records(Path(output_dir), keys=["epoch"])


def baseline_rate(baseline, script, processes, data_dir, num_epochs, default_threads=False, as_torchrun=False):
    """as_torchrun: every process in its own session, as `accelerate launch` starts the scripts' processes."""
    defaults = baselines.script_defaults(script)
    batch, lr = defaults.batch_size, defaults.lr
    threads = None if default_threads else baselines.threads_for(processes)
    rates = baselines.spawn(baseline, processes, threads, script, str(data_dir), batch, num_epochs, lr,
                            own_sessions=as_torchrun and processes > 1)
    return max(rates[1:])


def variants(script, processes, data_dir, num_epochs, workdir):
    """What one round measures for one script and process count: name -> a function giving samples/s."""
    def baseline(function, **kwargs):
        return lambda: baseline_rate(function, script, processes, data_dir, num_epochs, **kwargs)

    def pipeline(name):
        return lambda: script_rate(script, processes, data_dir, name, num_epochs, workdir)

    return {
        "default_memory": pipeline("memory"),
        "torchvision_pipeline": pipeline("torchvision"),
        "tutorial_recipe": baseline(baselines.tutorial_recipe, default_threads=True),
        "tutorial_recipe_matched_threads": baseline(baselines.tutorial_recipe),
        # What the scripts are measured against in their own ratios starts as the scripts' processes do.
        "raw_ddp_memory": baseline(baselines.raw_ddp_memory, as_torchrun=True),
        "step_ceiling": baseline(baselines.accelerate_ceiling, as_torchrun=True),
        "compute_ceiling_1proc": lambda: baseline_rate(baselines.compute_ceiling, script, 1, data_dir, num_epochs),
    }


def measure(scripts, process_counts, num_epochs, repeats, workdir, json_path, train_samples=None, only=None):
    """Every variant `repeats` times, in rounds that rotate their order so that no variant always runs
    first or after the slowest; a row holds every round's figures (see medians). The rows so far are
    saved to json_path after each one, so a run that is stopped keeps what it measured."""
    rows = []
    for script in scripts:
        num_train = train_samples or TRAIN_SAMPLES[script]
        data_dir = Path(workdir) / f"data_{num_train}"
        if not data_dir.exists():
            write_data(data_dir, num_train)
        for processes in process_counts:
            runs = {name: measure for name, measure in variants(script, processes, data_dir, num_epochs, workdir).items()
                    if not only or name in only}
            names = list(runs)
            rounds = []
            for round_index in range(repeats):
                order = baselines.rotated(names, round_index)
                rounds.append({name: runs[name]() for name in order})
                print(f"measured {script} x{processes}, round {round_index + 1}/{repeats}: "
                      + ", ".join(f"{name} {rounds[-1][name]:,.0f}" for name in names), file=sys.stderr, flush=True)
            row = {"script": script, "processes": processes, "batch_size": baselines.script_defaults(script).batch_size, "rounds": rounds,
                   "measured_with": baselines.measured_with()}
            rows.append(row)
            Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


def medians(row):
    """A row with each variant's median over its rounds."""
    return {**row, **{name: statistics.median(r[name] for r in row["rounds"]) for name in row["rounds"][0]}}


def ratios(row, numerator, denominator):
    """numerator / denominator within each round."""
    return [r[numerator] / r[denominator] for r in row["rounds"]]


COLUMNS = {  # variant -> table heading
    "default_memory": "default (memory)",
    "torchvision_pipeline": "torchvision pipeline",
    "tutorial_recipe": "tutorial recipe",
    "tutorial_recipe_matched_threads": "tutorial recipe, matched threads",
    "raw_ddp_memory": "raw DDP, memory (1 proc: bare model)",
    "step_ceiling": "step ceiling",
    "compute_ceiling_1proc": "compute ceiling (1 proc)",
}
RATIOS = {  # denominator -> heading of default / denominator
    "tutorial_recipe": "default / tutorial recipe",
    "tutorial_recipe_matched_threads": "default / tutorial, matched threads",
    "torchvision_pipeline": "default / torchvision pipeline",
    "step_ceiling": "default / step ceiling",
    "compute_ceiling_1proc": "default / compute ceiling",
    "raw_ddp_memory": "Accelerate / raw DDP (same data path)",
}


def tables(rows):
    measured = [name for name in COLUMNS if name in rows[0]["rounds"][0]]
    denominators = [name for name in RATIOS if name in measured]
    lines = ["| script | processes | batch | " + " | ".join(COLUMNS[k] for k in measured) + " |", "|---" * (3 + len(measured)) + "|"]
    for r in rows:
        lines.append(f"| {r['script']} | {r['processes']} | {r['batch_size']} | " + " | ".join(f"{r[k]:,.0f}" for k in measured) + " |")
    lines += ["", "| script | processes | " + " | ".join(RATIOS[k] for k in denominators) + " |", "|---" * (2 + len(denominators)) + "|"]
    for r in rows:
        cells = [baselines.spread(ratios(r, "default_memory", denominator), 2) for denominator in denominators]
        lines.append(f"| {r['script']} | {r['processes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows):
    """The issue's targets, where this run measured what they need: median ratio over rounds, and its range."""
    if not {"step_ceiling", "tutorial_recipe", "raw_ddp_memory", "compute_ceiling_1proc"} <= set(rows[0]["rounds"][0]):
        return "- not measured in this run (--variants)"
    found = {(r["script"], r["processes"]): r for r in rows}
    checks = []
    if ("cpu_gloo.py", 2) in found:
        r = found["cpu_gloo.py", 2]
        checks.append(("cpu_gloo, 2 processes, batch 64: default >= 0.85 x step ceiling", ratios(r, "default_memory", "step_ceiling"), 0.85))
        checks.append(("cpu_gloo, 2 processes, batch 64: default >= 4 x tutorial recipe", ratios(r, "default_memory", "tutorial_recipe"), 4.0))
        checks.append(("cpu_gloo, 2 processes, batch 64: default >= 4 x tutorial recipe given matched threads (stricter than asked)",
                       ratios(r, "default_memory", "tutorial_recipe_matched_threads"), 4.0))
    if ("mnist_conv.py", 1) in found:
        r = found["mnist_conv.py", 1]
        checks.append(("mnist_conv, 1 process, batch 64: default >= 0.95 x compute ceiling", ratios(r, "default_memory", "compute_ceiling_1proc"), 0.95))
    for r in rows:
        if r["processes"] > 1:  # one process has no DDP to compare with: that row compares with the bare model
            checks.append((f"{r['script']}, {r['processes']} processes: Accelerate >= 0.97 x raw DDP, same data path",
                           ratios(r, "default_memory", "raw_ddp_memory"), 0.97))
    return "\n".join(f"- {'PASS' if statistics.median(values) >= bound else 'MISS'}: {name} (median {statistics.median(values):.3f}, "
                     f"rounds {min(values):.3f}-{max(values):.3f})" for name, values, bound in checks)


def rows_of(saved):
    """The rows of a saved --output, with their medians."""
    if not saved:
        raise ValueError("it holds no rows")
    return [medians(row) for row in saved]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scripts = sorted({r["script"] for r in rows})
    figure, axes = plt.subplots(1, len(scripts), figsize=(5 * len(scripts), 4), squeeze=False)
    for axis, script in zip(axes[0], scripts):
        mine = [r for r in rows if r["script"] == script]
        processes = [r["processes"] for r in mine]
        for key, label in (("default_memory", "default (in-memory)"), ("torchvision_pipeline", "torchvision pipeline"),
                           ("tutorial_recipe", "tutorial recipe"), ("step_ceiling", "step ceiling")):
            if key not in mine[0]:
                continue
            axis.plot(processes, [r[key] for r in mine], marker="o", label=label)
        axis.set(title=script, xlabel="processes", ylabel="training samples/s", xticks=processes)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", default=list(TRAIN_SAMPLES), choices=list(TRAIN_SAMPLES))
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--num_epochs", type=int, default=4, help="epoch 1 is warm-up; the fastest of the rest is reported")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant; each figure is the median over rounds")
    parser.add_argument("--train_samples", type=int, help="training samples per data set (default: 24,000 for the linear nets, 6,000 for the conv net)")
    parser.add_argument("--output", default="benchmarks/throughput", help="writes <output>.json (after every row) and <output>.png")
    parser.add_argument("--variants", nargs="+", choices=list(COLUMNS),
                        help="measure only these, and default_memory, which the others are compared with (default: all)")
    parser.add_argument("--tables_from", metavar="JSON", help="measure nothing: print the tables of a saved <output>.json and redraw its PNG")
    args = parser.parse_args()
    if args.num_epochs < 2:
        parser.error("--num_epochs must be 2 or more: epoch 1 warms up, and is not reported")
    if args.variants:
        args.variants = ["default_memory", *(name for name in args.variants if name != "default_memory")]
    if args.tables_from:
        rows = baselines.read_saved_output(args.tables_from, rows_of)
        plot(rows, Path(args.tables_from).with_suffix(".png"))
        print(f"Tables of {args.tables_from}, {sum(len(r['rounds']) for r in rows) // len(rows)} rounds a row.\n")
    else:
        started = time.time()
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as workdir:
            rows = [medians(row) for row in measure(args.scripts, args.processes, args.num_epochs, args.repeats,
                                                    workdir, f"{args.output}.json", args.train_samples, args.variants)]
        plot(rows, f"{args.output}.png")
        print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, {torch.__version__}, CPU only; "
              f"{time.strftime('%Y-%m-%d')}; {args.repeats} rounds; {time.time() - started:.0f} s.\n")
    print(tables(rows))
    print("\nTargets:\n" + targets(rows))


if __name__ == "__main__":
    main()
