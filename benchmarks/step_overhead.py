"""Microseconds per training step of the linear net (batch 64, 500 in-memory batches, one process,
2 threads), from a plain PyTorch loop up to the scripts' own loop, one layer at a time:

    python benchmarks/step_overhead.py

It shows what accelerate's prepared optimizer costs with and without the cached package check in
shared/runtime.py (accelerate asks importlib whether lomo_optim is installed at every step).
"""

import sys
import time
from pathlib import Path

import accelerate.optimizer
import torch
import torch.nn.functional as F
from accelerate import Accelerator

uncached_check = accelerate.optimizer.is_lomo_available
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared import metrics, runtime  # noqa: E402, F401  (importing shared.runtime caches the check)

torch.set_num_threads(2)
torch.manual_seed(0)
INPUTS, LABELS = torch.randn(500 * 64, 1, 28, 28), torch.randint(0, 10, (500 * 64,))
BATCHES = list(zip(INPUTS.split(64), LABELS.split(64)))


def net():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))


def per_step_us(loop, repeats=5):
    loop()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        loop()
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2] / len(BATCHES) * 1e6


def main():
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def plain():
        for x, y in BATCHES:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    accelerator = Accelerator(cpu=True)
    prepared_model = net()
    prepared_model, prepared_optimizer = accelerator.prepare(prepared_model, torch.optim.SGD(prepared_model.parameters(), lr=0.01))

    def prepared():
        for x, y in BATCHES:
            prepared_optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(prepared_model(x), y))
            prepared_optimizer.step()

    def scripts_loop():
        stats = metrics.EpochStats(accelerator)
        for x, y in BATCHES:
            with accelerator.accumulate(prepared_model):
                loss = F.cross_entropy(prepared_model(x), y)
                accelerator.backward(loss)
                prepared_optimizer.step()
                prepared_optimizer.zero_grad()
            stats.add(loss, len(y))

    cached_check = accelerate.optimizer.is_lomo_available
    assert cached_check is not uncached_check, "shared.runtime caches the check"
    print("| loop | us per step |\n|---|---|")
    print(f"| plain PyTorch loop | {per_step_us(plain):.0f} |")
    accelerate.optimizer.is_lomo_available = uncached_check
    print(f"| Accelerate, package check as shipped | {per_step_us(prepared):.0f} |")
    accelerate.optimizer.is_lomo_available = cached_check
    print(f"| Accelerate, package check cached (shared/runtime.py) | {per_step_us(prepared):.0f} |")
    print(f"| the scripts' loop: + accumulate and epoch sums | {per_step_us(scripts_loop):.0f} |")

if __name__ == "__main__":
    main()
