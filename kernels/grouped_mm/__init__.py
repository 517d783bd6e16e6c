"""Grouped matmul: the rows of x, sorted by group, each group times its own matrix (MoE experts).

`grouped_mm(x, w, offs)` runs every group in one call, with no host sync and no padding:
`torch._grouped_mm` where this build has it for the dtype and device (CPU: fp32, bf16 and fp16;
CUDA: bf16) and the layout suits it (strides of 16 bytes), otherwise the per-group loop of the
readable reference `naive_grouped_mm` (same signature). It is registered as the custom op
`k3::grouped_mm`, so `torch.compile` keeps it as one opaque call (the fake-tensor rule of
`torch._grouped_mm` accepts only bf16), with its own backward: dx = dy w^T per group (the same
op), dw = x^T dy per group (`k3::grouped_mm_weight_grad`, opaque as well). Eagerly with nothing to
differentiate (inference) the op's body runs without its dispatch.
"""
from __future__ import annotations

import torch

from ..dispatch import eager, fail
from .reference import naive_grouped_mm

__all__ = ["grouped_mm", "naive_grouped_mm"]


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: one of the last two dims unit-strided, the other's stride
    a multiple of 16 bytes (and, on CUDA, a 16-byte aligned start)."""
    a, b = t.stride()[-2:]
    step = 16 // t.element_size()
    lead = b if a == 1 else a if b == 1 else None
    return lead is not None and lead % step == 0 and (not t.is_cuda or t.data_ptr() % 16 == 0)


# The dtypes torch._grouped_mm takes on CPU (torch 2.13: "Expected mat_a to be Float32, BFloat16 or
# Float16"); fp64 and the rest run the reference loop.
CPU_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native(*ts: torch.Tensor) -> bool:
    x = ts[0]
    return hasattr(torch, "_grouped_mm") and (
        (x.device.type == "cpu" and x.dtype in CPU_NATIVE_DTYPES) or (x.is_cuda and x.dtype == torch.bfloat16)
    ) and all(_aligned(t) for t in ts)


def _forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _native(x, w):
        # its output rows are padded to 16 bytes: contiguous, as the fake rule says
        return torch._grouped_mm(x, w, offs=offs).contiguous()
    return naive_grouped_mm(x, w, offs)


_grouped_mm = torch.library.custom_op("k3::grouped_mm", mutates_args=())(_forward)


@_grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("k3::grouped_mm_weight_grad", mutates_args=())
def _weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, K, N]: x_g^T dy_g per group (zero for an empty group). A custom op too, so a compiled
    backward keeps it opaque (traced, `torch._grouped_mm` would meet its bf16-only fake rule)."""
    if _native(x.t(), dy):
        return torch._grouped_mm(x.t(), dy, offs=offs)
    out = x.new_zeros(offs.numel(), x.shape[1], dy.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = x[start:end].t() @ dy[start:end]
        start = end
    return out


@_weight_grad.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = _grouped_mm(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = _weight_grad(x, dy, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm.register_autograd(_backward, setup_context=_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] rows sorted by group; w [G, K, N] (any strides); offs [G] int32, the cumulative
    group sizes (offs[-1] == M; group g is rows offs[g-1]:offs[g]) -> [M, N] in x's dtype.

    offs must rise from >= 0 to M: the native op leaves rows past offs[-1] uninitialised and
    reads rows past M. Its values are checked where that costs no device sync (CPU, eager);
    on a GPU or in a traced graph offs is trusted as built by its callers (a cumsum of counts).
    Differentiable in x and w.
    """
    for name, t in (("x", x), ("w", w), ("offs", offs)):
        if not isinstance(t, torch.Tensor):
            fail("grouped_mm", name, f"must be a tensor, got {type(t).__name__}")
    if x.dim() != 2 or not x.is_floating_point():
        fail("grouped_mm", "x", f"must be a floating [M, K] tensor, got {tuple(x.shape)} {x.dtype}")
    if w.dim() != 3 or w.shape[1] != x.shape[1] or w.dtype != x.dtype:
        fail("grouped_mm", "w", f"must be [G, K={x.shape[1]}, N] in {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    if offs.shape != (w.shape[0],) or offs.dtype != torch.int32:
        fail("grouped_mm", "offs", f"must be int32 [G={w.shape[0]}], got {tuple(offs.shape)} {offs.dtype}")
    for name, t in (("w", w), ("offs", offs)):
        if t.device != x.device:
            fail("grouped_mm", name, f"is on {t.device} but x is on {x.device}")
    if offs.device.type == "cpu" and type(offs) is torch.Tensor and eager():
        _check_offs(offs, x.shape[0])
    x = x.contiguous()
    if type(x) is type(w) is torch.Tensor and not torch.compiler.is_dynamo_compiling() and \
            not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return _forward(x, w, offs)  # eager, nothing to record or trace: the op's dispatch costs ~40 us
    return _grouped_mm(x, w, offs)


def _check_offs(offs: torch.Tensor, M: int) -> None:
    """offs [G] on the CPU rises from >= 0 to M. Read as a list and compared in C (a few us beside
    the native call; numpy's and torch's small ops cost 10-20)."""
    o = offs.tolist()
    bad = o[0] < 0 or o[-1] != M or o != sorted(o) if o else M != 0  # no groups: no rows
    if bad:
        fail("grouped_mm", "offs", f"must rise from >= 0 to M={M} (cumulative group sizes), got "
                                   f"{o[:8]}{'...' if len(o) > 8 else ''}")
