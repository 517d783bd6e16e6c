"""The prefill -> decode handoff: one request's whole hybrid cache state as plain numpy arrays.

`HybridCacheState` carries, for a prompt that one engine prefilled and sampled a first token
for: per KDA layer the fp32 recurrent state and the conv state after the prompt; per MLA layer
the prompt's latents in position order (page order, concatenated); the prompt's token ids and
page hashes; the first token with its logprob entry; and the request's sampling state (the
seeded generator's state after the first draw), so a seeded sampled request continues exactly.
A multimodal prompt adds its media spans (placeholder range + content digest per item, which
the page hashes were computed with) and the items' feature rows: the decode engine checks the
hashes against ids + spans, and recomputes from the rows if it must, never from pixels.

Numpy rather than torch: numpy arrays come out of Ray's object store zero-copy with no setting
(torch tensors only with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1); bf16, which numpy lacks, travels
as its raw 16-bit pattern and is viewed back on import. jobs/bench_engine.py measures both.

Every array is covered by a blake2b digest and the engine checks version, model fingerprint,
page size, shapes, dtypes, token ids and digest before it touches its own memory: a state from
another model, a truncated or corrupted one, or one for another prompt is refused, never loaded.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .media import MediaSpan

STATE_VERSION = 2  # 2: media spans and rows

_NP_FROM_TORCH = {torch.float32: ("float32", None), torch.bfloat16: ("bfloat16", torch.int16),
                  torch.float16: ("float16", None)}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy; bf16 as its int16 bit pattern."""
    view = _NP_FROM_TORCH.get(t.dtype, (None, None))[1]
    t = t.detach().to("cpu").contiguous()
    return (t.view(view) if view is not None else t).numpy().copy()


def to_torch(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device)


@dataclass
class HybridCacheState:
    version: int
    model_fingerprint: str  # config + weights sample + cache dtype (LLMEngine.fingerprint)
    page_size: int
    cache_dtype: str  # "float32" | "bfloat16": the conv state and latents as stored
    prompt_token_ids: np.ndarray  # [n] int64
    page_hashes: list[bytes]  # chain hashes of the full prompt pages
    kda_recurrent: dict[int, np.ndarray]  # layer -> [H, K, V] float32
    kda_conv: dict[int, np.ndarray]  # layer -> [3HK, W-1] (int16 bit pattern for bf16)
    mla_latents: dict[int, np.ndarray]  # layer -> [n, latent]
    first_token: int
    first_logprob: dict | None  # {"token", "logprob", "top": {id: lp}} when logprobs were asked
    generator_state: np.ndarray | None  # uint8, the request's seeded generator after its first draw
    media_spans: list[MediaSpan] = field(default_factory=list)  # per item: placeholder range, content digest
    media_rows: np.ndarray | None = None  # [P, hidden] float32: the feature rows of the P placeholders
    digest: bytes = field(default=b"")
    # Bookkeeping outside the digest: seconds the exporter spent building and sealing the state
    # ("export_s") and the importer spent checking and converting it ("check_s").
    timings: dict[str, float] = field(default_factory=dict)

    def arrays(self) -> list[tuple[str, np.ndarray]]:
        out = [("prompt_token_ids", self.prompt_token_ids)]
        for name, d in (("kda_recurrent", self.kda_recurrent), ("kda_conv", self.kda_conv),
                        ("mla_latents", self.mla_latents)):
            out += [(f"{name}[{k}]", d[k]) for k in sorted(d)]
        if self.generator_state is not None:
            out.append(("generator_state", self.generator_state))
        if self.media_rows is not None:
            out.append(("media_rows", self.media_rows))
        return out

    def compute_digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.version, self.model_fingerprint, self.page_size, self.cache_dtype, self.first_token,
                       self.first_logprob, list(self.page_hashes),
                       [(s.start, s.end, s.digest) for s in self.media_spans])).encode())
        for name, a in self.arrays():
            h.update(f"{name}:{a.dtype}:{a.shape}".encode())
            h.update(np.ascontiguousarray(a).view(np.uint8).data)
        return h.digest()

    def seal(self) -> "HybridCacheState":
        self.digest = self.compute_digest()
        return self

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays())


@dataclass
class PoolPage:
    """One prompt page as the shared prefix pool holds it (serve/prefix_pool.py)."""

    hash: bytes  # the page's chain hash (covers every token before it)
    depth: int  # 1-based position of the page in its prompt
    tokens: tuple[int, ...]  # the page's own tokens (checked on load, as local hits are)
    latents: dict[int, np.ndarray]  # MLA layer -> [page_size, latent]
    snapshot: dict[int, tuple[np.ndarray, np.ndarray]] | None  # KDA layer -> (conv, recurrent) after the page

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for a in self.latents.values())
        if self.snapshot is not None:
            n += sum(c.nbytes + r.nbytes for c, r in self.snapshot.values())
        return n
