"""Readable grouped matmul: one matmul per group of consecutive rows."""
from __future__ import annotations

import torch


def naive_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows sorted by group), w [G, K, N], offs [G] (the cumulative group sizes) ->
    [M, N]: rows offs[g-1]:offs[g] of x times w[g]. Empty groups multiply too, so the result
    stays differentiable in x and w when every group is empty."""
    parts, start = [], 0
    for g, end in enumerate(offs.tolist()):
        parts.append(x[start:end] @ w[g])
        start = end
    return torch.cat(parts)
