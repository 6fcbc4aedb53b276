"""The --output_dir of a run: checked before anything is written, held by one live run at a time."""

import atexit
import fcntl
import os
import shutil
import socket
from pathlib import Path

from accelerate.utils import gather_object

from shared import runtime
from shared.runtime import UserError

METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.safetensors"
CHECKPOINT_FOLDER = "checkpoints"
LOCK_FILE = ".lock"  # held by the live run's main process; the kernel lets go when that process ends, however it ends


def prepare(accelerator, output_dir, *, overwrite, resuming):
    """Make output_dir this run's and tell every process the outcome: stop with a sentence if it is a
    file, if a live run holds it, or if it holds an earlier run that this one neither resumes
    (`resuming`: --resume_from_checkpoint or --eval_only) nor replaces (`overwrite`:
    --overwrite_output_dir, which deletes that run's files only once this run holds the folder).

    The main process takes it first. Then the first process of every other machine looks for it:
    where a machine does not see it (no disk shared with machine 0), that process takes the same
    path on its own disk, and accelerate's save_on_each_node is turned on, so that every machine
    writes its own complete copy of each checkpoint and of the model."""
    output_dir = Path(output_dir)
    holder = runtime.on_main_process(accelerator, lambda: _take(output_dir, overwrite and not resuming, resuming))
    sees_main = not accelerator.is_local_main_process or _holder(output_dir) == holder
    if not all(gather_object([sees_main])):
        accelerator.project_configuration.save_on_each_node = True
        error = None
        if not sees_main:
            try:
                _take(output_dir, overwrite and not resuming, resuming)
            except UserError as mistake:
                error = f"On {socket.gethostname()}: {mistake}"
        runtime.raise_if_any_failed(error)
    return output_dir


def _take(output_dir, replace, resuming):
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a folder: choose another --output_dir.")
    if not output_dir.exists():
        output_dir.mkdir(parents=True)
        runtime.remove_if_run_fails(output_dir)
    hold(output_dir)
    earlier = [name for name in (METRICS_FILE, MODEL_FILE) if (output_dir / name).exists()]
    if earlier and not resuming and not replace:
        resumable = any((output_dir / CHECKPOINT_FOLDER).glob("step_*/trainer_state.json"))
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({', '.join(earlier)}): "
            + ("continue it with --resume_from_checkpoint latest, " if resumable else "")
            + "choose another --output_dir, or pass --overwrite_output_dir to replace it."
        )
    if replace:
        for name in earlier:
            (output_dir / name).unlink()
        shutil.rmtree(output_dir / CHECKPOINT_FOLDER, ignore_errors=True)
    return _holder(output_dir)


def _holder(output_dir):
    """What the lock file of output_dir says of the run holding it, or None."""
    try:
        return (output_dir / LOCK_FILE).read_text()
    except OSError:
        return None


def hold(output_dir):
    """Take output_dir's lock for the rest of this process's life, or stop naming the live run that has it.

    An advisory lock (flock) of a file in the folder: two launches into one folder on one machine, or
    on machines sharing the folder over NFS, see each other; a run that was killed holds nothing."""
    path = output_dir / LOCK_FILE
    while True:
        file = open(path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise UserError(
                f"--output_dir {output_dir} is in use by a run still going ({holder}): wait for it to end, "
                "stop it, or choose another --output_dir."
            ) from None
        try:  # a lock on a file that an ending run had just removed holds nothing: take the new one
            if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        file.close()
    file.seek(0)
    file.truncate()
    file.write(f"host {socket.gethostname()}, process {os.getpid()}\n")
    file.flush()
    # The file goes with the run: when it fails (before the folder it may have made) or exits.
    runtime.remove_if_run_fails(path)
    atexit.register(_let_go, path, file)


def _let_go(path, file):
    """Remove the lock file while still holding it, unless another run's file has taken its place."""
    try:
        if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
            path.unlink()
    except OSError:
        pass
    file.close()
