"""`accelerate launch` with one-sentence errors: the same arguments, the same launcher.

    python scripts/launch.py --config_file accelerate_configs/cpu.yaml scripts/cpu_gloo.py --num_epochs 3

Before starting anything it checks the profile: that it exists, that it parses, and that a profile
asking for GPUs finds some. Then it runs accelerate's own launcher in this process. When a training
process fails it has already printed its own one-sentence error, so torchrun's report and traceback
are left out; a process killed from outside gets one line saying which rank stopped. Exits 1.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def fail(sentence):
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    sys.exit(1)


def check_profile(path, cpu_flag):
    try:
        config = load_config_from_file(path)
    except FileNotFoundError:
        fail(f"Profile {path} does not exist: pass one of the files in accelerate_configs/ to --config_file.")
    except Exception as error:  # YAML and accelerate's own checks raise many kinds
        reason = " ".join(str(error).split())[:200]
        fail(f"Profile {path} could not be read ({reason}): fix it, or write a new one with `accelerate config --config_file {path}`.")
    if not (config.use_cpu or cpu_flag) and not torch.cuda.is_available():
        fail(
            f"Profile {path} asks for GPUs ({config.distributed_type}, {config.num_processes} processes) but PyTorch "
            "sees no GPU on this machine: use --config_file accelerate_configs/cpu.yaml, or install a CUDA build of PyTorch."
        )


def stopped(what, exitcode):
    """Exit code 1 means the process already printed why (its one-sentence error, or a bug's traceback)."""
    if exitcode == 1:
        sys.exit(1)
    fail(f"Training stopped: {what}. Resume with --resume_from_checkpoint latest if the run saved checkpoints.")


def how_it_ended(failure):
    if failure.exitcode < 0:
        return f"was killed by signal {-failure.exitcode}"
    return f"exited with code {failure.exitcode}"


def main():
    args = launch_command_parser().parse_args()
    if not (args.module or args.no_python or Path(args.training_script).is_file()):
        fail(f"Training script {args.training_script} does not exist: pass the path of one of the files in scripts/.")
    if args.config_file:
        check_profile(args.config_file, args.cpu)
    # torchrun logs every failure at length; the failed process has already said what went wrong.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # The training processes' C++ warnings (gloo's connection notices, DDP's note on unused
    # parameters) too; errors still show. A value you set wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        launch_command(args)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        stopped(f"rank {rank} {how_it_ended(failure)}", failure.exitcode)
    except subprocess.CalledProcessError as error:  # the one-process launcher
        stopped(f"the process exited with code {error.returncode}", error.returncode)
    except (ValueError, ConnectionError) as error:  # accelerate's checks of the launch arguments
        fail(f"{error} ")
    except KeyboardInterrupt:
        fail("Training stopped by Ctrl-C; resume it with --resume_from_checkpoint latest if it saved checkpoints.")


if __name__ == "__main__":
    main()
