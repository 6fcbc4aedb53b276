"""How the processes talk: the Accelerator's kwargs_handlers for the process group and for DDP."""

import os
from datetime import timedelta

import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, InitProcessGroupKwargs

from shared.errors import UserError


def kwargs_handlers(ddp_timeout, comm_hook="no", bucket_cap_mb=None):
    """The Accelerator's kwargs_handlers from --ddp_timeout, --ddp_comm_hook and --ddp_bucket_cap_mb.

    --ddp_timeout bounds every collective: a process whose peer's machine or network is gone fails
    after that many seconds instead of torch's 30 minutes. PowerSGD starts compressing at step 2, not
    torch's 1,000, which these short runs would never reach; its state is not in the checkpoints, so
    its resumed runs are not bitwise.

    At 3 or more processes DDP keeps one gradient layout all run long (find_unused_parameters). DDP
    otherwise reorders its buckets after the first step, and a resumed run's first step would use the
    first order again; gloo's ring all-reduce adds the values of 3 or more processes in an order that
    follows a value's place in the bucket, so the resumed run would drift (mnist_conv at 4 processes:
    3e-3 after five epochs). Turned on for every such run, not only those that save or resume, so that
    saving checkpoints does not change the model either. At 2 processes each sum has two terms, whose
    order cannot matter. The price: one more small all-reduce per step (benchmarks/README.md), and
    DDP's warning that no parameter was unused, which scripts/launch.py hides."""
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and (comm_hook != "no" or bucket_cap_mb):
        flag = "--ddp_comm_hook" if comm_hook != "no" else "--ddp_bucket_cap_mb"
        raise UserError(f"{flag} shapes DDP's gradient all-reduce, which FSDP (fsdp.yaml) does not use: leave it out, "
                        "or launch with a DDP profile.", every_process=True)
    if comm_hook == "batched_power_sgd" and not batched_power_sgd_works():
        raise UserError(f"--ddp_comm_hook batched_power_sgd fails in torch {torch.__version__} (its hook hands a single matrix to "
                        "an orthogonalization that takes a batch of them): use --ddp_comm_hook power_sgd.", every_process=True)
    ddp = {"comm_hook": DDPCommunicationHookType(comm_hook)}
    if "power_sgd" in comm_hook:
        ddp["comm_state_option"] = {"start_powerSGD_iter": 2}
    if bucket_cap_mb:
        ddp["bucket_cap_mb"] = bucket_cap_mb
    # Not under PowerSGD: its compressed all-reduces, started from the callbacks of earlier ones, cross
    # the layout's own all-reduce in another order on each process, which gloo ends in a size mismatch
    # (cpu_gloo.py at 4 processes, every run); its resumes are not bitwise anyway.
    if int(os.environ.get("WORLD_SIZE", "1")) >= 3 and "power_sgd" not in comm_hook:  # WORLD_SIZE: set by every launcher
        ddp["find_unused_parameters"] = True
    return [InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout)), DistributedDataParallelKwargs(**ddp)]


def batched_power_sgd_works():
    """torch 2.15's batched_powerSGD_hook orthogonalizes its 2-D low-rank matrix with a function that
    asserts a 3-D batch; try that call on a small matrix."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(4, 1))
        return True
    except AssertionError:
        return False
