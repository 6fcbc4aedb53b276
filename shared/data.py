"""MNIST-family data: downloaded once per machine, read from torchvision's folder layout.

torchvision is imported only where it is used (its import costs about 0.5 s of CPU per process on
top of torch's): --help, toy_mlp.py and the launcher's flag check never load it.
"""

import math
from pathlib import Path

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from torch.utils.data import DataLoader, TensorDataset

from shared import runtime
from shared.runtime import UserError, first_line

# torchvision keeps each data set under <data_dir>/<name>/raw/ with these four files.
RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# Mean and standard deviation of the training pixels, after ToTensor has scaled them to [0, 1].
PIXEL_STATS = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530)}


def load_in_download_order(accelerator, load):
    """load() on the main process first, which downloads; then on the first process of every other
    machine (it finds the files on a shared disk, or downloads its own copy); then on every other
    process, which reads the files now there. When a process that goes first fails with a
    UserError (offline, a truncated file), every process stops with its sentence rather than
    waiting for files that will not come."""
    loaded = None
    for goes_now in (accelerator.is_main_process, accelerator.is_local_main_process):
        error = None
        if goes_now and loaded is None:
            try:
                loaded = load()
            except UserError as mistake:
                error = str(mistake)
        runtime.raise_if_any_failed(error)  # the others wait here for those going now, and all learn of a failure
    return loaded if loaded is not None else load()


def mnist_loaders(accelerator, name, batch_size, eval_batch_size, *, data_dir, source, hub_name, pipeline, num_workers,
                  seed, normalize=True):
    """Training loader (batch_size per process) and test loader (eval_batch_size per process) for the
    data set `name`, before accelerator.prepare; `source` is --dataset_source (torchvision's download,
    or `hub_name` from the Hugging Face Hub), `pipeline` is --data_pipeline.

    The memory pipeline (the default) decodes and normalizes every image once into tensors and
    slices batches from them, in the order of a permutation of `seed` and the epoch; torchvision feeds
    each sample through ToTensor and Normalize as the tutorials do. Both give the same batches in the
    same order on every process, so a run trains to the same weights either way. ToTensor scales
    pixels to [0, 1] and Normalize centres them; nothing divides by 255 again.
    """
    stats = PIXEL_STATS[name] if normalize else None
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        raise UserError(f"--data_dir {data_dir} is a file, not a folder: pass the folder that holds the data sets, or an empty one to download them into.")

    def load():
        transform = _per_sample_transform(stats) if pipeline == "torchvision" else None  # the memory pipeline converts all at once
        if source == "hub":
            return _from_hub(hub_name, data_dir, transform)
        raw_folder = Path(data_dir) / name / "raw"
        if pipeline == "memory" and all((raw_folder / file).is_file() for file in RAW_FILES):
            return tuple(_read_raw(name, raw_folder, train) for train in (True, False))
        return tuple(_open(name, data_dir, train, transform) for train in (True, False))

    train_set, test_set = load_in_download_order(accelerator, load)
    if pipeline == "torchvision":
        return (
            DataLoader(train_set, batch_size=batch_size, shuffle=True, num_workers=num_workers),
            DataLoader(test_set, batch_size=eval_batch_size, num_workers=num_workers),
        )
    device = _tensor_home(train_set, accelerator)
    train_inputs, train_labels = as_tensors(train_set, stats, device)
    test_inputs, test_labels = as_tensors(test_set, stats, torch.device("cpu"))
    return (
        InMemoryLoader(train_inputs, train_labels, batch_size, accelerator, seed=seed),
        DataLoader(TensorDataset(test_inputs, test_labels), batch_size=eval_batch_size),
    )


def as_tensors(dataset, stats, device):
    """All images of a torchvision-style data set (uint8 .data, .targets) as the float tensors its
    ToTensor + Normalize would give one at a time: the same operations, so bitwise the same values."""
    inputs = dataset.data.to(device).unsqueeze(1).float().div(255)
    if stats:
        mean, std = (torch.tensor([value], device=device).view(-1, 1, 1) for value in stats)
        inputs = inputs.sub(mean).div(std)
    return inputs, torch.as_tensor(dataset.targets, device=device)


