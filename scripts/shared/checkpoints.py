"""Full training state under <output_dir>/checkpoints/step_NNNNNNNN, written atomically and resumed exactly.

A checkpoint is written into a hidden .tmp_ folder and renamed only once every process has finished,
so a crash while saving never leaves a broken folder that `latest` could pick. Its trainer_state.json
records where in the epoch it stopped in samples, so a resume with another number of processes (or
another batch size) knows which batch comes next, or says that it cannot know.
"""

import dataclasses
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from shared import metrics, outputs
from shared.runtime import UserError, first_line

CHECKPOINT_FOLDER = "checkpoints"
STATE_FILE = "trainer_state.json"
PREFIX = "step_"


@dataclasses.dataclass
class Position:
    """Where training (re)starts: the epoch to run, and how far into it the checkpoint got."""

    epoch: int = 1
    batches_done: int = 0  # batches each process has already trained in this epoch
    global_step: int = 0  # optimizer steps taken so far
    epoch_totals: tuple = (0.0, 0.0)  # loss x samples and samples of the epoch so far, all processes
    epoch_seconds: float = 0.0


class Checkpointer:
    """Saves on the schedule of --checkpointing_steps and resumes from --resume_from_checkpoint."""

    def __init__(self, args, accelerator, output_dir, metrics_log, batch_size):
        self.args = args
        self.batch_size = batch_size  # per process
        self.accelerator = accelerator
        self.folder = Path(output_dir) / CHECKPOINT_FOLDER
        self.metrics_log = metrics_log
        self.global_step = 0

    # -- saving ---------------------------------------------------------------------------------

    def step_done(self, epoch, stats):
        """Call after every optimizer step; saves when the step count reaches --checkpointing_steps."""
        self.global_step += 1
        every = self.args.checkpointing_steps
        if isinstance(every, int) and self.global_step % every == 0:
            totals, seconds = stats.snapshot()
            self.save(Position(epoch, stats.batches, self.global_step, totals, seconds))

    def epoch_done(self, epoch):
        """Call after an epoch's metrics are written; saves when --checkpointing_steps is 'epoch'."""
        if self.args.checkpointing_steps == "epoch":
            self.save(Position(epoch + 1, 0, self.global_step))

    def save(self, position):
        name = f"{PREFIX}{position.global_step:08d}"
        final, partial = self.folder / name, self.folder / f".tmp_{name}"
        if self.accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash while saving
        self.accelerator.wait_for_everyone()
        # Model, optimizer, scheduler and step from the main process; each process's RNG state.
        self.accelerator.save_state(partial)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            state = dataclasses.asdict(position)
            state.update(
                elapsed_s=self.metrics_log.elapsed(),
                world_size=self.accelerator.num_processes,
                batch_size=self.batch_size,
                samples_done=position.batches_done * self.accelerator.num_processes * self.batch_size,
                num_epochs=self.args.num_epochs,
            )
            (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
            if final.exists():  # the same step saved before, by a run this one resumed from
                shutil.rmtree(final)
            partial.rename(final)
            self.prune()
        self.accelerator.wait_for_everyone()

    def prune(self):
        keep = self.args.keep_last_checkpoints
        if keep:
            for old in complete_checkpoints(self.folder)[:-keep]:
                shutil.rmtree(old)

    # -- resuming -------------------------------------------------------------------------------

    def resume(self):
        """Load the state named by --resume_from_checkpoint and say where to continue."""
        spec = self.args.resume_from_checkpoint
        if not spec:
            return Position()
        path = self._resolve(spec)
        if path is None:
            if self.metrics_log.path.exists():  # never restart over the epochs of a run without checkpoints
                raise UserError(
                    f"{self.metrics_log.path.parent} holds a run but no checkpoint to resume: choose another "
                    "--output_dir, or pass --overwrite_output_dir instead of --resume_from_checkpoint."
                )
            self.accelerator.print(f"No checkpoint in {self.folder} yet: starting from the beginning.")
            return Position()
        state = read_state(path)
        finished = max(state["epoch"] - 1, self.metrics_log.completed_epochs())
        if finished >= self.args.num_epochs:
            raise UserError(
                f"The run in {self.metrics_log.path.parent} already finished {finished} epochs: pass a larger "
                "--num_epochs to train further, or start a new run in another --output_dir."
            )
        batches_done = self._batches_to_skip(path, state)
        self._load_state(path)
        self.global_step = state["global_step"]
        self.metrics_log.resume(completed_epochs=state["epoch"] - 1, elapsed_s=state["elapsed_s"])
        self.accelerator.print(f"Resumed from {path}: epoch {state['epoch']}, {batches_done} batches in, step {self.global_step}.")
        return Position(state["epoch"], batches_done, state["global_step"], tuple(state["epoch_totals"]), state["epoch_seconds"])

    def _batches_to_skip(self, path, state):
        """Batches per process to skip in the resumed epoch; the shuffle order does not depend on the
        number of processes, so the position in samples carries over when it falls on a step boundary."""
        global_batch = self.accelerator.num_processes * self.batch_size
        if state["samples_done"] % global_batch:
            saved = state["world_size"] * state["batch_size"]
            same_steps = f"--batch_size {saved}" if self.args.split_batches else f"{state['world_size']} processes and --batch_size {state['batch_size']}"
            raise UserError(
                f"Checkpoint {path} stopped {state['samples_done']} samples into epoch {state['epoch']}, which is not a whole "
                f"number of this run's steps of {global_batch} samples: resume with {same_steps} (its steps of {saved}), "
                "or from an epoch checkpoint."
            )
        return state["samples_done"] // global_batch

    def evaluate_only(self, model, test_loader, loss_fn, num_classes):
        """--eval_only: evaluate the weights of --resume_from_checkpoint over all processes, print and save it."""
        source = self.load_for_eval(model)
        result = metrics.evaluate(model, test_loader, self.accelerator, loss_fn, num_classes)
        outputs.report_eval(result, source, self.accelerator, self.metrics_log.path.parent)
        self.accelerator.end_training()  # leaves the process group before the interpreter exits

    def load_for_eval(self, model):
        """--eval_only: the weights of a checkpoint folder (or 'latest') or of a model.safetensors file."""
        path = self._resolve(self.args.resume_from_checkpoint)
        if path is None:
            raise UserError(f"No checkpoint in {self.folder} to evaluate: pass a checkpoint folder or a model.safetensors file.")
        if path.is_file():
            try:
                self.accelerator.unwrap_model(model, keep_torch_compile=False).load_state_dict(load_file(path))
            except Exception as error:  # safetensors and load_state_dict raise many kinds
                raise UserError(f"{path} does not hold this script's model weights ({first_line(error)}): pass its own model.safetensors.") from None
        else:
            read_state(path)
            self._load_state(path)
        return path

    def _resolve(self, spec):
        if not spec:
            raise UserError("--eval_only needs --resume_from_checkpoint: a checkpoint folder, 'latest' or a model.safetensors file.")
        return latest_checkpoint(self.folder) if spec == "latest" else Path(spec)

    def _load_state(self, path):
        try:
            self.accelerator.load_state(path)
        except Exception as error:  # torch and safetensors raise many kinds on a damaged file
            raise UserError(f"Checkpoint {path} could not be loaded ({first_line(error)}): resume from an earlier one.") from None


def complete_checkpoints(folder):
    """Finished checkpoints, oldest first; half-written .tmp_ folders are never listed."""
    found = [path for path in Path(folder).glob(f"{PREFIX}*") if (path / STATE_FILE).is_file()]
    return sorted(found, key=lambda path: int(path.name[len(PREFIX):]))


def latest_checkpoint(folder):
    found = complete_checkpoints(folder)
    return found[-1] if found else None


def read_state(path):
    if not path.is_dir():
        raise UserError(f"Checkpoint {path} does not exist: pass a folder under <output_dir>/{CHECKPOINT_FOLDER}/, or 'latest'.")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"Checkpoint {path} is incomplete or corrupt ({first_line(error)}): resume from an earlier one.") from None
