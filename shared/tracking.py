"""Experiment trackers (--with_tracking --report_to): what the Accelerator logs to, with their stores
under --output_dir."""

import contextlib
import os
import random
import shutil
import socket
import sys
from pathlib import Path

from accelerate.utils import ProjectConfiguration, is_mlflow_available, is_tensorboard_available

from shared import stop_together
from shared.errors import UserError, first_line
from shared.run_folder import MLFLOW_ARTIFACTS, MLFLOW_DB, TENSORBOARD_FOLDER


def log_with(with_tracking, report_to):
    """The Accelerator's log_with: no tracker unless --with_tracking; TensorBoard unless --report_to says
    otherwise. starting() checks that the main process, the one that runs them, has their packages."""
    if not with_tracking:
        return None
    return ["tensorboard", "mlflow"] if report_to == "all" else [report_to or "tensorboard"]


def project_config(output_dir):
    """The Accelerator's project_config: TensorBoard's events under output_dir."""
    output_dir = Path(output_dir).resolve()
    return ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / TENSORBOARD_FOLDER))


@contextlib.contextmanager
def starting(accelerator, output_dir, report_to, start):
    """Every process must enter this, around accelerator.init_trackers(..., init_kwargs=<what it gives>),
    which starts the trackers on the main process alone. MLflow's runs and artifacts go under output_dir
    (accelerate's MLflow tracker would use ./mlruns of wherever the run started; a MLFLOW_TRACKING_URI you
    set wins). TensorBoard drops the epochs from `start` (a checkpoints.Position) on that the run a resume
    continues had logged, as metrics.jsonl drops their records: its curves then hold each epoch once. A
    tracker that fails to start (a server down, a store it cannot make) stops every process with one
    sentence, not a traceback on one and a wait on the others; the trackers started before it are
    closed, and the stores they made in output_dir removed (a resumed run's stay). One that fails later
    is left out with a warning (_left_out_if_failing), not the run; one whose package the main process
    lacks stops every process before any starts."""
    stop_together.on_main_process(accelerator, lambda: _check_installed(log_with(True, report_to)))
    output_dir = Path(output_dir).resolve()
    if report_to in ("mlflow", "all"):
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{output_dir / MLFLOW_DB}")
    stores = [output_dir / name for name in (TENSORBOARD_FOLDER, MLFLOW_DB, MLFLOW_ARTIFACTS)]
    there_before = [store.exists() for store in stores]
    error, random_state = None, random.getstate()
    try:
        yield {"mlflow": {"logging_dir": str(output_dir / MLFLOW_ARTIFACTS)}, "tensorboard": {"purge_step": start.epoch}}
    except Exception as failure:  # mlflow, its database and tensorboard raise many kinds
        error = (f"--report_to {report_to or 'tensorboard'} could not start its tracker ({first_line(failure)}): fix what it "
                 "names (MLFLOW_TRACKING_URI, where you set it), or train without --with_tracking.")
        for tracker in accelerator.trackers:
            with contextlib.suppress(Exception):  # it is being given up
                tracker.finish()
        for store in (store for store, there in zip(stores, there_before) if not there and store.exists()):
            shutil.rmtree(store) if store.is_dir() else store.unlink()
    else:
        for tracker in accelerator.trackers:  # the main process's: the others have none
            _left_out_if_failing(tracker)
    finally:  # MLflow names its run with Python's random: the run draws on from the state its seed or checkpoint set
        random.setstate(random_state)
    stop_together.if_any_failed(error)


def _check_installed(trackers):
    """On the main process, which alone runs the trackers (another machine may go without their packages)."""
    for tracker, available in (("tensorboard", is_tensorboard_available), ("mlflow", is_mlflow_available)):
        if tracker in trackers and not available():  # else accelerate leaves it out, and the run records nothing
            raise UserError(f"--report_to {tracker} needs the {tracker} package, which is not installed on {socket.gethostname()}, "
                            f"the main process's machine: pip install {tracker} there, or train without --with_tracking.")


def _left_out_if_failing(tracker):
    """A tracker whose log or finish fails mid-run (its store damaged, its server gone) says so in one
    warning and does nothing from then on: the run trains on, the other trackers too, and metrics.jsonl
    keeps every epoch's record. (accelerator.log and end_training call each tracker's own methods.)"""
    failed = []

    def guard(method):
        def guarded(*args, **kwargs):
            if failed:
                return None
            try:
                return method(*args, **kwargs)
            except Exception as failure:  # mlflow, its database and tensorboard raise many kinds
                failed.append(failure)
                print(f"warning: the {tracker.name} tracker failed ({first_line(failure)}): the run goes on without it, "
                      "and metrics.jsonl keeps every epoch's record.", file=sys.stderr, flush=True)
        return guarded
    tracker.log, tracker.finish = guard(tracker.log), guard(tracker.finish)


def hyperparameters(flags):
    """Every flag (vars(args)) as a tracker-friendly value (TensorBoard's hparams take no None)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value) for key, value in flags.items()}


def scalars(record):
    """The numbers of a metrics record, for accelerator.log (trackers take no lists, and a flag is no metric)."""
    return {key: value for key, value in record.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
