"""Epoch metrics summed over all processes: training loss and throughput, exact evaluation, and
metrics.jsonl, the record of every epoch."""

import json
import time
from pathlib import Path

import torch

from shared.run_folder import METRICS_FILE
from shared.runtime import stop_all_if_write_fails


class EpochStats:
    """Sums the training loss and sample count of one epoch on this process, without a sync per batch,
    and measures the epoch's peak memory (see peak_memory_mb).

    `carried_over` (a checkpoints.Position inside its epoch) adds what a checkpoint had summed of the
    epoch before it stopped, so a resumed epoch reports the same numbers as one that never stopped.
    """

    def __init__(self, accelerator, carried_over=None):
        self.accelerator = accelerator
        self.loss_sum = torch.zeros((), device=accelerator.device)  # sum of loss x batch size
        self.samples = 0
        self.batches = 0
        self.started = time.perf_counter()
        reset_peak_memory(accelerator.device)
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
        """The epoch's mean loss over every process's samples, the global training samples per second,
        and the largest peak memory of any process (two collectives)."""
        (loss_sum, samples), elapsed = self.snapshot()
        peaks = self.accelerator.gather(torch.tensor([peak_memory_mb(self.accelerator.device)], device=self.accelerator.device))
        return {
            "train_loss": loss_sum / max(samples, 1),
            "train_samples_seen": int(samples),  # the padding of the last batches included
            "samples_per_sec": samples / elapsed,
            "peak_memory_mb": round(float(peaks.max()), 1),
        }


def reset_peak_memory(device):
    """Start measuring a new peak: CUDA's peak allocated, or the process's peak resident set (Linux
    lets a process reset its own high-water mark through /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:  # not Linux: the peak then counts from the start of the process
        pass


def peak_memory_mb(device):
    """This process's peak memory since reset_peak_memory, in MiB: on a GPU what PyTorch allocated on it;
    on a CPU the resident set (everything the process held in RAM: the model, the data set, PyTorch)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def evaluate(model, loader, accelerator, loss_fn, num_classes, prefix="eval"):
    """Loss and accuracy over the whole eval set, each sample counted exactly once.

    The prepared loader pads the last batches so every process gets the same number;
    gather_for_metrics drops that padding again. Every process evaluates the same model: buffers
    such as BatchNorm's running statistics, which each process updates with its own batches (DDP
    overwrites them with the main process's only at the next training step, FSDP never does), are
    first taken from the main process, whose are the ones saved. This changes no trained weight.
    """
    take_buffers_from_the_main_process(model, accelerator)
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


def take_buffers_from_the_main_process(model, accelerator):
    if accelerator.num_processes > 1:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer.data, src=0)


def epoch_line(record, num_epochs):
    return (
        f"epoch {record['epoch']}/{num_epochs}  train_loss {record['train_loss']:.4f}  "
        f"eval_loss {record['eval_loss']:.4f}  eval_accuracy {record['eval_accuracy']:.4f}  "
        f"{record['samples_per_sec']:,.0f} samples/s  peak {record['peak_memory_mb']:,.0f} MB  world_size {record['world_size']}"
    )


class MetricsLog:
    """metrics.jsonl: one JSON object per epoch, written by the main process only."""

    def __init__(self, output_dir, accelerator):
        self.path = Path(output_dir) / METRICS_FILE
        self.accelerator = accelerator
        self.started = time.perf_counter()

    def write(self, epoch, *parts):
        """Append the record of one epoch, merged from the dicts in parts, and return it."""
        record = {"epoch": epoch}
        for part in parts:
            record.update(part)
        record.update(
            world_size=self.accelerator.num_processes,
            device=str(self.accelerator.device),
            mixed_precision=self.accelerator.mixed_precision,
            elapsed_s=round(time.perf_counter() - self.started, 3),
        )
        with stop_all_if_write_fails(self.path, "free space or fix the folder, then resume from the newest checkpoint."):
            if self.accelerator.is_main_process:
                with self.path.open("a") as file:
                    file.write(json.dumps(record) + "\n")
        return record

    def continue_from(self, position):
        """A resumed run: keep the epochs the checkpoint had finished, drop any later ones, and count
        elapsed_s on from the checkpoint's."""
        self.started = time.perf_counter() - position.elapsed_s
        if self.accelerator.is_main_process and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["epoch"] < position.epoch]
            partial = self.path.with_name(self.path.name + ".tmp")
            partial.write_text("".join(line + "\n" for line in kept))
            partial.replace(self.path)
        self.accelerator.wait_for_everyone()


def read_records(output_dir):
    """The records of metrics.jsonl in output_dir, one per epoch; none if there is no such file."""
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_record(output_dir):
    """The last record of metrics.jsonl in output_dir (epoch, step, ...), None if there is none."""
    records = read_records(output_dir)
    return records[-1] if records else None


def report_eval(result, source, accelerator, output_dir):
    """--eval_only: print the weights' accuracy and per-class accuracy, and save them as eval.json."""
    result = {"weights": str(source), "world_size": accelerator.num_processes, **result}
    accelerator.print(
        f"{source}: eval_accuracy {result['eval_accuracy']:.4f} over {result['eval_samples']} samples "
        f"(eval_loss {result['eval_loss']:.4f}, world_size {accelerator.num_processes})"
    )
    for label, accuracy in enumerate(result["eval_per_class_accuracy"]):
        accelerator.print(f"  class {label}: {accuracy:.4f}")
    if accelerator.is_main_process:
        (Path(output_dir) / "eval.json").write_text(json.dumps(result, indent=1))
