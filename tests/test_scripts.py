"""Each script end to end, as 1 process and as 2 processes, launched the ways the README shows."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, REPO, SCRIPTS, data_flags, free_port, launch_command, processes_naming, python, python_command, read_metrics, run, script_env

# script -> (model class, extra flags that keep the test short, accuracy it must beat)
SCRIPTS_UNDER_TEST = {
    "seq_net.py": ("SeqNet", ["--num_epochs", "3", "--batch_size", "50"], 0.5),
    "mnist_conv.py": ("Net", ["--num_epochs", "2"], 0.5),
    "cpu_gloo.py": ("SimpleNet", ["--num_epochs", "2"], 0.5),
    "toy_mlp.py": ("NeuralNetwork", [], 0.99),
}
REQUIRED_KEYS = {"epoch", "train_loss", "eval_loss", "eval_accuracy", "samples_per_sec", "world_size", "elapsed_s"}
MINIMAL_KEYS = {"epoch", "train_loss", "train_eval_accuracy", "eval_accuracy", "world_size"}  # toy_mlp.py, the first rung


def load_script_module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_trained(output_dir, script, world_size, min_accuracy):
    records = read_metrics(output_dir)
    model_class, _, _ = SCRIPTS_UNDER_TEST[script]
    assert [r["epoch"] for r in records] == list(range(1, len(records) + 1))
    for record in records:
        assert (MINIMAL_KEYS if script == "toy_mlp.py" else REQUIRED_KEYS) <= record.keys()
        assert record["world_size"] == world_size
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert records[-1]["eval_accuracy"] >= min_accuracy
    model = getattr(load_script_module(SCRIPTS / script), model_class)()
    model.load_state_dict(load_file(output_dir / "model.safetensors"))  # strict: every key matches


@pytest.mark.smoke
@pytest.mark.parametrize("script", sorted(SCRIPTS_UNDER_TEST))
def test_one_process_with_python(script, data_dir, tmp_path):
    _, flags, min_accuracy = SCRIPTS_UNDER_TEST[script]
    output_dir = tmp_path / "run"
    command = python_command(script, *data_flags(script, data_dir), "--output_dir", output_dir, *flags)
    result = run(command, cwd=tmp_path)
    assert_trained(output_dir, script, 1, min_accuracy)
    assert len([line for line in result.stdout.splitlines() if line.startswith("epoch ")]) == len(read_metrics(output_dir))  # one line per epoch
    assert f"Saved the trained model to {output_dir / 'model.safetensors'}" in result.stdout


@pytest.mark.smoke
@pytest.mark.parametrize("script", sorted(SCRIPTS_UNDER_TEST))
def test_two_processes_with_cpu_profile(script, data_dir, tmp_path):
    _, flags, min_accuracy = SCRIPTS_UNDER_TEST[script]
    output_dir = tmp_path / "run"
    result = run(
        launch_command(script, *data_flags(script, data_dir), "--output_dir", output_dir, *flags, num_processes=2),
        cwd=tmp_path,
    )
    assert_trained(output_dir, script, 2, min_accuracy)
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epoch_lines) == len(read_metrics(output_dir))  # printed by the main process only


@pytest.mark.smoke
def test_cpu_gloo_with_the_cpu_profile_as_is_trains_as_four_processes(data_dir, tmp_path):
    result = run(launch_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", tmp_path / "run", "--num_epochs", "1"), cwd=tmp_path)
    record = read_metrics(tmp_path / "run")[0]
    assert record["world_size"] == 4
    # 2000 samples in steps of 64 (16 a process): 32 steps, the last topped up with 48 samples from
    # the start of the epoch's order so that every process takes a full batch.
    assert record["train_samples_seen"] == 2048
    # The tutorial's per-rank losses, gathered into one line by rank 0 (not 4 processes' lines colliding).
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("Epoch 1, batch 0, loss by rank: ")]
    assert [part.split(": ")[0] for part in line.split("loss by rank: ")[1].split("  ")] == ["0", "1", "2", "3"]


def test_accelerate_launch_with_plain_flags(tmp_path):
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--main_process_port", "0", SCRIPTS / "toy_mlp.py", "--output_dir", tmp_path / "run",
    ]
    run(command, cwd=tmp_path)
    assert_trained(tmp_path / "run", "toy_mlp.py", 2, 0.99)


def copy_as_template(project):
    """The README's recipe: the script and the shared/ folder, copied side by side."""
    project.mkdir()
    shutil.copy(SCRIPTS / "mnist_conv.py", project / "train.py")
    shutil.copytree(REPO / "shared", project / "shared", ignore=shutil.ignore_patterns("__pycache__"))


