"""The GPU tier: what only a CUDA GPU can show, run by a GPU owner with `python -m pytest -m gpu`.

Every launch goes through the profiles a user launches with, and every run asserts the device and
the world size it trained at. On a machine without CUDA these are skipped with the reason; the CPU
parts of the same code paths have CPU tests (test_gpu_paths.py). Tests that need more GPUs than the
machine has are skipped (world sizes 2 and 4, two machines on one host, a lost NCCL peer).
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, REPO, SCRIPTS, data_flags, read_metrics, run, script_env, two_machines
from test_features import assert_same_weights, resume_from, weights
from test_scripts import SCRIPTS_UNDER_TEST, load_script_module

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group("gpu"),  # one test process runs them all, one launch at a time
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU: run `python -m pytest -m gpu` on a machine with one"),
]


def needs_gpus(count):
    return pytest.mark.skipif(GPUS < count, reason=f"needs {count} GPUs, this machine has {GPUS}")


def gpu_launch(config, script, *args, num_processes=None, launcher_flags=()):
    """python scripts/launch.py --config_file accelerate_configs/<config> [on the first N GPUs] scripts/X.py ..."""
    command = [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / config, *launcher_flags]
    if num_processes is not None:
        command += ["--num_processes", num_processes, "--gpu_ids", ",".join(str(index) for index in range(num_processes))]
    return command + [SCRIPTS / script, *args]


def train(tmp_path, name, config, script, *flags, data_dir, num_processes=None, launcher_flags=()):
    output_dir = tmp_path / name
    result = run(gpu_launch(config, script, "--output_dir", output_dir, *data_flags(script, data_dir), *flags,
                            num_processes=num_processes, launcher_flags=launcher_flags), cwd=tmp_path)
    return output_dir, result


def assert_trained_on_the_gpu(output_dir, script, world_size, min_accuracy=0.5, device="cuda"):
    records = read_metrics(output_dir)
    assert {(r["world_size"], r["device"].split(":")[0]) for r in records} == {(world_size, device)}
    assert records[-1]["eval_accuracy"] >= min_accuracy and records[-1].get("peak_memory_mb", 1) > 0  # toy_mlp.py records none
    model = getattr(load_script_module(SCRIPTS / script), SCRIPTS_UNDER_TEST[script][0])()
    model.load_state_dict(load_file(output_dir / "model.safetensors"))  # strict: the plain class, no wrapper prefixes
    return records


@pytest.mark.parametrize("script", sorted(SCRIPTS_UNDER_TEST))
def test_the_one_gpu_profile_trains_every_script_on_the_gpu(script, data_dir, tmp_path):
    _, flags, min_accuracy = SCRIPTS_UNDER_TEST[script]
    output_dir, _ = train(tmp_path, "run", "1gpu.yaml", script, *flags, data_dir=data_dir)
    # The tutorial about CPU processes over gloo stays on the CPU, even on a machine with a GPU.
    assert_trained_on_the_gpu(output_dir, script, 1, min_accuracy, device="cpu" if script == "cpu_gloo.py" else "cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_the_gpu(precision, data_dir, tmp_path):
    output_dir, _ = train(tmp_path, precision, "1gpu.yaml", "mnist_conv.py", "--num_epochs", "2", "--mixed_precision", precision,
                          data_dir=data_dir)
    records = assert_trained_on_the_gpu(output_dir, "mnist_conv.py", 1)
    assert {r["mixed_precision"] for r in records} == {precision}
    assert all(value == value for value in (r["train_loss"] for r in records)), "no NaN loss"


@pytest.mark.parametrize("script", sorted(SCRIPTS_UNDER_TEST))
def test_the_fsdp_profile_trains_saves_evaluates_and_resumes(script, data_dir, tmp_path):
    """fsdp.yaml (FSDP2, bf16) on up to 4 GPUs: train with an epoch checkpoint, save a model.safetensors
    that loads into the plain class, evaluate it and the checkpoint with --eval_only (the number training
    reported), and resume from the checkpoint to where the run ended."""
    if script == "cpu_gloo.py":
        pytest.skip("cpu_gloo.py always trains on the CPU, where accelerate has no FSDP")
    if script == "toy_mlp.py":
        pytest.skip("toy_mlp.py, the first rung, has no checkpoints or --eval_only to check under FSDP")
    num_processes = min(GPUS, 4)
    flags = [*SCRIPTS_UNDER_TEST[script][1], "--checkpointing_steps", "epoch"]
    full, _ = train(tmp_path, "full", "fsdp.yaml", script, *flags, data_dir=data_dir, num_processes=num_processes)
    records = assert_trained_on_the_gpu(full, script, num_processes, SCRIPTS_UNDER_TEST[script][2])
    assert {r["mixed_precision"] for r in records} == {"bf16"}

    for source in (full / "model.safetensors", full / "checkpoints" / sorted(os.listdir(full / "checkpoints"))[-1]):
        run(gpu_launch("fsdp.yaml", script, "--output_dir", full, *data_flags(script, data_dir), "--eval_only",
                       "--resume_from_checkpoint", source, num_processes=num_processes), cwd=tmp_path)
        evaluation = json.loads((full / "eval.json").read_text())
        assert (evaluation["weights"], evaluation["world_size"]) == (str(source), num_processes)
        assert evaluation["eval_accuracy"] == pytest.approx(records[-1]["eval_accuracy"], abs=0.02), source

    first = sorted(os.listdir(full / "checkpoints"))[0]
    path = resume_from(full, first, tmp_path / "resumed")
    train(tmp_path, "resumed", "fsdp.yaml", script, *flags, "--resume_from_checkpoint", path, data_dir=data_dir, num_processes=num_processes)
    resumed = tmp_path / "resumed"
    assert read_metrics(resumed)[-1]["epoch"] == records[-1]["epoch"]
    assert_same_weights(weights(full), weights(resumed), exact=False, atol=1e-2)  # GPU kernels need not sum in one order


def test_channels_last_and_torch_compile_with_bf16_on_the_gpu(data_dir, tmp_path):
    flags = ["--num_epochs", "2", "--channels_last", "--mixed_precision", "bf16"]
    output_dir, _ = train(tmp_path, "run", "1gpu.yaml", "mnist_conv.py", *flags, data_dir=data_dir,
                          launcher_flags=["--dynamo_backend", "inductor"])
    assert_trained_on_the_gpu(output_dir, "mnist_conv.py", 1)


def test_the_in_memory_loader_moves_batches_that_stayed_on_the_cpu_to_the_gpu():
    """The data set stays on the CPU when the GPU has too little free memory; batches must still reach the GPU."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from shared.in_memory_loader import InMemoryLoader

    # A stand-in for one process's Accelerator on GPU 0: the three attributes the loader reads of it.
    accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cuda", 0))
    loader = InMemoryLoader(TensorDataset(torch.randn(10, 1, 28, 28), torch.arange(10)), 4, accelerator, seed=0, home=torch.device("cpu"))
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    assert {(inputs.device.type, labels.device.type) for inputs, labels in batches} == {("cuda", "cuda")}
    assert sorted(torch.cat([labels for _, labels in batches]).tolist()) == list(range(10)), "each sample once"


