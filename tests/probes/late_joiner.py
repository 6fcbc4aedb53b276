"""Launched by the tests like a training script: every rank stops with the same user mistake, but the
last rank still has work to do with the group first (a collective, as a rank still joining the group
or finishing a step would), while rank 0 stops at once."""

from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import UserError, run_main


def main():
    accelerator = Accelerator(cpu=cpu_only())
    if accelerator.process_index == accelerator.num_processes - 1:
        accelerator.wait_for_everyone()
    raise UserError(f"a mistake found by all {accelerator.num_processes} processes: fix it.")


if __name__ == "__main__":
    run_main(main)
