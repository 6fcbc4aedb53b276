"""Small learnable stand-ins for MNIST and FashionMNIST in torchvision's layout, made here with no
network: each 28x28 image's class is a bright 7x5 block at one of ten fixed places, over noise.

    python tools/synthetic_digits.py --data_dir data_synthetic
    python scripts/mnist_conv.py --data_dir data_synthetic --num_epochs 1

For a smoke run of a copied template, the tests and the benchmarks' own small runs; not for measuring
learning (tools/offline_mnist.py writes 5,000 real digits for that).
"""

import argparse

import numpy as np
from mnist_files import refuse_to_replace, write_mnist_layout

from shared.flags import positive_int


def learnable_digits(num_samples, seed):
    """28x28 uint8 images whose class is a bright block, 7 rows by 5 columns, at one of ten fixed spots, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=num_samples).astype(np.uint8)
    images = rng.integers(0, 60, size=(num_samples, 28, 28)).astype(np.uint8)
    for index, label in enumerate(labels):
        row, col = divmod(int(label), 5)
        images[index, 3 + row * 12 : 10 + row * 12, 1 + col * 5 : 6 + col * 5] = 230
    return images, labels


def write_small_mnist(data_dir, name="MNIST", num_train=512, num_test=200, seed=0):
    train_images, train_labels = learnable_digits(num_train, seed)
    test_images, test_labels = learnable_digits(num_test, seed + 1)
    return write_mnist_layout(data_dir, name, train_images, train_labels, test_images, test_labels)


def write_hub_dataset(folder, num_train=400, num_test=100, seed=0):
    """The same kind of digits as a local Hugging Face data set (train and test splits, image and label
    columns), in the Parquet layout of a Hub repository, so `datasets.load_dataset(folder)` reads it offline."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    for split, count, split_seed in (("train", num_train, seed), ("test", num_test, seed + 1)):
        images, labels = learnable_digits(count, split_seed)
        rows = datasets.Dataset.from_dict({"image": list(images), "label": labels.tolist()}, features=features)
        rows.to_parquet(f"{folder}/data/{split}-00000-of-00001.parquet")
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default="data_synthetic", help="folder to pass as --data_dir to the scripts")
    parser.add_argument("--num_train", type=positive_int, default=2000)
    parser.add_argument("--num_test", type=positive_int, default=200)
    parser.add_argument("--name", choices=["MNIST", "FashionMNIST"], default=None, help="one data set's folder (default: both)")
    args = parser.parse_args()
    names = [args.name] if args.name else ["MNIST", "FashionMNIST"]
    for name in names:
        refuse_to_replace(args.data_dir, name)
    for name in names:
        folder = write_small_mnist(args.data_dir, name, args.num_train, args.num_test)
        print(f"wrote {args.num_train} training and {args.num_test} test synthetic digits to {folder}")


if __name__ == "__main__":
    main()
