"""What the scripts' safety features cost per optimizer step: the fixed gradient layout that makes a
resume bitwise (DDP with find_unused_parameters=True, on in every run of 3+ processes) and the check for
a signal to save and stop (one all-reduce of one number, accelerate's check_trigger).

    python benchmarks/step_cost.py                       # 2 and 4 processes, cpu_gloo.py's net
    python benchmarks/step_cost.py --processes 2 --blocks 40 --script mnist_conv.py

On cpu_gloo.py's linear net any per-step cost shows most: its step is mostly gloo's all-reduce.
In each process the loops take turns, in blocks of --steps steps whose order rotates, on batches of
random digits already in memory (the script's share per process of its default batch); a figure is
rank 0's wall-clock time per step, the median over blocks, and a cost the median over blocks of the
difference to the plain DDP step of the same turn:
- DDP step: the script's model in DDP (default buckets), its loss and optimizer, forward, backward, step;
- + fixed gradient layout: the same on DDP(find_unused_parameters=True);
- + stop check every step: the DDP step and accelerator.check_trigger() after it;
- + stop check every 10 steps: as the scripts check (preemption.Preemption.CHECK_EVERY).
Then what a checkpoint's integrity costs per GB: writing a file of --digest_mb MB of weights with
safetensors, and its SHA-256 as shared/checkpoints.py takes it, right after the write (the
page cache still holds it) and read from the disk again.
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
from shared.preemption import Preemption  # noqa: E402

LOOPS = ("DDP step", "+ fixed gradient layout", "+ stop check every step", f"+ stop check every {Preemption.CHECK_EVERY} steps")


def step_costs(rank, world_size, script, steps, blocks, batch_size):
    """Rank 0's seconds per step of every loop, one list per loop with one figure per block."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # joins the group that spawn's environment describes
    assert accelerator.num_processes == world_size, "every spawned process joined one group"
    torch.manual_seed(0)
    inputs, labels = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    loss_function = baselines.script_module(script).loss_function
    models = {}
    for find_unused in (False, True):
        torch.manual_seed(0)
        model = DDP(baselines.make_model(script), find_unused_parameters=find_unused)
        models[find_unused] = (model, baselines.make_optimizer(script, model, 0.01))

    def loop(find_unused, check_every):
        model, optimizer = models[find_unused]
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            loss_function(model(inputs), labels).backward()
            optimizer.step()
            if check_every and step % check_every == 0:
                accelerator.check_trigger()

    loops = dict(zip(LOOPS, [(False, 0), (True, 0), (False, 1), (False, Preemption.CHECK_EVERY)]))
    for settings in loops.values():  # warm-up: the first steps allocate and DDP builds its buckets
        loop(*settings)
    seconds = {name: [] for name in loops}
    for block in range(blocks):
        for name in baselines.rotated(list(loops), block):
            accelerator.wait_for_everyone()
            started = time.perf_counter()
            loop(*loops[name])
            accelerator.wait_for_everyone()
            seconds[name].append((time.perf_counter() - started) / steps)
    return seconds


def digest_cost(size_mb, repeats=3):
    """Seconds per GB to write a file of size_mb MB of float32 weights, and to hash it with the page cache
    warm and dropped (dropping needs root; None without): medians over repeats."""
    from safetensors.torch import save_file

    from shared.intact_checkpoints import sha256

    weights = {"weights": torch.randn(size_mb * 2**20 // 4)}
    timings = {"write": [], "SHA-256, warm": [], "SHA-256, from disk": []}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        for _ in range(repeats):
            started = time.perf_counter()
            save_file(weights, path)
            os.sync()
            timings["write"].append(time.perf_counter() - started)
            started = time.perf_counter()
            sha256(path)
            timings["SHA-256, warm"].append(time.perf_counter() - started)
            try:
                Path("/proc/sys/vm/drop_caches").write_text("1")
            except OSError:
                continue
            started = time.perf_counter()
            sha256(path)
            timings["SHA-256, from disk"].append(time.perf_counter() - started)
    gigabytes = size_mb / 1024
    return {name: statistics.median(values) / gigabytes if values else None for name, values in timings.items()}, gigabytes


def table(results):
    lines = ["| processes | " + " | ".join(f"{name}: us per step" for name in LOOPS) + " |", "|---" * (1 + len(LOOPS)) + "|"]
    for processes, seconds in results.items():
        base = seconds[LOOPS[0]]
        cells = [f"{statistics.median(base) * 1e6:.0f}"]
        for name in LOOPS[1:]:
            extra = sorted((other - plain) * 1e6 for other, plain in zip(seconds[name], base))
            cells.append(f"{statistics.median(seconds[name]) * 1e6:.0f} ({statistics.median(extra):+.0f}; "
                         f"middle half {extra[len(extra) // 4]:+.0f} to {extra[3 * len(extra) // 4]:+.0f})")
        lines.append(f"| {processes} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--script", default="cpu_gloo.py", choices=["cpu_gloo.py", "seq_net.py", "mnist_conv.py"])
    parser.add_argument("--steps", type=int, default=100, help="steps in one block of one loop")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of every loop, in rotating order")
    parser.add_argument("--digest_mb", type=int, default=1024, help="size of the file the write and SHA-256 figures time")
    args = parser.parse_args()
    batch_size = baselines.script_defaults(args.script).batch_size
    results = {}
    for processes in args.processes:
        threads = baselines.threads_for(processes)
        results[processes] = baselines.spawn(step_costs, processes, threads, args.script, args.steps, args.blocks,
                                             batch_size // processes, own_sessions=True)
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU only; "
          f"{time.strftime('%Y-%m-%d')}; {args.script}'s net, batch {batch_size} split across the processes; "
          f"{args.blocks} blocks of {args.steps} steps.\n")
    print(table(results))
    per_gb, size_gb = digest_cost(args.digest_mb)
    print(f"\nA checkpoint's integrity, per GB (a {size_gb:.2f} GB file in the temporary folder's file system, medians of 3):\n")
    print("| " + " | ".join(f"{name}: s per GB" for name in per_gb) + " |\n" + "|---" * len(per_gb) + "|")
    print("| " + " | ".join("-" if value is None else f"{value:.2f}" for value in per_gb.values()) + " |")


if __name__ == "__main__":
    main()
