"""Runs the training script PAUSE_SCRIPT, paused after each optimizer step in PAUSE_AT_STEP (comma-separated)
on the ranks in PAUSE_RANKS (all if unset) until a signal to stop reaches the process (with PAUSE_RELEASE_ALL=1,
or another process paused at the same step, since: one signalled process stops them all in the check's
all-reduce, which is all the run needs, where a cluster's signal may reach one machine later than another),
or a file `go` appears in PAUSE_DIR (or PAUSE_DIR/exit_1_<rank>, which it removes and exits 1). Each writes
PAUSE_DIR/checking_<rank>_at_<step> as it enters the step's check for a signal, past its look at its own mark
(a signal from then on waits for the next check); pausing, each writes
PAUSE_DIR/paused_<rank>_at_<step>, and a process that finds its file there already (restarted, it passes
the step again) goes on; a signal to stop adds a line to PAUSE_DIR/signalled_<rank>: its time, its name and the
last optimizer step the process passed. A test that acts on a run (a
signal, a kill, a cut link) then acts at a known step however busy the machine is, where a test that acts
once epoch 1 is recorded can find the run already ended. Pausing changes no arithmetic: the weights stay bitwise those of a run that never paused.
Each step is a multiple of Preemption.CHECK_EVERY, so the processes check for a signal right after it.

    PAUSE_SCRIPT=scripts/cpu_gloo.py PAUSE_AT_STEP=70 PAUSE_DIR=/tmp/run python tests/probes/pause_at_step.py --output_dir ...
"""

import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

from accelerate import Accelerator

from shared.preemption import Preemption

SCRIPT = os.environ["PAUSE_SCRIPT"]
AT_STEPS = [int(step) for step in os.environ["PAUSE_AT_STEP"].split(",")]
FOLDER = Path(os.environ["PAUSE_DIR"])
RANK, RANKS = os.environ.get("RANK", "0"), os.environ.get("PAUSE_RANKS")  # this process's rank; those that pause
RELEASE_ALL = os.environ.get("PAUSE_RELEASE_ALL") == "1"
assert all(step % Preemption.CHECK_EVERY == 0 for step in AT_STEPS), "pause where the processes check for a signal"
signalled = threading.Event()
original_mark, original_stop_agreed = Preemption._mark, Preemption.stop_agreed
original_check_trigger = Accelerator.check_trigger
checking = []  # the step whose check this process is in


def mark(self, signum, frame):  # preemption's handler of SIGTERM and SIGUSR1
    signalled.set()
    with open(FOLDER / f"signalled_{RANK}", "a") as record:  # a test may wait for the signal to have come
        record.write(f"{time.time():.3f} {signal.Signals(signum).name} after step {checking[-1] if checking else 0}\n")
    original_mark(self, signum, frame)


def signalled_since(paused_at, step):
    """Whether this process has had a signal to stop, or (RELEASE_ALL) another at the same step since `paused_at`
    (time.time(); not a record of an earlier start of the run)."""
    return signalled.is_set() or RELEASE_ALL and any(
        float(line.split()[0]) >= paused_at and line.endswith(f" after step {step}")
        for record in FOLDER.glob("signalled_*") for line in record.read_text().split("\n")[:-1])  # whole lines: not one half written


def check_trigger(self):  # the check's all-reduce, after stop_agreed looked at this process's own mark
    if checking and checking[-1] in AT_STEPS:
        (FOLDER / f"checking_{RANK}_at_{checking[-1]}").touch()
    return original_check_trigger(self)


def stop_agreed(self, step, epoch_ends=False, last_step=False):
    checking[:] = [step]
    marker = FOLDER / f"paused_{RANK}_at_{step}"
    if step in AT_STEPS and (RANKS is None or RANK in RANKS.split(",")) and not marker.exists():
        marker.touch()
        paused_at = time.time()
        while not signalled_since(paused_at, step) and not (FOLDER / "go").exists():
            if (crash := FOLDER / f"exit_1_{RANK}").exists():  # a crash, as of a killed DataLoader worker: exit 1, no mistake written
                crash.unlink()  # once
                os._exit(1)
            time.sleep(0.01)
    return original_stop_agreed(self, step, epoch_ends, last_step)


Preemption._mark, Preemption.stop_agreed, Accelerator.check_trigger = mark, stop_agreed, check_trigger
sys.argv = [SCRIPT, *sys.argv[1:]]
sys.path[0] = str(Path(SCRIPT).resolve().parent)  # the script's own folder, as `python script.py` has it
runpy.run_path(SCRIPT, run_name="__main__")
