"""Runs a training script whose last process runs out of memory inside accelerate's `METHOD` (save_state,
load_state, backward), from its Nth call on (METHOD@N; the first by default), raising the torch.OutOfMemoryError
of CUDA's allocator (no GPU here to fill):

    python tests/probes/out_of_memory_in.py save_state scripts/cpu_gloo.py --checkpointing_steps 2 ...
"""

import runpy
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

method, _, from_call = sys.argv[1].partition("@")
original = getattr(Accelerator, method)
calls = []


def out_of_memory_on_the_last_process(self, *args, **kwargs):
    calls.append(method)
    if self.process_index == self.num_processes - 1 and len(calls) >= int(from_call or 1):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    return original(self, *args, **kwargs)


setattr(Accelerator, method, out_of_memory_on_the_last_process)
sys.argv = sys.argv[2:]
sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # the script's own folder, as `python script.py` has it
runpy.run_path(sys.argv[0], run_name="__main__")
