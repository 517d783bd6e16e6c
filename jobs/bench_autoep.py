"""AutoEP vs k3's expert parallelism: one k3-tiny LatentMoE layer, two routes, one JSON line.

    python jobs/bench_autoep.py [--tokens 256] [--repeats 7] [--grouped-mm]

DeepSpeed 0.19 ships AutoEP (`deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer`): a
torchtitan-style token-choice router, grouped experts and an all-to-all dispatch that replace a
model's MoE blocks inside `deepspeed.initialize`. This probe asks whether it can be k3's
expert-parallel layer. Two processes (gloo, ep_size 2, one torch thread each) run the same
LatentMoE weights on the same tokens

  (a) through k3's own route: model/moe.py's LatentMoE with platform/train/expert_parallel.py's all-to-all
      dispatcher installed on rank r's experts [r E/2, (r+1) E/2);
  (b) through AutoEPMoELayer inside a k3 adapter (`AutoEPLatentMoE` below): latent down-projection
      before it, RMSNorm + up-projection and the shared experts after it, SiTU-GLU registered
      with `register_expert_activation`, k3's Quantile-Balancing bias as the router's
      selection-only `e_score_correction_bias`, renormalised top-k times routed scaling;

and prints the largest absolute and relative differences of the outputs and of the gradients
(input, router, latent projections, experts) between (a), (b) and the single-device LatentMoE,
plus the median forward+backward time per call of (a) and (b). Then (`autoep_under_zero`) the
adapter inside a model handed to `deepspeed.initialize` with ZeRO-1 and ZeRO-2 and an active
gradient clip: whether DeepSpeed's expert handling turns on, its gradient norm against the norm
over every parameter computed by hand, and the parameters after one step against the
single-device layer stepped by hand.

It also records where AutoEP's own entry points refuse LatentMoE (`autoep_refusals`): the
preset parser that `deepspeed.initialize` runs, and the load-balancing `expert_bias`. The
adapter in (b) gets past the parser only by building the layer from a hand-written
`MoELayerSpec`, and past the router/expert width split only by swapping AutoEP's router for one
that reads the full-width tokens k3 routes on (`FullWidthRouter`): AutoEPMoELayer routes and
dispatches the same tensor, and LatentMoE routes on x but dispatches W_down x.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time

import torch
from torch import nn

from k3.kernels.situ_glu import situ_glu
from k3.model.config import K3Config, get_preset
from k3.model.moe import Experts, LatentMoE
import k3.model

EXPERT_ACTIVATION = "situ_glu"
# A layer that routes on the hidden width and runs its experts on the latent width, found by the
# same pattern DeepSeek-style presets use (k3's MoE blocks are model.layers.<i>.mlp).
K3_AUTOEP_PATTERN = {
    "enabled": True, "moe_layer_pattern": r"model\.layers\.\d+\.mlp", "router_pattern": "gate",
    "expert_pattern": "experts", "expert_w1": "w_gate", "expert_w2": "w_down", "expert_w3": "w_up",
    "score_func": "sigmoid", "score_apply": "post", "route_norm": True,
}


def bench_config(routed_scaling: float = 1.5) -> K3Config:
    """k3-tiny with a routed scaling other than 1, so the probe exercises it."""
    return get_preset("k3-tiny").replace(routed_scaling=routed_scaling)


def register_situ_glu() -> None:
    """SiTU-GLU as an AutoEP expert activation. AutoEP hands every form two scalars (alpha,
    limit) from the layer spec; SiTU-GLU reads them as its bounds b1, b2. Computed by k3's own
    kernel (fp32 math, Triton on CUDA, the torch path on CPU)."""
    from deepspeed.moe.ep_experts import EXPERT_ACTIVATIONS, register_expert_activation

    if EXPERT_ACTIVATION not in EXPERT_ACTIVATIONS:
        register_expert_activation(EXPERT_ACTIVATION, lambda g, u, b1, b2: situ_glu(g, u, b1, b2),
                                   uses_alpha=True, uses_limit=True)


class _SourceGate(nn.Module):
    """k3's router as AutoEP reads a source gate: `weight` [E, D] and the selection-only bias
    under the name DeepSeek-V3's noaux_tc routing uses (AutoEP copies it into its router)."""

    def __init__(self, moe: LatentMoE) -> None:
        super().__init__()
        self.weight = moe.gate.weight
        self.register_buffer("e_score_correction_bias", moe.gate.bias.detach().clone())


class _SourceMoE(nn.Module):
    def __init__(self, moe: LatentMoE) -> None:
        super().__init__()
        self.gate = _SourceGate(moe)
        self.experts = moe.experts


