"""Triton SiTU-GLU, forward and backward: one pass over gate and up, fp32 math in registers.

tanh is written with exp2 (the interpreter has no libdevice), with a short odd series near zero
where 1 - e^(-2|x|) would cancel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    e = tl.exp2(-2.8853900817779268 * a)  # e^(-2|x|)
    big = (1.0 - e) / (1.0 + e)
    x2 = a * a
    small = a * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                     + x2 * 0.021869488536155203))))
    r = tl.where(a < 0.25, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def situ_glu_fwd_kernel(gate, up, out, n, b1, b2, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_g = tl.load(gate + o, mask=m, other=0.).to(tl.float32)
    b_u = tl.load(up + o, mask=m, other=0.).to(tl.float32)
    b_a = b1 * _tanh(b_g / b1) * tl.sigmoid(b_g)
    b_h = b_a * (b2 * _tanh(b_u / b2))
    tl.store(out + o, b_h.to(out.dtype.element_ty), mask=m)


@triton.jit
def situ_glu_bwd_kernel(gate, up, dh, dgate, dup, n, b1, b2, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_g = tl.load(gate + o, mask=m, other=0.).to(tl.float32)
    b_u = tl.load(up + o, mask=m, other=0.).to(tl.float32)
    b_d = tl.load(dh + o, mask=m, other=0.).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    b_t = _tanh(b_g / b1)
    b_tu = _tanh(b_u / b2)
    b_da = b_s * ((1.0 - b_t * b_t) + b1 * b_t * (1.0 - b_s))
    tl.store(dgate + o, (b_d * b_da * b2 * b_tu).to(dgate.dtype.element_ty), mask=m)
    tl.store(dup + o, (b_d * b1 * b_t * b_s * (1.0 - b_tu * b_tu)).to(dup.dtype.element_ty), mask=m)


class _SituGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, b1, b2):
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            situ_glu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, b1, b2, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.b1, ctx.b2 = b1, b2
        return out

    @staticmethod
    # Triton kernels: nothing of the backward is recorded for a second one
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            situ_glu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dh, dgate, dup, n, ctx.b1, ctx.b2, BLOCK=BLOCK)
        return dgate, dup, None, None


def situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    """The contract of `k3.kernels.situ_glu.situ_glu` (inputs already checked)."""
    return _SituGLUTriton.apply(gate.contiguous(), up.contiguous(), float(b1), float(b2))
