"""Launched by the tests like a training script: one rank alone finds a mistake (no other rank has it),
while the others go on with the group, as they would in a training step. Its argument is that rank
(default: the last)."""

import sys

from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import UserError, run_main


def main():
    accelerator = Accelerator(cpu=cpu_only())
    finds_it = int(sys.argv[1]) if len(sys.argv) > 1 else accelerator.num_processes - 1
    if accelerator.process_index == finds_it:
        raise UserError(f"a mistake only rank {accelerator.process_index} found: fix it.")
    for _ in range(3):  # the first meets the failing rank's barrier as it leaves the group; the next find it gone
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_main(main)
