"""LLMEngine: add requests, step, stream outputs, abort; hand a prompt's cache state to another
engine and take one in. One forward per step for every scheduled sequence (prefill chunks and
decode tokens packed together).

Thread-safety: `add_request`, `import_request` and `abort_request` validate synchronously (bad
input raises ValueError and changes nothing) and queue; the queue is applied at the start of the
next step, so an asyncio front end may call them while a step runs in a worker thread. Request
ids are reserved under the lock when accepted and released when the request ends.

Failure isolation: a request whose sampling fails ends alone with an error; a forward that
raises sends every sequence in it back to be recomputed alone (scheduler.py), so the culprit
fails alone and every other request continues exactly as if it had not been there.

Images and video (media.py): with a K3ForConditionalGeneration a request may carry processed
media items; each request's items are encoded once, at its first chunk that holds a
placeholder, and every chunk gets the rows of its own placeholders. The placeholder token is
never sampled (its embedding is a picture's, not a token's).
"""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from concurrent.futures import Future
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.model.vision_processor import MediaItem

from .cache_manager import CacheManager, page_hashes
from .detokenizer import Detokenizer, StopMatcher
from .handoff import STATE_VERSION, HybridCacheState, PoolPage, to_numpy, to_torch
from .media import MediaRowCache, MediaSpan, SequenceMedia, check_item, check_spans, media_spans
from .params import EngineConfig, SamplingParams
from .sampler import sample
from .scheduler import Scheduled, Scheduler, Sequence, Status


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # everything generated so far
    text_delta: str = ""
    text: str = ""
    finished: bool = False
    # "stop" | "length" | "abort" | "error"; None while running, and for a prefill-only request
    # that ends by handing its state over (cache_state set).
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # per new token: {"token", "logprob", "top": {id: lp}}
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    cache_state: HybridCacheState | None = None