class FullWidthRouter(nn.Module):
    """AutoEP's router, fed the full-width tokens. AutoEPMoELayer calls `router(x, expert_bias)`
    with the tensor it dispatches; under LatentMoE that is W_down x, while k3 routes on x, so the
    adapter sets `x_full` before each call. Not an AutoEP hook: a swap of its `router` child."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.inner = router
        self.x_full: torch.Tensor | None = None

    def forward(self, x_lat: torch.Tensor, expert_bias: torch.Tensor | None = None):
        if self.x_full is None or self.x_full.shape[0] != x_lat.shape[0]:
            raise RuntimeError("FullWidthRouter: x_full [N, D] must be set for the N tokens being dispatched")
        return self.inner(self.x_full, expert_bias)


def autoep_spec(cfg: K3Config):
    """The MoELayerSpec AutoEP's parser would refuse for a LatentMoE layer, written by hand:
    experts on the latent width, no shared experts inside the layer (k3 runs them on the full
    width, added after the up-projection)."""
    from deepspeed.module_inject.auto_ep_config import MoELayerSpec

    De = cfg.moe_latent_size or cfg.hidden_size
    return MoELayerSpec(
        moe_module_name="mlp", model_family="k3", router_name="gate", experts_name="experts",
        expert_storage="fused_3d", expert_w1_name="w_gate", expert_w2_name="w_down", expert_w3_name="w_up",
        num_experts=cfg.num_experts, top_k=cfg.num_experts_per_token, hidden_size=De,
        ffn_hidden_size=cfg.moe_intermediate_size, score_func="sigmoid", score_apply="post",
        route_norm=cfg.moe_renormalize, gate_bias=False, return_router_logits=False,
        router_logits_capture_target="none", router_logits_capture_index=None,
        router_logits_capture_layer_name=None, has_shared_experts=False, shared_experts_name="",
        route_scale=cfg.routed_scaling, e_score_correction_bias_path="gate",
        expert_activation=EXPERT_ACTIVATION, expert_activation_alpha=cfg.situ_b1,
        expert_activation_limit=cfg.situ_b2)


class AutoEPLatentMoE(nn.Module):
    """A k3 adapter around AutoEPMoELayer: y = shared(x) + W_up RMSNorm(AutoEP(W_down x)), with
    AutoEP's router reading x. Built from a full-width LatentMoE holding all E experts (AutoEP
    slices rank `ep_rank`'s range itself)."""

    def __init__(self, moe: LatentMoE, ep_size: int, ep_rank: int, grouped_mm: bool = False) -> None:
        super().__init__()
        from deepspeed.module_inject.auto_ep_config import AutoEPConfig
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

        if not moe.latent:
            raise ValueError("AutoEPLatentMoE: the LatentMoE must have moe_latent_size set")
        if moe.experts.count != moe.cfg.num_experts:
            raise ValueError(f"AutoEPLatentMoE: needs all {moe.cfg.num_experts} experts, got {moe.experts.count}")
        register_situ_glu()
        self.cfg = moe.cfg
        self.latent_down, self.latent_norm, self.latent_up = moe.latent_down, moe.latent_norm, moe.latent_up
        self.shared_experts = moe.shared_experts if moe.cfg.num_shared_experts else None
        self.layer = AutoEPMoELayer(autoep_spec(moe.cfg), _SourceMoE(moe), ep_size, ep_rank,
                                    AutoEPConfig(enabled=True, autoep_size=ep_size, use_grouped_mm=grouped_mm))
        self.layer.router = FullWidthRouter(self.layer.router)

    @property
    def qb_bias(self) -> torch.Tensor:
        """The selection-only bias the balancer writes (the copy AutoEP's router reads)."""
        return self.layer.router.inner.e_score_correction_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> y [N, D]."""
        self.layer.router.x_full = x
        try:
            u = self.layer(self.latent_down(x).unsqueeze(0)).squeeze(0)  # [N, D_e]
        finally:
            self.layer.router.x_full = None
        y = self.latent_up(self.latent_norm(u))
        return y if self.shared_experts is None else y + self.shared_experts(x)


def k3_ep_moe(moe: LatentMoE, ep_group, ep_size: int, ep_rank: int) -> LatentMoE:
    """The same layer on k3's route: this rank's experts and platform/train/expert_parallel.py's dispatcher."""
    from k3.platform.train.expert_parallel import AllToAllDispatch

    out = copy.deepcopy(moe)
    E = moe.cfg.num_experts
    n = E // ep_size
    out.experts = Experts(moe.cfg, moe.experts.w_gate.shape[-1], moe.experts.layer_idx, first=ep_rank * n, count=n)
    with torch.no_grad():
        for name in ("w_gate", "w_up", "w_down"):
            getattr(out.experts, name).copy_(getattr(moe.experts, name)[ep_rank * n:(ep_rank + 1) * n])
    out.experts.dispatch = AllToAllDispatch(ep_group, ep_size, E)
    return out