def _tensor_home(dataset, accelerator):
    """The accelerator's device when the decoded set fits in a quarter of its free memory, else the CPU."""
    device = accelerator.device
    if device.type == "cuda":
        needed = len(dataset) * dataset.data[0].numel() * 4
        if needed > torch.cuda.mem_get_info(device)[0] // 4:
            return torch.device("cpu")
    return device


class InMemoryLoader(DataLoaderStateMixin):
    """Training batches sliced from tensors already on the device, in the order and with the sharding
    of accelerate's prepared DataLoader with a seeded sampler: per epoch one permutation from
    seed + epoch, the same on every process; global batch k goes to process k mod N; with several
    processes, the last batches are topped up from the start of the permutation so that all take the
    same number of steps. accelerator.prepare leaves it as it is.

    Why not a torch DataLoader over a Dataset whose __getitems__ slices a whole batch from the tensors,
    which accelerate would shard, skip and resume itself? Measured at commit 8232cea (benchmarks/README.md,
    findings): it trains to the same weights but at 0.87 of this loader's samples/s for
    cpu_gloo.py on one process and 0.84 on two (medians of 5 rounds; mnist_conv.py 0.96, within noise):
    per batch its sampler, batch sampler and accelerate's prefetching wrapper cost more than the
    linear net's whole step."""

    def __init__(self, inputs, labels, batch_size, accelerator, seed, skip_batches=0):
        self.inputs, self.labels, self.batch_size, self.seed = inputs, labels, batch_size, seed
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.accelerator = accelerator
        self.skip_batches = skip_batches
        self.epoch = 0
        # DataLoaderStateMixin: tells accelerator.accumulate when the epoch ends, so that a last
        # partial accumulation window still ends in an optimizer step.
        self.gradient_state = GradientState()
        self._drop_last = True

    def __len__(self):
        return math.ceil(len(self.labels) / (self.batch_size * self.world_size)) - self.skip_batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def skip_first_batches(self, num_batches):
        skipped = InMemoryLoader(self.inputs, self.labels, self.batch_size, self.accelerator, self.seed, num_batches)
        skipped.set_epoch(self.epoch)
        return skipped

    def this_process_batches(self):
        """The sample indices of this process's batches in this epoch, on the data's device, one row
        per batch (the last row shorter with one process)."""
        num_samples = len(self.labels)
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        if self.world_size == 1:
            return list(order.to(self.inputs.device).split(self.batch_size))
        steps = math.ceil(num_samples / (self.batch_size * self.world_size))
        total = steps * self.world_size * self.batch_size
        order = order.repeat(math.ceil(total / num_samples))[:total]  # the top-up comes from the start
        return list(order.view(steps, self.world_size, self.batch_size)[:, self.rank].to(self.inputs.device))

    def __iter__(self):
        batches = self.this_process_batches()
        device = self.accelerator.device  # where the data set did not fit (see _tensor_home), each batch moves there
        self.begin()
        for step in range(self.skip_batches, len(batches)):
            self.end_of_dataloader = step == len(batches) - 1
            # index_select gathers the same rows as inputs[rows], about 3x faster on a CPU.
            inputs, labels = self.inputs.index_select(0, batches[step]), self.labels.index_select(0, batches[step])
            yield inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        self.end()


def skip_first_batches(accelerator, loader, num_batches):
    """accelerator.skip_first_batches, which the in-memory loader does itself."""
    if isinstance(loader, InMemoryLoader):
        return loader.skip_first_batches(num_batches)
    return accelerator.skip_first_batches(loader, num_batches)


