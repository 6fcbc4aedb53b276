"""The in-memory data path trains to bitwise the same weights as the tutorials' DataLoader path
(at several processes both shard alike: tests/test_launch.py)."""

import pytest

from conftest import read_metrics
from test_features import assert_same_records, assert_same_weights, train, weights


@pytest.mark.parametrize("script, num_processes", [("seq_net.py", None), ("mnist_conv.py", None), ("cpu_gloo.py", None)])
def test_memory_and_torchvision_pipelines_train_identically(script, num_processes, data_dir, tmp_path):
    flags = ["--data_dir", data_dir, "--num_epochs", "2", "--batch_size", "48"]  # 2000 / 48: a ragged end
    runs = {
        pipeline: train(script, tmp_path, pipeline, *flags, "--data_pipeline", pipeline, num_processes=num_processes)[0]
        for pipeline in ("memory", "torchvision")
    }
    assert_same_weights(weights(runs["memory"]), weights(runs["torchvision"]))
    assert_same_records(read_metrics(runs["memory"]), read_metrics(runs["torchvision"]))


def test_torchvision_pipeline_resumes_mid_epoch_bitwise(data_dir, tmp_path):
    from test_features import resume_from

    flags = ["--data_dir", data_dir, "--num_epochs", "2", "--checkpointing_steps", "40", "--data_pipeline", "torchvision"]
    full, _ = train("cpu_gloo.py", tmp_path, "full", *flags)
    path = resume_from(full, "step_00000040", tmp_path / "resumed")
    train("cpu_gloo.py", tmp_path, "resumed", *flags, "--resume_from_checkpoint", path)
    assert_same_weights(weights(full), weights(tmp_path / "resumed"))