def test_a_script_copied_into_a_new_project_runs(data_dir, tmp_path):
    project = tmp_path / "my_project"
    copy_as_template(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    output_dir = tmp_path / "out"
    run([sys.executable, project / "train.py", "--data_dir", data_dir, "--output_dir", output_dir, "--num_epochs", "1"], cwd=elsewhere)
    assert read_metrics(output_dir)[0]["eval_accuracy"] > 0.5
    model = load_script_module(project / "train.py").Net()
    model.load_state_dict(load_file(output_dir / "model.safetensors"))


def test_a_copy_inside_a_checkout_uses_its_own_shared(data_dir, tmp_path):
    """Copied into a folder of a checkout, as a user starting a project there would, the copy imports the
    shared/ beside it: an edit to the copy's shared/ shows up, and the checkout's does not. So it does launched
    by the checkout's scripts/launch.py, whose scripts/run_script.py starts each process with the copy's folder first."""
    checkout = tmp_path / "checkout"
    for folder in ("scripts", "shared"):
        shutil.copytree(REPO / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
    project = checkout / "my_project"
    copy_as_template(project)
    metrics_file = project / "shared" / "metrics.py"
    metrics_file.write_text(metrics_file.read_text().replace('f"epoch {record', 'f"my copy: epoch {record'))
    result = run([sys.executable, project / "train.py", "--data_dir", data_dir, "--output_dir", tmp_path / "out", "--num_epochs", "1"],
                 cwd=checkout)
    assert "my copy: epoch 1/1" in result.stdout
    result = run([sys.executable, checkout / "scripts" / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2",
                  project / "train.py", "--data_dir", data_dir, "--output_dir", tmp_path / "launched", "--num_epochs", "1"], cwd=checkout)
    assert "my copy: epoch 1/1" in result.stdout and read_metrics(tmp_path / "launched")[0]["world_size"] == 2


def test_the_scripts_import_the_top_level_shared_that_the_set_up_installed(tmp_path):
    """requirements.txt installs this repository (`-e .`), so the top-level shared/ imports from any
    folder, and no script, tool or benchmark puts anything on sys.path to find it."""
    result = run([sys.executable, "-c", "import shared; print(shared.__file__)"], cwd=tmp_path)
    assert result.stdout.strip() == str(REPO / "shared" / "__init__.py")
    for path in [*SCRIPTS.glob("*.py"), *(REPO / "tools").glob("*.py"), *(REPO / "shared").glob("*.py")]:
        if path.name != "run_script.py":  # which puts the script it runs first, where `python SCRIPT` looks first
            assert "sys.path" not in path.read_text(), path


def test_toy_mlp_from_a_notebook_cell_in_a_jupyter_kernel(tmp_path):
    """The docs' notebook cell, run twice in a real Jupyter kernel (nbclient, ipykernel): the first trains
    as 2 processes; the second, into the same folder, ends in the one sentence, not a traceback of each."""
    import nbformat

    cell = f"""
import sys
sys.path.insert(0, {str(SCRIPTS)!r})          # the folder that holds toy_mlp.py
from accelerate import notebook_launcher
from shared.notebook import in_notebook
from toy_mlp import main

notebook_launcher(in_notebook(main), args=(["--output_dir", {str(tmp_path / "run")!r}],), num_processes=2, use_port="{free_port()}")
"""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell), nbformat.v4.new_code_cell(cell)])
    run_in_a_kernel(notebook, tmp_path)
    records = read_metrics(tmp_path / "run")
    assert records[-1]["world_size"] == 2
    assert records[-1]["eval_accuracy"] == 1.0 and records[-1]["train_eval_accuracy"] == 1.0
    assert torch.equal(torch.tensor([r["eval_samples"] for r in records]), torch.tensor([2, 2, 2]))
    again = notebook.cells[1].outputs
    assert all(output.output_type == "stream" for output in again), "the cell raised nothing"
    stderr = "".join(output.text for output in again if output.name == "stderr")
    assert [line for line in stderr.splitlines() if "error" in line.lower()] == [
        f"error: --output_dir {tmp_path / 'run'} already holds a run: choose another --output_dir."], stderr


