"""Epoch metrics summed over all processes: training loss and throughput, and exact evaluation."""

import time

import torch


class EpochStats:
    """Sums the training loss and sample count of one epoch on this process, without a sync per batch.

    `carried_over` (a checkpoints.Position inside its epoch) adds what a checkpoint had summed of the
    epoch before it stopped, so a resumed epoch reports the same numbers as one that never stopped.
    """

    def __init__(self, accelerator, carried_over=None):
        self.accelerator = accelerator
        self.loss_sum = torch.zeros((), device=accelerator.device)  # sum of loss x batch size
        self.samples = 0
        self.batches = 0
        self.started = time.perf_counter()
        if carried_over is not None:
            self.batches = carried_over.batches_done
            self.started -= carried_over.epoch_seconds
            if accelerator.is_main_process:  # the saved sums are already over all processes
                self.loss_sum += carried_over.epoch_totals[0]
                self.samples = int(carried_over.epoch_totals[1])

    def add(self, loss, batch_size):
        self.loss_sum.add_(loss.detach(), alpha=batch_size)  # one small op per step, no sync with the device
        self.samples += batch_size
        self.batches += 1

    def snapshot(self):
        """The sums over all processes so far, and the seconds spent, for a checkpoint."""
        totals = torch.stack([self.loss_sum.float(), torch.tensor(float(self.samples), device=self.loss_sum.device)])
        return tuple(self.accelerator.reduce(totals, reduction="sum").tolist()), time.perf_counter() - self.started

    def summary(self):
        """The epoch's mean loss over every process's samples, and the global samples per second."""
        (loss_sum, samples), elapsed = self.snapshot()
        return {
            "train_loss": loss_sum / max(samples, 1),
            "train_samples_seen": int(samples),  # the padding of the last batches included
            "samples_per_sec": samples / elapsed,
        }


@torch.no_grad()
def evaluate(model, loader, accelerator, loss_fn, num_classes, prefix="eval"):
    """Loss and accuracy over the whole eval set, each sample counted exactly once.

    The prepared loader pads the last batches so every process gets the same number;
    gather_for_metrics drops that padding again.
    """
    model.eval()
    # Sums stay on the device (float64 for the loss) and are read once at the end, not every batch.
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    class_correct = torch.zeros(num_classes, dtype=torch.long, device=accelerator.device)
    class_total = torch.zeros(num_classes, dtype=torch.long, device=accelerator.device)
    for inputs, labels in loader:
        outputs = model(inputs)
        losses = loss_fn(outputs.float(), labels, reduction="none")
        hits = outputs.argmax(dim=1) == labels
        losses, hits, labels = accelerator.gather_for_metrics((losses, hits, labels))
        loss_sum += losses.double().sum()
        class_total += torch.bincount(labels, minlength=num_classes)
        class_correct += torch.bincount(labels[hits], minlength=num_classes)
    model.train()
    count = int(class_total.sum())
    return {
        f"{prefix}_loss": loss_sum.item() / max(count, 1),
        f"{prefix}_accuracy": int(class_correct.sum()) / max(count, 1),
        f"{prefix}_samples": count,
        f"{prefix}_per_class_accuracy": (class_correct / class_total.clamp(min=1)).tolist(),
    }


def epoch_line(record, num_epochs):
    return (
        f"epoch {record['epoch']}/{num_epochs}  train_loss {record['train_loss']:.4f}  "
        f"eval_loss {record['eval_loss']:.4f}  eval_accuracy {record['eval_accuracy']:.4f}  "
        f"{record['samples_per_sec']:,.0f} samples/s  world_size {record['world_size']}"
    )
