"""Faults lose nothing: a killed rank ends the job promptly, a crash or a full disk while saving leaves
the previous checkpoint as latest, a damaged checkpoint is found and never loaded, a second launch
into a live run's folder touches nothing, machines started differently stop before the first step,
and a process stuck in a collective still ends on SIGTERM. A resume after any of them ends bitwise
equal to a run that never stopped."""

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from conftest import AS_AN_ORDINARY_USER, CONFIGS, PAUSE_PROBE, SCRIPTS, free_port, loopback_machine, python, all_paused, checkpoint_damage, checkpoints_in, error_lines, folder_snapshot, forks_made, latest_checkpoint, new_interpreter_env, paused_at, python_command, rank_naming, read_metrics, read_state, record_digest_again, run, script_env, scripts_of, small_disk, two_machines, wait_until
from test_features import assert_same_records, assert_same_weights, weights
from test_scripts import load_script_module

from shared import checkpoints, errors, intact_checkpoints, stop_together
from shared.errors import LOST_PEER_EXIT_CODE

LAUNCH = Path(__file__).resolve().parents[1] / "scripts" / "launch.py"
PROBES = Path(__file__).resolve().parent / "probes"
CRASH_PROBE = PROBES / "crash_in_save.py"
# A run long enough to be killed in the middle: 512 samples in batches of 8, 4 epochs of 64 steps.
FLAGS = ["--batch_size", "8", "--num_epochs", "4", "--checkpointing_steps", "50", "--log_interval", "1000"]
KILL_DEADLINE_S = 30


def training_command(num_processes, *args, script=SCRIPTS / "cpu_gloo.py"):
    if num_processes == 1:
        return [sys.executable, script, *args]
    return [sys.executable, LAUNCH, "--config_file", CONFIGS / "cpu.yaml", "--num_processes", num_processes, script, *args]


def rank_process(launcher, rank):
    """The training process of `rank` among the launcher's descendants (the launcher itself for 1 process)."""
    for process in [*launcher.children(recursive=True), launcher]:  # a launcher's own RANK is unset: its workers first
        try:
            if process.environ().get("RANK", "0") == str(rank) and any(name in " ".join(process.cmdline()) for name in ("cpu_gloo.py", PAUSE_PROBE.name)):
                return process
        except psutil.Error:
            continue
    return None


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory, fork_servers):
    """Uninterrupted runs with FLAGS at 1 and 2 processes, made once: what every recovered run must equal."""
    made = {}

    def at(num_processes):
        if num_processes not in made:
            made[num_processes] = tmp_path_factory.mktemp("reference") / "run"
            run(training_command(num_processes, "--output_dir", made[num_processes], "--data_dir", small_data, *FLAGS), cwd=made[num_processes].parent)
            assert {r["world_size"] for r in read_metrics(made[num_processes])} == {num_processes}
        return made[num_processes]
    return at


