"""The engine's one connector to other engines (vLLM's KV connector in role): the prefill ->
decode handoff of a prompt's whole hybrid cache state, and the prefix pool's pages. Export builds
them from the CacheManager's memory; import checks everything before anything is allocated and
loads it through the CacheManager. The engine loop only calls `export_state` / `check_state`
and the pool methods.

`HybridCacheState` carries, for a prompt that one engine prefilled and sampled a first token
for: per KDA layer the fp32 recurrent state and the conv state after the prompt; per MLA layer
the prompt's latents in position order; the prompt's token ids and page hashes; the first token
with its logprob entry; and the seeded generator's state after the first draw, so a seeded
sampled request continues exactly. A multimodal prompt adds its media spans (placeholder range
+ content digest per item, which the page hashes were computed with) and the items' feature
rows: the decode engine checks the hashes against ids + spans and recomputes from the rows if it
must, never from pixels. A `PoolPage` is one prompt page: its latents and, maybe, the KDA
snapshot after it.

Numpy rather than torch: numpy arrays come out of Ray's object store zero-copy with no setting
(torch tensors only with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1); bf16, which numpy lacks, travels
as its raw 16-bit pattern and is viewed back on import. jobs/bench_engine.py measures both.

Trust: both are sealed with a keyed BLAKE3 MAC under `EngineConfig.handoff_key`, a secret the
engines that exchange states share (the Serve builders give every replica of an application the
one its config drew); a state sealed under another key, or changed and resealed by someone
without it, is refused. What passes is then checked as strictly as what the engine computes
itself (version, model fingerprint, page size, shapes, dtypes, finite values, token ids, page
hashes, generator state) on a private copy, so a caller cannot change it after the check. An
import adds pages and snapshots the engine lacks and never replaces what it holds.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import hmac
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import blake3
import numpy as np
import torch

from k3.model import K3ForCausalLM

from .cache_manager import CacheManager, KDAStates, Latents, PrefixCopy, page_hashes
from .prompt_media import MediaSpan, SequenceMedia, check_spans
from .params import SamplingParams

if TYPE_CHECKING:
    from .scheduler import Sequence

STATE_VERSION = 4  # 2: media spans and rows; 3: keyed digest; 4: keyed BLAKE3 (was blake2b)

_NP_VIEW = {torch.bfloat16: torch.int16}  # torch dtypes numpy lacks, carried as their bit pattern


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t, in one pass that allocates nothing: min and max propagate a NaN,
    and are finite exactly when every value is (~10x faster than `torch.isfinite(t).all()` on a
    CPU, whose elementwise test is not vectorised: 1.0 -> 0.09 ms for a 2K-token state's 1.5 MB)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo) and math.isfinite(hi)


def to_numpy(t: torch.Tensor, copy: bool = True) -> np.ndarray:
    """A CPU numpy copy (without `copy`, a view where t is a contiguous CPU tensor already: for
    tensors nothing else holds); bf16 as its int16 bit pattern."""
    t = t.detach().to("cpu").contiguous()
    view = _NP_VIEW.get(t.dtype)
    a = (t.view(view) if view is not None else t).numpy()
    return a.copy() if copy else a


def to_torch(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tensor of an array to_numpy made (sharing a's memory on the CPU)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device)


def model_fingerprint(model: K3ForCausalLM, cache_dtype: str) -> str:
    """The config, the cache dtype and a sample of every parameter: two engines that agree on it
    can exchange cache states."""
    h = hashlib.sha256(model.cfg.to_json().encode() + cache_dtype.encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


# arrays smaller than this are joined before they are hashed (`_mac`)
_JOIN_BELOW = 256 * 1024


@functools.lru_cache(maxsize=16)
def _mac_key(secret: str, person: bytes) -> bytes:
    """The 32-byte key of one use (`person`: a state, a pool page, a pool snapshot) derived from
    the shared secret by BLAKE3's key derivation, once per secret and use."""
    return blake3.blake3(secret.encode(), derive_key_context=f"k3 2026-12 {person.decode()}").digest()


