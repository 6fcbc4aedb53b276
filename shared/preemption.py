"""Save, then stop, when a cluster warns that the job is about to be killed.

SIGTERM (Kubernetes, `scancel`, and torchrun passing on its own) and SIGUSR1 (SLURM's `--signal`)
mark the process that receives them; every CHECK_EVERY optimizer steps (and at each epoch's last) a marked process sets
accelerate's trigger (accelerator.set_trigger) and all processes learn in one all-reduce
(accelerator.check_trigger) whether any was signalled, so they save and stop after the same step. A check every step costs as much as a
second all-reduce (+30% of cpu_gloo.py's 2-process step); every 10 steps it is within noise
(benchmarks/README.md).

A process blocked in a collective that never completes (a peer gone or stuck) never runs Python's
signal handlers, which wait for the main thread. A thread of its own wakes at the signal instead
(Python's C-level handler writes the signal's number to the wakeup fd even then) and, when the main
thread has stood in the same call at the same instruction for GRACE_S seconds since (evaluating, or waiting for
its data, it moves on; blocked in C, it does not), ends the process with one line, before torchrun kills it. It watches the save of an agreed
stop too, on every process, signalled or not (stop_agreed wakes it), as its peer can be lost as well: a machine gone
mid-save would hold the others until --ddp_timeout. Writing or reading a checkpoint or the model (safetensors writes a whole file in one C
call), or waiting while another process does, may stand at one line up to BUSY_LIMIT_S instead: a slow
save after a signal completes.
"""

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback

from shared.errors import STOPPED_EXIT_CODE, exit_now


WAKEUP_SOCKETS = []
WATCHING = []  # the Preemptions of this process's run, until stop_watching


def signal_numbers():
    """The two ends of a socket whose first receives the number of every signal this process gets (the second is
    Python's wakeup fd, written by its C-level handler): a thread can wait on it where the main thread, blocked in C,
    runs no handler. Both ends stay open for the process's life: Python writes each later signal's number to the wakeup
    fd, which once closed would be the number of the next file opened, a checkpoint's, say."""
    reader, writer = socket.socketpair()
    WAKEUP_SOCKETS.append((reader, writer))
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    return reader, writer


class Preemption:
    """With `enabled` (checkpointing on), SIGTERM and SIGUSR1 mark this process instead of ending it."""

    CHECK_EVERY = 10
    # Inside torchrun's 90 s (scripts/launch.py) between passing a signal on and killing; past the 30 s in which torchrun
    # kills the others after one failed, so that those end killed, which a restart follows, not in 143, a stop to save.
    GRACE_S = 35
    # Saves and loads, inside which the main thread is busy, not stuck, up to BUSY_LIMIT_S (a peer lost mid-save: for good).
    BUSY_IN = {"save_state", "load_state", "save_model", "saving", "if_write_fails"}
    BUSY_LIMIT_S = 80

    def __init__(self, accelerator, enabled):
        self.accelerator, self.enabled, self.ended, self.signalled = accelerator, enabled, threading.Event(), False
        if enabled:
            self.replaced = {stop_signal: signal.signal(stop_signal, self._mark) for stop_signal in (signal.SIGTERM, signal.SIGUSR1)}
            reader, self.wakeup = signal_numbers()
            threading.Thread(target=self._end_if_stuck, args=(reader,), daemon=True).start()
            WATCHING.append(self)

    def _mark(self, signum, frame):
        self.signalled = True  # only a flag: the handler runs at any line, and set_trigger's tensor (a copy to the GPU) could
        # land inside a CUDA graph's capture, or wait on a stream that a lost peer hangs

    def stop_agreed(self, step, epoch_ends=False, last_step=False):
        """Every process must call this after each optimizer step: whether all stop now. Every CHECK_EVERY steps, and
        at the epoch's last (`epoch_ends`: before its evaluation, which could outlast the launcher's wait), it is a
        collective, accelerator.check_trigger(); not at the run's `last_step` (--max_train_steps), which finishes the run
        instead: a signal since the last check lets it save its model, as a stop would save a checkpoint."""
        if not self.enabled or last_step or (step % self.CHECK_EVERY and not epoch_ends):
            return False
        if self.signalled:
            self.accelerator.set_trigger()
        if not self.accelerator.check_trigger():
            return False
        if not self.signalled:  # another process's signal: this one's save is watched too, as a lost peer could hold it
            self.wakeup.send(bytes([signal.SIGTERM]))
        return True

    def _end_if_stuck(self, reader):
        signum = None
        while signum not in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signum = reader.recv(1)[0]
            if self.ended.is_set():  # a signal after the run, to a process that outlives it
                return
        what, exit_code = ("Ctrl-C", 128 + signal.SIGINT) if signum == signal.SIGINT else ("a signal to stop", STOPPED_EXIT_CODE)
        main, where, since = threading.main_thread().ident, None, time.monotonic()
        while not self.ended.is_set():  # until the run ends: after its save, an agreed stop ends it
            frame = sys._current_frames().get(main)
            # The frame itself, not its line: a loop that waits on its data calls the same line anew (a new frame) many times a second.
            here = (frame, frame.f_lasti) if frame else None  # kept, so no later frame can take its place in memory
            busy = frame is not None and any(each.f_code.co_name in self.BUSY_IN for each, _ in traceback.walk_stack(frame))
            limit = self.BUSY_LIMIT_S if busy else self.GRACE_S
            if here != where:  # the main thread moved on
                where, since = here, time.monotonic()
            elif time.monotonic() - since > limit:
                print(f"[rank {self.accelerator.process_index}] stopped: {limit} s after {what}, this process "
                      "was still waiting on another, so it could not save a checkpoint; the newest complete one stays "
                      "'latest'.", file=sys.stderr, flush=True)
                exit_now(exit_code)
            time.sleep(0.5)


def ignore_stop_signals(worker_id):
    """A DataLoader's worker_init_fn: its workers leave SIGTERM and SIGUSR1 to the training process. The launcher
    signals that process's whole process group (torchrun's killpg; SLURM every process of the job step), its
    workers too, where torch's handler ends a worker on a SIGTERM from any process but its parent: the training
    process then failed in "DataLoader worker is killed by signal" instead of saving. The parent's own SIGTERM
    (how it ends workers left at its exit) still ends the worker, as torch's handler does."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # the training process's, inherited by fork: the worker's signals are not its
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # left to this thread, and to those started after
    threading.Thread(target=_end_at_the_parents_sigterm, daemon=True).start()


def _end_at_the_parents_sigterm():
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != os.getppid():
        pass
    os._exit(0)


def stop_watching():
    """At the end of a run in a process that outlives it (a notebook's kernel, which an interrupt sends
    SIGINT): the watchdogs end, and the signal handlers they replaced are back."""
    while WATCHING:
        preemption = WATCHING.pop()
        preemption.ended.set()
        for stop_signal, handler in preemption.replaced.items():
            signal.signal(stop_signal, handler)
    for _, writer in WAKEUP_SOCKETS:  # a watchdog waiting for a signal on its socket wakes at a 0, and ends: else each run left one
        with contextlib.suppress(OSError):
            writer.send(b"\0")
