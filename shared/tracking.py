"""Experiment trackers (--with_tracking --report_to): what the Accelerator logs to, and where their stores go."""

import os
from pathlib import Path

from accelerate.utils import ProjectConfiguration


def log_with(with_tracking, report_to):
    """The Accelerator's log_with: no tracker unless --with_tracking; TensorBoard unless --report_to says otherwise."""
    if not with_tracking:
        return None
    return ["tensorboard", "mlflow"] if report_to == "all" else [report_to or "tensorboard"]


def project_config(output_dir, trackers):
    """Tracker stores under output_dir: TensorBoard events in tensorboard/, MLflow runs in mlflow.db."""
    output_dir = Path(output_dir).resolve()
    if trackers and "mlflow" in trackers:
        # accelerate's MLflow tracker uses MLflow's default store (./mlruns of wherever the run
        # started) unless this is set; a user's own setting wins.
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{output_dir / 'mlflow.db'}")
    return ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "tensorboard"))


def init_kwargs(output_dir):
    """init_trackers' init_kwargs: MLflow keeps its artifacts under output_dir too (accelerate gives
    its MLflow tracker no folder, and MLflow's default is ./mlruns of wherever the run started)."""
    return {"mlflow": {"logging_dir": str(Path(output_dir).resolve() / "mlflow_artifacts")}}


def hyperparameters(flags):
    """Every flag (vars(args)) as a tracker-friendly value (TensorBoard's hparams take no None)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value) for key, value in flags.items()}


def scalars(record):
    """The numbers of a metrics record, for accelerator.log (trackers take no lists)."""
    return {key: value for key, value in record.items() if isinstance(value, (int, float))}
