"""Training memory and traffic per GPU for a DP x CP x EP layout, as k3's trainer runs it.

Layout: the world of `gpus` ranks is DP x CP (context parallelism cuts each sequence into CP
contiguous shards); the routed experts are split over EP consecutive ranks (EP divides the world
and the expert count), every other parameter is held by every rank.

Memory per GPU (one `Memory` line each):
- weights: every dense parameter, plus 1/EP of the routed experts;
- gradients: the dense gradients (ZeRO-1: all of them; ZeRO-2: this rank's 1/world partition),
  the experts' in full (their own AdamW, outside ZeRO: platform/train/ds_adapter.py);
- optimizer: ZeRO's fp32 master copy, fp32 gradient partition and Adam moments of 1/world of the
  dense parameters; the experts' AdamW moments in the parameter dtype, not sharded;
- activations: what the forward keeps for the backward (activations.py) for the rank's
  micro_batch x context / CP tokens, plus the larger of the loss's transient and one sub-layer
  recomputed with its gradients (with activation checkpointing); on the last CP rank, MLA's keys
  over the whole sequence (`activation_parts`).

Traffic per GPU per step, bytes this rank sends (ring collectives: a rank sends (n - 1)/n of the
payload for an all-gather or a reduce-scatter, twice that for an all-reduce):
- all-to-all: each MoE layer's (token, expert) rows that leave the rank ((EP - 1)/EP of them under
  balanced routing) at the latent width, out and back, in the forward, the backward and (with
  checkpointing) the recompute, plus the expert ids of each forward call;
- CP exchange (DESIGN.md, Long context): per KDA layer an all-gather of each shard's (h_ext, M)
  [H, K, V] + [H, K, K] fp32, per MLA layer an all-gather of the shard's latents, each mirrored in
  the backward and repeated by the recompute;
- gradient reduction: ZeRO's reduce-scatter of the dense gradients and all-gather of the updated
  parameters over the world; the experts' all-reduce over their expert-data-parallel group;
- QB histograms: each rank's [MoE layers, E, bins] int32 histogram and [MoE layers, E] int64
  counts to the balance coordinator, the next bias (bias, lo, hi fp32) back.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from k3.model.config import K3Config

from k3.platform.train.context_parallel import piece_problem

from . import activations as act
from .hardware import GPU


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each thing training keeps."""

    name: str
    weight: int
    grad: int
    zero_fp32: int  # ZeRO's fp32 master copy + fp32 gradient partition, per dense parameter it owns
    moments: int  # Adam's two moments per dense parameter (fp32)
    expert_moments: int  # the experts' AdamW moments (parameter dtype)


PRECISIONS = {
    # GPU (TrainConfig.use_gpu): DeepSpeed's bf16 mode casts the model to bf16.
    "bf16": Precision("bf16", weight=2, grad=2, zero_fp32=8, moments=8, expert_moments=4),
    # CPU: an fp32 model; ZeRO still keeps its own fp32 copy and gradient partition.
    "fp32": Precision("fp32", weight=4, grad=4, zero_fp32=8, moments=8, expert_moments=8),
}


@dataclass(frozen=True)
class Layout:
    dp: int
    cp: int
    ep: int

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def __str__(self) -> str:
        return f"DP {self.dp} x CP {self.cp}, EP {self.ep}"


@dataclass(frozen=True)
class Counts:
    """Parameter counts the formulas need (model/params.py owns counting them)."""

    dense: int  # every parameter but the routed experts (vision tower and projector included)
    experts: int  # routed experts, all layers
    active: int  # per token, input embedding excluded (ParamCount.active)