class ArrayDataset(torch.utils.data.Dataset):
    """uint8 images (N x 28 x 28) and labels, named and transformed as torchvision's MNIST does."""

    def __init__(self, data, targets, transform):
        self.data, self.targets, self.transform = torch.as_tensor(data), torch.as_tensor(targets), transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.transform(self.data[index].numpy()), int(self.targets[index])


def _from_hub(hub_name, data_dir, transform):
    """A Hub data set with image and label columns, cached under <data_dir>/huggingface."""
    import datasets as hub  # only this path needs it

    try:
        splits = hub.load_dataset(hub_name, cache_dir=str(Path(data_dir) / "huggingface"))
        return tuple(
            ArrayDataset(np.stack([np.asarray(image, dtype=np.uint8) for image in splits[split]["image"]]),
                         np.asarray(splits[split]["label"]), transform)
            for split in ("train", "test")
        )
    except Exception as error:  # offline, unknown name, missing split or column: the datasets library raises many kinds
        raise UserError(
            f"{hub_name} could not be loaded from the Hugging Face Hub ({first_line(error)}): connect to the internet, "
            "pass --dataset_name a local data set with train and test splits of image and label columns, "
            "or use --dataset_source torchvision."
        ) from None


def _per_sample_transform(stats):
    """ToTensor, then Normalize with the data set's statistics (none for pixels kept in [0, 1])."""
    from torchvision import transforms

    steps = [transforms.ToTensor()] + ([transforms.Normalize((stats[0],), (stats[1],))] if stats else [])
    return transforms.Compose(steps)


def _read_raw(name, raw_folder, train):
    """One split of torchvision's MNIST files, read as torchvision's MNIST reads them (uint8 images,
    int64 labels) but without importing torchvision, whose import costs a new process about 0.5 s of
    CPU: what the memory pipeline needs when the files are already there (tests/test_data.py shows
    the tensors are bitwise torchvision's)."""
    prefix = "train" if train else "t10k"
    try:
        images, labels = (_read_idx(raw_folder / f"{prefix}-{kind}") for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
    except (ValueError, OSError) as error:
        raise _unreadable(name, raw_folder, error) from None
    return ArrayDataset(images, labels.long(), transform=None)


def _read_idx(path):
    """An IDX file of unsigned bytes (MNIST's format): a 4-byte magic number whose last byte is the
    number of dimensions, one big-endian 4-byte size per dimension, then the data."""
    data = path.read_bytes()
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path.name} is not an IDX file of unsigned bytes")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(data[3]))
    body = 4 + 4 * len(shape)
    if len(data) != body + math.prod(shape):
        raise ValueError(f"{path.name} holds {len(data) - body} bytes of data where its header says {math.prod(shape)}")
    return torch.frombuffer(bytearray(data[body:]), dtype=torch.uint8).view(shape)


def _open(name, data_dir, train, transform):
    raw_folder = Path(data_dir) / name / "raw"
    for folder in (Path(data_dir), raw_folder.parent, raw_folder):  # torchvision creates them before it downloads
        if not folder.exists():
            runtime.remove_if_run_fails(folder)
    from torchvision import datasets

    try:
        return getattr(datasets, name)(data_dir, train=train, download=True, transform=transform)
    except RuntimeError as error:
        if "download" in str(error).lower():
            name_flag = "" if name == "MNIST" else f" --name {name}"
            raise UserError(
                f"{name} is not in {raw_folder} and could not be downloaded ({first_line(error)}): connect to the internet, "
                f"copy {', '.join(RAW_FILES)} into {raw_folder}, or write 5,000 real digits there for offline runs "
                f"with `python tools/offline_mnist.py --data_dir {data_dir}{name_flag}`."
            ) from None
        raise _unreadable(name, raw_folder, error) from None
    except (ValueError, OSError, EOFError) as error:
        raise _unreadable(name, raw_folder, error) from None


def _unreadable(name, raw_folder, error):
    return UserError(
        f"The {name} files in {raw_folder} could not be read ({first_line(error)}): "
        "delete them so they are downloaded again, or replace them with complete copies."
    )
