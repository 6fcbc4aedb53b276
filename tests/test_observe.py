"""Seeing inside a run, and sending less: --profile, peak memory, --ddp_comm_hook and early stopping.
Each check fails if its flag silently did nothing; a flag that only observes leaves the weights bitwise
as they were."""

import contextlib
import gzip
import json
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import SCRIPTS, TOOLS, checkpoints_in, error_lines, forks_made, launch_command, python_command, read_metrics, read_state, run, script_env, scripts_of
from test_features import assert_same_records, assert_same_weights, resume_from, script_command, train, weights

from shared import profiling

PROBES = Path(__file__).resolve().parent / "probes"
PHASES = ("forward", "backward", "all-reduce wait", "optimizer", "data and loop")


TRACKED = ["--with_tracking", "--report_to", "all"]  # both trackers: they only observe


def step_time_table(profile_folder, cwd):
    """tools/step_time.py's table of a run's traces, and the rows it saved."""
    result = run([sys.executable, TOOLS / "step_time.py", profile_folder], cwd=cwd)
    return result.stdout, json.loads((profile_folder / "step_time.json").read_text())


@pytest.fixture(scope="module")
def two_process_run(data_dir, tmp_path_factory, fork_servers):
    """cpu_gloo on 2 processes, 2 epochs of 32 steps, with nothing observed: what the observed runs must equal."""
    output_dir, _ = train("cpu_gloo.py", tmp_path_factory.mktemp("plain"), "run", "--num_epochs", "2", num_processes=2, data_dir=data_dir)
    return output_dir


def test_profile_writes_a_trace_per_process_and_a_table_and_changes_no_weight(two_process_run, data_dir, tmp_path):
    profiled, result = train("cpu_gloo.py", tmp_path, "profiled", "--num_epochs", "2", "--profile", num_processes=2, data_dir=data_dir)
    assert_same_weights(weights(two_process_run), weights(profiled))
    assert_same_records(read_metrics(two_process_run), read_metrics(profiled), rel=1e-6)
    for rank in (0, 1):
        names = {event["name"] for event in json.loads((profiled / "profile" / f"trace_rank{rank}.json").read_text())["traceEvents"]}
        assert {"DistributedDataParallel.forward", "gloo:all_reduce", "Optimizer.step#SGD.step"} <= names
    assert f"--profile wrote a trace per process to {profiled / 'profile'}: `python tools/step_time.py" in result.stdout
    printed, rows = step_time_table(profiled / "profile", tmp_path)
    assert [row["process"] for row in rows] == [0, 1]
    for row in rows:
        assert row["steps"] == 5 and row["timeline"] == "host" and row["step"] > 0 and row["backward"] > 0 and row["all-reduce wait"] > 0
        assert sum(row[phase] for phase in PHASES) == pytest.approx(row["step"], rel=0.05)
    assert "| process | step | forward | backward | all-reduce wait | optimizer | data and loop | all-reduce under backward |" in printed


def test_the_step_table_leaves_out_the_steps_that_held_an_evaluation_a_save_or_no_training(small_data, tmp_path):
    """The profiled window crosses an epoch's end (8 steps an epoch, steps 8 to 12 recorded): one step
    also holds epoch 1's evaluation. A run that ends inside the window (--max_train_steps 10, 16 steps an
    epoch) leaves its last span open, and torch closes it only at the end, around the evaluation (here one
    forward, of the one test batch) and the save. A checkpoint saved after step 10 lands in the span of step 11.
    None is a training step: averaged in, they made the step look slower than it is (a save: before, counted),
    and tools/plot_trace.py draws the last step that is one (before, the run's end, an evaluation's forwards)."""
    from plot_trace import last_step
    from step_time import SAVE_SPAN

    assert SAVE_SPAN == profiling.SAVE_SPAN, "the tool's copy, which imports no torch, is the label the checkpoints write"
    for name, flags, counted in (("across_an_epoch", ["--num_epochs", "2", "--batch_size", "64"], 4),
                                 ("ended_inside", ["--max_train_steps", "10", "--batch_size", "32"], 3),
                                 ("saved_inside", ["--num_epochs", "1", "--batch_size", "32", "--checkpointing_steps", "10"], 4)):
        profiled, _ = train("cpu_gloo.py", tmp_path, name, "--profile", *flags, data_dir=small_data)
        printed, (row,) = step_time_table(profiled / "profile", tmp_path)
        assert (row["steps"], row["left out"]) == (counted, 1), row
        assert f"over {counted} profiled training steps, 1 more left out that held an evaluation, a checkpoint's save or no training" in printed
        _, phases = last_step(json.loads((profiled / "profile" / "trace_rank0.json").read_text()))
        assert [len(phases[name]) for name in ("forward", "backward")] == [1, 1], phases


