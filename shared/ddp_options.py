"""How the processes talk: the Accelerator's kwargs_handlers for the process group and for DDP."""

import os
from datetime import timedelta

from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, InitProcessGroupKwargs, parse_flag_from_env

from shared.errors import UserError


def kwargs_handlers(ddp_timeout, comm_hook="no", bucket_cap_mb=None):
    """The Accelerator's kwargs_handlers from --ddp_timeout, --ddp_comm_hook and --ddp_bucket_cap_mb.

    --ddp_timeout bounds every collective: a process whose peer's machine or network is gone fails after
    that many seconds instead of torch's 30 minutes. PowerSGD starts compressing at step 2, not torch's
    1,000, which these short runs would never reach; its state is not in the checkpoints, so its resumed
    runs are not bitwise.

    At 3 or more processes DDP keeps one gradient layout all run long (find_unused_parameters): it
    otherwise reorders its buckets after the first step, a resumed run's first step would use the first
    order again, and gloo's ring all-reduce adds 3 or more values in an order that follows their place
    in the bucket, so the resumed run would drift (mnist_conv at 4 processes: 3e-3 after five epochs).
    Every such run keeps it, so that saving checkpoints changes nothing either. The price: one more small
    all-reduce per step (benchmarks/README.md), and DDP's warning that no parameter was unused, which
    scripts/launch.py hides. Not under PowerSGD, whose compressed all-reduces cross the layout's own in
    another order on each process (gloo then fails on a size mismatch), and whose resumes drift anyway."""
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and (comm_hook != "no" or bucket_cap_mb):
        flag = "--ddp_comm_hook" if comm_hook != "no" else "--ddp_bucket_cap_mb"
        raise UserError(f"{flag} shapes DDP's gradient all-reduce, which FSDP (fsdp.yaml) does not use: leave it out, "
                        "or launch with a DDP profile.", every_process=True)
    ddp = {"comm_hook": DDPCommunicationHookType(comm_hook)}
    if comm_hook == "power_sgd":
        ddp["comm_state_option"] = {"start_powerSGD_iter": 2}
    if bucket_cap_mb:
        ddp["bucket_cap_mb"] = bucket_cap_mb
    if int(os.environ.get("WORLD_SIZE", "1")) >= 3 and comm_hook != "power_sgd":  # WORLD_SIZE: set by every launcher
        ddp["find_unused_parameters"] = True
    return [InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout)), DistributedDataParallelKwargs(**ddp)]
