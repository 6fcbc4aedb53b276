"""Evaluation over several processes counts every eval sample exactly once."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torchvision import datasets, transforms

from conftest import launch_command, read_metrics, run
from test_scripts import SCRIPTS, load_script_module


def single_process_accuracy(weights, data_dir):
    model = load_script_module(SCRIPTS / "cpu_gloo.py").SimpleNet()
    model.load_state_dict(load_file(weights))
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    test_set = datasets.MNIST(data_dir, train=False, transform=transform)
    images = torch.stack([image for image, _ in test_set])
    labels = torch.tensor([label for _, label in test_set])
    with torch.no_grad():
        logits = model(images)
    return (logits.argmax(1) == labels).sum().item() / len(labels), F.cross_entropy(logits, labels).item(), len(labels)


@pytest.mark.parametrize("num_processes", [3])
def test_uneven_eval_split_counts_each_sample_once(data_dir, tmp_path, num_processes):
    # 200 eval samples in batches of 7 over 3 processes: the shards and the last batches are uneven.
    # A small lr leaves the accuracy well between 0 and 1, so a duplicated or lost sample shows.
    output_dir = tmp_path / "run"
    run(launch_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", output_dir, "--num_epochs", "1",
                       "--lr", "0.004", "--eval_batch_size", "7", num_processes=num_processes), cwd=tmp_path)
    record = read_metrics(output_dir)[-1]
    assert record["world_size"] == num_processes
    accuracy, loss, count = single_process_accuracy(output_dir / "model.safetensors", data_dir)
    assert record["eval_samples"] == count == 200
    assert 0.1 < accuracy < 0.95
    assert record["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert record["eval_loss"] == pytest.approx(loss, rel=1e-4)
