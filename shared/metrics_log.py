"""metrics.jsonl, the record of every epoch, written by the main process; and the lines a run prints
of its numbers."""

import json
import time

from shared import stop_together
from shared.errors import UserError
from shared.run_folder import EVAL_FILE, METRICS_FILE


class MetricsLog:
    """<output_dir>/metrics.jsonl: one JSON object per epoch."""

    def __init__(self, output_dir, accelerator):
        self.path = output_dir / METRICS_FILE
        self.accelerator = accelerator
        self.started = time.perf_counter()

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
                partial = self.path.with_name(self.path.name + ".tmp")
                partial.write_text("".join(json.dumps(record) + "\n" for record in records if record["epoch"] < position.epoch))
                partial.replace(self.path)


def read_records(output_dir):
    """The records of output_dir's metrics.jsonl, one per epoch (none without the file); a last line that
    a killed run's write cut short is left out."""
    path = output_dir / METRICS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise UserError(f"{path} line {number} is not a record of an epoch: fix or delete that line.") from None
    return records


def epoch_line(record, num_epochs):
    return (
        f"epoch {record['epoch']}/{num_epochs}  train_loss {record['train_loss']:.4f}  "
        f"eval_loss {record['eval_loss']:.4f}  eval_accuracy {record['eval_accuracy']:.4f}  "
        f"{record['samples_per_sec']:,.0f} samples/s  peak {record['peak_memory_mb']:,.0f} MB  world_size {record['world_size']}"
    )


def report_eval(result, source, accelerator, output_dir):
    """Every process must call this, though the main process alone writes (a failed write stops all of
    them): --eval_only's accuracy and per-class accuracy of the weights, printed and saved as eval.json."""
    result = {"weights": str(source), "world_size": accelerator.num_processes, **result}
    accelerator.print(
        f"{source}: eval_accuracy {result['eval_accuracy']:.4f} over {result['eval_samples']} samples "
        f"(eval_loss {result['eval_loss']:.4f}, world_size {accelerator.num_processes})"
    )
    for label, accuracy in enumerate(result["eval_per_class_accuracy"]):
        accelerator.print(f"  class {label}: {accuracy:.4f}")
    with stop_together.if_write_fails(output_dir / EVAL_FILE, "free space or fix the folder, and evaluate again."):
        if accelerator.is_main_process:
            (output_dir / EVAL_FILE).write_text(json.dumps(result, indent=1))
