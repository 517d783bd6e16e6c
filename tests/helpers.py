"""Shared test utilities (imported as `helpers` via conftest's sys.path entry)."""
from __future__ import annotations

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / ||e|| (fla's measure), safe for an all-zero reference."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.pow(2).mean().sqrt().clamp_min(1e-30)
    return float((a - e).pow(2).mean().sqrt() / denom)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.0e}"
