"""SiTU-GLU activation (K3's expert activation) and SwiGLU, with shape checks.

`situ_glu(gate, up)` computes in fp32 and returns the inputs' dtype; it is differentiable with a
fused backward: Triton on CUDA (triton.py), a blocked torch path on CPU (cpu.py). The readable
reference with the same signature is `naive_situ_glu`.
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from ..dispatch import fail, use_triton
from .cpu import situ_glu_torch
from .reference import naive_situ_glu, naive_swiglu

__all__ = ["situ_glu", "swiglu", "naive_situ_glu", "naive_swiglu"]


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    for name, x in (("gate", gate), ("up", up)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"situ_glu: {name} must be a tensor, got {type(x).__name__}")
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.device != up.device:
        raise ValueError(f"situ_glu: up is on device {up.device} but gate is on {gate.device}")
    if not gate.is_floating_point() or gate.dtype != up.dtype:
        raise ValueError(f"situ_glu: gate and up must share a floating dtype, got {gate.dtype} and {up.dtype}")


FP32 = torch.finfo(torch.float32)
FP32_SMALLEST = 2.0**-149  # the smallest positive fp32 (subnormal); below it a bound is 0 there


def _check_bounds(b1, b2) -> None:
    for name, b in (("b1", b1), ("b2", b2)):
        # An infinite bound makes its factor b tanh(x / b) = inf * 0 = NaN; NaN fails every comparison.
        if isinstance(b, bool) or not isinstance(b, Real) or not (math.isfinite(b) and b > 0):
            fail("situ_glu", name, f"must be a finite number > 0, got {b!r}")
        # The math is fp32: a bound past its range is inf there (3.5e38 gave NaN), one below its
        # smallest positive value is 0 (x / 0 = NaN at x = 0).
        if not FP32_SMALLEST <= b <= FP32.max:
            fail("situ_glu", name, f"must be within fp32's positive range [{FP32_SMALLEST:.4g}, {FP32.max:.4g}], "
                                   f"got {b!r}")
    if b1 * b2 > FP32.max:  # |h| < b1 b2, and the gradients reach about b1 b2 / 4: both must stay finite
        fail("situ_glu", "b1 * b2", f"(the output's bound) must be <= fp32's max {FP32.max:.4g}, got {b1 * b2:.4g}")


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, b1: float = 4.0, b2: float = 25.0, *, backend: str | None = None
) -> torch.Tensor:
    """[..., I] x [..., I] -> [..., I]: [b1 tanh(gate/b1) sigmoid(gate)] * [b2 tanh(up/b2)].

    fp32 math, output in the inputs' dtype (bf16, fp16 or fp32); differentiable.
    b1, b2: the soft clamps of the gate and up factors, > 0, in fp32's range, b1 * b2 too.
    backend: None (Triton on CUDA, torch on CPU), "torch" or "triton".
    """
    _check(gate, up)
    _check_bounds(b1, b2)
    if use_triton("situ_glu", gate, backend):
        from .triton import situ_glu_triton

        return situ_glu_triton(gate, up, b1, b2)
    return situ_glu_torch(gate, up, b1, b2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, fp32 math; the Kimi Linear activation."""
    _check(gate, up)
    return naive_swiglu(gate, up)
