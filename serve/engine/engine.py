"""LLMEngine: add requests, step, stream outputs, abort; export a prompt's cache state to another
engine and import one (the checks and conversions live in handoff.py, the memory in
cache_manager.py). One forward per step for every scheduled sequence (prefill chunks and decode
tokens packed together).

Thread-safety: `add_request`, `import_request` and `abort_request` validate synchronously (bad
input raises ValueError and changes nothing) and queue; the queue is applied at the start of the
next step, so an asyncio front end may call them while a step runs in a worker thread. Request
ids are reserved under the lock when accepted and released when the request ends or is aborted:
`abort_request` frees the id at once, and no output of the aborted request is returned after it
(not even from a step already running), so the id can be reused immediately.

Failure isolation: a request whose sampling fails ends alone with an error; a forward that
raises sends every sequence in it back to be recomputed alone (scheduler.py), so the culprit
fails alone and every other request continues exactly as if it had not been there.

Images and video (prompt_media.py): with a K3ForConditionalGeneration a request may carry processed
media items; each request's items are encoded once, at its first chunk that holds a
placeholder, and every chunk gets the rows of its own placeholders. The placeholder token is
never sampled (its embedding is a picture's, not a token's).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.model.vision_processor import MediaItem

from .cache_manager import CacheManager, KDAStates, PrefixCopy, PrefixHit, SeqCache, int64_tensor
from .detokenizer import Detokenizer, StopMatcher
from .graphs import DecodeGraph
from .handoff import Handoff, HybridCacheState, PoolPage, PoolRun
from .prompt_media import MediaRowCache, MediaSpan, SequenceMedia, check_item, media_spans
from .params import EngineConfig, SamplingParams, own_copy
from .sampler import Draw, SampleRow, sample
from .scheduler import Scheduled, Scheduler, Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # everything generated so far ([] while running, with cumulative_outputs off)
    text_delta: str = ""
    text: str = ""
    finished: bool = False
    # "stop" | "length" | "error"; None while running, and for a prefill-only request that ends
    # by handing its state over (cache_state set). An aborted request gets no more outputs (but
    # `generate`'s final one, "abort").
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)  # per new token: {"token", "logprob", "top": {id: lp}}
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    cache_state: HybridCacheState | None = None
    # wall-clock stamps of the Serve path ({hop: time.time()}), only when a request asked for them
    # (serve/servers.py fills it; the engine never does)
    trace: dict[str, float] | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One output saying what this one and the `later` one of the same request say (a stream
        reader that fell behind sends the steps it missed as one chunk)."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge outputs of requests {self.request_id!r} and {later.request_id!r}")
        return dataclasses.replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                                   text_delta=self.text_delta + later.text_delta,
                                   logprobs=self.logprobs + later.logprobs, trace=self.trace or later.trace)


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
        self.max_len = self.config.context_length(self.cfg)
        self.cache = CacheManager(self.cfg, self.config, self.device)
        self.scheduler = Scheduler(self.cache, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.enable_prefix_caching, self.config.snapshot_interval)
        if self.config.verify_prefix_hits:
            self.scheduler.verifier = self._verify_snapshot
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.handoff = Handoff(self.cache, model, self.config.dtype, self.config.handoff_key.get_secret_value(),
                               self.multimodal)
        # text models only: a vision model's decode carries media rows, and a wrapper may do anything
        self.decode_graph = DecodeGraph(model, self.device) if self.config.decode_graphs_on(self.device) and \
            type(model) is K3ForCausalLM else None
        if self.decode_graph is not None:
            self._start_decode_graphs()
        self.seqs: dict[str, Sequence] = {}  # admitted to the scheduler (the step thread's view)
        self._live: dict[str, Sequence] = {}  # every accepted, unfinished, unaborted request (guarded by _lock)
        self._pending: deque = deque()
        self._produced: list[tuple[Sequence, RequestOutput]] = []  # this step's outputs, delivered at its end
        self.deliveries = 0  # steps that have returned their outputs (counted under _lock)
        # False: a running request's outputs carry only the step's delta (`token_ids` [] and `text`
        # ""; the finished output carries the whole answer), as the servers send them, so no step
        # copies the answer so far (~100 us a step after 32K generated tokens, docs/benchmarks.md)
        self.cumulative_outputs = True
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
        # C-level passes over a long prompt (a Python loop per token took ~0.2 ms at 2K tokens);
        # the per-token loops run only to name what is wrong
        if not set(map(type, ids)) <= {int} and any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be integers")
        if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            raise ValueError(f"prompt token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias))):
            bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if params.min_tokens and len(set(self._banned_early(params))) >= self.cfg.vocab_size:
            raise ValueError(f"stop_token_ids (with EOS) are every token of the vocabulary, and min_tokens="
                             f"{params.min_tokens} bans them until then: no token could be sampled")
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_len} (prompt + at least 1 new)")
        if params.stop and self.detok is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        if params.max_tokens is None:  # to the end of the context: what the cache holds, if less
            room = self.room(len(ids))
            if room < 1:
                raise ValueError(f"prompt has {len(ids)} tokens but the whole cache holds "
                                 f"{self.cache.num_pages * self.cache.page_size} (prompt + at least 1 new); raise "
                                 f"cache_memory_bytes")
            if params.min_tokens > room:
                raise ValueError(f"min_tokens ({params.min_tokens}) is more than the {room} new tokens the cache holds "
                                 f"beside this prompt")
            return ids
        need = self.cache.pages_for(min(len(ids) + params.max_tokens, self.max_len))
        if need > self.cache.num_pages:
            raise ValueError(f"request needs {need} cache pages (prompt {len(ids)} + max_tokens {params.max_tokens}) "
                             f"but the whole cache holds {self.cache.num_pages}; lower max_tokens or raise "
                             f"cache_memory_bytes")
        return ids

    def room(self, prompt_len: int) -> int:
        """Most new tokens after a prompt of `prompt_len`: to max_model_len, or to the end of the
        cache when it holds fewer tokens (what `SamplingParams(max_tokens=None)` asks for)."""
        return min(self.max_len, self.cache.num_pages * self.cache.page_size) - prompt_len

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
            self._live[seq.request_id] = seq
            self._pending.append((kind, seq))
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
        params = own_copy(params)
        ids = self.validate(prompt_token_ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.room(len(ids))
        positions, spans = self.media_spans(ids, media)
        seq = self._new_sequence(request_id, ids, params)
        if spans:
            seq.media = SequenceMedia(list(media), spans, positions)
        seq.prefill_only = prefill_only
        return self._enqueue("add", seq)

    def import_request(self, request_id: str | None, prompt_token_ids: list[int], state: HybridCacheState,
                       params: SamplingParams | None = None, owned: bool = False) -> str:
        """Continue a request another engine prefilled: its first output (the handed-over first
        token) comes from the next step; decoding goes on from there. The state is checked
        completely (handoff.py) before anything is allocated: a mismatch raises ValueError and
        changes nothing. `owned`: the caller gives the state up (the engine process's reader,
        which unpickled it), so only its read-only arrays are copied before they are checked."""
        params = own_copy(params)
        ids = self.validate(prompt_token_ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.room(len(ids))
        t0 = time.perf_counter()
        imported = self.handoff.check_state(state, ids, params, owned=owned)
        state.timings["check_s"] = time.perf_counter() - t0
        seq = self._new_sequence(request_id, ids, params)
        seq.media = imported.media
        seq.hashes = imported.page_hashes if self.config.enable_prefix_caching else []
        seq.imported = imported
        if seq.generator is not None:
            seq.generator.set_state(imported.generator_state)
        return self._enqueue("import", seq)

    def call(self, fn) -> Future:
        """Run fn() in the step thread between two steps, where the cache may be read and changed
        safely (the prefix pool's export and import); the Future holds its result."""
        fut: Future = Future()
        with self._lock:
            self._pending.append(("call", (fn, fut)))
        return fut

    def abort_request(self, request_id: str) -> None:
        """Give up a request: its id is free at once, and no output of it is returned any more."""
        with self._lock:
            seq = self._live.pop(request_id, None)
            if seq is not None:
                seq.aborted = True
                self._pending.append(("abort", seq))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    def _release(self, seq: Sequence) -> None:
        """The request ended: forget it and free its id (unless an abort freed it already)."""
        if self.seqs.get(seq.request_id) is seq:
            del self.seqs[seq.request_id]
        with self._lock:
            if self._live.get(seq.request_id) is seq:
                del self._live[seq.request_id]

    def _apply_pending(self) -> None:
        with self._lock:
            items, self._pending = list(self._pending), deque()
        for kind, item in items:
            if kind == "call":
                fn, fut = item
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller gets it through the Future
                    fut.set_exception(e)
            elif kind == "abort":
                if self.seqs.get(item.request_id) is item:
                    self.scheduler.remove(item)
                    item.status = Status.FINISHED
                    self._release(item)
            else:
                self.seqs[item.request_id] = item
                if kind == "import":  # the first token, as the prefill engine chose it
                    self._accept(item, item.imported.first_token, item.imported.first_logprob)
                if item.status is not Status.FINISHED:
                    self.scheduler.add(item)

    def _deliver(self) -> list[RequestOutput]:
        """This step's outputs, less those of requests aborted meanwhile."""
        with self._lock:
            outs = [o for seq, o in self._produced if not seq.aborted]
            self.deliveries += 1
        self._produced = []
        return outs

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        self._apply_pending()
        sched = self.scheduler.schedule()
        if sched:
            sched = self._encode_media(sched)
        if sched:
            self._forward(sched)
        return self._deliver()

    def _forward(self, sched: list[Scheduled]) -> None:
        """One forward over the scheduled chunks, then sampling for the sequences it completes."""
        t0 = time.perf_counter()
        try:
            graph = self._graph_for(sched)
            batch, rows, sample_idx = self._build(sched, graph)
            logits = graph.logits(batch[0], batch[1]) if graph is not None else None
            if logits is None:
                extra = {"media_embeds": batch[2]} if self.multimodal else {}
                logits_at = int64_tensor(rows, self.device)
                logits = self.model(batch[0], cache=batch[1], logits_at=logits_at, **extra).logits
        except Exception as e:  # noqa: BLE001 - isolate whatever the forward raised
            self._forward_failed(sched, e)
            self.step_seconds.append(time.perf_counter() - t0)
            return
        snaps = self._mid_chunk_snapshots(batch[1])
        for i, s in enumerate(sched):
            self.scheduler.after_step(s, snaps.get(i, {}))
        seqs = [sched[i].seq for i in sample_idx]
        rows = [SampleRow(s.params, s.generator, self._banned(s), s.output) for s in seqs]
        try:
            draws = sample(logits, rows, self.generator) if seqs else []
        except Exception as e:  # noqa: BLE001 - the sampler checks each row; this is its last line of defence
            # the chunks are computed (after_step above): these sequences cannot be stepped again
            # without a token, so they fail; the engine and every other request go on
            draws = [Draw(None, None, f"sampling failed: {type(e).__name__}: {e}")] * len(seqs)
        for seq, d in zip(seqs, draws):
            if d.error is not None:
                self._fail(seq, d.error)
            else:
                self._accept(seq, d.token, d.logprob)
        self.steps += 1
        self.step_seconds.append(time.perf_counter() - t0)

    def _encode_media(self, sched: list[Scheduled]) -> list[Scheduled]:
        """Encode the media of every scheduled sequence whose chunk reaches its first placeholder
        (or, for a prefill-only request, its last prompt chunk: the handoff carries the rows even
        when a prefix hit skipped every placeholder, since decode may have to recompute); a
        sequence whose items fail to encode fails alone and leaves the batch."""
        keep = []
        for s in sched:
            seq, hi = s.seq, s.seq.num_computed + s.num_tokens
            if seq.media is not None and (seq.media.needs_rows(seq.num_computed, hi) or
                                          (seq.prefill_only and seq.media.rows is None and hi == seq.length)):
                try:
                    self.media_items_encoded += seq.media.encode(self.model, self.media_rows)
                except Exception as e:  # noqa: BLE001 - this request's media, this request's failure
                    self._fail(seq, f"encoding its media failed: {type(e).__name__}: {e}")
                    continue
            keep.append(s)
        return keep

    def _graph_for(self, sched: list[Scheduled]) -> DecodeGraph | None:
        """The compiled decode forward, for a batch of decode tokens only (every row sampled, no
        snapshot asked mid-chunk); None: run eagerly."""
        g = self.decode_graph
        if g is None or not g.ready or g.error is not None:  # not compiled (yet), or off
            return None
        ok = all(s.num_tokens == 1 and not s.snapshot_offsets and s.seq.num_computed + 1 == s.seq.length for s in sched)
        return g if ok else None

    def _start_decode_graphs(self) -> None:
        """Compile the decode graphs before any request's step needs them: a decode batch of one
        sequence and of two (`CacheManager.compile_batch`). On CPU over scratch pools, here or,
        with `compile_decode_wait=False`, in a background thread while steps run eagerly; on a GPU
        over the engine's own pools (CUDA graphs keep their addresses), here."""
        private = self.device.type == "cpu"
        if private and not self.config.compile_decode_wait:
            # not a daemon: the interpreter waits for it at exit (a daemon thread stopped while it
            # frees a tensor or runs an op, with the GIL released, aborts the process)
            threading.Thread(target=self._compile_decode_graphs, args=(private,), name="k3-decode-graphs").start()
        else:
            self._compile_decode_graphs(private)

    @torch.no_grad()
    def _compile_decode_graphs(self, private: bool) -> None:
        t0, g = time.perf_counter(), self.decode_graph
        try:
            for n in (1, 2)[:self.config.max_num_seqs]:
                # the batch's scratch pools (`private`) live until the next one is built
                cb = self.cache.compile_batch(n, g.table_width, private)
                if g.compile(torch.zeros((1, n), dtype=torch.long, device=self.device), cb) is None:
                    return  # graphs are off (logged); steps run eagerly
                del cb
            g.compile_seconds = time.perf_counter() - t0
            g.ready = True
            log.info("decode graphs compiled in %.1f s", g.compile_seconds)
        except Exception as e:  # noqa: BLE001 - a graph that fails (memory, ...) must not stop the engine
            g.error = f"{type(e).__name__}: {e}"
            log.warning("decode graphs are off for this engine, steps run eagerly: %s", g.error)
        finally:
            g.compiled.set()

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Wait until the decode graphs are compiled (or have failed); True when decode steps now
        run through them, False when graphs are off, failed, or `timeout` seconds passed first."""
        g = self.decode_graph
        return g is not None and g.compiled.wait(timeout) and g.ready and g.error is None

    def _build(self, sched: list[Scheduled], graph: DecodeGraph | None = None):
        ids, lengths, context, rows, sample_idx, offsets = [], [], [], [], [], {}
        media: list[torch.Tensor] = []  # rows of the placeholders in the batch, in batch order
        row = 0
        for i, s in enumerate(sched):
            seq = s.seq
            ids.extend(seq.token_slice(seq.num_computed, seq.num_computed + s.num_tokens))
            if seq.media is not None and (r := seq.media.rows_for(seq.num_computed, seq.num_computed + s.num_tokens)) \
                    is not None:
                media.append(r)
            lengths.append(s.num_tokens)
            context.append(seq.num_computed)
            row += s.num_tokens
            if seq.num_computed + s.num_tokens == seq.length:
                rows.append(row - 1)
                sample_idx.append(i)
            if s.snapshot_offsets:
                offsets[i] = s.snapshot_offsets
        cb = self.cache.cache_batch(lengths, [s.seq.mem for s in sched], context, offsets,
                                    table_width=graph.table_width if graph is not None else None)
        embeds = torch.cat(media).to(self.device) if media else None
        return (int64_tensor(ids, self.device)[None], cb, embeds), rows, sample_idx

    def _forward_failed(self, sched: list[Scheduled], e: Exception) -> None:
        self.failed_forwards += 1
        if len(sched) == 1:
            self._fail(sched[0].seq, f"the model's forward failed: {type(e).__name__}: {e}")
            return
        until = {id(s.seq): s.seq.num_computed + s.num_tokens for s in sched}
        self.scheduler.preempt_for_recompute([s.seq for s in sched], until)

    @staticmethod
    def _mid_chunk_snapshots(cb) -> dict[int, dict[int, KDAStates]]:
        """{scheduled index: {offset: {kda layer: (conv, recurrent)}}} from what the layers recorded."""
        out: dict = {}
        for layer, snaps in cb.snapshots.items():
            for s in snaps:
                out.setdefault(s.seq, {}).setdefault(s.offset, {})[layer] = (s.conv, s.recurrent)
        return out

    def _verify_snapshot(self, seq: Sequence, hit: PrefixHit, tol: float = 1e-3) -> bool:
        """Recompute seq's first hit.num_tokens tokens cold and compare every KDA layer's state
        with the snapshot the hit would start from."""
        from k3.model import HybridCache

        n = hit.num_tokens
        prefix = seq.tokens[:n]
        extra = {}
        if self.multimodal:
            if seq.media is not None and seq.media.needs_rows(0, n):
                self.media_items_encoded += seq.media.encode(self.model, self.media_rows)
            extra["media_embeds"] = seq.media.rows_for(0, n) if seq.media is not None else None
        cold = HybridCache(self.cfg, 1, len(prefix), dtype=self.cache.dtype, device=self.device)
        self.model(torch.tensor([prefix], device=self.device), cache=cold.batch([len(prefix)]),
                   logits_at=torch.tensor([len(prefix) - 1], device=self.device), **extra)
        snapshot = self.cache.snapshot_states(hit)
        for layer, pool in cold.kda.items():
            ref, got = pool.recurrent[0], snapshot[layer][1]
            if float((got - ref).norm() / ref.norm().clamp_min(1e-30)) > tol:
                return False
        return True

    def _banned(self, seq: Sequence) -> list[int]:
        if len(seq.output) >= seq.params.min_tokens:
            return [self.cfg.media_placeholder_token_id] if self.multimodal else []
        return self._banned_early(seq.params)

    def _banned_early(self, p: SamplingParams) -> list[int]:
        """Tokens a request may not produce before its min_tokens: the media placeholder (always),
        its stop ids and EOS."""
        eos = self.cfg.eos_token_id
        always = [self.cfg.media_placeholder_token_id] if self.multimodal else []
        return always + list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])

    def _accept(self, seq: Sequence, tok: int, lp: dict | None) -> None:
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
                if hit:  # the held-back text completed a stop string: the answer stopped on it
                    seq.finish_reason = "stop"
        elif seq.prefill_only:
            state, finished = self.handoff.export_state(seq, tok, lp), True
        if finished:
            seq.status = Status.FINISHED
            self.scheduler.remove(seq)
            self._release(seq)
        seq.text += delta
        self._output(seq, [tok], lps, finished, delta).cache_state = state

    def _fail(self, seq: Sequence, message: str) -> None:
        self.scheduler.remove(seq, failed=True)
        seq.status, seq.finish_reason = Status.FINISHED, "error"
        self._release(seq)
        self._output(seq, [], [], True).error = message

    def _output(self, seq: Sequence, new: list[int], lp: list[dict], finished: bool, delta: str = "") -> RequestOutput:
        whole = finished or self.cumulative_outputs
        out = RequestOutput(seq.request_id, new, list(seq.output) if whole else [], delta, seq.text if whole else "",
                            finished, seq.finish_reason, lp, len(seq.prompt), seq.num_cached_tokens)
        self._produced.append((seq, out))
        return out

    # -- the shared prefix pool (run these in the step thread: call()) --------------------------------
    def cached_prefix_tokens(self, prompt: list[int], media: list[MediaSpan] = ()) -> int:
        """Prompt tokens this engine could start from its own prefix cache (`media`: the
        prompt's spans, from `media_spans`)."""
        return self.handoff.cached_prefix_tokens(prompt, media)

    def export_prefix(self, prompt: list[int], media: list[MediaSpan] = (), only: set[bytes] | None = None,
                      bare: Collection[bytes] = ()) -> list[PoolPage]:
        """The prompt's cached pages here, up to the deepest one with a snapshot, as sealed pool
        pages (only the pages whose hash is in `only`, when given; those in `bare` only where
        they keep a snapshot here): `copy_prefix` here, then `seal_prefix`, which may run in
        another thread."""
        return self.handoff.export_prefix(prompt, media, only, bare)

    def copy_prefix(self, prompt: list[int], media: list[MediaSpan] = (), only: set[bytes] | None = None,
                    bare: Collection[bytes] = ()):
        """The step thread's share of `export_prefix`: copies of the pages' bytes (a few gathers)."""
        return self.handoff.copy_prefix(prompt, media, only, bare)

    def seal_prefix(self, prompt: list[int], copied: PrefixCopy) -> list[PoolPage]:
        """Pool pages of what `copy_prefix` took, sealed; reads no engine state (any thread)."""
        return self.handoff.seal_prefix(prompt, copied)

    def import_prefix(self, prompt: list[int], pages: PoolRun | list[PoolPage], media: list[MediaSpan] = ()) -> int:
        """Load pool pages for this prompt (the pages and snapshots this cache lacks); returns
        the prompt tokens now resumable here. A page that does not belong to the prompt, is not
        sealed under this engine's handoff_key or does not fit its model: ValueError, nothing loaded."""
        return self.handoff.import_prefix(prompt, pages, media)

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no running request holds (and its snapshot); returns how many."""
        return self.cache.evict_idle()

    # -- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 media: list[list[MediaItem] | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); the final output of each, in order.
        Every prompt is validated before any is queued. `media[i]`: prompt i's items. A request
        aborted meanwhile (`abort_request` from another thread) ends with finish_reason "abort"
        and what it had generated. It steps the engine itself: outputs of requests queued by other
        callers are consumed and dropped (use `step` for those)."""
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
        with self._lock:
            seqs = dict(zip(rids, (self._live.get(r) for r in rids)))  # None: aborted already
        final: dict[str, RequestOutput] = {}
        while True:
            for (r, seq), p in zip(seqs.items(), prompts):
                if r not in final and (seq is None or seq.aborted):  # no output of it will come
                    final[r] = RequestOutput(r, [], list(seq.output) if seq else [], "", seq.text if seq else "",
                                             True, "abort", [], len(p), seq.num_cached_tokens if seq else 0)
            if len(final) == len(rids):
                return [final[r] for r in rids]
            for o in self.step():
                if o.finished and o.request_id in seqs:
                    final[o.request_id] = o


    def stats(self) -> dict:
        u, g = self.cache.usage(), self.decode_graph
        q = u["prefix_query_tokens"]
        return {**u, "steps": self.steps, "preemptions": self.scheduler.preemptions,
                "failed_forwards": self.failed_forwards, "media_items_encoded": self.media_items_encoded,
                "decode_graph_steps": g.calls if g is not None else 0,
                "decode_graph_compile_s": g.compile_seconds if g is not None else None,
                "decode_graphs": g.state if g is not None else "off",
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "prefix_hit_rate": (u["prefix_hit_tokens"] / q) if q else 0.0}