def assert_ends_like(reference, resumed):
    assert_same_weights(weights(reference), weights(resumed))
    assert_same_records(read_metrics(reference), read_metrics(resumed), rel=1e-6)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_killed_rank_ends_the_job_and_resume_is_bitwise_equal(num_processes, small_data, reference, tmp_path):
    """The last rank (rank 0 for 1 process) is SIGKILLed after step 160, where it waits
    (tests/probes/pause_at_step.py) so that the kill lands there however busy the machine: the job ends,
    the checkpoint of step 150 is the newest, and the resume from it ends bitwise as a run never killed."""
    args = ["--data_dir", small_data, *FLAGS]
    reference = reference(num_processes)

    killed, victim_rank = tmp_path / "killed", num_processes - 1
    _, *command = training_command(num_processes, "--output_dir", killed, *args, script=PAUSE_PROBE)
    job = subprocess.Popen([str(c) for c in [python(), *command]], cwd=tmp_path, env={**script_env(), **paused_at([160], tmp_path, [victim_rank])},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all_paused(tmp_path, [victim_rank], 160):  # the others wait for it in the step's check for a signal
        assert job.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    (rank_naming(killed, victim_rank) if num_processes > 1 else psutil.Process(job.pid)).kill()  # a fork's client: its fork dies with it
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
    assert read_state(newest)["global_step"] == 150
    resumed = run(training_command(num_processes, "--output_dir", killed, *args, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert f"Resumed from {newest}: epoch " in resumed.stdout, resumed.stdout[-2000:]
    assert_ends_like(reference, killed)


def test_the_launcher_names_the_lost_process_not_a_survivor_or_one_it_stopped():
    """torchrun's own first failure goes by whole seconds, so a survivor that left because its peer was
    lost (LOST_PEER_EXIT_CODE) can tie with the lost process, and the processes torchrun then stopped
    itself can tie with both: scripts/launch.py names the lost process, or, when no process of this
    machine was lost (a machine or the network gone), the survivor."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    launch = load_script_module(LAUNCH)
    torchrun_log = launch.TorchrunLog()  # what torchrun logs as it stops the rest (torch's own format)
    torchrun_log.emit(logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.WARNING, __file__, 0,
                                        "Sending process %s closing signal %s", (102, "SIGTERM"), None))
    assert torchrun_log.stopped_by_torchrun == {102}
    failed = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
              for rank, code in ((0, LOST_PEER_EXIT_CODE), (1, -9), (2, -15))}  # in the order torchrun saw them end
    assert launch.cause_of_failure(failed, torchrun_log.stopped_by_torchrun) == (1, failed[1])
    del failed[1]
    rank, failure = launch.cause_of_failure(failed, torchrun_log.stopped_by_torchrun)
    assert rank == 0 and launch.how_it_ended(failure.exitcode).startswith("lost the connection to another process of the run")
    assert launch.cause_of_failure({2: failed[2]}, torchrun_log.stopped_by_torchrun) == (2, failed[2])  # nothing better to name


def test_a_signal_before_any_process_starts_names_what_the_launch_waited_for():
    """A signal while torchrun has no training process running here ends the launch in one line, which says what it was
    waiting for: the other machines, or on one machine its own processes. Before, one machine's said the other machines."""
    launch = load_script_module(LAUNCH)
    assert launch.TorchrunLog(machines=2).while_waiting() == "the launch waited for the other machines, with no training process running here"
    assert launch.TorchrunLog(machines=1).while_waiting() == "the launch was starting its training processes, none of them running yet"


def test_a_signal_that_lands_in_the_launchers_log_handler_still_reaches_torchrun(monkeypatch):
    """torchrun raises SignalException from its handler wherever the launcher's main thread is, inside the
    launcher's handler of torchrun's log too (torchrun logs as it stops and starts processes): there it must go
    on to torchrun, which then stops the run and waits for its save. Before, the handler took it for a logging
    error, printed "--- Logging error ---" with a traceback, and the signal was lost."""
    launch = load_script_module(LAUNCH)
    torchrun_log = launch.TorchrunLog()

    def signalled(record):
        raise launch.SignalException("Process 7 got signal: 15", signal.SIGTERM)

    monkeypatch.setattr(torchrun_log, "say", signalled)
    with pytest.raises(launch.SignalException):
        torchrun_log.emit(logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.INFO, __file__, 0,
                                            "Starting worker group", None, None))


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


def page_rounded_size(folder):
    return sum(-(-path.stat().st_size // 4096) * 4096 for path in folder.rglob("*") if path.is_file())


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_full_disk_stops_the_save_in_one_sentence_and_the_one_before_resumes(num_processes, small_data, reference, tmp_path):
    """--output_dir on a small tmpfs with room for two checkpoints: the third save fails on a full disk.
    Every process stops with one sentence naming the checkpoint, the cause and the way on; the
    checkpoints before it stay complete and 'latest'; copied to a disk with room, the run resumes from
    them to the end of the run that never stopped."""
    reference = reference(num_processes)
    size = int(2.5 * page_rounded_size(reference / "checkpoints" / "step_00000050")) + 2 * 4096  # and metrics.jsonl
    with small_disk(tmp_path / "disk", size) as disk:
        output_dir = disk / "run"
        failed = run(training_command(num_processes, "--output_dir", output_dir, "--data_dir", small_data, *FLAGS), cwd=tmp_path, check=False)
        assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
        saved = checkpoints_in(output_dir / "checkpoints")
        assert [path.name for path in saved] == ["step_00000050", "step_00000100"]
        (line,) = error_lines(failed.stderr)
        assert line.startswith(f"error: Could not write {output_dir / 'checkpoints' / 'step_00000150'} (") and line.endswith(
            f"): free space or fix the folder, then resume with --resume_from_checkpoint latest, which is {saved[-1]} and complete."), line
        assert "no space left on" in line.lower(), line  # the cause, in the sentence itself
        assert not list((output_dir / "checkpoints").glob(".tmp_*")), "the failed save's partial folder is gone"
        assert all(checkpoint_damage(path) is None for path in saved)
        moved = tmp_path / "moved"
        shutil.copytree(output_dir, moved)
    resumed = run(training_command(num_processes, "--output_dir", moved, "--data_dir", small_data, *FLAGS, "--resume_from_checkpoint", "latest"),
                  cwd=tmp_path)
    assert f"Resumed from {moved / 'checkpoints' / 'step_00000100'}: epoch " in resumed.stdout, resumed.stdout[-2000:]
    assert_ends_like(reference, moved)


def test_a_mistake_on_a_full_disk_leaves_torchrun_no_cut_error_file(tmp_path, monkeypatch):
    """A process that a mistake ends tells torchrun so in its error file (scripts/launch.py then restarts
    nothing). Where that file's disk is full (torchrun keeps it under /tmp, often the disk that filled), no
    file is left rather than an empty one, on which torchrun's agent fails reading the process's failure
    (ProcessFailure parses it), and the launcher with a second, cryptic line."""
    monkeypatch.setattr(errors, "MADE_BY_THIS_RUN", [])  # what this test process's own runs made stays
    with small_disk(tmp_path / "disk", 8192) as disk:
        with contextlib.suppress(OSError):
            (disk / "filler").write_bytes(bytes(3 * 8192))  # fills it
        error_file = disk / "error.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert errors.end_in_its_sentence(errors.UserError("The disk is full: free space.")) == 1
        ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=1, error_file=str(error_file))  # as torchrun reads it: raised on a cut file
        assert not error_file.exists()


def assert_two_ranks_trained(result):
    """The run's first logged batch names the losses of ranks 0 and 1: it trained as one group of 2."""
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("Epoch 1, batch 0, loss by rank: ")]
    assert [part.split(": ")[0] for part in line.split("loss by rank: ")[1].split("  ")] == ["0", "1"], line


def assert_write_failed(failed, path, advice):
    """One process or both stopped with one sentence naming `path`, the cause and `advice`; the cause returned."""
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    (line,) = error_lines(failed.stderr)
    assert line.startswith(f"error: Could not write {path} (") and line.endswith(f"): free space or fix the folder, {advice}"), line
    return line.removeprefix(f"error: Could not write {path} (")


def test_a_record_or_first_checkpoint_that_cannot_be_written_stops_the_run_in_one_sentence(small_data, tmp_path):
    """The epoch's record, which the main process alone writes, behind a link into a folder that does not
    exist; the first checkpoint where a file stands in for the checkpoints folder: both processes stop, and
    the sentence says how to go on from what the run has saved so far."""
    flags = ["--data_dir", small_data, "--batch_size", "64", "--num_epochs", "1"]
    (tmp_path / "record").mkdir()
    (tmp_path / "record" / "metrics.jsonl").symlink_to(tmp_path / "gone" / "metrics.jsonl")
    failed = run(training_command(2, "--output_dir", tmp_path / "record", *flags), cwd=tmp_path, check=False)
    cause = assert_write_failed(failed, tmp_path / "record" / "metrics.jsonl", "then resume with --resume_from_checkpoint latest "
                                "(without checkpoints: train again with --overwrite_output_dir).")
    assert cause.startswith("[Errno 2] No such file or directory") and "MB free on its disk): " in cause, cause
    assert_two_ranks_trained(failed)

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "checkpoints").touch()
    failed = run(training_command(2, "--output_dir", tmp_path / "checkpoint", *flags, "--checkpointing_steps", "2"), cwd=tmp_path, check=False)
    cause = assert_write_failed(failed, tmp_path / "checkpoint" / "checkpoints" / "step_00000002",
                                "then start again: this run saved no checkpoint before.")
    assert cause.startswith("[Errno 20] Not a directory"), cause
    assert_two_ranks_trained(failed)


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux's setpriv")
def test_a_write_under_a_folder_this_user_cannot_search_ends_in_one_sentence(tmp_path):
    """A write whose folder sits in one this user can no longer search (a chmod mid-run, NFS once its
    credentials expire) fails with EACCES, and the sentence gives the free space of the nearest folder
    that can be seen. Before, looking for that folder raised EACCES itself (pathlib's exists() does, in
    Python 3.11): a traceback on the process that wrote, and a wait for it on the others."""
    locked = tmp_path / "locked"
    (locked / "run").mkdir(parents=True)
    target = locked / "run" / "model.safetensors"
    write = ("import sys\nfrom shared import stop_together\nfrom shared.errors import UserError\ntry:\n"
             "    with stop_together.if_write_fails(sys.argv[1], 'free space or fix the folder.'):\n        open(sys.argv[1], 'wb')\n"
             "except UserError as mistake:\n    print(mistake)\n")
    locked.chmod(0o000)
    try:
        result = subprocess.run(AS_AN_ORDINARY_USER + [sys.executable, "-c", write, target], capture_output=True, text=True, timeout=60)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.fullmatch(rf"Could not write {re.escape(str(target))} \(\[Errno 13\] Permission denied: '{re.escape(str(target))}'; "
                        r"[0-9.]+ MB free on its disk\): free space or fix the folder\.\n", result.stdout), result.stdout


def test_a_failed_write_on_a_disk_that_cannot_say_its_free_space_still_ends_in_its_sentence(tmp_path, monkeypatch):
    """The sentence adds the disk's free space; where the disk cannot say (NFS's stale handle), the cause alone.
    Before, the lookup's own error left the handler: a traceback on that process, a wait for it on the others."""
    def stale(path):
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(shutil, "disk_usage", stale)
    with pytest.raises(errors.UserError, match=r"^Could not write \S+model\.safetensors \(\[Errno 13\] Permission denied\): free space\.$"):
        with stop_together.if_write_fails(tmp_path / "model.safetensors", "free space."):
            raise PermissionError(errno.EACCES, "Permission denied")


def test_records_that_cannot_be_cut_back_on_a_resume_stop_it_in_one_sentence_and_stay_whole(small_data, reference, tmp_path):
    """A resume cuts metrics.jsonl back to the epochs before its checkpoint through a temporary file; where
    that cannot be written (a folder in its place), the resume stops in one sentence and the records stay."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference(1), run_dir)
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved
    (run_dir / "metrics.jsonl.tmp").mkdir()
    records = (run_dir / "metrics.jsonl").read_bytes()
    failed = run(training_command(1, "--output_dir", run_dir, "--data_dir", small_data, *FLAGS, "--resume_from_checkpoint", "latest"),
                 cwd=tmp_path, check=False)
    assert_write_failed(failed, run_dir / "metrics.jsonl", "then resume again.")
    assert (run_dir / "metrics.jsonl").read_bytes() == records


def test_a_model_that_does_not_fit_on_the_disk_stops_the_run_in_one_sentence(small_data, tmp_path):
    """--output_dir on a tmpfs with room for the lock and the records but not the model, which the main
    process alone writes: both processes stop, and the sentence says how to finish the run."""
    with small_disk(tmp_path / "disk", 3 * 4096) as disk:
        failed = run(training_command(2, "--output_dir", disk / "run", "--data_dir", small_data, "--batch_size", "64", "--num_epochs", "1"),
                     cwd=tmp_path, check=False)
        cause = assert_write_failed(failed, disk / "run" / "model.safetensors", "then finish the run with --resume_from_checkpoint latest "
                                    "(without checkpoints: train again with --overwrite_output_dir).")
        assert "no space left on" in cause.lower(), cause
        assert [record["world_size"] for record in read_metrics(disk / "run")] == [2]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_damaged_checkpoint_is_skipped_by_latest_and_refused_by_name(num_processes, small_data, reference, tmp_path):
    """Bytes of a file of the newest checkpoint changed in place, the size kept (its weights; at 2
    processes rank 1's RNG state, which the main process hashed too): `latest` says so and resumes from
    the one before (the damaged one stays), to the end of the run that never stopped; the damaged one
    named outright stops the run with a sentence naming the file. The folders that a save and a prune
    killed midway left go with the resume; before, they stayed for good, each as large as a checkpoint."""
    reference = reference(num_processes)
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    newest, before = checkpoints_in(run_dir / "checkpoints")[-1], checkpoints_in(run_dir / "checkpoints")[-2]
    damaged = "model.safetensors" if num_processes == 1 else "random_states_1.pkl"
    weights_file = newest / damaged
    data = bytearray(weights_file.read_bytes())
    data[-100:-90] = bytes(byte ^ 0xFF for byte in data[-100:-90])  # changed, whatever they were
    weights_file.write_bytes(bytes(data))
    lines = (reference / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["epoch"] < read_state(before)["epoch"]))

    named = run(training_command(num_processes, "--output_dir", run_dir, "--data_dir", small_data, *FLAGS, "--resume_from_checkpoint", newest),
                cwd=tmp_path, check=False)
    assert named.returncode == 1 and "Traceback" not in named.stderr
    assert f"error: Checkpoint {newest} is damaged ({damaged} differs from what was saved): resume from an earlier checkpoint" in named.stderr

    shutil.copytree(before, before.with_name(f"{before.name}.bak"))  # a user's copy, which is no checkpoint of the run
    leftovers = [run_dir / "checkpoints" / name for name in (".tmp_step_00000099", ".pruned_step_00000001")]
    for leftover in leftovers:
        shutil.copytree(before, leftover)
    result = run(training_command(num_processes, "--output_dir", run_dir, "--data_dir", small_data, *FLAGS, "--resume_from_checkpoint", "latest"),
                 cwd=tmp_path)
    assert f"Skipping damaged checkpoint {newest} ({damaged} differs from what was saved); trying the one before it." in result.stdout
    assert f"Resumed from {before}:" in result.stdout
    kept = newest.with_name(f"damaged_{newest.name}")  # the resumed run saved that step again, and kept the damaged one aside
    assert checkpoint_damage(kept) and latest_checkpoint(run_dir / "checkpoints") == newest and not checkpoint_damage(newest)
    assert not any(leftover.exists() for leftover in leftovers) and before.with_name(f"{before.name}.bak").exists()
    assert_ends_like(reference, run_dir)


def test_latest_with_every_checkpoint_damaged_stops_in_one_sentence_and_deletes_none(small_data, reference, tmp_path):
    """Every checkpoint of a run that holds records is damaged: `latest` sets each aside (kept, as
    damaged_step_N) and stops, rather than train the recorded epochs again from the start."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference(1), run_dir)
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved
    saved = checkpoints_in(run_dir / "checkpoints")
    for checkpoint in saved:
        (checkpoint / "model.safetensors").write_bytes(b"damaged")
    failed = run(training_command(1, "--output_dir", run_dir, "--data_dir", small_data, *FLAGS, "--resume_from_checkpoint", "latest"),
                 cwd=tmp_path, check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert error_lines(failed.stderr) == [
        f"error: {run_dir} holds a run but no intact checkpoint to resume: choose another --output_dir, or pass "
        "--overwrite_output_dir instead of --resume_from_checkpoint."]
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == sorted(f"damaged_{path.name}" for path in saved)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_checkpoint_whose_digests_match_but_will_not_load_stops_in_one_sentence(num_processes, small_data, reference, tmp_path):
    """A model.safetensors cut short, with its digest recorded again to match (a checkpoint damaged
    before it was hashed, or a state file rewritten by hand): the load fails on every process, and the
    sentence is said once, by the machine's first process."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference(num_processes), run_dir)
    (run_dir / "model.safetensors").unlink()  # killed before its model was saved
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    weights_file = checkpoint / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:100])
    record_digest_again(checkpoint, "model.safetensors")
    with forks_made() as new_forks:
        failed = run(training_command(num_processes, "--output_dir", run_dir, "--data_dir", small_data, *FLAGS, "--resume_from_checkpoint",
                                      "latest"), cwd=tmp_path, check=False)
    assert scripts_of(new_forks).count("cpu_gloo.py") == num_processes, "as many training processes as launched"
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    (line,) = error_lines(failed.stderr)
    assert line.startswith(f"error: Checkpoint {checkpoint} could not be loaded (") and line.endswith("): resume from an earlier one."), line


def test_a_checkpoint_is_written_through_to_the_disk_before_its_rename_and_the_prune(tmp_path, monkeypatch):
    """A crash of the machine (not only of the process) within seconds of a save would otherwise find the checkpoint's
    files still in the kernel's cache, lost, and the checkpoints before it already pruned: each file and folder of it
    is fsync'ed, and after the rename the checkpoints folder, before the prune. Here as the main process of one, with
    the real rename; os.fsync records which path each call flushed."""
    flushed = []
    monkeypatch.setattr(os, "fsync", lambda descriptor: flushed.append(os.readlink(f"/proc/self/fd/{descriptor}")))
    main_process = SimpleNamespace(is_main_process=True, num_processes=1, gradient_accumulation_steps=1)
    saver = checkpoints.Checkpoints(main_process, tmp_path, every=4, keep=1, batch_size=8, batches_per_epoch=10, num_epochs=1,
                                    trained_on={"data set": "MNIST", "seed": 42})
    folder = tmp_path / "checkpoints"
    partial = folder / ".tmp_step_00000004"
    (partial / "random_states").mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"weights")
    (partial / "random_states" / "rng_state.pkl").write_bytes(b"state")
    saver._complete(partial, folder / "step_00000004", checkpoints.Position(epoch=1, global_step=4))
    assert sorted(flushed[:-1]) == sorted(str(partial / name) for name in
                                          ["", "model.safetensors", "random_states", "random_states/rng_state.pkl", "trainer_state.json"])
    assert flushed[-1] == str(folder), "the rename, after it"
    assert checkpoint_damage(folder / "step_00000004") is None

    def no_fsync_of_folders(descriptor):  # CIFS, some FUSE and 9p mounts
        if os.path.isdir(os.readlink(f"/proc/self/fd/{descriptor}")):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", no_fsync_of_folders)
    (folder / ".tmp_step_00000008").mkdir()
    (folder / ".tmp_step_00000008" / "model.safetensors").write_bytes(b"weights")
    saver._complete(folder / ".tmp_step_00000008", folder / "step_00000008", checkpoints.Position(epoch=1, global_step=8))
    assert checkpoint_damage(folder / "step_00000008") is None, "saved as before on such a disk"


@pytest.mark.parametrize("raised_as", ["itself", "in torch's CheckpointException"])
def test_a_peer_lost_while_fsdp_loads_a_checkpoint_is_no_damaged_checkpoint(tmp_path, monkeypatch, raised_as):
    """FSDP's load has collectives: a peer lost in one (gloo's error, or NCCL's under TORCH_NCCL_BLOCKING_WAIT=1) goes
    on to errors.run_main, which ends the process as a lost peer's survivor (exit 75, which --max_restarts restarts).
    Before, it ended in "Checkpoint ... could not be loaded (Connection closed by peer): resume from an earlier one",
    a mistake in the error file, after which the launcher restarted nothing. Here inside one process's load, in a
    process group and, where a message only reads like a lost peer's, in none: there it stays the file's sentence."""
    from torch.distributed.checkpoint.api import CheckpointException

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500")
    fsdp = SimpleNamespace(distributed_type=checkpoints.DistributedType.FSDP, scaler=None)
    with pytest.raises(errors.UserError) as refused, checkpoints.loading(tmp_path / "step_00000004", fsdp):
        raise lost
    assert "could not be loaded (" in str(refused.value), "no process group: errors.run_main would print its traceback"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as raised, checkpoints.loading(tmp_path / "step_00000004", fsdp):
        raise lost if raised_as == "itself" else CheckpointException("load failed", {1: (lost, None)})
    assert raised.value is lost
    with pytest.raises(errors.UserError) as refused, checkpoints.loading(tmp_path / "step_00000004", fsdp):  # a damaged file still is one
        raise CheckpointException("load failed", {0: (RuntimeError("PytorchStreamReader failed reading zip archive"), None)})
    assert str(refused.value) == (f"Checkpoint {tmp_path / 'step_00000004'} could not be loaded (PytorchStreamReader failed reading "
                                  "zip archive): resume from an earlier one.")


def test_an_fp16_load_of_a_checkpoint_saved_without_fp16_ends_in_one_sentence(tmp_path):
    """fp16 (GPUs only) gives the Accelerator a GradScaler, whose state accelerate's load_state reads from scaler.pt,
    which a run without fp16 never saved: the load failed on the missing file, advising an earlier checkpoint, which
    fails the same way. A stand-in for fp16's Accelerator: it assumes only that load_state reads scaler.pt whenever
    accelerator.scaler is set (accelerate 1.15's checkpointing.load_accelerator_state, and its FSDP2 branch)."""
    checkpoint = tmp_path / "step_00000004"
    checkpoint.mkdir()
    fp16 = SimpleNamespace(scaler=torch.amp.GradScaler("cpu"), distributed_type=checkpoints.DistributedType.MULTI_GPU)
    with pytest.raises(errors.UserError) as refused, checkpoints.loading(checkpoint, fp16):
        pytest.fail("the load went on")
    assert str(refused.value) == (f"Checkpoint {checkpoint} holds no loss scale for --mixed_precision fp16 (its run trained without "
                                  "fp16): load it with the --mixed_precision it trained with: bf16 or no.")


@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Permission denied"), OSError(errno.ESTALE, "Stale file handle"),
                                   OSError(errno.EIO, "Input/output error")])
def test_a_checkpoint_file_that_may_not_be_read_stops_the_resume_and_sets_nothing_aside(tmp_path, monkeypatch, capsys, error):
    """A checkpoint whose file is there but may not be read now (its permissions, a stale NFS handle) is not damaged:
    `latest` stops in one sentence naming the machine, and the checkpoint stays `latest`; named outright, the advice is
    another checkpoint. Before, `latest` set it aside as damaged_step_N and went on from the one before, losing the steps
    between. A disk that fails to read a file (EIO) has damaged it: skipped, as before. Here as the main process of one
    (tests run as root, whom permissions do not stop: sha256 raises the error)."""
    folder = tmp_path / "checkpoints"
    for step in (4, 8):
        (folder / f"step_0000000{step}").mkdir(parents=True)
        (folder / f"step_0000000{step}" / "model.safetensors").write_bytes(b"weights")
        state = {"files": {"model.safetensors": intact_checkpoints.sha256(folder / f"step_0000000{step}" / "model.safetensors")}}
        (folder / f"step_0000000{step}" / "trainer_state.json").write_text(json.dumps(state | {"sha256": intact_checkpoints.state_digest(state)}))
    main_process = SimpleNamespace(is_main_process=True, is_local_main_process=True, print=print)
    monkeypatch.setattr(stop_together, "on_main_process", lambda accelerator, work: work())
    monkeypatch.setattr(intact_checkpoints, "gather_object", lambda verdicts: verdicts)
    newest = folder / "step_00000008"
    hashed = intact_checkpoints.sha256
    monkeypatch.setattr(intact_checkpoints, "sha256", lambda path: (_ for _ in ()).throw(error) if newest in path.parents else hashed(path))
    if error.errno == errno.EIO:
        assert intact_checkpoints.first_intact(main_process, tmp_path, "latest") == folder / "step_00000004"
        assert f"Skipping damaged checkpoint {newest} (model.safetensors could not be read (" in capsys.readouterr().out
        assert sorted(path.name for path in folder.iterdir()) == ["damaged_step_00000008", "step_00000004"]
        return
    for spec, instead in (("latest", f"move it out of {folder} to resume from the one before"), (str(newest), "resume from another checkpoint")):
        with pytest.raises(errors.UserError) as refused:
            intact_checkpoints.first_intact(main_process, tmp_path, spec)
        assert str(refused.value) == (
            f"Checkpoint {newest} is there but model.safetensors may not be read on {os.uname().nodename} ({errors.first_line(error)}): make "
            f"its files readable there (their permissions; a stale NFS mount: mount it again), or {instead}, then launch again.")
        assert sorted(path.name for path in folder.iterdir()) == ["step_00000004", "step_00000008"], "nothing set aside"


def test_a_checkpoint_set_aside_by_a_killed_save_of_its_step_is_put_back(tmp_path, monkeypatch):
    """A resume that saves its checkpoint's step again (stopped after an epoch's last step, the resumed run evaluates
    that epoch and saves it) sets the earlier copy aside while the new one takes its place. A kill between the two
    renames left no step_N: `latest` took the one before, and the resume then deleted both copies. Now the next
    look for a checkpoint puts it back. Here as the main process of one."""
    folder = tmp_path / "checkpoints"
    state = {"files": {}}  # a checkpoint with no files but its state: intact
    for name in ("step_00000004", ".displaced_step_00000008"):
        (folder / name).mkdir(parents=True)
        (folder / name / "trainer_state.json").write_text(json.dumps(state | {"sha256": intact_checkpoints.state_digest(state)}))
    monkeypatch.setattr(intact_checkpoints, "gather_object", lambda mine: mine)
    main_process = SimpleNamespace(is_main_process=True, is_local_main_process=True, print=print)
    assert intact_checkpoints.first_intact(main_process, tmp_path, "latest") == folder / "step_00000008"
    assert sorted(path.name for path in folder.iterdir()) == ["step_00000004", "step_00000008"]


def test_latest_skips_a_checkpoint_this_machines_disk_has_no_copy_of(tmp_path, monkeypatch, capsys):
    """With a disk per machine, machine 0 may list a checkpoint that another machine's disk lacks (a save
    killed there before it completed): there `latest` skips it, renaming nothing, for the one before. Before,
    the rename of the missing copy ended the run in a FileNotFoundError. Where that disk holds none of them
    (a requeue onto a new machine), a sentence says so: before, that the run held no checkpoint to resume,
    advising --overwrite_output_dir, which would have deleted machine 0's copies. Here as machine 1's process,
    machine 0's intact copies stood in for by its answer to the gather (the two-machine test below runs both)."""
    folder = tmp_path / "checkpoints"
    (folder / "step_00000004").mkdir(parents=True)
    state = {"files": {}}  # a checkpoint with no files but its state: intact
    (folder / "step_00000004" / "trainer_state.json").write_text(json.dumps(state | {"sha256": intact_checkpoints.state_digest(state)}))
    machine_1 = SimpleNamespace(is_main_process=False, is_local_main_process=True, print=print,
                                project_configuration=SimpleNamespace(save_on_each_node=True))

    def machine_0_first(mine):  # machine 0's answer to each gather, then this machine's: the names on its disk, then (writes, intact)
        return [["step_00000004", "step_00000008"] if isinstance(mine[0], list) else (True, None), *mine]
    monkeypatch.setattr(intact_checkpoints, "gather_object", machine_0_first)
    assert intact_checkpoints.first_intact(machine_1, tmp_path, "latest") == folder / "step_00000004"
    assert (f"Skipping damaged checkpoint {folder / 'step_00000008'} ({os.uname().nodename}'s disk has no copy of it); "
            "trying the one before it.") in capsys.readouterr().out
    assert sorted(path.name for path in folder.iterdir()) == ["step_00000004"]

    shutil.rmtree(folder / "step_00000004")
    with pytest.raises(errors.UserError) as refused:
        intact_checkpoints.first_intact(machine_1, tmp_path, "latest")
    assert str(refused.value) == (
        f"No checkpoint in {folder} is intact on every machine's disk ({os.uname().nodename}'s disk has no copy of it): copy a machine's "
        "intact ones into the others' --output_dir, or put --output_dir on a disk they all share, then launch again.")

    # The other way round, as machine 0 on a new disk (a requeue onto another node) beside machine 1's intact copies:
    # the same sentence. Before, machine 0 listed its own disk alone, found nothing, and the run started afresh over them.
    main_process = SimpleNamespace(is_main_process=True, is_local_main_process=True, print=print)
    monkeypatch.setattr(intact_checkpoints, "gather_object", lambda mine: [*mine, ["step_00000008"] if isinstance(mine[0], list) else (True, None)])
    with pytest.raises(errors.UserError) as refused:
        intact_checkpoints.first_intact(main_process, tmp_path, "latest")
    assert str(refused.value).startswith(f"No checkpoint in {folder} is intact on every machine's disk ({os.uname().nodename}'s disk has no copy")

    # Named outright, a checkpoint machine 0 holds and this machine's disk lacks: not called damaged.
    monkeypatch.setattr(stop_together, "on_main_process", lambda accelerator, work: [str(folder / "step_00000008")])
    with pytest.raises(errors.UserError) as refused:
        intact_checkpoints.first_intact(machine_1, tmp_path, str(folder / "step_00000008"))
    assert str(refused.value) == (
        f"Checkpoint {folder / 'step_00000008'} is not on every machine's disk ({os.uname().nodename}'s disk has no copy of it): copy it "
        "into the same folder there, or put --output_dir on a disk they all share, then launch again.")
    # Damaged on machine 0 as well: called damaged, for what is wrong with machine 0's copy.
    monkeypatch.setattr(intact_checkpoints, "gather_object", lambda verdicts: [(True, "model.safetensors differs from what was saved"), *verdicts])
    with pytest.raises(errors.UserError) as refused:
        intact_checkpoints.first_intact(machine_1, tmp_path, str(folder / "step_00000008"))
    assert str(refused.value).startswith(f"Checkpoint {folder / 'step_00000008'} is damaged (model.safetensors differs from what was saved): ")


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_diverged_run_stops_in_one_sentence_and_keeps_its_finite_checkpoints(num_processes, small_data, tmp_path):
    """--gamma 1e40 (a typo in an exponent) makes the learning rate 1e38 after epoch 1, and epoch 2
    diverges at once: every process stops at the next check of the loss, the save at step 70, with one
    sentence naming the epoch and the learning rate, and writes neither that checkpoint nor a model file;
    epoch 1's checkpoints stay, finite, the newest of them `latest`."""
    output_dir = tmp_path / "run"
    result = run(training_command(num_processes, "--output_dir", output_dir, "--data_dir", small_data, "--batch_size", "8",
                                  "--num_epochs", "3", "--checkpointing_steps", "10", "--gamma", "1e40", "--log_interval", "1000"),
                 cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    # Every weight of the Linear 784 -> 10 is NaN, counted once however many processes hold a copy.
    assert line.startswith("error: Training diverged in epoch 2: the loss summed over its steps is nan and 7850 weights are not finite. "
                           "The learning rate is likely too high: lower --lr"), line
    checkpoint = latest_checkpoint(output_dir / "checkpoints")
    assert checkpoint.name == "step_00000060" and checkpoint_damage(checkpoint) is None  # 64 steps an epoch
    assert all(torch.isfinite(tensor).all() for tensor in load_file(checkpoint / "model.safetensors").values())
    assert not list((output_dir / "checkpoints").glob(".tmp_*")) and not (output_dir / "model.safetensors").exists()
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(output_dir)] == [(1, num_processes)]

    # As the sentence advises: resumed from `latest` with the decay fixed, the run goes on with it and ends.
    resumed = run(training_command(num_processes, "--output_dir", output_dir, "--data_dir", small_data, "--batch_size", "8",
                                   "--num_epochs", "3", "--checkpointing_steps", "10", "--gamma", "1", "--log_interval", "1000",
                                   "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert "--lr 0.01 and --gamma 1.0 replace the 0.01 and 1e+40 of the run this checkpoint comes from." in resumed.stdout
    assert [(r["epoch"], r["lr"]) for r in read_metrics(output_dir)] == [(1, 0.01), (2, 0.01), (3, 0.01)]  # from step 60, in epoch 1


def test_a_resume_with_another_lr_and_gamma_records_the_rate_its_epoch_trains_at():
    """After two epochs at --lr 1 and --gamma 0.7, a resume with --lr 0.1 and --gamma 0.5 trains its epoch at
    0.1 x 0.5^2, and the epoch's record (scheduler.get_last_lr(), read before its scheduler.step()) says so: before,
    it said the checkpoint's 0.49 for that epoch. The scheduler is accelerate's wrapper around StepLR, as prepare()
    gives it; the accelerator a stand-in of which apply_flags_schedule only prints."""
    from accelerate.scheduler import AcceleratedScheduler

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    scheduler = AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7), optimizer, step_with_optimizer=False)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    checkpoints.apply_flags_schedule(SimpleNamespace(print=print), scheduler, lr=0.1, gamma=0.5)
    for epochs_done in (2, 3):
        assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == pytest.approx(0.1 * 0.5 ** epochs_done)
        scheduler.step()


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_first_rung_stops_a_diverged_run_too(num_processes, tmp_path):
    command = [*([sys.executable, LAUNCH, "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2"] if num_processes == 2 else [sys.executable]),
               SCRIPTS / "toy_mlp.py", "--output_dir", tmp_path / "run", "--lr", "1e30"]
    result = run(command, cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if "error:" in line] == [
        "error: Training diverged in epoch 2: the loss is nan. The learning rate is likely too high: lower --lr and train again in a "
        "new --output_dir."]
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(tmp_path / "run")] == [(1, num_processes)]  # its loss was finite


def wait_for_metrics(job, output_dir):
    deadline = time.monotonic() + 120
    while not (output_dir / "metrics.jsonl").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_second_launch_into_a_live_runs_folder_stops_and_touches_nothing(num_processes, small_data, tmp_path):
    """While a run trains, a second launch into its --output_dir, with --overwrite_output_dir or
    without, stops at once naming the live run's host and process, and leaves its files alone. Once
    the live run is killed, its folder no longer blocks a new run."""
    output_dir = tmp_path / "run"
    args = ["--output_dir", output_dir, "--data_dir", small_data, "--batch_size", "8", "--num_epochs", "200", "--log_interval", "1000"]
    # New interpreters: the error names the process holding the folder, and a fork is not among the launcher's.
    live = subprocess.Popen([str(part) for part in training_command(num_processes, *args)], cwd=tmp_path, env=new_interpreter_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launcher = psutil.Process(live.pid)  # the training process itself at 1 process
    try:
        wait_for_metrics(live, output_dir)
        holder = rank_process(launcher, 0)
        for process in [launcher, *launcher.children(recursive=True)]:  # paused, alive, holding its folder: the cores go to the launches below
            process.suspend()
        for extra in (["--overwrite_output_dir"], []):
            before = folder_snapshot(output_dir)
            second = run(training_command(num_processes, *args, *extra), cwd=tmp_path, check=False)
            assert second.returncode == 1 and "Traceback" not in second.stderr
            assert f"error: --output_dir {output_dir} is in use by a run still going (host {os.uname().nodename}, process {holder.pid}): " \
                   "wait for it to end, stop it, or choose another --output_dir." in second.stderr
            assert folder_snapshot(output_dir) == before, "every file of the live run's folder is as it was"
            assert live.poll() is None, "the live run goes on"
    finally:
        for process in [*launcher.children(recursive=True), launcher]:
            process.kill()
        live.communicate()
    # What an earlier run's --eval_only, --profile (at more processes) and --with_tracking left goes with it too.
    earlier = [output_dir / "eval.json", output_dir / "profile" / "trace_rank3.json", output_dir / "tensorboard" / "events.out.tfevents.1"]
    for path in earlier:
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}")
    run(training_command(num_processes, *args[:-4], "--num_epochs", "1", "--overwrite_output_dir"), cwd=tmp_path)
    assert [(r["epoch"], r["world_size"]) for r in read_metrics(output_dir)] == [(1, num_processes)]
    assert not any(path.parent.exists() if path.parent != output_dir else path.exists() for path in earlier)


def test_machines_started_differently_stop_before_the_first_step(small_data, tmp_path):
    """Two machines whose second has another --lr, then another copy of the script (with another --lr too: the code,
    which can explain other flags, is named first): both stop before the first step with one sentence naming the
    difference, and neither writes a model."""
    script = SCRIPTS / "cpu_gloo.py"
    changed = tmp_path / "elsewhere" / "cpu_gloo.py"
    changed.parent.mkdir()
    changed.write_text(script.read_text() + "# edited on one machine only\n")
    args = ["--data_dir", small_data, "--output_dir", tmp_path / "run", "--num_epochs", "1"]
    host = os.uname().nodename
    for machine_1, difference, advice in (
        ([script, *args, "--lr", "0.02"], f"--lr is 0.02 in process 1 on {host} but --lr is 0.01 in process 0 on {host}",
         "start every process with the same training flags."),
        ([changed, *args, "--lr", "0.02"], "cpu_gloo.py has SHA-256 ", "run the same code on every machine."),
        # --with_tracking decides whether a process checks the trackers' start, a collective: a difference would desync them.
        ([script, *args, "--with_tracking"], f"--with_tracking is True in process 1 on {host} but --with_tracking is False in process 0",
         "start every process with the same training flags."),
    ):
        results = two_machines(tmp_path, [[script, *args], machine_1])
        for result in results:  # each machine's terminal says it once
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
            (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
            assert line.startswith(f"error: The processes disagree before the first step: {difference}") and line.endswith(advice), line
        assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.parametrize("stopping", [0, 1])
def test_a_machine_that_stops_before_the_group_forms_ends_the_other_in_one_line_each(stopping, tmp_path):
    """One machine's processes stop on a mistake before the process group forms. The other's, waiting for
    them to join, gave up with a traceback each: after --ddp_timeout (machine 0 waiting), or at once when
    machine 0's launcher, which holds the rendezvous, had gone (machine 1 waiting). Now each leaves as a
    survivor of a lost peer (75), and its launcher names the lost connection."""
    probe = Path(__file__).resolve().parent / "probes" / "one_machine_stops_before_the_group.py"
    results = two_machines(tmp_path, [[probe, stopping], [probe, stopping]])
    stopped, waited = results[stopping], results[1 - stopping]
    assert stopped.returncode == 1 and error_lines(stopped.stderr) == [
        f"error: a mistake machine {stopping} found before the process group formed: fix it."], stopped.stderr[-3000:]
    assert waited.returncode == 1 and "Traceback" not in waited.stderr, waited.stderr[-3000:]
    assert error_lines(waited.stderr) == [f"error: Training stopped: rank {1 - stopping} lost the connection to another process of the run "
                                          "(that process ended, or the network to its machine failed). Resume with "
                                          "--resume_from_checkpoint latest if the run saved checkpoints."], waited.stderr[-3000:]
    if stopping == 1:  # machine 0 waited --ddp_timeout for it
        assert "[rank 0] stopped: no answer from another process within --ddp_timeout (wait timeout" in waited.stderr, waited.stderr[-3000:]


@pytest.mark.parametrize("finds_it", [1, 0])
def test_under_restarts_a_mistake_one_machine_alone_finds_ends_both_in_one_line_each(tmp_path, finds_it):
    """--max_restarts 1 on two machines, and one machine's process alone finds a mistake: it says it and
    ends its launch, which restarts nothing (every start would meet it again) and closes the rendezvous as
    it leaves. The other machine, which lost its peer, tries its restart and says that the other machine
    ended the run. Machine 1 finds the rendezvous closed; before, it blamed machine 0 as unreachable.
    Machine 0's launcher hosts the rendezvous, so machine 1 finds it gone; before, it was told to start
    machine 0, which had run and ended."""
    probe = Path(__file__).resolve().parent / "probes" / "alone_in_error.py"
    results = two_machines(tmp_path, [["--max_restarts", "1", probe, finds_it]] * 2)
    finder, other = results[finds_it], results[1 - finds_it]
    assert finder.returncode == 1 and error_lines(finder.stderr) == [f"error: a mistake only rank {finds_it} found: fix it."], finder.stderr[-3000:]
    assert "Restarting the run" not in finder.stderr, finder.stderr[-3000:]
    assert other.returncode == 1 and "Traceback" not in other.stderr, other.stderr[-3000:]
    ended = {1: "another machine's launcher ended the run (its own output says why)",
             0: "machine 0's launcher, which hosts the rendezvous of the machines at 127.0.0.1:PORT, ended the run (its own output "
                "says why) or can no longer be reached from here"}[finds_it]
    assert [re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line) for line in error_lines(other.stderr)] == [
        f"error: Training stopped: {ended}. Resume with --resume_from_checkpoint latest if the run saved checkpoints."], other.stderr[-3000:]


def test_under_restarts_machine_0_whose_peer_never_joins_ends_in_one_sentence(tmp_path):
    """--max_restarts makes the rendezvous torchrun's c10d one, where machine 0 waits for the others up to its join
    timeout (600 s; 3 s here): then one sentence. Before, machine 0 said that machine 0 was not running."""
    probe = Path(__file__).resolve().parent / "probes" / "alone_in_error.py"
    command = loopback_machine(0, free_port(), "--max_restarts", "1", "--rdzv_conf", "join_timeout=3", probe)
    result = run([python(), *command], cwd=tmp_path, check=False)
    assert result.returncode == 1 and [re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line) for line in error_lines(result.stderr)] == [
        "error: Training stopped: not every machine joined the rendezvous of the machines at 127.0.0.1:PORT within its join timeout: start "
        "every machine with the same profile, each able to reach that address, and where one was lost mid-run (its own output, if any, says "
        "why), resume with --resume_from_checkpoint latest on every machine if the run saved checkpoints."], result.stderr[-3000:]


