"""How a training process ends when something goes wrong: one sentence and an exit code, never a
traceback per process, a hang, or a half-made folder left behind."""

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM, as a process ended by the signal would exit
LOST_PEER_EXIT_CODE = 75  # sysexits.h's EX_TEMPFAIL: this process was fine, but another of the run, or the way to it, is gone
# A rank that fails alone speaks after LONE_ERROR_WAIT_S unless the launcher stops it first (rank 0 failed too and said it);
# a lost peer's survivor leaves LOST_PEER_WAIT_S after, later: the launcher sees the lost one end first (and names it).
LONE_ERROR_WAIT_S, LOST_PEER_WAIT_S = 3, 5
# How gloo, and NCCL when its errors reach Python (TORCH_NCCL_BLOCKING_WAIT=1), say a peer is gone.
LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
                   "Watchdog caught collective operation timeout", "ncclRemoteError", "NCCL communicator was aborted")
OUT_OF_MEMORY_SIGNS = ("out of memory", "can't allocate memory")  # CUDA's, raised or wrapped (torch.compile's), and the CPU's


class UserError(Exception):
    """A mistake the user can fix, in one sentence that says how, printed without a traceback.
    every_process: all processes raised this sentence, so each machine's first process says it."""

    def __init__(self, sentence, every_process=False):
        super().__init__(sentence)
        self.every_process = every_process


class Stopped(Exception):
    """The run saved a checkpoint and stops on purpose (a signal to stop); the message says where."""


