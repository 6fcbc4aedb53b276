"""Microseconds per training step of cpu_gloo's linear net (batch 64, the in-memory data path), from
a plain PyTorch loop up to the scripts' own loop, for 1 and 2 processes:

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --processes 2 --blocks 60

The loops take turns inside the same processes, in blocks of --steps steps, so that a shared
machine's drift falls on all of them alike; each figure is the median over blocks, and the ratio is
the median of plain / loop within a block. "plain" is the plain PyTorch way: the bare model on one
process, DDP on several. It shows what Accelerate's wrappers cost as shipped, with the two per-step
look-ups that shared/runtime.py answers once, then what each further call of the scripts' loop adds:
accelerator.accumulate around the step, and the epoch's loss sum (the scripts' loop itself).

Beside wall-clock time it reports rank 0's CPU time per step (all its threads, gloo's included):
the work a loop costs without the time it waits for the other ranks. With one process and 2
threads it exceeds the wall clock: torch's second thread spins while it waits for work.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import accelerate.optimizer
import torch
import torch.nn.functional as F

SHIPPED = {"is_lomo_available": accelerate.optimizer.is_lomo_available, "inspect": accelerate.optimizer.inspect}
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import baselines  # noqa: E402
from shared import metrics, runtime  # noqa: E402, F401  (importing shared.runtime installs its answers)
from shared.data import InMemoryLoader  # noqa: E402

TRIMMED = {name: getattr(accelerate.optimizer, name) for name in SHIPPED}
BATCH_SIZE = 64
LOOPS = ("plain PyTorch", "Accelerate as shipped", "Accelerate + shared/runtime.py", "+ accelerator.accumulate", "the scripts' loop")


def use(answers):
    for name, value in answers.items():
        setattr(accelerate.optimizer, name, value)


def measure(rank, world_size, blocks, steps):
    """Rank 0's wall-clock and CPU microseconds per step of every loop in every block (runs in each
    spawned process)."""
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel as DDP

    accelerator = Accelerator(cpu=True)  # joins the group that spawn's environment describes
    assert accelerator.num_processes == world_size, "every spawned process joined one group"
    inputs = torch.randn(BATCH_SIZE * world_size * steps, 1, 28, 28)
    labels = torch.randint(0, 10, (len(inputs),))
    loader = InMemoryLoader(inputs, labels, BATCH_SIZE, accelerator, seed=0)

    plain_model = baselines.make_model("cpu_gloo.py")
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    if world_size > 1:
        plain_model = DDP(plain_model)
    model = baselines.make_model("cpu_gloo.py")
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))

    def plain():
        for x, y in loader:
            baselines.step(plain_model, plain_optimizer, F.cross_entropy, x, y)

    def prepared():
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()

    def accumulated():
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()

    def scripts_loop():
        stats = metrics.EpochStats(accelerator)
        for x, y in loader:
            baselines.scripts_step(accelerator, model, optimizer, F.cross_entropy, x, y, stats)

    runs = dict(zip(LOOPS, [(plain, TRIMMED), (prepared, SHIPPED), (prepared, TRIMMED), (accumulated, TRIMMED), (scripts_loop, TRIMMED)]))
    results = []
    for block in range(blocks + 1):  # block 0 warms up
        order = baselines.rotated(LOOPS, block)
        timings = {}
        for name in order:
            loop, answers = runs[name]
            use(answers)
            accelerator.wait_for_everyone()
            started, cpu_started = time.perf_counter(), time.process_time()
            loop()
            timings[name] = ((time.perf_counter() - started) / len(loader) * 1e6,
                             (time.process_time() - cpu_started) / len(loader) * 1e6)
        if block:
            results.append(timings)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=50, help="steps per loop per block")
    args = parser.parse_args()
    print("| processes | loop | us per step (median) | plain / loop (median, middle half of blocks) "
          "| CPU us per step (median) | plain / loop in CPU time |\n|---|---|---|---|---|---|")
    for processes in args.processes:
        threads = baselines.threads_for(processes)
        blocks = baselines.spawn(measure, processes, threads, args.blocks, args.steps)
        for name in LOOPS:
            columns = []
            for clock in (0, 1):  # wall clock, then CPU time
                ratios = sorted(block[LOOPS[0]][clock] / block[name][clock] for block in blocks)
                quarter = len(ratios) // 4
                columns += [f"{statistics.median(block[name][clock] for block in blocks):.0f}",
                            f"{statistics.median(ratios):.3f} ({ratios[quarter]:.3f}-{ratios[-1 - quarter]:.3f})"]
            print(f"| {processes} | {name} | {' | '.join(columns)} |")


if __name__ == "__main__":
    main()
