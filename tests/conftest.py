"""Fixtures and launch helpers: every test runs the scripts as a user would, in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
CONFIGS = REPO / "accelerate_configs"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from datagen import write_small_mnist  # noqa: E402

TIMEOUT = 300


def script_env():
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    return env


def run(command, cwd, check=True, env=None):
    """Run a command; on an unexpected exit code, fail with its output."""
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env or script_env(),
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    if check and result.returncode != 0:
        pytest.fail(f"{command} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def python_command(script, *args):
    """One process, no launcher: python scripts/X.py ..."""
    return [sys.executable, SCRIPTS / script, *args]


def launch_command(script, *args, num_processes=None, config="cpu.yaml"):
    """accelerate launch --config_file accelerate_configs/<config> [--num_processes N] scripts/X.py ..."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / config]
    if num_processes is not None:
        command += ["--num_processes", num_processes]
    return command + [SCRIPTS / script, *args]


def read_metrics(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """MNIST and FashionMNIST in torchvision's layout (real IDX files), small and learnable."""
    root = tmp_path_factory.mktemp("data")
    for name in ("MNIST", "FashionMNIST"):
        write_small_mnist(root, name, num_train=2000, num_test=200)
    return root
