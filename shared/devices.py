"""The CPU or the GPUs: what the Accelerator is built for, and the sentence for a launch that asks
for GPUs this machine does not have."""

import os

import torch
from accelerate.utils import parse_flag_from_env

from shared.errors import UserError


def cpu_only():
    """The Accelerator's cpu=: whether this run must use the CPU. Stops when the launch named GPUs
    (a GPU profile's gpu_ids, which reach the process as CUDA_VISIBLE_DEVICES) that are not there, or
    starts more processes on this machine than it has GPUs (each takes the GPU of its local rank)."""
    if parse_flag_from_env("ACCELERATE_USE_CPU"):  # cpu.yaml or --cpu, whatever GPUs a job's environment names
        return True
    requested = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    asked = requested and not requested.startswith("-")
    if asked or torch.cuda.is_available():
        require_gpus(f"This launch asks for GPUs {requested or 'all'}" + (" (a GPU profile)" if asked else ""),
                     per_machine=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),  # torchrun's processes on this machine
                     processes=int(os.environ.get("WORLD_SIZE", "1")))
    return not torch.cuda.is_available()


def require_gpus(launch, per_machine=1, processes=1):
    """Stop with one sentence when `launch` (what asks for GPUs, as the sentence's subject) finds none,
    or fewer than its `per_machine` processes on this machine (of `processes` on all machines)."""
    if not torch.cuda.is_available():
        raise UserError(f"{launch} but PyTorch sees no GPU on this machine: launch with --config_file "
                        "accelerate_configs/cpu.yaml instead, or install a CUDA build of PyTorch.", every_process=True)
    found = torch.cuda.device_count()  # of those the profile's gpu_ids name
    if per_machine > found:
        machines = max(processes // per_machine, 1)
        fitting = f"{found * machines} ({found} on each of {machines} machines)" if machines > 1 else f"{found}"
        raise UserError(f"{launch}, one for each of its {per_machine} processes on this machine, but PyTorch sees {found}: "
                        f"pass --num_processes {fitting}, or train on the CPU with scripts/launch.py --config_file "
                        "accelerate_configs/cpu.yaml.", every_process=True)
