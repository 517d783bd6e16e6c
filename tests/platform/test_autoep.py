"""Why k3 keeps its own expert parallelism instead of DeepSpeed's AutoEP (docs/benchmarks.md,
"AutoEP vs k3's expert parallelism"; the probe is jobs/bench_autoep.py).

AutoEP computes LatentMoE exactly only when forced: its supported entry (the preset parser that
`deepspeed.initialize` runs) refuses a layer whose experts run on a narrower width than its
router, its layer routes and dispatches one and the same tensor (no hook for the latent
down-projection in between), and its load-balancing `expert_bias` is refused in this build.
Forced through a hand-written spec and a swapped router, it matches LatentMoE to fp32 round-off,
so exactness does not decide between the routes; these refusals do. If a DeepSpeed upgrade
makes one of the refusal tests fail, re-run the probe and reconsider."""
from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed.module_inject.auto_ep_layer")

import k3.model  # noqa: E402
from k3.jobs.bench_autoep import (  # noqa: E402
    K3_AUTOEP_PATTERN,
    AutoEPLatentMoE,
    _SourceMoE,
    autoep_refusals,
    autoep_spec,
    bench_config,
    build_layer,
    register_situ_glu,
)


@pytest.fixture(autouse=True)
def _one_thread():
    # The machine's other processes own the remaining cores: two OpenMP threads here spin.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(n: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


def _fwd_bwd(fn, x: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    y = fn(xi)
    y.backward(gy)
    return y.detach(), xi.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_autoep_parser_refuses_latent_moe():
    refusals = autoep_refusals(bench_config())
    assert refusals["parser"].startswith("ValueError: hidden_size=64 from expert weights mismatches router "
                                         "weight dim=128"), refusals["parser"]


def test_autoep_refuses_its_load_balancing_expert_bias():
    assert "load_balance_coeff=0.001 is not supported" in autoep_refusals(bench_config())["expert_bias"]


def test_autoep_parser_reads_k3_router_bias_as_a_trainable_gate_bias():
    # Without the latent width the parser accepts k3's layer, but it takes the router's `bias`
    # (QB's selection-only bias) for a bias of the gate's linear map: added to the logits before
    # the sigmoid, so it would change the weights and be trained. The adapter renames it.
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    cfg = bench_config().replace(moe_latent_size=None, num_layers=2, layer_types=["kda", "mla"],
                                 mlp_types=["dense", "moe"])
    specs = AutoEP(k3.model.build(cfg), parse_autoep_config({**K3_AUTOEP_PATTERN, "top_k": 4})).ep_parser()
    assert [s.moe_module_name for s in specs] == ["model.layers.1.mlp"]
    assert specs[0].gate_bias is True


@pytest.mark.parametrize("feed", ["latent", "full"])
def test_autoep_layer_routes_and_dispatches_one_tensor(feed):
    # The missing hook: AutoEPMoELayer hands the same tokens to its router (k3's gate is [E, D])
    # and to its experts (latent width D_e), so neither width runs without the router swap.
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    register_situ_glu()
    cfg = bench_config()
    moe = build_layer(cfg, seed=0)
    layer = AutoEPMoELayer(autoep_spec(cfg), _SourceMoE(moe), 1, 0, AutoEPConfig(enabled=True, use_grouped_mm=False))
    x, _ = _tokens(8, cfg.hidden_size)
    inp = moe.latent_down(x) if feed == "latent" else x
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        layer(inp.unsqueeze(0))


@pytest.mark.parametrize("grouped_mm", [False, True])
def test_forced_autoep_adapter_matches_latent_moe(grouped_mm):
    cfg = bench_config()
    moe = build_layer(cfg, seed=1)
    auto = AutoEPLatentMoE(copy.deepcopy(moe), ep_size=1, ep_rank=0, grouped_mm=grouped_mm)
    assert torch.equal(auto.qb_bias, moe.gate.bias)  # the QB bias, copied into AutoEP's router
    x, gy = _tokens(96, cfg.hidden_size, seed=2)
    y_ref, dx_ref = _fwd_bwd(lambda t: moe(t)[0], x, gy)
    y, dx = _fwd_bwd(auto, x, gy)
    assert _rel(y, y_ref) <= 1e-5 and _rel(dx, dx_ref) <= 1e-5
    pairs = {"router": (auto.layer.router.inner.gate.weight, moe.gate.weight),
             "w_gate": (auto.layer.experts.w1, moe.experts.w_gate),
             "w_up": (auto.layer.experts.w3, moe.experts.w_up),
             "w_down": (auto.layer.experts.w2, moe.experts.w_down),
             "latent_down": (auto.latent_down.weight, moe.latent_down.weight)}
    for name, (a, b) in pairs.items():
        assert _rel(a.grad, b.grad) <= 1e-5, name
