"""Readable QB margin histogram: count each expert's margins into `bins` equal bins.

Bin i of expert e covers [lo_e + i * w_e, lo_e + (i + 1) * w_e) with w_e = (hi_e - lo_e) / bins.
Margins below lo_e land in bin 0 and margins at or above hi_e in the last bin, so every token is
counted once per expert and a row sums to N. The bin index is floor((m - lo_e) * bins / (hi_e - lo_e)),
computed in fp32 (fp64 for fp64 input) by one function that both paths call, so they agree bin
for bin.
"""
from __future__ import annotations

import torch


def bin_index(margins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """[N, E] margins, [E] lo/hi -> [N, E] int32 bin indices in [0, bins). Shared by both paths."""
    dtype = torch.float64 if margins.dtype == torch.float64 else torch.float32
    m = margins.to(dtype)
    lo, hi = lo.to(dtype), hi.to(dtype)
    scale = bins / (hi - lo)  # [E]
    # subtracting lo before scaling keeps the precision of narrow windows away from zero;
    # clamping before the cast keeps far-out margins from overflowing it and makes it a floor
    return torch.sub(m, lo).mul_(scale).clamp_(0, bins - 1).to(torch.int32)


def naive_qb_histogram(margins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """margins [N, E], lo [E], hi [E] -> counts [E, bins] int64, one expert at a time."""
    n_tokens, n_experts = margins.shape
    counts = torch.zeros(n_experts, bins, dtype=torch.int64, device=margins.device)
    for e in range(n_experts):
        idx_N = bin_index(margins[:, e : e + 1], lo[e : e + 1], hi[e : e + 1], bins)[:, 0]
        counts[e] = torch.bincount(idx_N, minlength=bins)
    return counts
