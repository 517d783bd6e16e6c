"""Triton QB margin histogram: one pass over the [N, E] margins, atomic adds into [E, bins].

Each program takes a [BN, BE] tile (coalesced along experts), computes the bin of every margin
with exactly the operations of reference.bin_index (fp32, or fp64 for fp64 margins: subtract
lo, multiply by the host-computed bins / (hi - lo), clamp, truncate), and adds 1 to
counts[e * bins + bin]. Histograms from different workers sum exactly, so the coordinator can add them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def qb_histogram_kernel(margins, lo, scale, counts, N, E, bins, stride_n,
                        BN: tl.constexpr, BE: tl.constexpr, F64: tl.constexpr):
    i_n, i_e = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    m = (o_n < N)[:, None] & m_e[None, :]
    dt = tl.float64 if F64 else tl.float32
    b_m = tl.load(margins + o_n.to(tl.int64)[:, None] * stride_n + o_e[None, :], mask=m, other=0.).to(dt)
    b_lo = tl.load(lo + o_e, mask=m_e, other=0.)
    b_sc = tl.load(scale + o_e, mask=m_e, other=0.)
    b_x = (b_m - b_lo[None, :]) * b_sc[None, :]
    b_x = tl.minimum(tl.maximum(b_x, 0.), (bins - 1).to(dt))
    b_bin = b_x.to(tl.int32) + o_e[None, :] * bins  # truncation: a floor, the value being >= 0
    tl.atomic_add(counts + b_bin, tl.full([BN, BE], 1, tl.int32), mask=m)


def qb_histogram_triton(margins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """margins [N, E] (any float dtype, last dim contiguous or not), lo [E], hi [E] -> counts
    [E, bins] int64; the contract of `k3.kernels.qb_histogram.qb_histogram` (inputs checked)."""
    N, E = margins.shape
    dtype = torch.float64 if margins.dtype == torch.float64 else torch.float32
    lo_c = lo.to(device=margins.device, dtype=dtype)
    scale = bins / (hi.to(device=margins.device, dtype=dtype) - lo_c)  # the reference's exact operations
    if margins.stride(1) != 1:
        margins = margins.contiguous()
    counts = torch.zeros(E * bins, dtype=torch.int32, device=margins.device)
    if N and E:
        BE = min(64, triton.next_power_of_2(E))
        BN = max(1, 4096 // BE)
        grid = (triton.cdiv(N, BN), triton.cdiv(E, BE))
        qb_histogram_kernel[grid](margins, lo_c.contiguous(), scale.contiguous(), counts, N, E, bins,
                                  margins.stride(0), BN=BN, BE=BE, F64=dtype == torch.float64)
    return counts.view(E, bins).to(torch.int64)
