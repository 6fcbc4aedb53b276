"""Checkpoints around accelerator.save_state and load_state: written atomically, checked, resumed exactly.

save_state writes into a hidden .tmp_ folder, renamed once every process has finished and on the disk (fsync)
before older checkpoints are pruned: a crash or a full disk never leaves a broken folder for `latest`. Its
trainer_state.json records where in the epoch it stopped, in samples (a resume at another world size knows the next
batch, or says it cannot), and the SHA-256 of every file, found damaged before it loads (shared/intact_checkpoints.py).
"""

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from accelerate.utils import SCALER_NAME, DistributedType

from shared import profiling, stop_together
from shared.errors import LOST_PEER_SIGNS, OUT_OF_MEMORY_SIGNS, UserError, first_line
from shared.flags import OUT_OF_MEMORY_ADVICE
from shared.intact_checkpoints import first_intact, sha256, state_digest
from shared.metrics import read_records
from shared.run_folder import (CHECKPOINT_FOLDER, CHECKPOINT_NAME, METRICS_FILE, STATE_FILE, checkpoint_step, checkpoints_in,
                               delete_renamed_first, model_saved_after, writes_here)


@dataclasses.dataclass
class Position:
    """Where training (re)starts: the checkpoint (None: a new run), and where in which epoch it stopped."""

    path: Path = None
    epoch: int = 1
    batches_done: int = 0  # batches each process has already trained in this epoch
    global_step: int = 0  # optimizer steps taken so far
    epoch_totals: tuple = (0.0, 0.0)  # loss x samples and samples of the epoch so far, all processes
    epoch_seconds: float = 0.0
    elapsed_s: float = 0.0  # since the run first started
    process_totals: tuple = ()  # epoch_totals of each process, in rank order


