"""Batched generation over the contiguous HybridCache: packed prefill, then one-token decode steps.

The serving engine (serve/engine) replaces this with continuous batching over paged memory;
this loop is the simple, exact baseline the tests and the demo use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

from .cache import HybridCache
from .model import K3ForCausalLM


# Below this temperature sampling is greedy, here and in the serving engine (serve/engine/params.py):
# dividing the logits by a denormal temperature overflows them to inf and the softmax is NaN.
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass
class SamplingConfig:
    max_tokens: int = 32
    temperature: float = 0.0  # below GREEDY_BELOW (0 included): greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        """ValueError naming the first field of the wrong type or out of range."""
        for name in ("max_tokens", "top_k"):
            _integer(name, getattr(self, name))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _integer("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t)


def _integer(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> token ids [N]: greedy below GREEDY_BELOW, else temperature, top-k, top-p."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: K3ForCausalLM, prompts: list[list[int]], sampling: SamplingConfig | None = None,
             return_logits: bool = False) -> list[list[int]] | tuple[list[list[int]], list[torch.Tensor]]:
    """Continue each prompt (token id lists, any lengths) by up to sampling.max_tokens tokens.

    Returns the new tokens per prompt (stopping after a stop token, which is kept), and with
    return_logits the logits [steps, V] each token was chosen from.
    """
    sc = SamplingConfig() if sampling is None else sampling
    if not isinstance(sc, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sc).__name__}")
    sc.validate()
    if not isinstance(prompts, (list, tuple)) or not prompts or \
            any(not isinstance(p, (list, tuple)) or len(p) == 0 for p in prompts):
        got = type(prompts).__name__ if not isinstance(prompts, (list, tuple)) else "an empty or non-list entry"
        raise ValueError(f"prompts must be a non-empty list of non-empty token id lists (a tensor: .tolist() it), "
                         f"got {got}")
    cfg = model.cfg
    for i, p in enumerate(prompts):
        if any(isinstance(t, bool) or not isinstance(t, Integral) for t in p):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got {p[:8]!r}")
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {cfg.vocab_size})")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    lens = [len(p) for p in prompts]
    max_len = max(lens) + sc.max_tokens
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_tokens = {max_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    cache = HybridCache(cfg, len(prompts), max_len, dtype=dtype, device=device)
    gen = None
    if sc.seed is not None:
        gen = torch.Generator(device=device).manual_seed(sc.seed)

    ids = torch.tensor([t for p in prompts for t in p], device=device)[None]
    batch = cache.batch(lens)
    last = batch.cu_seqlens[1:] - 1
    logits = model(ids, cache=batch, logits_at=last).logits
    cache.advance(lens)
    out: list[list[int]] = [[] for _ in prompts]
    seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    stops = set(sc.stop_token_ids)
    for step in range(sc.max_tokens):
        nxt = sample_next(logits, sc.temperature, sc.top_k, sc.top_p, gen)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                if return_logits:
                    seen[i].append(logits[i].float().cpu())
                done[i] = t in stops
        if all(done) or step == sc.max_tokens - 1:
            break
        batch = cache.batch([1] * len(prompts))
        logits = model(nxt[:, None], cache=batch).logits[:, -1]
        cache.advance([1] * len(prompts))
    if return_logits:
        return out, [torch.stack(s) for s in seen]
    return out
