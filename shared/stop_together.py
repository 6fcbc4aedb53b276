"""Failures that stop every process together: a mistake or a failed write found on one process ends
all of them in its sentence, not a traceback on one and a hang on the others. Every function here is a
collective: every process must call it at the same point."""

import contextlib
import os
import shutil
from pathlib import Path

from accelerate.utils import broadcast_object_list, gather_object

from shared.errors import OUT_OF_MEMORY_SIGNS, UserError, first_line
from shared.flags import OUT_OF_MEMORY_ADVICE


def if_any_failed(sentence):
    """Every process must call this: each passes its UserError sentence or None, and every process
    raises the first one given."""
    failures = [message for message in gather_object([sentence]) if message]
    if failures:
        raise UserError(failures[0], every_process=True)


def on_main_process(accelerator, function):
    """Every process must call this: function() runs on the main process while the others wait, and
    every process returns its result, or raises its UserError."""
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


@contextlib.contextmanager
def if_write_fails(path, advice):
    """Every process must enter this, around a write that some or all of them make: when it fails on any
    process (a full disk, an I/O error), all stop with one sentence naming `path`, the cause and `advice`."""
    error = None
    try:
        yield
    except Exception as failure:  # torch, safetensors and the OS raise many kinds on a failed write
        cause = first_line(failure)
        if any(sign in str(failure) for sign in OUT_OF_MEMORY_SIGNS):  # the memory to copy or gather what is written, not the disk
            advice = f"{OUT_OF_MEMORY_ADVICE}."
        elif "space" not in cause:  # torch.save says only "iostream error" on a full disk
            with contextlib.suppress(OSError):  # a disk that cannot say (NFS's stale handle): the cause alone
                # os.path.exists: pathlib's raises where a folder above cannot be searched (a chmod, NFS's expired credentials)
                free = shutil.disk_usage(next(folder for folder in Path(path).parents if os.path.exists(folder))).free
                cause = f"no space left on its disk: {cause}" if free < 2**20 else f"{cause}; {free / 2**20:.1f} MB free on its disk"
        error = f"Could not write {path} ({cause}): {advice}"
    if_any_failed(error)


class FailureCaught(contextlib.AbstractContextManager):
    """A UserError raised inside `with` is kept, so that the code around it (main_process_first's
    barriers) runs on as on the other processes; raise_everywhere() then stops every process with it."""

    sentence = None

    def __exit__(self, kind, error, trace):
        if isinstance(error, UserError):
            self.sentence = str(error)
            return True

    def raise_everywhere(self):
        """Every process must call this: a failure caught on any process stops all of them with its sentence."""
        if_any_failed(self.sentence)
