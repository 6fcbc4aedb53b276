"""The training features of every script: checkpoints and exact resume, eval-only, mixed precision,
gradient accumulation, the scheduler, tracking, plots, Hub data, torch.compile and multi-node."""

import json
import os
import shutil
import socket
import sqlite3
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SCRIPTS, TOOLS, checkpoint_damage, checkpoints_in, data_flags, error_lines, launch_command, python_command, read_metrics, run, script_env, two_machines
from synthetic_digits import write_hub_dataset, write_small_mnist
from test_scripts import load_script_module

# script -> (flags for a short run, a checkpoint step inside epoch 2, model class, whether the model
#            has BatchNorm); --batch_size is split across the processes, so every world size takes
#            the same steps
FEATURE_RUNS = {
    "seq_net.py": (["--num_epochs", "2", "--batch_size", "50"], 50, "SeqNet", False),
    "mnist_conv.py": (["--num_epochs", "2"], 40, "Net", True),
    "cpu_gloo.py": (["--num_epochs", "2"], 40, "SimpleNet", False),
}
# Checkpoints and resume, where the runs differ from FEATURE_RUNS': the conv net, whose steps cost most, on
# small_data (8 steps an epoch); at several processes, cpu_gloo at 2, and at 3, where the order of the all-reduce's
# sums can differ (unlike at 2) and the fixed gradient layout is on (shared/ddp_options.py), the BatchNorm net,
# the one issue 25 measured, in steps of 48 (11 steps an epoch, the last of 32 samples topped up and split
# 16/16/16). Each resumed run trains to the end of epoch 2. -> (extra flags, checkpoint step, data fixture)
RESUME_RUNS = {("mnist_conv.py", None): ([], 10, "small_data"), ("cpu_gloo.py", 2): ([], 40, "data_dir"),
               ("mnist_conv.py", 3): (["--batch_size", "48"], 13, "small_data")}
MEASURED_KEYS = {"elapsed_s", "samples_per_sec", "peak_memory_mb"}  # of the machine, not of the training


def weights(run_dir):
    return load_file(run_dir / "model.safetensors")


def assert_same_weights(a, b, exact=True, atol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), f"{key} differs"
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=atol)  # float summation order only


