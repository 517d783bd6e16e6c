"""jobs/bench_long_context.py's bookkeeping (docs/benchmarks.md, "Long-context training"): the
planner's prediction beside each measured step peak, the tables and the plot made of the runs. The
runs themselves (minutes each) are the benchmark, not a test."""
from __future__ import annotations

import json

import pytest

from k3.jobs.bench_long_context import MB, breakdown_table, groups, load_runs, planned, plot, table
from k3.model import get_preset
from k3.platform.ops.plan.planner import count


def rank_row(T: int, C: int, rank: int, step_s: float, peak: int, **extra) -> dict:
    return {"T": T, "C": C, "rank": rank, "tokens": T // C, "step_s": step_s, "tokens_per_s": round(T / step_s, 1),
            "step_peak_mb": peak, "peak_rss_mb": peak + 400, "loss": 8.3, "planned_step_mb": 100} | extra


def test_planned_is_activations_and_gradients_of_a_ranks_tokens():
    cfg = get_preset("k3-tiny")
    c = count(cfg)
    one, two = planned("k3-tiny", 8192, 1), planned("k3-tiny", 8192, 2)
    assert one["parts_mb"]["gradients"] == round((c.dense + c.experts) * 4 / MB)  # fp32, EP 1: every expert
    for plan in (one, two):
        assert abs(sum(plan["parts_mb"].values()) - plan["step_mb"]) <= len(plan["parts_mb"])  # rounding only
    # the planner gives a CP rank what a whole sequence of its T / C tokens costs
    assert two["parts_mb"] == planned("k3-tiny", 4096, 1)["parts_mb"]
    assert abs(one["parts_mb"]["residual_path"] - 2 * two["parts_mb"]["residual_path"]) <= 1  # MiB rounding


def test_table_takes_the_slowest_rank_and_the_largest_peak():
    runs = [rank_row(8192, 2, 0, 10.0, 300), rank_row(8192, 2, 1, 12.5, 350),
            rank_row(4096, 1, 0, 4.0, 200, planned_step_mb=150)]
    lines = table(runs).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| 4,096 | 1 | 4,096 | 4.0 | 1,024 | 200 | 150 | -25% | 600 |"
    assert lines[3] == "| 8,192 | 2 | 4,096 | 12.5 | 655 | 350 | 100 | -71% | 750 |"


def test_a_second_run_of_a_point_replaces_the_first():
    runs = [rank_row(4096, 2, 0, 9.0, 300), rank_row(4096, 2, 1, 9.0, 310),
            rank_row(4096, 2, 0, 5.0, 200), rank_row(4096, 2, 1, 5.0, 210)]
    assert [r["step_peak_mb"] for r in groups(runs)[4096, 2]] == [200, 210]


def test_breakdown_table_shows_linear_and_quadratic_growth():
    runs = [rank_row(T, 1, 0, 1.0, 100, forward_s={"KimiDeltaAttention": T / 1000, "GatedMLA": (T / 1000) ** 2,
                                                  "mlp": 0.5 * T / 1000})
            for T in (4096, 8192)] + [rank_row(8192, 2, 0, 1.0, 100)]
    lines = breakdown_table(runs).splitlines()
    assert len(lines) == 4  # header, rule, a row per T at C = 1
    assert lines[2].startswith("| 4,096 | 4.10 | - | 16.78 | - |")
    assert lines[3] == "| 8,192 | 8.19 | 2.0 | 67.11 | 4.0 | 4.10 | 2.0 |"


def test_load_runs_gives_the_planners_prediction_of_today(tmp_path):
    older = rank_row(4096, 1, 0, 4.0, 200)  # recorded with a prediction of an earlier planner
    oldest = rank_row(8192, 2, 1, 4.0, 200)
    del oldest["planned_step_mb"]  # recorded before the planner existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"preset": "k3-tiny", "runs": [older, oldest]}))
    runs = load_runs(str(path))
    assert [r["planned_step_mb"] for r in runs] == [planned("k3-tiny", 4096, 1)["step_mb"],
                                                    planned("k3-tiny", 8192, 2)["step_mb"]]
    assert runs[0]["planned_step_mb"] != 100


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [rank_row(T, C, r, T / 500, T // 30 // C) for T in (4096, 8192) for C in (1, 2) for r in range(C)]
    plot(runs, str(tmp_path / "lc.png"))
    assert (tmp_path / "lc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
