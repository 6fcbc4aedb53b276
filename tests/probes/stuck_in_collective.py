"""Launched by the tests like a training script, with checkpointing on: rank 0 never reaches the
collective that the other ranks wait in, as a process whose peer is gone or stuck would. Each
process writes `waiting` under its folder once it is in place, then waits for a signal to stop.

With --slow_save every process instead spends 6 s in one C call inside a function named save_state, as
accelerator.save_state spends writing a large checkpoint (the probe assumes only that name and the
one long call), then writes `saved`."""

import sys
import time
from pathlib import Path

from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import run_main
from shared.preemption import Preemption


def save_state():
    time.sleep(6)  # one C call, twice the probe's GRACE_S


def main():
    accelerator = Accelerator(cpu=cpu_only())
    Preemption.GRACE_S = 3  # the tests' wait; training runs keep the default
    Preemption(accelerator, enabled=True)
    (Path(sys.argv[1]) / f"waiting_{accelerator.process_index}").write_text(str(accelerator.num_processes))
    if "--slow_save" in sys.argv:
        save_state()
        (Path(sys.argv[1]) / f"saved_{accelerator.process_index}").write_text("saved")
    elif accelerator.is_main_process:
        time.sleep(600)  # Python code: its signal handler runs, and sleep goes on after it (PEP 475)
    else:
        accelerator.wait_for_everyone()  # blocked inside gloo: no Python code runs on the main thread


if __name__ == "__main__":
    run_main(main)
