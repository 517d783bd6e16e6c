"""Expert load balancing for the MoE router: Quantile Balancing (QB) and the baselines.

The router selects the top-k experts of (s + b) per token, s = sigmoid scores [N, E] in fp32 and
b [E] a bias that never receives gradients. QB sets b from the margins of a batch:

    alpha_t   = (k+1)-th largest of (s_t + b)             per token, under the bias in use
    m_te      = s_te - alpha_t                            token t picks e  <=>  m_te + b_e > 0
    -b_new_e  = a threshold with q = N k / E margins above it, per expert
    b_new    -= mean(b_new)                               centring; top-k is shift invariant

and b_new is used from the next batch on: the batch it was computed from never sees it.
The exact solve puts the threshold half-way between the q-th and (q+1)-th largest margin
(DESIGN.md says "the (q+1)-th largest": it selects the same q tokens of the batch, but a
threshold sitting exactly on a margin ties that token with its (k+1)-th expert, and with those
ties the iteration can stall unbalanced). The histogram solve bins every expert's margins into
fixed bins, sums the histograms over workers and scans each row from the top until q is reached;
it is within one bin of the exact solve and its traffic does not grow with the token count.

Everything here works on plain tensors (scores, margins, bias, histograms), so neither the model
nor the Ray coordinator (k3.platform.balance.coordinator) is needed to use or test it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from k3.kernels.qb_histogram import qb_histogram
from k3.model.moe import select_experts

METHODS = ("quantile", "quantile_hist", "loss_free", "aux_loss", "none")


class BalanceConfig(BaseModel):
    """How a model balances its routed experts. Loadable from YAML/JSON (`BalanceConfig(**d)`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal[METHODS] = Field(
        "quantile_hist",
        description="quantile: exact QB on one process's margins; quantile_hist: QB from margin "
        "histograms (what the distributed coordinator runs); loss_free: DeepSeek-V3 sign update of "
        "the bias; aux_loss: Switch auxiliary loss added to the training loss (bias stays zero); "
        "none: plain top-k.",
    )
    bins: int = Field(256, ge=2, description="quantile_hist: bins per expert in each margin histogram.")
    range_policy: Literal["follow", "fixed"] = Field(
        "follow",
        description="quantile_hist: 'follow' gives expert e the window -b_e +- w (its current selection "
        "boundary), w per layer adapted to how far the thresholds moved; 'fixed' uses fixed_range for all.",
    )
    fixed_range: tuple[float, float] = Field((-1.0, 1.0), description="quantile_hist, range_policy='fixed': [lo, hi) of every histogram.")
    init_halfwidth: float = Field(1.0, gt=0, description="'follow': first half-width w; 1.0 covers every margin of sigmoid scores at b = 0.")
    min_halfwidth: float = Field(1e-4, gt=0, description="'follow': w never shrinks below this.")
    max_halfwidth: float = Field(4.0, gt=0, description="'follow': w never grows beyond this.")
    fine_pass: bool = Field(
        False,
        description="quantile_hist: bin the margins a second time inside the bin each threshold fell "
        "in (same bin count), dividing the error by `bins`. Single-process Balancer only for now.",
    )
    gain: Literal["one", "adaptive"] = Field(
        "one",
        description="QB update b <- b + g (b_solve - b). 'one' (g = 1) is the algorithm of DESIGN.md. "
        "'adaptive' sets g = clip(1 - 1/z2, min_gain, 1), z2 = mean over experts of "
        "(load - q)^2 / (q (1 - k/E)) on the batch just seen: g is 1 while loads are far off and "
        "drops once they are within sampling noise, which averages the solve over batches.",
    )
    min_gain: float = Field(0.1, gt=0, le=1, description="gain='adaptive': lower bound of g.")
    margins_after_step: bool = Field(
        True,
        description="quantile/quantile_hist in the training job: solve from the margins of a no-grad forward of "
        "the step's batch under the weights the optimizer step just produced (one extra forward per step), not "
        "from the training forward's. The bias is then solved for the router (and router inputs) that will use "
        "it; at high learning rates the deep layers' routers move more per step than their tokens differ, and "
        "a bias solved for the previous weights lets them collapse (docs/benchmarks.md, 'Quantile Balancing in "
        "the training job').",
    )
    solve_rounds: int = Field(
        2, ge=1, le=8,
        description="quantile/quantile_hist in the training job, with margins_after_step: solves per step. Round 1 "
        "solves every layer from the after-step forward; each further round sets those biases, runs the "
        "after-step forward again and solves again. A layer's router input depends on how the layers below it "
        "route, so a deep layer's bias solved while the shallow layers still route with last step's biases is "
        "solved for inputs it will not see; at high learning rates that left the deep layers 2x above the "
        "fixed-bias floor (docs/benchmarks.md). Each round is one more no-grad forward and, with the "
        "coordinator, one more histogram round trip that the step waits on.",
    )
    loss_free_step: float = Field(1e-3, gt=0, description="loss_free: step size of b += step * sign(mean load - load).")
    aux_loss_coef: float = Field(1e-2, ge=0, description="aux_loss: coefficient of the Switch load-balancing loss.")

    @model_validator(mode="after")
    def _check(self) -> "BalanceConfig":
        lo, hi = self.fixed_range
        if not lo < hi:
            raise ValueError(f"fixed_range must have lo < hi, got {self.fixed_range}")
        if self.min_halfwidth > self.max_halfwidth:
            raise ValueError(f"min_halfwidth {self.min_halfwidth} > max_halfwidth {self.max_halfwidth}")
        if self.solve_rounds > 1 and not self.margins_after_step and self.method in ("quantile", "quantile_hist"):
            raise ValueError(f"solve_rounds={self.solve_rounds} re-runs the after-step forward: it needs "
                             "margins_after_step=True (or solve_rounds=1)")
        return self


# ---------------------------------------------------------------------------------------------
# Router-side quantities


def _check_scores(scores: torch.Tensor, bias: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating [N, E] tensor, got {tuple(scores.shape)} {scores.dtype}")
    check_k(k, scores.shape[1])
    if bias.shape != (scores.shape[1],):
        raise ValueError(f"bias must be [E={scores.shape[1]}], got {tuple(bias.shape)}")


def check_k(k: int, num_experts: int) -> None:
    """QB needs a (k+1)-th expert per token: 1 <= k < E."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < num_experts:
        raise ValueError(f"k (num_experts_per_token) must satisfy 1 <= k < experts, got k={k!r} with {num_experts} experts")


def check_layers(num_layers: int, num_experts: int, k: int) -> None:
    """What a balancer over `num_layers` MoE layers needs: at least one layer, 1 <= k < E."""
    check_k(k, num_experts)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")


def route(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as the model does it, plus QB margins.

    scores [N, E], bias [E] -> (margins [N, E] = s - alpha, topk_idx [N, k]).
    """
    _check_scores(scores, bias, k)
    idx, margins = select_experts(scores, bias, k)
    return margins, idx


def token_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N, E], bias [E] -> margins [N, E] = s - alpha, alpha = (k+1)-th largest of s + b per token."""
    return route(scores, bias, k)[0]


def expert_loads(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_idx [N, k] -> tokens per expert [E] int64."""
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts)


