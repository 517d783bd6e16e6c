"""Images and video chunks in the engine: where each item's placeholders are, what it hashes to,
and its feature rows, encoded once and sliced per prefill chunk.

A multimodal prompt is token ids in which every media item (a `k3.model.vision_processor.MediaItem`:
an image or a 4-frame video chunk, already patchified) owns a run of `media_placeholder_token_id`
tokens; item i fills the next `num_tokens` placeholders in order. Its `MediaSpan` is the range from
its first to its last placeholder and a digest of its content.

- Prefix caching: the digest of every item is mixed into the chain hash of every page its span
  covers (`page_hashes(..., media=spans)` in cache_manager.py), and through the chain into every
  later page. The same picture in a repeated conversation gives the same hashes (a hit); another
  picture of the same size gives the same token ids but other hashes (a miss).
- The engine computes the digest itself from the patches (never trusts a caller's hash: a wrong
  one would serve one picture's cached latents for another).
- Encoding: at most once per request, at the first prefill chunk that holds a placeholder (a
  prefix hit that covers every placeholder needs no rows at all), and not even that for an item
  whose rows are still in the engine's MediaRowCache (by digest); the rows are kept with the
  sequence, so a preempted or recomputed request reuses them. Each chunk gets exactly the rows
  of the placeholders it holds.
- Handoff: a decode engine receives the spans and the rows with the cache state, checks the
  page hashes against them and never needs the pixels.
"""
from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from k3.model.vision_config import K3VisionConfig
from k3.model.vision_processor import MediaItem


@dataclass(frozen=True)
class MediaSpan:
    """Where one media item sits in a prompt and what it is."""

    start: int  # position of its first placeholder
    end: int  # one past its last placeholder
    digest: bytes  # blake2b-128 of kind, grid and patches (media_digest)


def media_digest(item: MediaItem) -> bytes:
    """Content hash of an item: its kind, patch grid and patch values (same picture, same bytes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{item.kind}:{tuple(item.grid_thw)}:{tuple(item.pixel_values.shape)}:".encode())
    h.update(item.pixel_values.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.digest()


def placeholder_positions(prompt: Seq[int], placeholder_id: int) -> list[int]:
    return [i for i, t in enumerate(prompt) if t == placeholder_id]


def check_item(item: object, i: int, vc: K3VisionConfig) -> MediaItem:
    """One item as the tower `vc` takes it (grid within its rotary table and frame limit, patches
    matching the grid, token count matching the merge); a ValueError naming media[i] otherwise."""
    if not isinstance(item, MediaItem):
        raise ValueError(f"media[{i}] must be a MediaItem (k3.model.vision_processor), got {type(item).__name__}")
    g = tuple(item.grid_thw)
    if len(g) != 3 or any(not isinstance(v, int) or v <= 0 for v in g):
        raise ValueError(f"media[{i}].grid_thw must be three positive ints, got {item.grid_thw!r}")
    t, h, w = g
    if max(h, w) > vc.rope_max_grid or t > vc.init_pos_emb_time:
        raise ValueError(f"media[{i}].grid_thw {g}: the tower takes at most {vc.init_pos_emb_time} frames and "
                         f"{vc.rope_max_grid} patches per side")
    patch_size, merge = vc.patch_size, tuple(vc.merge_kernel_size)
    want = (t * h * w, 3, patch_size, patch_size)
    pv = item.pixel_values
    if not isinstance(pv, torch.Tensor) or tuple(pv.shape) != want or not pv.is_floating_point():
        raise ValueError(f"media[{i}].pixel_values must be a float tensor {list(want)} for grid {g}, got "
                         f"{getattr(pv, 'shape', type(pv).__name__)}")
    kh, kw = merge
    if h % kh or w % kw or item.num_tokens != (h // kh) * (w // kw):
        raise ValueError(f"media[{i}].num_tokens={item.num_tokens} does not match grid {g} merged {kh}x{kw}")
    return item


def media_spans(prompt: Seq[int], items: Seq[MediaItem], placeholder_id: int) -> tuple[list[int], list[MediaSpan]]:
    """(placeholder positions, one span per item): item i takes the next num_tokens placeholders.
    ValueError naming both counts when the prompt's placeholders and the items' tokens differ."""
    pos = placeholder_positions(prompt, placeholder_id)
    need = sum(it.num_tokens for it in items)
    if len(pos) != need:
        raise ValueError(f"the prompt holds {len(pos)} media placeholder tokens (id {placeholder_id}) but its "
                         f"{len(items)} media item(s) fill {need}")
    spans, k = [], 0
    for it in items:
        spans.append(MediaSpan(pos[k], pos[k + it.num_tokens - 1] + 1, media_digest(it)))
        k += it.num_tokens
    return pos, spans


def check_spans(prompt: Seq[int], spans: Seq[MediaSpan], placeholder_id: int | None) -> list[int]:
    """Spans handed over with a cache state must describe this prompt: in order, not overlapping,
    each starting and ending on a placeholder, together covering every placeholder. Returns the
    placeholder positions; ValueError otherwise."""
    pos = placeholder_positions(prompt, placeholder_id) if placeholder_id is not None else []
    covered, last = 0, 0
    for j, s in enumerate(spans):
        if not isinstance(s, MediaSpan) or not isinstance(s.digest, bytes) or len(s.digest) != 16:
            raise ValueError(f"media span {j} is not a MediaSpan with a 16-byte digest")
        if not last <= s.start < s.end <= len(prompt) or prompt[s.start] != placeholder_id or \
                prompt[s.end - 1] != placeholder_id:
            raise ValueError(f"media span {j} [{s.start}, {s.end}) does not start and end on placeholders "
                             f"after the previous span, inside the {len(prompt)}-token prompt")
        covered += bisect.bisect_left(pos, s.end) - bisect.bisect_left(pos, s.start)
        last = s.end
    if covered != len(pos):
        raise ValueError(f"media spans cover {covered} of the prompt's {len(pos)} placeholder tokens")
    return pos


class MediaRowCache:
    """Feature rows of recently encoded items by content digest, least recently used out first,
    within a byte budget: the same picture in another request (another conversation, or a
    prefill replica that must hand the rows over after a prefix hit) skips the tower."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.bytes = budget_bytes, 0
        self.rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, digest: bytes) -> torch.Tensor | None:
        r = self.rows.get(digest)
        if r is not None:
            self.rows.move_to_end(digest)
        return r

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        n = rows.numel() * rows.element_size()
        if n > self.budget or digest in self.rows:
            return
        self.rows[digest] = rows
        self.bytes += n
        while self.bytes > self.budget:
            _, old = self.rows.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


