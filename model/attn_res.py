"""Block Attention Residuals.

Instead of adding every sub-layer's output into one residual stream, the stack keeps block
representations: the embedding is block 0, and inside a block of `attn_res_block_size` decoder
layers the sub-layer outputs (attention side and MLP side) are summed into a partial block.
Each sub-layer reads a softmax mixture over depth of the completed blocks and the running
partial sum, weighted by softmax_i(w_l . RMSNorm(v_i)) with w_l a learned pseudo-query
(zero at init: uniform mixing). The final norm reads the same mixture over every block.

Two ways to compute a sub-layer's input, tested against each other:
- `mix_naive`: one softmax over all sources;
- `BlockStats` + `merge_partial`: at each block start, one batched pass over the completed
  blocks gives every sub-layer of the block its (max, normaliser, weighted sum); each
  sub-layer then merges the partial sum in with an online-softmax update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .norm import rms_norm


def mix_naive(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """sources: list of [..., D]; query: [D] -> sum_i softmax_i(query . rms(v_i)) v_i."""
    V = torch.stack([s.float() for s in sources])  # [n, ..., D]
    logits = (rms_norm(V, None, eps) * query.float()).sum(-1)  # [n, ...]
    a = torch.softmax(logits, dim=0)
    return (a[..., None] * V).sum(0).to(sources[0].dtype)


@dataclass
class BlockStats:
    """Softmax pieces over completed blocks for the S sub-layers of one block.

    m [S, ...] running max, z [S, ...] sum of exp(logit - m), h [S, ..., D] sum of exp(logit - m) v.
    """

    m: torch.Tensor
    z: torch.Tensor
    h: torch.Tensor

    @classmethod
    def compute(cls, blocks: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor) -> "BlockStats":
        """blocks, keys: [n, ..., D] (keys = rms(blocks)); queries: [S, D]."""
        logits = torch.einsum("n...d,sd->s...n", keys, queries.float())
        m = logits.amax(-1)
        e = (logits - m[..., None]).exp()
        h = torch.einsum("s...n,n...d->s...d", e, blocks)
        return cls(m, e.sum(-1), h)


def merge_partial(stats: BlockStats, s: int, partial: torch.Tensor | None, query: torch.Tensor, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Input of the block's s-th sub-layer: completed-block stats merged with the partial sum."""
    m, z, h = stats.m[s], stats.z[s], stats.h[s]
    if partial is None:
        return (h / z[..., None]).to(dtype)
    pf = partial.float()
    lp = (rms_norm(pf, None, eps) * query.float()).sum(-1)
    m2 = torch.maximum(m, lp)
    a, b = (m - m2).exp(), (lp - m2).exp()
    return ((h * a[..., None] + pf * b[..., None]) / (z * a + b)[..., None]).to(dtype)


class BlockAttnRes(nn.Module):
    """Pseudo-queries for every sub-layer (2 per decoder layer) and one for the final readout."""

    def __init__(self, hidden_size: int, num_layers: int, block_size: int, eps: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.num_sublayers = 2 * num_layers
        self.eps = eps
        self.queries = nn.Parameter(torch.zeros(self.num_sublayers + 1, hidden_size))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.queries)

    def block_start(self, l: int) -> bool:
        return l > 0 and l % (2 * self.block_size) == 0

    def block_range(self, l: int) -> range:
        return range(l, min(l + 2 * self.block_size, self.num_sublayers))
