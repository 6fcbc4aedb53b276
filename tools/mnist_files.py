"""MNIST-family files in torchvision's layout, written from arrays: the IDX format MNIST ships in.

The tests, the offline subset (tools/offline_mnist.py) and the benchmarks write their data with it, so
the scripts read it as they read the downloaded files (the torchvision pipeline through torchvision's own
loading code), with no network.
"""

import contextlib
import struct
import sys
from pathlib import Path

import numpy as np

from shared.mnist_data import RAW_FILES  # the scripts' shared/ names the files


def write_idx(path, array):
    """Write a uint8 array as an IDX file, the format MNIST ships in (used by tests and offline set-up)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    Path(path).write_bytes(header + array.tobytes())


def refuse_to_replace(data_dir, name):
    """Stop a tool, in one sentence, before it writes over the files of a data set already in
    <data_dir>/<name>/raw/, which may be the real one."""
    raw_folder = Path(data_dir) / name / "raw"
    if any((raw_folder / file_name).exists() for file_name in RAW_FILES):
        sys.exit(f"error: {raw_folder} already holds {name} files, which this would replace: pass another --data_dir, "
                 "or delete them first.")


def write_mnist_layout(data_dir, name, train_images, train_labels, test_images, test_labels):
    """Lay out arrays as torchvision expects <data_dir>/<name>/raw/, so it loads them with no network."""
    raw_folder = Path(data_dir) / name / "raw"
    written = []
    try:
        raw_folder.mkdir(parents=True, exist_ok=True)
        for file_name, array in zip(RAW_FILES, (train_images, train_labels, test_images, test_labels)):
            if not (raw_folder / file_name).exists():
                written.append(raw_folder / file_name)
            write_idx(raw_folder / file_name, array)
    except OSError as error:  # a file where a folder goes, a read-only or full disk
        for path in written:  # a half-written set would make the next try refuse to replace it
            with contextlib.suppress(OSError):
                path.unlink()
        sys.exit(f"error: {raw_folder} could not be written ({error}): pass a --data_dir you can write in.")
    return raw_folder
