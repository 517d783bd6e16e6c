"""QB margin histogram: per-expert counts of router margins in fixed bins.

Quantile Balancing sums these histograms over data-parallel workers and scans each expert's
row from the top until q = N k / E tokens are reached (k3.platform.balance.quantile). The public op is
`qb_histogram`; `naive_qb_histogram` is the readable reference with the same signature. CUDA
tensors run the Triton kernel (triton.py), CPU tensors the torch path (cpu.py).
"""
from __future__ import annotations

import torch

from ..dispatch import use_triton
from .cpu import qb_histogram_torch
from .reference import naive_qb_histogram

__all__ = ["qb_histogram", "naive_qb_histogram"]


def _as_bound(value: float | torch.Tensor, n_experts: int, name: str, margins: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.expand(n_experts)
        if value.shape != (n_experts,):
            raise ValueError(f"qb_histogram: {name} must be a float or a [E={n_experts}] tensor, got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise ValueError(f"qb_histogram: {name} must be floating point, got {value.dtype}")
        return value.to(device=margins.device)
    return torch.full((n_experts,), float(value), dtype=torch.float64, device=margins.device)


def qb_histogram(
    margins: torch.Tensor, lo: float | torch.Tensor, hi: float | torch.Tensor, bins: int
) -> torch.Tensor:
    """Count margins [N, E] into `bins` equal bins per expert over [lo, hi) -> [E, bins] int64.

    lo, hi: floats (one range for every expert) or [E] tensors (a window per expert).
    Margins outside the range are clamped into the first or last bin, so each row sums to N.
    """
    if not isinstance(margins, torch.Tensor) or margins.dim() != 2:
        shape = tuple(margins.shape) if isinstance(margins, torch.Tensor) else type(margins).__name__
        raise ValueError(f"qb_histogram: margins must be a [N, E] tensor, got {shape}")
    if not margins.is_floating_point():
        raise ValueError(f"qb_histogram: margins must be floating point, got {margins.dtype}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"qb_histogram: bins must be a positive int, got {bins!r}")
    n_experts = margins.shape[1]
    if n_experts * bins >= 2**31:
        raise ValueError(f"qb_histogram: experts x bins = {n_experts} x {bins} overflows the int32 bin ids")
    lo_E = _as_bound(lo, n_experts, "lo", margins)
    hi_E = _as_bound(hi, n_experts, "hi", margins)
    if not (torch.isfinite(lo_E).all() and torch.isfinite(hi_E).all()):
        raise ValueError("qb_histogram: lo and hi must be finite")
    if not bool((hi_E > lo_E).all()):
        bad = int(torch.nonzero(hi_E <= lo_E)[0])
        raise ValueError(f"qb_histogram: need hi > lo for every expert, expert {bad} has lo={float(lo_E[bad])}, hi={float(hi_E[bad])}")
    # the bins are computed in fp32 (fp64 for fp64 margins): the window must survive that
    dtype = torch.float64 if margins.dtype == torch.float64 else torch.float32
    if dtype == torch.float32 and bins > 2**24:
        raise ValueError(f"qb_histogram: bins must be <= 2^24 for {margins.dtype} margins (the last bin index "
                         f"{bins - 1} is not exact in fp32, so clamped margins would land in the next expert's row), "
                         f"got {bins}")
    scale = bins / (hi_E.to(dtype) - lo_E.to(dtype))
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        bad = int(torch.nonzero(~torch.isfinite(scale) | (scale <= 0))[0])
        raise ValueError(f"qb_histogram: lo and hi of expert {bad} ({float(lo_E[bad])!r}, {float(hi_E[bad])!r}) are "
                         f"one window in fp64 but collapse in {dtype} (width {float(hi_E[bad].to(dtype) - lo_E[bad].to(dtype))}): "
                         "widen the window or pass fp64 margins")
    if margins.numel() and bool(torch.isnan(margins).any()):  # +-inf is fine: it clamps
        raise ValueError("qb_histogram: margins contain NaN")
    if use_triton("qb_histogram", margins, None):
        from .triton import qb_histogram_triton

        return qb_histogram_triton(margins, lo_E, hi_E, bins)
    return qb_histogram_torch(margins, lo_E, hi_E, bins)