def test_a_complete_template_in_the_kernel_itself_ends_a_mistake_in_the_cell_and_lets_its_folder_go(small_data, tmp_path):
    """notebook_launcher with one process runs main in the kernel, which lives on after the run: a mistake
    of one process (--eval_only without weights) ends the cell in its sentence, not the kernel (it was
    os._exit there); a run lets its --output_dir go at its end, so the next cell can replace it (before,
    the kernel held the lock until it exited, and the folder was 'in use by a run still going'); an
    interrupt of the idle kernel after a run with checkpoints leaves it alive (preemption's watchdog
    ended it with exit 130), and no run's watchdog thread is left waiting (each run left one). A run that runs
    out of memory (CUDA's error, raised by its backward here) ends in that sentence too (until 2026-11-27, a traceback),
    and removes none of what the kernel's earlier runs made (before, another live run's lock file in their folder); a
    signal to stop (SIGUSR1, sent at its fifth step) saves at the epoch's last, its eighth, and ends the cell in one line (before, a traceback)."""
    import nbformat

    def cell(*flags, num_processes=1):
        return f"""
import sys
sys.path.insert(0, {str(SCRIPTS)!r})
from accelerate import notebook_launcher
from shared.notebook import in_notebook
from cpu_gloo import main

notebook_launcher(in_notebook(main), args=([*{[str(flag) for flag in flags]!r}],), num_processes={num_processes}, use_port="{free_port()}")
"""
    common = ["--output_dir", tmp_path / "run", "--data_dir", small_data, "--num_epochs", "1", "--checkpointing_steps", "epoch"]
    # The kernel interrupted after the run (as Jupyter's interrupt button does), idle past preemption's grace
    # (2 s here): the run's watchdog, which wakes at the signal, must have ended with the run.
    interrupt = """
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
except KeyboardInterrupt:
    pass
time.sleep(4)
print("the kernel lives on")
"""
    out_of_memory = f"""
import torch
backward = torch.Tensor.backward
def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
torch.Tensor.backward = out_of_memory
from pathlib import Path
stand_in = Path({str(tmp_path / "run")!r}) / ".lock"
stand_in.write_text("host elsewhere, process 1")  # the lock of a run started elsewhere after the kernel's runs into this folder
"""
    signal_at_step_5 = """
import os, signal, torch
step, steps = torch.optim.SGD.step, []
def step_then_signal(self, *args, **kwargs):
    steps.append(1)
    if len(steps) == 5:
        os.kill(os.getpid(), signal.SIGUSR1)
    return step(self, *args, **kwargs)
torch.optim.SGD.step = step_then_signal
"""
    interrupt_at_step_5 = signal_at_step_5.replace("SIGUSR1", "SIGINT")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        "from shared.preemption import Preemption\nPreemption.GRACE_S = 2",
        cell(*common, "--eval_only"), cell(*common), cell(*common, "--overwrite_output_dir", "--lr", "0.02"),
        out_of_memory + cell(*common[2:], "--output_dir", tmp_path / "out_of_memory") + "torch.Tensor.backward = backward\n"
        + "print(\"another run's lock kept:\", stand_in.exists())\nstand_in.unlink()",
        signal_at_step_5 + cell(*common[2:], "--output_dir", tmp_path / "stopped", "--num_epochs", "3") + "torch.optim.SGD.step = step",
        cell(*common[2:-2], "--output_dir", tmp_path / "bf16", "--mixed_precision", "bf16"),
        cell(*common[2:-2], "--output_dir", tmp_path / "plain"), cell(*common[2:-2], "--output_dir", tmp_path / "pair", num_processes=2),
        interrupt_at_step_5 + "try:\n" + textwrap.indent(cell(*common[2:-2], "--output_dir", tmp_path / "interrupted"), "    ")
        + "except KeyboardInterrupt:\n    print('interrupted')\ntorch.optim.SGD.step = step",
        interrupt,
        "import threading\nprint('watchdogs left:', sum(Preemption._end_if_stuck.__name__ in thread.name for thread in threading.enumerate()))")])
    run_in_a_kernel(notebook, tmp_path)
    said = ["".join(output.get("text", "") for output in each.outputs if output.get("name") == "stderr") for each in notebook.cells]
    assert "error: --eval_only needs --resume_from_checkpoint" in said[1] and all(
        output.output_type == "stream" for each in notebook.cells for output in each.outputs), said
    assert "error" not in said[2] + said[3], said
    assert [line for line in said[4].splitlines() if "error" in line] == [
        "error: Out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.): lower --batch_size."], said[4]
    assert not (tmp_path / "out_of_memory").exists(), "a failed run removes the folder it made"
    assert "another run's lock kept: True" in notebook.cells[4].outputs[-1].text
    assert [line for line in said[5].splitlines() if "Stopped" in line or "error" in line] == [
        f"Stopped by a signal to stop: saved {tmp_path / 'stopped' / 'checkpoints' / 'step_00000008'} after step 8; continue with "
        "--resume_from_checkpoint latest."], said[5]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 1 and records[0]["lr"] == 0.02 and not (tmp_path / "run" / ".lock").exists()
    # Each run in the kernel starts afresh: the next cell's precision (before, bf16 again, without a word), and
    # notebook_launcher's processes (before, it refused to start them once the kernel had run an Accelerator).
    assert [read_metrics(tmp_path / name)[-1]["mixed_precision"] for name in ("bf16", "plain")] == ["bf16", "no"]
    assert [record["world_size"] for record in read_metrics(tmp_path / "pair")] == [2], said[8]
    printed = "".join(output.get("text", "") for output in notebook.cells[-3].outputs if output.get("name") == "stdout")
    assert printed.endswith("interrupted\n"), notebook.cells[-3].outputs
    assert not (tmp_path / "interrupted").exists(), "as Ctrl-C: what it made goes"
    assert notebook.cells[-2].outputs[-1].text == "the kernel lives on\n"
    assert notebook.cells[-1].outputs[-1].text == "watchdogs left: 0\n"


