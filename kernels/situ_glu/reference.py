"""Readable SiTU-GLU: h = [b1 tanh(g / b1) sigmoid(g)] * [b2 tanh(u / b2)], in fp32.

Both factors are soft-clamped (|gate factor| < b1, |up factor| < b2), so |h| < b1 * b2 (100 with
K3's 4 and 25) whatever the pre-activations do; near zero it equals SiLU(g) * u.
"""
from __future__ import annotations

import torch


def naive_situ_glu(gate: torch.Tensor, up: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    g, u = gate.float(), up.float()
    h = (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))
    return h.to(gate.dtype)


def naive_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
