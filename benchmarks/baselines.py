"""What the project's scripts are measured against, one function per baseline, each run as N processes
by `spawn` below (torch.multiprocessing, the way tutorials 000 and 004 start their processes).

- tutorial_recipe: the tutorials' plain recipe: raw torch.distributed (gloo) + DDP + DistributedSampler
  + a DataLoader that sends every sample through torchvision's ToTensor and Normalize.
- raw_ddp_memory: raw torch.distributed + DDP on the project's in-memory data path (no Accelerate),
  to measure what Accelerate itself costs; on one process the bare model, as Accelerate runs it.
- accelerate_ceiling: the Accelerate-prepared model stepping on batches already in memory, with no
  loader and no bookkeeping: the step rate that the model and DDP's own communication allow (on one
  process Accelerate uses no DDP, so neither does this). On the CPU, or with a GpuSetting on the
  device Accelerate picks (the GPU where there is one; benchmarks/gpu_throughput.py).
- compute_ceiling: one process, no DDP, the model stepping on one fixed batch: compute only.

Each returns the global training samples per second of every epoch (rank 0's clock, after a barrier).
"""

import functools
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

REPO = Path(__file__).resolve().parents[1]
# The Python of the processes a benchmark starts. PYTHON_EXEC is torchrun's name for the Python of the
# processes it starts; the benchmarks honor it too, so that the tests can hand all of them their fork
# client (tests/fork_client.py). startup.py, which measures new interpreters, always uses sys.executable.
PYTHON = os.environ.get("PYTHON_EXEC", sys.executable)
from shared.in_memory_loader import InMemoryLoader  # noqa: E402
from shared.mnist_data import PIXEL_STATS, as_tensors  # noqa: E402

# The optimizer each script builds in its main() (tests/test_benchmarks.py checks that they agree).
OPTIMIZERS = {"seq_net.py": torch.optim.Adam, "mnist_conv.py": torch.optim.Adadelta, "cpu_gloo.py": torch.optim.SGD}


@functools.cache
def script_module(script):
    """The training script as a module (its __main__ block does not run): the recipe every baseline
    follows, so they train the script's own model with its optimizer, loss and data set."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / "scripts" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks the model's module up by name
    spec.loader.exec_module(module)
    return module


def script_defaults(script):
    """The script's default flags: batch size, learning rate and the rest."""
    return script_module(script).parse_args([])


def make_model(script):
    """A new instance of the model class the script defines."""
    module = script_module(script)
    (model_class,) = [value for value in vars(module).values()
                      if isinstance(value, type) and issubclass(value, torch.nn.Module) and value.__module__ == module.__name__]
    return model_class()


def make_optimizer(script, model, lr):
    return OPTIMIZERS[script](model.parameters(), lr=lr)


def load_data_set(script, data_dir, train=True):
    """The script's training (or test) set, each sample through the tutorials' per-sample transforms;
    and the (mean, std) they normalize with, or None."""
    module = script_module(script)
    stats = PIXEL_STATS[module.DATA_SET] if getattr(module, "NORMALIZE", True) else None
    steps = [transforms.ToTensor()] + ([transforms.Normalize((stats[0],), (stats[1],))] if stats else [])
    data_set = getattr(datasets, module.DATA_SET)(data_dir, train=train, transform=transforms.Compose(steps))
    return data_set, stats


def epoch_rates(run_epoch, num_epochs, samples_per_epoch):
    rates = []
    for epoch in range(1, num_epochs + 1):
        finish_queued_work()
        started = time.perf_counter()
        run_epoch(epoch)
        finish_queued_work()
        rates.append(samples_per_epoch / (time.perf_counter() - started))
    return rates


def finish_queued_work():
    """Wait for every process and for the GPU's queue, so that a clock reading covers the work."""
    if dist.is_initialized():
        dist.barrier()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step(model, optimizer, loss_fn, inputs, labels):
    optimizer.zero_grad()
    loss_fn(model(inputs), labels).backward()
    optimizer.step()


