"""MNIST-family data: downloaded once per machine, read from torchvision's folder layout."""

import contextlib
import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torchvision import datasets, transforms

from shared.runtime import UserError, first_line

# torchvision keeps each data set under <data_dir>/<name>/raw/ with these four files.
RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
DATASETS = {"MNIST": datasets.MNIST, "FashionMNIST": datasets.FashionMNIST}
# Mean and standard deviation of the training pixels, after ToTensor has scaled them to [0, 1].
PIXEL_STATS = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530)}


@contextlib.contextmanager
def download_order(accelerator):
    """The main process downloads first, then the first process of every other machine (a no-op
    on a shared disk), then everyone else reads the files that are now there."""
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        yield


def mnist_datasets(args, name, accelerator, normalize=True):
    """The (train, test) data sets `name` from --dataset_source, downloaded into --data_dir if missing.

    Both sources give the same samples: ToTensor scales pixels to [0, 1] and Normalize centres
    them; nothing divides by 255 again.
    """
    steps = [transforms.ToTensor()]
    if normalize:
        mean, std = PIXEL_STATS[name]
        steps.append(transforms.Normalize((mean,), (std,)))
    transform = transforms.Compose(steps)
    with download_order(accelerator):
        if args.dataset_source == "hub":
            train_set, test_set = _from_hub(args.dataset_name, args.data_dir, transform)
        else:
            train_set, test_set = (_open(name, args.data_dir, train, transform) for train in (True, False))
    check_world_size(len(train_set), accelerator, f"the {name} training set")
    return train_set, test_set


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


def check_world_size(num_samples, accelerator, what):
    """Stop when some process would get no training sample at all."""
    if accelerator.num_processes > num_samples:
        raise UserError(
            f"{accelerator.num_processes} processes were launched but {what} has only {num_samples} samples: "
            f"launch at most {num_samples} processes (--num_processes {num_samples})."
        )


def _open(name, data_dir, train, transform):
    raw_folder = Path(data_dir) / name / "raw"
    try:
        return DATASETS[name](data_dir, train=train, download=True, transform=transform)
    except RuntimeError as error:
        if "download" in str(error).lower():
            raise UserError(
                f"{name} is not in {raw_folder} and could not be downloaded ({first_line(error)}): "
                f"connect to the internet, or copy {', '.join(RAW_FILES)} into {raw_folder}."
            ) from None
        raise _unreadable(name, raw_folder, error) from None
    except (ValueError, OSError, EOFError) as error:
        raise _unreadable(name, raw_folder, error) from None


def _unreadable(name, raw_folder, error):
    return UserError(
        f"The {name} files in {raw_folder} could not be read ({first_line(error)}): "
        "delete them so they are downloaded again, or replace them with complete copies."
    )


def write_idx(path, array):
    """Write a uint8 array as an IDX file, the format MNIST ships in (used by tests and offline set-up)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as file:
        file.write(header + array.tobytes())


def write_mnist_layout(data_dir, name, train_images, train_labels, test_images, test_labels):
    """Lay out arrays as torchvision expects <data_dir>/<name>/raw/, so it loads them with no network."""
    raw_folder = Path(data_dir) / name / "raw"
    raw_folder.mkdir(parents=True, exist_ok=True)
    for file_name, array in zip(RAW_FILES, (train_images, train_labels, test_images, test_labels)):
        write_idx(raw_folder / file_name, array)
    return raw_folder
