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

from dataclasses import dataclass
from typing import Any

import torch

from .config import BalanceConfig
from .routing import centred, expert_loads, quantile_target, route

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


def exact_bias(margins: torch.Tensor, top_k: int, centre: bool = True) -> torch.Tensor:
    """margins [N, E] of one batch -> next bias [E] (centred unless centre=False); q = N k / E."""
    q = quantile_target(margins.shape[0], top_k, margins.shape[1])
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


def adaptive_gain(loads: torch.Tensor, q: float, top_k: int, min_gain: float) -> float:
    """Gain for b <- b + g (b_solve - b) from how far the observed loads are from q.

    z2 = mean_e (load_e - q)^2 / (q (1 - k/E)) is about 1 when loads differ from q only by
    sampling noise; g = 1 - 1/z2 (clipped to [min_gain, 1]) is the scalar Kalman gain that
    treats z2 - 1 as the part of the error the bias can fix.
    """
    num_experts = loads.numel()
    var = q * (1 - top_k / num_experts)
    z2 = float(((loads.double() - q) ** 2).mean() / var)
    return min(1.0, max(min_gain, 1.0 - 1.0 / z2)) if z2 > 0 else min_gain


def blend(config: BalanceConfig, bias: torch.Tensor, solved: torch.Tensor, loads: torch.Tensor | None, q: float,
          top_k: int) -> tuple[torch.Tensor, float]:
    """The QB update b <- b + g (b_solve - b) for both solves; returns (new bias, g)."""
    gain = 1.0
    if config.gain == "adaptive":
        if loads is None:
            raise ValueError("gain='adaptive' needs the step's expert loads")
        gain = adaptive_gain(loads, q, top_k, config.min_gain)
    return bias + gain * (solved - bias), gain


# Per-layer histogram QB step, shared by the single-process QuantileHist balancer and the coordinator


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
    top_k: int,
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
    q = quantile_target(n_tokens, top_k, num_experts)
    thresholds, saturated = histogram_thresholds(hist, state.lo, state.hi, q)
    coarse = thresholds
    if fine is not None:
        thresholds = histogram_thresholds(fine[0], fine[1], fine[2], q)[0]
    bias, gain = blend(config, state.bias, centred(-thresholds).float(), loads, q, top_k)
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


# Iterating the exact solve on one batch (the worked example and the fixed-point property)


def solve_batch(scores: torch.Tensor, top_k: int, max_iters: int = 1000) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Alternate the per-token (alpha) and per-expert (threshold) steps on one batch.

    scores [N, E] with N k / E an integer -> (bias [E], trace). trace[i] holds the bias of
    iteration i (0 = no bias) and the top-k loads it gives on this batch. Stops at a fixed point:
    loads all equal q and one more iteration leaves the selection unchanged. Each iteration is
    one QB step; this is how the per-step solve converges, seen on a single batch.
    """
    n, e = scores.shape
    q = quantile_target(n, top_k, e)
    if q != int(q):
        raise ValueError(f"solve_batch needs an integer q = N k / E, got {q:g}")
    bias = torch.zeros(e, dtype=scores.dtype)
    trace: list[dict[str, Any]] = []
    margins, idx = route(scores, bias, top_k)
    for it in range(max_iters + 1):
        loads = expert_loads(idx, e)
        trace.append({"iter": it, "bias": bias.tolist(), "loads": loads.tolist()})
        nxt = centred(-exact_thresholds(margins, q))
        nxt_margins, nxt_idx = route(scores, nxt, top_k)
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
