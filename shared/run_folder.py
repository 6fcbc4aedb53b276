"""The --output_dir of a run: the name of everything a run writes there, and the folder taken by one
live run at a time, checked before anything is written."""

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from accelerate.utils import SAFE_WEIGHTS_NAME, DistributedType, gather_object

from shared import stop_together
from shared.errors import MADE_BY_THIS_RUN, UserError, first_line, make_folders

METRICS_FILE = "metrics.jsonl"  # a record per epoch (shared/metrics.py)
MODEL_FILE = SAFE_WEIGHTS_NAME  # model.safetensors, as accelerator.save_model names it
EVAL_FILE = "eval.json"  # --eval_only's result
CHECKPOINT_FOLDER = "checkpoints"  # a CHECKPOINT_NAME folder each, with STATE_FILE (shared/checkpoints.py)
CHECKPOINT_NAME = "step_{:08d}"  # after that optimizer step; prefixed .tmp_ while written, .pruned_ while deleted, .displaced_
# while a new copy of its step takes its place, damaged_ or abandoned_ when set aside
STATE_FILE = "trainer_state.json"
PROFILE_FOLDER = "profile"  # --profile: trace_rank<N>.json each
TENSORBOARD_FOLDER, MLFLOW_DB, MLFLOW_ARTIFACTS = "tensorboard", "mlflow.db", "mlflow_artifacts"  # --with_tracking
LOCK_FILE = ".lock"  # locked by the live run's main process; the kernel lets go when that process ends, however it ends
RUN_FILES = (METRICS_FILE, MODEL_FILE, EVAL_FILE, CHECKPOINT_FOLDER, PROFILE_FOLDER, TENSORBOARD_FOLDER, MLFLOW_DB, MLFLOW_ARTIFACTS)
REPLACED_FOLDER = ".replaced"  # --overwrite_output_dir: the run there before, set aside until nothing can refuse this one


def checkpoints_in(folder):
    """The complete checkpoints in a checkpoints folder, oldest first (a .tmp_ one being written is not)."""
    found = [path for path in Path(folder).glob("step_*") if path.name[5:].isdigit() and (path / STATE_FILE).is_file()]  # not a step_N.bak copy
    return sorted(found, key=checkpoint_step)


def checkpoint_step(checkpoint):
    """The optimizer step a checkpoint folder (step_N) was saved after."""
    return int(checkpoint.name.removeprefix("step_"))


def model_saved_after(output_dir, checkpoint):
    """Whether output_dir's model.safetensors was saved after `checkpoint` (a folder; None: at all) and after the run's
    last record, which a run writes before its model: the end of the run that went on from that checkpoint, not the end
    of an earlier run it continues, nor one that a run continuing it recorded its last epoch over, killed before its save."""
    model = Path(output_dir) / MODEL_FILE
    written_before = [Path(output_dir) / METRICS_FILE] + ([Path(checkpoint) / STATE_FILE] if checkpoint else [])
    return model.exists() and all(model.stat().st_mtime >= path.stat().st_mtime for path in written_before if path.exists())


def resumes_here(spec, output_dir):
    """Whether --resume_from_checkpoint `spec` continues the run in output_dir: `latest`, one of its
    checkpoints, or no folder at all (which the resume then names); another run's checkpoint starts a
    new run there instead, which may not write over the one it holds."""
    if spec is None:
        return False
    path, output_dir = Path(spec).resolve(), Path(output_dir).resolve()  # the run folder itself too, never replaced by its own resume
    return (spec == "latest" or not os.path.isdir(path)  # not there, or in a folder this user cannot enter: the resume names it
            or path == output_dir or path.is_relative_to((output_dir / CHECKPOINT_FOLDER).resolve()))