def build_layer(cfg: K3Config, seed: int, qb_scale: float = 0.05) -> LatentMoE:
    """One LatentMoE with all experts and a nonzero, centred QB bias (identical on every rank)."""
    torch.manual_seed(seed)
    moe = LatentMoE(cfg, layer_idx=1)
    moe.reset_parameters()
    with torch.no_grad():
        b = torch.randn(cfg.num_experts) * qb_scale
        moe.gate.bias.copy_(b - b.mean())
    return moe


def autoep_refusals(cfg: K3Config) -> dict[str, str]:
    """Where AutoEP's supported entry points refuse k3: the exception text of each."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    out = {}
    model = k3.model.build(cfg.replace(num_layers=2, layer_types=["kda", "mla"], mlp_types=["dense", "moe"]))
    try:
        AutoEP(model, parse_autoep_config({**K3_AUTOEP_PATTERN, "top_k": cfg.num_experts_per_token})).ep_parser()
        out["parser"] = "accepted"
    except ValueError as e:
        out["parser"] = f"ValueError: {e}"
    try:
        parse_autoep_config({**K3_AUTOEP_PATTERN, "load_balance_coeff": 1e-3})
        out["expert_bias"] = "accepted"
    except ValueError as e:
        out["expert_bias"] = f"ValueError: {e}"
    return out


# -- the two-process measurement ----------------------------------------------------------------
def _grads(named: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in named.items()}


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = float((a - b).abs().max())
    return d, d / max(float(b.abs().max()), 1e-30)


def _run(fn, x: torch.Tensor, gy: torch.Tensor, params: list[nn.Parameter]):
    for p in params:
        p.grad = None
    xi = x.detach().clone().requires_grad_(True)
    y = fn(xi)
    y.backward(gy)
    return y.detach(), xi.grad.detach()


def _time(runs: dict, names: list[str], x, gy, repeats: int) -> dict[str, float]:
    """Median forward+backward seconds per route, the routes interleaved call by call (in
    alternating order) so a change in the machine's load falls on both alike."""
    import torch.distributed as dist

    ts: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            fn, params = runs[name]
            dist.barrier()
            t = time.perf_counter()
            _run(fn, x, gy, list(params.values()))
            ts[name].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in ts.items()}


ZERO_CLIP = 0.05  # far below the probe's gradient norm (~46), so the clip is active
ZERO_LR = 0.5


