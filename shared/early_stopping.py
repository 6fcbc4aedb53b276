"""--early_stopping_patience and --early_stopping_target: stop training after the epoch that settles it.

The main process decides, from the epoch's evaluation and the epochs metrics.jsonl already holds (a
resumed run remembers how long its eval loss has not improved), and tells the others: every process
then stops after the same epoch, even where their float sums of the same numbers differ in the last bit.
"""

from shared import stop_together
from shared.errors import UserError
from shared.metrics import read_records
from shared.run_folder import model_saved_after


class EarlyStopping:
    """--early_stopping_patience and --early_stopping_target, as their help in shared/flags.py says."""

    def __init__(self, accelerator, output_dir, start, *, patience, target):
        """Every process must call this (one broadcast), before log.continue_from(start) cuts metrics.jsonl.
        A run that had already stopped early after its last recorded epoch, and saved its model after the
        checkpoint it resumes (`start`, a checkpoints.Position), stops with a sentence instead of training on."""
        self.accelerator, self.patience, self.target, self.history = accelerator, patience, target, []
        stop_together.on_main_process(accelerator, lambda: self._check_not_stopped(output_dir, start.path))
        self.history = [record for record in self.history if record["epoch"] < start.epoch]  # the epochs a resumed run keeps

    def _check_not_stopped(self, output_dir, checkpoint):
        self.history = read_records(output_dir)  # the main process's alone: only it decides
        if self.history and model_saved_after(output_dir, checkpoint) and (reason := self._reason(self.history[-1])):
            # Said of what the records show by these flags: the run may have stopped there early, or trained its --num_epochs.
            raise UserError(f"The run in {output_dir} has stopped early by these flags, after epoch {self.history[-1]['epoch']} ({reason}): "
                            "loosen --early_stopping_patience or --early_stopping_target to train further, or start a new run "
                            "in another --output_dir.")

    def reason_to_stop(self, record):
        """Every process must call this after an epoch's evaluation (one broadcast, when on): why all stop now, or None."""
        if self.patience is None and self.target is None:
            return None
        self.history.append(record)
        return stop_together.on_main_process(self.accelerator, lambda: self._reason(record))

    def _reason(self, record):
        if self.target is not None and record["eval_accuracy"] >= self.target:
            return f"eval_accuracy {record['eval_accuracy']:.4f} reached --early_stopping_target {self.target}"
        best = min(self.history, key=lambda earlier: earlier["eval_loss"])
        if self.patience is not None and record["epoch"] - best["epoch"] >= self.patience:
            return (f"eval_loss has not improved for {self.patience} epochs (best {best['eval_loss']:.4f} "
                    f"after epoch {best['epoch']}; --early_stopping_patience {self.patience})")
        return None
