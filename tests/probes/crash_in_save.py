"""Runs a training script whose Nth checkpoint save dies halfway (CRASH_AT_SAVE=N): the state is
written, one file is cut in half, and the process is killed before the checkpoint is complete.

    python tests/probes/crash_in_save.py scripts/cpu_gloo.py --checkpointing_steps 20 ...
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from accelerate import Accelerator

CRASH_AT = int(os.environ["CRASH_AT_SAVE"])
original_save_state = Accelerator.save_state
saves = 0


def save_state_then_die(self, output_dir=None, **kwargs):
    global saves
    saves += 1
    result = original_save_state(self, output_dir, **kwargs)
    if saves == CRASH_AT:
        weights = Path(output_dir) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return result


Accelerator.save_state = save_state_then_die
sys.argv = sys.argv[1:]
sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # the script's own folder, as `python script.py` has it
runpy.run_path(sys.argv[0], run_name="__main__")