class Checkpoints:
    """The checkpoints of the run in output_dir: --checkpointing_steps (`every`: N optimizer steps or
    'epoch'), --keep_last_checkpoints (`keep`), --num_epochs; `batch_size` and `batches_per_epoch` are each process's;
    `trained_on` (see trained_on()) what a resume must train on as the checkpoint did."""

    def __init__(self, accelerator, output_dir, *, every, keep, batch_size, batches_per_epoch, num_epochs, trained_on):
        self.accelerator, self.output_dir, self.folder = accelerator, Path(output_dir), Path(output_dir) / CHECKPOINT_FOLDER
        self.every, self.keep, self.num_epochs, self.batch_size, self.batches_per_epoch = every, keep, num_epochs, batch_size, batches_per_epoch
        self.trained_on = trained_on
        self.started = time.perf_counter()
        self.newest = None  # the last checkpoint this run saved
        self.writes = writes_here(accelerator)

    def due(self, step):
        return isinstance(self.every, int) and step % self.every == 0

    def due_after_epoch(self, whole_epoch):
        return self.every == "epoch" and whole_epoch

    @contextlib.contextmanager
    def saving(self, epoch, step, stats=None):
        """Every process must enter this around accelerator.save_state(folder), with the folder it gives; on a clean exit
        that becomes checkpoints/step_<step> (self.newest), older ones pruned. `stats` (metrics.EpochStats) marks a save
        inside `epoch`, with its sums so far (one all-reduce and one gather). A save that fails on any process (a full disk, an I/O error)
        stops every one with one sentence; the checkpoints before it stay complete, and `latest` still names the newest."""
        position = Position(None, epoch, 0, step, elapsed_s=time.perf_counter() - self.started)
        if stats is not None:
            position.batches_done = stats.batches
            position.epoch_totals, position.epoch_seconds = stats.snapshot()
            position.process_totals = stats.sums_by_process()
        name = CHECKPOINT_NAME.format(step)
        final, partial = self.folder / name, self.folder / f".tmp_{name}"
        if self.writes:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash while saving
        self.accelerator.wait_for_everyone()
        previous = checkpoints_in(self.folder)[-1:]
        advice = "free space or fix the folder, then " + (
            f"resume with --resume_from_checkpoint latest, which is {previous[0]} and complete." if previous
            else "start again: this run saved no checkpoint before.")
        try:
            with stop_together.if_write_fails(final, advice), torch.profiler.record_function(profiling.SAVE_SPAN):
                yield partial
            with stop_together.if_write_fails(final, advice), torch.profiler.record_function(profiling.SAVE_SPAN):  # once all wrote theirs
                if self.writes:
                    self._complete(partial, final, position)
            self.newest = final
            if self.writes and self.keep:  # all but the newest `keep` go; one that cannot stays with a warning, and the run goes on
                for old in checkpoints_in(self.folder)[:-self.keep]:
                    delete_renamed_first(old, old.with_name(f".pruned_{old.name}"), "the old checkpoint")
            self.accelerator.wait_for_everyone()  # the others wait here, inside the save, while old checkpoints go
        except UserError:
            if self.writes:
                shutil.rmtree(partial, ignore_errors=True)
            raise

    def _complete(self, partial, final, position):
        """Record the position and every file's digest (each machine's copy, where each has a disk), then
        make the folder a checkpoint by its rename, replacing one of the same step (saved before a resume)."""
        files = {path.relative_to(partial).as_posix(): sha256(path) for path in sorted(partial.rglob("*")) if path.is_file()}
        state = {name: value for name, value in dataclasses.asdict(position).items() if name != "path"} | {
            "world_size": self.accelerator.num_processes, "batch_size": self.batch_size,
            "samples_done": position.batches_done * self.accelerator.num_processes * self.batch_size,
            "gradient_accumulation_steps": self.accelerator.gradient_accumulation_steps,
            "batches_per_epoch": self.batches_per_epoch, "trained_on": self.trained_on, "files": files}
        (partial / STATE_FILE).write_text(json.dumps(state | {"sha256": state_digest(state)}, indent=1))
        write_through([*partial.rglob("*"), partial])
        displaced = final.with_name(f".displaced_{final.name}")
        if final.exists():  # set aside whole, not deleted in place: a kill before the rename below leaves it for first_intact to put back
            final.rename(displaced)
        partial.rename(final)
        write_through([final.parent])  # the rename too, before older checkpoints are pruned
        shutil.rmtree(displaced, ignore_errors=True)

    def where_to_resume(self, spec, *, max_train_steps, split_batches):
        """Every process must call this: the Position to resume from for --resume_from_checkpoint `spec` (a folder, or
        `latest`: see first_intact), before the script's accelerator.load_state(position.path). `latest` with no checkpoint
        yet starts a new run (a requeued job's first start); a run that holds epochs but no intact checkpoint, or has
        finished, stops with a sentence. Later checkpoints stay (see branch_at)."""
        path = first_intact(self.accelerator, self.output_dir, spec)
        if path and path.name.startswith("abandoned_") and path.parent.resolve() == self.folder.resolve():  # a later branch's folder
            raise UserError(f"Checkpoint {path} was set aside when its run went on from an earlier one: resume it with another "
                            "--output_dir, where it starts a run of its own (or --eval_only it).", every_process=True)
        if path is None:
            stop_together.on_main_process(self.accelerator, self._check_nothing_to_resume)
            self.accelerator.print(f"No checkpoint in {self.folder} yet: starting from the beginning.")
            return Position()
        state = json.loads((path / STATE_FILE).read_text())
        stop_together.on_main_process(self.accelerator, lambda: self._check_not_finished(path, state, max_train_steps))
        self._check_trained_on(path, state.get("trained_on"))  # not recorded before 2026-11-27
        position = Position(path, state["epoch"], self._batches_to_skip(path, state, split_batches), state["global_step"],
                            tuple(state["epoch_totals"]), state["epoch_seconds"], state["elapsed_s"],
                            tuple(map(tuple, state.get("process_totals", ()))))  # not recorded before 2026-11-27
        self.started = time.perf_counter() - state["elapsed_s"]
        # A checkpoint saved after its epoch's last batch, or at --max_train_steps, leaves no step to take before
        # the epoch's scheduler.step(): torch's warning that the scheduler then stepped first is about other code.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
        return position

    def branch_at(self, position):
        """Every process must call this, once every check that could refuse the resume has passed: the run's checkpoints
        after the one resumed (`position`) are set aside as abandoned_step_N, never deleted, so that `latest` finds this
        run's own newest, and pruning never takes one of its own for one of theirs. What a save or a prune killed midway
        left (.tmp_, .pruned_, .displaced_ where its step's new copy is complete) goes: this run alone holds the folder."""
        if self.writes:
            for leftover in [path for prefix in (".tmp_", ".pruned_", ".displaced_") for path in self.folder.glob(f"{prefix}step_*")]:
                shutil.rmtree(leftover, ignore_errors=True)
        if self.writes and position.path and position.path.parent.resolve() == self.folder.resolve():
            for later in [checkpoint for checkpoint in checkpoints_in(self.folder) if checkpoint_step(checkpoint) > position.global_step]:
                aside = later.with_name(f"abandoned_{later.name}")
                aside = aside.with_name(f"{aside.name}_{time.time_ns()}") if aside.exists() else aside  # from an earlier branch
                later.rename(aside)
                self.accelerator.print(f"Set aside {later}, saved after the checkpoint resumed, as {aside.name}.")
        self.accelerator.wait_for_everyone()

    def _check_nothing_to_resume(self):
        if (self.output_dir / METRICS_FILE).exists():  # never train again over the epochs of a run that saved no checkpoint
            which = "no intact checkpoint" if any(self.folder.glob("damaged_step_*")) else "no checkpoint"
            raise UserError(f"{self.output_dir} holds a run but {which} to resume: choose another --output_dir, "
                            "or pass --overwrite_output_dir instead of --resume_from_checkpoint.")

    def _check_not_finished(self, path, state, max_train_steps):
        # A run killed before it saved its model resumes to finish it, whatever its records say it reached;
        # a model file from before this checkpoint is the end of an earlier run that this one continued.
        saved_model = model_saved_after(self.output_dir, path)
        last = ((read_records(self.output_dir) if saved_model else []) or [{"step": 0, "epoch": 0}])[-1]
        trained = max(state["global_step"], last["step"])
        if max_train_steps and (trained > max_train_steps or (trained == max_train_steps and saved_model)):
            raise UserError(f"The run in {self.output_dir} already trained {trained} steps: pass a "
                            "larger --max_train_steps to train further, or start a new run in another --output_dir.")
        finished = max(state["epoch"] - 1, last["epoch"] - (not last.get("whole_epoch", True)))  # not one --max_train_steps cut
        if not max_train_steps and finished >= self.num_epochs and saved_model:
            raise UserError(f"The run in {self.output_dir} already finished {finished} epochs: pass a larger --num_epochs "
                            "to train further, or start a new run in another --output_dir.")
        trained_into = state["epoch"] if state["batches_done"] else state["epoch"] - 1
        if not max_train_steps and trained_into > self.num_epochs:  # else its weights would be saved as the model, unevaluated
            raise UserError(f"The checkpoint to resume has trained into epoch {trained_into}, past the --num_epochs {self.num_epochs} "
                            f"asked for now: pass --num_epochs {trained_into} or more, or resume from an earlier checkpoint.")

    def _check_trained_on(self, path, recorded):
        """Every process, on the same state: a resume goes on with the data set, seed and data the checkpoint trained with, or stops."""
        differing = [name for name in recorded or {} if recorded[name] != self.trained_on.get(name)]
        if "data set" in differing:  # another script's, as seq_net.py's FashionMNIST to an MNIST script
            raise UserError(f"Checkpoint {path} was trained on {recorded['data set']}, not on this script's {self.trained_on['data set']}: "
                            "resume it with the script that trained it, or pass a checkpoint of this script's.", every_process=True)
        if "seed" in differing:
            raise UserError(f"Checkpoint {path} was trained with --seed {recorded['seed']}, not {self.trained_on['seed']}: resume it with "
                            f"--seed {recorded['seed']} (each epoch's shuffle order follows it), or start a new run in another --output_dir.",
                            every_process=True)
        if differing:
            name = differing[0]
            raise UserError(f"Checkpoint {path} was trained on a {name} of {recorded[name]}, but this run's has {self.trained_on.get(name)}: "
                            "pass the --data_dir (or --dataset_source and --dataset_name) it trained on, or start a new run in another "
                            "--output_dir.", every_process=True)

    def _batches_to_skip(self, path, state, split_batches):
        """Batches per process to skip in the resumed epoch; the shuffle order does not depend on the
        number of processes, so the position in samples carries over when it falls on a step boundary
        (with accumulation, a whole optimizer step: else this run's accumulation windows would not line up)."""
        if state["batches_done"] == state.get("batches_per_epoch"):  # saved after the epoch's last batch, ragged or not
            return self.batches_per_epoch
        batch = self.accelerator.num_processes * self.batch_size
        global_batch = batch * self.accelerator.gradient_accumulation_steps
        if state["samples_done"] % global_batch:
            saved = state["world_size"] * state["batch_size"]
            accumulation = state.get("gradient_accumulation_steps", 1)  # not recorded before 2026-11-26
            flags = [f"--batch_size {saved}"] if split_batches else [f"{state['world_size']} processes", f"--batch_size {state['batch_size']}"]
            if accumulation > 1 or self.accelerator.gradient_accumulation_steps > 1:  # a step is that many batches
                flags.append(f"--gradient_accumulation_steps {accumulation}")
            same_steps = " and ".join([", ".join(flags[:-1]), flags[-1]] if len(flags) > 1 else flags) + f" (its steps of {saved * accumulation})"
            if split_batches and saved % self.accelerator.num_processes:  # nor would that batch split across this run's processes
                same_steps += f" on a number of processes that divides {saved}, such as its {state['world_size']}"
            raise UserError(
                f"Checkpoint {path} stopped {state['samples_done']} samples into epoch {state['epoch']}, which is not a whole "
                f"number of this run's steps of {global_batch} samples: resume with {same_steps}, "
                "or from an epoch checkpoint.", every_process=True)
        return state["samples_done"] // batch


