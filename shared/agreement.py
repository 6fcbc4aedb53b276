"""Before the first step: every process trains the same, or all stop naming the first difference.

Launched on several machines with different flags, code, packages, launch profiles (each machine
has its own copy of 2node_4gpu.yaml) or data, the processes would otherwise average the gradients of
different models, or wait on each other forever."""

import hashlib
import socket
import sys
from pathlib import Path

import accelerate
import torch
from accelerate.utils import gather_object
from torch.utils.data import TensorDataset

import shared
from shared.errors import UserError

# Flags that may differ from machine to machine without changing what is trained: paths, workers,
# trackers (the main process's alone), checkpoint pruning, and how long to wait for a lost machine.
PER_MACHINE_FLAGS = {"output_dir", "data_dir", "overwrite_output_dir", "num_workers", "with_tracking", "report_to",
                     "keep_last_checkpoints", "ddp_timeout"}
# What is compared -> how a value is said, and what to do about a difference.
PARTS = {"flags": ("--{} is {!r}", "start every process with the same training flags"),
         "profile": ("{} is {}", "launch every machine with the same launch profile settings"),
         "code": ("{} has SHA-256 {}", "run the same code on every machine"),
         "packages": ("{} is {}", "install the same versions everywhere (pip install -r requirements.txt -c constraints.txt)"),
         "data": ("the {} has {}", "give every machine the same copy of the data set (delete a machine's copy under --data_dir "
                  "to have it downloaded again)")}


def check(accelerator, flags):
    """Every process must call this (one all-gather). Compares the training flags (`flags`, vars(args),
    less PER_MACHINE_FLAGS; a checkpoint to resume by its folder's name), what the Accelerator runs
    with (the launch profile's precision, distributed type, device, torch.compile and FSDP settings),
    the code (the script and shared/) and the torch and accelerate versions."""
    stop_at_a_difference(gather_object([what_this_process_trains(accelerator, flags)]))


def check_data(accelerator, train_set, test_set):
    """Every process must call this (one all-gather), after the data load: every process read the same
    data sets, by their sizes and SHA-256s, or all stop naming the first difference. A machine with a
    disk of its own reads its own copy, which may be another data set (the 5,000-digit subset where the
    others have the whole one): its processes would shard other samples, or take fewer steps and hang."""
    if accelerator.num_processes == 1:  # nothing to compare: no hashing at start-up
        return
    data = {}
    for name, dataset in (("training set", train_set), ("test set", test_set)):
        digest = hashlib.sha256()  # 0.1 s for MNIST's 60,000 decoded images
        for tensor in dataset.tensors if isinstance(dataset, TensorDataset) else (dataset.data, dataset.targets):
            digest.update(torch.as_tensor(tensor).contiguous().numpy())
        data[name] = f"{len(dataset)} samples with SHA-256 {digest.hexdigest()[:12]}"
    stop_at_a_difference(gather_object([{"data": data, "host": socket.gethostname()}]))


def stop_at_a_difference(everyone):
    """Raise the first difference between process 0's and another process's gathered description."""
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        for part, (said, advice) in PARTS.items():
            for name in sorted(first.get(part, {}).keys() | theirs.get(part, {}).keys()):
                if first[part].get(name) != theirs[part].get(name):
                    raise UserError(
                        f"The processes disagree before the first step: {said.format(name, theirs[part].get(name))} in process "
                        f"{rank} on {theirs['host']} but {said.format(name, first[part].get(name))} in process 0 on {first['host']}: {advice}.",
                        every_process=True,  # each found it in the same gathered list
                    )


def what_this_process_trains(accelerator, flags):
    trained = {name: value for name, value in flags.items() if name not in PER_MACHINE_FLAGS}
    if trained.get("resume_from_checkpoint"):
        trained["resume_from_checkpoint"] = Path(trained["resume_from_checkpoint"]).name
    state = accelerator.state
    profile = {"distributed type": state.distributed_type.value, "mixed precision": accelerator.mixed_precision,
               "device": accelerator.device.type, "torch.compile backend": state.dynamo_plugin.backend.value,
               "torch.compile mode": state.dynamo_plugin.mode}
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        for setting in ("fsdp_version", "reshard_after_forward", "state_dict_type", "cpu_offload", "mixed_precision_policy",
                        "auto_wrap_policy", "activation_checkpointing"):
            value = getattr(fsdp, setting)
            profile[setting] = getattr(value, "__name__", str(value))  # a wrap policy is a function
    script = getattr(sys.modules["__main__"], "__file__", None)  # none in a notebook
    code = {f"shared/{path.name}": path for path in sorted(Path(shared.__file__).parent.glob("*.py"))}
    if script:
        code[Path(script).name] = Path(script)
    return {
        "flags": trained,
        "profile": profile,
        "code": {name: hashlib.sha256(path.read_bytes()).hexdigest()[:12] for name, path in code.items()},
        "packages": {"torch": torch.__version__, "accelerate": accelerate.__version__},
        "host": socket.gethostname(),
    }
