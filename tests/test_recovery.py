"""Runs that recover by themselves: a signal to stop saves a checkpoint first, restarts after a lost
process finish the run, two hosts on a real network stop (never hang) when the link goes, and the
CPU profile puts any Accelerate script into one gloo group. Every resumed run ends bitwise equal to
one that never stopped."""

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import CONFIGS, PAUSE_PROBE, SCRIPTS, all_paused, checkpoints_in, error_lines, free_port, latest_checkpoint, loopback_machine, new_interpreter_env, paused_at, processes_naming, python, python_command, rank_naming, read_metrics, run, script_env, start_fork_servers, stop_fork_servers, wait_until
from synthetic_digits import write_small_mnist
from test_features import assert_same_records, assert_same_weights, weights

PROBES = SCRIPTS.parent / "tests" / "probes"
# 512 samples in steps of 8: 64 steps an epoch, long enough to be interrupted in the middle.
FLAGS = ["--batch_size", "8", "--num_epochs", "3", "--log_interval", "1000"]
STOP_WAIT_S = 30  # how long a signalled or failed run may take to end in these tests


def launch(*args, num_processes=2, launcher_flags=(), script=SCRIPTS / "cpu_gloo.py"):
    """python scripts/launch.py --config_file cpu.yaml --num_processes N [launcher flags] cpu_gloo.py ..., on a port of this
    test worker's own (conftest.launch_command says why)."""
    return [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", num_processes,
            "--main_process_port", free_port(), *launcher_flags, script, *args]


def launch_one_process(*args):
    """python scripts/launch.py --cpu --num_processes 1 cpu_gloo.py ...: accelerate's one-process launcher, as 1gpu.yaml's."""
    return [sys.executable, SCRIPTS / "launch.py", "--cpu", "--num_processes", 1, SCRIPTS / "cpu_gloo.py", *args]


def start(command, cwd, env=None):
    return subprocess.Popen([str(part) for part in command], cwd=cwd, env=env or script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def training_process(job, rank):
    """The training process of `rank` among the launcher's descendants (never the launcher itself)."""
    for process in psutil.Process(job.pid).children(recursive=True):
        try:
            if process.environ().get("RANK") == str(rank) and any(name in " ".join(process.cmdline()) for name in ("cpu_gloo.py", PAUSE_PROBE.name)):
                return process
        except psutil.Error:
            continue
    pytest.fail(f"no training process of rank {rank}")


def assert_world_size(output_dir, world_size=2):
    """Every epoch of the run was trained by one group of `world_size` processes (not each alone)."""
    assert {record["world_size"] for record in read_metrics(output_dir)} == {world_size}


def epochs_done(output_dir):
    return lambda: (output_dir / "metrics.jsonl").exists() and len(read_metrics(output_dir)) >= 1


def finish(job, timeout, output_dir=None):
    """The job's output once it ends within timeout; else it and its processes (those naming output_dir too: a forked
    launcher's are not its client's children) are killed, and the test fails with them listed."""
    try:
        return job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        descendants = psutil.Process(job.pid).children(recursive=True)  # some in sessions of their own, as torchrun starts them
        descendants += processes_naming(output_dir) if output_dir else []
        tree = [f"{process.pid} {process.status()} {' '.join(process.cmdline())[-120:]}" for process in descendants]
        for process in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"the run was still going {timeout} s later\n" + "\n".join(tree) + f"\n{stdout[-1500:]}\n{stderr[-3000:]}")


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory, fork_servers):
    """The run an interrupted one must end like: cpu_gloo.py with FLAGS at 2 processes, never stopped and
    saving no checkpoint (saving them changes nothing: test_features.py)."""
    output_dir = tmp_path_factory.mktemp("reference") / "run"
    run(launch("--output_dir", output_dir, "--data_dir", small_data, *FLAGS), cwd=output_dir.parent)
    assert_world_size(output_dir)
    return output_dir


# -- preemption: save, then exit --------------------------------------------------------------------

@pytest.mark.parametrize("target, stop_signal, loader", [("launcher", signal.SIGTERM, "memory"), ("rank 1", signal.SIGUSR1, "memory"),
                                                         ("launcher", signal.SIGTERM, "workers")])
