"""`k3 plan`'s traffic lines against a real two-rank run (jobs/bench_plan.py as a user runs it):
the context-parallel exchange counted at `ContextParallel.gather` (forward, recompute and the
backward's reduce-scatter) and ZeRO's parameter all-gather counted at deepspeed.comm, each beside
the planner's bytes. The full table (longer sequences, peak memory) is the benchmark."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_cp_exchange_and_parameter_all_gather_are_what_the_planner_says(tmp_path):
    out = tmp_path / "plan.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(REPO / "jobs" / "bench_plan.py"), "--cases", "2x1x512:ckpt:cp2",
                          "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    case = json.loads(out.read_text())["cases"][0]
    assert case["cp"] == 2 and case["checkpointing"]
    # measured: what the gathers sent, per rank and step; the planner's cp_exchange for the layout
    assert case["cp_exchange_measured_per_step"] > 0
    assert abs(case["cp_exchange_error"]) < 0.15, case
    for rank in case["ranks"]:
        tally = rank["collective_payload_bytes_2_steps"]
        assert tally["cp_check"] == 2 * 2 * 8  # the group's batch check: two int64, two steps, not planned
        # ZeRO-1 gathers the updated dense parameters once a step: the planner's payload exactly
        assert tally["deepspeed.all_gather_into_tensor"] == 2 * case["predicted"]["grad_payloads"]["dense_parameters"]


@pytest.mark.parametrize("case, says", [
    ("2x1x512:ckpt:cp0", "only cpC (C a positive integer)"),
    ("2x1x512:ckpt:cp3", "cp3 must divide the world size (2)"),
    ("2x1x513:full:cp2", "and the sequence length (513)"),
    ("2x1:ckpt", "WORLDxMICRO_BATCHxSEQ_LEN"),
    ("2x1x512:fast", "ckpt or full, got 'fast'"),
    ("2x1x512", "ckpt or full, got ''"),
])
def test_a_bad_case_is_refused_before_any_case_runs(case, says):
    # the good case first: it must not start (a bad case late in the list is found before it)
    run = subprocess.run([sys.executable, str(REPO / "jobs" / "bench_plan.py"), "--cases", f"1x1x64:ckpt,{case}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr and not run.stdout, (run.returncode, run.stderr[-2000:])
