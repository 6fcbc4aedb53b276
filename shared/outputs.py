"""What a run writes under --output_dir, and the checks that keep an earlier run's files safe."""

import json
import os
import shutil
import time
from pathlib import Path

from accelerate.utils import ProjectConfiguration

from shared import runtime
from shared.runtime import UserError

METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.safetensors"


def trackers(args):
    """The log_with of the Accelerator: None unless --with_tracking."""
    if not args.with_tracking:
        return None
    return ["tensorboard", "mlflow"] if args.report_to == "all" else [args.report_to or "tensorboard"]


def project_config(args):
    """Tracker stores under --output_dir: TensorBoard events in tensorboard/, MLflow in mlflow.db."""
    output_dir = Path(args.output_dir).resolve()
    if args.with_tracking and args.report_to in ("mlflow", "all"):
        # accelerate's MLflow tracker uses MLflow's default store (./mlruns of wherever the run
        # started) unless this is set; a user's own setting wins.
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{output_dir / 'mlflow.db'}")
    return ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "tensorboard"))


def tracker_options(output_dir):
    """init_trackers' init_kwargs: MLflow keeps its artifacts under --output_dir too (accelerate gives
    its MLflow tracker no folder, and MLflow's default is ./mlruns of wherever the run started)."""
    return {"mlflow": {"logging_dir": str(Path(output_dir).resolve() / "mlflow_artifacts")}}


def hyperparameters(args):
    """The flags as tracker-friendly values (TensorBoard's hparams take no None)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value) for key, value in vars(args).items()}


def prepare_output_dir(args, accelerator):
    """Check --output_dir before anything is written, then create it on the main process."""
    output_dir = Path(args.output_dir)
    resuming = bool(args.resume_from_checkpoint) or args.eval_only
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a folder: choose another --output_dir.")
    earlier = [name for name in (METRICS_FILE, MODEL_FILE) if (output_dir / name).exists()]
    if earlier and not resuming and not args.overwrite_output_dir:
        resumable = any((output_dir / "checkpoints").glob("step_*/trainer_state.json"))
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({', '.join(earlier)}): "
            + ("continue it with --resume_from_checkpoint latest, " if resumable else "")
            + "choose another --output_dir, or pass --overwrite_output_dir to replace it."
        )
    accelerator.wait_for_everyone()  # everyone has looked before the main process changes anything
    if accelerator.is_main_process:
        if args.overwrite_output_dir and not resuming:
            for name in earlier:
                (output_dir / name).unlink()
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
        if not output_dir.exists():
            output_dir.mkdir(parents=True)
            runtime.remove_if_left_empty(output_dir)
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
            world_size=self.accelerator.num_processes,
            mixed_precision=self.accelerator.mixed_precision,
            elapsed_s=round(time.perf_counter() - self.started, 3),
        )
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


def completed_epochs(output_dir):
    """The last epoch metrics.jsonl in output_dir records, 0 if none."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return 0
    return max((json.loads(line)["epoch"] for line in path.read_text().splitlines()), default=0)


def scalars(record):
    """The numbers of a record, for accelerator.log (trackers take no lists)."""
    return {key: value for key, value in record.items() if isinstance(value, (int, float))}


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
