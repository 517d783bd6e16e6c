"""SiTU-GLU on CPU: a custom autograd.Function that computes in fp32, block by block.

Autograd through the readable formula keeps five fp32 intermediates of the full [..., I] size
alive for backward and streams each through memory once per op. Here forward and backward walk
the flattened tensors in cache-sized blocks (every temporary stays in L2), backward recomputes
the activation from the saved inputs (in their own dtype), and nothing else is stored.

    A(g) = b1 tanh(g / b1) sigmoid(g),   A'(g) = sigmoid(g) [(1 - t^2) + b1 t (1 - sigmoid(g))], t = tanh(g / b1)
    B(u) = b2 tanh(u / b2),              B'(u) = 1 - tanh(u / b2)^2
    h = A(g) B(u)
"""
from __future__ import annotations

import torch

BLOCK = 1 << 16  # elements per block: 256 KB per fp32 temporary


def _blocks(n: int):
    return [(i, min(i + BLOCK, n)) for i in range(0, n, BLOCK)]


class _SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, b1, b2):
        g_flat, u_flat = gate.reshape(-1), up.reshape(-1)
        out = torch.empty_like(gate)
        o_flat = out.view(-1)
        for lo, hi in _blocks(g_flat.numel()):
            # .float() of an fp32 input is the input itself: no in-place op on g or u.
            g = g_flat[lo:hi].float()
            u = u_flat[lo:hi].float()
            a = torch.tanh(g / b1).mul_(b1).mul_(torch.sigmoid(g))
            o_flat[lo:hi] = a.mul_(torch.tanh(u / b2).mul_(b2))
        ctx.save_for_backward(gate, up)
        ctx.b1, ctx.b2 = b1, b2
        return out

    @staticmethod
    # the blocked backward works in place: torch cannot differentiate it again
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        b1, b2 = ctx.b1, ctx.b2
        g_flat, u_flat, d_flat = gate.reshape(-1), up.reshape(-1), dh.reshape(-1)
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        dg_flat, du_flat = dgate.view(-1), dup.view(-1)
        for lo, hi in _blocks(g_flat.numel()):
            g = g_flat[lo:hi].float()
            d = d_flat[lo:hi].float()
            s = torch.sigmoid(g)
            t = torch.tanh(g / b1)
            a = t * s * b1
            da = (1 - t * t).add_(t.mul_(b1).mul_(1 - s)).mul_(s)  # A'(g)
            tu = torch.tanh(u_flat[lo:hi].float() / b2)
            dg_flat[lo:hi] = da.mul_(tu * b2).mul_(d)
            du_flat[lo:hi] = tu.mul_(tu).neg_().add_(1).mul_(a).mul_(d)
        return dgate, dup, None, None


def situ_glu_torch(gate: torch.Tensor, up: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    """[..., I] x [..., I] -> [..., I] in the inputs' dtype; fp32 math; differentiable.

    Traced by torch.compile, the formula itself: inductor fuses it into one loop, and the blocks'
    Python range over the element count would pin every size it depends on (the batch) to a
    constant in the graph."""
    if torch.compiler.is_dynamo_compiling():
        g, u = gate.float(), up.float()
        return (torch.tanh(g / b1) * b1 * torch.sigmoid(g) * (torch.tanh(u / b2) * b2)).to(gate.dtype)
    return _SituGLU.apply(gate.contiguous(), up.contiguous(), float(b1), float(b2))
