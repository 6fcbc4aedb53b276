"""Before the first step: every process trains the same, or all stop naming the first difference.

Launched on several machines with different flags, code, packages, launch profiles (each machine has its
own copy of 2node_4gpu.yaml) or data (each its own copy, where disks are not shared: the 5,000-digit
subset on one, the whole set on another), the processes would otherwise average the gradients of
different models, or take different numbers of steps and wait on each other forever."""

import hashlib
import socket
import sys
from pathlib import Path

import accelerate
import torch
from accelerate.utils import gather_object

import shared
from shared.errors import UserError

# Flags that may differ from machine to machine without changing what is trained: paths, workers, the
# tracker (the main process's alone; --with_tracking is compared: every process then checks its start),
# checkpoint pruning, and how long to wait for a lost machine.
PER_MACHINE_FLAGS = {"output_dir", "data_dir", "overwrite_output_dir", "num_workers", "report_to", "keep_last_checkpoints",
                     "ddp_timeout"}
# Compared by their effect: the precision in the profile below (--mixed_precision bf16 on one machine and a bf16
# profile on another train the same), the data set by its content (check_data: a local copy at another path reads the same).
COMPARED_BY_EFFECT = {"mixed_precision", "dataset_name"}
# What is compared, and what to do about a difference.
ADVICE = {"flags": "start every process with the same training flags",
          "profile": "launch every machine with the same launch profile settings",
          "code": "run the same code on every machine",
          "packages": "install the same versions everywhere (pip install -r requirements.txt -c constraints.txt)",
          "data": "give every machine the same copy of the data set (delete a machine's copy under --data_dir to have it downloaded again)",
          "weights": "give every machine the same copy of the checkpoint (machine 0's), or resume from one they saved together"}


def check(accelerator, flags):
    """Every process must call this (one all-gather), before any other collective: compares the training
    flags (`flags`, vars(args), less PER_MACHINE_FLAGS; a checkpoint to resume by its folder's name), what
    the Accelerator runs with (the launch profile's precision, distributed type, device, torch.compile and
    FSDP settings), the code (the script and shared/) and the torch and accelerate versions."""
    trained = {name: value for name, value in flags.items() if name not in PER_MACHINE_FLAGS | COMPARED_BY_EFFECT}
    if trained.get("resume_from_checkpoint"):
        trained["resume_from_checkpoint"] = Path(trained["resume_from_checkpoint"]).name
    state = accelerator.state
    # Each changes the collectives a process runs: accelerate's debug mode adds a gather before each, and
    # ACCELERATE_GRADIENT_ACCUMULATION_STEPS overrides the flag.
    profile = {"distributed type": state.distributed_type.value, "mixed precision": accelerator.mixed_precision,
               "device": accelerator.device.type, "torch.compile backend": state.dynamo_plugin.backend.value,
               "torch.compile mode": state.dynamo_plugin.mode, "debug mode": state.debug,
               "gradient accumulation": accelerator.gradient_accumulation_steps}
    if getattr(state, "fsdp_plugin", None):
        for setting in ("fsdp_version", "reshard_after_forward", "state_dict_type", "cpu_offload", "mixed_precision_policy",
                        "auto_wrap_policy", "min_num_params", "transformer_cls_names_to_wrap", "cpu_ram_efficient_loading",
                        "activation_checkpointing"):
            value = getattr(state.fsdp_plugin, setting)
            profile[setting] = getattr(value, "__name__", value)  # a wrap policy is a function
    script = getattr(sys.modules["__main__"], "__file__", None)  # none in a notebook
    code = {f"shared/{path.name}": path for path in sorted(Path(shared.__file__).parent.glob("*.py"))}
    if script:
        code[Path(script).name] = Path(script)
    # The code and the packages first: another version of either can explain a difference of flags or profile (a new flag,
    # another default), not the other way round.
    stop_at_a_difference({
        "code": {name: f"{name} has SHA-256 {hashlib.sha256(path.read_bytes()).hexdigest()[:12]}" for name, path in code.items()},
        "packages": {"torch": f"torch is {torch.__version__}", "accelerate": f"accelerate is {accelerate.__version__}"},
        "profile": {name: f"{name} is {value}" for name, value in profile.items()},
        "flags": {name: f"--{name} is {value!r}" for name, value in trained.items()}})


def check_data(accelerator, train_set, test_set):
    """Every process must call this (one all-gather), after the data load: every process read the same
    data sets, by their sizes and SHA-256s (0.1 s for MNIST's 60,000 decoded images), or all stop."""
    if accelerator.num_processes == 1:  # nothing to compare: no hashing at start-up
        return
    data = {}
    for name, dataset in (("training set", train_set), ("test set", test_set)):
        digest = hashlib.sha256()
        for tensor in dataset.tensors if hasattr(dataset, "tensors") else (dataset.data, dataset.targets):
            digest.update(torch.as_tensor(tensor).cpu().contiguous().numpy())  # a data set of yours may live on the GPU
        data[name] = f"the {name} has {len(dataset)} samples with SHA-256 {digest.hexdigest()[:12]}"
    stop_at_a_difference({"data": data})


def check_weights(accelerator, model):
    """Every process must call this after a checkpoint's load_state (one all-gather where each machine has
    a disk, and so a copy, of its own): every process loaded the same parameters, or all stop. Each copy
    was checked against its own digests only; one that another run saved there (a resume on one machine
    alone) passes that, and its weights would mix with the others' (BatchNorm's running statistics,
    which each process keeps, are not compared)."""
    if not accelerator.project_configuration.save_on_each_node:  # one copy, on the disk every machine shares
        return
    digest = hashlib.sha256()
    for parameter in accelerator.unwrap_model(model, keep_torch_compile=False).parameters():
        digest.update(parameter.detach().float().cpu().numpy().tobytes())
    stop_at_a_difference({"weights": {"parameters": f"the loaded weights have SHA-256 {digest.hexdigest()[:12]}"}})


def stop_at_a_difference(description):
    """Every process must call this (one gather): raises the first difference between process 0's description
    (what it compares, each as a sentence part that says its value) and another's."""
    everyone = gather_object([{**description, "host": socket.gethostname()}])
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        for part in description:
            for name in sorted(first[part].keys() | theirs[part].keys()):
                if first[part].get(name) != theirs[part].get(name):
                    said = [each[part].get(name, f"{name} is not there") for each in (theirs, first)]
                    raise UserError(f"The processes disagree before the first step: {said[0]} in process {rank} on {theirs['host']} "
                                    f"but {said[1]} in process 0 on {first['host']}: {ADVICE[part]}.", every_process=True)
