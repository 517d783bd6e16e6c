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


def kimi_linear_torch_only():
    """transformers' Kimi Linear module with its own torch paths.

    transformers decides at import time whether `chunk_kda` and friends come from fla (Triton,
    GPU only) or from its torch fallback; on a CPU-only machine with fla installed that choice
    is wrong. Import the module with fla and causal_conv1d hidden, then unhide them.
    """
    import importlib
    import sys

    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name in sys.modules:
        mod = sys.modules[name]
    else:
        hidden = {k: sys.modules.get(k) for k in ("fla", "causal_conv1d")}
        try:
            for k in hidden:
                sys.modules[k] = None  # makes `import k` raise ImportError
            mod = importlib.import_module(name)
        finally:
            for k, v in hidden.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
    return mod