@dataclass
class TrainSetup:
    cfg: K3Config
    counts: Counts
    gpu: GPU
    context: int  # tokens per sequence
    micro_batch: int = 1  # sequences per DP rank per step
    zero_stage: int = 1
    checkpointing: bool = True
    precision: Precision = PRECISIONS["bf16"]
    backend: str = "triton"  # the KDA kernel whose saved tensors count (activations.py)
    qb_bins: int = 256

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {self.zero_stage}")
        for name in ("context", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class TrainPlan:
    layout: Layout
    tokens_per_gpu: int
    memory: dict[str, int]  # weights, gradients, optimizer, activations
    traffic: dict[str, int]  # bytes sent per GPU per step: all_to_all, cp_exchange, grad_reduction, qb_histograms
    seconds: dict[str, float] = field(default_factory=dict)  # traffic over the assumed links, compute at utilisation
    fits: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def seconds_per_sequence(self) -> float:
        """A step's time (traffic and compute, nothing overlapped) per sequence it trains on."""
        return sum(self.seconds.values()) / self.layout.dp

    def as_dict(self) -> dict:
        return asdict(self) | {"layout": str(self.layout), "total_bytes": self.total_bytes}


def static_memory(s: TrainSetup, layout: Layout) -> dict[str, int]:
    """Weights, gradients and optimizer states per GPU."""
    p, c, W = s.precision, s.counts, layout.world
    local_experts = c.experts // layout.ep
    dense_grads = c.dense * p.grad // (W if s.zero_stage == 2 else 1)
    return {
        "weights": c.dense * p.weight + local_experts * p.weight,
        "gradients": dense_grads + local_experts * p.grad,
        "optimizer": c.dense * (p.zero_fp32 + p.moments) // W + local_experts * p.expert_moments,
    }


# With activation checkpointing, the backward of one sub-layer holds its recomputed tensors and
# the gradients being built from them: measured 1.3-1.45x the sub-layer's kept bytes on k3-tiny
# (the long-context sweep's slope at 16K-32K tokens, docs/benchmarks.md), not the 2x first assumed.
RECOMPUTE_PEAK = 1.4

def last_rank_reach(s: TrainSetup, layout: Layout) -> int:
    """Key positions the last CP rank's MLA reaches before its own tokens (one document filling
    the sequence, the worst case): 0 without context parallelism."""
    return s.micro_batch * s.context - s.micro_batch * s.context // layout.cp


def activation_parts(s: TrainSetup, layout: Layout) -> dict[str, int]:
    """Activation bytes on the busiest GPU of `layout` by where they come from: the residual path
    (Block AttnRes statistics and merges), the sub-layers' own tensors (without checkpointing),
    the MLA layers' keys over earlier shards (without checkpointing), the loss, and the backward's
    largest transient (the loss's, or one sub-layer recomputed with its gradients).

    Under context parallelism every rank keeps the same for its micro_batch x context / CP tokens
    but for MLA: a rank's keys run from its documents' starts, so the last rank's MLA layers expand
    keys over the whole sequence when one document fills it (the worst case, planned for)."""
    b, cfg = s.precision.weight, s.cfg
    tokens = s.micro_batch * s.context // layout.cp
    reach = last_rank_reach(s, layout)
    layers = act.sublayers(cfg, b, s.backend)
    mla_layers = [layers[2 * i] for i, kind in enumerate(cfg.layer_types) if kind == "mla"]
    span = reach * act.mla_key_span(cfg, b) if mla_layers else 0  # per MLA layer
    # one MLA layer's backward over its reach: the latents, their gradients, one tile's working set
    span_peak = reach * act.mla_key_span_peak(cfg, b) + act.mla_tile_transient(cfg) if reach and mla_layers else 0
    transient = act.loss_transient(cfg, b, tokens)
    if s.checkpointing:
        widest = RECOMPUTE_PEAK * tokens * max(layers)
        if mla_layers:
            widest = max(widest, RECOMPUTE_PEAK * tokens * max(mla_layers) + span_peak)
        transient = max(transient, int(widest))
    else:
        transient = max(transient, span_peak - span)
    return {"residual_path": tokens * act.residuals(cfg, b, s.checkpointing),
            "sublayers": 0 if s.checkpointing else tokens * sum(layers),
            "mla_reach": 0 if s.checkpointing else len(mla_layers) * span,
            "loss": tokens * act.loss(cfg, b), "transient": transient}


def all_to_all_bytes(cfg: K3Config, tokens: int, ep: int, dtype_bytes: int, checkpointing: bool) -> float:
    """Bytes one rank sends through one MoE layer's all-to-alls in a step, under balanced routing:
    (EP - 1)/EP of its tokens' top-k rows leave, and as many arrive to be computed and sent back,
    at the latent width, in the forward, the backward and the recompute; ids and counts go with
    each forward call (platform/train/expert_parallel.py)."""
    passes = 3 if checkpointing else 2
    calls = 2 if checkpointing else 1
    rows = tokens * cfg.num_experts_per_token * (ep - 1) / ep
    width = cfg.moe_latent_size or cfg.hidden_size
    return rows * width * dtype_bytes * 2 * passes + calls * (rows * 8 + (ep - 1) * 8)


def traffic(s: TrainSetup, layout: Layout, tokens: int) -> dict[str, int]:
    """Bytes one GPU sends per step, by kind (see the module docstring)."""
    cfg, b = s.cfg, s.precision.weight
    passes = 3 if s.checkpointing else 2  # forward, backward, recompute
    n_moe, n_kda, n_mla = cfg.mlp_types.count("moe"), cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    a2a = n_moe * all_to_all_bytes(cfg, tokens, layout.ep, b, s.checkpointing)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    ring = layout.cp - 1
    # per KDA layer (h_ext [H, K, V] and M [H, K, K], V = K), per MLA layer the shard's latents
    cp = passes * ring * (n_kda * H * 2 * K * K * 4 + n_mla * tokens * cfg.mla_latent_dim * b)
    W, edp = layout.world, layout.world // layout.ep
    g = grad_payloads(s, layout)
    # a ring reduce-scatter or all-gather sends (n - 1)/n of its payload, an all-reduce twice that
    reduction = (W - 1) / W * (g["dense_gradients"] + g["dense_parameters"]) \
        + 2 * (edp - 1) / edp * g["expert_gradients"]
    qb = n_moe * cfg.num_experts * (4 * s.qb_bins + 8 + 12) if n_moe else 0
    return {"all_to_all": int(a2a), "cp_exchange": int(cp), "grad_reduction": int(reduction),
            "qb_histograms": int(qb)}


def grad_payloads(s: TrainSetup, layout: Layout) -> dict[str, int]:
    """Bytes handed to collectives per step around the optimizer: ZeRO's reduction of the dense
    gradients and all-gather of the updated dense parameters (over the world), the experts'
    gradient all-reduce (over the ranks holding the same experts; none when there is one)."""
    p, c = s.precision, s.counts
    W, edp = layout.world, layout.world // layout.ep
    return {"dense_gradients": c.dense * p.grad if W > 1 else 0,
            "dense_parameters": c.dense * p.weight if W > 1 else 0,
            "expert_gradients": c.experts // layout.ep * p.grad if edp > 1 else 0}


def forward_flops_per_token(cfg: K3Config, active: int, context: int) -> float:
    """Matmul FLOPs of one token's forward at the average causal position of a `context`-token
    sequence: 2 x the active parameters, MLA's scores and values over context / 2 keys, KDA's
    chunkwise form (intra-chunk products over C tokens and three K x V state products per head)."""
    H, dqk, dv = cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim
    mla = 2 * H * (dqk + dv) * (context + 1) / 2
    Hk, K, C = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_chunk_size
    kda = 2 * Hk * (C * 5 * K + 3 * K * K)
    return 2 * active + cfg.layer_types.count("mla") * mla + cfg.layer_types.count("kda") * kda


def plan_layout(s: TrainSetup, layout: Layout, utilisation: float) -> TrainPlan:
    tokens = s.micro_batch * s.context // layout.cp
    memory = static_memory(s, layout) | {"activations": sum(activation_parts(s, layout).values())}
    t = traffic(s, layout, tokens)
    g = s.gpu
    step_flops = (4 if s.checkpointing else 3) * tokens * forward_flops_per_token(s.cfg, s.counts.active, s.context)
    seconds = {
        "all_to_all": t["all_to_all"] / g.link_bytes_s(layout.ep),
        "cp_exchange": t["cp_exchange"] / g.link_bytes_s(layout.cp),
        "grad_reduction": t["grad_reduction"] / g.link_bytes_s(layout.world),
        "compute": step_flops / (g.bf16_flops * utilisation),
    }
    plan = TrainPlan(layout, tokens, memory, t, seconds)
    plan.fits = plan.total_bytes <= g.usable_bytes
    return plan


def layouts(s: TrainSetup, gpus: int, dp: int | None = None, cp: int | None = None,
            ep: int | None = None) -> list[Layout]:
    """Every DP x CP = gpus with CP cutting the context as the trainer does (piece_problem: CP divides
    it and, above 1, leaves each shard KDA's conv window), and EP dividing both the world and the
    expert count; optionally pinned to the given values."""
    out = []
    ways = divisors(gpus)
    for c in ways:
        if piece_problem(c, s.context, s.cfg.kda_conv_size) is not None or (cp is not None and c != cp):
            continue
        d = gpus // c
        if dp is not None and d != dp:
            continue
        for e in ways:
            if s.cfg.num_experts % e == 0 and (ep is None or e == ep):
                out.append(Layout(d, c, e))
    return out


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, found up to its square root."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def best_plan(s: TrainSetup, gpus: int, utilisation: float, **pinned: int | None) -> tuple[TrainPlan | None, list[TrainPlan]]:
    """(the fitting layout that trains the most sequences per second, every layout considered,
    best first; the ones that do not fit by their need)."""
    plans = [plan_layout(s, l, utilisation) for l in layouts(s, gpus, **pinned)]
    if not plans:
        raise ValueError(f"no DP x CP x EP layout of {gpus} GPUs matches {pinned_text(pinned)} (CP must divide the "
                         f"context {s.context} and, above 1, cut it into shards of >= "
                         f"{s.cfg.kda_conv_size - 1} tokens, "
                         f"the KDA conv window, as the trainer does; EP must divide {gpus} and the "
                         f"{s.cfg.num_experts} experts)")
    plans.sort(key=lambda p: (not p.fits, p.seconds_per_sequence if p.fits else p.total_bytes))
    return (plans[0] if plans[0].fits else None), plans


def pinned_text(pinned: dict) -> str:
    given = [f"{k.upper()} {v}" for k, v in pinned.items() if v is not None]
    return ", ".join(given) if given else "any layout"