def named_checkpoint(path):
    """`path` as a string once it is a checkpoint folder whose trainer_state.json reads, else a sentence saying why not."""
    try:
        if path.is_file():
            raise UserError(
                f"{path} is a file, not a checkpoint folder: resume training from a folder under <output_dir>/{CHECKPOINT_FOLDER}/ "
                "or 'latest', or evaluate a model file with --eval_only.")
        if not path.is_dir():
            raise UserError(f"Checkpoint {path} does not exist: pass a folder under <output_dir>/{CHECKPOINT_FOLDER}/, or 'latest'.")
        if path.name == CHECKPOINT_FOLDER or (path / CHECKPOINT_FOLDER).is_dir():
            raise UserError(f"{path} holds checkpoints but is not one: pass one of its step_N folders, or 'latest' with its run's --output_dir.")
        if not (path / STATE_FILE).exists() and any((path / name).exists() for name in (METRICS_FILE, MODEL_FILE)):
            raise UserError(f"{path} is a run's folder, which saved no checkpoint: "
                            + (f"evaluate its model with --eval_only --resume_from_checkpoint {path / MODEL_FILE}, or "
                               if (path / MODEL_FILE).exists() else "")
                            + "train it again with --overwrite_output_dir and --checkpointing_steps, to resume next time.")
        json.loads((path / STATE_FILE).read_text())
    except PermissionError as error:  # another user's folder, which this one may see but not enter
        raise UserError(f"Checkpoint {path} could not be read ({first_line(error)}): give yourself read access to it, "
                        "or copy it to a folder you can read.") from None
    except (OSError, ValueError) as error:
        raise UserError(f"Checkpoint {path} is incomplete or corrupt ({first_line(error)}): resume from an earlier one.") from None
    return str(path)


def writes_here(accelerator):
    """Whether this process writes what one process writes (a checkpoint's state, the model): the main
    process, and with a disk per machine (accelerate's save_on_each_node) each machine's first."""
    return accelerator.is_main_process or (accelerator.is_local_main_process and accelerator.project_configuration.save_on_each_node)


def prepare(accelerator, output_dir, *, overwrite, resuming):
    """Every process must call this: makes output_dir this run's, or stops all with a sentence when it is
    a file, a live run holds it, or it holds an earlier run that this one neither resumes (`resuming`)
    nor replaces (`overwrite`: that run's files are set aside once this run holds the folder, to go at
    replaced_run_goes()). The main
    process takes it first; each other machine's first process then reads its lock file, and where it
    does not find the main process's (no shared disk), takes the path on its own disk. Returns the folder,
    and whether every machine shares it."""
    output_dir = Path(output_dir)
    holder = stop_together.on_main_process(accelerator, lambda: _take(output_dir, overwrite and not resuming, resuming))
    sees_main = not accelerator.is_local_main_process or _holder(output_dir) == holder
    if all(gather_object([sees_main])):
        return output_dir, True
    error = None
    if accelerator.distributed_type == DistributedType.FSDP:
        # torch's sharded save writes each process's shard on its own machine and the index on machine 0 alone.
        error = (f"--output_dir {output_dir} is not on a disk that every machine shares, which FSDP's sharded checkpoints "
                 "need (each machine would hold only its own shards): put --output_dir on a shared file system.")
    elif not sees_main:
        try:
            _take(output_dir, overwrite and not resuming, resuming)
        except UserError as mistake:
            error = f"On {socket.gethostname()}: {mistake}"
    stop_together.if_any_failed(error)
    return output_dir, False