def max_violation(loads: torch.Tensor) -> float:
    """MaxVio = max load / mean load - 1 (0 when perfectly balanced)."""
    loads = loads.double()
    mean = loads.mean()
    if mean <= 0:
        raise ValueError("max_violation: no token was routed")
    return float(loads.max() / mean - 1)


def centred(bias: torch.Tensor) -> torch.Tensor:
    """Subtract the mean; top-k of s + b is unchanged by a shift of every b_e."""
    return bias - bias.mean()


# ---------------------------------------------------------------------------------------------
# The solves


def quantile_target(n_tokens: int, k: int, num_experts: int) -> float:
    """q = N k / E, the load every expert should carry; raises if it is outside (0, N)."""
    check_k(k, num_experts)
    q = n_tokens * k / num_experts
    if not 0 < q < n_tokens:
        raise ValueError(f"q = N k / E = {n_tokens} * {k} / {num_experts} = {q:g} is outside (0, N={n_tokens})")
    return q


def _integer_q(q: float, n: int) -> int:
    """N k / E need not divide: both solves round q, which moves a load by half a token at most."""
    if not 0 < q < n:
        raise ValueError(f"q = {q:g} is outside (0, N={n})")
    qi = int(round(q))
    if not 1 <= qi <= n - 1:
        raise ValueError(f"q = {q:g} rounds to {qi}, outside [1, N-1={n - 1}]: the batch is too small")
    return qi


