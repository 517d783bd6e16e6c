"""Feed-forward blocks: the dense gated MLP and the LatentMoE.

LatentMoE (K3): the router reads the full-width x; routed experts run on a latent projection
x_lat = W_down x; their weighted sum u goes back through RMSNorm and W_up; the fused shared
experts run on the full width:  y = shared(x) + W_up RMSNorm(sum_i w_i E_i(W_down x)).
With `moe_latent_size=None` (Kimi Linear) experts run on x directly and y = shared(x) + sum.

Router: sigmoid scores in fp32 (routing arithmetic in low precision flips expert choices); the
experts are the top-k of score + bias, where the bias is a buffer that balancing sets (it gets
no gradient and never enters the weights); weights are the chosen unbiased scores,
renormalised, times routed_scaling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.grouped_mm import grouped_mm
from k3.kernels.situ_glu import situ_glu, swiglu

from .config import K3Config
from .norm import RMSNorm


def gated_activation(cfg: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if cfg.activation == "situ_glu":
        return situ_glu(gate, up, cfg.situ_b1, cfg.situ_b2)
    return swiglu(gate, up)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense layer and the fused shared experts."""

    def __init__(self, cfg: K3Config, dim: int, intermediate: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(dim, intermediate, bias=False)
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)

    def reset_parameters(self) -> None:
        for m in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(m.weight, std=self.cfg.initializer_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.cfg, self.gate_proj(x), self.up_proj(x)))


@dataclass
class RouterOutput:
    """What one MoE layer's router decided for N tokens, and what balancing needs from it.

    expert_ids [N, top_k] int64; expert_weights [N, top_k] fp32 (renormalised, scaled); scores [N, E] fp32
    sigmoid scores (differentiable: auxiliary-loss baselines use them); counts [E] tokens per
    expert; margins [N, E] fp32 = score - alpha_t, alpha_t the (k+1)-th largest biased score of
    token t (Quantile Balancing's input; detached).
    """

    expert_ids: torch.Tensor
    expert_weights: torch.Tensor
    scores: torch.Tensor
    counts: torch.Tensor
    margins: torch.Tensor


