"""Data parallelism trains the same model: the same command at 1, 2 and 4 processes ends with the same
weights (--batch_size is split across the processes, so every world size takes the same steps on the
same samples), for the nets without BatchNorm; gradient averaging is exact, as --no_split_batches shows
(N processes x batch b end where 1 process x batch N*b ends); and the ragged case is what the README
says it is."""

import json

import pytest

from conftest import read_metrics, run
from test_features import assert_same_weights, script_command, weights


def train(script, tmp_path, name, num_processes, *args):
    output_dir = tmp_path / name
    run(script_command(script, "--output_dir", output_dir, *args, num_processes=None if num_processes == 1 else num_processes), cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(output_dir)} == {num_processes}
    return output_dir


def assert_same_training(runs):
    """The same weights (to float summation order) and the same steps, samples and losses per epoch."""
    first, *others = runs
    for other in others:
        assert_same_weights(weights(first), weights(other), exact=False)
        for left, right in zip(read_metrics(first), read_metrics(other), strict=True):
            assert left["train_samples_seen"] == right["train_samples_seen"] == 2000
            assert (left["step"], left["lr"]) == (right["step"], right["lr"])
            assert left["train_loss"] == pytest.approx(right["train_loss"], rel=1e-5)


def test_cpu_gloo_trains_the_same_model_on_1_2_and_4_processes(data_dir, tmp_path):
    flags = ["--data_dir", data_dir, "--num_epochs", "2", "--batch_size", "100"]
    runs = [train("cpu_gloo.py", tmp_path, f"x{n}", n, *flags) for n in (1, 2, 4)]
    assert [r["step"] for r in read_metrics(runs[0])] == [20, 40]  # 2000 / 100 steps an epoch at every world size
    assert_same_training(runs)


def test_without_split_batches_four_processes_equal_one_process_with_four_times_the_batch(data_dir, tmp_path):
    flags = ["--data_dir", data_dir, "--num_epochs", "2"]
    parallel = train("cpu_gloo.py", tmp_path, "parallel", 4, *flags, "--batch_size", "25", "--no_split_batches")
    single = train("cpu_gloo.py", tmp_path, "single", 1, *flags, "--batch_size", "100")
    assert_same_training([parallel, single])


def test_toy_mlp_five_processes_equal_one_process_with_all_five_rows(tmp_path):
    parallel = train("toy_mlp.py", tmp_path, "parallel", 5, "--batch_size", "5")
    single = train("toy_mlp.py", tmp_path, "single", 1, "--batch_size", "5")
    assert_same_weights(weights(parallel), weights(single), exact=False)


def test_ragged_last_batch_is_topped_up_from_the_start_of_the_epoch(data_dir, tmp_path):
    """2000 samples in steps of 64: the 32nd step has 16 fresh samples. With 2 processes (32 each)
    accelerate tops each process's last batch up to 32 with samples from the start of the epoch's
    order, so both processes take the same number of steps; one process takes a last step of 16.
    Up to that step the two runs agree; the last step differs."""
    flags = ["--data_dir", data_dir, "--num_epochs", "1", "--checkpointing_steps", "31", "--batch_size", "64"]
    parallel = train("cpu_gloo.py", tmp_path, "parallel", 2, *flags)
    single = train("cpu_gloo.py", tmp_path, "single", 1, *flags)
    for run_dir in (parallel, single):
        assert read_metrics(run_dir)[-1]["step"] == 32
    assert read_metrics(parallel)[-1]["train_samples_seen"] == 2048  # 48 samples seen twice
    assert read_metrics(single)[-1]["train_samples_seen"] == 2000
    before_last = [weights(run_dir / "checkpoints" / "step_00000031") for run_dir in (parallel, single)]
    assert_same_weights(*before_last, exact=False)
    with pytest.raises(AssertionError):
        assert_same_weights(weights(parallel), weights(single), exact=False)
    state = json.loads((parallel / "checkpoints" / "step_00000031" / "trainer_state.json").read_text())
    assert state["samples_done"] == 31 * 64
