"""--early_stopping_patience and --early_stopping_target: stop training after the epoch that settles it.

The main process decides from the epoch's evaluation (the same numbers on every process) and from
the epochs metrics.jsonl already holds, so a resumed run remembers how long its eval loss has not
improved; accelerate's set_trigger and check_trigger then stop every process after the same epoch.
"""

from accelerate.utils import broadcast_object_list

from shared.metrics import read_records


class EarlyStopping:
    """`patience`: stop when eval_loss has not improved on its best for that many epochs; `target`: stop
    after the first epoch whose eval_accuracy reaches it (time to accuracy, as MLPerf measures it)."""

    def __init__(self, accelerator, output_dir, *, patience, target):
        self.accelerator = accelerator
        self.patience, self.target = patience, target
        self.history = read_records(output_dir) if accelerator.is_main_process else []  # a resumed run's epochs

    def stop_after(self, record):
        """After an epoch's evaluation: why every process stops now, or None. A collective, when on."""
        if self.patience is None and self.target is None:
            return None
        reason = None
        if self.accelerator.is_main_process:
            self.history.append(record)
            reason = self._reason()
            if reason:
                self.accelerator.set_trigger()
        if not self.accelerator.check_trigger():
            return None
        (reason,) = broadcast_object_list([reason])
        if reason is None:  # the trigger was a signal to stop (runtime.Preemption): leave it for its check
            self.accelerator.set_trigger()
        return reason

    def _reason(self):
        last = self.history[-1]
        if self.target is not None and last["eval_accuracy"] >= self.target:
            return f"eval_accuracy {last['eval_accuracy']:.4f} reached --early_stopping_target {self.target}"
        if self.patience is not None:
            best = min(self.history, key=lambda record: record["eval_loss"])
            if last["epoch"] - best["epoch"] >= self.patience:
                return (f"eval_loss has not improved for {self.patience} epochs (best {best['eval_loss']:.4f} "
                        f"after epoch {best['epoch']}; --early_stopping_patience {self.patience})")
        return None