def select_experts(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one definition of expert selection and Quantile Balancing margins.

    scores [N, E], bias [E] -> (expert_ids [N, top_k], margins [N, E] = scores - alpha), alpha_t the
    (k+1)-th largest biased score of token t: token t picks e  <=>  margins[t, e] + bias[e] > 0.
    """
    top_vals, top_idx = (scores + bias.to(scores.dtype)).topk(top_k + 1, dim=-1)
    return top_idx[:, :top_k], scores - top_vals[:, top_k:]


def tokens_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the expert ids (any shape, any integer dtype, each in [0, num_experts)) name
    each expert: [E] int64. A scatter_add, not a bincount: its length does not depend on the values,
    so a traced graph keeps it as one fused loop (a bincount is data-dependent, and inductor has no
    C++ shim for it); an id outside the range is an index error, not a longer result."""
    flat = ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


class Router(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_token  # k of the routing math (platform/balance/quantile.py)
        self.num_experts = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        # Selection-only bias, set by the balancer between steps; a buffer so no optimizer sees it.
        self.register_buffer("bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        # Set only inside K3Model.solving_router_bias: called with this layer's routing under the
        # bias in hand, it returns the bias this layer routes with from then on (or None: keep it).
        self.rebias = None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.initializer_range)
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x: [N, D] -> RouterOutput."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        with torch.no_grad():
            idx, margins = select_experts(scores.detach(), self.bias.float(), self.top_k)
            counts = tokens_per_expert(idx, self.num_experts)
            if self.rebias is not None and (bias := self.rebias(RouterOutput(idx, None, scores, counts, margins))) is not None:
                self.bias.copy_(bias)
                idx, margins = select_experts(scores.detach(), self.bias.float(), self.top_k)
                counts = tokens_per_expert(idx, self.num_experts)
        w = scores.gather(1, idx)
        if self.cfg.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return RouterOutput(idx, w * self.cfg.routed_scaling, scores, counts, margins)


# Eagerly a token's experts are copied out before they are read: worth it while the copy is small.
EAGER_GATHER_BYTES = 2 << 20
# A compiled graph traced at up to this many tokens reads by index, while one token's experts
# weigh at most COMPILED_TOKEN_BYTES (larger ones fall behind from 16 tokens, which a decode graph
# traced at 2 still serves).
COMPILED_TOKENS = 64
COMPILED_TOKEN_BYTES = 32 << 20


def read_by_index(x: torch.Tensor, token_bytes: int) -> bool:
    """Whether the routed experts read each token's weights by index (`Experts.by_index`) rather
    than group the tokens by expert (`Experts.grouped`), for inference on a CPU; `token_bytes`:
    the weights of one token's k experts.

    The grouped path pays a fixed cost per call (the sort, three opaque grouped calls of a
    matmul per expert, the scatter back); reading by index moves the experts' weights once per
    (token, slot) row instead of once per expert. Side by side on one thread (docs/benchmarks.md):
    compiled, inductor reads the weights in place in fused loops, and by index was ahead at 1 and
    8 tokens for every expert size tried (top-2 of 8 experts 256 x 128: 30 against 114 us a layer
    at 1 token, 79 against 188 at 8; top-8 of 32 experts 2048 x 768, 144 MB a token: 4.3 against
    8.7 ms at 1 token, 37.6 against 48.7 at 8, but 61.5 against 52.5 at 16), to 32 tokens for
    experts of up to 24 MB a token (even there), and for kimi8's experts up to 64 tokens (383
    against 482 us), 10% behind at 128 and 30% at 256. Eagerly the k experts are copied first,
    which pays for one token while the copy is small (0.75 MB: 101 against 132 us; 1.5 MB: 162
    against 184; 6 MB: 525 against 247). So: in a compiled inference graph on a CPU traced at up to
    `COMPILED_TOKENS` tokens of experts up to `COMPILED_TOKEN_BYTES` (the engine's decode graphs are
    traced at 1 and 2 sequences and serve up to `max_num_seqs`, 16 by default; a compiled forward of
    a long sequence stays grouped, also once dynamo makes its length dynamic), and eagerly for a
    single token up to `EAGER_GATHER_BYTES`; never with autograd on (the weights' gradient would be
    a scatter per row) nor on a GPU (grouped bf16 GEMMs there)."""
    if torch.is_grad_enabled() or x.device.type != "cpu":
        return False
    if torch.compiler.is_dynamo_compiling():
        # The count the graph is traced at, read without a guard (both paths compute the same
        # function, so a later call of another count only runs at the other's speed); symbolic_shapes
        # is loaded while compiling (importing it with this module costs ~0.5 s).
        return token_bytes <= COMPILED_TOKEN_BYTES and \
            torch.fx.experimental.symbolic_shapes.optimization_hint(x.shape[0]) <= COMPILED_TOKENS
    return x.shape[0] == 1 and token_bytes <= EAGER_GATHER_BYTES


class Experts(nn.Module):
    """Routed experts [first, first + count) of E, as stacked weights: gate/up [count, I, D_e],
    down [count, D_e, I]. A single device holds all E; under expert parallelism each rank builds
    only its own range, and `dispatch` (set from outside, e.g. k3.platform.train.expert_parallel) moves tokens to
    the rank that owns their expert and back."""

    def __init__(self, cfg: K3Config, dim: int, layer_idx: int = 0, first: int = 0, count: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        self.first = first
        self.count = E - first if count is None else count
        if not (0 <= first and first + self.count <= E and self.count >= 1):
            raise ValueError(f"experts [{first}, {first + self.count}) is not a range inside [0, {E})")
        self.w_gate = nn.Parameter(torch.empty(self.count, I, dim))
        self.w_up = nn.Parameter(torch.empty(self.count, I, dim))
        self.w_down = nn.Parameter(torch.empty(self.count, dim, I))
        self.dispatch = None
        self.init_seed = 0

    def reset_parameters(self) -> None:
        # One draw from the global RNG per layer, then a generator per (layer, expert): every
        # expert gets the same values whichever rank builds it and however many others exist.
        self.init_seed = int(torch.randint(0, 2**31 - 1, ()))
        std = self.cfg.initializer_range
        with torch.no_grad():
            for local in range(self.count):
                g = torch.Generator().manual_seed(self.init_seed * 1_000_003 + self.first + local)
                for w in (self.w_gate, self.w_up, self.w_down):
                    w[local].copy_(torch.randn(w.shape[1:], generator=g) * std)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e on x [n, D_e]."""
        h = gated_activation(self.cfg, x @ self.w_gate[e].T, x @ self.w_up[e].T)
        return h @ self.w_down[e].T

    def grouped(self, x: torch.Tensor, local_ids: torch.Tensor, per_row: int = 1) -> torch.Tensor:
        """Each row r of x [n / per_row, D_e] repeated per_row times (row r // per_row for the r-th
        of local_ids [n]) through its local expert: rows sorted by expert, gathered straight in that
        order, every expert's rows in one grouped matmul per weight (k3.kernels.grouped_mm: no
        padding, no host sync), returned [n, D_e] in the original order. With no row for any local
        expert (routing collapsed onto other ranks' experts) the result is empty but stays in the
        autograd graph of x and the weights, so every rank runs the same backward collectives."""
        order = local_ids.argsort(stable=True)
        # index_select, not x[order]: the same gather in a quarter of the time on CPU, and its
        # backward (an index_add) faster than advanced indexing's (an accumulating index_put)
        xs = x.index_select(0, order if per_row == 1 else order.div(per_row, rounding_mode="floor"))
        offs = tokens_per_expert(local_ids, self.count).cumsum(0).to(torch.int32)
        g = grouped_mm(xs, self.w_gate.transpose(1, 2), offs)
        u = grouped_mm(xs, self.w_up.transpose(1, 2), offs)
        ys = grouped_mm(gated_activation(self.cfg, g, u), self.w_down.transpose(1, 2), offs)
        if torch.is_grad_enabled() and ys.requires_grad:  # its backward a gather (an index_select's a scatter)
            return torch.empty_like(ys).index_copy_(0, order, ys)  # in place: the out-of-place copies the empty first
        # with nothing to differentiate, a gather by the inverse permutation: ~3x faster on CPU
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return ys.index_select(0, inverse)

    def by_index(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`forward` with each token's k experts read by index: no sort, no grouped call, and
        every (token, slot) row reads its expert's three matrices (a compiled graph reads them
        in place inside fused C++ loops; eagerly they are gathered first)."""
        N, top_k = idx.shape
        e = idx.reshape(-1) - self.first
        xr = x[:, None, :].expand(N, top_k, x.shape[-1]).reshape(N * top_k, x.shape[-1])
        h = gated_activation(self.cfg, torch.einsum("rd,rid->ri", xr, self.w_gate[e]),
                             torch.einsum("rd,rid->ri", xr, self.w_up[e]))
        ys = torch.einsum("ri,rdi->rd", h, self.w_down[e]).view(N, top_k, -1)
        return (ys * weight[..., None].to(ys.dtype)).sum(1).to(x.dtype)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [N, D_e]; idx (global expert ids), weight: [N, k] -> sum_k weight * expert(x): [N, D_e]."""
        if self.dispatch is not None:
            return self.dispatch(self, x, idx, weight)
        if read_by_index(x, idx.shape[1] * 3 * (self.w_gate.numel() // self.count) * self.w_gate.element_size()):
            return self.by_index(x, idx, weight)
        # the (token, slot) rows, each gathered straight from its token; the outputs weighted and a
        # token's k added in slot order (the sums of an index_add over the rows, without its scatter)
        N, k = idx.shape
        ys = self.grouped(x, idx.reshape(-1) - self.first, per_row=k).view(N, k, -1)
        w = weight[..., None].to(ys.dtype)
        ys = ys * w if torch.is_grad_enabled() else ys.mul_(w)  # a fresh tensor: in place unless autograd needs it
        out = ys[:, 0]
        for slot in range(1, k):
            out = out + ys[:, slot]
        return out.to(x.dtype)

    def forward_loop(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Readable reference: for each expert, gather its tokens, run it, add back weighted."""
        out = torch.zeros_like(x)
        for e in range(self.count):
            tok, slot = torch.where(idx == self.first + e)
            if tok.numel():
                out.index_add_(0, tok, (self.expert(e, x[tok]) * weight[tok, slot, None]).to(x.dtype))
        return out


def is_expert_param(name: str) -> bool:
    """Routed-expert tensors by their name in a K3 model (stacked per layer, dim 0 = the expert axis)."""
    return ".mlp.experts." in name


def shard_experts(model: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Every MoE layer of `model` keeps only expert-parallel rank `ep_rank`'s experts. The
    placement is checked even when no layer is MoE."""
    check_expert_parallel(ep_rank, ep_size)
    for m in model.modules():
        if isinstance(m, LatentMoE):
            m.keep_experts(ep_rank, ep_size)


def require_all_experts(model: nn.Module) -> None:
    """A checkpoint holds every routed expert: refuse a model that holds only a rank's range."""
    for m in model.modules():
        if isinstance(m, LatentMoE) and m.experts.count != m.cfg.num_experts:
            e = m.experts
            raise ValueError(f"layer {e.layer_idx} holds experts [{e.first}, {e.first + e.count}) of "
                             f"{m.cfg.num_experts}: save a model with every expert (loaded with ep_size=1)")


def check_expert_parallel(ep_rank: int, ep_size: int) -> None:
    """ep_rank and ep_size are integers with 0 <= ep_rank < ep_size."""
    for name, v in (("ep_rank", ep_rank), ("ep_size", ep_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must lie in [0, ep_size={ep_size}) with ep_size >= 1")


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """(first, count) of the routed experts expert-parallel rank `ep_rank` of `ep_size` holds:
    the contiguous range [rank E / ep, (rank + 1) E / ep)."""
    check_expert_parallel(ep_rank, ep_size)
    if num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide num_experts={num_experts}")
    n = num_experts // ep_size
    return ep_rank * n, n


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.latent = cfg.moe_latent_size is not None
        De = cfg.moe_latent_size if self.latent else D
        self.gate = Router(cfg)
        self.experts = Experts(cfg, De, layer_idx)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, D, cfg.moe_intermediate_size * cfg.num_shared_experts)
        if self.latent:
            self.latent_down = nn.Linear(D, De, bias=False)
            self.latent_norm = RMSNorm(De, cfg.rms_norm_eps)
            self.latent_up = nn.Linear(De, D, bias=False)

    def keep_experts(self, ep_rank: int, ep_size: int) -> None:
        """Hold only expert-parallel rank `ep_rank`'s experts (`expert_range`). On the meta device
        (a model being assembled) the new range is empty; otherwise its weights are the current
        experts' rows for that range, which must hold it."""
        first, count = expert_range(self.cfg.num_experts, ep_rank, ep_size)
        old = self.experts
        if not old.first <= first or first + count > old.first + old.count:
            raise ValueError(f"layer {old.layer_idx} holds experts [{old.first}, {old.first + old.count}), not the "
                             f"range [{first}, {first + count}) of ep_rank {ep_rank}")
        with torch.device(old.w_gate.device):
            new = Experts(self.cfg, old.w_gate.shape[-1], old.layer_idx, first=first, count=count)
        if not old.w_gate.is_meta:
            rows = slice(first - old.first, first - old.first + count)
            with torch.no_grad():
                for name in ("w_gate", "w_up", "w_down"):
                    getattr(new, name).copy_(getattr(old, name)[rows])
            new.init_seed = old.init_seed
        self.experts = new

    def reset_parameters(self) -> None:
        self.gate.reset_parameters()
        self.experts.reset_parameters()
        if self.cfg.num_shared_experts:
            self.shared_experts.reset_parameters()
        if self.latent:
            nn.init.normal_(self.latent_down.weight, std=self.cfg.initializer_range)
            nn.init.normal_(self.latent_up.weight, std=self.cfg.initializer_range)
            self.latent_norm.reset_parameters()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        """x: [..., D] -> (y [..., D], router output over the flattened tokens)."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        r = self.gate(xt)
        xe = self.latent_down(xt) if self.latent else xt
        u = self.experts(xe, r.expert_ids, r.expert_weights)
        y = self.latent_up(self.latent_norm(u)) if self.latent else u
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(xt)
        return y.reshape(shape), r
