"""Launched by the tests like a training script: every rank asks torch's CPU allocator for more memory
than any machine has, as a batch too large for its device would; with the argument `cuda`, the last rank
alone raises the torch.OutOfMemoryError that CUDA's allocator raises (no GPU here to fill). Either must
end in the one sentence that says what to lower."""

import sys

import torch
from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import run_main


def main():
    accelerator = Accelerator(cpu=cpu_only())
    if sys.argv[1:] == ["cuda"]:
        if accelerator.process_index == accelerator.num_processes - 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 1 has a total capacity of 79.19 GiB "
                                         "of which 3.06 GiB is free.")
    else:
        torch.empty(1 << 50, dtype=torch.uint8, device=accelerator.device)
    for _ in range(3):  # the others go on with the group, as in a training step
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_main(main)