def tutorial_setup(rank, world_size, script, data_dir, batch_size, lr):
    """The tutorials' recipe, ready to train: the DDP model and a function that trains one epoch on
    this rank's DistributedSampler shard, each sample through ToTensor and Normalize; and the number
    of samples an epoch trains across all ranks."""
    train_set, _ = load_data_set(script, data_dir)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    model = DDP(make_model(script))
    optimizer, loss_fn = make_optimizer(script, model, lr), script_module(script).loss_function

    def run_epoch(epoch):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            step(model, optimizer, loss_fn, images, labels)

    return model, run_epoch, len(sampler) * world_size


def tutorial_recipe(rank, world_size, script, data_dir, batch_size, num_epochs, lr):
    _, run_epoch, samples_per_epoch = tutorial_setup(rank, world_size, script, data_dir, batch_size, lr)
    return epoch_rates(run_epoch, num_epochs, samples_per_epoch)


def tutorial_recipe_to_target(rank, world_size, script, data_dir, batch_size, lr, target, max_epochs):
    """The tutorials' recipe, evaluated on the whole test set after every epoch (by rank 0, the others
    waiting), until the accuracy reaches `target` or max_epochs have run. Returns, on rank 0, each
    epoch's (epoch, eval accuracy, time.time() when it was known)."""
    model, run_epoch, _ = tutorial_setup(rank, world_size, script, data_dir, batch_size, lr)
    test_set, _ = load_data_set(script, data_dir, train=False)
    reports = []
    for epoch in range(1, max_epochs + 1):
        run_epoch(epoch)
        reached = torch.zeros(1)
        if rank == 0:
            accuracy = test_accuracy(model.module, test_set)
            reports.append((epoch, accuracy, time.time()))
            reached.fill_(accuracy >= target)
        dist.broadcast(reached, src=0)  # every rank stops together
        if reached.item():
            break
    return reports


@torch.no_grad()
def test_accuracy(model, test_set):
    model.eval()
    correct = sum(int((model(images).argmax(1) == labels).sum()) for images, labels in DataLoader(test_set, batch_size=1000))
    model.train()
    return correct / len(test_set)


class Ranks:
    """What InMemoryLoader reads from an Accelerator, taken from torch.distributed instead."""

    def __init__(self, rank, world_size):
        self.process_index, self.num_processes = rank, world_size
        self.device = torch.device("cpu")


def raw_ddp_memory(rank, world_size, script, data_dir, batch_size, num_epochs, lr):
    train_set, stats = load_data_set(script, data_dir)
    loader = InMemoryLoader(as_tensors(train_set, stats), batch_size, Ranks(rank, world_size), seed=0)
    model = DDP(make_model(script)) if world_size > 1 else make_model(script)
    optimizer, loss_fn = make_optimizer(script, model, lr), script_module(script).loss_function

    def run_epoch(epoch):
        loader.set_epoch(epoch)
        for batch_inputs, batch_labels in loader:
            step(model, optimizer, loss_fn, batch_inputs, batch_labels)

    return epoch_rates(run_epoch, num_epochs, len(loader) * batch_size * world_size)


@dataclass(frozen=True)
class GpuSetting:
    """How mnist_conv trains in benchmarks/gpu_throughput.py: its --mixed_precision and --channels_last,
    and torch.compile at launch."""

    mixed_precision: str = "no"
    channels_last: bool = False
    compile: bool = False


