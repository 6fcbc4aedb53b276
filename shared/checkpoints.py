"""Full training state under <output_dir>/checkpoints/step_NNNNNNNN, written atomically, checked, and resumed exactly.

A checkpoint is written into a hidden .tmp_ folder and renamed only once every process has finished,
so a crash or a full disk while saving never leaves a broken folder that `latest` could pick. Its
trainer_state.json records where in the epoch it stopped in samples, so a resume with another
number of processes (or another batch size) knows which batch comes next, or says that it cannot
know; and the SHA-256 of every file it holds, so a file damaged since is found before it is loaded.

The main process decides what to resume, and every process loads that one. Where the machines do not
share --output_dir (run_folder.prepare found out, and set accelerate's save_on_each_node), the first
process of every machine writes, checks and renames its own copy of each checkpoint.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file

from shared import runtime
from shared.metrics import last_record
from shared.run_folder import CHECKPOINT_FOLDER, MODEL_FILE
from shared.runtime import UserError, first_line

STATE_FILE = "trainer_state.json"
PREFIX = "step_"
KEEP_UNDER_RESTARTS = 2  # the newest to resume from, and one before it in case the newest is damaged


@dataclasses.dataclass
class Position:
    """Where training (re)starts: the epoch to run, how far into it the checkpoint got, and what the
    epoch had summed so far. A new run starts at Position(): epoch 1, nothing done."""

    epoch: int = 1
    batches_done: int = 0  # batches each process has already trained in this epoch
    global_step: int = 0  # optimizer steps taken so far
    epoch_totals: tuple = (0.0, 0.0)  # loss x samples and samples of the epoch so far, all processes
    epoch_seconds: float = 0.0
    elapsed_s: float = 0.0  # since the run first started


class Checkpointer:
    """Saves the full training state every `every` optimizer steps (--checkpointing_steps N; 'epoch' and
    None are left to the script), keeping the newest `keep` (--keep_last_checkpoints), and resumes it.
    `batch_size` is each process's, `num_epochs` the run's."""

    def __init__(self, accelerator, output_dir, *, every, keep, batch_size, num_epochs):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.folder = self.output_dir / CHECKPOINT_FOLDER
        self.every = every
        self.batch_size = batch_size
        self.num_epochs = num_epochs
        self.started = time.perf_counter()
        self.keep = keep
        if self.keep is None and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            self.keep = KEEP_UNDER_RESTARTS  # a launcher that restarts the run would otherwise pile them up
        # Whether this process writes a checkpoint folder: the main process, and with one disk per
        # machine the first process of every machine.
        self.writes_folder = accelerator.is_main_process or (
            accelerator.is_local_main_process and accelerator.project_configuration.save_on_each_node
        )

    def due(self, step):
        """Whether --checkpointing_steps N asks for a save after this optimizer step."""
        return isinstance(self.every, int) and step % self.every == 0

    def save(self, epoch, step, stats=None):
        """Save everything a resume needs: accelerator.save_state (model, optimizer, scheduler, every
        process's RNG state) and where the run stands. `stats` (metrics.EpochStats) marks a save inside
        the epoch: how many batches it had trained and its loss sums so far (one all-reduce); without
        it the save is at the start of `epoch`. Returns the checkpoint's folder.

        A save that fails on any process (a full disk, no permission, an I/O error) stops every process
        with one sentence; the checkpoints before it stay complete and `latest` still names the newest."""
        position = Position(epoch, 0, step, elapsed_s=self.elapsed())
        if stats is not None:
            position.batches_done = stats.batches
            position.epoch_totals, position.epoch_seconds = stats.snapshot()
        final, partial = self.folder / f"{PREFIX}{step:08d}", self.folder / f".tmp_{PREFIX}{step:08d}"
        if self.writes_folder:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash while saving
        self.accelerator.wait_for_everyone()
        previous = latest_checkpoint(self.folder)
        advice = "free space or fix the folder, then " + (
            f"resume with --resume_from_checkpoint latest, which is {previous} and complete." if previous
            else "start again: this run saved no checkpoint before.")
        try:
            with runtime.stop_all_if_write_fails(final, advice):
                self.accelerator.save_state(partial)
            with runtime.stop_all_if_write_fails(final, advice):
                self._complete(partial, final, position)
        except UserError:
            if self.writes_folder:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        return final

    def _complete(self, partial, final, position):
        """Where this process writes a folder: record the position and the files' digests, then make
        the folder a checkpoint by its rename."""
        if not self.writes_folder:
            return
        state = dataclasses.asdict(position)
        state.update(
            world_size=self.accelerator.num_processes,
            batch_size=self.batch_size,
            samples_done=position.batches_done * self.accelerator.num_processes * self.batch_size,
            num_epochs=self.num_epochs,
            files=digests(partial),
        )
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
        if final.exists():  # the same step saved before, by a run this one resumed from; a damaged one is kept aside
            final.rename(final.with_name(f"damaged_{final.name}")) if damaged(final) else shutil.rmtree(final)
        partial.rename(final)
        if self.keep:
            for old in complete_checkpoints(self.folder)[:-self.keep]:
                shutil.rmtree(old)

    def elapsed(self):
        return time.perf_counter() - self.started

    def resume(self, spec, *, max_train_steps, split_batches):
        """Load the state that `spec` (--resume_from_checkpoint: a folder, or `latest`) names on every
        process; where to continue.

        The main process chooses: `latest` is the newest checkpoint whose files are as they were saved
        (a damaged one is skipped with a line saying so, never deleted); a named one that is damaged
        stops the run. `latest` in an --output_dir with no checkpoint yet starts a new run (a requeued
        job's first start); a run that holds epochs but no checkpoint, or that already finished its
        epochs or its `max_train_steps`, stops with a sentence. `split_batches` only words advice."""
        chosen = runtime.on_main_process(self.accelerator, lambda: self._choose(spec, max_train_steps))
        if chosen is None:
            self.accelerator.print(f"No checkpoint in {self.folder} yet: starting from the beginning.")
            return Position()
        path, state = chosen
        if spec == "latest":
            path = self.folder / path.name  # this machine's copy, where the machines have a disk each
        # The main process checked its copy; every other machine with a disk of its own checks its own.
        runtime.raise_if_any_failed(damaged(path) if self.writes_folder and not self.accelerator.is_main_process else None)
        batches_done = self._batches_to_skip(path, state, split_batches)
        load_state(self.accelerator, path)
        self.started = time.perf_counter() - state["elapsed_s"]
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.accelerator.print(
            (f"Restart {restart} after a lost process: r" if restart else "R")
            + f"esumed from {path}: epoch {state['epoch']}, {batches_done} batches in, step {state['global_step']}."
        )
        return Position(state["epoch"], batches_done, state["global_step"], tuple(state["epoch_totals"]),
                        state["epoch_seconds"], state["elapsed_s"])

    def _choose(self, spec, max_train_steps):
        """On the main process: the checkpoint to resume and its state, or None to start anew."""
        last = last_record(self.output_dir)  # of metrics.jsonl, or None
        path = intact_latest(self.folder, self.accelerator.print) if spec == "latest" else Path(spec)
        if path is None:
            if last:  # never train again over the epochs of a run that saved no checkpoint
                which = "no intact checkpoint" if complete_checkpoints(self.folder) else "no checkpoint"
                raise UserError(
                    f"{self.output_dir} holds a run but {which} to resume: choose another "
                    "--output_dir, or pass --overwrite_output_dir instead of --resume_from_checkpoint."
                )
            return None
        state = read_state(path)
        if spec != "latest" and (damage := damaged(path)):
            raise UserError(damage)
        if max_train_steps:
            trained = max(state["global_step"], last["step"] if last else 0)
            if trained >= max_train_steps:
                raise UserError(
                    f"The run in {self.output_dir} already trained {trained} steps: pass a larger "
                    "--max_train_steps to train further, or start a new run in another --output_dir."
                )
        else:
            finished = max(state["epoch"] - 1, last["epoch"] if last else 0)
            if finished >= self.num_epochs:
                raise UserError(
                    f"The run in {self.output_dir} already finished {finished} epochs: pass a larger "
                    "--num_epochs to train further, or start a new run in another --output_dir."
                )
        return path, state

    def _batches_to_skip(self, path, state, split_batches):
        """Batches per process to skip in the resumed epoch; the shuffle order does not depend on the
        number of processes, so the position in samples carries over when it falls on a step boundary."""
        global_batch = self.accelerator.num_processes * self.batch_size
        if state["samples_done"] % global_batch:
            saved = state["world_size"] * state["batch_size"]
            same_steps = f"--batch_size {saved}" if split_batches else f"{state['world_size']} processes and --batch_size {state['batch_size']}"
            raise UserError(
                f"Checkpoint {path} stopped {state['samples_done']} samples into epoch {state['epoch']}, which is not a whole "
                f"number of this run's steps of {global_batch} samples: resume with {same_steps} (its steps of {saved}), "
                "or from an epoch checkpoint."
            )
        return state["samples_done"] // global_batch


def load_weights(spec, accelerator, model, output_dir):
    """--eval_only: load the weights named by --resume_from_checkpoint into the prepared model; their path.

    A checkpoint folder, a model.safetensors file, or `latest`: the newest weights of the run in
    output_dir, its model.safetensors when the run finished after its last checkpoint. A file is
    loaded through torch's distributed state-dict API, which fills a plain, a DDP or an FSDP2-sharded
    model alike from the full weights."""
    if not spec:
        raise UserError("--eval_only needs --resume_from_checkpoint: a checkpoint folder, 'latest' or a model.safetensors file.")
    path = runtime.on_main_process(accelerator, lambda: _weights_to_evaluate(spec, output_dir, accelerator.print))
    if path.is_file():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # 0.8 s of imports: only here

        try:
            weights = load_file(path)
            set_model_state_dict(accelerator.unwrap_model(model, keep_torch_compile=False), weights,
                                 options=StateDictOptions(full_state_dict=True))
        except Exception as error:  # safetensors and load_state_dict raise many kinds
            raise UserError(f"{path} does not hold this script's model weights ({first_line(error)}): pass its own model.safetensors.") from None
    else:
        load_state(accelerator, path)
    return path


def _weights_to_evaluate(spec, output_dir, say):
    if spec != "latest":
        path = Path(spec)
        if not path.is_file():
            read_state(path)
            if damage := damaged(path):
                raise UserError(damage)
        return path
    candidates = [found for found in (intact_latest(Path(output_dir) / CHECKPOINT_FOLDER, say), Path(output_dir) / MODEL_FILE)
                  if found is not None and found.exists()]
    if not candidates:
        raise UserError(f"{output_dir} holds neither a checkpoint nor a {MODEL_FILE} to evaluate: pass the --output_dir of a run, or a path.")
    return max(candidates, key=lambda found: found.stat().st_mtime)


def load_state(accelerator, path):
    try:
        accelerator.load_state(path)
    except Exception as error:  # torch and safetensors raise many kinds on a damaged file
        raise UserError(f"Checkpoint {path} could not be loaded ({first_line(error)}): resume from an earlier one.") from None


def digests(folder):
    """The SHA-256 of every file under folder, by its path relative to folder."""
    found = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            sha = hashlib.sha256()
            with path.open("rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    sha.update(block)
            found[path.relative_to(folder).as_posix()] = sha.hexdigest()
    return found


def damaged(path):
    """A sentence naming the first file of checkpoint `path` that is missing or differs from what was
    saved, or None when all are as saved (or the checkpoint predates the digests)."""
    reason = _damage(path)
    return reason and (f"Checkpoint {path} is damaged ({reason}): resume from an earlier checkpoint, "
                       "or from 'latest', which skips damaged ones.")


def _damage(path):
    try:
        saved = json.loads((path / STATE_FILE).read_text()).get("files")
    except (OSError, ValueError) as error:
        return f"its {STATE_FILE} cannot be read: {first_line(error)}"
    now = digests(path) if saved is not None else {}
    for name, digest in (saved or {}).items():
        if now.get(name) != digest:
            return f"{name} is missing" if name not in now else f"{name} differs from what was saved"
    return None


def complete_checkpoints(folder):
    """Finished checkpoints, oldest first; half-written .tmp_ folders are never listed."""
    found = [path for path in Path(folder).glob(f"{PREFIX}*") if (path / STATE_FILE).is_file()]
    return sorted(found, key=lambda path: int(path.name[len(PREFIX):]))


def latest_checkpoint(folder):
    found = complete_checkpoints(folder)
    return found[-1] if found else None


def intact_latest(folder, say):
    """The newest checkpoint whose files are as they were saved; each damaged one on the way is named
    by say() (accelerator.print) and left where it is."""
    for path in reversed(complete_checkpoints(folder)):
        reason = _damage(path)
        if reason is None:
            return path
        say(f"Skipping damaged checkpoint {path} ({reason}); trying the one before it.")
    return None


def read_state(path):
    if path.is_file():
        raise UserError(
            f"{path} is a file, not a checkpoint folder: resume training from a folder under <output_dir>/{CHECKPOINT_FOLDER}/ "
            "or 'latest', or evaluate a model file with --eval_only."
        )
    if not path.is_dir():
        raise UserError(f"Checkpoint {path} does not exist: pass a folder under <output_dir>/{CHECKPOINT_FOLDER}/, or 'latest'.")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"Checkpoint {path} is incomplete or corrupt ({first_line(error)}): resume from an earlier one.") from None
