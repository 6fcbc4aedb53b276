"""Most tests' processes are forks of a fork server (conftest.py, fork_server.py), to save each the 4 s
of importing torch and the rest: a forked run ends as new interpreters end, and a fork takes its
client's place for the launcher that watches it."""

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import forks_made, forks, scripts_of, launch_command, new_interpreter_env, python_command, read_metrics, run, script_env
from test_features import assert_same_records, assert_same_weights, weights


@pytest.mark.parametrize("flags", [["--batch_size", "abc"], ["--dataset_source", "hub"]], ids=["bad flag", "Hub offline"])
def test_a_forked_run_fails_as_a_new_interpreter_would(flags, tmp_path):
    command = python_command("cpu_gloo.py", "--output_dir", tmp_path / "run", *flags)
    with forks_made() as new_forks:
        forked = run(command, cwd=tmp_path, check=False)
    assert scripts_of(new_forks) == ["cpu_gloo.py"], "the run was a fork"
    fresh = run(command, cwd=tmp_path, check=False, new_interpreter=True)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr == fresh.stderr and forked.stderr.startswith("error: ")


def test_an_uncaught_exception_ends_a_fork_as_it_ends_an_interpreter(tmp_path):
    command = [sys.executable, "-c", "import torch\nraise ValueError(torch.__name__)"]
    with forks_made() as new_forks:
        forked = run(command, cwd=tmp_path, check=False)
    assert new_forks == [command[1:]], "the run was a fork"
    fresh = run(command, cwd=tmp_path, check=False, new_interpreter=True)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr == fresh.stderr == 'Traceback (most recent call last):\n  File "<string>", line 2, in <module>\nValueError: torch\n'


@pytest.mark.parametrize("processes", [1, 2])
def test_a_forked_run_trains_as_new_interpreters_would(processes, data_dir, tmp_path):
    """1 process: `python scripts/cpu_gloo.py` forked; 2: scripts/launch.py and both training processes forked."""
    runs = {}
    for name, new_interpreter in (("forked", False), ("fresh", True)):
        runs[name] = tmp_path / name
        args = ["--data_dir", data_dir, "--output_dir", runs[name], "--num_epochs", "1", "--checkpointing_steps", "epoch"]
        command = python_command("cpu_gloo.py", *args) if processes == 1 else launch_command("cpu_gloo.py", *args, num_processes=2)
        with forks_made() as new_forks:
            run(command, cwd=tmp_path, new_interpreter=new_interpreter, env=new_interpreter_env() if new_interpreter else None)
        # Forked: the script's process, or the launcher and both training processes; new interpreters: none.
        expected = [] if new_interpreter else ["cpu_gloo.py"] if processes == 1 else ["launch.py", "cpu_gloo.py", "cpu_gloo.py"]
        assert scripts_of(new_forks) == expected
    files = {name: sorted(path.relative_to(folder) for path in folder.rglob("*")) for name, folder in runs.items()}
    assert files["forked"] == files["fresh"]
    assert_same_weights(weights(runs["forked"]), weights(runs["fresh"]))
    assert_same_records(read_metrics(runs["forked"]), read_metrics(runs["fresh"]))
    assert read_metrics(runs["forked"])[-1]["world_size"] == processes


def test_a_process_that_multiprocessing_spawns_is_a_fork_that_has_the_files_it_was_given(tmp_path):
    """torch.multiprocessing's spawn, which starts the benchmarks' baselines, hands its child a pipe's end
    (the child's arguments and results go through it) and passes -B on: the spawning interpreter is
    started with -B (a fork would keep its server's flags)."""
    probe = tmp_path / "spawner.py"
    probe.write_text(textwrap.dedent("""\
        import os, sys
        import torch.multiprocessing as mp

        def child(results):
            results.put(os.getpid())

        if __name__ == "__main__":
            context = mp.get_context("spawn")
            context.set_executable(os.environ["PYTHON_EXEC"])
            results = context.SimpleQueue()
            process = context.Process(target=child, args=(results,))
            process.start()
            print(process.pid, results.get())
            process.join()
            sys.exit(process.exitcode)
        """))
    client, child = map(int, run([sys.executable, "-B", probe], cwd=tmp_path, new_interpreter=True).stdout.split())
    assert child != client  # the child ran in a fork, not in the new interpreter the client would have become


def test_a_signal_to_a_forks_stand_in_reaches_the_fork_and_killing_the_stand_in_kills_the_fork(tmp_path):
    """What a launcher sees of the process it started: the fork client, which passes signals on and ends as the fork ended."""
    probe = tmp_path / "wait.py"
    # Short sleeps: a signal that lands just before a sleep's system call starts is handled at its end.
    probe.write_text("import os, signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *_: sys.exit(7))\n"
                     "print(os.getpid(), flush=True)\nfor _ in range(600):\n    time.sleep(0.1)\n")
    for stop, exit_code in ((signal.SIGUSR1, 7), (signal.SIGKILL, -signal.SIGKILL)):
        client = subprocess.Popen([forks["PYTHON_EXEC"], "-u", probe], cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, text=True)
        fork = psutil.Process(int(client.stdout.readline()))
        assert fork.pid != client.pid and fork not in psutil.Process(client.pid).children(recursive=True)
        client.send_signal(stop)
        assert client.wait(timeout=30) == exit_code
        fork.wait(timeout=30)  # gone: psutil raises TimeoutExpired while it runs


def test_a_fork_that_cannot_report_its_failure_still_ends_and_leaves_the_other_forks_alone(tmp_path):
    """An uncaught error whose report meets a closed stderr (its launcher was killed) and an excepthook
    that writes there (as torch.distributed's does) ends that fork with exit code 1, as it ends an
    interpreter, and nothing else: the fork never returns into the server's code, which would then
    stop the server's other forks."""
    code = "import sys, time\ntime.sleep(1)\nsys.excepthook = lambda *error: sys.stderr.write('failed')\nraise ValueError"
    waiting = "import os, time\nopen('started', 'w').close()\nwhile not os.path.exists('released'):\n    time.sleep(0.05)"
    try:
        with forks_made() as new_forks:
            other = subprocess.Popen([forks["PYTHON_EXEC"], "-c", waiting], cwd=tmp_path, env=script_env())
            while not (tmp_path / "started").exists():  # forked, and logged as such
                assert other.poll() is None
                time.sleep(0.05)
            for python in (forks["PYTHON_EXEC"], sys.executable):
                failing = subprocess.Popen([python, "-c", code], cwd=tmp_path, env=script_env(), stderr=subprocess.PIPE)
                failing.stderr.close()
                assert failing.wait(timeout=30) == 1
        assert sorted(new_forks) == sorted([["-c", code], ["-c", waiting]]), "the other and the first failing one were forks"
        assert other.poll() is None, "the other fork lives on"
    finally:
        (tmp_path / "released").touch()
    assert other.wait(timeout=30) == 0
