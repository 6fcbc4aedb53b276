"""Fixtures and launch helpers: every test runs the scripts as a user would, in processes of their own.

Most tests' Python processes are forks of a fork server (fork_server.py) that has already imported
torch and accelerate, which a new interpreter spends about 4 s of CPU on: `python ...` in run(), the
training processes that torchrun starts (PYTHON_EXEC), and the benchmarks' processes (which honor
PYTHON_EXEC too). Each fork takes the place of the process its launcher started (open files,
environment, signals, exit code) and runs where a new interpreter
would run the same; test_forked_runs.py shows that it ends as one does. The smoke tier run on its own
(`-m smoke`, the user's check of their machine) and the GPU tier start every process as a new
interpreter, as users start them.
"""

import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

# What the scripts' processes get (script_env), set before anything imports torch.
SCRIPT_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
os.environ.update(SCRIPT_ENV)
os.environ.pop("CUDA_VISIBLE_DEVICES", None)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
CONFIGS = REPO / "accelerate_configs"
TOOLS = REPO / "tools"
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TESTS))

from fork_server import FORKED_LOG  # noqa: E402
from synthetic_digits import write_small_mnist  # noqa: E402
from shared.intact_checkpoints import sha256, state_digest  # noqa: E402
from shared.metrics import read_records  # noqa: E402
from shared.run_folder import STATE_FILE, checkpoints_in  # noqa: E402

TIMEOUT = 300
# One fork server per import-time environment the tests' processes have: scripts/launch.py gives its
# training processes TORCH_CPP_LOG_LEVEL=ERROR.
FORK_SERVER_ENVS = ({}, {"TORCH_CPP_LOG_LEVEL": "ERROR"})
forks = {}  # while a test may use forks: the fork client's executable and the servers' folder


def start_fork_servers(environments, prefix=()):
    """Fork servers with these import-time environments (added to this process's), started after
    prefix (a command that enters another namespace), their sockets in a new folder with a short path
    (a socket's path has at most 107 bytes): the folder and the servers, once they accept."""
    folder = Path(tempfile.mkdtemp(prefix="forks-"))
    servers = [subprocess.Popen([*prefix, sys.executable, TESTS / "fork_server.py", folder], env={**os.environ, **extra},
                                start_new_session=True) for extra in environments]
    deadline = time.monotonic() + TIMEOUT
    while len(list(folder.glob("*.sock"))) < len(servers):
        assert all(server.poll() is None for server in servers) and time.monotonic() < deadline, "a fork server did not start"
        time.sleep(0.1)
    return folder, servers


def stop_fork_servers(folder, servers):
    for server in servers:
        os.killpg(server.pid, signal.SIGKILL)  # the server, and any fork a test left behind
        server.wait()
    shutil.rmtree(folder)


@pytest.fixture(scope="session")
def fork_servers():
    """Starts the fork servers; from then on the tests' processes are forks (see process_start).
    Module fixtures that run the scripts ask for it too."""
    folder, servers = start_fork_servers(FORK_SERVER_ENVS)
    client = folder / "python"
    client.write_text(f"#!/bin/sh\nexec '{sys.executable}' -S -E '{TESTS / 'fork_client.py'}' '{sys.executable}' \"$@\"\n")
    client.chmod(0o755)
    forks.update(PYTHON_EXEC=str(client), FORK_SERVER_DIR=str(folder))
    yield
    forks.clear()
    stop_fork_servers(folder, servers)


def starts_new_interpreters(request):
    """The GPU tier, and the smoke tier when it runs on its own (`-m smoke`): in the full suite its tests
    fork as the others do, and test_forked_runs.py starts new interpreters beside forks."""
    smoke_tier = request.config.option.markexpr.strip() == "smoke" and request.node.get_closest_marker("smoke")
    return bool(smoke_tier or request.node.get_closest_marker("gpu"))


@pytest.fixture(autouse=True)
def process_start(request):
    """Forks for this test's processes, unless it starts new interpreters."""
    if not starts_new_interpreters(request):
        request.getfixturevalue("fork_servers")
        yield
        return
    allowed = dict(forks)
    forks.clear()
    yield
    forks.update(allowed)


def forked_commands():
    """The command (`python`'s arguments) of every fork this test process's fork servers have made, in order."""
    log = Path(forks["FORK_SERVER_DIR"]) / FORKED_LOG
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@contextlib.contextmanager
def forks_made():
    """The commands (forked_commands) of the forks made while the block runs, in the list it gives, filled as it ends."""
    before = len(forked_commands())
    made = []
    try:
        yield made
    finally:
        made.extend(forked_commands()[before:])


