"""The numbers a run reports: each epoch's loss, speed and peak memory over all processes, with the stop
of a run whose loss or weights are no longer finite, and their record in metrics.jsonl."""

import contextlib
import json
import resource
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedType, gather_object

from shared import stop_together
from shared.errors import UserError
from shared.run_folder import METRICS_FILE


class EpochStats:
    """The loss and sample sums of `epoch` on this process, with no host-device sync per batch.
    `carried_over` (a checkpoints.Position inside the epoch) adds what the checkpoint had summed, so that
    a resumed epoch reports the numbers of one that never stopped."""

    def __init__(self, accelerator, model, epoch, carried_over=None):
        self.accelerator, self.model, self.epoch = accelerator, model, epoch
        self.loss_sum = torch.zeros((), device=accelerator.device)  # sum of loss x batch size
        self.samples = self.batches = 0
        self.started = time.perf_counter()
        reset_peak_memory(accelerator.device)
        if carried_over is not None:
            self.batches = carried_over.batches_done
            self.started -= carried_over.epoch_seconds
            if len(carried_over.process_totals) == accelerator.num_processes:  # this process's own sums: the epoch's come out bitwise
                loss_sum, self.samples = carried_over.process_totals[accelerator.process_index]
                self.loss_sum += loss_sum
            elif accelerator.is_main_process:  # at another world size, the sums over all processes
                self.loss_sum += carried_over.epoch_totals[0]
                self.samples = int(carried_over.epoch_totals[1])

    def add(self, loss, batch_size):
        self.loss_sum.add_(loss.detach(), alpha=batch_size)  # one small op on the device, no sync
        self.samples += batch_size
        self.batches += 1

    def snapshot(self):
        """Every process must call this (one all-reduce): the loss and sample sums over all processes so
        far, and the seconds spent. Stops every process when the loss or a weight is not finite, so that
        no checkpoint or model file of such weights is ever written."""
        nonfinite = sum((~torch.isfinite(weight.to_local() if hasattr(weight, "to_local") else weight)).sum()  # FSDP: this shard
                        for weight in self.model.parameters())
        # Every process counted its whole copy of the model, but under FSDP (fsdp.yaml: one shard each, no replicas).
        copies = 1 if self.accelerator.distributed_type == DistributedType.FSDP else self.accelerator.num_processes
        # float64: float32 would round a count past 2**24, and an epoch of a large data set has more samples
        totals = torch.stack([self.loss_sum.double(), torch.tensor(float(self.samples), dtype=torch.float64, device=self.loss_sum.device),
                              torch.as_tensor(nonfinite, device=self.loss_sum.device).double()])
        loss_sum, samples, nonfinite = self.accelerator.reduce(totals, reduction="sum").tolist()
        if not torch.isfinite(torch.tensor(loss_sum)) or nonfinite:
            fp16 = ", or --mixed_precision fp16 overflowed (bf16 has fp32's range)" if self.accelerator.mixed_precision == "fp16" else ""
            raise UserError(
                f"Training diverged in epoch {self.epoch}: the loss summed over its steps is {loss_sum} and {round(nonfinite / copies)} weights "
                f"are not finite. The learning rate is likely too high{fp16}: lower --lr (or --gamma), and resume with "
                "--resume_from_checkpoint latest if the run saved checkpoints (none of them holds such weights), or train again.",
                every_process=True)
        return (loss_sum, samples), time.perf_counter() - self.started

    def sums_by_process(self):
        """Every process must call this (one gather): each process's loss and sample sums so far, in rank order, for a
        checkpoint: resumed at the same world size, each process goes on from its own, and the float sums at the
        epoch's end group as in a run that never stopped (from the sums over all processes they would round differently)."""
        return tuple(gather_object([(self.loss_sum.item(), self.samples)]))  # Python numbers: exact, and on any device

    def summary(self):
        """Every process must call this (two collectives): the epoch's mean loss over every process's
        samples, the global training samples per second, and the largest peak memory of any process."""
        (loss_sum, samples), elapsed = self.snapshot()
        device = self.accelerator.device
        peaks = self.accelerator.gather(torch.tensor([peak_memory_mb(device)], device=device))
        return {"train_loss": loss_sum / max(samples, 1), "train_samples_seen": int(samples),  # the padding of the last batches included
                "samples_per_sec": samples / elapsed, "peak_memory_mb": round(float(peaks.max()), 1)}


def reset_peak_memory(device):
    """A new peak from now: CUDA's allocated, or the process's resident set (reset through /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux: the peak then counts from the start of the process
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device):
    """This process's peak memory in MiB since reset_peak_memory: on a GPU what PyTorch allocated; on a
    CPU the resident set (the model, the data set, PyTorch: all the process held in RAM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)  # bytes there, KiB on Linux


class MetricsLog:
    """<output_dir>/metrics.jsonl: one JSON object per epoch, written by the main process."""

    def __init__(self, output_dir, accelerator):
        self.path, self.accelerator, self.started = output_dir / METRICS_FILE, accelerator, time.perf_counter()

    def write(self, epoch, *parts):
        """Every process must call this, though the main process alone writes (a failed write stops all
        of them): appends the record of `epoch`, merged from the dicts in parts, and returns it."""
        record = {"epoch": epoch}
        for part in parts:
            record.update(part)
        record.update(world_size=self.accelerator.num_processes, device=str(self.accelerator.device),
                      mixed_precision=self.accelerator.mixed_precision, elapsed_s=round(time.perf_counter() - self.started, 3))
        with stop_together.if_write_fails(self.path, "free space or fix the folder, then resume with --resume_from_checkpoint "
                                          "latest (without checkpoints: train again with --overwrite_output_dir)."):
            if self.accelerator.is_main_process:
                with self.path.open("a") as file:
                    file.write(json.dumps(record) + "\n")
        return record

    def continue_from(self, position):
        """Every process must call this: keeps the records of the epochs before `position` (a
        checkpoints.Position; none for a new run), drops any later ones, and counts elapsed_s on from its."""
        self.started = time.perf_counter() - position.elapsed_s
        records = stop_together.on_main_process(self.accelerator, lambda: read_records(self.path.parent))
        with stop_together.if_write_fails(self.path, "free space or fix the folder, then resume again."):
            if self.accelerator.is_main_process and self.path.exists():
                write_whole(self.path, "".join(json.dumps(record) + "\n" for record in records if record["epoch"] < position.epoch))


RESUMED_KEYS = ("epoch", "step", "eval_loss", "eval_accuracy")  # what a resume reads of the epochs before it


def read_records(output_dir, keys=RESUMED_KEYS):
    """The records of output_dir's metrics.jsonl, one per epoch (none without the file), each an object with a number
    for each of `keys` (toy_mlp records no step); a last line that a killed run's write cut short is left out."""
    path = output_dir / METRICS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and all(type(record.get(key)) in (int, float) for key in keys):  # not a bool either
            records.append(record)
        elif number < len(lines) or record is not None:  # valid JSON of another shape: edited, not cut
            raise UserError(f"{path} line {number} is not a record of an epoch: fix or delete that line.")
    return records


def epoch_line(record, num_epochs):
    return (f"epoch {record['epoch']}/{num_epochs}  train_loss {record['train_loss']:.4f}  eval_loss {record['eval_loss']:.4f}  "
            f"eval_accuracy {record['eval_accuracy']:.4f}  {record['samples_per_sec']:,.0f} samples/s  "
            f"peak {record['peak_memory_mb']:,.0f} MB  world_size {record['world_size']}")


def write_whole(path, text):
    """Write text to path through a temporary file, so that a failed write leaves the file before it whole."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)
