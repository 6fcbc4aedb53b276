"""Process-level plumbing: picking CPU or GPU, and turning user mistakes into one sentence."""

import contextlib
import gc
import hashlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
from accelerate.utils import (DDPCommunicationHookType, DistributedDataParallelKwargs, InitProcessGroupKwargs, broadcast_object_list,
                               gather_object)


class UserError(Exception):
    """A mistake the user can fix; the message says how. Printed without a stack trace. every_process:
    a collective raised it on every process with this sentence, so each machine's first process says
    it for all of that machine's processes."""

    def __init__(self, sentence, every_process=False):
        super().__init__(sentence)
        self.every_process = every_process


def cpu_only():
    """Whether this run must use the CPU; stops if the launch asked for GPUs that are not there.

    `accelerate launch` starts processes through torchrun for every multi-process profile; on a
    machine without GPUs those processes join one gloo group only if the Accelerator is built with
    cpu=True (otherwise each trains alone). The GPU profiles name their GPUs (`gpu_ids`), which
    reaches us as CUDA_VISIBLE_DEVICES, so a GPU profile on a CPU machine is caught here.
    """
    if torch.cuda.is_available():
        return False
    requested = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if requested and not requested.startswith("-"):
        raise UserError(
            f"This launch asks for GPUs {requested} (a GPU profile) but PyTorch sees no GPU on this "
            "machine: launch with --config_file accelerate_configs/cpu.yaml instead, or install a CUDA build of PyTorch."
        )
    return True


def distributed_kwargs(ddp_timeout, comm_hook="no", bucket_cap_mb=None):
    """The Accelerator's kwargs_handlers: how long a process waits for the others, how DDP sends its
    gradients (`comm_hook`: --ddp_comm_hook, `bucket_cap_mb`: --ddp_bucket_cap_mb), and, at 3 or more
    processes, DDP keeping one gradient layout all run long.

    PowerSGD starts compressing after start_powerSGD_iter steps of plain all-reduce; torch's default
    of 1,000 would leave these scripts' short runs uncompressed, so it starts at step 2 (the first
    steps it needs for its error feedback). Its state (error feedback, low-rank bases) is not in the
    checkpoints, so a resumed run does not end bitwise as one that never stopped.

    --ddp_timeout bounds every collective: a process whose peer's machine or network is gone fails
    after that many seconds instead of waiting on (torch's default is 30 minutes).

    DDP reorders its gradient buckets once, after the first step, to the order backward produces
    them; a run resumed from a checkpoint takes its first step with the initial order again. At 3 or
    more processes gloo's ring all-reduce adds the processes' values in an order that depends on a
    value's place in the bucket, so that step rounds differently and the resumed run drifts away
    (mnist_conv at 4 processes: 1e-7 after one epoch, 3e-3 after five). DDP never reorders when
    find_unused_parameters is on, so every run of 3 or more processes turns it on: a run with or
    without checkpoints, and one resumed from them, then end bitwise equal. (Turned on only for runs
    that save or resume, it made those runs differ from the same run without checkpoints; at 2
    processes each sum has two terms, whose order cannot change the result.) Its price is one more
    all-reduce per step, of DDP's map of used parameters (measured: benchmarks/README.md), and DDP's
    warning at the first step that no parameter was unused, which scripts/launch.py hides.
    """
    if comm_hook == "batched_power_sgd" and not _batched_power_sgd_works():
        raise UserError(f"--ddp_comm_hook batched_power_sgd fails in torch {torch.__version__} (its hook hands a single matrix to "
                        "an orthogonalization that takes a batch of them): use --ddp_comm_hook power_sgd.")
    ddp = {"comm_hook": DDPCommunicationHookType(comm_hook)}
    if "power_sgd" in comm_hook:
        ddp["comm_state_option"] = {"start_powerSGD_iter": 2}
    if bucket_cap_mb:
        ddp["bucket_cap_mb"] = bucket_cap_mb
    # Not under PowerSGD, whose resume is not bitwise anyway: its compressed all-reduces, started from
    # the callbacks of earlier ones, then cross the map's all-reduce in another order on each process,
    # which gloo ends in a size mismatch (measured: cpu_gloo.py at 4 processes, every run).
    if int(os.environ.get("WORLD_SIZE", "1")) >= 3 and "power_sgd" not in comm_hook:  # WORLD_SIZE: set by every launcher
        ddp["find_unused_parameters"] = True
    return [InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout)), DistributedDataParallelKwargs(**ddp)]


# Flags that may differ from machine to machine without changing what is trained: paths, workers,
# trackers (the main process's alone), checkpoint pruning, and how long to wait for a lost machine.
PER_MACHINE_FLAGS = {"output_dir", "data_dir", "overwrite_output_dir", "num_workers", "with_tracking", "report_to",
                     "keep_last_checkpoints", "ddp_timeout"}


