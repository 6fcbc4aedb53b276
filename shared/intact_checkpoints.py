"""Which checkpoint is intact: each file of a checkpoint folder against the SHA-256 that its trainer_state.json
records (shared/checkpoints.py writes them), on every machine's copy where each machine has a disk."""

import errno
import hashlib
import json
import os
from pathlib import Path

from accelerate.utils import gather_object

from shared import stop_together
from shared.errors import UserError, first_line
from shared.run_folder import CHECKPOINT_FOLDER, STATE_FILE, checkpoint_step, checkpoints_in, named_checkpoint, writes_here


NO_COPY = "'s disk has no copy of it"  # after the machine's name, in damage()'s sentence part
UNREADABLE = "may not be read on"  # its permissions, or a stale NFS handle: no damage, so nothing is set aside


def first_intact(accelerator, output_dir, spec):
    """Every process must call this: the checkpoint folder that `spec` names (a folder, or `latest`: the
    newest of output_dir's, on any machine's disk), once each machine's copy is checked against its digests. A damaged one named
    outright stops the run; `latest` names each damaged one, sets it aside as damaged_step_N (never
    deleted) and tries the one before. None: there is none; where a machine's disk holds an intact copy, a sentence instead.
    A file that is there but may not be read (its permissions, a stale NFS handle) stops the run in a sentence, setting nothing aside."""
    folder = Path(output_dir) / CHECKPOINT_FOLDER
    writes = writes_here(accelerator)  # this process checks its disk's copy
    for displaced in folder.glob(".displaced_step_*") if writes else []:  # a save of the same step killed before its copy was in place
        if not (final := displaced.with_name(displaced.name.removeprefix(".displaced_"))).exists():
            displaced.rename(final)  # the checkpoint still: else `latest` would skip it, and the resume delete it
    if spec == "latest":  # the newest on any machine's disk: a main process's new, empty disk must not start the run afresh
        listed = gather_object([[path.name for path in checkpoints_in(folder)] if writes else []])
        names = sorted({name for names in listed for name in names}, key=lambda name: checkpoint_step(Path(name)), reverse=True)
    else:
        names = stop_together.on_main_process(accelerator, lambda: [named_checkpoint(Path(spec))])
    intact_elsewhere = []  # with a disk per machine, why a checkpoint was skipped though another machine's copy of it is intact
    for name in names:
        path = folder / Path(name).name if spec == "latest" else Path(name)  # this machine's copy, where each has a disk
        damaged_here = damage(path) if writes else None
        checked = gather_object([(writes, damaged_here)])  # each disk's copy, by its machine's first process
        reasons = sorted((reason for _, reason in checked if reason), key=lambda reason: reason.endswith(NO_COPY))  # damage first
        if not reasons:
            return path
        if unreadable := [reason for reason in reasons if UNREADABLE in reason]:  # else `latest` would skip an intact checkpoint
            instead = f"move it out of {folder} to resume from the one before" if spec == "latest" else "resume from another checkpoint"
            raise UserError(f"Checkpoint {path} is there but {unreadable[0]}: make its files readable there (their permissions; a stale "
                            f"NFS mount: mount it again), or {instead}, then launch again.", every_process=True)
        if spec != "latest" and all(reason.endswith(NO_COPY) for reason in reasons):  # a disk per machine, intact where it is
            raise UserError(f"Checkpoint {path} is not on every machine's disk ({reasons[0]}): copy it into the same folder there, "
                            "or put --output_dir on a disk they all share, then launch again.", every_process=True)
        if spec != "latest":
            raise UserError(f"Checkpoint {path} is damaged ({reasons[0]}): resume from an earlier checkpoint, "
                            "or from 'latest', which skips damaged ones.", every_process=True)
        accelerator.print(f"Skipping damaged checkpoint {path} ({reasons[0]}); trying the one before it.")
        if damaged_here and os.path.exists(path) and not os.path.exists(path.with_name(f"damaged_{path.name}")):  # else none here
            path.rename(path.with_name(f"damaged_{path.name}"))  # this machine's copy; another's may be intact
        intact_elsewhere += [reasons[0]] if any(checker and not reason for checker, reason in checked) else []
    if intact_elsewhere:  # not "no checkpoint": training from the start, or over the run, would lose the intact copies
        raise UserError(f"No checkpoint in {folder} is intact on every machine's disk ({intact_elsewhere[0]}): copy a machine's intact "
                        "ones into the others' --output_dir, or put --output_dir on a disk they all share, then launch again.", every_process=True)
    return None


def damage(folder):
    """The first file of a checkpoint folder that is missing, unreadable or not its recorded digest, as a sentence part; or None."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        recorded = state["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:  # TypeError: a state that is not a JSON object
        if isinstance(error, FileNotFoundError) and not os.path.lexists(folder):  # a disk per machine, this one without it
            return f"{os.uname().nodename}{NO_COPY}"
        if cannot_read(error):
            return f"its {STATE_FILE} {UNREADABLE} {os.uname().nodename} ({first_line(error)})"
        return f"its {STATE_FILE} cannot be read: {error}"
    digest = state_digest(state)
    if state.get("sha256", digest) != digest:  # edited or damaged since (none recorded before 2026-11-27)
        return f"its {STATE_FILE} differs from what was saved"
    for name, digest in recorded.items():
        try:
            if sha256(folder / name) != digest:
                return f"{name} differs from what was saved"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:  # a folder in its place, say: no traceback on one process
            where = f"{UNREADABLE} {os.uname().nodename}" if cannot_read(error) else "could not be read"
            return f"{name} {where} ({first_line(error)})"
    return None


def cannot_read(error):
    """Whether an error reading a file says it is there but this process may not read it now (its permissions, NFS's stale
    handle), rather than that the file is damaged. A disk that fails to read it (EIO) has damaged it: `latest` skips it."""
    return isinstance(error, PermissionError) or getattr(error, "errno", None) == errno.ESTALE


def state_digest(state):
    """The SHA-256 of a checkpoint's state less its own digest: a trainer_state.json edited since is found, not resumed."""
    return hashlib.sha256(json.dumps({key: value for key, value in state.items() if key != "sha256"}, sort_keys=True).encode()).hexdigest()


def sha256(path):
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