def test_a_notebook_launch_forks_processes_that_can_print_while_the_kernel_prints(tmp_path):
    """ipykernel's IOPub thread takes sys.stdout's lock to send what was printed; a process that
    notebook_launcher forks in that moment would hang at its first print. Once shared.notebook is
    imported, the kernel's forks wait for the lock: 20 forks while a thread prints, each child prints
    and exits."""
    cell = f"""
import os, sys, threading, time
import shared.notebook  # as the cell that imports in_notebook does
printing = True
def print_all_the_time():
    while printing:
        sys.stdout.write(".")
threading.Thread(target=print_all_the_time, daemon=True).start()
ended = []
try:
    for _ in range(20):
        child = os.fork()
        if child == 0:
            print("a forked process prints", flush=True)
            os._exit(0)
        deadline = time.monotonic() + 5
        while not (done := os.waitpid(child, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0]:
            ended.append(f"exit {{os.waitstatus_to_exitcode(done[1])}}")
        else:
            ended.append("hung")
            os.kill(child, 9)
            os.waitpid(child, 0)
finally:
    printing = False
open({str(tmp_path / "ended")!r}, "w").write(" ".join(ended))
"""
    import nbformat

    run_in_a_kernel(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), tmp_path)
    assert (tmp_path / "ended").read_text() == " ".join(["exit 0"] * 20), "every forked process printed and exited"