def check_processes_agree(accelerator, flags):
    """Stop every process with one sentence, before the first step, unless all processes run the same
    training: the same flags (`flags`, vars(args), less PER_MACHINE_FLAGS; a checkpoint to resume by
    its folder's name), the same code (the script and shared/), and the same torch and accelerate.
    Launched on several machines with different flags or code, the processes would otherwise average
    gradients of different models, or wait on each other forever. One all-gather."""
    mine = _what_this_process_trains(flags)
    everyone = gather_object([mine])
    for rank, theirs in enumerate(everyone):
        for part, (what, advice) in (("flags", ("--{} is {!r}", "start every process with the same training flags")),
                                     ("code", ("{} has SHA-256 {:.12}", "run the same code on every machine")),
                                     ("packages", ("{} is {}", "install the same versions everywhere (pip install -r "
                                                                "requirements.txt -c constraints.txt)"))):
            for name in sorted(everyone[0][part].keys() | theirs[part].keys()):
                first, other = everyone[0][part].get(name), theirs[part].get(name)
                if first != other:
                    raise UserError(
                        f"The processes disagree before the first step: {what.format(name, other)} in process {rank} on "
                        f"{theirs['host']} but {what.format(name, first)} in process 0 on {everyone[0]['host']}: {advice}.",
                        every_process=True,  # each found it in the same gathered list
                    )


def _what_this_process_trains(flags):
    import accelerate
    import shared

    trained = {name: value for name, value in flags.items() if name not in PER_MACHINE_FLAGS}
    if trained.get("resume_from_checkpoint"):
        trained["resume_from_checkpoint"] = Path(trained["resume_from_checkpoint"]).name
    sources = sorted(Path(shared.__file__).parent.glob("*.py"))
    script = getattr(sys.modules["__main__"], "__file__", None)  # none in a notebook
    code = {f"shared/{path.name}": path for path in sources}
    if script:
        code[Path(script).name] = Path(script)
    return {
        "flags": trained,
        "code": {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in code.items()},
        "packages": {"torch": torch.__version__, "accelerate": accelerate.__version__},
        "host": socket.gethostname(),
    }


def keep_batchnorm_in_float32_under_fsdp(accelerator, model):
    """Under FSDP2 with mixed precision (fsdp.yaml: bf16), give each BatchNorm layer a shard of its own
    whose parameters stay fp32; call it before the optimizer is built. Does nothing otherwise.

    accelerate's FSDP2 policy casts every parameter to bf16 but no buffer, so BatchNorm would meet
    bf16 weights with fp32 running statistics: the CPU kernel rejects that mix ("expected scalar type
    BFloat16 but found Float"), CUDA's accepts it at bf16 precision for the affine weights. FSDP1 kept
    BatchNorm out of its mixed precision for this reason; FSDP2 has no such rule. accelerator.prepare
    then shards the rest of the model around these layers, which compute in fp32 and hand bf16 on."""
    if getattr(accelerator, "is_fsdp2", False) and accelerator.mixed_precision in ("bf16", "fp16"):
        shard_batchnorm_in_float32(model, torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float16)


def shard_batchnorm_in_float32(model, compute_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=compute_dtype)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            fully_shard(module, mp_policy=policy)


