"""Launched by the tests like a training script: every rank asks torch's CPU allocator for more memory
than any machine has, as a batch too large for its device would; with the argument `cuda`, the last rank
alone raises the torch.OutOfMemoryError that CUDA's allocator raises (no GPU here to fill), and with
`compiled` that error as torch.compile raises it when its compiler ran out, wrapped in its own. Each must
end in the one sentence that says what to lower."""

import sys

import torch
from accelerate import Accelerator
from torch._dynamo.exc import BackendCompilerFailed

from shared.devices import cpu_only
from shared.errors import run_main
from shared.flags import OUT_OF_MEMORY_ADVICE


def inductor(graph, example_inputs):
    """Stands for torch.compile's default backend, which names it in its error."""


def main():
    accelerator = Accelerator(cpu=cpu_only())
    if sys.argv[1:] in (["cuda"], ["compiled"]):
        if accelerator.process_index == accelerator.num_processes - 1:
            error = torch.OutOfMemoryError(  # CUDA's message in full, as torch 2.11 said it on an H100
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 1 has a total capacity of 79.18 GiB of which 3.06 GiB is free. "
                "Including non-PyTorch memory, this process has 76.12 GiB memory in use. Of the allocated memory 75.50 GiB is allocated "
                "by PyTorch, and 120.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
                "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
                "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
            if sys.argv[1:] == ["compiled"]:  # as torch._dynamo's OutputGraph.call_user_compiler raises it: the error in its message alone
                raise BackendCompilerFailed(inductor, error, None) from None
            raise error
    else:
        torch.empty(1 << 50, dtype=torch.uint8, device=accelerator.device)
    for _ in range(3):  # the others go on with the group, as in a training step
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_main(main, OUT_OF_MEMORY_ADVICE)