def run_in_a_kernel(notebook, folder, timeout_s=240):
    """Run a notebook's cells in a real Jupyter kernel (nbclient, ipykernel); a cell that times out fails
    the test with the end of what every cell had printed by then."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    try:
        NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    except CellTimeoutError:
        printed = ["".join(output.get("text", "") for output in cell.get("outputs", []))[-3000:] for cell in notebook.cells]
        pytest.fail(f"a cell ran over {timeout_s} s; the cells had printed: {printed}")


@pytest.mark.smoke
def test_a_mistake_ends_in_one_sentence(tmp_path):
    result = run(python_command("cpu_gloo.py", "--batch_size", "0", "--output_dir", tmp_path / "run"), cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr == (
        "error: argument --batch_size: must be at least 1, got 0: see cpu_gloo.py --help for what it takes.\n")
    assert not (tmp_path / "run").exists()


def test_help_keeps_the_example_commands_on_their_own_lines():
    result = run([sys.executable, "-X", "importtime", SCRIPTS / "mnist_conv.py", "--help"], cwd=SCRIPTS)
    # torch's sharded checkpoints (DTensor's, sympy's: 1.4 s of --help's 4.5 s) only where FSDP loads one
    assert "torch.distributed.checkpoint" not in result.stderr
    assert "\nRun on one process:           python scripts/mnist_conv.py\n" in result.stdout
    help_text = " ".join(result.stdout.split())
    assert "(default: 64)" in help_text, "every default is shown"
    # Not a switch's True or False (--no_split_batches' True reads as its own default), nor an unset flag's None.
    assert "--report_to {tensorboard,mlflow,all} tracker for --with_tracking, stored under --output_dir (default: tensorboard) --data_dir" in help_text
    assert not re.search(r"\(default: (None|True|False)\)", help_text), help_text


def test_accelerate_launch_of_several_processes_that_runs_one_says_so(data_dir, tmp_path):
    """Without a profile, on a machine without GPUs, accelerate's plain launcher starts one process for
    --num_processes 2; the script warns in one line (and trains, as it was started)."""
    env = {**script_env(), "HF_HOME": str(tmp_path / "hf")}  # no default accelerate config of this machine's user
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", SCRIPTS / "cpu_gloo.py",
               "--output_dir", tmp_path / "run", "--data_dir", data_dir, "--max_train_steps", "2"]
    result = run(command, cwd=tmp_path, env=env)
    assert read_metrics(tmp_path / "run")[-1]["world_size"] == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("warning: ")] == [
        "warning: accelerate launch was asked for several processes but started this one alone, which trains by itself: "
        "launch with --config_file accelerate_configs/cpu.yaml, or add --multi_gpu."]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_ctrl_c_stops_every_process_with_one_line(num_processes, data_dir, tmp_path):
    """Ctrl-C in a terminal signals the launcher's foreground process group; torchrun, whose processes
    run in sessions of their own, passes it on to every rank; one process, in the group, gets it itself.
    The launcher adds no line of its own, and exits 130 as the processes do."""
    launcher = ["--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2"] if num_processes == 2 else ["--cpu", "--num_processes", "1"]
    command = [sys.executable, SCRIPTS / "launch.py", *launcher,
               SCRIPTS / "cpu_gloo.py", "--data_dir", data_dir, "--output_dir", tmp_path / "run", "--num_epochs", "50"]
    job = subprocess.Popen([str(part) for part in command], cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "metrics.jsonl").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGINT)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 130, stderr[-2000:]
    assert read_metrics(tmp_path / "run")[0]["world_size"] == num_processes
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr and "error:" not in stderr, stderr
    assert stderr.count("Stopped by Ctrl-C.") == 1, stderr
    assert not processes_naming(tmp_path), "every process of the launch ended"


@pytest.mark.parametrize("stop_signal, exit_code, line", [
    (signal.SIGINT, 130, "Stopped by Ctrl-C."),
    (signal.SIGUSR1, 143, "Stopped by SIGUSR1 while the launcher started: nothing trained; resume with --resume_from_checkpoint latest "
                          "if the run saved checkpoints.")])
def test_a_signal_while_the_launcher_starts_ends_it_in_one_line(stop_signal, exit_code, line, tmp_path):
    """Ctrl-C, or SLURM's SIGUSR1, a second into scripts/launch.py, while it imports torch and accelerate (about 2 s) or
    checks the profile and the flags: before, a KeyboardInterrupt's traceback of 60 lines, and a death by SIGUSR1 (138),
    on which the SLURM batch script does not requeue the job; 143 now, on which it does."""
    job = subprocess.Popen([sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2",
                            SCRIPTS / "toy_mlp.py", "--output_dir", tmp_path / "run"], cwd=tmp_path, env=script_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    job.send_signal(stop_signal)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == exit_code and stderr.splitlines() == [line], (job.returncode, stderr[-3000:])


@pytest.mark.parametrize("num_processes", [1, 2])
def test_ctrl_c_while_the_processes_import_torch_ends_in_one_line(num_processes, tmp_path):
    """Ctrl-C in the seconds each training process imports torch, before the script's own handler is in place
    (tests/probes/importing.py stands in for that script): before, a KeyboardInterrupt's traceback from every process."""
    launcher = ["--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2"] if num_processes == 2 else ["--cpu", "--num_processes", "1"]
    job = subprocess.Popen([str(part) for part in [sys.executable, SCRIPTS / "launch.py", *launcher, REPO / "tests" / "probes" / "importing.py", tmp_path]],
                           cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready_*"))) < num_processes:
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the launcher's foreground process group
    _, stderr = job.communicate(timeout=60)
    assert sorted(path.name for path in tmp_path.glob("ready_*")) == [f"ready_{rank}" for rank in range(num_processes)]
    assert job.returncode == 130 and stderr.splitlines()[-1] == "Stopped by Ctrl-C.", (job.returncode, stderr[-3000:])
    assert stderr.count("Stopped by Ctrl-C.") == 1 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert not processes_naming(tmp_path), "every process of the launch ended"


def test_ctrl_c_that_reaches_a_process_after_it_lost_a_peer_ends_in_the_same_line(tmp_path):
    """The launcher passes Ctrl-C to the processes one after another: the first stops at once, and the
    next may already be leaving because its all-reduce lost that peer when the signal reaches it."""
    job = subprocess.Popen([python(), REPO / "tests" / "probes" / "lost_peer_then_ctrl_c.py"], cwd=tmp_path,
                           env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline() == "lost a peer\n"
    job.send_signal(signal.SIGINT)  # run_main waits LOST_PEER_WAIT_S before it leaves a lost group
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 130
    assert stderr.splitlines() == ["Stopped by Ctrl-C."], stderr
