"""Evaluation over 1 to 4 processes counts every eval sample exactly once, with uneven splits, and
gives the accuracy a single process computes for the same weights."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torchvision import datasets, transforms

from conftest import launch_command, python_command, read_metrics, run
from test_scripts import SCRIPTS, load_script_module

# One test process builds the module's fixture once and runs all of these (pytest.ini).
pytestmark = pytest.mark.xdist_group("metrics")


def single_process_evaluation(weights, data_dir):
    """Plain PyTorch, no Accelerate: the reference numbers for these weights."""
    model = load_script_module(SCRIPTS / "cpu_gloo.py").SimpleNet()
    model.load_state_dict(load_file(weights))
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    test_set = datasets.MNIST(data_dir, train=False, transform=transform)
    images = torch.stack([image for image, _ in test_set])
    labels = torch.tensor([label for _, label in test_set])
    with torch.no_grad():
        logits = model(images)
    return (logits.argmax(1) == labels).sum().item() / len(labels), F.cross_entropy(logits, labels).item(), len(labels)


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory, fork_servers):
    # A small lr leaves the accuracy well between 0 and 1, so a duplicated or lost sample shows.
    output_dir = tmp_path_factory.mktemp("metrics") / "run"
    run(python_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", output_dir, "--num_epochs", "1", "--lr", "0.001"), cwd=output_dir.parent)
    return output_dir


@pytest.mark.parametrize("num_processes", [1, 2, 3])
def test_every_eval_sample_counted_once_at_any_world_size(num_processes, trained, data_dir, tmp_path):
    # 200 eval samples in batches of 7: uneven shards and uneven last batches at 2 and 3 processes.
    accuracy, loss, count = single_process_evaluation(trained / "model.safetensors", data_dir)
    assert 0.1 < accuracy < 0.95
    run(launch_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", tmp_path / "eval", "--eval_only",
                       "--resume_from_checkpoint", trained / "model.safetensors", "--eval_batch_size", "7",
                       num_processes=num_processes), cwd=tmp_path)
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["world_size"] == num_processes
    assert result["eval_samples"] == count == 200
    assert result["eval_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert result["eval_loss"] == pytest.approx(loss, rel=1e-5)


def test_training_run_metrics_match_the_reference(trained, data_dir):
    accuracy, loss, count = single_process_evaluation(trained / "model.safetensors", data_dir)
    record = read_metrics(trained)[-1]
    assert (record["eval_samples"], record["eval_accuracy"]) == (count, pytest.approx(accuracy, abs=1e-12))