def _zero_step(rank: int, cfg: K3Config, seed: int, stage: int, tokens: int) -> dict:
    """The adapter inside a model handed to deepspeed.initialize (ZeRO `stage`, client SGD,
    gradient clipping on): one step on each rank's tokens against the single-device layer
    stepped by hand with the data-parallel mean gradient and one global clip."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    ref = build_layer(cfg, seed)
    auto = AutoEPLatentMoE(copy.deepcopy(ref), 2, rank)
    model = nn.ModuleDict({"mlp": auto})
    xs = [torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(3000 + r)) for r in range(2)]
    gys = [torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(4000 + r)) for r in range(2)]
    # DeepSpeed splits expert parameters into their own groups only for an optimizer it builds.
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "k3"})
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(groups, lr=ZERO_LR),
        config={"train_micro_batch_size_per_gpu": 1, "gradient_clipping": ZERO_CLIP,
                "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
                "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}})
    engine.backward((engine.module["mlp"](xs[rank]) * gys[rank]).sum())
    engine.step()
    for r in range(2):  # the data-parallel mean of the two ranks' losses
        (ref(xs[r])[0] * gys[r]).sum().div(2).backward()
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters() if p.grad is not None)))
    factor = min(1.0, ZERO_CLIP / (norm + 1e-6))
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= ZERO_LR * factor * p.grad
    n = cfg.num_experts // 2
    sl = slice(rank * n, (rank + 1) * n)
    ex = auto.layer.experts
    pairs = {"w_gate": (ex.w1, ref.experts.w_gate[sl]), "w_up": (ex.w3, ref.experts.w_up[sl]),
             "w_down": (ex.w2, ref.experts.w_down[sl]),
             "router": (auto.layer.router.inner.gate.weight, ref.gate.weight),
             "latent_down": (auto.latent_down.weight, ref.latent_down.weight),
             "shared_gate": (auto.shared_experts.gate_proj.weight, ref.shared_experts.gate_proj.weight)}
    w = ex.w1.detach().contiguous()
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w)
    return {"deepspeed_moe_handling": bool(engine.has_moe_layers),
            "deepspeed_grad_norm": float(engine.get_global_grad_norm()), "hand_grad_norm": norm,
            "clip_factor": factor, "experts_kept_apart": not torch.equal(both[0], both[1]),
            "param_after_step_max_abs_diff": max(float((a.detach() - b).abs().max()) for a, b in pairs.values())}


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from k3.platform.ops.extensions import init_distributed
    from k3.platform.train.expert_parallel import ep_groups

    init_distributed("gloo")  # the ninja every k3 build uses; its build line on stderr
    ep = 2
    cfg = bench_config()
    ref = build_layer(cfg, args.seed)
    k3_moe = k3_ep_moe(ref, ep_groups(rank, 2, ep)[0], ep, rank)
    auto = AutoEPLatentMoE(copy.deepcopy(ref), ep, rank, grouped_mm=args.grouped_mm)
    auto.layer.set_deepspeed_parallelism()  # DeepSpeed's expert groups ep_size_2 (what initialize does)

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, cfg.hidden_size, generator=g)
    gy = torch.randn(args.tokens, cfg.hidden_size, generator=g)
    n = cfg.num_experts // ep
    sl = slice(rank * n, (rank + 1) * n)

    def named(m: nn.Module, experts) -> dict[str, nn.Parameter]:
        d = {"router": m.gate.weight if isinstance(m, LatentMoE) else m.layer.router.inner.gate.weight,
             "latent_down": m.latent_down.weight, "latent_up": m.latent_up.weight}
        d.update(zip(("w_gate", "w_up", "w_down"), experts))
        return d

    runs = {
        "single": (lambda t: ref(t)[0], named(ref, (ref.experts.w_gate, ref.experts.w_up, ref.experts.w_down))),
        "k3": (lambda t: k3_moe(t)[0], named(k3_moe, (k3_moe.experts.w_gate, k3_moe.experts.w_up,
                                                       k3_moe.experts.w_down))),
        "autoep": (auto, named(auto, (auto.layer.experts.w1, auto.layer.experts.w3, auto.layer.experts.w2))),
    }
    res = {}
    for name, (fn, params) in runs.items():
        y, dx = _run(fn, x, gy, list(params.values()))
        grads = _grads(params)
        if name == "single":
            # An EP rank's expert gradients hold every rank's tokens routed to its experts: the
            # reference's counterpart is the all-ranks sum of its full gradients, this rank's slice.
            for k in ("w_gate", "w_up", "w_down"):
                dist.all_reduce(grads[k])
                grads[k] = grads[k][sl]
        res[name] = (y, dx, grads)

    report = {}
    for a, b in (("k3", "single"), ("autoep", "single"), ("autoep", "k3")):
        (ya, dxa, ga), (yb, dxb, gb) = res[a], res[b]
        report[f"{a}_vs_{b}"] = {"out": _diff(ya, yb), "input_grad": _diff(dxa, dxb),
                                 **{k: _diff(ga[k], gb[k]) for k in ga}}
    timing = _time(runs, ["k3", "autoep"], x, gy, args.repeats)
    zero = {f"stage{st}": _zero_step(rank, cfg, args.seed, st, 64) for st in (1, 2)}
    torch.save({"report": report, "timing": timing, "zero": zero}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--repeats", type=int, default=7, help="timed forward+backward calls per route (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grouped-mm", action="store_true",
                   help="AutoEP experts through torch._grouped_mm instead of its per-expert loop")
    args = p.parse_args()

    import tempfile

    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    cfg = bench_config()
    refusals = autoep_refusals(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, args, out), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    import deepspeed

    exact = {}
    for pair, entry in ranks[0]["report"].items():
        exact[pair] = {k: {"max_abs": max(r["report"][pair][k][0] for r in ranks),
                           "max_rel": max(r["report"][pair][k][1] for r in ranks)} for k in entry}
    timing = {k: max(r["timing"][k] for r in ranks) for k in ranks[0]["timing"]}
    print(json.dumps({
        "bench": "autoep", "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "preset": "k3-tiny", "routed_scaling": cfg.routed_scaling, "ep_size": 2, "backend": "gloo",
        "tokens_per_rank": args.tokens, "repeats": args.repeats, "autoep_grouped_mm": args.grouped_mm,
        "exactness": exact,
        "fwd_bwd_ms": {k: round(v * 1e3, 2) for k, v in timing.items()},
        "autoep_over_k3": round(timing["autoep"] / timing["k3"], 3),
        "autoep_under_zero": ranks[0]["zero"],
        "autoep_refusals": refusals,
    }))


if __name__ == "__main__":
    main()