def gpu_shaped_trace():
    """Two profiled steps of 10 ms in the shape Kineto writes with CUDA: each ProfilerStep#N on the host's
    main thread and again on the device's row (gpu_user_annotation); autograd's functions and DDP's
    copy_bucket_to_grad on autograd's device thread; compute kernels on stream 7 and NCCL's all-reduce
    on stream 20, 1 ms of it beside backward's last kernel and 1.5 ms alone, after NCCL's broadcast of
    BatchNorm's buffers (DDP's, before forward's first kernel)."""
    events = []
    for start in (0, 20_000):
        def event(cat, name, ts, dur, pid=100, tid=1):
            events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start + ts, "dur": dur})
        event("user_annotation", f"ProfilerStep#{start}", 0, 10_000)
        event("gpu_user_annotation", f"ProfilerStep#{start}", 500, 11_500, pid=0, tid=7)
        event("user_annotation", "DistributedDataParallel.forward", 0, 2_000)
        event("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 2_500, 3_500, tid=2)
        event("cpu_op", "torch.distributed.ddp.reducer::copy_bucket_to_grad", 6_000, 100, tid=2)
        event("user_annotation", "Optimizer.step#SGD.step", 7_000, 1_000)
        for ts, dur in ((1_000, 2_000), (3_000, 4_000), (9_000, 1_000)):
            event("kernel", "void at::native::vectorized_elementwise_kernel<4>(...)", ts, dur, pid=0, tid=7)
        event("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 6_000, 2_500, pid=0, tid=20)
        event("kernel", "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 500, 400, pid=0, tid=20)
    return {"traceEvents": events}


def test_the_step_table_of_a_gpu_trace_counts_each_step_once_and_reads_nccl_from_the_device():
    """Kineto repeats each step on the device's rows, and on a GPU the host never waits on NCCL: the table
    counts the host's steps, and takes the all-reduce from NCCL's kernels against the others. A broadcast is no
    all-reduce (before 2026-11-27 it was counted as one), but the device was busy with it."""
    sys.path.insert(0, str(TOOLS))
    from step_time import step_time

    row = step_time(gpu_shaped_trace())
    assert row == {"step": 10.0, "forward": 2.0, "backward": 3.5, "optimizer": 1.0, "data and loop": 3.5, "all-reduce wait": 1.5,
                   "device busy": 8.9, "all-reduce under backward": 1.0, "steps": 2, "left out": 0, "timeline": "device"}


def test_the_step_table_of_a_real_h100_trace_counts_each_step_once():
    """A trace Kineto wrote on an H100 (`mnist_conv.py --profile` at 1 process, batch 64, torch 2.11,
    2026-11-25; 76 KB gzipped): each of the 5 steps is on the host's main thread and again on the device's
    row, and is counted once; the phases add up to the step; the device is busy a fraction of it (the
    small batch is host-bound); one process has no all-reduce. NCCL's columns need a trace of 2 GPUs."""
    sys.path.insert(0, str(TOOLS))
    from step_time import step_time

    trace = json.loads(gzip.decompress((Path(__file__).parent / "traces" / "h100_mnist_conv_1gpu_trace_rank0.json.gz").read_bytes()))
    assert trace["deviceProperties"][0]["name"].startswith("NVIDIA H100")
    row = step_time(trace)
    assert row["steps"] == 5 and row["timeline"] == "device", row
    assert abs(sum(row[phase] for phase in PHASES) - row["step"]) < 0.01, row
    assert 0 < row["device busy"] < row["step"] / 2, row
    assert row["all-reduce wait"] == row["all-reduce under backward"] == 0, row

    # Where a second stream ran in a step (NCCL's, at 2 GPUs), Kineto marks the step on that stream too,
    # here a mark over the step's last microsecond: the step on the device still spans both marks. Before,
    # the last mark read replaced the first, and the device looked busy for almost none of the step.
    marks = [event for event in trace["traceEvents"] if event.get("cat") == "gpu_user_annotation" and event["name"].startswith("ProfilerStep")]
    for mark in marks:
        trace["traceEvents"].append({**mark, "tid": mark["tid"] + 1, "ts": mark["ts"] + mark["dur"] - 1, "dur": 1})
    assert step_time(trace) == row

    # tools/plot_trace.py draws the host's phases of the last step, once each: before, forward's and the
    # optimizer's copies on the device's row were drawn on the main thread's too.
    from plot_trace import last_step

    _, phases = last_step(trace)
    assert [len(phases[name]) for name in ("forward", "backward", "optimizer")] == [1, 1, 2], phases  # the step, and zero_grad


def test_the_step_table_counts_gloos_overlapping_all_reduces_once():
    """gloo runs the all-reduces of two buckets at once, on threads of its own: 3 ms of backward under two
    all-reduces that overlap are 3 ms hidden, not 4.5 (before, each all-reduce's overlap was added)."""
    sys.path.insert(0, str(TOOLS))
    from step_time import step_time

    events = [{"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur} for cat, name, tid, ts, dur in (
        ("user_annotation", "ProfilerStep#1", 1, 0, 10_000), ("user_annotation", "DistributedDataParallel.forward", 1, 0, 2_000),
        ("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 1, 2_000, 4_000),
        ("cpu_op", "gloo:all_reduce", 2, 3_000, 2_000), ("cpu_op", "gloo:all_reduce", 3, 3_500, 2_500),
        ("cpu_op", "torch.distributed.ddp.reducer::copy_bucket_to_grad", 1, 6_500, 100))]
    row = step_time({"traceEvents": events})
    assert row["all-reduce under backward"] == 3.0 and row["all-reduce wait"] == 0.6, row


def test_profile_at_four_processes_gathers_every_rank(data_dir, tmp_path):
    """Under cpu.yaml at 4 processes: a trace and a row of the table for each process, and, tracked by
    both trackers too, the weights of the same run without --profile and tracking."""
    plain, _ = train("cpu_gloo.py", tmp_path, "plain", "--max_train_steps", "14", num_processes=4, data_dir=data_dir)
    profiled, result = train("cpu_gloo.py", tmp_path, "profiled", "--max_train_steps", "14", "--profile", *TRACKED,
                             num_processes=4, data_dir=data_dir)
    assert read_metrics(profiled)[-1]["world_size"] == 4 and all((profiled / store).exists() for store in ("tensorboard", "mlflow.db"))
    assert_same_weights(weights(plain), weights(profiled))
    assert sorted(path.name for path in (profiled / "profile").glob("trace_rank*.json")) == [f"trace_rank{rank}.json" for rank in range(4)]
    printed, rows = step_time_table(profiled / "profile", tmp_path)
    assert [row["process"] for row in rows] == [0, 1, 2, 3]
    assert all(row["steps"] == 5 and row["all-reduce wait"] > 0 for row in rows), rows
    rows_printed = [line.split(" | ")[0] for line in printed.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows_printed == ["| 0", "| 1", "| 2", "| 3"], printed


def test_profile_on_one_process_and_a_run_too_short_to_profile(data_dir, tmp_path):
    """A trace of a process this run does not have (left by an earlier launch at 2) goes: the table is this run's.
    Profiled and tracked, one process trains the weights of the same run without either."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "profiled" / "profile").mkdir(parents=True)
    (tmp_path / "profiled" / "profile" / "trace_rank1.json").write_text('{"traceEvents": []}')
    plain, _ = train("mnist_conv.py", tmp_path, "plain", "--max_train_steps", "14", data_dir=data_dir)
    profiled, result = train("mnist_conv.py", tmp_path, "profiled", "--max_train_steps", "14", "--profile", *TRACKED, data_dir=data_dir)
    assert read_metrics(profiled)[-1]["world_size"] == 1 and all((profiled / store).exists() for store in ("tensorboard", "mlflow.db"))
    assert_same_weights(weights(plain), weights(profiled))
    accuracy = EventAccumulator(str(next((profiled / "tensorboard").iterdir()))).Reload().Scalars("eval_accuracy")  # mnist_conv's log
    assert [event.step for event in accuracy] == [record["epoch"] for record in read_metrics(profiled)]
    assert [event.value for event in accuracy] == pytest.approx([record["eval_accuracy"] for record in read_metrics(profiled)])
    _, (row,) = step_time_table(profiled / "profile", tmp_path)
    assert row["process"] == 0 and row["forward"] > 0 and row["all-reduce wait"] == 0
    # Ended at the window's first recorded step, torch writes a trace of what came after the loop (the evaluation): none.
    short, result = train("cpu_gloo.py", tmp_path, "short", "--max_train_steps", "7", "--profile", data_dir=data_dir)
    assert "--profile recorded nothing: the run took 7 steps, and the profiler skips 5" in result.stderr
    assert "--profile wrote" not in result.stdout and not (short / "profile").exists()


def test_a_trace_that_cannot_be_written_stops_every_process_in_one_sentence(data_dir, tmp_path):
    """At 2 processes, where <output_dir>/profile is a file: both stop at the end of the profiled window
    with one sentence naming the trace, and the file stays."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / "profile").write_text("not a folder")
    with forks_made() as new_forks:
        result = run(script_command("cpu_gloo.py", "--output_dir", output_dir, "--data_dir", data_dir, "--max_train_steps", "14", "--profile",
                                    num_processes=2), cwd=tmp_path, check=False)
    assert scripts_of(new_forks).count("cpu_gloo.py") == 2
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "error: " in line]
    assert line.startswith(f"error: Could not write {output_dir / 'profile' / 'trace_rank'}") and line.endswith(
        "free space or fix the folder, or train without --profile."), line
    assert (output_dir / "profile").read_text() == "not a folder"


def test_a_process_that_fails_inside_the_profiled_window_ends_the_run_without_a_trace(data_dir, tmp_path):
    """The last of 2 processes runs out of memory in its 10th backward, inside the recorded window (steps 8 to 12).
    Its profiler wrote the trace on the way out, a write that waits for every process, while the other process
    waited in that step's gradient all-reduce: the run hung until --ddp_timeout. Now the failing process writes
    no trace, and the run ends in its failure's sentence, as without --profile."""
    output_dir = tmp_path / "run"
    started = time.monotonic()
    result = run(launch_command(PROBES / "out_of_memory_in.py", "backward@10", SCRIPTS / "cpu_gloo.py", "--output_dir", output_dir,
                                "--data_dir", data_dir, "--max_train_steps", "14", "--profile", "--ddp_timeout", "300", num_processes=2),
                 cwd=tmp_path, check=False)
    assert result.returncode == 1 and time.monotonic() - started < 200, (time.monotonic() - started, result.stderr[-3000:])
    assert error_lines(result.stderr)[0].startswith("error: Out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.)"), result.stderr[-3000:]
    assert "[rank 1] error: Out of memory (" in result.stderr, "the last of 2 processes failed, not one process alone"
    assert not (output_dir / "profile").exists()


def test_the_trace_tools_answer_a_trace_cut_short_in_one_sentence(tmp_path):
    """A trace that a run killed while writing it left cut short ends each tool in one line naming it."""
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "trace_rank0.json").write_text('{"traceEvents": [{"name": "ProfilerStep#3", ')
    for tool in ("step_time.py", "plot_trace.py"):
        result = run([sys.executable, TOOLS / tool, tmp_path / "profile"], cwd=tmp_path, check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith(f"error: {tmp_path / 'profile' / 'trace_rank0.json'} could not be read as a trace ("), result.stderr
        assert result.stderr.strip().endswith("): profile the run again, or pass another profile folder.")
    # JSON, but not a trace; a trace without a recorded step (a run shorter than the profiler's window).
    for content, sentence in (("[]", "could not be read as a trace (it holds no traceEvents list)"),
                              ('{"traceEvents": []}', "step: pass the profile folder of a run trained with --profile long enough")):
        (tmp_path / "profile" / "trace_rank0.json").write_text(content)
        for tool in ("step_time.py", "plot_trace.py"):
            result = run([sys.executable, TOOLS / tool, tmp_path / "profile"], cwd=tmp_path, check=False)
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
            assert result.stderr.count("error: ") == 1 and sentence in result.stderr, result.stderr
    # Every recorded step held a checkpoint's save (--checkpointing_steps 1): the run was long enough, its steps not alone.
    saving = gpu_shaped_trace()
    for step in [event for event in saving["traceEvents"] if event["cat"] == "user_annotation" and event["name"].startswith("ProfilerStep#")]:
        saving["traceEvents"].append({**step, "name": profiling.SAVE_SPAN, "ts": step["ts"] + 9_000, "dur": 500})
    (tmp_path / "profile" / "trace_rank0.json").write_text(json.dumps(saving))
    for tool, where in (("step_time.py", tmp_path / "profile"), ("plot_trace.py", tmp_path / "profile" / "trace_rank0.json")):
        result = run([sys.executable, TOOLS / tool, tmp_path / "profile"], cwd=tmp_path, check=False)
        assert result.returncode == 1 and result.stderr.splitlines() == [
            f"error: every step recorded in {where} also held an evaluation, a checkpoint's save or no training: profile again "
            "with checkpoints further apart (--checkpointing_steps) or longer epochs, so that steps 8 to 12 train alone."], result.stderr
    # A folder without traces; a table whose step_time.json cannot be written (a folder of that name).
    (tmp_path / "profile" / "trace_rank0.json").unlink()
    result = run([sys.executable, TOOLS / "plot_trace.py", tmp_path / "profile"], cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: {tmp_path / 'profile'} holds no trace_rank*.json: pass the profile/ folder of a run made with --profile."]
    (tmp_path / "profile" / "trace_rank0.json").write_text(json.dumps(gpu_shaped_trace()))
    (tmp_path / "profile" / "step_time.json").mkdir()
    result = run([sys.executable, TOOLS / "step_time.py", tmp_path / "profile"], cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.startswith(f"error: {tmp_path / 'profile' / 'step_time.json'} could not be written ("), \
        result.stderr
    assert result.stderr.strip().endswith("): make the folder writable, or copy it to one that is.")
    # A file of another name beside the traces is no rank's (before, a traceback on its name); an output that is a folder.
    (tmp_path / "profile" / "step_time.json").rmdir()
    (tmp_path / "profile" / "trace_rank_summary.json").write_text("{}")
    assert run([sys.executable, TOOLS / "step_time.py", tmp_path / "profile"], cwd=tmp_path).stdout.count("\n| 0 |") == 1
    (tmp_path / "folder.png").mkdir()
    result = run([sys.executable, TOOLS / "plot_trace.py", tmp_path / "profile", "-o", tmp_path / "folder.png"], cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.startswith(f"error: {tmp_path / 'folder.png'} could not be written ("), result.stderr


def test_peak_memory_is_in_every_record_and_tracker_log(two_process_run, data_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for record in read_metrics(two_process_run):
        assert record["device"].split(":")[0] == "cpu" and 100 < record["peak_memory_mb"] < 20_000  # the process's resident set, in MiB
    tracked, _ = train("cpu_gloo.py", tmp_path, "tracked", "--max_train_steps", "40", "--with_tracking", data_dir=data_dir)
    events = EventAccumulator(str(next((tracked / "tensorboard").iterdir()))).Reload()
    assert [event.value for event in events.Scalars("peak_memory_mb")] == pytest.approx([r["peak_memory_mb"] for r in read_metrics(tracked)])


def test_a_resumed_run_logs_each_epoch_once_to_tensorboard(small_data, tmp_path):
    """A resume from epoch 1's checkpoint trains epoch 2 again: TensorBoard drops the abandoned epoch 2, as
    metrics.jsonl does, so that its curve holds each epoch once, with the records' values (before, it read
    epochs 1, 2, 2, 3: the abandoned run's and the resumed run's mixed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["--with_tracking", "--checkpointing_steps", "epoch", "--batch_size", "64"]
    run_dir, _ = train("cpu_gloo.py", tmp_path, "run", "--num_epochs", "2", *flags, data_dir=small_data)
    # TensorBoard reads a folder's event files in name order: the second each run started its tracker, then
    # its pid. Two runs in one second (the test's forked runs are that fast) could read in either order.
    time.sleep(1 - time.time() % 1)
    train("cpu_gloo.py", tmp_path, "run", "--num_epochs", "3", *flags, "--resume_from_checkpoint",
          run_dir / "checkpoints" / "step_00000008", data_dir=small_data)  # 8 steps an epoch: after epoch 1
    events = EventAccumulator(str(next((run_dir / "tensorboard").iterdir()))).Reload()
    records = read_metrics(run_dir)
    assert [event.step for event in events.Scalars("eval_loss")] == [record["epoch"] for record in records] == [1, 2, 3]
    assert [event.value for event in events.Scalars("eval_loss")] == pytest.approx([record["eval_loss"] for record in records])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # MLflow's own use of SQLAlchemy, when the test makes the store
def test_a_tracker_that_fails_mid_run_is_left_out_with_a_warning_and_the_run_trains_on(two_process_run, data_dir, tmp_path):
    """A real MLflow store (MLFLOW_TRACKING_URI, which wins over --output_dir's) that takes the run's start
    and then refuses every metric, as a store damaged mid-run does: a trigger of its own raises on each
    insert. Before, that ended the run in MLflow's traceback with no model saved; now MLflow is left out
    with one warning, TensorBoard beside it logs on, and the run ends as the untracked one, bitwise. (This
    test once damaged the file while the run trained: on a busy machine the run sometimes ended first.)"""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = tmp_path / "store.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}").search_experiments()  # MLflow's own tables, made here
    with contextlib.closing(sqlite3.connect(store)) as connection:
        connection.execute("CREATE TRIGGER damaged BEFORE INSERT ON metrics BEGIN SELECT RAISE(ABORT, 'the store is damaged'); END")
        connection.commit()
    output_dir = tmp_path / "tracked"
    result = run(script_command("cpu_gloo.py", "--output_dir", output_dir, "--num_epochs", "2", "--data_dir", data_dir,
                                "--with_tracking", "--report_to", "all", num_processes=2),
                 cwd=tmp_path, env={**script_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{store}"})
    said = result.stderr
    assert "Traceback" not in said
    warnings = [line for line in said.splitlines() if line.startswith("warning: ")]  # said once, though end_training calls finish() too
    assert len(warnings) == 1 and warnings[0].startswith("warning: the mlflow tracker failed (") and warnings[0].endswith(
        "): the run goes on without it, and metrics.jsonl keeps every epoch's record."), said[-3000:]
    with contextlib.closing(sqlite3.connect(store)) as connection:
        assert connection.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,), "the run started in this store"
    assert [record["world_size"] for record in read_metrics(output_dir)] == [2, 2]
    assert_same_weights(weights(two_process_run), weights(output_dir))
    events = EventAccumulator(str(next((output_dir / "tensorboard").iterdir()))).Reload()
    assert [event.step for event in events.Scalars("eval_accuracy")] == [1, 2]


def test_a_tracker_whose_package_the_main_process_lacks_is_named_not_left_out(monkeypatch, tmp_path):
    """A stand-in for an environment without mlflow (this one has it): it assumes only that accelerate's
    own check then says so, as it would there; accelerate would leave the tracker out without a word. The
    main process alone runs the trackers, so it alone checks (another machine may go without the package),
    and every process stops with its sentence (a one-process stand-in here: on_main_process passes it on)."""
    import socket

    from shared import tracking
    from shared.checkpoints import Position
    from shared.errors import UserError

    monkeypatch.setattr(tracking, "is_mlflow_available", lambda: False)
    assert tracking.log_with(True, "all") == ["tensorboard", "mlflow"], "the Accelerator of every process is given both"
    main_process = SimpleNamespace(is_main_process=True, trackers=[])
    with pytest.raises(UserError, match=rf"^--report_to mlflow needs the mlflow package, which is not installed on "
                       rf"{socket.gethostname()}, the main process's machine: pip install mlflow there, or train without --with_tracking\.$") as stop:
        with tracking.starting(main_process, tmp_path, "all", Position()):
            pytest.fail("no tracker starts")
    assert stop.value.every_process
    assert not any(tmp_path.iterdir()), "no tracker's store was made"


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # mlflow's store, under SQLAlchemy 2.1
def test_mlflow_naming_its_run_leaves_the_runs_random_state_as_it_was(monkeypatch, tmp_path):
    """MLflow draws its run's name (accelerate's init_trackers gives none) from Python's random: a copy of a template
    that draws from it (an augmentation) would train otherwise, and resume otherwise, with --with_tracking. The real
    mlflow.start_run, inside tracking.starting as the scripts' init_trackers is (the main process, a one-process stand-in)."""
    import random

    import mlflow

    from shared import tracking
    from shared.checkpoints import Position

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")  # where starting() would set it, undone after
    outer = random.getstate()  # this test process's own, put back after
    try:
        random.seed(0)
        seeded = random.getstate()
        with tracking.starting(SimpleNamespace(is_main_process=True, trackers=[]), tmp_path, "mlflow", Position()):
            mlflow.start_run()
            mlflow.end_run()
            inside = random.getstate()
        assert inside != seeded, "mlflow drew from Python's random: else this test proves nothing"
        assert random.getstate() == seeded
    finally:
        random.setstate(outer)


@pytest.mark.parametrize("hook", ["fp16", "power_sgd"])
def test_a_communication_hook_compresses_what_ddp_sends(hook, two_process_run, data_dir, tmp_path):
    """fp16 rounds every averaged gradient to half precision; PowerSGD sends a rank-1 approximation with
    error feedback. Either changes the weights (the hook is in use) and still learns."""
    hooked, _ = train("cpu_gloo.py", tmp_path, hook, "--num_epochs", "2", "--ddp_comm_hook", hook, num_processes=2, data_dir=data_dir)
    plain, compressed = weights(two_process_run), weights(hooked)
    assert any(not (plain[key] == compressed[key]).all() for key in plain)
    records = read_metrics(hooked)
    assert records[-1]["train_loss"] < records[0]["train_loss"] and records[-1]["eval_accuracy"] > 0.9


def test_early_stopping_target_stops_every_process_after_the_same_epoch(data_dir, tmp_path):
    stopped, result = train("cpu_gloo.py", tmp_path, "stopped", "--num_epochs", "10", "--early_stopping_target", "0.9",
                            num_processes=2, data_dir=data_dir)
    records = read_metrics(stopped)
    assert len(records) < 10 and records[-1]["eval_accuracy"] >= 0.9 > max((r["eval_accuracy"] for r in records[:-1]), default=0)
    assert f"Stopped early after epoch {len(records)}: eval_accuracy {records[-1]['eval_accuracy']:.4f} reached " \
           "--early_stopping_target 0.9." in result.stdout
    assert (stopped / "model.safetensors").exists()


def test_early_stopping_patience_and_a_resumed_run_remember_the_epochs_without_improvement(data_dir, tmp_path):
    """With --lr 5 the linear net drives eval loss to its floor at once, after which it stops improving.
    A run stopped and resumed between stops where the uninterrupted one stops, with the same records."""
    flags = ["--data_dir", data_dir, "--lr", "5", "--early_stopping_patience", "2", "--checkpointing_steps", "epoch"]
    whole, result = train("cpu_gloo.py", tmp_path, "whole", *flags, "--num_epochs", "10")
    records = read_metrics(whole)
    best = min(records, key=lambda record: record["eval_loss"])["epoch"]
    assert records[-1]["epoch"] == best + 2 < 10 and records[-1]["epoch"] >= 3
    assert f"Stopped early after epoch {best + 2}: eval_loss has not improved for 2 epochs" in result.stdout
    # The same command again, as a requeued or restarted job would run it: the run is finished.
    again = run(python_command("cpu_gloo.py", "--output_dir", whole, *flags, "--num_epochs", "10", "--resume_from_checkpoint", "latest"),
                cwd=tmp_path, check=False)
    assert again.returncode == 1 and f"error: The run in {whole} has stopped early by these flags, after epoch {best + 2} (eval_loss has not " \
        "improved for 2 epochs" in again.stderr, again.stderr[-2000:]
    assert read_metrics(whole) == records

    resumed = tmp_path / "resumed"
    path = resume_from(whole, "step_00000064", resumed)  # after epoch 2
    train("cpu_gloo.py", tmp_path, "resumed", *flags, "--num_epochs", "10", "--resume_from_checkpoint", path)
    assert_same_records(records, read_metrics(resumed), rel=1e-6)

    # Killed after the stopping epoch's record but before its model: no checkpoint was saved after that
    # epoch, so the resume trains it again and stops where the run stopped (before, it trained on).
    shutil.copytree(whole, tmp_path / "killed")
    (tmp_path / "killed" / "model.safetensors").unlink()
    killed, _ = train("cpu_gloo.py", tmp_path, "killed", *flags, "--num_epochs", "10", "--resume_from_checkpoint", "latest")
    assert_same_records(records, read_metrics(killed), rel=1e-6)
    assert_same_weights(weights(whole), weights(killed))


def test_a_run_stopped_early_is_finished_whatever_its_newest_checkpoint(data_dir, tmp_path):
    """Its newest checkpoint a step checkpoint inside the epoch it stopped after: running it again still
    says it stopped early (before, the resume cut that epoch's record first and trained it again)."""
    flags = ["--data_dir", data_dir, "--lr", "5", "--early_stopping_patience", "2", "--checkpointing_steps", "20", "--num_epochs", "10"]
    whole, _ = train("cpu_gloo.py", tmp_path, "whole", *flags)
    records = read_metrics(whole)
    newest = read_state(checkpoints_in(whole / "checkpoints")[-1])
    assert newest["epoch"] == records[-1]["epoch"] and 0 < newest["batches_done"] < newest["batches_per_epoch"]
    again = run(python_command("cpu_gloo.py", "--output_dir", whole, *flags, "--resume_from_checkpoint", "latest"), cwd=tmp_path, check=False)
    assert again.returncode == 1 and f"error: The run in {whole} has stopped early by these flags, after epoch {records[-1]['epoch']}" in again.stderr
    assert read_metrics(whole) == records
