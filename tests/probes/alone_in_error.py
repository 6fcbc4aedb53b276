"""Launched by the tests like a training script: the last rank alone finds a mistake (no other rank
has it), while rank 0 goes on with the group, as it would in a training step."""

from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import UserError, run_main


def main():
    accelerator = Accelerator(cpu=cpu_only())
    if accelerator.process_index == accelerator.num_processes - 1:
        raise UserError(f"a mistake only rank {accelerator.process_index} found: fix it.")
    for _ in range(3):  # the first meets the failing rank's barrier as it leaves the group; the next find it gone
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_main(main)