def _take(output_dir, replace, resuming):
    """Lock output_dir for this run and check what it holds; returns what the lock file now says."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):  # os.path: no PermissionError in a folder this user cannot enter
        raise UserError(f"--output_dir {output_dir} is a file, not a folder: choose another --output_dir.")
    try:
        make_folders(output_dir)
        _hold(output_dir / LOCK_FILE)
    except OSError as error:
        raise UserError(f"--output_dir {output_dir} could not be made or locked ({first_line(error)}): choose another "
                        "--output_dir, one you can write to.") from None
    _put_back(output_dir)  # a run that a run killed before replaced_run_goes() had set aside
    for leftover in output_dir.glob(f"{REPLACED_FOLDER}_deleted_*"):  # a replaced run whose delete was cut short
        shutil.rmtree(leftover, ignore_errors=True)
    earlier = [name for name in (METRICS_FILE, MODEL_FILE) if (output_dir / name).exists()]
    if any((output_dir / CHECKPOINT_FOLDER).glob("*")):  # a run stopped before its first epoch's record holds only these
        earlier.append(CHECKPOINT_FOLDER)
    if earlier and not resuming and not replace:
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({', '.join(earlier)}): "
            + ("continue it with --resume_from_checkpoint latest, " if checkpoints_in(output_dir / CHECKPOINT_FOLDER) else "")
            + "choose another --output_dir, or pass --overwrite_output_dir to replace it.")
    if replace:  # all that a run writes here, by the names above: a trace or tracker log left behind would mix with this run's
        _set_aside(output_dir)
    return _holder(output_dir)


def _set_aside(output_dir):
    """Move the earlier run's files into output_dir/.replaced, each by one rename, until replaced_run_goes() deletes
    them: a check that refuses this run after prepare() (a checkpoint to resume, a tracker) finds them put back."""
    earlier = [output_dir / name for name in RUN_FILES if os.path.lexists(output_dir / name)]
    if not earlier:  # nothing to replace: the folder stays one that a failed run removes, if it made it
        return
    aside = moving = output_dir / REPLACED_FOLDER
    try:
        aside.mkdir(exist_ok=True)
        for moving in earlier:
            stale = aside / moving.name  # what _put_back could not put back: a run killed as its tracker started took its name
            if os.path.lexists(stale):
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
            os.rename(moving, stale)
    except OSError as error:  # a folder this user may not move (its `..` cannot change): old checkpoints must not mix with new
        _put_back(output_dir)
        raise UserError(f"--overwrite_output_dir could not set {moving} aside, of the run there before ({error.strerror}): "
                        "delete it yourself, or choose another --output_dir.") from None
    _REPLACING.append(output_dir)
    # Held until let_go() has put the run back, not removed first with what a failed run made: another run could take it.
    MADE_BY_THIS_RUN.remove(output_dir / LOCK_FILE)


def _put_back(output_dir):
    """The files of a run set aside in output_dir/.replaced, back in their places (a name this run has taken stays aside)."""
    aside = output_dir / REPLACED_FOLDER
    for name in RUN_FILES:
        if os.path.lexists(aside / name) and not os.path.lexists(output_dir / name):
            with contextlib.suppress(OSError):
                os.rename(aside / name, output_dir / name)
    with contextlib.suppress(OSError):  # only once empty
        aside.rmdir()


def replaced_run_goes():
    """The run that --overwrite_output_dir replaces, set aside by prepare(), is deleted: call it once nothing can refuse
    this run. Renamed first, so that a delete cut short is never put back."""
    while _REPLACING:
        aside = _REPLACING.pop() / REPLACED_FOLDER
        delete_renamed_first(aside, aside.with_name(f"{REPLACED_FOLDER}_deleted_{time.time_ns()}"),
                             "the run that --overwrite_output_dir replaced, in")


def delete_renamed_first(path, renamed, what):
    """Delete the folder `path`, renamed to `renamed` first so that one half-deleted keeps no name a run reads. One that
    cannot go (another user's files, NFS's open .nfs files) stays with a warning naming `what`, and the run goes on."""
    try:
        path.rename(renamed)
        shutil.rmtree(renamed)
    except OSError as error:
        print(f"warning: could not delete {what} {renamed if renamed.exists() else path} ({first_line(error)}): delete it yourself.",
              file=sys.stderr, flush=True)


_REPLACING = []  # each --output_dir whose earlier run this process set aside, until replaced_run_goes()


def _hold(path):
    """Lock output_dir for this process's life, or stop naming the live run that holds it: a flock, seen by
    launches on one machine or sharing the folder over NFS, and let go by a killed run too."""
    while True:
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise UserError(f"--output_dir {path.parent} is in use by a run still going ({_holder(path.parent) or 'another process'}): "
                            "wait for it to end, stop it, or choose another --output_dir.") from None
        with contextlib.suppress(FileNotFoundError):  # else an ending run removed the file it had locked: lock the new one
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        lock.close()
    lock.truncate(0)
    lock.write(f"host {socket.gethostname()}, process {os.getpid()}")
    lock.flush()
    os.fsync(lock.fileno())  # NFS shows other machines a file's data only after fsync or close: prepare() reads it there
    MADE_BY_THIS_RUN.append(path)  # removed by a failed run before the folder it may have made
    _HELD.append((path, lock))


_HELD = []  # (lock file, its open file) of each --output_dir this process holds


@atexit.register
def let_go():
    """Let go of every --output_dir this process holds: at its exit, or at the end of a run in a process that
    outlives it (a notebook's kernel). Each lock file is removed while still held, unless another run's file
    has taken its place. A run that ends before replaced_run_goes() first puts back the run it had set aside."""
    while _HELD:
        path, lock = _HELD.pop()
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                if path.parent in _REPLACING:
                    _put_back(path.parent)
                path.unlink()
        lock.close()
    _REPLACING.clear()


def _holder(output_dir):
    """What the lock file of output_dir says of the run holding it, or None."""
    try:
        return (output_dir / LOCK_FILE).read_text().strip() or None
    except OSError:
        return None
