"""The real torchvision loading code on files laid out as torchvision expects, and its failures."""

import sys

import pytest

from conftest import python_command, read_metrics, run
from datagen import write_small_mnist


def test_files_in_torchvision_layout_are_used_without_network(tmp_path):
    write_small_mnist(tmp_path / "data", "MNIST", num_train=256, num_test=64)
    run(python_command("cpu_gloo.py", "--data_dir", tmp_path / "data", "--output_dir", tmp_path / "run", "--num_epochs", "1"), cwd=tmp_path)
    assert read_metrics(tmp_path / "run")[0]["eval_samples"] == 64


@pytest.mark.parametrize("script, name", [("mnist_conv.py", "MNIST"), ("seq_net.py", "FashionMNIST")])
def test_missing_data_offline_ends_in_one_sentence(tmp_path, script, name):
    result = run(python_command(script, "--data_dir", tmp_path / "empty", "--output_dir", tmp_path / "run"), cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    message = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1
    assert f"{name} is not in {tmp_path / 'empty' / name / 'raw'} and could not be downloaded" in message[0]
    assert "train-images-idx3-ubyte" in message[0]


def test_truncated_file_ends_in_one_sentence(tmp_path):
    raw = write_small_mnist(tmp_path / "data", "MNIST", num_train=256, num_test=64)
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:5000])
    result = run(python_command("mnist_conv.py", "--data_dir", tmp_path / "data", "--output_dir", tmp_path / "run"), cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"The MNIST files in {raw} could not be read" in result.stderr