def first_line(error):
    """The first line of an exception's message, for a one-sentence error (two where the first ends in a colon, a heading)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    line = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return line if len(line) <= 200 else line[:line.rfind(". ", 100, 200) + 1 or 200]  # where a sentence past 100 ends, if one does


def run_main(main, out_of_memory_advice="lower --batch_size"):
    """Run a script's main(): a UserError ends the process in its sentence and exit code 1 (see end_in_its_sentence), as
    does running out of memory (with `out_of_memory_advice`), Stopped in 143, a lost peer in 75, Ctrl-C in 130; a failed run removes what it had made.
    SHOW_TRACEBACK=1 adds the traceback, for bug reports. main()'s garbage is collected while the interpreter is whole:
    a gloo group destroyed in the interpreter's shutdown aborts the process (the scripts' free_memory() too)."""
    rank = int(os.environ.get("RANK", "0"))
    # accelerate launch was asked for several processes (it sets MASTER_ADDR) but started this one alone, as its plain
    # launcher does on a machine without GPUs: nothing else would show it but world_size 1.
    in_a_group = any(name in os.environ for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"))
    if "ACCELERATE_MIXED_PRECISION" in os.environ and "MASTER_ADDR" in os.environ and not in_a_group:
        print("warning: accelerate launch was asked for several processes but started this one alone, which trains "
              "by itself: launch with --config_file accelerate_configs/cpu.yaml, or add --multi_gpu.", file=sys.stderr, flush=True)
    try:
        try:
            main()
            gc.collect()
        except UserError as error:
            sys.exit(end_in_its_sentence(error))
        except Stopped as stopped:
            if rank == 0:
                print(f"Stopped by a signal to stop: {stopped}", file=sys.stderr, flush=True)
            leave_process_group_together()
            sys.exit(STOPPED_EXIT_CODE)
        except RuntimeError as error:  # gloo reports a lost peer as a RuntimeError (DistBackendError or plain)
            if any(sign in str(error) for sign in OUT_OF_MEMORY_SIGNS):
                sys.exit(end_in_its_sentence(UserError(f"Out of memory ({first_line(error)}): {out_of_memory_advice}.")))
            # Or, as a DistError before the group formed, another machine's processes stopped before they joined it.
            never_joined = isinstance(error, torch.distributed.DistError) and not torch.distributed.is_initialized()
            if not (never_joined or torch.distributed.is_initialized() and any(sign in str(error) for sign in LOST_PEER_SIGNS)):
                raise
            # Another process, or the network to it, is gone: this survivor leaves LOST_PEER_WAIT_S later, in a code saying so.
            print_traceback_if_asked()
            if isinstance(error, torch.distributed.DistStoreError) or "imed out" in str(error):  # waited --ddp_timeout
                print(f"[rank {rank}] stopped: no answer from another process within --ddp_timeout ({first_line(error)})",
                      file=sys.stderr, flush=True)
            time.sleep(LOST_PEER_WAIT_S)
            exit_now(LOST_PEER_EXIT_CODE)
    except KeyboardInterrupt:
        # The launcher passes Ctrl-C on process by process: it can reach this one while it handles another's loss.
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the clean-up
        remove_what_the_failed_run_made()
        if rank == 0:
            print("Stopped by Ctrl-C.", file=sys.stderr, flush=True)
        exit_now(130)  # at once: the other processes are stopping too, so leaving the group could wait on them


def end_in_its_sentence(error):
    """Remove what the failed run made, say the sentence once, write it to torchrun's error file for this process
    (torch's ErrorHandler's form less the traceback: scripts/launch.py restarts no run every start would end the same
    way), and leave the process group. Returns the exit code: 1, or 0 where another process says a mistake every
    process has: the launcher stops all at the first non-zero exit, and could stop that one before it spoke."""
    rank = int(os.environ.get("RANK", "0"))
    remove_what_the_failed_run_made()
    print_traceback_if_asked()
    with contextlib.suppress(KeyError, OSError):  # not under torchrun, or no room to write: then a restart may come
        partial = Path(os.environ["TORCHELASTIC_ERROR_FILE"] + ".partial")  # renamed once whole: torchrun fails on a cut file
        partial.write_text(json.dumps({"message": f"{UserError.__name__}: {error}", "timestamp": int(time.time())}))
        partial.rename(os.environ["TORCHELASTIC_ERROR_FILE"])
    # Rank 0 says it; a mistake every process has is said on every machine, by its first process.
    speaks = rank == 0 or (error.every_process and int(os.environ.get("LOCAL_RANK", "0")) == 0)
    if speaks:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:  # the launcher's SIGTERM, once the one that speaks has left, ends this process in exit code 1, not in preemption's
        # trigger or 143, the code of a run stopped to save, on which SLURM's batch script requeues (a run failing every time)
        for stop_signal in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(stop_signal, lambda *_: exit_now(1))
    leave_process_group_together()
    if speaks or error.every_process:
        return int(speaks)
    # Usually rank 0 has said it and the launcher stops this rank when rank 0 exits; a rank that fails alone still speaks.
    time.sleep(LONE_ERROR_WAIT_S)
    print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
    return 1


def print_traceback_if_asked():
    if os.environ.get("SHOW_TRACEBACK") == "1":
        traceback.print_exc()


def exit_now(code):
    """Exit without tearing down the process group, which could wait on processes that are gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The folders and files that the run in this process made, which a failed run removes (a folder only if empty);
# shared/notebook.py empties it after each of a kernel's runs.
MADE_BY_THIS_RUN = []


def make_folders(path):
    """`path` and those of its parents that are missing (mkdir -p), each of which a failed run removes."""
    for folder in [*reversed(Path(path).parents), Path(path)]:  # outermost first: a failed run removes the innermost first
        try:
            folder.mkdir()
        except FileExistsError:  # there before, or made by another process of the run
            continue
        MADE_BY_THIS_RUN.append(folder)


def remove_what_the_failed_run_made():
    for path in reversed(MADE_BY_THIS_RUN):  # the newest, and so the innermost, first
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() else path.unlink()  # rmdir only succeeds when empty


def leave_process_group_together(timeout_s=10):
    """Leave the process group once every process has come this far: rank 0 hosts the rendezvous, so its
    exit while another rank is still joining crashes that rank, and a group left up can abort in its C++
    teardown. A rank that stops alone waits timeout_s at most, its barrier in a thread that may never return."""
    if not torch.distributed.is_initialized():
        return
    barrier = threading.Thread(target=_barrier_quietly, daemon=True)
    barrier.start()
    barrier.join(timeout_s)
    if not barrier.is_alive():
        torch.distributed.destroy_process_group()


def _barrier_quietly():
    with contextlib.suppress(Exception):  # a peer already left: nothing more to wait for
        torch.distributed.barrier()