def test_machines_whose_copies_of_a_checkpoint_differ_or_will_not_load_stop_before_the_first_step(small_data, tmp_path):
    """Machines with a disk each hold a copy each of every checkpoint, each checked against its own digests.
    Machine 1's copy here holds other weights, with digests to match, as one that another run saved there
    would (a resume on that machine alone): resumed together, or evaluated, both stop in one sentence;
    before, each trained, or scored its share of the test set, from its own weights. Then every copy is cut
    short, its digest recorded again: the load fails on every process, and each machine says so once, at
    once; before, a process not on machine 0 said it as a rank that failed alone ([rank 1] error), late. Last,
    --overwrite_output_dir sets each machine's run aside on its own disk, and puts it back where a check refuses."""
    from safetensors.torch import save_file

    flags = [SCRIPTS / "cpu_gloo.py", "--data_dir", small_data, "--num_epochs", "1", "--checkpointing_steps", "epoch"]
    folders = [tmp_path / "machine_0", tmp_path / "machine_1"]
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder] for folder in folders])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    # Machine 0 on a new, empty disk (a requeue onto another node): `latest` finds machine 1's copies and says so;
    # before, machine 0 found none on its own disk and the run started afresh, saving over machine 1's.
    shutil.move(folders[0], tmp_path / "machine_0_disk")
    before = folder_snapshot(folders[1])
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--resume_from_checkpoint", "latest", "--num_epochs", "2"]
                                      for folder in folders])
    for folder, result in zip(folders, results):
        assert result.returncode == 1 and error_lines(result.stderr) == [
            f"error: No checkpoint in {folder / 'checkpoints'} is intact on every machine's disk ({os.uname().nodename}'s disk has no copy of "
            "it): copy a machine's intact ones into the others' --output_dir, or put --output_dir on a disk they all share, then launch again."
        ], result.stderr[-3000:]
    assert folder_snapshot(folders[1]) == before and not folders[0].exists()
    shutil.move(tmp_path / "machine_0_disk", folders[0])
    other = latest_checkpoint(folders[1] / "checkpoints")
    save_file({name: tensor + 0.01 for name, tensor in load_file(other / "model.safetensors").items()}, other / "model.safetensors")
    record_digest_again(other, "model.safetensors")
    host = os.uname().nodename
    for folder in folders:  # killed before the model was saved: --eval_only of `latest` takes the checkpoint (a model file's copies are compared already)
        (folder / "model.safetensors").unlink()
    for resume in (["--num_epochs", "2"], ["--eval_only"]):
        results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--resume_from_checkpoint", "latest", *resume] for folder in folders])
        for result in results:
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
            (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
            assert line.startswith("error: The processes disagree before the first step: the loaded weights have SHA-256 ") and line.endswith(
                f"in process 0 on {host}: give every machine the same copy of the checkpoint (machine 0's), or resume from one they "
                "saved together."), line
    assert [record["epoch"] for record in read_metrics(folders[0])] == [1] and not (folders[0] / "eval.json").exists()
    for folder in folders:
        weights_file = latest_checkpoint(folder / "checkpoints") / "model.safetensors"
        weights_file.write_bytes(weights_file.read_bytes()[:100])
        record_digest_again(weights_file.parent, "model.safetensors")
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--resume_from_checkpoint", "latest", "--num_epochs", "2"]
                                      for folder in folders])
    for result in results:
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
        assert line.startswith(f"error: Checkpoint {latest_checkpoint(folders[0] / 'checkpoints')} could not be loaded ("), line

    # --overwrite_output_dir, each machine setting aside the run on its own disk: a resume refused after that (another run's
    # folder, named in place of a checkpoint) puts each back as it was; without it, each machine's holds the new run alone.
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)
    before = [folder_snapshot(folder) for folder in folders]
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--overwrite_output_dir", "--resume_from_checkpoint", tmp_path / "other"]
                                      for folder in folders])
    assert [result.returncode for result in results] == [1, 1] and [folder_snapshot(folder) for folder in folders] == before, (
        results[0].stderr[-3000:] + results[1].stderr[-3000:])
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--overwrite_output_dir"] for folder in folders])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    for folder in folders:
        assert [path.name for path in checkpoints_in(folder / "checkpoints")] == ["step_00000008"] and not list(folder.glob(".replaced*"))
    assert [(record["epoch"], record["world_size"]) for record in read_metrics(folders[0])] == [(1, 2)]

    # Machine 1's copy damaged, then machine 1 replaced by one with an empty disk (a requeue onto a new machine): machine 0's copy
    # is intact. Before, "no checkpoint to resume", advising --overwrite_output_dir, which would have deleted it.
    damaged = folders[1] / "checkpoints" / "step_00000008" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")
    for why in ("model.safetensors differs from what was saved", f"{host}'s disk has no copy of it"):
        results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--resume_from_checkpoint", "latest", "--num_epochs", "2"]
                                          for folder in folders])
        for folder, result in zip(folders, results):  # each machine names its own --output_dir
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
            assert [line for line in result.stderr.splitlines() if "error:" in line] == [
                f"error: No checkpoint in {folder / 'checkpoints'} is intact on every machine's disk ({why}): copy a machine's intact "
                "ones into the others' --output_dir, or put --output_dir on a disk they all share, then launch again."]
        assert [path.name for path in checkpoints_in(folders[0] / "checkpoints")] == ["step_00000008"]
        if why.startswith("model"):  # machine 1's copy is set aside, never deleted; then machine 1's disk is a new one
            assert [path.name for path in (folders[1] / "checkpoints").iterdir()] == ["damaged_step_00000008"]
            shutil.rmtree(folders[1])
    # As the sentence says: machine 0's checkpoints copied to machine 1, the run resumes on both and trains on.
    shutil.copytree(folders[0] / "checkpoints", folders[1] / "checkpoints")
    results = two_machines(tmp_path, [[*flags, "--output_dir", folder, "--resume_from_checkpoint", "latest", "--num_epochs", "2"]
                                      for folder in folders])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert [(record["epoch"], record["world_size"]) for record in read_metrics(folders[0])] == [(1, 2), (2, 2)]