@pytest.mark.parametrize("count", [2, 4])
def test_several_gpus_train_the_model_one_gpu_trains(count, data_dir, tmp_path):
    if GPUS < count:
        pytest.skip(f"needs {count} GPUs, this machine has {GPUS}")
    flags = ["--num_epochs", "2", "--batch_size", "64"]
    one, _ = train(tmp_path, "one", "1gpu.yaml", "mnist_conv.py", *flags, data_dir=data_dir)
    several, _ = train(tmp_path, "several", f"{count}gpu.yaml", "mnist_conv.py", *flags, data_dir=data_dir)
    assert_trained_on_the_gpu(one, "mnist_conv.py", 1)
    assert_trained_on_the_gpu(several, "mnist_conv.py", count)
    assert read_metrics(several)[-1]["eval_accuracy"] == pytest.approx(read_metrics(one)[-1]["eval_accuracy"], abs=0.05)


@needs_gpus(2)
def test_two_machines_on_one_host_with_a_gpu_each(data_dir, tmp_path):
    args = [SCRIPTS / "mnist_conv.py", "--data_dir", data_dir, "--num_epochs", "1"]
    results = two_machines(tmp_path, [["--gpu_ids", str(rank), *args, "--output_dir", tmp_path / f"machine_{rank}"] for rank in (0, 1)],
                           config="2gpu.yaml")
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert_trained_on_the_gpu(tmp_path / "machine_0", "mnist_conv.py", 2)


@needs_gpus(2)
def test_a_lost_nccl_peer_ends_the_job(data_dir, tmp_path):
    """One machine: torchrun stops the other GPUs' processes within seconds of one dying."""
    command = gpu_launch("2gpu.yaml", "mnist_conv.py", "--output_dir", tmp_path / "run", "--data_dir", data_dir, "--num_epochs", "100")
    job = subprocess.Popen([str(part) for part in command], cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "run" / "metrics.jsonl").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)
    (victim,) = [p for p in psutil.Process(job.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    victim.send_signal(signal.SIGKILL)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 1 and "Training stopped: rank 1 was killed by signal 9" in stderr


def test_the_gpu_benchmark_writes_its_results_with_the_device_name(tmp_path):
    output = tmp_path / "gpu_throughput.json"
    run([sys.executable, REPO / "benchmarks" / "gpu_throughput.py", "--settings", "fp32", "--num_epochs", "2",
         "--train_samples", "7680", "--output", output], cwd=REPO)
    results = json.loads(output.read_text())
    assert results["device"] == torch.cuda.get_device_name()
    (row,) = results["rows"]
    assert row["script"] > 0 and row["ceiling"] > 0


def test_a_cuda_graph_of_the_small_batch_step_trains_the_eager_steps_weights(tmp_path):
    """benchmarks/small_batch_step.py's claim: under cuDNN's deterministic kernels the graph's weights
    are bitwise those of the eager step, which is itself repeatable there."""
    result = run([sys.executable, REPO / "benchmarks" / "small_batch_step.py", "--deterministic", "--steps", "300"], cwd=tmp_path)
    for way in ("CUDA graph", "eager again", "eager, capturable=True"):
        assert f"- {way}: bitwise equal" in result.stdout, result.stdout
