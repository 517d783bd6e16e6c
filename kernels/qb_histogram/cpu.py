"""Fast torch path for the QB margin histogram: one bincount over expert-offset bin ids.

Tokens are processed in chunks so the [chunk, E] index tensor stays small (N x E int32 at K3's
896 experts and 64K tokens would be 235 MB).
"""
from __future__ import annotations

import torch

from .reference import bin_index

CHUNK_ELEMENTS = 1 << 22  # ~4M margins per chunk: 16 MB of int32 indices


def qb_histogram_torch(margins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """margins [N, E], lo [E], hi [E] -> counts [E, bins] int64."""
    n_tokens, n_experts = margins.shape
    offset_E = torch.arange(n_experts, device=margins.device, dtype=torch.int32) * bins
    counts = torch.zeros(n_experts * bins, dtype=torch.int64, device=margins.device)
    rows = max(1, CHUNK_ELEMENTS // max(n_experts, 1))
    for start in range(0, n_tokens, rows):
        idx_NE = bin_index(margins[start : start + rows], lo, hi, bins).add_(offset_E)
        counts += torch.bincount(idx_NE.reshape(-1), minlength=n_experts * bins)
    return counts.view(n_experts, bins)