def _mac(secret: str, person: bytes, header: object, arrays: list[tuple[str, np.ndarray]]) -> bytes:
    """Keyed BLAKE3 over a header, every array's name, dtype and shape, then the arrays' bytes in
    that order (their lengths follow from the shapes and dtypes hashed before them). BLAKE3 rather
    than hashlib's blake2b: its SIMD lanes hash a 2K-token state's 1.5 MB in 0.24 ms where blake2b
    takes 1.67 (docs/benchmarks.md), and every handoff and pool page is sealed once and checked once."""
    h = blake3.blake3(key=_mac_key(secret, person))
    h.update(repr((header, [(name, a.dtype.str, a.shape) for name, a in arrays])).encode())
    # the same stream of bytes as one update per array, but small arrays joined first: BLAKE3
    # hashes 1 KB chunks side by side only within one update (a pool page's 3-16 KB arrays one at
    # a time went at ~1 GB/s, joined at ~3; docs/benchmarks.md)
    small: list = []
    pending = 0
    for _, a in arrays:
        view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
        if view.nbytes >= _JOIN_BELOW:
            if small:
                h.update(b"".join(small))
                small, pending = [], 0
            h.update(view)
            continue
        small.append(view)
        pending += view.nbytes
        if pending >= _JOIN_BELOW:  # joined pieces stay small: no copy of a whole state
            h.update(b"".join(small))
            small, pending = [], 0
    if small:
        h.update(b"".join(small))
    return h.digest()


@dataclass
class HybridCacheState:
    version: int
    model_fingerprint: str  # config + weights sample + cache dtype (model_fingerprint)
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
    digest: bytes = field(default=b"")  # keyed MAC of everything above (seal)
    # Bookkeeping outside the digest: seconds the exporter spent building and sealing the state
    # ("export_s"), the decode server fetching it ("fetch_s"), the importer checking it ("check_s").
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

    def compute_digest(self, secret: str) -> bytes:
        header = (self.version, self.model_fingerprint, self.page_size, self.cache_dtype, self.first_token,
                  self.first_logprob, list(self.page_hashes), [(s.start, s.end, s.digest) for s in self.media_spans])
        return _mac(secret, b"k3 cache state", header, self.arrays())

    def seal(self, secret: str) -> HybridCacheState:
        """Set the digest under `secret` (the EngineConfig.handoff_key of the engines involved)."""
        self.digest = self.compute_digest(secret)
        return self

    def private_copy(self, keep_writable: bool = False) -> HybridCacheState:
        """A deep copy: what the importer checks and loads, out of its caller's reach.
        `keep_writable`: the caller owns this state and its writable arrays (it unpickled them):
        those are taken as they are, and only read-only ones (views of memory another holds,
        such as the object store's) are copied."""
        def arr(a):
            if keep_writable and isinstance(a, np.ndarray) and a.flags.writeable:
                return a
            return np.array(a, copy=True)

        return dataclasses.replace(
            self, prompt_token_ids=arr(self.prompt_token_ids), page_hashes=list(self.page_hashes),
            kda_recurrent={k: arr(a) for k, a in self.kda_recurrent.items()},
            kda_conv={k: arr(a) for k, a in self.kda_conv.items()},
            mla_latents={k: arr(a) for k, a in self.mla_latents.items()},
            first_logprob=copy.deepcopy(self.first_logprob), media_spans=list(self.media_spans),
            generator_state=None if self.generator_state is None else arr(self.generator_state),
            media_rows=None if self.media_rows is None else arr(self.media_rows), timings={})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays())


def _page_mac(secret: str, h: bytes, depth: int, tokens, latents: dict[int, np.ndarray]) -> bytes:
    """A pool page's seal: keyed BLAKE3 (`_mac`'s stream) over its chain hash, depth and tokens,
    its latents' names, dtypes and shapes, then their bytes layer by layer."""
    return _page_macs(secret, [h], [depth], [tokens], latents)[0]


