"""A long prompt through the engine (16K tokens on k3-tiny): what it holds grows as the cache
formula says and nothing else grows with the context, and a prefix hit resumed from a KDA snapshot
gives the cold run's tokens. (The 128K runs are jobs/bench_long_serve.py.)"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from k3.model.cache import cache_bytes
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams

CHUNK, PAGE = 2048, 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def sized_config(cfg, length: int) -> EngineConfig:
    """An engine holding one request of `length` + 4 tokens, with a KDA snapshot at every chunk end."""
    fixed = cache_bytes(cfg, 0, torch.float32)
    pages = -(-(length + GREEDY.max_tokens) // PAGE)
    snapshots = (length // CHUNK + 1) * fixed
    budget = fixed + snapshots + pages * (cache_bytes(cfg, PAGE, torch.float32) - fixed)
    return EngineConfig(max_num_seqs=1, max_num_batched_tokens=CHUNK, page_size=PAGE, cache_memory_bytes=budget,
                        snapshot_interval=CHUNK // PAGE, snapshot_memory_fraction=snapshots / (budget - fixed) + 1e-9)


def prompt_of(length: int) -> list[int]:
    return torch.randint(0, 4096, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def peak_tensor_bytes(fn):
    """fn()'s result and the most torch tensor bytes live at once while it ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak


def serve_cold(model, length: int):
    """A fresh engine sized for the prompt and its cold run: (engine, output, peak tensor bytes)."""
    def run():
        eng = LLMEngine(model, sized_config(model.cfg, length))
        return eng, eng.generate([prompt_of(length)], GREEDY)[0]

    (eng, out), peak = peak_tensor_bytes(run)
    return eng, out, peak


@pytest.fixture(scope="module")
def runs(tiny_model):
    # 4K: two chunks, the second over a cached context as every later chunk of the 16K prompt
    return {n: serve_cold(tiny_model, n) for n in (4096, 16384)}


@pytest.mark.slow  # a 16K-token prompt served cold (the fixture, ~30 s), the full tier
def test_memory_grows_as_the_cache_formula_says(runs):
    (short, _, peak_short), (long, _, peak_long) = runs[4096], runs[16384]
    for eng, n in ((short, 4096), (long, 16384)):  # the engine allocated what the formula asks for
        assert cache_bytes(eng.cfg, n, torch.float32) <= eng.cache.nbytes() <= eng.config.cache_memory_bytes
    # the working set of a chunk does not grow with the context: the peak grows by the cache alone
    growth, formula = peak_long - peak_short, long.cache.nbytes() - short.cache.nbytes()
    assert abs(growth / formula - 1) < 0.1, (growth, formula)


@pytest.mark.slow
def test_prefix_hit_at_16k_resumes_from_a_snapshot_and_equals_the_cold_run(runs):
    eng, cold, _ = runs[16384]
    hit = eng.generate([prompt_of(16384)], GREEDY)[0]
    assert hit.cached_tokens == 16384 - CHUNK  # the last snapshot before the end of the prompt
    assert hit.token_ids == cold.token_ids