def exact_thresholds(margins: torch.Tensor, q: float) -> torch.Tensor:
    """margins [N, E] -> [E]: per expert, the midpoint of the q-th and (q+1)-th largest margin.

    Exactly q margins of the batch lie above it (q rounded to an integer).
    """
    if margins.dim() != 2:
        raise ValueError(f"margins must be [N, E], got {tuple(margins.shape)}")
    n = margins.shape[0]
    qi = _integer_q(q, n)
    # one partial top-k per expert gives both order statistics; rows contiguous is ~1.3x faster,
    # and counting from the nearer end keeps the selection short
    m_EN = margins.t().contiguous()
    if qi + 1 <= n - qi + 1:
        top = torch.topk(m_EN, qi + 1, dim=1).values  # descending
        v_q, v_q1 = top[:, qi - 1], top[:, qi]
    else:
        low = torch.topk(m_EN, n - qi + 1, dim=1, largest=False).values  # ascending
        v_q, v_q1 = low[:, n - qi], low[:, n - qi - 1]
    return 0.5 * (v_q + v_q1)


def exact_bias(margins: torch.Tensor, k: int, centre: bool = True) -> torch.Tensor:
    """margins [N, E] of one batch -> next bias [E] (centred unless centre=False); q = N k / E."""
    q = quantile_target(margins.shape[0], k, margins.shape[1])
    bias = -exact_thresholds(margins, q)
    return centred(bias) if centre else bias