def trained_on(data_set, seed, train_set, test_set):
    """Checkpoints' `trained_on`: the script's data set, --seed, and each set's size and labels (their SHA-256, the same
    for either --data_pipeline). A resume with another seed or data would go on over other samples, or in another order."""
    description = {"data set": data_set, "seed": seed}
    for name, dataset in (("training set", train_set), ("test set", test_set)):
        labels = dataset.tensors[1] if hasattr(dataset, "tensors") else getattr(dataset, "targets", None)  # or torchvision's
        digest = "" if labels is None else hashlib.sha256(torch.as_tensor(labels).long().cpu().numpy().tobytes()).hexdigest()[:12]
        description[name] = f"{len(dataset)} samples" + (f" (labels SHA-256 {digest})" if digest else "")  # a data set of yours: its size
    return description


def write_through(paths):
    """Each file and folder of `paths` written from the kernel's cache to the disk (fsync): else a machine that crashes
    within seconds of a save may come back with the checkpoint's files empty, and the ones before it pruned. A disk that
    cannot fsync a folder (CIFS, some FUSE and 9p mounts say EINVAL) keeps what the kernel writes back, as before."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def loading(path, accelerator, position=None):
    """Every process must enter this, around accelerator.load_state(path): a file that fails to load on any
    process stops every one in one sentence, said once per machine; a resume (`position`) that loads says where it continues."""
    if accelerator.scaler is not None and not (Path(path) / SCALER_NAME).exists():  # fp16's GradScaler: load_state would read it
        raise UserError(f"Checkpoint {path} holds no loss scale for --mixed_precision fp16 (its run trained without fp16): load it "
                        "with the --mixed_precision it trained with: bf16 or no.", every_process=True)
    failure = None
    try:
        yield
    except (Exception, _sharded_load_error()) as error:  # torch and safetensors raise many kinds on a damaged file
        cause = error if isinstance(error, Exception) else next(iter(error.failures.values()))[0]  # FSDP's sharded load's
        if torch.distributed.is_initialized() and isinstance(cause, RuntimeError) and any(sign in str(cause) for sign in LOST_PEER_SIGNS):
            raise cause from None  # another process is gone, not the file: errors.run_main ends this one as a lost peer's survivor
        another_model = any(sign in str(cause) for sign in ("loading state_dict", "Missing key in checkpoint state_dict"))  # FSDP's
        advice = ("resume it with the script whose model it holds, or pass a checkpoint of this script's" if another_model
                  else OUT_OF_MEMORY_ADVICE if any(sign in str(cause) for sign in OUT_OF_MEMORY_SIGNS) else "resume from an earlier one")
        failure = f"Checkpoint {path} could not be loaded ({first_line(cause)}): {advice}."
        # FSDP's load has collectives around torch's, which fails on every process together: one failing alone stops alone.
        if accelerator.distributed_type == DistributedType.FSDP and cause is error:
            raise UserError(failure) from None
    stop_together.if_any_failed(failure)
    if position is not None:
        # load_state brings back accelerate's count of batches into the accumulation window, the saving run's: with another
        # --gradient_accumulation_steps (or on a process that saved none) every window would shift. A resume starts on a whole step.
        accelerator.step = 0
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torchrun under --max_restarts
        accelerator.print((f"Restart {restart} after a lost process: r" if restart else "R") + f"esumed from {path}: epoch "
                          f"{position.epoch}, {position.batches_done} batches in, step {position.global_step}.")


def _sharded_load_error():
    """torch's CheckpointException, a BaseException of FSDP's sharded load, once that has imported it (1.4 s of --help's start)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api.CheckpointException if api else Exception


def apply_flags_schedule(accelerator, scheduler, lr, gamma):
    """After a resume's load_state, which brings back the checkpoint run's learning rate and decay (in
    the optimizer's and scheduler's state): those of --lr and --gamma from here on where they differ, so
    that a resume can lower a learning rate that diverged. The same flags leave the resume bitwise."""
    step_lr = scheduler.scheduler  # the StepLR inside accelerate's prepared scheduler
    if (step_lr.base_lrs[0], step_lr.gamma) == (lr, gamma):
        return
    accelerator.print(f"--lr {lr} and --gamma {gamma} replace the {step_lr.base_lrs[0]} and {step_lr.gamma} of the run this checkpoint "
                      "comes from.")
    step_lr.base_lrs, step_lr.gamma = [lr] * len(step_lr.base_lrs), gamma
    for group in step_lr.optimizer.param_groups:  # StepLR's rate after the epochs done
        group["initial_lr"], group["lr"] = lr, lr * gamma ** (step_lr.last_epoch // step_lr.step_size)
    step_lr._last_lr = [group["lr"] for group in step_lr.optimizer.param_groups]  # get_last_lr(), which the epoch's record reads
