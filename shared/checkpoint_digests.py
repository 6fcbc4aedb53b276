"""The SHA-256 of every file of a checkpoint, each file hashed by the process that wrote it.

accelerator.save_state writes the model, optimizer and scheduler from the main process (with one
disk per machine, from each machine's first), each process's RNG state as random_states_<rank>.pkl,
and under FSDP each process's shard as __<rank>_0.distcp. Each process hashes what it wrote and the
digests are gathered, so no process reads every rank's shards of a large model while the others
wait, and the files are read on the machine that holds them, while they are still in its page cache.
"""

import hashlib
import json
import re
from pathlib import Path

from accelerate.utils import gather_object

from shared.run_folder import STATE_FILE, writes_here

WRITTEN_BY_RANK = re.compile(r"random_states_(\d+)\.pkl|__(\d+)_\d+\.distcp")


def record(accelerator, folder):
    """Every process must call this: the digests of the files of this machine's copy of `folder`, by
    their path relative to it, for the process that writes its state file."""
    mine = {name: _sha256(folder / name) for name in _files(folder) if _hashed_here(accelerator, name)}
    return {name: digest for theirs in _of_this_copy(accelerator, mine) for name, digest in theirs.items()}


def damage(accelerator, folder):
    """Every process must call this: what differs in `folder` from the digests its state file recorded
    (the first file found, the same sentence part on every process, or None), and whether this
    machine's copy is among the damaged ones."""
    found = _damage(folder, lambda name: _hashed_here(accelerator, name))
    everyone = gather_object([(_copy_of(accelerator), found)])
    return next((reason for _, reason in everyone if reason), None), any(reason for copy, reason in everyone if copy == _copy_of(accelerator))


def intact_here(folder):
    """Whether every file a checkpoint's state file recorded is here as saved, read by this process
    alone: for the rare checkpoint of the same step found in the way of a new save."""
    return _damage(folder, lambda name: True) is None


def _damage(folder, checks):
    """The first of the files recorded in folder's state file that `checks` (by name) and that is missing
    or differs from its digest, in a sentence part; None when all are as saved."""
    try:
        recorded = json.loads((folder / STATE_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError) as error:
        return f"its {STATE_FILE} cannot be read: {error}"
    for name, digest in recorded.items():
        if checks(name):
            if not (folder / name).is_file():
                return f"{name} is missing"
            if _sha256(folder / name) != digest:
                return f"{name} differs from what was saved"
    return None


def _copy_of(accelerator):
    """Which copy of a checkpoint this process's files are in: the one copy on a shared disk, else its
    machine's (by the machine's first rank, as torchrun numbers processes machine by machine)."""
    if not accelerator.project_configuration.save_on_each_node:
        return 0
    return accelerator.process_index - accelerator.local_process_index


def _of_this_copy(accelerator, mine):
    """Every process's `mine` gathered, and those of the processes whose files are in this process's copy."""
    return [theirs for copy, theirs in gather_object([(_copy_of(accelerator), mine)]) if copy == _copy_of(accelerator)]


def _hashed_here(accelerator, name):
    """Whether this process hashes file `name`: the rank that wrote it, or the process that wrote the
    rest (the main process, or with one disk per machine, each machine's first); a file of a rank this
    run does not have (resumed with fewer processes) is the main process's."""
    written_by = WRITTEN_BY_RANK.fullmatch(Path(name).name)
    rank = int(next(group for group in written_by.groups() if group)) if written_by else None
    if rank is not None and rank < accelerator.num_processes:
        return rank == accelerator.process_index
    return writes_here(accelerator)


def _files(folder):
    return sorted(path.relative_to(folder).as_posix() for path in Path(folder).rglob("*") if path.is_file())


def _sha256(path):
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
