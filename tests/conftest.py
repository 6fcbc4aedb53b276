"""Fixtures and launch helpers: every test runs the scripts as a user would, in a process of their own.

A one-process `python scripts/X.py` run of a training script is a fork of the test process, which
has already imported what the scripts import (torch, accelerate, shared/): a new interpreter would
spend about 3 s of CPU on those imports. scripts/launch.py, `accelerate launch`, the training
processes a launcher starts, and every other command start new interpreters, as users start them.
"""

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

# What the scripts' processes get (script_env), set before anything imports torch, so that a forked
# run sees the same settings at import time as a new interpreter would.
SCRIPT_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
os.environ.update(SCRIPT_ENV)
os.environ.pop("CUDA_VISIBLE_DEVICES", None)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
CONFIGS = REPO / "accelerate_configs"
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from datagen import write_small_mnist  # noqa: E402

TIMEOUT = 300


def script_env():
    """The environment of a script's process: this one's, which SCRIPT_ENV was applied to above."""
    return dict(os.environ)


def run(command, cwd, check=True, env=None, new_interpreter=False):
    """Run a command; on an unexpected exit code, fail with its output.

    `python scripts/X.py ...` of a training script with the scripts' environment runs in a fork of
    this process unless new_interpreter is set; everything else starts as a new process.
    """
    command = [str(part) for part in command]
    is_training_script = (len(command) > 1 and command[0] == sys.executable and Path(command[1]).parent == SCRIPTS
                          and Path(command[1]).name != "launch.py")
    if is_training_script and env is None and not new_interpreter:
        result = run_script_in_fork(command[1], command[2:], cwd)
    else:
        result = subprocess.run(command, cwd=cwd, env=env or script_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if check and result.returncode != 0:
        pytest.fail(f"{command} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


# What the scripts import, loaded into this process before the first fork; torch._dynamo because
# every optimizer's first add_param_group imports it (half of the 3 s).
SCRIPT_IMPORTS = ("accelerate", "safetensors.torch", "torch._dynamo", "tqdm.auto", "shared.checkpoints", "shared.cli",
                  "shared.data", "shared.metrics", "shared.run_folder", "shared.runtime", "shared.tracking")


def run_script_in_fork(script, args, cwd):
    """`python script args` in cwd, as a fork of this process; the result as subprocess.run gives it."""
    for name in SCRIPT_IMPORTS:
        importlib.import_module(name)
    command = [sys.executable, script, *args]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        pid = os.fork()
        if pid == 0:  # the child: become `python script args`; at its end run its own exit handlers, not this process's
            exit_code = 1
            atexit._clear()
            try:
                os.dup2(stdout.fileno(), 1)
                os.dup2(stderr.fileno(), 2)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                os.chdir(cwd)
                sys.argv = [script, *args]
                sys.path[0] = str(Path(script).parent)
                exit_code = run_as_main(script)
            finally:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_code)
        exit_code = wait_for(pid, command)
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, exit_code, stdout.read(), stderr.read())


def run_as_main(script):
    """Run a file as __main__; the exit code the interpreter would give."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def wait_for(pid, command):
    """The child's exit code; after TIMEOUT seconds it is killed, as subprocess.run would."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise subprocess.TimeoutExpired(command, TIMEOUT)


def python_command(script, *args):
    """One process, no launcher: python scripts/X.py ..."""
    return [sys.executable, SCRIPTS / script, *args]


def launch_command(script, *args, num_processes=None, config="cpu.yaml"):
    """python scripts/launch.py --config_file accelerate_configs/<config> [--num_processes N] scripts/X.py ...:
    accelerate's launcher with the README's checks. Plain `accelerate launch` has tests of its own."""
    command = [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / config]
    if num_processes is not None:
        command += ["--num_processes", num_processes]
    return command + [SCRIPTS / script, *args]


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_machines(cwd, machine_args, config="cpu.yaml"):
    """Two launches on loopback that join one group as machines 0 and 1 (one process each), as two
    hosts would: machine_args[rank] is what follows the launcher's flags on that machine (the script
    and its flags, after any launcher flag of its own). The results, as subprocess.run gives them, in
    machine order."""
    port = str(free_port())
    jobs = [
        subprocess.Popen(
            [str(part) for part in [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / config, "--num_machines", "2",
                                    "--num_processes", "2", "--machine_rank", rank, "--main_process_ip", "127.0.0.1",
                                    "--main_process_port", port, *args]],
            cwd=cwd, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, args in enumerate(machine_args)
    ]
    outputs = [job.communicate(timeout=TIMEOUT) for job in jobs]
    return [subprocess.CompletedProcess(job.args, job.returncode, *output) for job, output in zip(jobs, outputs)]


def data_flags(script, data_dir):
    """--data_dir for the scripts that read a data set; toy_mlp has its rows built in and takes none."""
    return [] if script == "toy_mlp.py" else ["--data_dir", data_dir]


def read_metrics(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """MNIST and FashionMNIST in torchvision's layout (real IDX files), small and learnable."""
    root = tmp_path_factory.mktemp("data")
    for name in ("MNIST", "FashionMNIST"):
        write_small_mnist(root, name, num_train=2000, num_test=200)
    return root
