"""From raw DDP to the script under `accelerate launch`, one layer at a time, each rung run as whole
processes: where a gap between cpu_gloo.py and raw DDP comes from, if it is anywhere.

    python benchmarks/accelerate_ladder.py                  # cpu_gloo.py, 2 processes, 20 rounds
    python benchmarks/accelerate_ladder.py --processes 4 --rounds 10

The rungs, each adding one thing to the one before, on the same in-memory data (InMemoryLoader):
1. raw DDP: torch.distributed's gloo group, DDP, the plain step (benchmarks/baselines.py);
2. + the scripts' imports: accelerate, datasets, tqdm and shared/ loaded in the process, unused;
3. + Accelerate's process group: Accelerator(cpu=True) starts the group, the model still in plain DDP;
4. + prepare: accelerator.prepare(model, optimizer) and the scripts' step (accumulate, backward,
   the epoch's loss sum), with shared/runtime.py's cached answers as in the scripts;
5. the script's main(): everything the script does (evaluation, metrics.jsonl, the progress bar);
6. accelerate launch: the same script started by the launcher, as a user runs it.
Rungs 1-5 run in spawned processes, each in a session of its own as torchrun starts them
(benchmarks/launch_layout.py); the rounds rotate their order. A figure is a run's fastest epoch of
2..N in global training samples/s (rungs 1-4 time each epoch between barriers, rungs 5-6 report the
script's own samples_per_sec from metrics.jsonl), then the median over rounds; a ratio is the median
of the ratios within a round, with the middle half of rounds in brackets.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
import launch_layout  # noqa: E402
import throughput  # noqa: E402
from shared.data import InMemoryLoader, as_tensors  # noqa: E402  (baselines put the repository on sys.path)

RUNGS = ("raw DDP", "+ the scripts' imports", "+ Accelerate's process group", "+ prepare and the scripts' step",
         "the script's main()", "accelerate launch")


def layered_ddp(rank, world_size, script, data_dir, batch_size, num_epochs, lr, rung):
    """Rungs 2-4 in one spawned process: raw DDP with the first `rung` layers of Accelerate added
    (rungs 2 and 3 run benchmarks/baselines.py's raw DDP itself, on the group they started)."""
    import accelerate
    import datasets  # noqa: F401
    import tqdm  # noqa: F401
    from shared import checkpoints, cli, data, metrics, outputs, runtime  # noqa: F401  (runtime: the cached answers)

    if rung >= RUNGS.index("+ Accelerate's process group"):
        accelerator = accelerate.Accelerator(cpu=True)  # joins the group that spawn's environment describes
        assert accelerator.num_processes == world_size, "every spawned process joined one group"
    else:
        dist.init_process_group("gloo")
    if rung < RUNGS.index("+ prepare and the scripts' step"):
        return baselines.raw_ddp_memory(rank, world_size, script, data_dir, batch_size, num_epochs, lr)  # on that group
    train_set, stats = baselines.load_data_set(script, data_dir)
    inputs, labels = as_tensors(train_set, stats, torch.device("cpu"))
    loader = InMemoryLoader(inputs, labels, batch_size, accelerator, seed=0)
    model = baselines.make_model(script)
    optimizer, loss_fn = baselines.RECIPES[script][3](model.parameters(), lr=lr), baselines.RECIPES[script][4]
    model, optimizer = accelerator.prepare(model, optimizer)

    def run_epoch(epoch):
        loader.set_epoch(epoch)
        epoch_stats = metrics.EpochStats(accelerator)
        for batch_inputs, batch_labels in loader:
            baselines.scripts_step(accelerator, model, optimizer, loss_fn, batch_inputs, batch_labels, epoch_stats)

    return baselines.epoch_rates(run_epoch, num_epochs, len(loader) * batch_size * world_size)


def rungs(script, processes, data_dir, num_epochs, workdir):
    """Rung name -> a function giving its samples/s."""
    threads = baselines.threads_for(processes)
    batch, lr, _ = throughput.SETTINGS[script]
    argv = throughput.script_args(script, data_dir, "memory", num_epochs, Path(workdir) / "spawned")

    def spawned(function, *args):
        return lambda: max(baselines.spawn(function, processes, threads, *args, own_sessions=True)[1:])

    layered = [spawned(layered_ddp, script, str(data_dir), batch, num_epochs, lr, rung) for rung in range(1, 4)]
    functions = [lambda: throughput.baseline_rate(baselines.raw_ddp_memory, script, processes, data_dir, num_epochs, as_torchrun=True),
                 *layered, spawned(launch_layout.script_main, argv),
                 lambda: throughput.script_rate(script, processes, data_dir, "memory", num_epochs, workdir)]
    return dict(zip(RUNGS, functions))


def table(row):
    lines = ["| rung | samples/s (median) | / raw DDP | / the rung before |", "|---|---|---|---|"]
    for index, name in enumerate(RUNGS):
        cells = [f"{statistics.median(r[name] for r in row['rounds']):,.0f}"]
        for base in (RUNGS[0], RUNGS[max(index - 1, 0)]):
            ratios = sorted(r[name] / r[base] for r in row["rounds"])
            quarter = len(ratios) // 4
            cells.append(f"{statistics.median(ratios):.2f} ({ratios[quarter]:.2f}-{ratios[-1 - quarter]:.2f})")
        lines.append(f"| {index + 1}. {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="cpu_gloo.py", choices=list(throughput.SETTINGS))
    parser.add_argument("--processes", type=int, default=2, help="2 or more: one process has no group to start")
    parser.add_argument("--num_epochs", type=int, default=4, help="epoch 1 is warm-up; the fastest of the rest is reported")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--train_samples", type=int, help="default: as benchmarks/throughput.py")
    parser.add_argument("--output", default="benchmarks/accelerate_ladder.json", help="every round's figures, written after each round")
    args = parser.parse_args()
    if args.processes < 2:
        parser.error("--processes must be 2 or more")
    started = time.time()
    row = {"script": args.script, "processes": args.processes, "rounds": []}
    with tempfile.TemporaryDirectory() as workdir:
        data_dir = Path(workdir) / "data"
        throughput.write_data(data_dir, args.train_samples or throughput.SETTINGS[args.script][2])
        runs = rungs(args.script, args.processes, data_dir, args.num_epochs, workdir)
        for round_index in range(args.rounds):
            measured = {name: runs[name]() for name in baselines.rotated(list(RUNGS), round_index)}
            row["rounds"].append({name: measured[name] for name in RUNGS})
            Path(args.output).write_text(json.dumps(row, indent=1))
            print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(f"{name} {measured[name]:,.0f}" for name in RUNGS),
                  file=sys.stderr, flush=True)
    print(f"{args.script}, {args.processes} processes. Machine: {platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, CPU only; {time.strftime('%Y-%m-%d')}; {args.rounds} rounds; {time.time() - started:.0f} s.\n")
    print(table(row))


if __name__ == "__main__":
    main()
