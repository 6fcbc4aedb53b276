"""The benchmarks' own commands at their smallest: every variant runs and the tables come out.

No timing is asserted (benchmarks/RESULTS.md holds the measurements); this keeps the commands that
produced them working.
"""

import json
import sys

from conftest import REPO, run

BENCHMARKS = REPO / "benchmarks"


def test_throughput_benchmark_measures_every_variant(tmp_path):
    result = run([sys.executable, BENCHMARKS / "throughput.py", "--scripts", "cpu_gloo.py", "--processes", "1",
                  "--repeats", "1", "--num_epochs", "2", "--train_samples", "2000", "--output", tmp_path / "throughput"], cwd=REPO)
    sys.path.insert(0, str(BENCHMARKS))
    from throughput import COLUMNS

    (row,) = json.loads((tmp_path / "throughput.json").read_text())
    assert (row["script"], row["processes"], row["batch_size"]) == ("cpu_gloo.py", 1, 64)
    assert all(row["rounds"][0][name] > 0 for name in COLUMNS), row
    assert (tmp_path / "throughput.png").stat().st_size > 0
    rows = [line for line in result.stdout.splitlines() if line.startswith("| cpu_gloo.py | 1 |")]
    assert len(rows) == 2, result.stdout  # one row of figures, one of ratios


def test_step_overhead_benchmark_times_every_loop():
    result = run([sys.executable, BENCHMARKS / "step_overhead.py", "--processes", "1", "2", "--blocks", "1", "--steps", "5"], cwd=REPO)
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 8, result.stdout  # four loops at each of the two process counts
