"""LLMEngine: add requests, step, stream outputs, abort. One forward per step for every
scheduled sequence (prefill chunks and decode tokens packed together).

Thread-safety: `add_request` validates synchronously (bad input raises ValueError and changes
nothing) and queues; `abort_request` queues; both are applied at the start of the next step, so
an asyncio front end may call them while a step runs in a worker thread.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from k3.model import K3ForCausalLM
from k3.model.generate import sample_next

from .cache_manager import CacheManager
from .detokenizer import Detokenizer, StopMatcher
from .params import EngineConfig, SamplingParams
from .scheduler import Scheduler, Sequence, Status

_ids = itertools.count()


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # everything generated so far
    text_delta: str = ""
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[dict] = field(default_factory=list)  # per new token: {"token", "logprob", "top": {id: lp}}
    prompt_tokens: int = 0
    cached_tokens: int = 0


class LLMEngine:
    def __init__(self, model: K3ForCausalLM, config: EngineConfig | None = None, tokenizer=None) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.config = config or EngineConfig()
        self.device = next(model.parameters()).device
        self.max_len = min(self.config.max_model_len or self.cfg.max_position_embeddings,
                           self.cfg.max_position_embeddings)
        self.cache = CacheManager(self.cfg, self.config, self.device)
        self.scheduler = Scheduler(self.cache, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.enable_prefix_caching, self.config.checkpoint_interval)
        if self.config.verify_prefix_hits:
            self.scheduler.verifier = self._verify_checkpoint
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.seqs: dict[str, Sequence] = {}
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self.steps = 0
        self.step_times: list[float] = []

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

    def add_request(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams | None = None) -> str:
        params = params or SamplingParams()
        ids = self.validate(prompt_token_ids, params)
        rid = request_id or f"req-{next(_ids)}"
        with self._lock:
            if rid in self.seqs or any(p[1] == rid for p in self._pending if p[0] == "add"):
                raise ValueError(f"request_id {rid!r} is already in use")
            seq = Sequence(rid, ids, params)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
            if self.detok is not None:
                seq.detok = self.detok.stream()
                seq.stopper = StopMatcher(params.stop, params.include_stop_str_in_output)
            self._pending.append(("add", rid, seq))
        return rid

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(("abort", request_id, None))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    def _apply_pending(self) -> list[RequestOutput]:
        outs = []
        with self._lock:
            items, self._pending = list(self._pending), deque()
        for kind, rid, seq in items:
            if kind == "add":
                self.seqs[rid] = seq
                self.scheduler.add(seq)
            elif rid in self.seqs:
                seq = self.seqs.pop(rid)
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                outs.append(self._output(seq, [], [], finished=True))
        return outs

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        outs = self._apply_pending()
        sched = self.scheduler.schedule()
        if not sched:
            return outs
        t0 = time.perf_counter()
        ids, lengths, slots, tables, context, sample_rows, snap = [], [], [], [], [], [], {}
        row = 0
        for i, s in enumerate(sched):
            seq = s.seq
            ids.extend(seq.tokens[seq.num_computed: seq.num_computed + s.num_tokens])
            lengths.append(s.num_tokens)
            slots.append(seq.slot)
            tables.append(seq.pages)
            context.append(seq.num_computed)
            row += s.num_tokens
            if seq.num_computed + s.num_tokens == seq.length:
                sample_rows.append((i, row - 1))
            if s.snapshot_offsets:
                snap[i] = s.snapshot_offsets
        batch = self.cache.cache_batch(lengths, slots, tables, context)
        if snap:
            batch.extras["kda_snapshot_offsets"] = snap
        logits_at = torch.tensor([r for _, r in sample_rows], dtype=torch.long, device=self.device)
        logits = self.model(torch.tensor([ids], device=self.device), cache=batch, logits_at=logits_at).logits
        states = self._collect_snapshots(batch, sched)
        for i, s in enumerate(sched):
            self.scheduler.after_step(s, states.get(i, {}))
        for (i, _), lg in zip(sample_rows, logits):
            outs.append(self._sample(sched[i].seq, lg))
        self.steps += 1
        self.step_times.append(time.perf_counter() - t0)
        return outs

    def _verify_checkpoint(self, prefix: list[int], slot: int, tol: float = 1e-3) -> bool:
        """Recompute the prefix cold and compare every KDA layer's state with the checkpoint."""
        from k3.model import HybridCache

        cold = HybridCache(self.cfg, 1, len(prefix), dtype=self.cache.dtype, device=self.device)
        self.model(torch.tensor([prefix], device=self.device), cache=cold.batch([len(prefix)]),
                   logits_at=torch.tensor([len(prefix) - 1], device=self.device))
        for layer, ref in cold.kda_state.items():
            got = self.cache.kda_state[layer][slot]
            err = float((got - ref[0]).norm() / ref[0].norm().clamp_min(1e-30))
            if err > tol:
                return False
        return True

    def _collect_snapshots(self, batch, sched) -> dict[int, dict[int, dict[int, tuple]]]:
        """{scheduled index: {offset: {kda layer: (conv, recurrent)}}}."""
        out: dict = {}
        for layer, items in batch.extras.get("kda_snapshots", {}).items():
            for i, off, st in items:
                out.setdefault(i, {}).setdefault(off, {})[layer] = (st.conv, st.recurrent)
        return out

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> RequestOutput:
        p = seq.params
        logits = logits.float()[None]
        eos = self.cfg.eos_token_id
        if len(seq.output) < p.min_tokens:
            ban = list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])
            if ban:
                logits[:, ban] = float("-inf")
        gen = seq.generator or self.generator
        tok = int(sample_next(logits, p.temperature, p.top_k, p.top_p, gen)[0])
        lp = []
        if p.logprobs is not None:
            logp = torch.log_softmax(logits[0], -1)
            entry = {"token": tok, "logprob": float(logp[tok])}
            if p.logprobs:
                top = logp.topk(p.logprobs)
                entry["top"] = {int(i): float(v) for v, i in zip(top.values, top.indices)}
            lp = [entry]
            seq.logprobs.extend(lp)
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
        if finished:
            if seq.detok is not None and not stop_hit:  # release held-back text
                tail, hit = seq.stopper.feed(seq.detok.flush())
                delta += tail if hit else tail + seq.stopper.finish()
            seq.status = Status.FINISHED
            self.scheduler.remove(seq)
            self.seqs.pop(seq.request_id, None)
        seq.text += delta
        return self._output(seq, [tok], lp, finished, delta)

    def _output(self, seq: Sequence, new: list[int], lp: list[dict], finished: bool, delta: str = "") -> RequestOutput:
        return RequestOutput(seq.request_id, new, list(seq.output), delta, seq.text, finished, seq.finish_reason,
                             lp, len(seq.prompt), seq.num_cached_tokens)

    # -- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); the final output of each, in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        rids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
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
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "prefix_hit_rate": (u["prefix_hit_tokens"] / q) if q else 0.0}
