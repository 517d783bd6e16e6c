"""Where every chunkwise KDA path cuts a (packed) batch into chunks: one table for all of them."""
from __future__ import annotations

import torch


class ChunkTable:
    """The chunks of a packed batch, at most `size` tokens each, in token order.

    A sequence is cut every `size` tokens from its start and also at every offset in `cuts`
    ({sequence: [offsets]}), so the chunk-to-chunk pass crosses each asked-for offset: the state
    entering the chunk that starts there is the state after that many tokens, at any offset, for
    the cost of one more (shorter) chunk. Chunk j covers flat tokens bounds[j] = [start, end);
    the chunks of sequence i are first[i] .. first[i + 1] - 1.

    cu_seqlens: [N + 1] offsets on the batch's device; cuts: checked offsets in (0, length].
    """

    def __init__(self, cu_seqlens: torch.Tensor, size: int, cuts: dict[int, list[int]] | None = None) -> None:
        cu = cu_seqlens.long()
        dev = cu.device
        lengths = cu[1:] - cu[:-1]
        per_seq = (lengths + size - 1) // size
        n = int(per_seq.sum())
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), per_seq, output_size=n)
        within = torch.arange(n, device=dev) - (per_seq.cumsum(0) - per_seq)[seq]
        starts = cu[seq] + within * size
        cuts = cuts or {}
        host_cu = cu.tolist() if cuts else []
        # an offset at a sequence's end cuts nothing: the state after it is the final state
        inner = [host_cu[i] + off for i, offs in cuts.items() for off in offs if host_cu[i] + off < host_cu[i + 1]]
        if inner:
            starts = torch.unique(torch.cat([starts, torch.tensor(inner, dtype=torch.long, device=dev)]))
        self.size = size
        self.num_chunks = starts.numel()
        self.num_seqs = lengths.numel()
        # Every non-empty sequence begins a chunk, so a chunk ends where the next one starts.
        ends = torch.cat([starts[1:], cu[-1:]])[: starts.numel()]
        self.bounds = torch.stack([starts, ends], 1).contiguous()  # [NT, 2]
        self.first = torch.searchsorted(starts, cu).contiguous()  # [N + 1]
        self.state_chunk = self._state_chunks(cuts, host_cu, starts)

    @staticmethod
    def _state_chunks(cuts, host_cu, starts) -> dict[tuple[int, int], int]:
        """{(sequence, offset): the chunk whose entering state is the state after offset, or -1
        when the offset is the sequence's end (its final state)}."""
        keys = [(i, off) for i, offs in sorted(cuts.items()) for off in offs]
        pos = torch.tensor([host_cu[i] + off for i, off in keys], dtype=torch.long, device=starts.device)
        at = torch.searchsorted(starts, pos).tolist() if keys else []
        return {(i, off): -1 if host_cu[i] + off == host_cu[i + 1] else j for (i, off), j in zip(keys, at)}
