"""Process-level plumbing: picking CPU or GPU, and turning user mistakes into one sentence."""

import functools
import os
import sys
import time

import accelerate.optimizer
import torch

# accelerate (1.15) asks importlib at every optimizer step whether the lomo_optim package is
# installed: an uncached search of sys.path that costs about 0.1 ms a step, more than half a small
# net's training step on a CPU (benchmarks/step_overhead.py). Packages do not change in a run: ask once.
if hasattr(accelerate.optimizer, "is_lomo_available"):
    accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)


class UserError(Exception):
    """A mistake the user can fix; the message says how. Printed without a stack trace."""


def cpu_only():
    """Whether this run must use the CPU; stops if the launch asked for GPUs that are not there.

    `accelerate launch` starts processes through torchrun for every multi-process profile; on a
    machine without GPUs those processes join one gloo group only if the Accelerator is built with
    cpu=True (otherwise each trains alone). The GPU profiles name their GPUs (`gpu_ids`), which
    reaches us as CUDA_VISIBLE_DEVICES, so a GPU profile on a CPU machine is caught here.
    """
    if torch.cuda.is_available():
        return False
    requested = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if requested and not requested.startswith("-"):
        raise UserError(
            f"This launch asks for GPUs {requested} (a GPU profile) but PyTorch sees no GPU on this "
            "machine: launch with --config_file accelerate_configs/cpu.yaml instead, or install a CUDA build of PyTorch."
        )
    return True


def first_line(error):
    """The first line of an exception's message, for a one-sentence error."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def run_main(main):
    """Run a script's main(); a UserError ends the process with its sentence and exit code 1."""
    try:
        main()
    except UserError as error:
        rank = int(os.environ.get("RANK", "0"))
        if rank:
            # Usually every rank hits the same mistake: give rank 0 time to say it once; the
            # launcher stops the other ranks when it exits. A rank that fails alone still speaks.
            time.sleep(3)
        prefix = f"[rank {rank}] " if rank else ""
        print(f"{prefix}error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