def model_fingerprint(model: K3ForCausalLM, cache_dtype: str) -> str:
    """The config, the cache dtype and a sample of every parameter: two engines that agree on it
    can exchange cache states."""
    h = hashlib.sha256(model.cfg.to_json().encode() + cache_dtype.encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


class LLMEngine:
    def __init__(self, model: K3ForCausalLM | K3ForConditionalGeneration, config: EngineConfig | None = None,
                 tokenizer=None) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.multimodal = isinstance(model, K3ForConditionalGeneration)
        self.media_items_encoded = 0  # items run through the tower + projector
        self.config = config or EngineConfig()
        self.media_rows = MediaRowCache(self.config.media_cache_bytes) if self.multimodal else None
        self.device = next(model.parameters()).device
        self.max_len = min(self.config.max_model_len or self.cfg.max_position_embeddings,
                           self.cfg.max_position_embeddings)
        self.cache = CacheManager(self.cfg, self.config, self.device)
        self.scheduler = Scheduler(self.cache, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.enable_prefix_caching, self.config.snapshot_interval)
        if self.config.verify_prefix_hits:
            self.scheduler.verifier = self._verify_snapshot
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.fingerprint = model_fingerprint(model, self.config.dtype)
        self.seqs: dict[str, Sequence] = {}  # admitted to the scheduler (the step thread's view)
        self._live: set[str] = set()  # every accepted, unfinished request id (guarded by _lock)
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._next_id = itertools.count()
        self.steps = 0
        self.failed_forwards = 0
        self.step_seconds: deque[float] = deque(maxlen=1024)  # the most recent steps only

    # -- requests --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids, params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, (list, tuple)) or len(prompt_token_ids) == 0:
            raise ValueError("prompt must be a non-empty list of token ids")
        ids = list(prompt_token_ids)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_len} (prompt + at least 1 new)")
        if params.stop and self.detok is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        need = self.cache.pages_for(min(len(ids) + params.max_tokens, self.max_len))
        if need > self.cache.num_pages:
            raise ValueError(f"request needs {need} cache pages (prompt {len(ids)} + max_tokens {params.max_tokens}) "
                             f"but the whole cache holds {self.cache.num_pages}; lower max_tokens or raise "
                             f"cache_memory_bytes")
        return ids

    def _new_sequence(self, request_id: str | None, ids: list[int], params: SamplingParams) -> Sequence:
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        seq = Sequence(request_id or "", ids, params)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.detok is not None:
            seq.detok = self.detok.stream()
            seq.stopper = StopMatcher(params.stop, params.include_stop_str_in_output)
        return seq

    def _enqueue(self, kind: str, seq: Sequence) -> str:
        with self._lock:
            if not seq.request_id:
                seq.request_id = f"req-{next(self._next_id)}"
                while seq.request_id in self._live:
                    seq.request_id = f"req-{next(self._next_id)}"
            if seq.request_id in self._live:
                raise ValueError(f"request_id {seq.request_id!r} is already in use")
            self._live.add(seq.request_id)
            self._pending.append((kind, seq.request_id, seq))
        return seq.request_id

    def media_spans(self, prompt: list[int], media: list[MediaItem] | None) -> tuple[list[int], list[MediaSpan]]:
        """(placeholder positions, spans) of a prompt's media; ValueError when this model takes no
        media, an item is malformed, or the placeholder count differs from the items' tokens."""
        media = list(media or [])
        if not self.multimodal:
            if media:
                raise ValueError(f"media given, but this engine's model ({type(self.model).__name__}) has no vision "
                                 f"tower")
            return [], []
        items = [check_item(it, i, self.cfg.vision_config) for i, it in enumerate(media)]
        return media_spans(prompt, items, self.cfg.media_placeholder_token_id)

    def add_request(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    prefill_only: bool = False, media: list[MediaItem] | None = None) -> str:
        """Queue a request; returns its id. With prefill_only the request ends after its first
        token with `cache_state` set (or finished normally, if that token already ends it).
        `media`: the prompt's images / video chunks (k3.model.vision_processor), in placeholder order."""
        params = params or SamplingParams()
        ids = self.validate(prompt_token_ids, params)
        positions, spans = self.media_spans(ids, media)
        seq = self._new_sequence(request_id, ids, params)
        if spans:
            seq.media = SequenceMedia(list(media), spans, positions)
        seq.prefill_only = prefill_only
        return self._enqueue("add", seq)

    def import_request(self, request_id: str | None, prompt_token_ids: list[int], state: HybridCacheState,
                       params: SamplingParams | None = None) -> str:
        """Continue a request another engine prefilled: its first output (the handed-over first
        token) comes from the next step; decoding goes on from there. The state is checked
        completely before anything is allocated: a mismatch raises ValueError and changes nothing."""
        params = params or SamplingParams()
        ids = self.validate(prompt_token_ids, params)
        t0 = time.perf_counter()
        latents, kda, media = self._check_state(state, ids, params)
        state.timings["check_s"] = time.perf_counter() - t0
        seq = self._new_sequence(request_id, ids, params)
        seq.media = media
        seq.hashes = list(state.page_hashes) if self.config.enable_prefix_caching else []
        seq.imported = {"latents": latents, "kda": kda, "first": (state.first_token, state.first_logprob)}
        if seq.generator is not None:
            seq.generator.set_state(torch.from_numpy(state.generator_state.copy()))
        return self._enqueue("import", seq)

    def call(self, fn) -> Future:
        """Run fn() in the step thread between two steps, where the cache may be read and changed
        safely (the prefix pool's export and import); the Future holds its result."""
        fut: Future = Future()
        with self._lock:
            self._pending.append(("call", None, (fn, fut)))
        return fut

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(("abort", request_id, None))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    def _release_id(self, rid: str) -> None:
        self.seqs.pop(rid, None)
        with self._lock:
            self._live.discard(rid)

    def _apply_pending(self) -> list[RequestOutput]:
        outs = []
        with self._lock:
            items, self._pending = list(self._pending), deque()
        for kind, rid, seq in items:
            if kind == "call":
                fn, fut = seq
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller gets it through the Future
                    fut.set_exception(e)
                continue
            if kind == "abort":
                seq = self.seqs.get(rid)
                if seq is not None:
                    self.scheduler.remove(seq)
                    seq.status, seq.finish_reason = Status.FINISHED, "abort"
                    self._release_id(rid)
                    outs.append(self._output(seq, [], [], finished=True))
                continue
            self.seqs[rid] = seq
            if kind == "import":
                tok, lp = seq.imported.pop("first")
                out = self._accept(seq, tok, lp)  # the first token, as the prefill engine chose it
                outs.append(out)
                if out.finished:
                    continue
            self.scheduler.add(seq)
        return outs

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        outs = self._apply_pending()
        sched = self.scheduler.schedule()
        if not sched:
            return outs
        t0 = time.perf_counter()
        sched, failed = self._encode_media(sched)
        outs += failed
        if not sched:
            return outs
        try:
            batch, logits_at, sample_idx = self._build(sched)
            extra = {"media_embeds": batch[2]} if self.multimodal else {}
            logits = self.model(batch[0], cache=batch[1], logits_at=logits_at, **extra).logits
        except Exception as e:  # noqa: BLE001 - isolate whatever the forward raised
            outs += self._forward_failed(sched, e)
            self.step_seconds.append(time.perf_counter() - t0)
            return outs
        snaps = self._mid_chunk_snapshots(batch[1])
        for i, s in enumerate(sched):
            self.scheduler.after_step(s, snaps.get(i, {}))
        seqs = [sched[i].seq for i in sample_idx]
        draws = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                       [self._banned(s) for s in seqs], self.generator) if seqs else []
        for seq, d in zip(seqs, draws):
            if d.error is not None:
                outs.append(self._fail(seq, d.error))
            else:
                outs.append(self._accept(seq, d.token, d.logprob))
        self.steps += 1
        self.step_seconds.append(time.perf_counter() - t0)
        return outs

    def _encode_media(self, sched: list[Scheduled]) -> tuple[list[Scheduled], list[RequestOutput]]:
        """Encode the media of every scheduled sequence whose chunk reaches its first placeholder
        (or, for a prefill-only request, its last prompt chunk: the handoff carries the rows even
        when a prefix hit skipped every placeholder, since decode may have to recompute); a
        sequence whose items fail to encode fails alone and leaves the batch."""
        keep, failed = [], []
        for s in sched:
            seq, hi = s.seq, s.seq.num_computed + s.num_tokens
            if seq.media is not None and (seq.media.needs_rows(seq.num_computed, hi) or
                                          (seq.prefill_only and seq.media.rows is None and hi == seq.length)):
                try:
                    self.media_items_encoded += seq.media.encode(self.model, self.media_rows)
                except Exception as e:  # noqa: BLE001 - this request's media, this request's failure
                    failed.append(self._fail(seq, f"encoding its media failed: {type(e).__name__}: {e}"))
                    continue
            keep.append(s)
        return keep, failed

    def _build(self, sched: list[Scheduled]):
        ids, lengths, slots, tables, context, rows, sample_idx, offsets = [], [], [], [], [], [], [], {}
        media: list[torch.Tensor] = []  # rows of the placeholders in the batch, in batch order
        row = 0
        for i, s in enumerate(sched):
            seq = s.seq
            ids.extend(seq.tokens[seq.num_computed: seq.num_computed + s.num_tokens])
            if seq.media is not None and (r := seq.media.rows_for(seq.num_computed, seq.num_computed + s.num_tokens)) \
                    is not None:
                media.append(r)
            lengths.append(s.num_tokens)
            slots.append(seq.slot)
            tables.append(seq.pages)
            context.append(seq.num_computed)
            row += s.num_tokens
            if seq.num_computed + s.num_tokens == seq.length:
                rows.append(row - 1)
                sample_idx.append(i)
            if s.snapshot_offsets:
                offsets[i] = s.snapshot_offsets
        cb = self.cache.cache_batch(lengths, slots, tables, context, offsets)
        logits_at = torch.tensor(rows, dtype=torch.long, device=self.device)
        embeds = torch.cat(media).to(self.device) if media else None
        return (torch.tensor([ids], device=self.device), cb, embeds), logits_at, sample_idx

    def _forward_failed(self, sched: list[Scheduled], e: Exception) -> list[RequestOutput]:
        self.failed_forwards += 1
        if len(sched) == 1:
            return [self._fail(sched[0].seq, f"the model's forward failed: {type(e).__name__}: {e}")]
        until = {id(s.seq): s.seq.num_computed + s.num_tokens for s in sched}
        self.scheduler.preempt_for_recompute([s.seq for s in sched], until)
        return []

    @staticmethod
    def _mid_chunk_snapshots(cb) -> dict[int, dict[int, dict[int, tuple]]]:
        """{scheduled index: {offset: {kda layer: (conv, recurrent)}}} from what the layers recorded."""
        out: dict = {}
        for layer, snaps in cb.snapshots.items():
            for s in snaps:
                out.setdefault(s.seq, {}).setdefault(s.offset, {})[layer] = (s.conv, s.recurrent)
        return out

    def _verify_snapshot(self, seq: Sequence, n: int, slot: int, tol: float = 1e-3) -> bool:
        """Recompute seq's first n tokens cold and compare every KDA layer's state with the snapshot."""
        from k3.model import HybridCache

        prefix = seq.tokens[:n]
        extra = {}
        if self.multimodal:
            if seq.media is not None and seq.media.needs_rows(0, n):
                self.media_items_encoded += seq.media.encode(self.model, self.media_rows)
            extra["media_embeds"] = seq.media.rows_for(0, n) if seq.media is not None else None
        cold = HybridCache(self.cfg, 1, len(prefix), dtype=self.cache.dtype, device=self.device)
        self.model(torch.tensor([prefix], device=self.device), cache=cold.batch([len(prefix)]),
                   logits_at=torch.tensor([len(prefix) - 1], device=self.device), **extra)
        for layer, pool in cold.kda.items():
            ref, got = pool.recurrent[0], self.cache.kda[layer].recurrent[slot]
            if float((got - ref).norm() / ref.norm().clamp_min(1e-30)) > tol:
                return False
        return True

    def _banned(self, seq: Sequence) -> list[int]:
        p, eos = seq.params, self.cfg.eos_token_id
        always = [self.cfg.media_placeholder_token_id] if self.multimodal else []
        if len(seq.output) >= p.min_tokens:
            return always
        return always + list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])

    def _accept(self, seq: Sequence, tok: int, lp: dict | None) -> RequestOutput:
        """Append a chosen token: detokenize, match stops, finish or hand over."""
        p, eos = seq.params, self.cfg.eos_token_id
        lps = [lp] if lp is not None else []
        seq.logprobs.extend(lps)
        seq.output.append(tok)
        delta = ""
        finished = stop_hit = False
        if seq.detok is not None:
            delta, stop_hit = seq.stopper.feed(seq.detok.push(tok))
            if stop_hit:
                seq.finish_reason, finished = "stop", True
        if not finished and ((tok == eos and not p.ignore_eos) or tok in p.stop_token_ids):
            seq.finish_reason, finished = "stop", True
        if not finished and (len(seq.output) >= p.max_tokens or seq.length >= self.max_len):
            seq.finish_reason, finished = "length", True
        state = None
        if finished:
            if seq.detok is not None and not stop_hit:  # release held-back text
                tail, hit = seq.stopper.feed(seq.detok.flush())
                delta += tail if hit else tail + seq.stopper.finish()
        elif seq.prefill_only:
            state, finished = self._export(seq, tok, lp), True
        if finished:
            seq.status = Status.FINISHED
            self.scheduler.remove(seq)
            self._release_id(seq.request_id)
        seq.text += delta
        out = self._output(seq, [tok], lps, finished, delta)
        out.cache_state = state
        return out

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self.scheduler.fail(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "error"
        self._release_id(seq.request_id)
        out = self._output(seq, [], [], True)
        out.error = message
        return out

    def _output(self, seq: Sequence, new: list[int], lp: list[dict], finished: bool, delta: str = "") -> RequestOutput:
        return RequestOutput(seq.request_id, new, list(seq.output), delta, seq.text, finished, seq.finish_reason,
                             lp, len(seq.prompt), seq.num_cached_tokens)

    # -- the handoff -----------------------------------------------------------------------------
    def _export(self, seq: Sequence, first: int, lp: dict | None) -> HybridCacheState:
        """The state after the prompt (the slot and the prompt's latents), the first token, and
        the generator as it stands after drawing it."""
        n = len(seq.prompt)
        assert seq.num_computed == n, "a prompt is exported right after its last token was computed"
        t0 = time.perf_counter()
        gen = seq.generator.get_state().numpy().copy() if seq.generator is not None else None
        spans, rows = [], None
        if seq.media is not None:
            spans, rows = list(seq.media.spans), seq.media.rows.detach().to("cpu", torch.float32).numpy().copy()
        kda = self.cache.read_slot(seq.slot)
        state = HybridCacheState(
            version=STATE_VERSION, model_fingerprint=self.fingerprint, page_size=self.cache.page_size,
            cache_dtype=self.config.dtype, prompt_token_ids=np.asarray(seq.prompt, dtype=np.int64),
            page_hashes=list(seq.hashes) or page_hashes(seq.prompt, self.cache.page_size, media=spans),
            kda_recurrent={l: to_numpy(r) for l, (_, r) in kda.items()},
            kda_conv={l: to_numpy(c) for l, (c, _) in kda.items()},
            mla_latents={l: to_numpy(t) for l, t in self.cache.read_latents(seq.pages, n).items()},
            first_token=first, first_logprob=lp, generator_state=gen, media_spans=spans, media_rows=rows,
        ).seal()
        state.timings["export_s"] = time.perf_counter() - t0
        return state

    def _check_state(self, state, ids: list[int], params: SamplingParams):
        """Everything about a handed-over state that must hold before it is loaded."""
        def refuse(msg: str):
            raise ValueError(f"cache state refused: {msg}")

        if not isinstance(state, HybridCacheState):
            refuse(f"expected a HybridCacheState, got {type(state).__name__}")
        if state.version != STATE_VERSION:
            refuse(f"version {state.version}, this engine reads version {STATE_VERSION}")
        if state.model_fingerprint != self.fingerprint:
            refuse(f"model fingerprint {state.model_fingerprint} != this engine's {self.fingerprint} "
                   f"(another config, other weights or another cache dtype)")
        if state.page_size != self.cache.page_size:
            refuse(f"page_size {state.page_size} != this engine's {self.cache.page_size}")
        if state.digest != state.compute_digest():
            refuse("digest mismatch: the state was changed or corrupted after export")
        got = state.prompt_token_ids
        if not isinstance(got, np.ndarray) or got.dtype != np.int64 or got.shape != (len(ids),) or \
                not np.array_equal(got, np.asarray(ids, dtype=np.int64)):
            refuse(f"its prompt_token_ids ({getattr(got, 'shape', None)}) differ from the request's prompt "
                   f"({len(ids)} tokens)")
        media = self._check_media_state(state, ids, refuse)
        if list(state.page_hashes) != page_hashes(ids, self.cache.page_size, media=state.media_spans):
            refuse("page_hashes do not match the prompt and its media")
        if not 0 <= state.first_token < self.cfg.vocab_size:
            refuse(f"first_token {state.first_token} out of range [0, {self.cfg.vocab_size})")
        if (params.seed is not None) != (state.generator_state is not None):
            refuse("a seeded request needs the generator state, an unseeded one has none")
        cdt = self.cache.dtype
        np_conv = np.int16 if cdt == torch.bfloat16 else np.float32
        kda, latents = {}, {}
        if sorted(state.kda_recurrent) != [s.layer_idx for s in self.cache.kda_specs] or \
                sorted(state.kda_conv) != [s.layer_idx for s in self.cache.kda_specs]:
            refuse(f"KDA layers {sorted(state.kda_recurrent)} != {[s.layer_idx for s in self.cache.kda_specs]}")
        for s in self.cache.kda_specs:
            rec, conv = state.kda_recurrent[s.layer_idx], state.kda_conv[s.layer_idx]
            if rec.shape != s.state_shape or rec.dtype != np.float32 or not np.isfinite(rec).all():
                refuse(f"KDA layer {s.layer_idx} recurrent state {rec.shape} {rec.dtype}, expected finite "
                       f"{s.state_shape} float32")
            if conv.shape != s.conv_shape or conv.dtype != np_conv:
                refuse(f"KDA layer {s.layer_idx} conv state {conv.shape} {conv.dtype}, expected {s.conv_shape} "
                       f"{np.dtype(np_conv)}")
            kda[s.layer_idx] = (to_torch(conv, cdt, self.device), to_torch(rec, torch.float32, self.device))
        if sorted(state.mla_latents) != [s.layer_idx for s in self.cache.mla_specs]:
            refuse(f"MLA layers {sorted(state.mla_latents)} != {[s.layer_idx for s in self.cache.mla_specs]}")
        for s in self.cache.mla_specs:
            lat = state.mla_latents[s.layer_idx]
            if lat.shape != (len(ids), s.latent_dim) or lat.dtype != np_conv:
                refuse(f"MLA layer {s.layer_idx} latents {lat.shape} {lat.dtype}, expected "
                       f"{(len(ids), s.latent_dim)} {np.dtype(np_conv)}")
            latents[s.layer_idx] = to_torch(lat, cdt, self.device)
        return latents, kda, media

    def _check_media_state(self, state: HybridCacheState, ids: list[int], refuse) -> SequenceMedia | None:
        """The handed-over spans and rows: they must describe this prompt's placeholders exactly."""
        spans, rows = list(state.media_spans), state.media_rows
        if not self.multimodal:
            if spans or rows is not None:
                refuse(f"it carries media, but this engine's model ({type(self.model).__name__}) has no vision tower")
            return None
        try:
            pos = check_spans(ids, spans, self.cfg.media_placeholder_token_id)
        except ValueError as e:
            refuse(str(e))
        if not pos:
            if rows is not None:
                refuse("media_rows given for a prompt without placeholders")
            return None
        want = (len(pos), self.cfg.hidden_size)
        if not isinstance(rows, np.ndarray) or rows.shape != want or rows.dtype != np.float32 or \
                not np.isfinite(rows).all():
            refuse(f"media_rows {getattr(rows, 'shape', None)} {getattr(rows, 'dtype', None)}, expected finite "
                   f"{want} float32")
        return SequenceMedia(None, spans, pos, to_torch(rows, torch.float32, self.device))

    # -- the shared prefix pool (run these through call()) -----------------------------------------
    def prefix_pages(self, prompt: list[int], media: list[MediaSpan] = (),
                     only: set[bytes] | None = None) -> list[PoolPage]:
        """The prompt's cached pages here, up to the deepest one with a snapshot, as pool pages
        (`media`: the prompt's spans, from `media_spans`; only the pages whose hash is in `only`,
        when given)."""
        cm, ps = self.cache, self.cache.page_size
        hashes = page_hashes(prompt, ps, media=media)
        depth = cm.resume_depth(prompt, hashes)
        out = []
        for j in range(depth):
            if only is not None and hashes[j] not in only:
                continue
            blk = cm.cached(hashes[j], tuple(prompt[j * ps:(j + 1) * ps]))
            snap = None
            if blk.snapshot_slot is not None and blk.snapshot_hash == hashes[j]:
                snap = {l: (to_numpy(c), to_numpy(r)) for l, (c, r) in cm.read_slot(blk.snapshot_slot).items()}
            out.append(PoolPage(hashes[j], j + 1, blk.tokens,
                                {l: to_numpy(t[blk.page]) for l, t in cm.mla_pages.items()}, snap))
        return out

    def local_resume_tokens(self, prompt: list[int], media: list[MediaSpan] = ()) -> int:
        return self.cache.resume_depth(prompt, page_hashes(prompt, self.cache.page_size, media=media)) * \
            self.cache.page_size

    def adopt_prefix(self, prompt: list[int], pages: list[PoolPage], media: list[MediaSpan] = ()) -> int:
        """Load pool pages for this prompt into the local prefix cache (pages it lacks, and the
        snapshots); returns the prompt tokens now resumable here. Pages that do not belong to the
        prompt (hash or tokens) or do not fit this model's shapes are refused with a ValueError."""
        cm, ps = self.cache, self.cache.page_size
        hashes = page_hashes(prompt, ps, media=media)
        np_dtype = np.int16 if cm.dtype == torch.bfloat16 else np.float32
        for j, p in enumerate(pages):
            if j >= len(hashes) or p.hash != hashes[j] or p.depth != j + 1 or \
                    tuple(p.tokens) != tuple(prompt[j * ps:(j + 1) * ps]):
                raise ValueError(f"pool page {j + 1} does not belong to this prompt")
            if sorted(p.latents) != [s.layer_idx for s in cm.mla_specs] or any(
                    a.shape != (ps, s.latent_dim) or a.dtype != np_dtype
                    for s, a in ((s, p.latents[s.layer_idx]) for s in cm.mla_specs)):
                raise ValueError(f"pool page {j + 1}: latents do not fit this engine's pages")
            if p.snapshot is not None and (sorted(p.snapshot) != [s.layer_idx for s in cm.kda_specs] or any(
                    p.snapshot[s.layer_idx][1].shape != s.state_shape or p.snapshot[s.layer_idx][0].shape != s.conv_shape
                    for s in cm.kda_specs)):
                raise ValueError(f"pool page {j + 1}: snapshot does not fit this engine's KDA layers")
        resumable = 0
        for j, p in enumerate(pages):
            blk = cm.cached(p.hash, tuple(p.tokens))
            if blk is None:
                page = cm.alloc_page()
                if page is None:
                    break
                cm.write_latents([page], 0, {l: to_torch(a, cm.dtype, self.device) for l, a in p.latents.items()})
                cm.register(p.hash, tuple(p.tokens), j + 1, page, ref=0)
                blk = cm.entries[p.hash]
            if p.snapshot is not None:
                if blk.snapshot_slot is None:
                    cm.store_snapshot(blk, {l: (to_torch(c, cm.dtype, self.device), to_torch(r, torch.float32, self.device))
                                            for l, (c, r) in p.snapshot.items()})
                resumable = (j + 1) * ps
        return resumable

    # -- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 media: list[list[MediaItem] | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); the final output of each, in order.
        Every prompt is validated before any is queued. `media[i]`: prompt i's items."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
            plist = params
        else:
            plist = [params or SamplingParams()] * len(prompts)
        mlist = media if media is not None else [None] * len(prompts)
        if len(mlist) != len(prompts):
            raise ValueError(f"media has {len(mlist)} entries for {len(prompts)} prompts")
        for i, (p, sp, m) in enumerate(zip(prompts, plist, mlist)):
            try:
                self.media_spans(self.validate(p, sp), m)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        rids = [self.add_request(None, p, sp, media=m) for p, sp, m in zip(prompts, plist, mlist)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(rids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r] for r in rids]

    def stats(self) -> dict:
        u = self.cache.usage()
        q = u["prefix_query_tokens"]
        return {**u, "steps": self.steps, "preemptions": self.scheduler.preemptions,
                "failed_forwards": self.failed_forwards, "media_items_encoded": self.media_items_encoded,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "prefix_hit_rate": (u["prefix_hit_tokens"] / q) if q else 0.0}