def _batched_power_sgd_works():
    """torch 2.15's batched_powerSGD_hook orthogonalizes its 2-D low-rank matrix with a function that
    asserts a 3-D batch; try that call on a small matrix."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(4, 1))
        return True
    except AssertionError:
        return False


class Preempted(Exception):
    """The run saved a checkpoint and stops because a process was told the job will be killed."""


class Preemption:
    """Save, then stop, when a cluster warns that the job is about to be killed.

    With checkpointing on, SIGTERM (what Kubernetes sends, and what torchrun passes on to every
    training process when it gets one) and SIGUSR1 (SLURM's --signal) mark the process that receives
    them. Every CHECK_EVERY optimizer steps all processes learn in one all-reduce (accelerate's
    set_trigger and check_trigger) whether any was marked, so they stop after the same step: a
    signal to one process or to the launcher stops the run within CHECK_EVERY steps. A check every
    step costs as much as a second all-reduce (+30% of cpu_gloo.py's 2-process step); every 10 steps
    it is within noise (benchmarks/README.md). Without checkpointing the signals keep their
    default: the process ends.

    A process blocked in a collective that never completes (a peer gone or stuck) never runs Python's
    signal handlers, which wait for the main thread. So a thread of its own wakes at the signal
    (Python's C-level handler writes the signal's number to the wakeup fd even then) and, when no
    optimizer step has finished for GRACE_S seconds since and the stop was not agreed, ends the
    process with one line, inside torchrun's 30 s between passing SIGTERM on and killing.
    """

    CHECK_EVERY = 10
    GRACE_S = 20

    def __init__(self, accelerator, enabled):
        self.accelerator = accelerator
        self.enabled = enabled
        self.agreed = False
        self.last_progress = time.monotonic()
        if self.enabled:
            for stop_signal in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(stop_signal, lambda signum, frame: accelerator.set_trigger())
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            threading.Thread(target=self._end_if_stuck, args=(reader, writer), daemon=True).start()

    def stop_agreed(self, step):
        """After this optimizer step, whether every process stops (a collective every CHECK_EVERY steps)."""
        self.last_progress = time.monotonic()
        self.agreed = self.enabled and step % self.CHECK_EVERY == 0 and self.accelerator.check_trigger()
        return self.agreed

    def _end_if_stuck(self, reader, writer):  # writer: kept open as long as the thread lives
        while reader.recv(1)[0] not in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            pass
        signalled = time.monotonic()
        while not self.agreed:
            if time.monotonic() - max(signalled, self.last_progress) > self.GRACE_S:
                print(f"[rank {self.accelerator.process_index}] stopped: {self.GRACE_S} s after a signal to stop, this process "
                      "was still waiting on another, so it could not save a checkpoint; the newest complete one stays "
                      "'latest'.", file=sys.stderr, flush=True)
                exit_now(PREEMPTED_EXIT_CODE)
            time.sleep(0.5)


def first_line(error):
    """The first line of an exception's message, for a one-sentence error."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def run_main(main):
    """Run a script's main(); a UserError ends the process with its sentence and exit code 1, Ctrl-C
    with one line and exit code 130, and either removes what the run had made (remove_if_run_fails).
    SHOW_TRACEBACK=1 in the environment adds the full traceback to a sentence, for bug reports.

    After main() the garbage left in cycles is collected while the interpreter is whole: DDP holds the
    process group until the model is freed, and a gloo process group destroyed during interpreter
    shutdown lets its worker threads reach for a Python that is gone, which aborts the process
    ("terminate called without an active exception") after the run had saved everything. The scripts
    call accelerator.free_memory() for the same reason."""
    rank = int(os.environ.get("RANK", "0"))
    warn_if_launched_alone()
    try:
        try:
            main()
            gc.collect()
        except UserError as error:
            remove_what_the_failed_run_made()
            print_traceback_if_asked()
            # Rank 0 says it; a mistake every process has is said on every machine, by its first process.
            if rank == 0 or (error.every_process and int(os.environ.get("LOCAL_RANK", "0")) == 0):
                print(f"error: {error}", file=sys.stderr, flush=True)
            if torch.distributed.is_initialized():
                leave_process_group_together()
            if rank and not error.every_process:
                # Usually every rank hits the same mistake and rank 0 has said it: the launcher stops this
                # rank when rank 0 exits. A rank that fails alone still speaks.
                time.sleep(3)
                print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
            sys.exit(1)
        except Preempted as stopped:
            if rank == 0:
                print(f"Stopped by a signal to stop: {stopped}", file=sys.stderr, flush=True)
            if torch.distributed.is_initialized():
                leave_process_group_together()
            sys.exit(PREEMPTED_EXIT_CODE)
        except RuntimeError as error:  # gloo reports a lost peer as a RuntimeError (DistBackendError or plain)
            if not (torch.distributed.is_initialized() and lost_a_peer(error)):
                raise
            # Another process of the run, or its network, is gone (killed, out of memory, a machine
            # lost): the launcher says which process ended, and restarts the run if asked to. The
            # survivors leave without a traceback each, with an exit code of their own that tells the
            # launcher they are not the cause; one that waited --ddp_timeout in vain says so. They wait
            # a moment first: torchrun's own report names the first process it sees end (to the
            # second), which should be the one that was lost, not a survivor.
            print_traceback_if_asked()
            if "imed out" in str(error):
                print(f"[rank {rank}] stopped: no answer from another process within --ddp_timeout ({first_line(error)})",
                      file=sys.stderr, flush=True)
            time.sleep(2)
            exit_now(LOST_PEER_EXIT_CODE)
    except KeyboardInterrupt:
        # Ctrl-C reaches the launcher, which passes it to the processes one after another: a process
        # can meet it in training, or while it handles the loss of a process that stopped first.
        # One line for the run, not a traceback each.
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the clean-up
        remove_what_the_failed_run_made()
        if rank == 0:
            print("Stopped by Ctrl-C.", file=sys.stderr, flush=True)
        exit_now(130)  # at once: the other processes are stopping too, so leaving the group could wait on them


def print_traceback_if_asked():
    if os.environ.get("SHOW_TRACEBACK") == "1":
        traceback.print_exc()


PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as a process ended by the signal would exit
LOST_PEER_EXIT_CODE = 75  # sysexits.h's EX_TEMPFAIL: this process was fine, but another of the run, or the way to it, is gone


def exit_now(code):
    """Exit without tearing down the process group, which could wait on processes that are gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# How gloo, and NCCL when its errors reach Python (TORCH_NCCL_BLOCKING_WAIT=1), say a peer is gone.
LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
                   "Watchdog caught collective operation timeout", "ncclRemoteError", "NCCL communicator was aborted")


def lost_a_peer(error):
    """Whether a collective failed because another process or its network is gone. Under NCCL's
    default error handling the watchdog ends the process itself instead (SIGABRT, after --ddp_timeout),
    and the launcher names the rank that ended: docs/recovery.md."""
    return any(sign in str(error) for sign in LOST_PEER_SIGNS)


def warn_if_launched_alone():
    """accelerate launch asked for several processes (it sets MASTER_ADDR) but started only this one:
    its plain launcher does that without a profile on a machine without GPUs, or with a MULTI_CPU
    profile and no MPI hostfile. Nothing else would show it but world_size 1 in the epoch lines."""
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    in_a_group = any(name in os.environ for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"))
    if launched_by_accelerate and "MASTER_ADDR" in os.environ and not in_a_group:
        print("warning: accelerate launch was asked for several processes but started this one alone, which trains "
              "by itself: launch with --config_file accelerate_configs/cpu.yaml, or add --multi_gpu.", file=sys.stderr, flush=True)


_MADE_BY_THIS_RUN = []


def remove_if_run_fails(path):
    """A folder or file this run has just made: a run that fails removes it again (a folder only if
    nothing else was written to it)."""
    _MADE_BY_THIS_RUN.append(Path(path))


def remove_what_the_failed_run_made():
    for path in reversed(_MADE_BY_THIS_RUN):  # the newest, and so the innermost, first
        try:
            path.rmdir() if path.is_dir() else path.unlink()  # rmdir only succeeds when empty
        except OSError:
            pass


def raise_if_any_failed(error):
    """A collective: each process passes its UserError sentence, or None; every process raises the
    first one given, so a failure on one process stops all of them with the same sentence."""
    failures = [message for message in gather_object([error]) if message]
    if failures:
        raise UserError(failures[0], every_process=True)


@contextlib.contextmanager
def stop_all_if_write_fails(path, advice):
    """Around a write that every process enters (each may write its part, or none): when it fails on
    any process (a full disk, no permission, an I/O error), every process stops with one sentence
    naming `path`, the cause and `advice` (what to do), instead of a traceback on one and a hang on
    the others. A collective."""
    error = None
    try:
        yield
    except Exception as failure:  # torch, safetensors and the OS raise many kinds on a failed write
        cause = first_line(failure)
        if "space" not in cause:  # torch.save says only "iostream error" on a full disk
            free = shutil.disk_usage(next(folder for folder in Path(path).parents if folder.exists())).free
            cause = f"no space left on its disk: {cause}" if free < 2**20 else f"{cause}; {free / 2**20:.1f} MB free on its disk"
        error = f"Could not write {path} ({cause}): {advice}"
    raise_if_any_failed(error)


def on_main_process(accelerator, function):
    """function() on the main process only, while the others wait; every process returns its result,
    or raises its UserError, so a mistake found there stops every process with the same sentence."""
    result = error = None
    if accelerator.is_main_process:
        try:
            result = function()
        except UserError as mistake:
            error = str(mistake)
    result, error = broadcast_object_list([result, error])
    if error is not None:
        raise UserError(error, every_process=True)
    return result


def leave_process_group_together(timeout_s=10):
    """Wait until every process has come this far, then leave the process group. Rank 0 hosts the
    rendezvous, so exiting while another rank is still joining the group crashes that rank with a
    gloo traceback; and exiting with the group still up sometimes aborts in its C++ teardown (signal
    6). Every rank usually stops at the same mistake, so the wait is short; one that stops alone
    waits timeout_s at most (its barrier runs in a thread that may never return)."""
    barrier = threading.Thread(target=_barrier_quietly, daemon=True)
    barrier.start()
    barrier.join(timeout_s)
    if not barrier.is_alive():
        torch.distributed.destroy_process_group()


def _barrier_quietly():
    try:
        torch.distributed.barrier()
    except Exception:  # noqa: BLE001  a peer already left: nothing more to wait for
        pass