def test_machines_launched_with_different_profiles_stop_before_the_first_step(small_data, tmp_path):
    """Machine 1 launched with bf16 (its copy of the profile edited): the same flags, but the Accelerators
    differ, which the processes compare too. The precision is compared by its effect, not by where it was
    set: the profile's bf16 on one machine and --mixed_precision bf16 on the other train."""
    args = [SCRIPTS / "cpu_gloo.py", "--data_dir", small_data, "--output_dir", tmp_path / "run", "--num_epochs", "1"]
    host = os.uname().nodename
    results = two_machines(tmp_path, [args, ["--mixed_precision", "bf16", *args]])
    for result in results:
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
        assert line == (f"error: The processes disagree before the first step: mixed precision is bf16 in process 1 on {host} but "
                        f"mixed precision is no in process 0 on {host}: launch every machine with the same launch profile settings."), line
    assert not (tmp_path / "run" / "model.safetensors").exists()
    # The same precision, from the profile on one machine and from the script's flag on the other, trains.
    results = two_machines(tmp_path, [["--mixed_precision", "bf16", *args], [*args, "--mixed_precision", "bf16"]])
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["world_size"] == 2


def probe_in_place(tmp_path, *flags):
    """Launch 2 processes of the stuck_in_collective probe: the launcher's process, once both are in place."""
    tmp_path.mkdir(exist_ok=True)
    command = [python(), LAUNCH, "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", PROBES / "stuck_in_collective.py",
               tmp_path, *flags]
    job = subprocess.Popen([str(part) for part in command], cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    wait_until(lambda: len([path for path in tmp_path.glob("waiting_*") if path.read_text()]) == 2, job, "both in place")  # written, not only created
    assert {path.read_text() for path in tmp_path.glob("waiting_*")} == {"2"}, "one group of 2"
    return job


def signal_the_probe_in_place(tmp_path, *flags, stop_signal=signal.SIGTERM, ranks=("0", "1")):
    """Launch 2 processes of the stuck_in_collective probe, signal `ranks` once they are in place; the
    seconds from the signal to the launcher's end, its exit code and its stderr."""
    job = probe_in_place(tmp_path, *flags)
    time.sleep(0.5)  # rank 1 is inside the barrier, or both in their save
    workers = [rank_naming(tmp_path, rank) for rank in ranks]
    signalled = time.monotonic()
    for worker in workers:
        worker.send_signal(stop_signal)
    _, stderr = job.communicate(timeout=30)
    return time.monotonic() - signalled, job.returncode, stderr


def test_a_process_stuck_in_a_collective_still_ends_on_sigterm(tmp_path):
    """With checkpointing on, SIGTERM only marks a stop that the processes agree on at their next
    check; a process blocked in a collective that never completes would never get there. Each ends
    with one line soon after the signal instead (the probe waits 3 s; the scripts 35)."""
    seconds, returncode, stderr = signal_the_probe_in_place(tmp_path)
    assert seconds < 15 and returncode == 143, stderr
    assert stderr.count("s after a signal to stop, this process was still waiting on another") == 2, stderr


def test_ctrl_c_to_a_process_stuck_in_a_collective_ends_it_as_ctrl_c(tmp_path):
    """Ctrl-C ends a process blocked in a collective after the grace, as SIGTERM does, but in the words
    and exit code of Ctrl-C, not those of a signal to stop (here to rank 1 alone: a rank 0 stopped at once
    by it would have torchrun end rank 1 first)."""
    seconds, _, stderr = signal_the_probe_in_place(tmp_path, stop_signal=signal.SIGINT, ranks=("1",))
    assert seconds < 15 and stderr.count("[rank 1] stopped: 3 s after Ctrl-C, this process was still waiting on another") == 1, stderr
    assert "rank 1 exited with code 130" in stderr and "Traceback" not in stderr, stderr


def test_a_signal_after_the_agreed_stop_writes_into_no_file(tmp_path):
    """Once the watchdog thread has woken, it reads no more signal numbers; a later signal (torchrun passes
    SIGTERM on while they save) must not land in a file: Python writes its number to the wakeup fd, whose
    number a closed socket would leave to the next file opened, a checkpoint's."""
    code = """if True:
        import os, signal, sys, time, types
        from shared.preemption import Preemption
        preemption = Preemption(types.SimpleNamespace(set_trigger=lambda: None, check_trigger=lambda: True), enabled=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        assert preemption.stop_agreed(10)
        time.sleep(1)  # the watchdog thread now watches the main thread, not the socket
        files = [open(os.path.join(sys.argv[1], name), "wb") for name in ("a", "b")]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        for file in files:
            file.write(b"saved")
            file.close()
    """
    result = run([sys.executable, "-c", code, tmp_path], cwd=tmp_path)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"saved" and not result.stderr, result.stderr


def test_a_process_that_stops_for_another_ones_signal_has_its_save_watched_too(tmp_path):
    """A stop agreed for another process's signal (Kubernetes preempting one machine's pod): this process had no
    signal, and its watchdog slept on, so a save whose peer was lost held it until --ddp_timeout (30 minutes by
    default). stop_agreed wakes it now: the save ends at BUSY_LIMIT_S with the line a signalled process gives. Not at
    the run's last step, which finishes the run instead: a watchdog woken there could end a healthy process in its last
    evaluation or the model's save (here a wait past GRACE_S, which it outlives). The Accelerator is a stand-in whose
    check_trigger says another process set the trigger."""
    code = """if True:
        import time, types
        from shared.preemption import Preemption
        Preemption.GRACE_S, Preemption.BUSY_LIMIT_S = 1, 2
        accelerator = types.SimpleNamespace(set_trigger=lambda: None, check_trigger=lambda: True, process_index=1)
        preemption = Preemption(accelerator, enabled=True)
        assert not preemption.stop_agreed(10, last_step=True)
        def end_training():
            time.sleep(4)  # one C call, past GRACE_S
        end_training()
        assert preemption.stop_agreed(20)
        def save_state():
            time.sleep(120)  # one C call, as a save whose peer is lost
        save_state()
    """
    started = time.monotonic()
    result = run([sys.executable, "-c", code], cwd=tmp_path, check=False)
    assert result.returncode == 143 and result.stderr == ("[rank 1] stopped: 2 s after a signal to stop, this process was still waiting on "
                                                         "another, so it could not save a checkpoint; the newest complete one stays 'latest'.\n"), result.stderr
    assert time.monotonic() - started < 60


def test_a_killed_dataloader_worker_ends_the_run_at_once(data_dir, tmp_path):
    """A DataLoader worker SIGKILLed (the kernel's OOM killer) mid-epoch: torch's error, and the process ends within
    seconds. Python's exit then ends the workers left with SIGTERM, which a worker must still obey from its parent
    while it leaves other processes' SIGTERM to the training process: ignoring every SIGTERM, it hung the exit."""
    job = subprocess.Popen([sys.executable, SCRIPTS / "cpu_gloo.py", "--output_dir", tmp_path / "run", "--data_dir", data_dir, "--batch_size", "8",
                            "--num_epochs", "50", "--data_pipeline", "torchvision", "--num_workers", "2", "--checkpointing_steps", "1000"],
                           cwd=tmp_path, env=new_interpreter_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(psutil.Process(job.pid).children()) < 2:  # a new interpreter: its workers are its children
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    time.sleep(1)  # into the epoch
    killed_at = time.monotonic()
    while job.poll() is None and time.monotonic() < killed_at + 60:
        # An epoch lasts about a second: the worker listed may have ended with its epoch, or be killed while its
        # loader shuts it down, which torch rightly ignores. Kill a worker alive now until the run ends.
        with contextlib.suppress(psutil.NoSuchProcess, IndexError):
            psutil.Process(job.pid).children()[0].kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=5)
    if job.poll() is None:
        for process in [*psutil.Process(job.pid).children(), psutil.Process(job.pid)]:  # the hung process and its workers
            process.kill()
    _, stderr = job.communicate()
    assert job.returncode == 1 and "is killed by signal: Killed" in stderr and time.monotonic() - killed_at < 30, stderr[-3000:]


def test_a_save_longer_than_the_grace_after_sigterm_completes(tmp_path):
    """A process inside a save after the signal is busy, not stuck, while its one line takes less than
    BUSY_LIMIT_S (as safetensors writes a whole file in one call): both finish their 6 s save, past the
    probe's 3 s grace. A save that never ends (its peer lost) ends at the probe's 10 s limit."""
    seconds, returncode, stderr = signal_the_probe_in_place(tmp_path / "slow", "--slow_save")
    assert returncode == 0 and "after a signal to stop" not in stderr, stderr
    assert sorted(path.name for path in (tmp_path / "slow").glob("saved_*")) == ["saved_0", "saved_1"]
    assert seconds > 3, "the save outlasted the grace"
    seconds, returncode, stderr = signal_the_probe_in_place(tmp_path / "stuck", "--stuck_save")
    assert 10 < seconds < 25 and returncode == 143, stderr
    assert stderr.count("10 s after a signal to stop, this process was still waiting on another") == 2, stderr


def test_a_process_killed_by_another_hand_while_the_processes_stop_is_not_blamed_on_the_launcher(tmp_path):
    """SIGTERM to the launcher, which passes it on to both processes of the probe, which then stay in their save
    (--stuck_save); rank 0 is then SIGKILLed, as by the kernel's out-of-memory killer, and rank 1's watchdog ends it at the
    probe's 10 s, well inside the launcher's 90 s wait. Before, the launcher said it had killed them after its wait."""
    job = probe_in_place(tmp_path, "--stuck_save")
    job.send_signal(signal.SIGTERM)
    signalled = tmp_path / "signalled_0"
    wait_until(lambda: signalled.exists() and signalled.read_text(), job, "the signal, passed on by torchrun, at rank 0")  # written, not only created
    rank_naming(tmp_path, 0).kill()
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 143 and error_lines(stderr) == [
        "error: Training stopped: a training process was killed (SIGKILL: the kernel's out-of-memory killer, or a person) while the "
        "processes stopped after the signal: the newest complete checkpoint, if any, stays 'latest'."], stderr[-3000:]
    assert "[rank 1] stopped: 10 s after a signal to stop" in stderr, stderr[-3000:]


def test_the_watchdog_outwaits_torchruns_kill_after_a_failure_and_fits_in_its_wait_after_a_signal():
    """After a process fails, torchrun sends the others SIGTERM and kills them 30 s on (its close()'s default, which
    scripts/launch.py leaves alone); one blocked in a collective with the lost one must end killed then, which a restart
    follows, not in the watchdog's 143, a stop to save after which no restart comes. After a signal to stop, torchrun
    waits 90 s (scripts/launch.py), inside which the watchdog must end a stuck process with its line."""
    import inspect

    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext  # torchrun's, for `python SCRIPT`

    from shared.preemption import Preemption

    assert PContext.close.__defaults__ == (None, 30) and "self.close()" in inspect.getsource(SubprocessContext._poll)
    assert 30 < Preemption.GRACE_S < 90
    assert 'os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")' in LAUNCH.read_text()


def test_a_process_waiting_for_its_data_after_sigterm_is_not_taken_for_stuck(tmp_path):
    """A loop that waits on its DataLoader's workers calls the same line over and over, each call inside one
    C call: the watchdog sampled that line at every look and ended a process making progress, losing what it
    had trained since its last checkpoint. It follows the call itself now: both processes go on past the
    probe's 3 s grace and end their loop."""
    seconds, returncode, stderr = signal_the_probe_in_place(tmp_path, "--waiting_for_data")
    assert returncode == 0 and "after a signal to stop" not in stderr, stderr
    assert sorted(path.name for path in tmp_path.glob("finished_*")) == ["finished_0", "finished_1"]
    assert seconds > 3, "the loop outlasted the grace"


def test_a_save_after_the_agreed_stop_whose_peer_is_lost_ends_at_the_limit(tmp_path):
    """The processes agreed to stop, and save: a peer lost in that save (a machine gone, which closes no
    connection) would hold them in its collective until --ddp_timeout; the watchdog ends them at BUSY_LIMIT_S."""
    seconds, returncode, stderr = signal_the_probe_in_place(tmp_path, "--stuck_save_once_agreed")
    assert 10 < seconds < 25 and returncode == 143, stderr
    assert stderr.count("10 s after a signal to stop, this process was still waiting on another") == 2, stderr
