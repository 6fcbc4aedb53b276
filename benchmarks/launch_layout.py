"""Does it matter how the processes are started? A script as `accelerate launch` runs it, against the
same script and raw DDP in processes started by torch.multiprocessing, sharing one session or each in
a session of its own:

    python benchmarks/launch_layout.py                      # cpu_gloo.py at 2 and 4 processes, 5 rounds
    python benchmarks/launch_layout.py --processes 4 --rounds 3

`accelerate launch` starts processes through torchrun, which puts every worker in a session of its
own; torch.multiprocessing (the tutorials, and this project's baselines by default) keeps them in
the caller's. Where Linux schedules each session as a group of its own (autogroup,
/proc/sys/kernel/sched_autogroup_enabled), that changes how processes that outnumber the cores take
turns. The variants, in rounds that rotate their order, on the same in-memory data:
- accelerate launch: the script's command line, as in benchmarks/throughput.py;
- script, one session / own sessions: the script's main() in spawned processes;
- raw DDP, one session / own sessions: benchmarks/baselines.py's raw_ddp_memory.
A figure is a run's fastest epoch of 2..N in global training samples/s, then the median over rounds;
a ratio is the median of the ratios within a round, with the lowest and highest round.
"""

import argparse
import contextlib
import json
import os
import platform
import runpy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
import throughput  # noqa: E402

VARIANTS = ("accelerate launch", "script, one session", "script, own sessions", "raw DDP, one session", "raw DDP, own sessions")
RATIOS = {  # heading -> (numerator, denominator)
    "script: own sessions / one session": ("script, own sessions", "script, one session"),
    "raw DDP: own sessions / one session": ("raw DDP, own sessions", "raw DDP, one session"),
    "accelerate launch / script in own sessions": ("accelerate launch", "script, own sessions"),
    "Accelerate / raw DDP, both one session": ("script, one session", "raw DDP, one session"),
    "Accelerate / raw DDP, both own sessions (throughput.py's ratio)": ("accelerate launch", "raw DDP, own sessions"),
}


def script_main(rank, world_size, argv):
    """The script's own main() in this spawned process; Accelerate joins the group that spawn's
    environment describes. Rank 0 returns the samples/s of every epoch from metrics.jsonl."""
    sys.argv = argv
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        runpy.run_path(argv[0], run_name="__main__")  # a failure still reaches spawn as an exception
    records = throughput.read_metrics(argv[argv.index("--output_dir") + 1])
    assert records[-1]["world_size"] == world_size
    return [record["samples_per_sec"] for record in records]


def variants(script, processes, data_dir, num_epochs, workdir):
    """Variant name -> a function giving its samples/s."""
    threads = baselines.threads_for(processes)

    def spawned_script(own_sessions):
        argv = throughput.script_args(script, data_dir, "memory", num_epochs, Path(workdir) / "spawned")
        return lambda: max(baselines.spawn(script_main, processes, threads, argv, own_sessions=own_sessions)[1:])

    def raw_ddp(as_torchrun):
        return lambda: throughput.baseline_rate(baselines.raw_ddp_memory, script, processes, data_dir, num_epochs, as_torchrun=as_torchrun)

    functions = (lambda: throughput.script_rate(script, processes, data_dir, "memory", num_epochs, workdir),
                 spawned_script(False), spawned_script(True), raw_ddp(False), raw_ddp(True))
    return dict(zip(VARIANTS, functions))


def tables(rows):
    lines = ["| script | processes | " + " | ".join(VARIANTS) + " |", "|---" * (2 + len(VARIANTS)) + "|"]
    for row in map(throughput.medians, rows):
        lines.append(f"| {row['script']} | {row['processes']} | " + " | ".join(f"{row[name]:,.0f}" for name in VARIANTS) + " |")
    lines += ["", "| script | processes | " + " | ".join(RATIOS) + " |", "|---" * (2 + len(RATIOS)) + "|"]
    for row in rows:
        cells = ["{:.2f} ({:.2f}-{:.2f})".format(*throughput.ratio(row, *pair)) for pair in RATIOS.values()]
        lines.append(f"| {row['script']} | {row['processes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def autogroup():
    path = Path("/proc/sys/kernel/sched_autogroup_enabled")
    return {"1": "on", "0": "off"}.get(path.read_text().strip(), "unknown") if path.exists() else "not on this system"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="cpu_gloo.py", choices=list(throughput.SETTINGS))
    parser.add_argument("--processes", nargs="+", type=int, default=[2, 4], help="2 or more: one process has no group to start")
    parser.add_argument("--num_epochs", type=int, default=4, help="epoch 1 is warm-up; the fastest of the rest is reported")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train_samples", type=int, help="default: as benchmarks/throughput.py")
    parser.add_argument("--output", default="benchmarks/launch_layout.json", help="every round's figures, written after each row")
    args = parser.parse_args()
    if min(args.processes) < 2:
        parser.error("--processes: every count must be 2 or more")
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        data_dir = Path(workdir) / "data"
        throughput.write_data(data_dir, args.train_samples or throughput.SETTINGS[args.script][2])
        for processes in args.processes:
            runs = variants(args.script, processes, data_dir, args.num_epochs, workdir)
            rounds = []
            for round_index in range(args.rounds):
                rounds.append({name: runs[name]() for name in baselines.rotated(list(VARIANTS), round_index)})
                print(f"measured x{processes}, round {round_index + 1}/{args.rounds}: "
                      + ", ".join(f"{name} {rounds[-1][name]:,.0f}" for name in VARIANTS), file=sys.stderr, flush=True)
            rows.append({"script": args.script, "processes": processes, "rounds": rounds})
            Path(args.output).write_text(json.dumps(rows, indent=1))
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU only, autogroup "
          f"scheduling {autogroup()}; {time.strftime('%Y-%m-%d')}; {args.rounds} rounds; {time.time() - started:.0f} s.\n")
    print(tables(rows))


if __name__ == "__main__":
    main()