def accelerate_ceiling(rank, world_size, script, data_dir, batch_size, num_epochs, lr, gpu_setting=None):
    from accelerate import Accelerator

    if gpu_setting is None:
        accelerator = Accelerator(cpu=True)  # joins the group that spawn's environment describes
    else:
        accelerator = Accelerator(mixed_precision=gpu_setting.mixed_precision,
                                  dynamo_backend="inductor" if gpu_setting.compile else "no")
    assert accelerator.num_processes == world_size, "every spawned process joined one group"
    train_set, stats = load_data_set(script, data_dir)
    inputs, labels = (tensor.to(accelerator.device) for tensor in as_tensors(train_set, stats).tensors)
    steps = len(labels) // (batch_size * world_size)
    batches = [(inputs[i * batch_size:(i + 1) * batch_size], labels[i * batch_size:(i + 1) * batch_size]) for i in range(steps)]
    model = make_model(script)
    if gpu_setting and gpu_setting.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(script, model, lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss_fn = script_module(script).loss_function

    def run_epoch(epoch):
        for batch_inputs, batch_labels in batches:
            optimizer.zero_grad()
            accelerator.backward(loss_fn(model(batch_inputs), batch_labels))
            optimizer.step()

    return epoch_rates(run_epoch, num_epochs, steps * batch_size * world_size)


def compute_ceiling(rank, world_size, script, data_dir, batch_size, num_epochs, lr):
    train_set, stats = load_data_set(script, data_dir)
    inputs, labels = (tensor[:batch_size] for tensor in as_tensors(train_set, stats).tensors)
    model = make_model(script)
    optimizer, loss_fn = make_optimizer(script, model, lr), script_module(script).loss_function
    steps = len(train_set) // batch_size

    def run_epoch(epoch):
        for _ in range(steps):
            step(model, optimizer, loss_fn, inputs, labels)

    return epoch_rates(run_epoch, num_epochs, steps * batch_size)


def _worker(rank, world_size, port, threads, own_session, baseline, args, results):
    if own_session:
        os.setsid()
    # One process runs without a process group, as `python scripts/x.py` does (Accelerate then does
    # not wrap the model in DDP); only the tutorial's recipe wraps even one process in DDP.
    distributed = world_size > 1 or baseline in (tutorial_recipe, tutorial_recipe_to_target)
    if distributed:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if threads:  # None: torch's default, one thread per core in every process, as the tutorials run
        os.environ["OMP_NUM_THREADS"] = str(threads)  # else accelerate would pick its own
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    if distributed and baseline in (tutorial_recipe, tutorial_recipe_to_target, raw_ddp_memory):  # Accelerate starts its own
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rates = baseline(rank, world_size, *args)
    if rank == 0:
        results.put(rates)
    if dist.is_initialized():
        dist.destroy_process_group()


def read_saved_output(path, read):
    """read() of the JSON a benchmark's --output wrote at path (a benchmark's --tables_from), or one sentence
    where the file is missing or not that benchmark's (read() raises on what it does not expect)."""
    try:
        return read(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        sys.exit(f"error: {path} could not be read as this benchmark's output ({error!r}): pass one it wrote.")


def spread(values, digits):
    """The median of the values and their range, "m (low-high)"; "not reached" where any is None."""
    if any(value is None for value in values):
        return "not reached"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def measured_with():
    """What a result was measured with, saved beside it: the commit (and whether the checkout had changes), the
    versions that set the speed, the machine's cores and the date."""
    import accelerate

    def git(*args):
        result = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    return {"commit": commit and commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else ""),
            "torch": torch.__version__, "accelerate": accelerate.__version__, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def rotated(names, turn):
    """names, starting at position turn (mod len): each variant takes its turn at running first."""
    start = turn % len(names)
    return names[start:] + names[:start]


def threads_for(processes):
    """The threads each of `processes` processes gets: this machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // processes)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(baseline, world_size, threads, *args, own_sessions=False):
    """Run `baseline` as world_size processes of `threads` threads each (None: torch's default);
    rank 0's samples per second of every epoch (whatever rank 0's `baseline` returns).

    own_sessions: every process in a session of its own, as torchrun (and so `accelerate launch`)
    starts the scripts' processes; the default shares this one, as torch.multiprocessing does. Where
    Linux schedules each session as a group (autogroup), that alone changes a run's speed on a small
    machine (benchmarks/README.md, findings)."""
    context = mp.get_context("spawn")
    context.set_executable(PYTHON)
    results = context.SimpleQueue()
    mp.start_processes(_worker, args=(world_size, free_port(), threads, own_sessions, baseline, args, results),
                       nprocs=world_size, start_method="spawn")
    return results.get()
