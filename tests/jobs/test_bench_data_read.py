"""jobs/bench_data_read.py as a user runs it: bad counts are refused before Ray starts (its
comparison itself is recorded in docs/benchmarks.md; the read it measures, `data_splits`, is
tested in tests/platform/test_launch.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--workers", "-1"]])
def test_bad_counts_are_refused_before_ray_starts(argv):
    run = subprocess.run([sys.executable, str(REPO / "jobs" / "bench_data_read.py"), *argv], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "--workers and --repeats must be >= 1" in run.stderr and not run.stdout, \
        (run.returncode, run.stderr[-2000:])
