"""jobs/bench_train.py as a user runs it: an unknown balancing variant is refused before Ray
starts, naming the choices (its runs are recorded in docs/benchmarks.md, "Distributed
pretraining"; what they run is tested in tests/platform/test_qb_training.py and
tests/platform/test_coordinator.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_unknown_method_is_refused_before_ray_starts():
    run = subprocess.run([sys.executable, str(REPO / "jobs" / "bench_train.py"), "--methods", "quantile_hist,qb-3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and not run.stdout, (run.returncode, run.stderr[-2000:])
    assert "--methods: unknown qb-3; choose from quantile_hist, qb-layerwise-one, qb-layerwise-two, qb-two-rounds" in run.stderr
