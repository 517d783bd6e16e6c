"""SiTU-GLU activation (K3's expert activation) and SwiGLU, with shape checks.

`situ_glu(gate, up)` computes in fp32 and returns the inputs' dtype. The readable reference
with the same signature is `naive_situ_glu`.
"""
from __future__ import annotations

import torch

from .reference import naive_situ_glu, naive_swiglu

__all__ = ["situ_glu", "swiglu", "naive_situ_glu", "naive_swiglu"]


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if gate.device != up.device:
        raise ValueError(f"situ_glu: gate is on {gate.device} but up is on {up.device}")
    if not gate.is_floating_point() or gate.dtype != up.dtype:
        raise ValueError(f"situ_glu: gate and up must share a floating dtype, got {gate.dtype} and {up.dtype}")


def situ_glu(gate: torch.Tensor, up: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    """[..., I] x [..., I] -> [..., I]; fp32 math, output in the input dtype."""
    _check(gate, up)
    if b1 <= 0 or b2 <= 0:
        raise ValueError(f"situ_glu: b1 and b2 must be positive, got b1={b1}, b2={b2}")
    return naive_situ_glu(gate, up, b1, b2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, fp32 math; the Kimi Linear activation."""
    _check(gate, up)
    return naive_swiglu(gate, up)