def assert_close(actual, expected, rel=1e-6, where="value"):
    """Equal in kind and shape: strings, flags and None exactly, numbers within rel (pytest.approx's
    default abs of 1e-12 included), lists, tuples and dicts element by element."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_close(actual[key], expected[key], rel, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for index, (left, right) in enumerate(zip(actual, expected)):
            assert_close(left, right, rel, f"{where}[{index}]")
    elif isinstance(expected, (int, float)) and not isinstance(expected, bool):
        assert not isinstance(actual, (bool, str)) and actual == pytest.approx(expected, rel=rel), f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_same_records(a, b, rel=0.0):
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b]
    for left, right in zip(a, b):
        assert left.keys() == right.keys()
        for key in left.keys() - MEASURED_KEYS:
            assert_close(left[key], right[key], rel, f"epoch {left['epoch']} {key}")


def script_command(script, *args, num_processes=None):
    """python scripts/X.py for one process (None), else accelerate launch with the CPU profile."""
    return python_command(script, *args) if num_processes is None else launch_command(script, *args, num_processes=num_processes)


def train(script, tmp_path, name, *flags, num_processes=None, data_dir=None):
    output_dir = tmp_path / name
    args = ["--output_dir", output_dir, *flags] + (data_flags(script, data_dir) if data_dir else [])
    result = run(script_command(script, *args, num_processes=num_processes), cwd=tmp_path)
    if "--eval_only" not in args:  # the last epoch ran with the processes launched, not one alone
        assert read_metrics(output_dir)[-1]["world_size"] == (num_processes or 1)
    return output_dir, result


def resume_from(source_dir, checkpoint, target_dir):
    """A second run folder holding what the first had when `checkpoint` was written."""
    path = target_dir / "checkpoints" / checkpoint
    shutil.copytree(source_dir / "checkpoints" / checkpoint, path)
    epoch = json.loads((path / "trainer_state.json").read_text())["epoch"]
    lines = (source_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (target_dir / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["epoch"] < epoch))
    return path


# -- checkpoints and resume -----------------------------------------------------------------------

@pytest.mark.parametrize("script, num_processes", [
    pytest.param(script, None, marks=[pytest.mark.smoke] if script == "cpu_gloo.py" else []) for script in sorted(FEATURE_RUNS)
] + [key for key in RESUME_RUNS if key[1]])
def test_checkpoints_change_nothing_and_a_mid_epoch_resume_ends_bitwise_equal(script, num_processes, request, tmp_path):
    """A run without checkpoints, the same run saving them, and that run resumed from a checkpoint in the
    middle of epoch 2 end with bitwise the same weights and records, at 1, 2 and 3 processes."""
    flags, step, _, _ = FEATURE_RUNS[script]
    extra, step, data = RESUME_RUNS.get((script, num_processes), ([], step, "data_dir"))
    data_dir = request.getfixturevalue(data)
    flags = [*flags, *extra]
    plain, _ = train(script, tmp_path, "plain", *flags, num_processes=num_processes, data_dir=data_dir)
    flags += ["--checkpointing_steps", str(step)]
    full, _ = train(script, tmp_path, "full", *flags, num_processes=num_processes, data_dir=data_dir)
    assert_same_weights(weights(plain), weights(full))
    assert_same_records(read_metrics(plain), read_metrics(full))
    checkpoint = f"step_{step:08d}"
    state = json.loads((full / "checkpoints" / checkpoint / "trainer_state.json").read_text())
    assert state["epoch"] == 2 and state["batches_done"] > 0, "the checkpoint falls inside epoch 2"
    assert state["world_size"] == (num_processes or 1)

    resumed = tmp_path / "resumed"
    path = resume_from(full, checkpoint, resumed)
    _, result = train(script, tmp_path, "resumed", *flags, "--resume_from_checkpoint", path,
                      num_processes=num_processes, data_dir=data_dir)
    assert f"Resumed from {path}: epoch 2, {state['batches_done']} batches in" in result.stdout
    assert_same_weights(weights(full), weights(resumed))
    assert_same_records(read_metrics(full), read_metrics(resumed))


@pytest.mark.parametrize("pipeline", ["torchvision", "memory"])
def test_a_model_with_dropout_resumes_bitwise_from_the_middle_of_an_epoch(pipeline, small_data, tmp_path):
    """Dropout, which a copy of a template may add, draws from torch's random state, which the checkpoint holds.
    Before, the torchvision pipeline's resumed DataLoader drew one number from it for its workers' seeds as it
    started, a draw the run never stopped did not make there: the resumed weights differed (the in-memory loader's did not)."""
    flags = ["--data_dir", small_data, "--num_epochs", "2", "--batch_size", "32", "--data_pipeline", pipeline, "--checkpointing_steps", "20"]
    with_dropout = [sys.executable, Path(__file__).resolve().parent / "probes" / "with_dropout.py", SCRIPTS / "mnist_conv.py"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run([*with_dropout, "--output_dir", full, *flags], cwd=tmp_path)
    path = resume_from(full, "step_00000020", resumed)  # 16 steps an epoch: 4 into epoch 2
    result = run([*with_dropout, "--output_dir", resumed, *flags, "--resume_from_checkpoint", path], cwd=tmp_path)
    assert f"Resumed from {path}: epoch 2, 4 batches in" in result.stdout
    assert_same_weights(weights(full), weights(resumed))
    assert_same_records(read_metrics(full), read_metrics(resumed))


def test_checkpoint_names_pruning_and_latest(data_dir, tmp_path):
    flags = ["--data_dir", data_dir, "--num_epochs", "2", "--checkpointing_steps", "10", "--keep_last_checkpoints", "2"]
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", *flags)
    names = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000050", "step_00000060"]  # 2 x 32 steps: 10, 20, ..., 60; the last 2 kept

    finished = run(python_command("cpu_gloo.py", "--output_dir", run_dir, *flags, "--resume_from_checkpoint", "latest"), cwd=tmp_path, check=False)
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert f"The run in {run_dir} already finished 2 epochs: pass a larger --num_epochs" in finished.stderr

    before = read_metrics(run_dir)
    flags[flags.index("--num_epochs") + 1] = "3"
    resumed = run(python_command("cpu_gloo.py", "--output_dir", run_dir, *flags, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert f"Resumed from {run_dir / 'checkpoints' / 'step_00000060'}: epoch 2, 28 batches in" in resumed.stdout, resumed.stdout[-2000:]
    after = read_metrics(run_dir)
    # Resumed at step 60, inside epoch 2: epoch 2 is finished again, to the same numbers.
    assert [r["epoch"] for r in after] == [1, 2, 3]
    assert_same_records(after[:2], before, rel=1e-6)
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_00000080", "step_00000090"]


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux's setpriv")
@pytest.mark.xdist_group("mistakes")  # on the test process whose ordinary user's fork server test_mistakes.py started
def test_an_old_checkpoint_that_cannot_be_deleted_stays_with_a_warning(small_data, tmp_path, run_as_an_ordinary_user):
    """Pruning comes after the new checkpoint is complete: an old one that cannot be deleted (another
    user's files, say) is left, renamed so that it is no checkpoint, with a warning, and the run goes on.
    Before, the run stopped, saying that the complete new checkpoint could not be written. The run has no
    root's reading and writing capabilities (setpriv), as an ordinary user would not."""
    flags = ["--data_dir", small_data, "--batch_size", "128", "--checkpointing_steps", "2"]
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", *flags, "--num_epochs", "1")  # 4 steps: step_2 and step_4
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved
    (run_dir / "checkpoints" / "step_00000002").chmod(0o555)  # its files cannot be deleted
    try:
        result = run_as_an_ordinary_user(python_command("cpu_gloo.py", "--output_dir", run_dir, *flags, "--num_epochs", "2",
                                                        "--keep_last_checkpoints", "1", "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    finally:
        (run_dir / "checkpoints" / ".pruned_step_00000002").chmod(0o755)
    assert result.stderr.count("warning: could not delete the old checkpoint") == 1, result.stderr  # renamed, it is no longer listed
    assert f"{run_dir / 'checkpoints' / '.pruned_step_00000002'} ([Errno 13] Permission denied" in result.stderr
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [".pruned_step_00000002", "step_00000008"]
    assert [record["epoch"] for record in read_metrics(run_dir)] == [1, 2] and (run_dir / "model.safetensors").exists()


def test_a_record_cut_short_by_a_kill_is_left_out_and_the_run_resumes(small_data, tmp_path):
    """A run killed while it appended a record leaves half a line at the end of metrics.jsonl; the resume
    leaves it out, trains that epoch again and ends as the run that never stopped."""
    flags = ["--data_dir", small_data, "--batch_size", "64", "--num_epochs", "3", "--checkpointing_steps", "epoch"]
    whole, _ = train("cpu_gloo.py", tmp_path, "whole", *flags)
    cut = tmp_path / "cut"
    resume_from(whole, "step_00000016", cut)  # after epoch 2, with its two records
    with (cut / "metrics.jsonl").open("a") as file:
        file.write('{"epoch": 3, "train_lo')
    _, result = train("cpu_gloo.py", tmp_path, "cut", *flags, "--resume_from_checkpoint", "latest")
    assert f"Resumed from {cut / 'checkpoints' / 'step_00000016'}: epoch 3, 0 batches in" in result.stdout, result.stdout[-2000:]
    assert_same_weights(weights(whole), weights(cut))
    assert_same_records(read_metrics(whole), read_metrics(cut), rel=1e-6)


def test_a_run_killed_while_it_saved_its_model_resumes_to_save_it(small_data, tmp_path):
    """All its epochs recorded and checkpointed, but no model.safetensors (killed in the final save, as
    torchrun's kill after a late signal can): `latest` finishes the run instead of saying it is done."""
    flags = ["--data_dir", small_data, "--batch_size", "64", "--num_epochs", "2", "--checkpointing_steps", "epoch"]
    whole, _ = train("cpu_gloo.py", tmp_path, "whole", *flags)
    killed = tmp_path / "killed"
    shutil.copytree(whole, killed)
    (killed / "model.safetensors").unlink()
    _, result = train("cpu_gloo.py", tmp_path, "killed", *flags, "--resume_from_checkpoint", "latest")
    assert "Resumed from" in result.stdout and f"Saved the trained model to {killed / 'model.safetensors'}" in result.stdout
    assert_same_weights(weights(whole), weights(killed))
    assert_same_records(read_metrics(whole), read_metrics(killed))


def test_a_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(small_data, tmp_path):
    """Resumed from an earlier checkpoint of its folder, the run branches there: the later checkpoints
    of the run it left are set aside (abandoned_step_N, kept), so that `latest` and pruning go by the
    new branch's own; it ends as the run that never stopped."""
    flags = ["--data_dir", small_data, "--batch_size", "64", "--num_epochs", "3", "--checkpointing_steps", "epoch"]
    whole, _ = train("cpu_gloo.py", tmp_path, "whole", *flags)
    branch = tmp_path / "branch"
    shutil.copytree(whole, branch)
    (branch / "model.safetensors").unlink()
    _, result = train("cpu_gloo.py", tmp_path, "branch", *flags, "--resume_from_checkpoint", branch / "checkpoints" / "step_00000008")
    assert f"Set aside {branch / 'checkpoints' / 'step_00000016'}, saved after the checkpoint resumed, as abandoned_step_00000016." in result.stdout
    assert sorted(path.name for path in (branch / "checkpoints").iterdir()) == [
        "abandoned_step_00000016", "abandoned_step_00000024", "step_00000008", "step_00000016", "step_00000024"]
    assert_same_weights(weights(whole), weights(branch))
    assert_same_records(read_metrics(whole), read_metrics(branch), rel=1e-6)

    # Back to the abandoned branch's step 16: refused in this folder, whose branch has a step_16 and records of its own
    # (before, those stayed live beside the old branch's resume, for `latest`, pruning and early stopping to take); in
    # another --output_dir it starts a run of its own, and ends where the run that never stopped ends.
    abandoned = branch / "checkpoints" / "abandoned_step_00000016"
    refused = run(script_command("cpu_gloo.py", "--output_dir", branch, *flags, "--resume_from_checkpoint", abandoned), cwd=tmp_path, check=False)
    assert refused.returncode == 1 and error_lines(refused.stderr) == [
        f"error: Checkpoint {abandoned} was set aside when its run went on from an earlier one: resume it with another --output_dir, "
        "where it starts a run of its own (or --eval_only it)."], refused.stderr[-2000:]
    elsewhere, _ = train("cpu_gloo.py", tmp_path, "from_the_abandoned_branch", *flags, "--resume_from_checkpoint", abandoned)
    assert_same_weights(weights(whole), weights(elsewhere))


def test_a_resume_at_another_process_count_falls_on_a_whole_optimizer_step(small_data, tmp_path):
    """With gradient accumulation, the checkpoint's position must be a whole number of the new run's
    optimizer steps (processes x batch x accumulation), not only of its batches, or its accumulation
    windows would not line up: 96 samples in (2 x 8 x 2 saved it), 4 x 8 x 2 does not fit, 1 x 8 x 2 does."""
    flags = ["--data_dir", small_data, "--no_split_batches", "--batch_size", "8", "--gradient_accumulation_steps", "2",
             "--num_epochs", "1", "--checkpointing_steps", "3"]
    run_dir = tmp_path / "run"
    run(launch_command("cpu_gloo.py", "--output_dir", run_dir, *flags, num_processes=2), cwd=tmp_path)
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved: the folder can be resumed
    refused = run(launch_command("cpu_gloo.py", "--output_dir", run_dir, *flags, "--resume_from_checkpoint", run_dir / "checkpoints" / "step_00000003",
                                 num_processes=4), cwd=tmp_path, check=False)
    assert refused.returncode == 1 and "stopped 96 samples into epoch 1, which is not a whole number of this run's steps of 64 samples" in refused.stderr
    assert "resume with 2 processes, --batch_size 8 and --gradient_accumulation_steps 2 (its steps of 32), or from an epoch checkpoint." \
        in refused.stderr, "the advice names every flag that makes up the checkpoint's step"
    resumed = run(python_command("cpu_gloo.py", "--output_dir", run_dir, *flags, "--resume_from_checkpoint", run_dir / "checkpoints" / "step_00000003"),
                  cwd=tmp_path)
    assert f"Resumed from {run_dir / 'checkpoints' / 'step_00000003'}: epoch 1, 12 batches in, step 3." in resumed.stdout, resumed.stdout[-2000:]
    assert [record["world_size"] for record in read_metrics(run_dir)] == [1]


def test_a_resume_that_is_refused_sets_no_checkpoint_aside(small_data, tmp_path):
    """A resume from an earlier checkpoint that stops with a sentence (here at a batch size its position
    does not divide into) leaves the later checkpoints as they were, so that `latest` still finds them."""
    flags = ["--data_dir", small_data, "--batch_size", "64", "--num_epochs", "1", "--checkpointing_steps", "3"]
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", *flags)
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved: the folder can be resumed
    refused = run(python_command("cpu_gloo.py", "--output_dir", run_dir, *flags, "--batch_size", "50",
                                 "--resume_from_checkpoint", run_dir / "checkpoints" / "step_00000003"), cwd=tmp_path, check=False)
    assert refused.returncode == 1 and "stopped 192 samples into epoch 1, which is not a whole number" in refused.stderr
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]


def test_a_continued_run_killed_before_its_new_model_was_saved_resumes_to_save_it(data_dir, tmp_path):
    """A run that ended at step 30 is continued to --max_train_steps 50 and killed after the checkpoint of
    step 50, before its model: the model.safetensors in the folder is still step 30's, which is not the
    end of this run. The resume saves the model of step 50; before, it said the run had trained 50 steps."""
    flags = ["--data_dir", data_dir, "--batch_size", "50", "--checkpointing_steps", "10"]
    first, _ = train("cpu_gloo.py", tmp_path, "first", *flags, "--max_train_steps", "30")
    shutil.copytree(first, tmp_path / "continued")
    continued, _ = train("cpu_gloo.py", tmp_path, "continued", *flags, "--max_train_steps", "50", "--resume_from_checkpoint", "latest")
    shutil.copytree(continued, tmp_path / "killed")
    shutil.copy2(first / "model.safetensors", tmp_path / "killed" / "model.safetensors")  # step 30's file, as it was
    killed, result = train("cpu_gloo.py", tmp_path, "killed", *flags, "--max_train_steps", "50", "--resume_from_checkpoint", "latest")
    assert "epoch 2, 10 batches in, step 50." in result.stdout
    assert_same_weights(weights(continued), weights(killed))
    assert_same_records(read_metrics(continued), read_metrics(killed), rel=1e-6)


def test_epoch_checkpoints(data_dir, tmp_path):
    run_dir, _ = train("mnist_conv.py", tmp_path, "run", "--data_dir", data_dir, "--num_epochs", "2", "--checkpointing_steps", "epoch")
    states = [json.loads((path / "trainer_state.json").read_text()) for path in sorted((run_dir / "checkpoints").iterdir())]
    assert [(s["epoch"], s["batches_done"], s["global_step"]) for s in states] == [(2, 0, 32), (3, 0, 64)]


def test_resume_with_another_process_count(data_dir, tmp_path):
    """Stopped by 2 processes, resumed by 1 with the same --batch_size 50 (25 a process, then 50): the
    same steps follow. (2000 samples split into whole steps of 50, so no epoch ends in a ragged one.)"""
    flags = ["--data_dir", data_dir, "--num_epochs", "2", "--checkpointing_steps", "48", "--batch_size", "50"]
    full, _ = train("cpu_gloo.py", tmp_path, "full", *flags, num_processes=2)
    path = resume_from(full, "step_00000048", tmp_path / "resumed")
    _, result = train("cpu_gloo.py", tmp_path, "resumed", *flags, "--resume_from_checkpoint", path)
    assert "epoch 2, 8 batches in" in result.stdout  # 8 x 50 = 400 samples, as 2 x 8 x 25 were
    assert read_metrics(tmp_path / "resumed")[-1]["world_size"] == 1
    assert_same_weights(weights(full), weights(tmp_path / "resumed"), exact=False)

    path = resume_from(full, "step_00000048", tmp_path / "mismatch")
    mismatch = run(python_command("cpu_gloo.py", "--output_dir", tmp_path / "mismatch", *flags, "--batch_size", "30",
                                  "--resume_from_checkpoint", path), cwd=tmp_path, check=False)
    assert mismatch.returncode == 1 and "Traceback" not in mismatch.stderr
    assert "stopped 400 samples into epoch 2, which is not a whole number of this run's steps of 30 samples: " \
           "resume with --batch_size 50 (its steps of 50), or from an epoch checkpoint." in mismatch.stderr
    # At 3 processes, which cannot split the checkpoint's batch of 50, the advice says so.
    mismatch = run(script_command("cpu_gloo.py", "--output_dir", tmp_path / "mismatch", *flags, "--batch_size", "30",
                                  "--resume_from_checkpoint", path, num_processes=3), cwd=tmp_path, check=False)
    assert mismatch.returncode == 1 and mismatch.stderr.count("error: ") == 1, mismatch.stderr[-3000:]
    assert "resume with --batch_size 50 (its steps of 50) on a number of processes that divides 50, such as its 2, " \
           "or from an epoch checkpoint." in mismatch.stderr


# -- --max_train_steps ------------------------------------------------------------------------------

def test_max_train_steps_stops_mid_epoch_and_a_resume_ends_bitwise(data_dir, tmp_path):
    """2000 samples in steps of 50 are 40 steps an epoch, so step 50 falls inside epoch 2: the run
    evaluates and records that partial epoch at step 50 and saves the model. Resumed from its step-30
    checkpoint it ends bitwise the same; resumed once more, it says it is done."""
    flags = ["--data_dir", data_dir, "--batch_size", "50", "--max_train_steps", "50", "--checkpointing_steps", "30"]
    full, result = train("cpu_gloo.py", tmp_path, "full", *flags)
    records = read_metrics(full)
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 40), (2, 50)]
    assert records[-1]["train_samples_seen"] == 10 * 50, "the partial epoch's own samples"
    assert "epoch 2/2" in result.stdout and f"Saved the trained model to {full / 'model.safetensors'}" in result.stdout

    path = resume_from(full, "step_00000030", tmp_path / "resumed")
    train("cpu_gloo.py", tmp_path, "resumed", *flags, "--resume_from_checkpoint", path)
    assert_same_weights(weights(full), weights(tmp_path / "resumed"))
    assert_same_records(records, read_metrics(tmp_path / "resumed"), rel=1e-6)

    done = run(python_command("cpu_gloo.py", "--output_dir", full, *flags, "--resume_from_checkpoint", "latest"), cwd=tmp_path, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"The run in {full} already trained 50 steps: pass a larger --max_train_steps" in done.stderr

    # Its epoch 2, cut short at step 50, is not a finished epoch: the run continues to --num_epochs 2 and
    # ends as one that trained 2 epochs without stopping. Before, it was refused as already finished.
    by_epochs = ["--data_dir", data_dir, "--batch_size", "50", "--checkpointing_steps", "30", "--num_epochs", "2"]
    whole, _ = train("cpu_gloo.py", tmp_path, "whole", *by_epochs)
    continued, result = train("cpu_gloo.py", tmp_path, "full", *by_epochs, "--resume_from_checkpoint", "latest")
    assert "epoch 1, 30 batches in, step 30." in result.stdout
    assert [(r["epoch"], r["step"], r["whole_epoch"]) for r in read_metrics(continued)] == [(1, 40, True), (2, 80, True)]
    assert [r["whole_epoch"] for r in records] == [True, False]
    assert_same_weights(weights(whole), weights(continued))
    assert_same_records(read_metrics(whole), read_metrics(continued), rel=1e-6)


def test_a_run_killed_after_its_last_step_was_saved_but_before_its_model_resumes_to_save_it(data_dir, tmp_path):
    """The checkpoint of step 50, --max_train_steps, is complete but model.safetensors is not there (a
    kill in between leaves this folder): the resume trains no step, records the epoch and saves the
    model the run would have saved. Before, it was refused as a run that had already trained 50 steps."""
    flags = ["--data_dir", data_dir, "--batch_size", "50", "--max_train_steps", "50", "--checkpointing_steps", "25"]
    full, _ = train("cpu_gloo.py", tmp_path, "full", *flags)
    shutil.copytree(full, tmp_path / "killed")
    (tmp_path / "killed" / "model.safetensors").unlink()
    killed, result = train("cpu_gloo.py", tmp_path, "killed", *flags, "--resume_from_checkpoint", "latest")
    assert "epoch 2, 10 batches in, step 50." in result.stdout
    assert_same_weights(weights(full), weights(killed))
    assert_same_records(read_metrics(full), read_metrics(killed), rel=1e-6)


def test_a_continued_run_killed_after_its_last_record_but_before_its_model_resumes_to_save_it(data_dir, tmp_path):
    """A run of 1 epoch, continued to --num_epochs 2 from its step-30 checkpoint, saving none after: killed after its
    epoch 2 record, before its model replaced the 1-epoch one. The resume trains from step 30 again and saves the
    2-epoch model. Before, the 1-epoch model, newer than the checkpoint, was taken for the end of epoch 2: "already
    finished 2 epochs", and the folder held a model of 1 epoch beside records of 2."""
    flags = ["--data_dir", data_dir, "--batch_size", "50"]
    first, _ = train("cpu_gloo.py", tmp_path, "first", *flags, "--num_epochs", "1", "--checkpointing_steps", "30")
    shutil.copytree(first, tmp_path / "continued")
    shutil.copytree(first, tmp_path / "killed")
    further = [*flags, "--num_epochs", "2", "--checkpointing_steps", "1000", "--resume_from_checkpoint", "latest"]
    continued, _ = train("cpu_gloo.py", tmp_path, "continued", *further)
    assert [record["epoch"] for record in read_metrics(continued)] == [1, 2]
    shutil.copy(continued / "metrics.jsonl", tmp_path / "killed" / "metrics.jsonl")  # its epoch 2 record, written after the old model
    killed, result = train("cpu_gloo.py", tmp_path, "killed", *further)
    assert "step_00000030: epoch 1, 30 batches in, step 30." in result.stdout, result.stdout[-2000:]
    assert_same_weights(weights(continued), weights(killed))
    assert_same_records(read_metrics(continued), read_metrics(killed), rel=1e-6)


BY_EPOCH = ["--batch_size", "50", "--max_train_steps", "100", "--checkpointing_steps", "epoch"]  # 40 steps an epoch: 40, 80, 100
ACCUMULATED = ["--batch_size", "50", "--gradient_accumulation_steps", "2", "--max_train_steps", "50", "--checkpointing_steps", "10"]


@pytest.mark.parametrize("flags, checkpoint, resumed_with, expected", [
    (BY_EPOCH, "step_00000040", ["--batch_size", "40"], [(1, 40), (2, 90), (3, 100)]),  # 50 steps an epoch: before, it stopped at 90
    (BY_EPOCH, "step_00000080", ["--batch_size", "40"], [(1, 40), (2, 80), (3, 100)]),  # past the 2 epochs that reach 100: refused
    (BY_EPOCH, "step_00000040", ["--batch_size", "100"], [(1, 40), (2, 60), (3, 80), (4, 100)]),  # 20 an epoch: an empty epoch 5
    # 20 steps an epoch of 2 batches each; step 30 is 20 batches into epoch 2. Resumed at batches of 100: 10 steps an epoch,
    # 5 of them done. Before, an empty epoch 5 was recorded.
    (ACCUMULATED, "step_00000030", ["--batch_size", "100"], [(1, 20), (2, 35), (3, 45), (4, 50)]),
])
def test_a_max_train_steps_resume_at_another_batch_size_trains_to_that_step(flags, checkpoint, resumed_with, expected, data_dir, tmp_path):
    """A run of --max_train_steps killed before its model was saved, resumed at another batch size from one of its
    checkpoints: its epochs are counted from where it resumes, in the resumed run's steps, and it ends at that step exactly."""
    full, _ = train("cpu_gloo.py", tmp_path, "full", "--data_dir", data_dir, *flags)
    resume_from(full, checkpoint, tmp_path / "resumed")
    resumed, _ = train("cpu_gloo.py", tmp_path, "resumed", "--data_dir", data_dir, *flags, *resumed_with, "--resume_from_checkpoint", "latest")
    assert [(record["epoch"], record["step"]) for record in read_metrics(resumed)] == expected
    assert (resumed / "model.safetensors").exists()


def test_a_step_checkpoint_after_an_epochs_ragged_last_batch_resumes_at_another_batch_size(data_dir, tmp_path):
    """2000 samples in batches of 48 are 42 batches an epoch, the last of 32. A step checkpoint after
    the last holds the whole epoch: a resume at --batch_size 50 goes on as from the epoch checkpoint
    saved at the same point. Before, it counted 42 x 48 samples and was refused."""
    flags = ["--data_dir", data_dir, "--batch_size", "48", "--num_epochs", "1"]
    by_step, _ = train("cpu_gloo.py", tmp_path, "by_step", *flags, "--checkpointing_steps", "42")
    by_epoch, _ = train("cpu_gloo.py", tmp_path, "by_epoch", *flags, "--checkpointing_steps", "epoch")
    resumed = [train("cpu_gloo.py", tmp_path, f"{source.name}_resumed", "--data_dir", data_dir, "--batch_size", "50",
                     "--num_epochs", "2", "--resume_from_checkpoint", source / "checkpoints" / "step_00000042")
               for source in (by_step, by_epoch)]
    assert "epoch 1, 40 batches in, step 42." in resumed[0][1].stdout  # all 40 of its own batches
    assert_same_weights(*(weights(run_dir) for run_dir, _ in resumed))
    assert_same_records(*(read_metrics(run_dir)[-1:] for run_dir, _ in resumed))
    assert read_metrics(resumed[0][0])[-1]["step"] == 42 + 40


def test_max_train_steps_counts_optimizer_steps_at_any_world_size(data_dir, tmp_path):
    """With accumulation of 2 batches of 50, an epoch of 2000 samples is 20 optimizer steps; 30 steps end
    inside epoch 2, at 1 process and at 2, with the same model. accelerate's ACCELERATE_GRADIENT_ACCUMULATION_STEPS
    sets the Accelerator's accumulation over the flag's, and the steps are the Accelerator's: before, the
    script counted an epoch in the flag's (40 steps), ran 1 epoch and saved its model after 20 steps."""
    flags = ["--data_dir", data_dir, "--batch_size", "50", "--max_train_steps", "30"]
    one, _ = train("cpu_gloo.py", tmp_path, "one", *flags, "--gradient_accumulation_steps", "2")
    two, _ = train("cpu_gloo.py", tmp_path, "two", *flags, "--gradient_accumulation_steps", "2", num_processes=2)
    from_environment = tmp_path / "from_environment"
    run(python_command("cpu_gloo.py", "--output_dir", from_environment, *flags), cwd=tmp_path,
        env={**script_env(), "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"})
    for run_dir, world_size in ((one, 1), (two, 2), (from_environment, 1)):
        assert [(r["epoch"], r["step"], r["world_size"]) for r in read_metrics(run_dir)] == [(1, 20, world_size), (2, 30, world_size)]
    assert_same_weights(weights(one), weights(two), exact=False)
    assert_same_weights(weights(one), weights(from_environment))


# -- eval-only ------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["mnist_conv.py", "seq_net.py"])  # the BatchNorm net, and one without; the loops are one (test_drift.py)
def test_eval_only_from_checkpoint_and_from_model_file(script, small_data, tmp_path):
    data_dir = small_data  # a quarter of data_dir: the conv net's epoch costs most
    flags = [*data_flags(script, data_dir), "--num_epochs", "1", "--checkpointing_steps", "epoch"]
    run_dir, _ = train(script, tmp_path, "run", *flags)
    last = read_metrics(run_dir)[-1]
    checkpoint = next((run_dir / "checkpoints").iterdir())
    # From the checkpoint on 2 processes (their shards gathered), from the model file on one.
    for source, num_processes in ((checkpoint, 2), (run_dir / "model.safetensors", None)):
        result = run(script_command(script, *data_flags(script, data_dir), "--output_dir", run_dir, "--eval_only",
                                    "--resume_from_checkpoint", source, num_processes=num_processes), cwd=tmp_path)
        evaluation = json.loads((run_dir / "eval.json").read_text())
        assert evaluation["world_size"] == (num_processes or 1) and evaluation["eval_samples"] == last["eval_samples"]
        assert evaluation["eval_accuracy"] == pytest.approx(last["eval_accuracy"], abs=1e-9)
        assert evaluation["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)  # the accuracy moves in steps of 1/64
        assert len(evaluation["eval_per_class_accuracy"]) == len(last["eval_per_class_accuracy"])
        assert "class 1:" in result.stdout and f"eval_accuracy {last['eval_accuracy']:.4f}" in result.stdout
    assert len(read_metrics(run_dir)) == 1, "evaluation leaves the run's metrics alone"


def test_eval_only_latest_evaluates_the_newest_weights_of_the_run(data_dir, tmp_path):
    """After a run that finished past its last checkpoint, `latest` is its final model.safetensors."""
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", "--data_dir", data_dir, "--num_epochs", "2", "--checkpointing_steps", "40")
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_00000040"]  # the run ends at step 64
    # The training command line, accumulation and all, evaluates: the accumulation check is training's.
    result = run(python_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", run_dir, "--eval_only",
                                "--resume_from_checkpoint", "latest", "--gradient_accumulation_steps", "100"), cwd=tmp_path)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["weights"] == str(run_dir / "model.safetensors")
    assert evaluation["eval_accuracy"] == read_metrics(run_dir)[-1]["eval_accuracy"]
    assert result.stdout.startswith(f"{run_dir / 'model.safetensors'}: eval_accuracy")
    # On a disk that stamps whole seconds, the checkpoint, the records and the model saved after them may share one time:
    # still the model (before, a tie went to the checkpoint).
    second = int(time.time())
    for path in (run_dir / "checkpoints" / "step_00000040", run_dir / "checkpoints" / "step_00000040" / "trainer_state.json",
                 run_dir / "metrics.jsonl", run_dir / "model.safetensors"):
        os.utime(path, (second, second))
    result = run(python_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", run_dir, "--eval_only",
                                "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert result.stdout.startswith(f"{run_dir / 'model.safetensors'}: eval_accuracy")

    # A write that fails (a folder where its temporary file goes) ends in one sentence, the eval.json before it whole.
    before = (run_dir / "eval.json").read_text()
    (run_dir / "eval.json.tmp").mkdir()
    failed = run(python_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", run_dir, "--eval_only",
                                "--resume_from_checkpoint", run_dir / "checkpoints" / "step_00000040"), cwd=tmp_path, check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert f"error: Could not write {run_dir / 'eval.json'} (" in failed.stderr and failed.stderr.strip().endswith("and evaluate again.")
    assert (run_dir / "eval.json").read_text() == before


def test_eval_only_of_a_model_file_that_one_machines_disk_lacks_stops_both_machines_in_one_sentence(data_dir, tmp_path):
    """Two machines with a disk each (two launches, each with folders of its own), and --eval_only of a
    model.safetensors that only machine 0's disk holds: both stop with one sentence that names the file,
    the process that could not read it and the way on. Before, machine 1 stopped alone and machine 0
    waited for it in the evaluation, then ended as a lost peer. A copy of other weights on machine 1 stops
    both too."""
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", "--data_dir", data_dir, "--num_epochs", "1")
    missing = tmp_path / "machine_1" / "model.safetensors"
    flags = [SCRIPTS / "cpu_gloo.py", "--data_dir", data_dir, "--eval_only", "--resume_from_checkpoint"]
    results = two_machines(tmp_path, [[*flags, run_dir / "model.safetensors", "--output_dir", run_dir],
                                      [*flags, missing, "--output_dir", tmp_path / "machine_1"]])
    for result in results:
        assert result.returncode == 1 and [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
            f"error: {missing} could not be read by process 1 (No such file or directory: {missing}): where each machine has a disk of its "
            "own, copy the file to the same path on each."], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    # Another model's weights in machine 1's copy (the same keys): evaluated, the two halves of the test set would mix them.
    other = load_file(run_dir / "model.safetensors")
    missing.parent.mkdir()  # the failed run above removed the folder it had made
    save_file({name: tensor + 1 for name, tensor in other.items()}, missing)
    results = two_machines(tmp_path, [[*flags, run_dir / "model.safetensors", "--output_dir", run_dir],
                                      [*flags, missing, "--output_dir", tmp_path / "machine_1"]])
    for result, path in zip(results, (run_dir / "model.safetensors", missing)):
        assert result.returncode == 1 and [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
            f"error: The copies of {path} differ from machine to machine: copy the same file to each."], result.stderr[-3000:]
    assert not (run_dir / "eval.json").exists()


# -- precision, accumulation, schedule ------------------------------------------------------------

def test_channels_last_trains_and_saves_weights_that_load_into_the_plain_net(data_dir, tmp_path):
    run_dir, _ = train("mnist_conv.py", tmp_path, "run", "--data_dir", data_dir, "--num_epochs", "1", "--channels_last",
                       "--checkpointing_steps", "epoch")
    assert read_metrics(run_dir)[-1]["eval_accuracy"] > 0.5
    model = load_script_module(SCRIPTS / "mnist_conv.py").Net()
    model.load_state_dict(weights(run_dir))  # strict, from the main process's contiguous copy
    result = run(script_command("mnist_conv.py", "--data_dir", data_dir, "--output_dir", run_dir, "--eval_only", "--channels_last",
                                "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert f"eval_accuracy {read_metrics(run_dir)[-1]['eval_accuracy']:.4f}" in result.stdout


# The trackers' lines are the same in every script; each tracked run imports them (seconds): MLflow is checked
# through cpu_gloo, TensorBoard through it and seq_net (mnist_conv's tracking: test_observe.py's profiled run).
@pytest.mark.parametrize("script, report_to", [("cpu_gloo.py", "all"), ("seq_net.py", "tensorboard"), ("mnist_conv.py", None)])
def test_bf16_on_cpu_changes_the_arithmetic_learns_and_is_tracked(script, report_to, small_data, tmp_path):
    """A bf16 run differs from the fp32 one and still learns; with --with_tracking, the trackers asked for
    (TensorBoard, and MLflow with --report_to all) hold the epochs of its metrics.jsonl. (small_data: bf16
    convolutions on a CPU take about 4 times as long as fp32 ones.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = [*data_flags(script, small_data), *FEATURE_RUNS[script][0]]
    plain, _ = train(script, tmp_path, "fp32", *flags)
    bf16, _ = train(script, tmp_path, "bf16", *flags, "--mixed_precision", "bf16", *(["--with_tracking", "--report_to", report_to] if report_to else []))
    records = read_metrics(bf16)
    assert {r["mixed_precision"] for r in records} == {"bf16"}
    assert read_metrics(plain)[-1]["mixed_precision"] == "no"
    assert any(not torch.equal(a, b) for a, b in zip(weights(plain).values(), weights(bf16).values()))
    assert records[-1]["eval_accuracy"] > 0.5

    assert not (plain / "tensorboard").exists() and not (plain / "mlflow.db").exists(), "tracking only when asked"
    if report_to is None:
        return
    assert (bf16 / "mlflow.db").exists() == (report_to == "all")
    events = EventAccumulator(str(next((bf16 / "tensorboard").iterdir()))).Reload()
    accuracy = events.Scalars("eval_accuracy")
    assert [e.step for e in accuracy] == [r["epoch"] for r in records]
    assert_close([e.value for e in accuracy], [r["eval_accuracy"] for r in records])
    if report_to != "all":
        return
    with sqlite3.connect(bf16 / "mlflow.db") as db:  # the store `mlflow ui` opens
        logged = db.execute("select step, value from metrics where key = 'train_loss' order by step").fetchall()
        params = dict(db.execute("select key, value from params").fetchall())
    assert_close(logged, [(r["epoch"], r["train_loss"]) for r in records])
    assert params["output_dir"] == str(bf16) and params["with_tracking"] == "True" and params["mixed_precision"] == "bf16"
    with sqlite3.connect(bf16 / "mlflow.db") as db:  # MLflow's artifacts go under --output_dir, not the working folder
        (artifacts,) = db.execute("select artifact_uri from runs").fetchone()
    assert artifacts.startswith(str(bf16 / "mlflow_artifacts")), artifacts


# Adam (seq_net) moves every weight by about lr at each step, whatever its gradient's size, so a weight
# whose gradient is near zero shows summation-order rounding at the scale of lr: measured up to 2e-5
# after 80 steps on this machine's CPU kernels. SGD's updates scale with the gradient.
@pytest.mark.parametrize("script, batch, atol", [("seq_net.py", 50, 1e-4), ("cpu_gloo.py", 25, 1e-5)])
def test_gradient_accumulation_equals_the_larger_batch(script, batch, atol, data_dir, tmp_path):
    """Without BatchNorm, 2 accumulated batches of b give the same update as one batch of 2b
    (2000 samples: every epoch splits into whole batches of both sizes)."""
    flags = ["--data_dir", data_dir, "--num_epochs", "2"]
    large, _ = train(script, tmp_path, "large", *flags, "--batch_size", str(2 * batch))
    accumulated, _ = train(script, tmp_path, "accumulated", *flags, "--batch_size", str(batch), "--gradient_accumulation_steps", "2")
    assert_same_weights(weights(large), weights(accumulated), exact=False, atol=atol)
    steps_per_epoch = 2000 // (2 * batch)
    assert [r["step"] for r in read_metrics(large)] == [r["step"] for r in read_metrics(accumulated)] == [steps_per_epoch, 2 * steps_per_epoch]
    for left, right in zip(read_metrics(large), read_metrics(accumulated)):
        assert left["train_loss"] == pytest.approx(right["train_loss"], rel=1e-5)


def test_a_resume_that_halves_the_batch_and_doubles_the_accumulation_takes_the_same_steps(data_dir, tmp_path):
    """What the out-of-memory sentence advises, mid-epoch: saved after 3 steps of 100, resumed as steps of 2 x 50.
    The epoch takes the same 20 steps and ends at the weights of the run that never stopped; before, load_state
    brought back accelerate's count of 3 batches into the window, so every window after the resume was shifted by
    one batch, the first a half step, and the epoch took 21."""
    flags = ["--data_dir", data_dir, "--num_epochs", "1"]
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", *flags, "--batch_size", "100", "--checkpointing_steps", "3")
    reference = weights(run_dir)
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved: the folder can be resumed
    train("cpu_gloo.py", tmp_path, "run", *flags, "--batch_size", "50", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "3",
          "--resume_from_checkpoint", run_dir / "checkpoints" / "step_00000003")
    assert [record["step"] for record in read_metrics(run_dir)] == [20]
    assert_same_weights(reference, weights(run_dir), exact=False, atol=1e-5)


def test_accumulation_with_a_partial_last_window(data_dir, tmp_path):
    """2000 samples in 5 batches of 400, accumulated by 2: steps of 2, 2 and 1 batches per epoch."""
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", "--data_dir", data_dir, "--num_epochs", "3", "--batch_size", "400",
                       "--gradient_accumulation_steps", "2")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [3, 6, 9]
    assert records[-1]["train_loss"] < records[0]["train_loss"]


def test_accumulation_steps_and_schedule_under_two_processes(data_dir, tmp_path):
    """Steps counted per optimizer step, lr decayed once per epoch at any world size (the loop and schedule of every
    complete script: cpu_gloo's, the quickest)."""
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", "--data_dir", data_dir, "--num_epochs", "3", "--gamma", "0.5",
                       "--batch_size", "50", "--gradient_accumulation_steps", "2", num_processes=2)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [20, 40, 60]  # 2000 / (2 x 25) = 40 batches, 20 steps per epoch
    assert [r["lr"] for r in records] == pytest.approx([0.01, 0.005, 0.0025])  # the rate each epoch trained at
    assert records[-1]["train_loss"] < records[0]["train_loss"]


# -- plots -------------------------------------------------------------------------------------------

def test_plot_metrics_draws_runs_side_by_side(data_dir, tmp_path):
    from PIL import Image

    one, _ = train("cpu_gloo.py", tmp_path, "one_process", "--data_dir", data_dir, "--num_epochs", "2")
    two, _ = train("cpu_gloo.py", tmp_path, "two_processes", "--data_dir", data_dir, "--num_epochs", "2", num_processes=2)
    toy, _ = train("toy_mlp.py", tmp_path, "toy")  # records no eval loss: its panel leaves the run out
    png = tmp_path / "plots" / "new" / "curves.png"  # folders that do not exist yet
    run([sys.executable, TOOLS / "plot_metrics.py", one, two, toy, "-o", png], cwd=tmp_path)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1500, 400)
        pixels = {color: count for count, color in image.convert("RGB").getcolors(maxcolors=1_000_000)}
    for line_color in ((0x1f, 0x77, 0xb4), (0xff, 0x7f, 0x0e), (0x2c, 0xa0, 0x2c)):  # matplotlib's first three: a line for each run
        assert pixels.get(line_color, 0) > 100, line_color
    # No records, an empty file, a damaged line before the last: one sentence each.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").touch()
    shutil.copytree(one, tmp_path / "damaged")
    (tmp_path / "damaged" / "metrics.jsonl").write_text("not a record\n" + (one / "metrics.jsonl").read_text())
    for folder, sentence in (("nothing", "metrics.jsonl does not exist: pass run folders that hold a metrics.jsonl."),
                             ("empty", "metrics.jsonl has no epochs yet: pass a run that finished at least one epoch."),
                             ("damaged", "metrics.jsonl could not be read (")):
        failed = run([sys.executable, TOOLS / "plot_metrics.py", tmp_path / folder, "-o", png], cwd=tmp_path, check=False)
        assert failed.returncode == 1 and failed.stderr.count("error: ") == 1 and "Traceback" not in failed.stderr, failed.stderr
        assert failed.stderr.startswith(f"error: {tmp_path / folder}/{sentence}"), failed.stderr
    # A run killed while it wrote its last record (or one still writing): its whole epochs are drawn, as the scripts read them.
    # Beside it, records of another shape (no world_size, a key only in the first): drawn, with a gap; before, a KeyError.
    with open(one / "metrics.jsonl", "a") as records:
        records.write('{"epoch": 3, "train_lo')
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"epoch": 1, "train_loss": 0.5}\n{"epoch": 2}\n')
    png.unlink()
    run([sys.executable, TOOLS / "plot_metrics.py", one, tmp_path / "other", "-o", png], cwd=tmp_path)
    with Image.open(png) as image:
        assert image.format == "PNG" and len(image.convert("RGB").getcolors(maxcolors=1_000_000)) > 50
    # An output that is a folder, or of a format matplotlib does not write: one sentence (before, a traceback).
    (tmp_path / "folder.png").mkdir()
    for output in (tmp_path / "folder.png", tmp_path / "curves.xyz"):
        failed = run([sys.executable, TOOLS / "plot_metrics.py", one, "-o", output], cwd=tmp_path, check=False)
        assert failed.returncode == 1 and failed.stderr.startswith(f"error: {output} could not be written (") and failed.stderr.strip().endswith(
            "): pass a .png, .pdf or .svg file name in a folder you can write in."), failed.stderr


# -- data from the Hub ------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["seq_net.py", "cpu_gloo.py"])  # FashionMNIST's and MNIST's names on the Hub
def test_hub_source_trains_on_a_local_datasets_folder(script, tmp_path):
    hub_folder = write_hub_dataset(tmp_path / "hub_mnist", num_train=600, num_test=100)
    run_dir, _ = train(script, tmp_path, "run", "--data_dir", tmp_path / "cache", "--dataset_source", "hub",
                       "--dataset_name", hub_folder, "--num_epochs", "2", "--batch_size", "20", num_processes=2)
    records = read_metrics(run_dir)
    assert records[-1]["eval_samples"] == 100 and records[-1]["world_size"] == 2
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert (tmp_path / "cache" / "huggingface").is_dir(), "cached under --data_dir"


def test_machines_may_read_a_local_hub_data_set_from_copies_at_different_paths(tmp_path):
    """Each machine its own copy of a local data set, at a path of its own: the processes compare the data
    by its content, not --dataset_name's text, so the two machines train as one group."""
    copies = [write_hub_dataset(tmp_path / "machine_0" / "hub_mnist", num_train=200, num_test=50), tmp_path / "machine_1" / "mnist"]
    shutil.copytree(copies[0], copies[1])
    results = two_machines(tmp_path, [[SCRIPTS / "cpu_gloo.py", "--dataset_source", "hub", "--dataset_name", copy, "--num_epochs", "1",
                                       "--data_dir", copy.parent / "cache", "--output_dir", copy.parent / "run"] for copy in copies])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert read_metrics(tmp_path / "machine_0" / "run")[-1]["world_size"] == 2


def test_hub_and_torchvision_sources_feed_the_same_samples(tmp_path):
    """The same digits as IDX files and as a Hub data set train to bitwise the same weights."""
    write_small_mnist(tmp_path / "idx", "MNIST", num_train=400, num_test=100)
    hub_folder = write_hub_dataset(tmp_path / "hub_mnist", num_train=400, num_test=100)
    flags = ["--num_epochs", "2"]
    from_files, _ = train("cpu_gloo.py", tmp_path, "files", "--data_dir", tmp_path / "idx", *flags)
    from_hub, _ = train("cpu_gloo.py", tmp_path, "hub", "--data_dir", tmp_path / "cache", "--dataset_source", "hub",
                        "--dataset_name", hub_folder, *flags)
    assert_same_weights(weights(from_files), weights(from_hub))


def test_hub_source_offline_ends_in_one_sentence(tmp_path):
    result = run(python_command("mnist_conv.py", "--data_dir", tmp_path, "--output_dir", tmp_path / "run",
                                "--dataset_source", "hub"), cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: ylecun/mnist could not be loaded from the Hugging Face Hub"), result.stderr[-2000:]


# -- torch.compile, several machines ---------------------------------------------------------------

def test_torch_compile_through_the_launcher(tmp_path):
    env = script_env()
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    command = launch_command("toy_mlp.py", "--output_dir", tmp_path / "run", num_processes=1)
    command.insert(command.index("--num_processes"), "--dynamo_backend")
    command.insert(command.index("--num_processes"), "inductor")
    run(command, cwd=tmp_path, env=env)
    generated = list((tmp_path / "inductor").rglob("*.py"))
    assert generated, "inductor compiled the model"
    assert read_metrics(tmp_path / "run")[-1]["eval_accuracy"] == 1.0
    model = load_script_module(SCRIPTS / "toy_mlp.py").NeuralNetwork()
    model.load_state_dict(weights(tmp_path / "run"))  # no torch.compile prefixes in the saved keys


def test_two_machines_train_as_one_group_with_a_disk_each_and_resume_together(data_dir, tmp_path):
    """Two launches (machine ranks 0 and 1, one process each), each writing to an --output_dir of its
    own as machines without a shared disk do: they train bitwise what one 2-process launch trains,
    each machine's folder holds complete checkpoints and the model, and `latest` on both resumes the
    same checkpoint to the same end."""
    flags = [SCRIPTS / "cpu_gloo.py", "--data_dir", data_dir, "--num_epochs", "2", "--checkpointing_steps", "40"]
    single, _ = train("cpu_gloo.py", tmp_path, "single", *flags[1:], num_processes=2)
    folders = [tmp_path / "machine_0", tmp_path / "machine_1"]
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder] for folder in folders])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert read_metrics(folders[0])[-1]["world_size"] == 2
    assert not (folders[1] / "metrics.jsonl").exists(), "the main process alone writes the metrics"
    for folder in folders:
        assert_same_weights(weights(single), weights(folder))
        assert [path.name for path in checkpoints_in(folder / "checkpoints")] == ["step_00000040"]
        assert checkpoint_damage(folder / "checkpoints" / "step_00000040") is None, "every file there, as its digests say"
    assert_same_records(read_metrics(single), read_metrics(folders[0]))

    # Both resume from their own copy of step 40, the newest the main process finds.
    resumed = [tmp_path / "resumed_0", tmp_path / "resumed_1"]
    for source, target in zip(folders, resumed):
        shutil.copytree(source / "checkpoints", target / "checkpoints")
    resume_from(folders[0], "step_00000040", tmp_path / "metrics_only")
    shutil.copy(tmp_path / "metrics_only" / "metrics.jsonl", resumed[0])
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--resume_from_checkpoint", "latest"] for folder in resumed])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert f"Resumed from {resumed[0] / 'checkpoints' / 'step_00000040'}: epoch 2" in results[0].stdout
    for folder in resumed:
        assert_same_weights(weights(single), weights(folder))
    assert_same_records(read_metrics(single), read_metrics(resumed[0]), rel=1e-6)

    # A new run whose folder on machine 1's disk holds that machine's copy of a run: both machines stop
    # before the first step with machine 1's sentence, and machine 0's new folder goes again.
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder] for folder in (tmp_path / "new", folders[1])])
    for result in results:
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert error_lines(result.stderr) == [
            f"error: On {socket.gethostname()}: --output_dir {folders[1]} already holds a run (model.safetensors, checkpoints): "
            "continue it with --resume_from_checkpoint latest, choose another --output_dir, or pass --overwrite_output_dir to replace it."]
    assert not (tmp_path / "new").exists()
