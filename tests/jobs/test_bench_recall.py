"""jobs/bench_recall.py as a user runs it: a shallower layer pattern for the three variants, the
result JSON the report reads, and a bad pattern refused before any training. Whether a variant
learns the task is the benchmark's to show (docs/benchmarks.md), not a test's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "jobs" / "bench_recall.py")
TINY = ["--train-len", "32", "--pairs", "2", "--keys", "16", "--values", "16", "--filler", "16", "--batch", "4",
        "--steps", "2", "--warmup", "1", "--eval-mults", "1,2", "--eval-batches", "1", "--eval-batch", "4"]


def run(*argv: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, SCRIPT, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_layers_set_the_hybrid_pattern_and_the_depth_of_the_others(tmp_path):
    kinds = {}
    for variant in ("hybrid", "all_mla"):
        out = tmp_path / f"{variant}.json"
        done = run("--variant", variant, "--layers", "kda,mla", *TINY, "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(out.read_text())
        kinds[variant] = result["layer_types"]
        assert set(result["eval"]) == {"1", "2"} and result["eval"]["2"]["length"] == 64
        assert all(0.0 <= e["accuracy"] <= 1.0 for e in result["eval"].values())
        assert result["args"]["layers"] == "kda,mla" and len(result["curve"]) == 2
    assert kinds == {"hybrid": ["kda", "mla"], "all_mla": ["mla", "mla"]}
    report = run("--report", str(tmp_path / "hybrid.json"), str(tmp_path / "all_mla.json"))
    assert report.returncode == 0, report.stderr[-3000:]
    assert "| hybrid | 1 KDA + 1 MLA | 2 |" in report.stdout and "| all_mla | 0 KDA + 2 MLA | 2 |" in report.stdout


@pytest.mark.parametrize("layers", ["kda,attention", "", "kda,,mla"])
def test_a_bad_layer_pattern_is_refused_before_training(layers):
    done = run("--variant", "hybrid", "--layers", layers, *TINY)
    assert done.returncode == 2 and "--layers takes kda and mla" in done.stderr and not done.stdout, done.stderr
