"""The tests' `python scripts/X.py` runs are forks of the test process (conftest.run), to save each
the 3 s of importing torch and the rest: a fork ends as a new interpreter does."""

import pytest

from conftest import python_command, read_metrics, run
from test_features import assert_same_records, assert_same_weights, weights


@pytest.mark.parametrize("flags", [["--batch_size", "abc"], ["--dataset_source", "hub"]], ids=["bad flag", "Hub offline"])
def test_a_forked_run_fails_as_a_new_interpreter_would(flags, tmp_path):
    command = python_command("cpu_gloo.py", "--output_dir", tmp_path / "run", *flags)
    forked = run(command, cwd=tmp_path, check=False)
    fresh = run(command, cwd=tmp_path, check=False, new_interpreter=True)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr == fresh.stderr and forked.stderr.startswith("error: ")


def test_a_forked_run_trains_as_a_new_interpreter_would(data_dir, tmp_path):
    runs = {}
    for name, new_interpreter in (("forked", False), ("fresh", True)):
        runs[name] = tmp_path / name
        run(python_command("cpu_gloo.py", "--data_dir", data_dir, "--output_dir", runs[name], "--num_epochs", "1",
                           "--checkpointing_steps", "epoch"), cwd=tmp_path, new_interpreter=new_interpreter)
    files = {name: sorted(path.relative_to(folder) for path in folder.rglob("*")) for name, folder in runs.items()}
    assert files["forked"] == files["fresh"]
    assert_same_weights(weights(runs["forked"]), weights(runs["fresh"]))
    assert_same_records(read_metrics(runs["forked"]), read_metrics(runs["fresh"]))