def scripts_of(commands):
    """The file name of the script each `python` command (of forked_commands) runs (through scripts/run_script.py, as
    scripts/launch.py starts each training process, or as itself)."""
    names = [[Path(part).name for part in command if part.endswith(".py")] or [" ".join(command)] for command in commands]
    return [script[1] if script[0] == "run_script.py" else script[0] for script in names]


def script_env():
    """The environment of a script's process: this one's, which SCRIPT_ENV was applied to above, and
    where the test allows it, the fork client as torchrun's Python."""
    return {**os.environ, **forks}


def new_interpreter_env():
    """script_env() without the fork client: torchrun starts the training processes as new interpreters."""
    return {name: value for name, value in script_env().items() if name not in forks}


def python():
    """The `python` of the tests' commands: the fork client where the test allows it, else this interpreter."""
    return forks.get("PYTHON_EXEC", sys.executable)


def run(command, cwd, check=True, env=None, new_interpreter=False):
    """Run a command; on an unexpected exit code, fail with its output. A `python ...` command runs
    through the fork client where the test allows it, unless new_interpreter is set."""
    command = [str(part) for part in command]
    if command[0] == sys.executable and not new_interpreter:
        command[0] = python()
    result = subprocess.run(command, cwd=cwd, env=env or script_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if check and result.returncode != 0:
        pytest.fail(f"{command} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def python_command(script, *args):
    """One process, no launcher: python scripts/X.py ..."""
    return [sys.executable, SCRIPTS / script, *args]


def launch_command(script, *args, num_processes=None, config="cpu.yaml"):
    """python scripts/launch.py --config_file accelerate_configs/<config> [--num_processes N] scripts/X.py ...:
    accelerate's launcher with the README's checks. Plain `accelerate launch` has tests of its own. The port is this
    test worker's (free_port): the profile's 0 has accelerate pick a free one, which torchrun binds a moment later, when
    the other worker's connections may have taken it."""
    command = [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / config, "--main_process_port", free_port()]
    if num_processes is not None:
        command += ["--num_processes", num_processes]
    return command + [SCRIPTS / script, *args]


def free_port():
    """A free port for a rendezvous that a launcher binds a moment later. Taken below the kernel's range
    of ephemeral ports, where no other socket (the other test worker's gloo connections, say) is given
    it by chance in that moment; each xdist worker tries its own block in turn."""
    import socket

    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    block = (ephemeral_low - 10_000) // workers
    start = 10_000 + block * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    for _ in range(max(block, 0)):
        port = start + next(_next_port) % block
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the ephemeral range on this machine
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_next_port = itertools.count(random.randrange(10_000))  # another session on this machine starts elsewhere


def loopback_machine(rank, port, *args, config="cpu.yaml"):
    """scripts/launch.py's arguments for machine `rank` of two on loopback (one process each), as a host
    would launch it: `args` follow the launcher's flags (any launcher flag of its own, the script and its flags)."""
    return [SCRIPTS / "launch.py", "--config_file", CONFIGS / config, "--num_machines", "2", "--num_processes", "2", "--machine_rank",
            rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port, *args]


def two_machines(cwd, machine_args, config="cpu.yaml"):
    """Two launches on loopback that join one group as machines 0 and 1 (loopback_machine): machine_args[rank]
    is what follows the launcher's flags on that machine. The results, as subprocess.run gives them, in
    machine order."""
    port = free_port()
    jobs = [subprocess.Popen([str(part) for part in [python(), *loopback_machine(rank, port, *args, config=config)]],
                             cwd=cwd, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, args in enumerate(machine_args)]
    outputs = [job.communicate(timeout=TIMEOUT) for job in jobs]
    return [subprocess.CompletedProcess(job.args, job.returncode, *output) for job, output in zip(jobs, outputs)]


@contextlib.contextmanager
def small_disk(folder, size):
    """`folder`, made, as a disk of `size` bytes (a tmpfs) for as long as the block runs: a disk that fills
    up. Skips the test where mounting is not allowed (it needs root)."""
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder]).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", folder])


# A command's prefix that runs it without the capabilities that let root read and write any folder (util-linux's setpriv).
AS_AN_ORDINARY_USER = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-dac_override,-dac_read_search"]


@pytest.fixture(scope="session")
def run_as_an_ordinary_user(fork_servers):
    """run(), without the capabilities that let root read and write any folder (AS_AN_ORDINARY_USER): as an ordinary
    user would. A `python` command is a fork of a fork server started so: a fork of the others would keep them."""
    folder, servers = start_fork_servers([{}], prefix=AS_AN_ORDINARY_USER)

    def run_it(command, cwd, check=True):
        command = [str(part) for part in command]
        if command[0] == sys.executable:
            command[0] = python()
        return run(AS_AN_ORDINARY_USER + command, cwd, check=check, env={**script_env(), "FORK_SERVER_DIR": str(folder)})
    yield run_it
    stop_fork_servers(folder, servers)

PAUSE_PROBE = Path(__file__).resolve().parent / "probes" / "pause_at_step.py"


def paused_at(steps, folder, ranks=None, release_all=False):
    """The environment in which tests/probes/pause_at_step.py, run in a script's place, pauses cpu_gloo.py
    after each optimizer step of `steps` on `ranks` (all if None), once, until each is signalled (`release_all`:
    or another paused at the same step is) or folder/go appears; each paused process writes folder/paused_<rank>_at_<step>."""
    return {"PAUSE_SCRIPT": str(SCRIPTS / "cpu_gloo.py"), "PAUSE_AT_STEP": ",".join(map(str, steps)), "PAUSE_DIR": str(folder),
            **({"PAUSE_RANKS": ",".join(map(str, ranks))} if ranks else {}), **({"PAUSE_RELEASE_ALL": "1"} if release_all else {})}


def all_paused(folder, ranks, step):
    """Whether each of `ranks` has paused after `step` (paused_at)."""
    return all((folder / f"paused_{rank}_at_{step}").exists() for rank in ranks)


def wait_until(condition, job, what, timeout=120):
    """Wait for condition() while the process `job` (a Popen with text pipes) runs; fail with its output if it ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if job.poll() is not None or time.monotonic() > deadline:
            stdout, stderr = job.communicate()
            pytest.fail(f"the run ended or took too long before {what}\n{stdout[-2000:]}\n{stderr[-3000:]}")
        time.sleep(0.05)


def data_flags(script, data_dir):
    """--data_dir for the scripts that read a data set; toy_mlp has its rows built in and takes none."""
    return [] if script == "toy_mlp.py" else ["--data_dir", data_dir]


def read_metrics(output_dir):
    return read_records(Path(output_dir), keys=["epoch"])  # toy_mlp's too


def latest_checkpoint(folder):
    """The newest complete checkpoint in a checkpoints folder, or None."""
    found = checkpoints_in(folder)
    return found[-1] if found else None


def error_lines(stderr):
    """Every error line, from `error: ` on: rank 0's, and any other rank's `[rank N] error: ` (one said twice)."""
    return [line[line.index("error: "):] for line in stderr.splitlines() if "error: " in line]


def folder_snapshot(root):
    """Every file and folder under root, files by content: what a run that must touch nothing there leaves as it was."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
            for path in sorted(Path(root).rglob("*"))}