def _check_hist(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if hist.dim() != 2:
        raise ValueError(f"hist must be [E, bins], got {tuple(hist.shape)}")
    if hist.is_floating_point() or hist.is_complex():
        raise ValueError(f"hist must hold integer counts, got {hist.dtype}")
    e = hist.shape[0]
    lo = torch.as_tensor(lo, dtype=torch.float64).expand(e)
    hi = torch.as_tensor(hi, dtype=torch.float64).expand(e)
    return lo, hi


def histogram_thresholds(
    hist: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float, q: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [E, bins] over [lo_e, hi_e) -> (thresholds [E] fp64, saturated [E] bool).

    Scans each row from the top until q counts are passed, spreading each bin's count evenly over
    the bin; where exactly q counts lie above a bin boundary, the threshold goes to the middle of
    the empty stretch above it (as the exact solve takes the middle of the gap). q is rounded
    like in the exact solve, so the two agree within one bin for any q. `saturated` marks
    thresholds in the first or last bin, which also hold the clamped out-of-range margins:
    there the estimate may be off by more than a bin.
    """
    lo, hi = _check_hist(hist, lo, hi)
    n_experts, bins = hist.shape
    counts = hist.to(torch.float64)
    n = counts.sum(-1)
    if not bool((n == n[0]).all()):
        raise ValueError(f"every histogram row must count the same N tokens, got row sums {n.unique().tolist()}")
    q = _integer_q(q, int(n[0]))
    at_or_above = counts.flip(-1).cumsum(-1).flip(-1)  # [E, bins] counts in bins >= j
    above = at_or_above - counts  # counts in bins > j
    j_E = (at_or_above > q).sum(-1) - 1  # last bin whose at-or-above count passes q
    width = (hi - lo) / bins
    h = counts.gather(1, j_E[:, None])[:, 0]
    a = above.gather(1, j_E[:, None])[:, 0]
    upper = lo + (j_E + 1) * width
    inside = upper - width * (q - a) / h
    # plateau: exactly q counts above bin j's upper edge; centre on the gap up to the next count
    idx = torch.arange(bins)
    nxt = torch.where((counts > 0) & (idx > j_E[:, None]), idx, bins).min(-1).values
    plateau = 0.5 * (upper + lo + nxt * width)
    thresholds = torch.where(a == q, plateau, inside)
    saturated = (j_E == 0) | (j_E == bins - 1)
    return thresholds, saturated


def histogram_bias(
    hist: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float, q: float, centre: bool = True
) -> torch.Tensor:
    """Summed margin histogram [E, bins] over [lo, hi) -> next bias [E] fp32 (centred unless centre=False)."""
    bias = -histogram_thresholds(hist, lo, hi, q)[0]
    return (centred(bias) if centre else bias).float()


def fine_window(
    hist: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float, q: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bin each expert's threshold fell in -> (lo [E], hi [E]) for a second, finer histogram.

    Binning the same margins again over this window (clamped as usual, so everything above lands
    in the top bin and the scan from the top still counts it) and solving that histogram with
    the same q divides the error bound by `bins`.
    """
    lo, hi = _check_hist(hist, lo, hi)
    thresholds, _ = histogram_thresholds(hist, lo, hi, q)
    bins = hist.shape[1]
    width = (hi - lo) / bins
    j_E = ((thresholds - lo) / width).floor().clamp(0, bins - 1)
    return lo + j_E * width, lo + (j_E + 1) * width


# ---------------------------------------------------------------------------------------------
# Baselines


def loss_free_update(bias: torch.Tensor, loads: torch.Tensor, step_size: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3 auxiliary-loss-free balancing: b_e += step * sign(mean load - load_e)."""
    loads = loads.to(torch.float64)
    return (bias + step_size * torch.sign(loads.mean() - loads).to(bias.dtype)).to(bias.dtype)


def switch_aux_loss(probs: torch.Tensor, topk_idx: torch.Tensor, coef: float = 1.0) -> torch.Tensor:
    """Switch Transformer load-balancing loss, generalised to top-k; a differentiable scalar.

    probs [N, E]: router probabilities (rows sum to 1; normalise sigmoid scores per token);
    topk_idx [N, k]: the selection. Loss = coef * E * sum_e f_e P_e with f_e the fraction of the
    N k routed slots that went to e (not differentiable) and P_e the mean probability of e.
    It equals coef under uniform routing; gradients reach the router through P only.
    """
    if probs.dim() != 2 or topk_idx.dim() != 2 or probs.shape[0] != topk_idx.shape[0]:
        raise ValueError(f"switch_aux_loss: need probs [N, E] and topk_idx [N, k], got {tuple(probs.shape)} and {tuple(topk_idx.shape)}")
    n, e = probs.shape
    f = expert_loads(topk_idx, e).to(probs.dtype) / topk_idx.numel()
    p = probs.mean(0)
    return coef * e * (f * p).sum()


def adaptive_gain(loads: torch.Tensor, q: float, k: int, min_gain: float) -> float:
    """Gain for b <- b + g (b_solve - b) from how far the observed loads are from q.

    z2 = mean_e (load_e - q)^2 / (q (1 - k/E)) is about 1 when loads differ from q only by
    sampling noise; g = 1 - 1/z2 (clipped to [min_gain, 1]) is the scalar Kalman gain that
    treats z2 - 1 as the part of the error the bias can fix.
    """
    num_experts = loads.numel()
    var = q * (1 - k / num_experts)
    z2 = float(((loads.double() - q) ** 2).mean() / var)
    return min(1.0, max(min_gain, 1.0 - 1.0 / z2)) if z2 > 0 else min_gain


def blend(config: BalanceConfig, bias: torch.Tensor, solved: torch.Tensor, loads: torch.Tensor | None, q: float,
          k: int) -> tuple[torch.Tensor, float]:
    """The QB update b <- b + g (b_solve - b) for both solves; returns (new bias, g)."""
    gain = 1.0
    if config.gain == "adaptive":
        if loads is None:
            raise ValueError("gain='adaptive' needs the step's expert loads")
        gain = adaptive_gain(loads, q, k, config.min_gain)
    return bias + gain * (solved - bias), gain


# ---------------------------------------------------------------------------------------------
# Per-layer histogram QB step, shared by the Balancer and the coordinator


@dataclass
class HistLayerState:
    """What one MoE layer carries between steps under quantile_hist (all fp32 [E] but halfwidth)."""

    bias: torch.Tensor  # [E] in use for the current step (centred)
    lo: torch.Tensor  # [E] histogram window of the current step
    hi: torch.Tensor  # [E]
    halfwidth: float  # 'follow' policy: w of the current window

    @classmethod
    def initial(cls, config: BalanceConfig, num_experts: int) -> "HistLayerState":
        bias = torch.zeros(num_experts)
        lo, hi = window_for(config, bias, config.init_halfwidth)
        return cls(bias, lo, hi, config.init_halfwidth)


def window_for(config: BalanceConfig, bias: torch.Tensor, halfwidth: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram window [lo_e, hi_e) for a step that routes with `bias`.

    'follow': centred on -b_e, expert e's selection boundary (token t picks e iff m_te > -b_e),
    which is where the next threshold settles once loads are balanced.
    """
    if config.range_policy == "fixed":
        lo, hi = config.fixed_range
        return torch.full_like(bias, lo, dtype=torch.float32), torch.full_like(bias, hi, dtype=torch.float32)
    c = -bias.float()
    return c - halfwidth, c + halfwidth


def hist_step(
    config: BalanceConfig,
    state: HistLayerState,
    hist: torch.Tensor,
    loads: torch.Tensor | None,
    k: int,
    fine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[HistLayerState, dict[str, Any]]:
    """One quantile_hist update: the summed histogram of step t -> the state for step t+1.

    hist [E, bins] was binned over state.lo/state.hi from margins routed with state.bias; loads
    [E] are that step's tokens per expert (needed for gain='adaptive', reported otherwise).
    fine: (hist, lo, hi) of the optional second pass over `fine_window`; when given, it sets the
    thresholds and the coarse histogram still drives the window policy.
    """
    num_experts = state.bias.numel()
    n_tokens = int(hist[0].sum())
    q = quantile_target(n_tokens, k, num_experts)
    thresholds, saturated = histogram_thresholds(hist, state.lo, state.hi, q)
    coarse = thresholds
    if fine is not None:
        thresholds = histogram_thresholds(fine[0], fine[1], fine[2], q)[0]
    bias, gain = blend(config, state.bias, centred(-thresholds).float(), loads, q, k)
    w = state.halfwidth
    if config.range_policy == "follow":
        moved = float((coarse - 0.5 * (state.lo + state.hi).double()).abs().max())
        if bool(saturated.any()):
            w = min(4.0 * w, config.max_halfwidth)
        else:
            # room for twice this step's largest move, shrinking at most 2x per step
            w = min(max(2.0 * moved, 0.5 * w, config.min_halfwidth), config.max_halfwidth)
    lo, hi = window_for(config, bias, w)
    info = {"q": q, "n_tokens": n_tokens, "thresholds": thresholds, "saturated": int(saturated.sum()), "gain": gain}
    return HistLayerState(bias, lo, hi, w), info


# ---------------------------------------------------------------------------------------------
# The single-process balancer


@dataclass
class _Pending:
    margins: list[torch.Tensor] = field(default_factory=list)
    hist: torch.Tensor | None = None
    loads: torch.Tensor | None = None


class Balancer:
    """Balancing state of one model: a bias [E] per MoE layer, updated once per training step.

    Per step: route every layer with `bias(layer)`, call `observe(layer, margins, counts)` (or
    `observe_scores`) for each micro-batch, then `step()`. Biases solved in `step()` are what
    `bias()` returns afterwards: a batch is never routed with a bias computed from itself.
    With method 'aux_loss', add `aux_loss(probs, topk_idx)` to the training loss.
    """

    def __init__(self, config: BalanceConfig, num_layers: int, num_experts: int, k: int):
        check_layers(num_layers, num_experts, k)
        self.config, self.num_layers, self.num_experts, self.k = config, num_layers, num_experts, k
        self.steps = 0
        self.hist_states = [HistLayerState.initial(config, num_experts) for _ in range(num_layers)]
        self._bias = torch.zeros(num_layers, num_experts)  # [L, E] in use now
        self._pending: dict[int, _Pending] = {}
        self.last_info: dict[int, dict[str, Any]] = {}

    # -- what the router uses
    def bias(self, layer: int | None = None) -> torch.Tensor:
        """[L, E], or [E] for one layer: the bias to route the current batch with (a copy)."""
        return self._bias.clone() if layer is None else self._bias[self._layer(layer)].clone()

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """quantile_hist: the histogram window (lo [E], hi [E]) of the current step."""
        s = self.hist_states[self._layer(layer)]
        return s.lo.clone(), s.hi.clone()

    # -- per micro-batch
    def observe_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Route scores [N, E] with the current bias, observe them; returns topk_idx [N, k]."""
        margins, topk_idx = route(scores, self._bias[self._layer(layer)], self.k)
        self.observe(layer, margins, expert_loads(topk_idx, self.num_experts))
        return topk_idx

    def observe(self, layer: int, margins: torch.Tensor | None, counts: torch.Tensor) -> None:
        """margins [N, E] (from routing with `bias(layer)`; unused by loss_free/aux_loss/none), counts [E]."""
        layer = self._layer(layer)
        if counts.shape != (self.num_experts,):
            raise ValueError(f"counts must be [E={self.num_experts}], got {tuple(counts.shape)}")
        p = self._pending.setdefault(layer, _Pending())
        needs_margins = self.config.method in ("quantile", "quantile_hist")
        if needs_margins:
            if margins is None or margins.dim() != 2 or margins.shape[1] != self.num_experts:
                shape = None if margins is None else tuple(margins.shape)
                raise ValueError(f"margins must be [N, E={self.num_experts}], got {shape}")
            if self.config.method == "quantile" or self.config.fine_pass:
                p.margins.append(margins.detach())
            if self.config.method == "quantile_hist":
                s = self.hist_states[layer]
                h = qb_histogram(margins.detach(), s.lo, s.hi, self.config.bins)
                p.hist = h if p.hist is None else p.hist + h
        counts = counts.detach().long()
        p.loads = counts if p.loads is None else p.loads + counts

    def aux_loss(self, probs: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """Switch auxiliary loss times config.aux_loss_coef (zero unless method is 'aux_loss')."""
        if self.config.method != "aux_loss":
            return probs.new_zeros(())
        return switch_aux_loss(probs, topk_idx, self.config.aux_loss_coef)

    # -- end of step
    def step(self) -> dict[int, dict[str, Any]]:
        """Solve every observed layer; the results route the next batch. Returns per-layer info."""
        infos: dict[int, dict[str, Any]] = {}
        for layer, p in sorted(self._pending.items()):
            info: dict[str, Any] = {}
            if p.loads is not None and int(p.loads.sum()) > 0:
                info["maxvio"] = max_violation(p.loads)
                info["loads"] = p.loads
            method = self.config.method
            if method == "quantile":
                self._bias[layer] = self._solve_exact(layer, p, info)
            elif method == "quantile_hist":
                self._bias[layer] = self._solve_hist(layer, p, info)
            elif method == "loss_free":
                self._bias[layer] = loss_free_update(self._bias[layer], p.loads, self.config.loss_free_step)
            info["bias_spread"] = float(self._bias[layer].max() - self._bias[layer].min())
            infos[layer] = info
        self._pending.clear()
        self.steps += 1
        self.last_info = infos
        return infos

    def _solve_exact(self, layer: int, p: _Pending, info: dict[str, Any]) -> torch.Tensor:
        margins = torch.cat(p.margins) if len(p.margins) > 1 else p.margins[0]
        q = quantile_target(margins.shape[0], self.k, self.num_experts)
        thresholds = exact_thresholds(margins, q)
        bias, gain = blend(self.config, self._bias[layer], centred(-thresholds).float(), p.loads, q, self.k)
        info.update(q=q, thresholds=thresholds, gain=gain)
        return bias

    def _solve_hist(self, layer: int, p: _Pending, info: dict[str, Any]) -> torch.Tensor:
        state = self.hist_states[layer]
        fine = None
        if self.config.fine_pass:
            margins = torch.cat(p.margins) if len(p.margins) > 1 else p.margins[0]
            q = quantile_target(margins.shape[0], self.k, self.num_experts)
            lo_f, hi_f = fine_window(p.hist, state.lo, state.hi, q)
            fine = (qb_histogram(margins, lo_f, hi_f, self.config.bins), lo_f, hi_f)
        new_state, step_info = hist_step(self.config, state, p.hist, p.loads, self.k, fine)
        info.update(step_info)
        info["bin_width"] = float(((state.hi - state.lo) / self.config.bins).max())
        self.hist_states[layer] = new_state
        return new_state.bias

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return layer

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(),
            "steps": self.steps,
            "bias": self._bias.clone(),
            "hist": [(s.bias.clone(), s.lo.clone(), s.hi.clone(), s.halfwidth) for s in self.hist_states],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bias = state["bias"]
        if tuple(bias.shape) != (self.num_layers, self.num_experts) or len(state["hist"]) != self.num_layers:
            raise ValueError(f"state is for bias {tuple(bias.shape)}, this balancer has [{self.num_layers}, {self.num_experts}]")
        self.steps = int(state["steps"])
        self._bias = bias.clone().float()
        self.hist_states = [HistLayerState(b.clone(), lo.clone(), hi.clone(), float(w)) for b, lo, hi, w in state["hist"]]
        self._pending.clear()


# ---------------------------------------------------------------------------------------------
# Iterating the exact solve on one batch (the worked example and the fixed-point property)


def solve_batch(scores: torch.Tensor, k: int, max_iters: int = 1000) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Alternate the per-token (alpha) and per-expert (threshold) steps on one batch.

    scores [N, E] with N k / E an integer -> (bias [E], trace). trace[i] holds the bias of
    iteration i (0 = no bias) and the top-k loads it gives on this batch. Stops at a fixed point:
    loads all equal q and one more iteration leaves the selection unchanged. Each iteration is
    one QB step; this is how the per-step solve converges, seen on a single batch.
    """
    n, e = scores.shape
    q = quantile_target(n, k, e)
    if q != int(q):
        raise ValueError(f"solve_batch needs an integer q = N k / E, got {q:g}")
    bias = torch.zeros(e, dtype=scores.dtype)
    trace: list[dict[str, Any]] = []
    margins, idx = route(scores, bias, k)
    for it in range(max_iters + 1):
        loads = expert_loads(idx, e)
        trace.append({"iter": it, "bias": bias.tolist(), "loads": loads.tolist()})
        nxt = centred(-exact_thresholds(margins, q))
        nxt_margins, nxt_idx = route(scores, nxt, k)
        if bool((loads == int(q)).all()) and torch.equal(nxt_idx.sort(1).values, idx.sort(1).values):
            break
        bias, margins, idx = nxt, nxt_margins, nxt_idx
    return bias, trace


def format_trace(trace: list[dict[str, Any]]) -> str:
    """One line per iteration: loads and bias, for failure messages and the docs."""
    lines = []
    for row in trace:
        b = ", ".join(f"{x:+.4f}" for x in row["bias"])
        lines.append(f"iter {row['iter']:3d}  loads {tuple(row['loads'])}  bias [{b}]")
    return "\n".join(lines)


__all__ = [
    "METHODS", "BalanceConfig", "Balancer", "HistLayerState", "adaptive_gain", "centred", "check_k",
    "exact_bias", "exact_thresholds", "expert_loads", "fine_window", "format_trace", "hist_step",
    "histogram_bias", "histogram_thresholds", "loss_free_update", "max_violation", "quantile_target",
    "route", "solve_batch", "switch_aux_loss", "token_margins", "window_for",
]
