"""SequenceShard: this process's contiguous piece of a token stream that a group of processes
runs together (context parallelism), handed to the model's forward the way a CacheBatch is.

Every process of the group holds the whole stream's token ids and documents; each computes only
the tokens [bounds[rank], bounds[rank + 1]) and reaches the others' through `gather`, a
differentiable all-gather that whoever builds the shard supplies (k3.platform.train.context_parallel:
torch.distributed's autograd collective; the model itself never communicates). Each layer that
looks across tokens asks the shard for what it needs:

- KDA: the previous piece's last pre-conv rows (`previous_rows`) and every piece's
  (state, transition) pair, folded by `k3.kernels.kda.shards`;
- MLA: every piece's latents (`gather_stream`) and, per document piece, which keys its queries see
  (`attention_spans`);
- the loss: this piece's next-token targets and the whole stream's count (`num_targets`).

Documents (`cu_seqlens` over the whole stream) may cross pieces: a boundary resets the KDA state
and masks MLA on whichever process holds it.

Every process must run the same collectives in the same order, backward included: autograd runs
a gather's backward (a reduce-scatter) only where the gathered tensor reaches the loss, so what
a process takes from a gather stays in its graph even when it counts for nothing there (the
first piece has no previous rows and no earlier states: zeros computed from the gathered tensor).
"""
from __future__ import annotations

import bisect
import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class SequenceShard:
    """rank: this process in the group; bounds: [world + 1] stream offsets (ints), piece r =
    [bounds[r], bounds[r + 1]), each non-empty; cu_seqlens: [N + 1] documents over the whole
    stream (a 1-D integer tensor; None: one document); gather: x -> [world, *x.shape] in rank order, differentiable
    (its backward hands each process the gradient of its own x); every process calls it at the
    same points of the forward."""

    rank: int
    bounds: tuple[int, ...]
    cu_seqlens: torch.Tensor | None
    gather: Callable[[torch.Tensor], torch.Tensor]
    _docs: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # offsets are whole tokens: a float bound or offset was truncated without a word, and an
        # empty cu_seqlens failed with a bare IndexError
        if not isinstance(self.rank, numbers.Integral) or isinstance(self.rank, bool):
            raise ValueError(f"SequenceShard.rank must be an int, got {self.rank!r}")
        if not isinstance(self.bounds, (tuple, list)) or \
                not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in self.bounds):
            raise ValueError(f"SequenceShard.bounds must be a tuple of ints, got {self.bounds!r}"[:200])
        object.__setattr__(self, "bounds", tuple(int(x) for x in self.bounds))
        object.__setattr__(self, "rank", int(self.rank))
        cu = self.cu_seqlens
        if cu is not None and not (isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2
                                   and not cu.dtype.is_floating_point and not cu.dtype.is_complex
                                   and cu.dtype != torch.bool):
            what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"SequenceShard.cu_seqlens must be a 1-D integer tensor of >= 2 offsets (or None), got "
                             f"{what}")
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(e <= s for s, e in zip(b, b[1:])):
            raise ValueError(f"SequenceShard.bounds must rise strictly from 0, got {list(b)[:8]}")
        if not 0 <= self.rank < len(b) - 1:
            raise ValueError(f"SequenceShard.rank {self.rank} is not in [0, {len(b) - 1})")
        docs = (0, b[-1]) if self.cu_seqlens is None else tuple(self.cu_seqlens.tolist())
        if docs[0] != 0 or docs[-1] != b[-1] or any(e < s for s, e in zip(docs, docs[1:])):
            raise ValueError(f"SequenceShard.cu_seqlens must rise from 0 to the stream's {b[-1]} tokens, "
                             f"got {list(docs)[:8]}")
        object.__setattr__(self, "_docs", tuple(sorted(set(docs))))

    @property
    def longest_document(self) -> int:
        """Tokens in the stream's longest document (a sequence holds positions, a stream does not)."""
        return max(e - s for s, e in zip(self._docs, self._docs[1:]))

    # -- where this piece lies
    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This piece of a [B, total, ...] stream tensor: [B, end - start, ...]."""
        return x[:, self.start:self.end]

    @property
    def continues(self) -> bool:
        """Whether this piece's first document began on an earlier piece."""
        return self.start not in self._docs

    def doc_start(self, pos: int) -> int:
        """Stream offset where the document holding token `pos` begins."""
        return self._docs[bisect.bisect_right(self._docs, pos) - 1]

    def local_cu_seqlens(self, device: torch.device | None = None) -> torch.Tensor:
        """[n + 1] offsets of this piece's document pieces, local: 0, the boundaries inside, length."""
        inner = [d - self.start for d in self._docs if self.start < d < self.end]
        return torch.tensor([0, *inner, self.end - self.start], dtype=torch.long, device=device)

    def attention_spans(self) -> list[tuple[int, int, int, int]]:
        """(q0, q1, k0, k1) per document piece: local queries [q0, q1) see stream keys [k0, k1),
        causally aligned at the bottom right (query q sees keys up to start + q)."""
        cu = self.local_cu_seqlens().tolist()
        return [(a, b, self.doc_start(self.start + a), self.start + b) for a, b in zip(cu, cu[1:])]

    # -- what crosses pieces
    def gather_stream(self, x: torch.Tensor) -> torch.Tensor:
        """Every piece's rows of x [length, *] -> [total, *] in stream order (differentiable)."""
        if x.shape[0] != self.end - self.start:
            raise ValueError(f"gather_stream: x has {x.shape[0]} rows, the piece {self.end - self.start}")
        width = max(e - s for s, e in zip(self.bounds, self.bounds[1:]))
        pad = width - x.shape[0]
        padded = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
        every = self.gather(padded)  # [world, width, *]
        return torch.cat([every[r, : e - s] for r, (s, e) in enumerate(zip(self.bounds, self.bounds[1:]))])

    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The n stream rows before this piece (x [length, *] is this piece's), zero where they lie
        before this piece's first document or before the stream: [n, *]. Differentiable."""
        lengths = [e - s for s, e in zip(self.bounds, self.bounds[1:])]
        if n > min(lengths):
            raise ValueError(f"previous_rows: {n} rows reach past the previous piece (pieces of {min(lengths)} "
                             f"tokens; each must hold at least {n})")
        tails = self.gather(x[x.shape[0] - n:])  # [world, n, *]
        keep = torch.arange(self.start - n, self.start, device=x.device) >= self.doc_start(self.start)
        keep &= self.rank > 0 and self.continues
        # where, not a new zero tensor: the result stays in the graph of the gather on every
        # process (see the module docstring)
        return torch.where(keep.view(n, *[1] * (x.dim() - 1)), tails[max(self.rank - 1, 0)], 0.0)

    # -- the loss
    def next_token_targets(self, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """labels [1, total] -> (this piece's targets [1, length]: the next label, -100 at each
        document's last token and the stream's end; the count of targets over the whole stream)."""
        target = torch.full_like(labels, -100)
        target[:, :-1] = labels[:, 1:]
        ends = torch.tensor(self._docs[1:-1], dtype=torch.long, device=labels.device) - 1
        target[0, ends.clamp_min(0)] = -100
        return self.local(target), int((target != -100).sum())