class SequenceMedia:
    """One request's media in the engine: items (None where the request was imported), spans,
    placeholder positions, and the feature rows [P, hidden] once encoded."""

    def __init__(self, items: list[MediaItem] | None, spans: list[MediaSpan], positions: list[int],
                 rows: torch.Tensor | None = None) -> None:
        self.items, self.spans, self.positions, self.rows = items, spans, positions, rows

    def needs_rows(self, lo: int, hi: int) -> bool:
        """Whether tokens [lo, hi) hold a placeholder and the rows are not there yet."""
        return self.rows is None and bisect.bisect_left(self.positions, lo) < bisect.bisect_left(self.positions, hi)

    def rows_for(self, lo: int, hi: int) -> torch.Tensor | None:
        """The rows of the placeholders at positions [lo, hi), in order ([k, hidden]; None if k = 0)."""
        a, b = bisect.bisect_left(self.positions, lo), bisect.bisect_left(self.positions, hi)
        if a == b:
            return None
        assert self.rows is not None, "rows are encoded before a chunk that needs them is built"
        return self.rows[a:b]

    def encode(self, model, cache: MediaRowCache | None = None) -> int:
        """The rows of every item: from the cache where it has them, the rest through the tower +
        projector at once (packed; equal to each alone). Returns the number of items encoded."""
        per = [cache.get(s.digest) if cache is not None else None for s in self.spans]
        todo = [i for i, r in enumerate(per) if r is None]
        if todo:
            pv = torch.cat([self.items[i].pixel_values for i in todo])
            dev = next(model.parameters()).device
            dtype = next(model.vision_tower.parameters()).dtype
            new = model.encode_media(pv.to(dev, dtype), [tuple(self.items[i].grid_thw) for i in todo])
            for i, r in zip(todo, new):
                if r.shape[0] != self.items[i].num_tokens:  # the tower's merge must agree with num_tokens
                    raise ValueError(f"the tower made {r.shape[0]} rows for media item {i}'s "
                                     f"{self.items[i].num_tokens} placeholders")
                per[i] = r
                if cache is not None:
                    cache.put(self.spans[i].digest, r)
        self.rows = torch.cat(per)
        return len(todo)