def processes_naming(path):
    """The processes whose command line names `path` (a test's folder): those a launch left running."""
    return [process for process in psutil.process_iter(["cmdline"]) if str(path) in " ".join(process.info["cmdline"] or [])]


def rank_naming(path, rank):
    """The training process of `rank` among the processes that have `path` as an argument: a new interpreter, or
    a fork's client, which passes a signal on to its fork and whose kill kills it (a launcher has no RANK)."""
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(path) in (process.info["cmdline"] or []) and process.environ().get("RANK") == str(rank):
                return process
    pytest.fail(f"no training process of rank {rank} names {path}")


def read_state(checkpoint):
    return json.loads((checkpoint / STATE_FILE).read_text())


def record_digest_again(checkpoint, name):
    """Record the digest of `name` as it is now in the checkpoint's state, and the state's own digest: a file
    damaged before it was hashed, which only its load can find."""
    state = read_state(checkpoint)
    state["files"][name] = sha256(checkpoint / name)
    (checkpoint / STATE_FILE).write_text(json.dumps(state | {"sha256": state_digest(state)}))


def checkpoint_damage(checkpoint):
    """The first file of a checkpoint folder that is missing or differs from the SHA-256 its state
    recorded, read here by one process; None when all are as saved."""
    for name, digest in read_state(checkpoint)["files"].items():
        path = checkpoint / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return name
    return None


def write_digits(root, num_train, num_test):
    """MNIST and FashionMNIST in torchvision's layout (real IDX files), small and learnable."""
    for name in ("MNIST", "FashionMNIST"):
        write_small_mnist(root, name, num_train=num_train, num_test=num_test)
    return root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("data"), num_train=2000, num_test=200)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """data_dir's kind of data, a quarter of its size: for the runs whose steps cost most."""
    return write_digits(tmp_path_factory.mktemp("small"), num_train=512, num_test=64)