def test_a_signal_to_stop_saves_then_exits_and_the_resume_is_bitwise(target, stop_signal, loader, small_data, reference, tmp_path):
    """SIGTERM to the launcher (as `kill` on the job, or SLURM, sends it), or SLURM's SIGUSR1 to one rank:
    every process stops after the same step, a checkpoint of it is saved, the job exits non-zero within
    torchrun's grace period, and rank 0 says where it stopped. The run waits for the signal after step 70
    (tests/probes/pause_at_step.py), so that the signal reaches it inside epoch 2 however busy the machine.
    With DataLoader workers (`workers`): torchrun signals each training process's whole process group, the
    workers too; before, torch's SIGTERM handler in each worker ended it, and the training process stopped
    in "DataLoader worker is killed by signal", with no checkpoint."""
    args = ["--data_dir", small_data, *FLAGS, "--checkpointing_steps", "1000"]  # no scheduled save before the end
    env = script_env()
    if loader == "workers":  # started by torchrun as new interpreters: a fork server's forks sit outside its process groups
        args, env = [*args, "--data_pipeline", "torchvision", "--num_workers", "2"], new_interpreter_env()

    stopped = tmp_path / "stopped"
    ranks = [0, 1] if target == "launcher" else [1]  # rank 0 waits for rank 1 in the step's check for a signal
    job = start(launch("--output_dir", stopped, *args, script=PAUSE_PROBE), tmp_path, env={**env, **paused_at([70], tmp_path, ranks)})
    wait_until(lambda: all_paused(tmp_path, ranks, 70), job, "the pause after step 70")
    receiver = psutil.Process(job.pid) if target == "launcher" else training_process(job, 1)
    receiver.send_signal(stop_signal)
    signalled_at = time.monotonic()
    _, stderr = finish(job, STOP_WAIT_S)
    print(f"the job exited {time.monotonic() - signalled_at:.2f} s after the signal")
    assert job.returncode == 143, stderr
    (line,) = [line for line in stderr.splitlines() if "Stopped by a signal to stop" in line]
    saved = latest_checkpoint(stopped / "checkpoints")
    assert line == f"Stopped by a signal to stop: saved {saved} after step {int(saved.name[5:])}; continue with --resume_from_checkpoint latest."
    assert saved.name == "step_00000070" and not (stopped / "model.safetensors").exists()
    assert "Traceback" not in stderr
    assert_world_size(stopped)  # epoch 1, before the signal, trained as one group of 2
    if loader == "workers":  # the torchvision pipeline resumes bitwise: tests/test_pipeline.py
        return

    resumed = run(launch("--output_dir", stopped, *args, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert f"Resumed from {saved}: epoch 2, " in resumed.stdout, resumed.stdout[-2000:]
    assert_world_size(stopped)
    assert_same_weights(weights(reference), weights(stopped))
    assert_same_records(read_metrics(reference), read_metrics(stopped), rel=1e-6)


def test_a_signal_late_in_an_epoch_stops_it_before_its_evaluation_and_the_resume_is_bitwise(small_data, reference, tmp_path):
    """A signal after the epoch's last check every 10 steps (step 60 of its 64): the processes check again at its last
    step, save there and stop, before the epoch's evaluation, which a larger test set could make outlast torchrun's wait.
    Before, they evaluated, recorded the epoch and trained on to step 70. The resumed run evaluates the epoch first."""
    args = ["--data_dir", small_data, *FLAGS, "--checkpointing_steps", "1000"]
    stopped = tmp_path / "stopped"
    # Rank 1 waits after step 60, before its check; rank 0 waits for it inside the check's all-reduce, past its look at its
    # own mark (its checking_ file says so), when the signal comes: the check at step 60 finds no mark, and the next is the
    # epoch's last step.
    job = start(launch("--output_dir", stopped, *args, script=PAUSE_PROBE), tmp_path, env={**script_env(), **paused_at([60], tmp_path, [1])})
    wait_until(lambda: all_paused(tmp_path, [1], 60) and (tmp_path / "checking_0_at_60").exists(), job, "step 60's check")
    training_process(job, 0).send_signal(signal.SIGTERM)
    time.sleep(0.5)  # delivered: its handler runs once the all-reduce returns
    (tmp_path / "go").touch()
    _, stderr = finish(job, STOP_WAIT_S)
    assert job.returncode == 143, stderr[-3000:]
    assert latest_checkpoint(stopped / "checkpoints").name == "step_00000064" and not read_metrics(stopped), stderr[-3000:]
    resumed = run(launch("--output_dir", stopped, *args, "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert ": epoch 1, 64 batches in, step 64." in resumed.stdout, resumed.stdout[-2000:]
    assert_world_size(stopped)
    assert_same_weights(weights(reference), weights(stopped))
    assert_same_records(read_metrics(reference), read_metrics(stopped), rel=1e-6)


def test_a_signal_whose_save_outlasts_torchruns_wait_says_so(small_data, tmp_path):
    """TORCH_ELASTIC_SHUTDOWN_TIMEOUT=0: torchrun kills the processes at once after passing SIGTERM on, before
    any saves. The launcher says so and still exits 143 (a cluster requeues the job, to resume from the newest
    complete checkpoint); before, it exited 143 in silence, as if they had saved."""
    args = ["--output_dir", tmp_path / "stopped", "--data_dir", small_data, *FLAGS, "--checkpointing_steps", "1000"]
    job = start(launch(*args, script=PAUSE_PROBE), tmp_path, env={**script_env(), **paused_at([70], tmp_path), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"})
    wait_until(lambda: all_paused(tmp_path, (0, 1), 70), job, "the pause after step 70")
    job.send_signal(signal.SIGTERM)
    _, stderr = finish(job, STOP_WAIT_S)
    assert job.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert error_lines(stderr) == ["error: Training stopped: the launcher killed the processes 0 s after passing the signal on, before every one "
                                   "had ended: the newest complete checkpoint, if any, stays 'latest'; for a longer save, raise "
                                   "TORCH_ELASTIC_SHUTDOWN_TIMEOUT."], stderr[-3000:]
    assert not checkpoints_in(tmp_path / "stopped" / "checkpoints")
    assert_world_size(tmp_path / "stopped")


def test_the_one_process_launcher_kills_a_process_that_outlasts_its_wait_after_a_signal(tmp_path):
    """accelerate's one-process launch (1gpu.yaml) has no torchrun to kill a process whose save hangs after the signal:
    the launcher waited for it forever, and the job ended only at the cluster's time limit, never requeued. It now
    kills it TORCH_ELASTIC_SHUTDOWN_TIMEOUT after passing the signal on, as torchrun does, says so and exits 143."""
    probe = tmp_path / "hangs.py"
    probe.write_text("import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: None)\n"
                     "pathlib.Path(sys.argv[1]).touch()\nwhile True:\n    time.sleep(0.1)\n")
    job = start([sys.executable, SCRIPTS / "launch.py", "--cpu", "--num_processes", 1, probe, tmp_path / "ready"], tmp_path,
                env={**script_env(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"})
    wait_until(lambda: (tmp_path / "ready").exists(), job, "the probe's start")
    job.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    _, stderr = finish(job, STOP_WAIT_S)
    assert job.returncode == 143 and time.monotonic() - signalled_at < 15, stderr[-3000:]
    assert error_lines(stderr) == ["error: Training stopped: the launcher killed the processes 2 s after passing the signal on, before every one "
                                   "had ended: the newest complete checkpoint, if any, stays 'latest'; for a longer save, raise "
                                   "TORCH_ELASTIC_SHUTDOWN_TIMEOUT."], stderr[-3000:]


def test_a_signal_after_the_runs_last_check_lets_it_finish_and_the_launcher_exits_0(small_data, tmp_path):
    """SIGTERM to the launcher after the processes' last check (paused after step 70 of --max_train_steps 70): the
    run finishes, saves its model, and each process exits 0; so does the launcher. Before, it exited 143, on which
    a cluster requeues the job, whose resume then stops in "already trained 70 steps" (exit 1)."""
    output_dir = tmp_path / "finished"
    args = ["--output_dir", output_dir, "--data_dir", small_data, *FLAGS, "--checkpointing_steps", "1000", "--max_train_steps", "70"]
    job = start(launch(*args, script=PAUSE_PROBE), tmp_path, env={**script_env(), **paused_at([70], tmp_path)})
    wait_until(lambda: all_paused(tmp_path, (0, 1), 70), job, "the pause after step 70")
    job.send_signal(signal.SIGTERM)
    stdout, stderr = finish(job, STOP_WAIT_S)
    assert job.returncode == 0 and "Traceback" not in stderr and "Stopped by" not in stderr, stderr[-3000:]
    assert {path.name for path in tmp_path.glob("signalled_*")} == {"signalled_0", "signalled_1"}, "torchrun passed it on"
    assert f"Saved the trained model to {output_dir / 'model.safetensors'}" in stdout, stdout[-2000:]
    assert not checkpoints_in(output_dir / "checkpoints")
    assert_world_size(output_dir)


def test_a_signal_whose_save_fails_ends_in_its_sentence_and_exit_1_not_143(small_data, tmp_path):
    """SIGUSR1, SLURM's warning, to the launcher and its processes, whose save then fails (a file stands where
    the checkpoints folder goes): the save's sentence, and the launcher exits 1. Before, it exited 143, on which
    the SLURM script requeues the job to resume from the checkpoint that 143 promises."""
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "checkpoints").touch()
    args = ["--output_dir", tmp_path / "stopped", "--data_dir", small_data, *FLAGS, "--checkpointing_steps", "1000"]
    job = start(launch(*args, script=PAUSE_PROBE), tmp_path, env={**script_env(), **paused_at([70], tmp_path)})
    wait_until(lambda: all_paused(tmp_path, (0, 1), 70), job, "the pause after step 70")
    for process in (training_process(job, 0), training_process(job, 1), psutil.Process(job.pid)):  # as SLURM signals a job step
        process.send_signal(signal.SIGUSR1)
    _, stderr = finish(job, STOP_WAIT_S)
    assert job.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if "error:" in line]
    assert line.startswith(f"error: Could not write {tmp_path / 'stopped' / 'checkpoints' / 'step_00000070'} (") and line.endswith(
        "then start again: this run saved no checkpoint before."), line
    assert "Stopped by a signal to stop" not in stderr
    assert_world_size(tmp_path / "stopped")  # epoch 1, recorded before the pause at step 70
    assert_no_process_left(tmp_path)


@pytest.mark.parametrize("how", ["python", "launcher", "slurm"])
def test_one_process_saves_on_a_signal_too(how, small_data, tmp_path):
    """One process started by python, or by the one-process launcher (accelerate's simple launcher, as
    1gpu.yaml uses), signalled as Kubernetes does (SIGTERM to the launcher alone) or as SLURM's --signal
    does (SIGUSR1 to the launcher and the process): it saves a checkpoint inside epoch 2 or later,
    exits 143, and no training process is left behind."""
    args = ["--data_dir", small_data, "--output_dir", tmp_path / "stopped", "--batch_size", "8", "--num_epochs", "200",
            "--checkpointing_steps", "epoch"]
    job = start(python_command("cpu_gloo.py", *args) if how == "python" else launch_one_process(*args), tmp_path)
    wait_until(epochs_done(tmp_path / "stopped"), job, "its first epoch")
    if how == "slurm":
        training = psutil.Process(job.pid).children()[0]
        assert "cpu_gloo.py" in " ".join(training.cmdline())
        training.send_signal(signal.SIGUSR1)
    job.send_signal(signal.SIGUSR1 if how == "slurm" else signal.SIGTERM)
    _, stderr = finish(job, STOP_WAIT_S)
    assert job.returncode == 143, stderr[-2000:]
    saved = latest_checkpoint(tmp_path / "stopped" / "checkpoints")  # the signal's, after epoch 1's at step 64
    step = int(saved.name[5:])
    assert step > 64 and f"Stopped by a signal to stop: saved {saved} after step {step}; continue with --resume_from_checkpoint latest." \
        in stderr.splitlines(), stderr[-2000:]
    assert_no_process_left(tmp_path)


def assert_no_process_left(tmp_path):
    assert not (left := processes_naming(tmp_path)), f"still running after the launcher exited: {left}"


@pytest.mark.parametrize("num_processes, stop_signal", [(1, signal.SIGTERM), (2, signal.SIGTERM), (1, signal.SIGHUP)],
                         ids=["1-SIGTERM", "2-SIGTERM", "1-SIGHUP"])
def test_without_checkpointing_a_signal_stops_the_run_at_once(num_processes, stop_signal, small_data, tmp_path):
    """SIGTERM to the launcher, torchrun's (2 processes) or the one-process one: every process stops,
    nothing is saved, and the launcher exits 143 with a line that says so. SIGHUP, as a lost SSH session sends it: the one-process
    launcher passes it on too (before, it died alone and its process trained on, orphaned) and exits 129."""
    args = ["--output_dir", tmp_path / "run", "--data_dir", small_data, "--batch_size", "8", "--num_epochs", "200"]
    job = start(launch_one_process(*args) if num_processes == 1 else launch(*args), tmp_path)
    wait_until(epochs_done(tmp_path / "run"), job, "its first epoch")
    os.kill(job.pid, stop_signal)
    signalled_at = time.monotonic()
    _, stderr = finish(job, STOP_WAIT_S)
    # About 1 s here: no epoch's end or save awaited, nor the kill at STOP_WAIT_S (a loaded machine may take several).
    assert time.monotonic() - signalled_at < 20, stderr[-2000:]
    expected = 143 if stop_signal == signal.SIGTERM else 128 + stop_signal
    assert job.returncode == expected and not (tmp_path / "run" / "checkpoints").exists(), stderr[-2000:]
    # Said, where before the launcher exited in silence (its 143 says, elsewhere, that the processes saved).
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
        f"Stopped by {stop_signal.name}: the training processes ended at once, without saving a checkpoint (they save one only on "
        "SIGTERM or SIGUSR1, with --checkpointing_steps, once training has started). Resume with --resume_from_checkpoint latest if "
        "the run saved checkpoints."), stderr[-2000:]
    assert_world_size(tmp_path / "run", num_processes)
    assert_no_process_left(tmp_path)


@pytest.mark.parametrize("machine_rank, launcher_flags, stop_signal", [
    (1, [], signal.SIGUSR1), (1, [], signal.SIGINT), (1, ["--max_restarts", "1"], signal.SIGUSR1), (0, ["--max_restarts", "1"], signal.SIGTERM)],
    ids=["machine 1-SIGUSR1", "machine 1-Ctrl-C", "machine 1 with restarts-SIGUSR1", "machine 0 with restarts-SIGTERM"])
def test_a_signal_while_the_launch_waits_for_the_other_machines_ends_it_at_once(machine_rank, launcher_flags, stop_signal, tmp_path):
    """One machine of two waits for the other, with no training process yet: SLURM's SIGUSR1 or SIGTERM
    ends the launch within seconds with 143, which the SLURM script requeues, Ctrl-C with 130, each in one
    line. Machine 1 waits on a machine 0 that accepts its connection and never answers, blocked in C++
    (the static rendezvous's store, or under --max_restarts c10d's connect); machine 0 waits for a
    machine 1 that never comes, in c10d's loop of Python. Before, SIGUSR1 killed the launcher (138) and
    Ctrl-C went unanswered until the rendezvous timed out."""
    with socket.create_server(("127.0.0.1", 0)) as silent_machine_0:
        silent_machine_0.settimeout(120)
        port = silent_machine_0.getsockname()[1] if machine_rank == 1 else free_port()
        job = start([sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", 2, *launcher_flags,
                     "--num_machines", 2, "--machine_rank", machine_rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                     "--rdzv_conf", "timeout=120,read_timeout=120", SCRIPTS / "toy_mlp.py", "--output_dir", tmp_path / "run"], tmp_path)
        if machine_rank == 1:
            connection, _ = silent_machine_0.accept()  # machine 1 waits at the rendezvous now
        else:  # machine 0 hosts the store at the port, then joins its rendezvous a moment later
            wait_until(lambda: any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.Process(job.pid).net_connections()),
                       job, "machine 0's store")
            time.sleep(3)
            connection = contextlib.nullcontext()
        with connection:
            job.send_signal(stop_signal)
            _, stderr = finish(job, 15)
    assert job.returncode == (130 if stop_signal == signal.SIGINT else 143), stderr[-2000:]
    name = "Ctrl-C" if stop_signal == signal.SIGINT else stop_signal.name
    assert f"Stopped by {name} while the launch waited for the other machines" in stderr.splitlines()[-1], stderr[-2000:]
    assert stderr.count("Stopped by") == 1, stderr[-2000:]
    assert "Traceback" not in stderr and not (tmp_path / "run").exists()
    assert_no_process_left(tmp_path)


# -- elastic restarts ---------------------------------------------------------------------------------

def test_restarts_after_killed_processes_finish_the_run_bitwise(small_data, reference, tmp_path):
    """--max_restarts: a rank SIGKILLed, then after the first restart a rank that exits 1 as a crash does (a
    mistake's exit 1 ends the run: test_restarts_stop_at_a_mistake_...), each restarted with one line and no
    traceback; then SLURM's SIGUSR1 to the launcher saves and exits 143 (the earlier exit 1 does not make it
    a failed save's 1), and the resumed run ends with the weights of a run that never stopped."""
    args = ["--data_dir", small_data, *FLAGS, "--checkpointing_steps", "20", "--resume_from_checkpoint", "latest"]
    restarted = tmp_path / "restarted"
    # Both processes wait after steps 70, 110 and 150 (tests/probes/pause_at_step.py), however busy the machine: one is
    # killed in epoch 2, one exits 1 later in it after the first restart resumed, and the signal comes in epoch 3 (192 steps in all).
    job = start(launch("--output_dir", restarted, *args, launcher_flags=["--max_restarts", "3"], script=PAUSE_PROBE), tmp_path,
                env={**script_env(), **paused_at([70, 110, 150], tmp_path)})
    wait_until(lambda: all_paused(tmp_path, (0, 1), 70), job, "the pause after step 70")
    training_process(job, random.randrange(2)).kill()
    wait_until(lambda: all_paused(tmp_path, (0, 1), 110), job, "the pause after step 110")
    (tmp_path / f"exit_1_{random.randrange(2)}").touch()
    wait_until(lambda: all_paused(tmp_path, (0, 1), 150), job, "the pause after step 150")
    job.send_signal(signal.SIGUSR1)
    stdout, stderr = finish(job, 240)
    assert job.returncode == 143 and f"Stopped by a signal to stop: saved {restarted / 'checkpoints' / 'step_00000150'}" in stderr, stderr[-3000:]
    # (A progress bar cut short by the kill may stand before a line on the same terminal row.)
    restarts = [line[line.index("Restarting the run"):] for line in stderr.splitlines() if "Restarting the run" in line]
    assert [line.split(":")[0] for line in restarts] == ["Restarting the run (1 of 3 restarts)", "Restarting the run (2 of 3 restarts)"], stderr[-5000:]
    assert "was killed by signal 9; it resumes from its newest checkpoint." in restarts[0], stderr[-5000:]
    assert "exited with code 1; it resumes from its newest checkpoint." in restarts[1], stderr[-5000:]
    assert stdout.count("Restart 1 after a lost process: resumed from") == 1 and "Restart 2 after a lost process" in stdout
    assert "Traceback" not in stderr, stderr[-3000:]

    run(launch("--output_dir", restarted, *args, launcher_flags=["--max_restarts", "3"]), cwd=tmp_path)
    assert len(checkpoints_in(restarted / "checkpoints")) == 2, "under restarts only the newest two are kept"
    assert_world_size(restarted)
    assert_same_weights(weights(reference), weights(restarted))
    assert_same_records(read_metrics(reference), read_metrics(restarted), rel=1e-6)


@pytest.mark.parametrize("restarts, stop_signal", [(1, signal.SIGTERM), (0, signal.SIGTERM), (1, signal.SIGHUP)])
def test_a_signal_while_torchrun_stops_the_processes_to_restart_them_ends_in_143_and_one_line(restarts, stop_signal, small_data, tmp_path):
    """SIGTERM to the launcher while torchrun stops the other processes after one crashed, to restart them (a
    preemption can come at any moment; the stop takes seconds, as the survivor finds its peer gone): the run ends in
    143, on which the SLURM script requeues it, and one line. Before, the crashed process's exit 1 read as a save
    that failed after the signal: exit 1 in silence, which no requeue follows. With no restart due, the crash ends
    the run in its exit 1 as it would have without the signal. SIGHUP (a lost terminal) ends it in 129, not in
    the 143 of a run to requeue, as SIGHUP does at any other time."""
    output_dir = tmp_path / "run"
    job = start(launch("--output_dir", output_dir, "--data_dir", small_data, *FLAGS, "--checkpointing_steps", "20",
                       launcher_flags=["--max_restarts", restarts], script=PAUSE_PROBE), tmp_path, env={**script_env(), **paused_at([70], tmp_path)})
    wait_until(lambda: all_paused(tmp_path, (0, 1), 70), job, "the pause after step 70")
    survivor = training_process(job, 0)
    (tmp_path / "exit_1_1").touch()  # rank 1 crashes; torchrun, which looks every 0.1 s, then stops rank 0 with SIGTERM
    wait_until(lambda: (tmp_path / "signalled_0").exists(), job, "torchrun's SIGTERM to rank 0")
    assert survivor.is_running(), "rank 0 takes seconds to stop: it waits before it leaves a group whose peer is gone"
    job.send_signal(stop_signal)
    _, stderr = finish(job, STOP_WAIT_S + 60)
    assert "Traceback" not in stderr and "Restarting" not in stderr, stderr[-3000:]
    line = (f"Stopped by {stop_signal.name} while torchrun stopped the processes after one failed, to restart them: nothing trained since "
            "the newest checkpoint; resume with --resume_from_checkpoint latest if the run saved checkpoints.")
    if restarts:  # SIGHUP (a lost terminal) ends the launch in its own 129, on which the SLURM script requeues nothing
        # (SIGHUP ends the processes at once: one's progress bar, cut short, may stand before the line on its terminal row.)
        assert job.returncode == (143 if stop_signal == signal.SIGTERM else 129) and stderr.splitlines()[-1].endswith(line), stderr[-3000:]
    else:
        assert job.returncode == 1 and line not in stderr, stderr[-3000:]
    assert latest_checkpoint(output_dir / "checkpoints").name == "step_00000060"
    assert_world_size(output_dir)  # epoch 1 (64 steps) was trained by one group of 2
    assert_no_process_left(tmp_path)


def test_restarts_stop_at_a_mistake_which_every_start_would_meet_again(small_data, tmp_path):
    """--max_restarts 2 (the SLURM script passes 3) and a run that diverges in epoch 2 (--gamma 1e40): the
    mistake is said once and ends the job with exit 1, as without restarts. Before, torchrun restarted the
    run twice, each start resuming from epoch 1's checkpoint to diverge again and say so again."""
    args = ["--data_dir", small_data, "--batch_size", "8", "--num_epochs", "3", "--checkpointing_steps", "10", "--gamma", "1e40",
            "--log_interval", "1000", "--resume_from_checkpoint", "latest"]
    result = run(launch("--output_dir", tmp_path / "run", *args, launcher_flags=["--max_restarts", "2"]), cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert line.startswith("error: Training diverged in epoch 2: "), line
    assert "Restarting the run" not in result.stderr and "Resumed from" not in result.stdout, result.stderr[-3000:]
    assert_world_size(tmp_path / "run")


@pytest.mark.parametrize("signalled", [0, 1])
def test_under_restarts_a_signal_to_one_machines_launcher_saves_and_ends_both(signalled, small_data, tmp_path):
    """--max_restarts 1 on two machines (loopback), and SIGTERM to one machine's launcher alone, as when a cluster
    preempts one pod: every process saves after the same step and exits 143, and both launchers exit 143. Before,
    the other machine restarted its processes: with machine 0 gone it ended in exit 1, blaming machine 0; as machine 0
    it waited for the other to rejoin until the rendezvous timed out (10 minutes)."""
    port = str(free_port())
    args = ["--output_dir", tmp_path / "run", "--data_dir", small_data, *FLAGS, "--checkpointing_steps", "1000"]
    env = {**script_env(), **paused_at([70], tmp_path, [signalled])}  # the other's rank waits in the step's check for a signal
    jobs = [start([sys.executable, *loopback_machine(rank, port, "--max_restarts", 1, PAUSE_PROBE, *args)], tmp_path, env) for rank in (0, 1)]
    wait_until(lambda: all_paused(tmp_path, [signalled], 70), jobs[0], "the pause after step 70")
    # torchrun's rendezvous orders the machines by address, then launcher pid: find which holds the rank.
    holder = next(job for job in jobs if any(process.environ().get("RANK") == str(signalled)
                                             for process in psutil.Process(job.pid).children(recursive=True)))
    holder.send_signal(signal.SIGTERM)
    results = [finish(job, STOP_WAIT_S) for job in jobs]
    for job, (_, stderr) in zip(jobs, results):
        assert job.returncode == 143 and "Traceback" not in stderr and "Restarting" not in stderr, stderr[-3000:]
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000070"
    assert_world_size(tmp_path / "run")  # the two machines trained as one group


# -- the CPU profile, for any Accelerate script --------------------------------------------------------

def test_the_cpu_profile_puts_a_plain_accelerator_into_one_group(tmp_path):
    """A script that is not ours and builds Accelerator() as accelerate's examples do: through
    scripts/launch.py, cpu.yaml's 4 processes form one gloo group; through plain accelerate launch
    each process trains alone (the trap the README warns of): accelerate joins torchrun's 4 processes in
    one gloo group, yet reports world size 1, so nothing would shard the data or average the gradients."""
    quiet = [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", PROBES / "plain_accelerator.py", tmp_path / "quiet"]
    plain = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / "cpu.yaml", PROBES / "plain_accelerator.py", tmp_path / "plain"]
    for command, folder in ((quiet, "quiet"), (plain, "plain")):
        (tmp_path / folder).mkdir()
        run(command, cwd=tmp_path)
    reports = {folder: [json.loads(path.read_text()) for path in sorted((tmp_path / folder).glob("*.json"))] for folder in ("quiet", "plain")}
    assert [(r["rank"], r["num_processes"], r["distributed_type"], r["torch_world_size"]) for r in reports["quiet"]] == [(rank, 4, "MULTI_CPU", 4) for rank in range(4)]
    assert [(r["num_processes"], r["distributed_type"], r["torch_world_size"]) for r in reports["plain"]] == [(1, "NO", 4)] * 4


# -- two hosts on a real network ----------------------------------------------------------------------

@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, each a host with an address of its own and a fork
    server of its own (a fork runs in its server's network); removed afterwards."""
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs the {tool} command")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"ddp{tag}a", f"ve{tag}a", "10.213.0.1"), (f"ddp{tag}b", f"ve{tag}b", "10.213.0.2")]

    def ip(*args, namespace=None):
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        return subprocess.run([*prefix, "ip", *args], capture_output=True, text=True)

    created = ip("netns", "add", hosts[0][0])
    if created.returncode:
        pytest.skip(f"network namespaces are not permitted here ({created.stderr.strip()})")
    servers = []
    try:
        ip("netns", "add", hosts[1][0])
        ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for namespace, device, address in hosts:
            ip("link", "set", device, "netns", namespace)
            ip("addr", "add", f"{address}/24", "dev", device, namespace=namespace)
            ip("link", "set", device, "up", namespace=namespace)
            ip("link", "set", "lo", "up", namespace=namespace)
            servers.append(start_fork_servers([HOST_ENV], prefix=enter(namespace)))
        assert ip("-4", "addr", "show", hosts[1][1], namespace=hosts[1][0]).stdout.count(hosts[1][2]) == 1
        yield [(*host, folder) for host, (folder, _) in zip(hosts, servers)], ip  # and the folder of its fork server
    finally:
        for folder, host_servers in servers:
            stop_fork_servers(folder, host_servers)
        for namespace, _, _ in hosts:
            ip("netns", "del", namespace)


# What every process on the hosts gets: scripts/launch.py gives its training processes this
# TORCH_CPP_LOG_LEVEL; plain accelerate launch's get it too, so that one fork server serves both.
HOST_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def enter(namespace):
    """Run in the namespace's network, with the filesystem as it is (`ip netns exec` makes a mount
    namespace of its own for each command, where no fork server could serve)."""
    return ["nsenter", f"--net=/run/netns/{namespace}"]


def host_python(host, *variables):
    """`python` on a host of two_hosts: inside its network namespace, a fork of its fork server, with HOST_ENV and `variables`."""
    namespace, _, _, fork_server_dir = host
    return [*enter(namespace), "env", f"FORK_SERVER_DIR={fork_server_dir}", *[f"{name}={value}" for name, value in HOST_ENV.items()],
            *variables, python()]


def machine_command(hosts, machine_rank, port, *args, launcher=("-m", "accelerate.commands.launch"), script=SCRIPTS / "cpu_gloo.py"):
    """One machine's launch on its host (host_python): rank 0's host is the rendezvous; gloo uses the veth."""
    return [*host_python(hosts[machine_rank], f"GLOO_SOCKET_IFNAME={hosts[machine_rank][1]}"), *launcher,
            "--config_file", CONFIGS / "cpu.yaml", "--num_machines", "2", "--num_processes", "2", "--machine_rank", machine_rank,
            "--main_process_ip", hosts[0][2], "--main_process_port", port, script, *args]


def start_machines(hosts, cwd, *args, env=None, **launch):
    port = free_port()
    return [start(machine_command(hosts, rank, port, *args, **launch), cwd, env) for rank in (0, 1)]


def test_two_hosts_train_as_one_group_and_stop_when_the_link_goes(two_hosts, small_data, reference, tmp_path):
    hosts, ip = two_hosts
    args = ["--data_dir", small_data, *FLAGS]
    # Under --max_restarts the machine that ranks first (by the name each advertises) hosts the processes' store: a second
    # host whose name means itself alone (`localhost`, as on some images) advertises its address toward machine 0 instead.
    code = ("import socket, sys; sys.path.insert(0, sys.argv[1]); socket.getfqdn = lambda: 'localhost'; import launch; "
            "print(launch.address_toward(sys.argv[2]))")
    advertised = run([*host_python(hosts[1]), "-c", code, SCRIPTS, hosts[0][2]], cwd=tmp_path)
    assert advertised.stdout.split() == [hosts[1][2]], advertised.stderr[-2000:]

    # The second host's own copy of the data is another data set of the same size: both hosts stop
    # before the first step, saying so once each, and make no run folder.
    other_data = write_small_mnist(tmp_path / "other_data", "MNIST", num_train=512, num_test=64, seed=7).parents[1]
    port = free_port()
    machines = [start(machine_command(hosts, rank, port, "--data_dir", (small_data, other_data)[rank], *FLAGS, "--output_dir",
                                      tmp_path / "disagree", launcher=(SCRIPTS / "launch.py",)), tmp_path) for rank in (0, 1)]
    for machine in machines:
        _, stderr = finish(machine, 120)
        assert machine.returncode == 1, stderr[-3000:]
        assert stderr.count("error: The processes disagree before the first step: the test set has 64 samples with SHA-256 ") == 1, stderr[-3000:]
        assert "give every machine the same copy of the data set" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "disagree").exists()

    # The two hosts train as one group; the link goes down mid-run: both hosts stop within
    # --ddp_timeout (and the launcher's own shutdown), never hang; with the link back, the run resumes
    # from its newest checkpoint and ends bitwise where one 2-process launch ends.
    cut = tmp_path / "cut"
    timeout_s = 10
    cut_args = [*args, "--checkpointing_steps", "20", "--ddp_timeout", str(timeout_s)]
    # Both processes wait after step 30, past the first checkpoint, while the link goes (tests/probes/pause_at_step.py).
    (tmp_path / "cut_pause").mkdir()
    machines = start_machines(hosts, tmp_path, "--output_dir", cut, *cut_args, launcher=(SCRIPTS / "launch.py",), script=PAUSE_PROBE,
                              env={**script_env(), **paused_at([30], tmp_path / "cut_pause")})
    wait_until(lambda: all_paused(tmp_path / "cut_pause", (0, 1), 30), machines[0], "the pause after step 30")
    ip("link", "set", hosts[0][1], "down", namespace=hosts[0][0])
    (tmp_path / "cut_pause" / "go").touch()
    cut_at = time.monotonic()
    for machine in machines:
        _, stderr = finish(machine, timeout_s + 60, cut)
        assert machine.returncode != 0
        # The process says why it stopped; the launcher, that no process of its machine was lost.
        assert "] stopped: no answer from another process within --ddp_timeout" in stderr, stderr[-3000:]
        assert "lost the connection to another process of the run (that process ended, or the network to its machine failed)" in stderr, stderr[-3000:]
    print(f"both hosts stopped {time.monotonic() - cut_at:.1f} s after the link went down")
    ip("link", "set", hosts[0][1], "up", namespace=hosts[0][0])
    machines = start_machines(hosts, tmp_path, "--output_dir", cut, *cut_args, "--resume_from_checkpoint", "latest")
    outputs = [finish(machine, 240, cut) for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert f"Resumed from {cut / 'checkpoints' / 'step_00000020'}: epoch 1, " in outputs[0][0], "step 20, the newest before the cut at step 30"
    assert_world_size(cut)
    assert_same_weights(weights(reference), weights(cut))

    # --max_restarts across the two hosts: a process on the second host is killed, both hosts
    # restart their processes, which resume from the newest checkpoint and finish the run.
    restarted = tmp_path / "restarted"
    (tmp_path / "restart_pause").mkdir()
    machines = start_machines(hosts, tmp_path, "--output_dir", restarted, *args, "--checkpointing_steps", "20",
                              "--resume_from_checkpoint", "latest", launcher=(SCRIPTS / "launch.py", "--max_restarts", "2"),
                              script=PAUSE_PROBE, env={**script_env(), **paused_at([70], tmp_path / "restart_pause")})
    wait_until(lambda: all_paused(tmp_path / "restart_pause", (0, 1), 70), machines[1], "the pause after step 70")
    rank_naming(restarted, 1).kill()  # global rank 1: the second host's process (a fork's client: its fork dies with it)
    outputs = [finish(machine, 240, restarted) for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    # The machine whose process was lost counts a restart; the other rejoins it (and says so).
    assert "Restart 1 after a lost process: resumed from" in outputs[1][0], outputs[1][0][-2000:]
    assert "Restarting this machine's processes to rejoin" in outputs[0][1], outputs[0][1][-2000:]
    assert not any("Traceback" in stderr for _, stderr in outputs), outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert_world_size(restarted)
    assert_same_weights(weights(reference), weights(restarted))
