"""The CPU or the GPUs: what the Accelerator is built for, and the sentence for a launch that asks
for GPUs this machine does not have."""

import os

import torch

from shared.errors import UserError


def cpu_only():
    """The Accelerator's cpu=: whether this run must use the CPU. Stops when the launch named GPUs
    (a GPU profile's gpu_ids, which reach the process as CUDA_VISIBLE_DEVICES) that are not there.

    `accelerate launch` starts every multi-process profile through torchrun; on a machine without
    GPUs those processes join one gloo group only if the Accelerator is built with cpu=True
    (otherwise each trains alone at world size 1)."""
    requested = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if requested and not requested.startswith("-"):
        require_gpus(f"This launch asks for GPUs {requested} (a GPU profile)")
    return not torch.cuda.is_available()


def require_gpus(launch):
    """Stop with one sentence when `launch` (what asks for GPUs, as the sentence's subject) finds none."""
    if not torch.cuda.is_available():
        raise UserError(f"{launch} but PyTorch sees no GPU on this machine: launch with --config_file "
                        "accelerate_configs/cpu.yaml instead, or install a CUDA build of PyTorch.")
