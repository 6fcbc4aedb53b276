"""One epoch's training numbers over all processes: its mean loss, samples per second and peak memory,
with no host-device sync per batch; and the stop of a run whose loss or weights are no longer finite."""

import time

import torch

from shared.errors import UserError


class EpochStats:
    """The loss and sample sums of `epoch` on this process, and its peak memory. `carried_over` (a
    checkpoints.Position inside the epoch) adds what the checkpoint had summed, so that a resumed epoch
    reports the numbers of one that never stopped."""

    def __init__(self, accelerator, model, epoch, carried_over=None):
        self.accelerator, self.model, self.epoch = accelerator, model, epoch
        self.loss_sum = torch.zeros((), device=accelerator.device)  # sum of loss x batch size
        self.samples = self.batches = 0
        self.started = time.perf_counter()
        reset_peak_memory(accelerator.device)
        if carried_over is not None:
            self.batches = carried_over.batches_done
            self.started -= carried_over.epoch_seconds
            if accelerator.is_main_process:  # the saved sums are already over all processes
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
        totals = torch.stack([self.loss_sum.float(), torch.tensor(float(self.samples), device=self.loss_sum.device),
                              torch.as_tensor(nonfinite, device=self.loss_sum.device).float()])
        loss_sum, samples, nonfinite = self.accelerator.reduce(totals, reduction="sum").tolist()
        if not torch.isfinite(torch.tensor(loss_sum)) or nonfinite:
            fp16 = ", or --mixed_precision fp16 overflowed (bf16 has fp32's range)" if self.accelerator.mixed_precision == "fp16" else ""
            raise UserError(
                f"Training diverged in epoch {self.epoch}: the loss summed over its steps is {loss_sum} and {int(nonfinite)} weights "
                f"are not finite. The learning rate is likely too high{fp16}: lower --lr (or --gamma), and resume with "
                "--resume_from_checkpoint latest if the run saved checkpoints (none of them holds such weights), or train again.",
                every_process=True)
        return (loss_sum, samples), time.perf_counter() - self.started

    def summary(self):
        """Every process must call this (two collectives): the epoch's mean loss over every process's
        samples, the global training samples per second, and the largest peak memory of any process."""
        (loss_sum, samples), elapsed = self.snapshot()
        device = self.accelerator.device
        peaks = self.accelerator.gather(torch.tensor([peak_memory_mb(device)], device=device))
        return {
            "train_loss": loss_sum / max(samples, 1),
            "train_samples_seen": int(samples),  # the padding of the last batches included
            "samples_per_sec": samples / elapsed,
            "peak_memory_mb": round(float(peaks.max()), 1),
        }


def reset_peak_memory(device):
    """A new peak from now: CUDA's allocated, or the process's resident set (reset through /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:  # not Linux: the peak then counts from the start of the process
        pass


def peak_memory_mb(device):
    """This process's peak memory in MiB since reset_peak_memory: on a GPU what PyTorch allocated; on a
    CPU the resident set (the model, the data set, PyTorch: all the process held in RAM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
