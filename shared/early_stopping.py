"""--early_stopping_patience and --early_stopping_target: stop training after the epoch that settles it.

Every process decides for itself from the epoch's evaluation, which gather_for_metrics makes the
same numbers on every process, so all stop after the same epoch without a collective. A resumed run
starts from the epochs metrics.jsonl kept, so it remembers how long its eval loss has not improved.
"""

from accelerate.utils import broadcast_object_list


class EarlyStopping:
    """`patience`: stop when eval_loss has not improved on its best for that many epochs; `target`: stop
    after the first epoch whose eval_accuracy reaches it (time to accuracy, as MLPerf measures it).
    Every process must build it: it takes the main process's records of a resumed run (`metrics_log`)."""

    def __init__(self, metrics_log, *, patience, target):
        self.patience, self.target = patience, target
        (self.history,) = broadcast_object_list([metrics_log.records()])

    def reason_to_stop(self, record):
        """After an epoch's evaluation: why every process stops now, or None."""
        self.history.append(record)
        if self.target is not None and record["eval_accuracy"] >= self.target:
            return f"eval_accuracy {record['eval_accuracy']:.4f} reached --early_stopping_target {self.target}"
        best = min(self.history, key=lambda earlier: earlier["eval_loss"])
        if self.patience is not None and record["epoch"] - best["epoch"] >= self.patience:
            return (f"eval_loss has not improved for {self.patience} epochs (best {best['eval_loss']:.4f} "
                    f"after epoch {best['epoch']}; --early_stopping_patience {self.patience})")
        return None