def _page_macs(secret: str, hashes: list[bytes], depths: list[int], tokens: list,
               latents: dict[int, np.ndarray]) -> list[bytes]:
    """The seals (`_page_mac`) of pages whose latents are consecutive equal blocks of rows of
    whole arrays (page k: the k-th of len(hashes) blocks of each layer's), the pages' bytes laid
    side by side once so that each page is one slice (a page of k3-tiny is two 5 KB arrays: per
    page, a view, a join and a header list cost about as much as the hashing)."""
    if not hashes:
        return []
    n = len(hashes)
    key = _mac_key(secret, b"k3 pool page")
    names = sorted(latents)
    arrays = [np.ascontiguousarray(latents[k]) for k in names]
    layout = [(f"latents[{k}]", a.dtype.str, (a.shape[0] // n, *a.shape[1:]) if a.ndim else a.shape)
              for k, a in zip(names, arrays)]
    pages = np.concatenate([a.reshape(n, -1).view(np.uint8) for a in arrays], axis=1)
    tail = f", {layout!r})"  # the header is repr((page header, layout)): the layout's part is every page's
    out = []
    for h, depth, toks, page in zip(hashes, depths, tokens, pages):
        m = blake3.blake3(key=key)
        m.update(f"({(h, depth, tuple(toks))!r}{tail}".encode())
        m.update(page.data)
        out.append(m.digest())
    return out


def _snapshot_mac(secret: str, h: bytes, snapshot: dict[int, tuple[np.ndarray, np.ndarray]]) -> bytes:
    """A pool page's snapshot's seal, apart from the page's (the pool sends a page without it)."""
    arrays = [(f"{part}[{k}]", snapshot[k][i]) for k in sorted(snapshot)
              for i, part in enumerate(("conv", "recurrent"))]
    return _mac(secret, b"k3 pool snapshot", h, arrays)


@dataclass
class PoolPage:
    """One prompt page as the shared prefix pool holds it (serve/prefix_pool.py). The latents and
    the snapshot are sealed apart, so the pool can send a page without its snapshot."""

    hash: bytes  # the page's chain hash (covers every token before it)
    depth: int  # 1-based position of the page in its prompt
    tokens: tuple[int, ...]  # the page's own tokens (checked on load, as local hits are)
    latents: dict[int, np.ndarray]  # MLA layer -> [page_size, latent]
    snapshot: dict[int, tuple[np.ndarray, np.ndarray]] | None  # KDA layer -> (conv, recurrent) after the page
    digest: bytes = b""  # keyed MAC of hash, depth, tokens and latents
    snapshot_digest: bytes = b""  # keyed MAC of hash and snapshot

    def seal(self, secret: str) -> PoolPage:
        self.digest = _page_mac(secret, self.hash, self.depth, self.tokens, self.latents)
        self.snapshot_digest = b"" if self.snapshot is None else _snapshot_mac(secret, self.hash, self.snapshot)
        return self

    def verified(self, secret: str) -> bool:
        ok = hmac.compare_digest(self.digest, _page_mac(secret, self.hash, self.depth, self.tokens, self.latents))
        return ok and (self.snapshot is None or
                       hmac.compare_digest(self.snapshot_digest, _snapshot_mac(secret, self.hash, self.snapshot)))

    def without_snapshot(self) -> PoolPage:
        return dataclasses.replace(self, snapshot=None, snapshot_digest=b"")

    def owned(self) -> PoolPage:
        """The page with arrays of its own (the same bytes, so the same digests). Received through
        Ray, a page's arrays are read-only views of the call's whole argument buffer, which stays
        alive (in the object store, for a large call) while any one of them is held."""
        return dataclasses.replace(
            self, latents={k: np.array(a, copy=True) for k, a in self.latents.items()},
            snapshot=None if self.snapshot is None else
            {k: (np.array(c, copy=True), np.array(r, copy=True)) for k, (c, r) in self.snapshot.items()})

    @property
    def nbytes(self) -> int:
        n = sum(a.nbytes for a in self.latents.values())
        if self.snapshot is not None:
            n += sum(c.nbytes + r.nbytes for c, r in self.snapshot.values())
        return n


@dataclass
class PoolRun:
    """A prompt's first pages, packed for the wire: the pages' tokens one array, each MLA layer's
    latents one array, the seals as each page's publisher made them (the pool holds no key: it packs
    pages, it cannot seal), and the snapshots the run carries. What a pool fetch sends: Ray pickles
    and unpickles a 2K-token prefix of k3-tiny, 140 pages, as a few arrays rather than 140 objects
    with ~300 arrays, and the importer checks and loads it a layer at a time (docs/benchmarks.md)."""

    hashes: list[bytes]  # page j's chain hash (covers every token before it)
    tokens: np.ndarray  # [pages, page_size]: page j's own tokens
    latents: dict[int, np.ndarray]  # MLA layer -> [pages * page_size, latent]
    digests: list[bytes]  # page j's seal (`PoolPage.digest`)
    snapshots: list[tuple[int, dict[int, tuple[np.ndarray, np.ndarray]], bytes]]  # (page j, its snapshot, its seal)

    def __len__(self) -> int:
        return len(self.hashes)

    @classmethod
    def of(cls, pages: list[PoolPage]) -> PoolRun:
        """Pages 1..n of one prompt as a run (pages[j] must be page j + 1 of its prompt). ValueError,
        naming the page, for one that is not a pool page of that depth, or whose tokens or latents
        do not have page 1's layout."""
        if not isinstance(pages, (list, tuple)) or not pages:
            raise ValueError(f"expected a non-empty list of pool pages, got {type(pages).__name__}")
        first = pages[0]
        for j, p in enumerate(pages):
            where = f"pool page {j + 1}: "
            if not isinstance(p, PoolPage) or p.depth != j + 1 or not isinstance(p.tokens, (tuple, list)) or \
                    not isinstance(first.tokens, (tuple, list)) or len(p.tokens) != len(first.tokens):
                _refuse("it does not belong to this prompt", where)
            snap = p.snapshot or {}
            if not isinstance(p.latents, dict) or not isinstance(snap, dict) or \
                    any(not isinstance(cr, tuple) or len(cr) != 2 for cr in snap.values()) or \
                    any(not _numeric(a) for a in [*p.latents.values(), *(a for cr in snap.values() for a in cr)]):
                _refuse("its latents and snapshot must be numeric numpy arrays", where)
            if sorted(p.latents) != sorted(first.latents) or \
                    any(a.ndim != 2 or a.shape[1:] != first.latents[k].shape[1:] or a.dtype != first.latents[k].dtype
                        for k, a in p.latents.items()):
                _refuse(f"its latents {({k: (a.shape, str(a.dtype)) for k, a in p.latents.items()})} are not laid "
                        f"out as page 1's", where)
        tokens = np.array([p.tokens for p in pages])
        if tokens.dtype.kind not in "iu":
            _refuse(f"page tokens must be integers, got {tokens.dtype}", "pool pages: ")
        return cls([p.hash for p in pages], tokens,
                   {k: np.concatenate([p.latents[k] for p in pages]) for k in first.latents},
                   [p.digest for p in pages],
                   [(j, p.snapshot, p.snapshot_digest) for j, p in enumerate(pages) if p.snapshot is not None])


@dataclass
class Imported:
    """A handed-over state, checked and converted: what the engine and the scheduler load."""

    latents: Latents  # MLA layer -> [prompt tokens, latent]
    states: KDAStates  # the KDA states after the prompt
    first_token: int
    first_logprob: dict | None
    page_hashes: list[bytes]
    media: SequenceMedia | None
    generator_state: torch.Tensor | None  # uint8, set on the request's generator


_REFUSED = "cache state refused: "  # the prefix of every refusal of a HybridCacheState


def _refuse(msg: str, where: str = _REFUSED):
    raise ValueError(f"{where}{msg}")


class Handoff:
    """Exports and imports for one engine: its cache, its model's shapes, its fingerprint and
    the shared secret."""

    def __init__(self, cache: CacheManager, model: K3ForCausalLM, cache_dtype: str, secret: str,
                 multimodal: bool) -> None:
        self.cache, self.cfg, self.multimodal = cache, model.cfg, multimodal
        self.device = cache.device
        self.fingerprint = model_fingerprint(model, cache_dtype)
        self.cache_dtype = cache_dtype
        self._secret = secret
        # bf16 travels as its int16 bit pattern
        self._np_dtype = np.dtype(np.int16) if cache.dtype == torch.bfloat16 else np.dtype(np.float32)
        self._generator_bytes = torch.Generator(device=self.device).get_state().numel()

    # -- one request's state -----------------------------------------------------------------------
    def export_state(self, seq: Sequence, first: int, lp: dict | None) -> HybridCacheState:
        """The state after seq's prompt (its slot and the prompt's latents), the first token, and
        the generator as it stands after drawing it; sealed."""
        n = len(seq.prompt)
        assert seq.num_computed == n, "a prompt is exported right after its last token was computed"
        t0 = time.perf_counter()
        gen = seq.generator.get_state().numpy().copy() if seq.generator is not None else None
        spans, rows = [], None
        if seq.media is not None:
            spans, rows = list(seq.media.spans), seq.media.rows.detach().to("cpu", torch.float32).numpy().copy()
        states, latents = self.cache.read_sequence(seq.mem, n)
        state = HybridCacheState(
            version=STATE_VERSION, model_fingerprint=self.fingerprint, page_size=self.cache.page_size,
            cache_dtype=self.cache_dtype, prompt_token_ids=np.asarray(seq.prompt, dtype=np.int64),
            page_hashes=list(seq.hashes[:n // self.cache.page_size]) or page_hashes(seq.prompt, self.cache.page_size,
                                                                                 media=spans),
            kda_recurrent={l: to_numpy(r) for l, (_, r) in states.items()},
            kda_conv={l: to_numpy(c) for l, (c, _) in states.items()},
            mla_latents={l: to_numpy(t) for l, t in latents.items()},
            first_token=first, first_logprob=copy.deepcopy(lp), generator_state=gen, media_spans=spans,
            media_rows=rows,
        ).seal(self._secret)
        state.timings["export_s"] = time.perf_counter() - t0
        return state

    def check_state(self, state: HybridCacheState, ids: list[int], params: SamplingParams,
                    owned: bool = False) -> Imported:
        """Everything about a handed-over state that must hold before it is loaded, checked on a
        private copy (`owned`: its caller unpickled it and holds it alone, so only its read-only
        arrays are copied); ValueError ("cache state refused: ...") naming what does not."""
        if not isinstance(state, HybridCacheState):
            _refuse(f"expected a HybridCacheState, got {type(state).__name__}")
        _check_containers(state)
        state = state.private_copy(keep_writable=owned)
        self._check_seal(state)
        media = self._check_prompt(state, ids)
        gen = self._check_generator(state.generator_state, params)
        lp = self._check_first(state.first_token, state.first_logprob, params)
        kda = self._kda_states(state.kda_conv, state.kda_recurrent, _REFUSED)
        latents = self._latents(state.mla_latents, len(ids), _REFUSED)
        return Imported(latents, kda, state.first_token, lp, list(state.page_hashes), media, gen)

    def _check_seal(self, state: HybridCacheState) -> None:
        if state.version != STATE_VERSION:
            _refuse(f"version {state.version!r}, this engine reads version {STATE_VERSION}")
        if state.model_fingerprint != self.fingerprint:
            _refuse(f"model fingerprint {state.model_fingerprint} != this engine's {self.fingerprint} "
                    f"(another config, other weights or another cache dtype)")
        if state.page_size != self.cache.page_size:
            _refuse(f"page_size {state.page_size} != this engine's {self.cache.page_size}")
        if state.cache_dtype != self.cache_dtype:
            _refuse(f"cache_dtype {state.cache_dtype!r} != this engine's {self.cache_dtype!r}")
        if not isinstance(state.digest, bytes) or not hmac.compare_digest(state.digest,
                                                                          state.compute_digest(self._secret)):
            _refuse("its digest does not verify under this engine's handoff_key: it was sealed with another key "
                    "(engines that exchange states need the same EngineConfig.handoff_key) or changed after sealing")

    def _check_prompt(self, state: HybridCacheState, ids: list[int]) -> SequenceMedia | None:
        got = state.prompt_token_ids
        if got.dtype != np.int64 or got.shape != (len(ids),) or not np.array_equal(got, np.asarray(ids, np.int64)):
            _refuse(f"its prompt_token_ids ({got.shape}) differ from the request's prompt ({len(ids)} tokens)")
        media = self._check_media(state, ids)
        if list(state.page_hashes) != page_hashes(ids, self.cache.page_size, media=state.media_spans):
            _refuse("page_hashes do not match the prompt and its media")
        return media

    def _check_media(self, state: HybridCacheState, ids: list[int]) -> SequenceMedia | None:
        """The handed-over spans and rows: they must describe this prompt's placeholders exactly."""
        spans, rows = list(state.media_spans), state.media_rows
        if not self.multimodal:
            if spans or rows is not None:
                _refuse("it carries media, but this engine's model has no vision tower")
            return None
        try:
            pos = check_spans(ids, spans, self.cfg.media_placeholder_token_id)
        except ValueError as e:
            _refuse(str(e))
        if not pos:
            if rows is not None:
                _refuse("media_rows given for a prompt without placeholders")
            return None
        want = (len(pos), self.cfg.hidden_size)
        if rows is None or rows.shape != want or rows.dtype != np.float32 or not np.isfinite(rows).all():
            _refuse(f"media_rows {getattr(rows, 'shape', None)} {getattr(rows, 'dtype', None)}, expected finite "
                    f"{want} float32")
        return SequenceMedia(None, spans, pos, to_torch(rows, torch.float32, self.device))

    def _check_generator(self, gen: np.ndarray | None, params: SamplingParams) -> torch.Tensor | None:
        if (params.seed is not None) != (gen is not None):
            _refuse("a seeded request needs the generator state, an unseeded one has none")
        if gen is None:
            return None
        if gen.dtype != np.uint8 or gen.shape != (self._generator_bytes,):
            _refuse(f"generator_state {gen.shape} {gen.dtype}, expected ({self._generator_bytes},) uint8")
        t = torch.from_numpy(gen)
        try:
            torch.Generator(device=self.device).set_state(t)
        except RuntimeError as e:
            _refuse(f"generator_state is not a state of this engine's generator: {e}")
        return t

    def _check_first(self, tok: object, lp: object, params: SamplingParams) -> dict | None:
        vocab = self.cfg.vocab_size
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
            _refuse(f"first_token {tok!r} is not a token id in [0, {vocab})")
        eos = self.cfg.eos_token_id
        if params.min_tokens > 0 and (tok in params.stop_token_ids or (tok == eos and not params.ignore_eos)):
            _refuse(f"first_token {tok} ends the request, which min_tokens={params.min_tokens} forbids: the "
                    f"prefill engine sampled it under other params")
        if self.multimodal and tok == self.cfg.media_placeholder_token_id:
            _refuse(f"first_token {tok} is the media placeholder, which no engine samples")
        if (params.logprobs is None) != (lp is None):
            _refuse(f"first_logprob is {'missing' if lp is None else 'given'} for a request with "
                    f"logprobs={params.logprobs}")
        if lp is None:
            return None
        if not _is_entry(lp, tok, params.logprobs, vocab):
            _refuse(f"first_logprob is not an entry for token {tok} with {params.logprobs} alternatives")
        return lp

    def _kda_states(self, conv: dict, rec: dict, where: str) -> KDAStates:
        """{layer: (conv, recurrent)} as tensors, every layer there, shaped, typed and finite."""
        want = [s.layer_idx for s in self.cache.kda_specs]
        if sorted(rec) != want or sorted(conv) != want:
            _refuse(f"KDA layers {sorted(rec)} / {sorted(conv)} != {want}", where)
        out = {}
        for s in self.cache.kda_specs:
            r, c = rec[s.layer_idx], conv[s.layer_idx]
            if r.shape != s.state_shape or r.dtype != np.float32:
                _refuse(f"KDA layer {s.layer_idx} recurrent state {r.shape} {r.dtype}, expected {s.state_shape} "
                        f"float32", where)
            if c.shape != s.conv_shape or c.dtype != self._np_dtype:
                _refuse(f"KDA layer {s.layer_idx} conv state {c.shape} {c.dtype}, expected {s.conv_shape} "
                        f"{self._np_dtype}", where)
            out[s.layer_idx] = (self._finite(c, self.cache.dtype, f"KDA layer {s.layer_idx} conv state", where),
                                self._finite(r, torch.float32, f"KDA layer {s.layer_idx} recurrent state", where))
        return out

    def _latents(self, lat: dict, n: int, where: str) -> Latents:
        """{layer: [n, latent]} as tensors, every MLA layer there, shaped, typed and finite."""
        return {l: self._finite(a, self.cache.dtype, f"MLA layer {l} latents", where)
                for l, a in self._latent_arrays(lat, n, where).items()}

    def _latent_arrays(self, lat: dict, n: int, where: str) -> dict[int, np.ndarray]:
        """{layer: [n, latent]}, every MLA layer there, shaped and typed (not yet checked finite)."""
        want = [s.layer_idx for s in self.cache.mla_specs]
        if sorted(lat) != want:
            _refuse(f"MLA layers {sorted(lat)} != {want}", where)
        for s in self.cache.mla_specs:
            a = lat[s.layer_idx]
            if a.shape != (n, s.latent_dim) or a.dtype != self._np_dtype:
                _refuse(f"MLA layer {s.layer_idx} latents {a.shape} {a.dtype}, expected {(n, s.latent_dim)} "
                        f"{self._np_dtype}", where)
        return {l: lat[l] for l in want}

    def _finite(self, a: np.ndarray, dtype: torch.dtype, name: str, where: str) -> torch.Tensor:
        t = to_torch(a, dtype, self.device)
        if not all_finite(t):
            _refuse(f"{name} holds non-finite values", where)
        return t

    # -- the prefix pool (call these in the engine's step thread) --------------------------------------
    def cached_prefix_tokens(self, prompt: list[int], media: list[MediaSpan] = ()) -> int:
        """Prompt tokens this engine could start from its own prefix cache: a request resumes
        strictly inside its prompt (its last token's logits are computed), as the scheduler's
        `find_prefix(..., limit=len(prompt))` does."""
        ps = self.cache.page_size
        return self.cache.prefix_depth(prompt, page_hashes(prompt, ps, media=media)[: (len(prompt) - 1) // ps]) * ps

    def export_prefix(self, prompt: list[int], media: list[MediaSpan] = (), only: set[bytes] | None = None,
                      bare: Collection[bytes] = ()) -> list[PoolPage]:
        """The prompt's cached pages here, up to the deepest one with a snapshot, as sealed pool
        pages (`media`: the prompt's spans; only the pages whose hash is in `only`, when given;
        those in `bare`, which the importer holds without a snapshot, only where they keep one
        here): `seal_prefix(*copy_prefix(...))`."""
        return self.seal_prefix(*self.copy_prefix(prompt, media, only, bare))

    def copy_prefix(self, prompt: list[int], media: list[MediaSpan] = (), only: set[bytes] | None = None,
                    bare: Collection[bytes] = ()):
        """The step thread's share of `export_prefix`: copies of the pages' latents and snapshots
        (a few gathers), for `seal_prefix` to make pool pages of in any thread, whatever the
        cache does meanwhile. Most of an export is the sealing (a keyed MAC over every page's bytes:
        for k3-tiny's 2,240-token prompt, 140 pages and 35 snapshots, 5.3-5.8 ms, of which
        BLAKE3's hashing 1.1-1.5; the copy 1.0-1.1, docs/benchmarks.md)."""
        hashes = page_hashes(prompt, self.cache.page_size, media=media)
        return prompt, self.cache.copy_prefix(prompt, hashes, only, bare)

    def seal_prefix(self, prompt: list[int], copied: PrefixCopy) -> list[PoolPage]:
        """Pool pages, sealed, of what `copy_prefix` took (reads nothing of the engine's). Each
        layer's copy becomes one array (copy_prefix's, held by nothing else: no copy) and a page's
        arrays are views of those (a pickled view carries only its own rows)."""
        ps = self.cache.page_size
        lat = {l: to_numpy(t, copy=False) for l, t in copied.latents.items()}
        snaps = {l: (to_numpy(c, copy=False), to_numpy(r, copy=False)) for l, (c, r) in copied.snapshots.items()}
        tokens = [tuple(prompt[j * ps:(j + 1) * ps]) for j in copied.indices]
        seals = _page_macs(self._secret, copied.hashes, [j + 1 for j in copied.indices], tokens,
                           {l: a.reshape(-1, a.shape[-1]) for l, a in lat.items()})
        pages = []
        for k, (h, j, s) in enumerate(zip(copied.hashes, copied.indices, copied.snapshot_rows)):
            snap = None if s is None else {l: (c[s], r[s]) for l, (c, r) in snaps.items()}
            pages.append(PoolPage(h, j + 1, tokens[k], {l: a[k] for l, a in lat.items()}, snap, seals[k],
                                  b"" if snap is None else _snapshot_mac(self._secret, h, snap)))
        return pages

    def import_prefix(self, prompt: list[int], pages: PoolRun | list[PoolPage], media: list[MediaSpan] = ()) -> int:
        """Load pool pages for this prompt into the prefix cache (pages it lacks, and snapshots
        for pages without one); returns the prompt tokens now resumable here. `pages`: a run of the
        prompt's first pages (what the pool fetches) or a list of them. Everything is checked first,
        on a private copy: a page that does not belong to the prompt, is not sealed under this
        engine's key, or does not fit this model is refused with a ValueError naming it, and nothing
        is loaded."""
        if not isinstance(pages, PoolRun):
            if not pages:
                return self.cached_prefix_tokens(prompt, media)
            pages = PoolRun.of(pages)
        hashes = page_hashes(prompt, self.cache.page_size, media=media)
        latents, snapshots = self._check_run(pages, hashes, prompt)
        n = len(pages)
        self.cache.import_prefix_pages(hashes[:n], [tuple(t) for t in pages.tokens.tolist()], latents, snapshots)
        return self.cached_prefix_tokens(prompt, media)

    def _check_run(self, run: PoolRun, hashes: list[bytes], prompt: list[int]) -> tuple[Latents, dict[int, KDAStates]]:
        """A pool run, checked as a handed-over state is, on a private copy: the pages are the
        prompt's first ones (hashes and tokens), every page's seal and every snapshot's verifies
        under this engine's key, the latents are shaped, typed and finite (one pass per layer) and
        so are the snapshots' states. Returns the latents and the snapshots by page index."""
        ps = self.cache.page_size
        n = len(run.hashes) if isinstance(run.hashes, list) else 0
        if n == 0 or not isinstance(run.digests, list) or len(run.digests) != n or \
                any(not isinstance(d, bytes) for d in run.digests):
            _refuse(f"a run needs one or more page hashes and a digest per page, got {n} hashes", "pool pages: ")
        for j, h in enumerate(run.hashes):
            if j >= len(hashes) or h != hashes[j]:
                _refuse("it does not belong to this prompt", f"pool page {j + 1}: ")
        want = np.asarray(prompt[:n * ps], dtype=np.int64).reshape(n, ps)
        if not _numeric(run.tokens) or run.tokens.shape != (n, ps):
            _refuse(f"tokens {getattr(run.tokens, 'shape', type(run.tokens).__name__)}, expected {(n, ps)}",
                    "pool pages: ")
        differ = (run.tokens != want).any(axis=1).nonzero()[0]
        if len(differ):
            _refuse("it does not belong to this prompt", f"pool page {int(differ[0]) + 1}: ")
        if not isinstance(run.latents, dict) or any(not _numeric(a) for a in run.latents.values()):
            _refuse("latents must be a dict of numeric numpy arrays", "pool pages: ")
        lat = {l: np.array(a, copy=True) for l, a in self._latent_arrays(run.latents, n * ps, "pool pages: ").items()}
        seals = _page_macs(self._secret, hashes[:n], range(1, n + 1), [prompt[j * ps:(j + 1) * ps] for j in range(n)],
                           lat)  # each page's, over the private copy's rows
        for j, (got, want) in enumerate(zip(run.digests, seals)):
            if not hmac.compare_digest(got, want):
                _refuse(_UNVERIFIED, f"pool page {j + 1}: ")
        snapshots = {}
        for entry in run.snapshots if isinstance(run.snapshots, list) else [None]:
            if not isinstance(entry, tuple) or len(entry) != 3 or not isinstance(entry[0], int) or \
                    not 0 <= entry[0] < n or entry[0] in snapshots or not isinstance(entry[1], dict) or \
                    not isinstance(entry[2], bytes) or \
                    any(not isinstance(cr, tuple) or len(cr) != 2 or not all(_numeric(a) for a in cr)
                        for cr in entry[1].values()):
                _refuse("snapshots must be (page index in the run, {KDA layer: (conv, recurrent) arrays}, digest)",
                        "pool pages: ")
            j, snap, digest = entry
            where = f"pool page {j + 1}: "
            snap = {k: (np.array(c, copy=True), np.array(r, copy=True)) for k, (c, r) in snap.items()}
            if not hmac.compare_digest(digest, _snapshot_mac(self._secret, hashes[j], snap)):
                _refuse(_UNVERIFIED, where)
            snapshots[j] = self._kda_states({k: c for k, (c, _) in snap.items()}, {k: r for k, (_, r) in snap.items()},
                                            where)
        out = {}
        for l, a in lat.items():  # finite, one pass per layer; a refusal names the first page that is not
            t = to_torch(a, self.cache.dtype, self.device)
            if not all_finite(t):
                row = int((~torch.isfinite(t).all(dim=1)).nonzero()[0])
                _refuse(f"MLA layer {l} latents holds non-finite values", f"pool page {row // ps + 1}: ")
            out[l] = t
        return out, snapshots


_UNVERIFIED = ("its digest does not verify under this engine's handoff_key (sealed with another key, or changed "
               "after sealing)")


def _numeric(a: object) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.kind in "biuf"


def _is_logprob(v: object) -> bool:
    return isinstance(v, float) and not math.isnan(v) and v <= 0.0


def _is_entry(lp: object, tok: int, k: int, vocab: int) -> bool:
    """Whether lp is the sampler's logprob entry (sampler.py) for tok with k alternatives."""
    if not isinstance(lp, dict) or set(lp) != ({"token", "logprob", "top"} if k else {"token", "logprob"}):
        return False
    top = lp.get("top", {})
    return lp["token"] == tok and _is_logprob(lp["logprob"]) and isinstance(top, dict) and len(top) == k and \
        all(isinstance(t, int) and 0 <= t < vocab and _is_logprob(v) for t, v in top.items())


def _check_containers(state: HybridCacheState) -> None:
    """The fields' types, before anything reads them (a malformed state is refused, not crashed on)."""
    for name in ("kda_recurrent", "kda_conv", "mla_latents"):
        d = getattr(state, name)
        if not isinstance(d, dict) or any(not _numeric(a) for a in d.values()):
            _refuse(f"{name} must be a dict of numeric numpy arrays")
    for name in ("prompt_token_ids", "generator_state", "media_rows"):
        a = getattr(state, name)
        if not _numeric(a) and not (a is None and name != "prompt_token_ids"):
            _refuse(f"{name} must be a numeric numpy array, got {type(a).__name__}")
    if not isinstance(state.page_hashes, (list, tuple)) or any(not isinstance(h, bytes) for h in state.page_hashes):
        _refuse("page_hashes must be a list of bytes")
    if not isinstance(state.media_spans, (list, tuple)) or any(not isinstance(m, MediaSpan) for m in state.media_spans):
        _refuse("media_spans must be a list of MediaSpans")
