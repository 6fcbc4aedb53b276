"""Training samples per second of each MNIST-family script, against the tutorial recipe and the ceilings.

    python benchmarks/throughput.py                       # prints markdown tables, writes throughput.png/.json
    python benchmarks/throughput.py --processes 1 2 --scripts cpu_gloo.py

For 1, 2 and 4 processes on this machine's CPU, in one run, on the same data: each script through
its real command line with the default in-memory pipeline and with --data_pipeline torchvision;
the tutorials' plain recipe (benchmarks/baselines.py); raw DDP on the in-memory path; and the
ceilings (compute only, and the Accelerate-prepared model on in-memory batches with no loader).
Every figure is the median over epochs 2..N of global training samples per second. Each process
gets cores / processes threads (at least 1), the same for every variant; "tutorial as written" is
the same recipe left at torch's default threads (every process one thread per core), as the
tutorials run it.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import baselines  # noqa: E402
from shared.data import write_mnist_layout  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# script -> (batch size, learning rate: the scripts' defaults; training samples for the benchmark)
SETTINGS = {"cpu_gloo.py": (64, 0.01, 24000), "seq_net.py": (100, 0.01, 24000), "mnist_conv.py": (64, 1.0, 6000)}


def write_data(root, num_train):
    """Random digits-shaped data in torchvision's layout: speed does not depend on what they show."""
    rng = np.random.default_rng(0)
    for name in ("MNIST", "FashionMNIST"):
        write_mnist_layout(root, name, rng.integers(0, 256, (num_train, 28, 28)), rng.integers(0, 10, num_train),
                           rng.integers(0, 256, (500, 28, 28)), rng.integers(0, 10, 500))


def threads_for(processes):
    return max(1, (os.cpu_count() or 1) // processes)


def script_rate(script, processes, data_dir, pipeline, num_epochs, workdir):
    """Run the script as a user would and read samples_per_sec back from its metrics.jsonl."""
    batch, lr, _ = SETTINGS[script]
    output_dir = Path(workdir) / f"{Path(script).stem}_{pipeline}_{processes}"
    args = [str(REPO / "scripts" / script), "--data_dir", str(data_dir), "--output_dir", str(output_dir),
            "--overwrite_output_dir", "--num_epochs", str(num_epochs), "--data_pipeline", pipeline]
    if script == "cpu_gloo.py":
        args += ["--log_interval", "1000000"]
    launcher = [sys.executable, str(REPO / "scripts" / "launch.py"), "--config_file",
                str(REPO / "accelerate_configs" / "cpu.yaml"), "--num_processes", str(processes)]
    command = ([sys.executable] if processes == 1 else launcher) + args
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_for(processes)), "TQDM_DISABLE": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["world_size"] == processes
    return statistics.median(r["samples_per_sec"] for r in records[1:])


def baseline_rate(baseline, script, processes, data_dir, num_epochs, default_threads=False):
    batch, lr, _ = SETTINGS[script]
    threads = None if default_threads else threads_for(processes)
    rates = baselines.spawn(baseline, processes, threads, script, str(data_dir), batch, num_epochs, lr)
    return statistics.median(rates[1:])


def measure(scripts, process_counts, num_epochs, workdir):
    rows = []
    for script in scripts:
        data_dir = Path(workdir) / f"data_{SETTINGS[script][2]}"
        if not data_dir.exists():
            write_data(data_dir, SETTINGS[script][2])
        compute = baseline_rate(baselines.compute_ceiling, script, 1, data_dir, num_epochs)
        for processes in process_counts:
            row = {
                "script": script, "processes": processes, "batch_size": SETTINGS[script][0],
                "default_memory": script_rate(script, processes, data_dir, "memory", num_epochs, workdir),
                "torchvision_pipeline": script_rate(script, processes, data_dir, "torchvision", num_epochs, workdir),
                "tutorial_recipe": baseline_rate(baselines.tutorial_recipe, script, processes, data_dir, num_epochs),
                "tutorial_as_written": baseline_rate(baselines.tutorial_recipe, script, processes, data_dir, num_epochs, default_threads=True),
                "raw_ddp_memory": baseline_rate(baselines.raw_ddp_memory, script, processes, data_dir, num_epochs),
                "step_ceiling": baseline_rate(baselines.accelerate_ceiling, script, processes, data_dir, num_epochs),
                "compute_ceiling_1proc": compute,
            }
            rows.append(row)
            print(f"measured {script} x{processes}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items() if isinstance(v, float)),
                  file=sys.stderr, flush=True)
    return rows


