"""What a run writes under --output_dir, and the checks that keep an earlier run's files safe."""

import json
import shutil
import time
from pathlib import Path

from shared.runtime import UserError

METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.safetensors"


def prepare_output_dir(args, accelerator, resuming=False):
    """Check --output_dir before anything is written, then create it on the main process."""
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a folder: choose another --output_dir.")
    earlier = [name for name in (METRICS_FILE, MODEL_FILE) if (output_dir / name).exists()]
    if earlier and not resuming and not args.overwrite_output_dir:
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({', '.join(earlier)}): continue it with "
            "--resume_from_checkpoint latest, choose another --output_dir, or pass --overwrite_output_dir to replace it."
        )
    accelerator.wait_for_everyone()  # everyone has looked before the main process changes anything
    if accelerator.is_main_process:
        if args.overwrite_output_dir and not resuming:
            for name in earlier:
                (output_dir / name).unlink()
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    return output_dir


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
            world_size=self.accelerator.num_processes, elapsed_s=round(time.perf_counter() - self.started, 3)
        )
        if self.accelerator.is_main_process:
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")
        return record
