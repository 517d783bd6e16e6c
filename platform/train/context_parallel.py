"""Context parallelism, applied to a single-device K3 model from outside.

A training step's sequences become one token stream (each row a document, and each document the
data marks inside a row, `prepare(..., doc_starts=True)`); the stream is cut into C contiguous
pieces, one per rank of a context-parallel group, and every rank runs its piece with a
`k3.model.shard.SequenceShard` in the forward. The model asks the shard for what crosses pieces
(KDA's conv inputs and (state, transition) pairs, MLA's latents); here they travel through one
differentiable all-gather (torch's functional autograd collective: its backward is a
reduce-scatter, so each piece's gradients come back to the rank that owns it).

- groups: `cp_groups(rank, world, cp_size)`: consecutive ranks form a group, so ranks =
  DP x CP (rank = dp_rank * C + cp_rank); expert parallelism is independent of it (its
  all-to-all moves whatever tokens a rank holds);
- `ContextParallel.shard(tokens, doc_start)`: this rank's piece of a batch's stream, after a check
  that every rank of the group holds the same batch;
- the loss each rank reports is its piece's share of the stream's mean (the group's shares add up
  to it); the Trainer scales its backward by C because DeepSpeed averages gradients over every
  rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

from k3.model.shard import SequenceShard


def cp_groups(rank: int, world: int, cp_size: int) -> dist.ProcessGroup | None:
    """This rank's context-parallel group: ranks [C d, C d + C) for data-parallel index d.
    Every rank creates every group, as torch.distributed requires; None when C is 1."""
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"context_parallel={cp_size} must divide the world size {world}")
    if cp_size == 1:
        return None
    mine = None
    for start in range(0, world, cp_size):
        g = dist.new_group(list(range(start, start + cp_size)))
        if start <= rank < start + cp_size:
            mine = g
    return mine


def piece_problem(cp_size: int, seq_len: int, conv_size: int) -> str | None:
    """Why cp_size ranks cannot cut sequences of seq_len tokens into their pieces (None when they
    can): the pieces are equal (C divides the sequence) and, for C > 1, each holds KDA's conv window
    (conv_size - 1 tokens), which reaches back one piece only. The trainer's rule
    (TrainConfig.check) and the planner's (`k3 plan`)."""
    if seq_len % cp_size:
        return f"must divide the sequence of {seq_len} tokens"
    if cp_size > 1 and seq_len // cp_size < conv_size - 1:
        return (f"cuts the sequence of {seq_len} tokens into pieces shorter than the KDA conv window "
                f"({conv_size - 1} tokens)")
    return None


def stream_cu_seqlens(tokens: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
    """Documents of the stream tokens.reshape(-1) ([B, T] rows laid end to end): each row starts
    one, and so does every position doc_start [B, T] marks (1). Returns [N + 1] offsets."""
    B, T = tokens.shape
    starts = torch.zeros(B, T, dtype=torch.bool, device=tokens.device)
    starts[:, 0] = True
    if doc_start is not None:
        if doc_start.shape != tokens.shape:
            raise ValueError(f"doc_start shape {tuple(doc_start.shape)} != tokens shape {tuple(tokens.shape)}")
        starts |= doc_start.bool()
    flat = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([flat, flat.new_tensor([B * T])])


def piece_bounds(total: int, cp_size: int) -> tuple[int, ...]:
    """Stream offsets of the C pieces: as equal as integers allow (the last rank of a [T + 1]
    row gets the token that is only a label)."""
    return tuple(r * total // cp_size for r in range(cp_size + 1))


class ContextParallel:
    """One rank's place in its context-parallel group and the group's all-gather."""

    def __init__(self, group: dist.ProcessGroup | None, cp_size: int, cp_rank: int) -> None:
        self.group, self.size, self.rank = group, cp_size, cp_rank

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x -> [C, *x.shape], every rank's x in rank order; differentiable."""
        if self.size == 1:
            return x[None]
        out = wait_tensor(all_gather_single_autograd(x.contiguous().reshape(1, *x.shape), 0, self.group))
        return out.view(self.size, *x.shape)

    def shard(self, tokens: torch.Tensor, doc_start: torch.Tensor | None = None) -> tuple[torch.Tensor, SequenceShard]:
        """A batch's tokens [B, T] (and its document starts) -> (the stream [1, B T], this rank's
        SequenceShard). Every rank of the group must pass the same batch (checked)."""
        stream = tokens.reshape(1, -1)
        self._check_same(stream)
        bounds = piece_bounds(stream.shape[1], self.size)
        if min(b - a for a, b in zip(bounds, bounds[1:])) < 1:
            raise ValueError(f"a stream of {stream.shape[1]} tokens cannot be cut into {self.size} pieces")
        return stream, SequenceShard(self.rank, bounds, stream_cu_seqlens(tokens, doc_start), self.gather)

    def _check_same(self, stream: torch.Tensor) -> None:
        """Ranks of a group reading different batches would train on a stream no one holds."""
        if self.size == 1:
            return
        weights = torch.arange(1, stream.numel() + 1, device=stream.device, dtype=torch.long) % 65521
        mine = torch.stack([stream.new_tensor(stream.numel()), (stream.reshape(-1).long() * weights).sum()])
        every = self.gather(mine)
        if not bool((every == mine).all()):
            raise RuntimeError(f"context-parallel ranks hold different batches (length, checksum per rank: "
                               f"{every.tolist()}): each rank of a group must read the same sequences")
