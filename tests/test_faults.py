"""Faults lose nothing: a killed rank ends the job promptly, a crash while saving leaves the previous
checkpoint as latest, and a resume after either ends bitwise equal to a run that never stopped."""

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import CONFIGS, SCRIPTS, python_command, read_metrics, run, script_env
from datagen import write_small_mnist
from test_features import assert_same_records, assert_same_weights, weights

from shared.checkpoints import latest_checkpoint, read_state

LAUNCH = Path(__file__).resolve().parents[1] / "scripts" / "launch.py"
CRASH_PROBE = Path(__file__).resolve().parent / "probes" / "crash_in_save.py"
# A run long enough to be killed in the middle: 512 samples in batches of 8, 12 epochs.
FLAGS = ["--batch_size", "8", "--num_epochs", "12", "--checkpointing_steps", "50", "--log_interval", "1000"]
KILL_DEADLINE_S = 30


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    write_small_mnist(root, "MNIST", num_train=512, num_test=64)
    return root


def training_command(num_processes, *args):
    if num_processes == 1:
        return python_command("cpu_gloo.py", *args)
    return [sys.executable, LAUNCH, "--config_file", CONFIGS / "cpu.yaml", "--num_processes", num_processes,
            SCRIPTS / "cpu_gloo.py", *args]


def rank_process(launcher, rank):
    """The training process of `rank` among the launcher's descendants (the launcher itself for 1 process)."""
    for process in [launcher, *launcher.children(recursive=True)]:
        try:
            if process.environ().get("RANK", "0") == str(rank) and "cpu_gloo.py" in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            continue
    return None


@pytest.mark.parametrize("num_processes", [1, 2])
def test_killed_rank_ends_the_job_and_resume_is_bitwise_equal(num_processes, small_data, tmp_path):
    args = ["--data_dir", small_data, *FLAGS]
    reference = tmp_path / "reference"
    run(training_command(num_processes, "--output_dir", reference, *args), cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(reference)} == {num_processes}

    killed = tmp_path / "killed"
    job = subprocess.Popen([str(c) for c in training_command(num_processes, "--output_dir", killed, *args)],
                           cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while latest_checkpoint(killed / "checkpoints") is None or len(list((killed / "checkpoints").iterdir())) < 3:
        assert job.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    victim = rank_process(psutil.Process(job.pid), num_processes - 1)  # the last rank; rank 0 for 1 process
    victim.kill()
    killed_at = time.monotonic()
    try:
        _, stderr = job.communicate(timeout=KILL_DEADLINE_S)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"the job still ran {KILL_DEADLINE_S} s after rank {num_processes - 1} was killed")
    assert job.returncode != 0
    print(f"job exited {time.monotonic() - killed_at:.2f} s after the kill")
    if num_processes > 1:  # the survivors' "connection closed by peer" errors may come before this line
        assert f"Training stopped: rank {num_processes - 1} was killed by signal 9" in stderr
    assert not (killed / "model.safetensors").exists(), "killed before the end"

    newest = latest_checkpoint(killed / "checkpoints")
    assert read_state(newest)["global_step"] % 50 == 0
    run(training_command(num_processes, "--output_dir", killed, *args, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert_same_weights(weights(reference), weights(killed))
    assert_same_records(read_metrics(reference), read_metrics(killed), rel=1e-6)


def test_crash_while_saving_leaves_the_previous_checkpoint_as_latest(small_data, tmp_path):
    args = ["--data_dir", small_data, "--batch_size", "8", "--num_epochs", "3", "--checkpointing_steps", "20"]
    reference = tmp_path / "reference"
    run(python_command("cpu_gloo.py", "--output_dir", reference, *args), cwd=tmp_path)

    crashed = tmp_path / "crashed"
    env = script_env()
    env["CRASH_AT_SAVE"] = "3"  # the save of step 60 dies halfway
    result = run([sys.executable, CRASH_PROBE, SCRIPTS / "cpu_gloo.py", "--output_dir", crashed, *args], cwd=tmp_path, check=False, env=env)
    assert result.returncode == -9
    checkpoints = crashed / "checkpoints"
    assert (checkpoints / ".tmp_step_00000060").is_dir(), "the half-written checkpoint is there, hidden"
    assert latest_checkpoint(checkpoints) == checkpoints / "step_00000040"
    assert read_state(checkpoints / "step_00000040")["global_step"] == 40

    run(python_command("cpu_gloo.py", "--output_dir", crashed, *args, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert_same_weights(weights(reference), weights(crashed))
    assert not (checkpoints / ".tmp_step_00000060").exists(), "the next save of that step cleared it"
