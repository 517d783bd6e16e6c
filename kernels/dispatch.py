"""What every op's public function shares: its ValueError, and the choice of Triton or torch."""
from __future__ import annotations

import math
import os
from numbers import Real
from typing import NoReturn

import torch


def fail(op: str, name: str, msg: str) -> NoReturn:
    """Raise the ops' one error form: "<op>: <argument> <what is wrong>"."""
    raise ValueError(f"{op}: {name} {msg}")


def check_scale(op: str, scale, default: float | None) -> float:
    """The softmax/readout scale as a float: `default` for None (an op without one refuses None);
    a number or a one-element real tensor, finite and > 0 (NaN or inf made every output NaN)."""
    if scale is None:
        if default is None:
            fail(op, "scale", "is required: a finite number > 0, got None")
        return default
    ok = (isinstance(scale, Real) and not isinstance(scale, bool)) or (
        isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.dtype != torch.bool and not scale.is_complex())
    value = float(scale) if ok else math.nan
    if not (math.isfinite(value) and value > 0):
        fail(op, "scale", f"must be a finite number > 0, got {scale!r}")
    return value


def eager() -> bool:
    """False while a graph is being captured (torch.compile tracing, CUDA graph capture).

    Value checks read tensors back to the host, which a captured graph cannot do (nor should a
    replay pay for); they run in eager calls only. Shape, dtype and device checks always run:
    for a graph, once at capture. Dynamo's own flag, not `torch.compiler.is_compiling()`: that one
    is process-wide while any thread compiles (torch 2.13), and an engine's eager steps run beside
    its decode graphs' background compile."""
    if torch.compiler.is_dynamo_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def use_triton(op: str, x: torch.Tensor, backend: str | None) -> bool:
    """True for CUDA tensors when triton is installed, or when `backend="triton"` forces it
    (then on CPU only under TRITON_INTERPRET=1); False for `backend="torch"` and CPU tensors.
    Op-specific limits (head dims, ...) are the caller's to check after this."""
    if backend not in (None, "torch", "triton"):
        fail(op, "backend", f"must be None, 'torch' or 'triton', got {backend!r}")
    if backend == "torch" or (backend is None and not x.is_cuda):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        if backend == "triton":
            fail(op, "backend", "'triton' needs the triton package")
        return False
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        fail(op, "backend", f"'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    return True