def tables(rows):
    lines = [
        "| script | processes | batch | default (memory) | torchvision pipeline | tutorial recipe | tutorial as written | raw DDP, memory | step ceiling | compute ceiling (1 proc) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['script']} | {r['processes']} | {r['batch_size']} | {r['default_memory']:,.0f} | {r['torchvision_pipeline']:,.0f} | "
                     f"{r['tutorial_recipe']:,.0f} | {r['tutorial_as_written']:,.0f} | {r['raw_ddp_memory']:,.0f} | {r['step_ceiling']:,.0f} | {r['compute_ceiling_1proc']:,.0f} |")
    lines += [
        "",
        "| script | processes | default / tutorial | default / tutorial as written | default / torchvision pipeline | default / step ceiling | default / compute ceiling | Accelerate / raw DDP (same data path) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["default_memory"]
        lines.append(f"| {r['script']} | {r['processes']} | {d / r['tutorial_recipe']:.2f}x | {d / r['tutorial_as_written']:.2f}x | {d / r['torchvision_pipeline']:.2f}x | "
                     f"{d / r['step_ceiling']:.2f} | {d / r['compute_ceiling_1proc']:.2f} | {d / r['raw_ddp_memory']:.3f} |")
    return "\n".join(lines)


def targets(rows):
    """The issue's targets, where this run measured what they need."""
    found = {(r["script"], r["processes"]): r for r in rows}
    checks = []
    if ("cpu_gloo.py", 2) in found:
        r = found["cpu_gloo.py", 2]
        checks.append(("cpu_gloo, 2 processes, batch 64: default >= 0.85 x step ceiling", r["default_memory"] / r["step_ceiling"], 0.85))
        checks.append(("cpu_gloo, 2 processes, batch 64: default >= 4 x tutorial recipe, same threads", r["default_memory"] / r["tutorial_recipe"], 4.0))
        checks.append(("cpu_gloo, 2 processes, batch 64: default >= 4 x tutorial recipe as written", r["default_memory"] / r["tutorial_as_written"], 4.0))
    if ("mnist_conv.py", 1) in found:
        r = found["mnist_conv.py", 1]
        checks.append(("mnist_conv, 1 process, batch 64: default >= 0.95 x compute ceiling", r["default_memory"] / r["compute_ceiling_1proc"], 0.95))
    for r in rows:
        if r["processes"] > 1:
            checks.append((f"{r['script']}, {r['processes']} processes: Accelerate >= 0.97 x raw DDP, same data path",
                           r["default_memory"] / r["raw_ddp_memory"], 0.97))
    return "\n".join(f"- {'PASS' if value >= bound else 'MISS'}: {name} (measured {value:.3f})" for name, value, bound in checks)


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
            axis.plot(processes, [r[key] for r in mine], marker="o", label=label)
        axis.set(title=script, xlabel="processes", ylabel="training samples/s", xticks=processes)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--num_epochs", type=int, default=3, help="epoch 1 is warm-up; the median of the rest is reported")
    parser.add_argument("--output", default="benchmarks/throughput", help="writes <output>.png and <output>.json")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(args.scripts, args.processes, args.num_epochs, workdir)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.output}.json").write_text(json.dumps(rows, indent=1))
    plot(rows, f"{args.output}.png")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, {torch.__version__}, CPU only; "
          f"{time.strftime('%Y-%m-%d')}; {time.time() - started:.0f} s.\n")
    print(tables(rows))
    print("\nTargets:\n" + targets(rows))


if __name__ == "__main__":
    main()
