"""Parameter counts: the K3 release totals and the Kimi Linear preset against transformers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.model import get_preset
from k3.model.hf_kimi import config_from_hf
from k3.model.params import count_parameters

REPO = Path(__file__).resolve().parents[2]
RELEASED = REPO / "model" / "data" / "kimi_linear_48b_a3b_config.json"


def test_k3_totals_within_half_a_percent():
    c = count_parameters(get_preset("k3"))
    assert abs(c.total / 2.779e12 - 1) <= 0.005, c.total
    assert abs(c.active / 104.2e9 - 1) <= 0.005, c.active


def test_small_and_tiny_sizes():
    assert 100e6 <= count_parameters(get_preset("k3-small")).total <= 900e6
    assert 1e6 <= count_parameters(get_preset("k3-tiny")).total <= 10e6


def test_kimi_linear_preset_equals_transformers_on_meta():
    transformers = pytest.importorskip("transformers")
    hf_json = json.loads(RELEASED.read_text())
    hf_cfg = transformers.KimiLinearConfig(**hf_json)
    with torch.device("meta"):
        hf_model = transformers.KimiLinearForCausalLM(hf_cfg)
    hf_total = sum(p.numel() for p in hf_model.parameters())
    ours = count_parameters(get_preset("kimi-linear-48b-a3b")).total
    assert ours == hf_total, f"k3 {ours:,} vs transformers {hf_total:,}"
    assert config_from_hf(hf_json) == get_preset("kimi-linear-48b-a3b")


def test_cli_params_json():
    out = subprocess.run([sys.executable, "-m", "k3.platform.ops.cli", "params", "--preset", "k3", "--json"],
                         capture_output=True, text=True, check=True, cwd=REPO)
    d = json.loads(out.stdout)
    assert d["preset"] == "k3" and abs(d["total"] / 2.779e12 - 1) < 0.005
    assert "input embedding" in d["note"]
    bad = subprocess.run([sys.executable, "-m", "k3.platform.ops.cli", "params", "--preset", "nope"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode != 0 and "nope" in bad.stderr
