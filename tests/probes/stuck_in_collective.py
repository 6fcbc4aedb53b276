"""Launched by the tests like a training script, with checkpointing on: rank 0 never reaches the
collective that the other ranks wait in, as a process whose peer is gone or stuck would. Each
process writes `waiting` under its folder once it is in place, then waits for a signal to stop (and where it waits
for the signal in Python, below, writes `signalled` once it has come).

With --slow_save every process instead, once signalled, spends 6 s in one C call inside a function named save_state, as
accelerator.save_state spends writing a large checkpoint (the probe assumes only that name and the
one long call), then writes `saved`; with --stuck_save it stays there, as a save whose peer is lost would;
with --stuck_save_once_agreed the processes first agree on the stop (accelerator.check_trigger), as a
training loop does, then stay in the save. With --waiting_for_data the process instead, once signalled, spends 6 s calling the
same line over and over, each call 0.2 s in one C call, as a loop waiting on its DataLoader's workers does
(a new frame each call), then writes `finished` and ends: it is making progress, not stuck."""

import sys
import time
from pathlib import Path

from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import run_main
from shared.preemption import Preemption


def save_state(seconds):
    time.sleep(seconds)  # one C call


def next_batch():
    time.sleep(0.2)  # one C call, as a wait on the workers' queue


def wait_for_the_signal(preemption, folder, rank):
    """So that the 6 s that follow come after the signal, however long the test took to send it; writes `signalled` then."""
    while not preemption.signalled:
        time.sleep(0.05)
    (folder / f"signalled_{rank}").write_text("signalled")


def main():
    accelerator = Accelerator(cpu=cpu_only())
    Preemption.GRACE_S, Preemption.BUSY_LIMIT_S = 3, 10  # the tests' waits; training runs keep the defaults
    preemption = Preemption(accelerator, enabled=True)
    (Path(sys.argv[1]) / f"waiting_{accelerator.process_index}").write_text(str(accelerator.num_processes))
    if "--stuck_save_once_agreed" in sys.argv:
        while not preemption.stop_agreed(Preemption.CHECK_EVERY):  # a collective each time, until the signal has come
            time.sleep(0.1)
        save_state(600)
    elif "--waiting_for_data" in sys.argv:
        wait_for_the_signal(preemption, Path(sys.argv[1]), accelerator.process_index)
        for _ in range(30):
            next_batch()
        (Path(sys.argv[1]) / f"finished_{accelerator.process_index}").write_text("finished")
    elif "--slow_save" in sys.argv or "--stuck_save" in sys.argv:
        wait_for_the_signal(preemption, Path(sys.argv[1]), accelerator.process_index)
        save_state(6 if "--slow_save" in sys.argv else 600)  # past the probe's GRACE_S, within its BUSY_LIMIT_S; or never done
        (Path(sys.argv[1]) / f"saved_{accelerator.process_index}").write_text("saved")
    elif accelerator.is_main_process:
        time.sleep(600)  # Python code: its signal handler runs, and sleep goes on after it (PEP 475)
    else:
        accelerator.wait_for_everyone()  # blocked inside gloo: no Python code runs on the main thread


if __name__ == "__main__":
    run_main(main)
