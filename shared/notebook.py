"""A script's main() in a notebook cell, for accelerate's notebook_launcher:

    from accelerate import notebook_launcher
    from shared.notebook import in_notebook
    notebook_launcher(in_notebook(main), args=([],), num_processes=2)
"""

import contextlib
import os
import sys
import threading

from accelerate.state import AcceleratorState, GradientState

from shared import preemption, run_folder
from shared.errors import (MADE_BY_THIS_RUN, OUT_OF_MEMORY_SIGNS, Stopped, UserError, end_in_its_sentence,
                           exit_now, first_line, leave_process_group_together, remove_what_the_failed_run_made)


def in_notebook(main, out_of_memory_advice="lower --batch_size"):
    """main, for notebook_launcher, which every process it starts calls: a UserError, or running out of
    memory (a complete template may pass flags.OUT_OF_MEMORY_ADVICE), ends in its one sentence, and a
    signal to stop in its one line, as under errors.run_main, not in a traceback of every process; the
    cell then ends. With one process, notebook_launcher runs main in the kernel itself, which lives on:
    at the run's end its --output_dir is let go, preemption's watchdog ends, what a failed run made is no
    longer this run's to remove, the next run starts afresh (_forget_the_run), and a mistake ends the cell,
    never the kernel; an interrupt removes what the run made, as Ctrl-C does under errors.run_main."""
    kernel = os.getpid()

    def run(*args):
        kernel_had = _what_the_kernel_had() if os.getpid() == kernel else None
        try:
            main(*args)
        except Stopped as stopped:  # a checkpoint saved on every process
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"Stopped by a signal to stop: {stopped}", file=sys.stderr, flush=True)
            leave_process_group_together()
        except Exception as error:  # any other than these is raised as it is
            if not isinstance(error, UserError) and any(sign in str(error) for sign in OUT_OF_MEMORY_SIGNS):
                error = UserError(f"Out of memory ({first_line(error)}): {out_of_memory_advice}.")
            if not isinstance(error, UserError):
                raise
            end_in_its_sentence(error)
            if not error.every_process and os.getpid() != kernel:  # the others go on: the launcher stops them once this one fails
                exit_now(1)
        except KeyboardInterrupt:
            remove_what_the_failed_run_made()
            raise
        finally:
            run_folder.let_go()
            preemption.stop_watching()
            MADE_BY_THIS_RUN.clear()  # the kernel's next run, which fails, must not remove what this one made
            if kernel_had is not None:
                _forget_the_run(*kernel_had)
    return run


def _what_the_kernel_had():
    """Before a run in the kernel: whether accelerate had state (an Accelerator of the user's own), MLflow's store as the
    user set it (or none), and the user's own active MLflow run."""
    mlflow = sys.modules.get("mlflow")
    active = mlflow.active_run() if mlflow else None
    return bool(AcceleratorState._shared_state), os.environ.get("MLFLOW_TRACKING_URI"), active.info.run_id if active else None


def _forget_the_run(had_state, tracking_uri, users_run):
    """In the kernel after a run, what the kernel had before it comes back. accelerate keeps its state (the precision, the
    device) in the process for the next Accelerator, which then quietly trained in this run's --mixed_precision where the
    next cell asked for none, refused another with a traceback, and kept notebook_launcher from starting processes: it
    is reset, unless it was there before (the user's own Accelerator would lose it); accelerate has no public reset (its
    own tests use this one). An MLflow run this run left active (it failed before end_training) ends in its own store,
    then MLflow's store setting is the user's again."""
    mlflow = sys.modules.get("mlflow")
    if mlflow and (active := mlflow.active_run()) and active.info.run_id != users_run:
        with contextlib.suppress(Exception):  # a store gone
            mlflow.end_run("FAILED")
    if tracking_uri is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    if not had_state:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


_held = threading.local()  # by the thread that forks: two threads may fork at once


def _take_the_output_locks():
    _held.locks = []
    for stream in (sys.stdout, sys.stderr):
        lock = getattr(stream, "_buffer_lock", None)  # ipykernel's OutStream; a terminal's stream has none
        if lock is not None and lock.acquire(timeout=5):  # a lock some stuck thread holds for good never stops a fork
            _held.locks.append(lock)


def _give_back_the_output_locks():
    while _held.locks:
        _held.locks.pop().release()


# notebook_launcher forks the kernel, whose sys.stdout and sys.stderr (ipykernel's) guard their buffer with
# a lock that the kernel's IOPub thread takes to send what was printed. A fork in that moment leaves the
# lock held in the child for good, and that process hangs at its first print (in a kernel that forked 40
# times while a thread printed, 16 children hung). Holding the locks across each fork, as the logging
# module does for its own, gives every child free ones: from the import on, once per kernel.
os.register_at_fork(before=_take_the_output_locks, after_in_parent=_give_back_the_output_locks,
                    after_in_child=_give_back_the_output_locks)
