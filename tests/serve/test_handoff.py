"""Prefill on one engine, decode on another: the handed-over hybrid cache state (KDA recurrent +
conv states, MLA latents, first token, sampling state) continues the request exactly."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from k3.model import K3ForCausalLM, get_preset
from k3.serve.engine import EngineConfig, HybridCacheState, LLMEngine, SamplingParams

CFG = EngineConfig(page_size=8, snapshot_interval=2, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=3)


def rand(n, seed):
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(eng, rid):
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def prefill(eng, prompt, params):
    rid = eng.add_request(None, prompt, params, prefill_only=True)
    outs = drain(eng, rid)
    assert len(outs) == 1 and outs[0].finished and outs[0].cache_state is not None
    return outs[0]


def decode(eng, prompt, state, params, busy=()):
    """Import into eng while it runs `busy` other requests; the request's outputs."""
    for i, p in enumerate(busy):
        eng.add_request(f"busy{i}-{len(prompt)}", p, SamplingParams(max_tokens=12, temperature=0))
    for _ in range(2):
        eng.step()
    rid = eng.import_request(None, prompt, state, params)
    return drain(eng, rid)


def whole_run(model, prompt, params):
    """One engine doing the whole request: (tokens, per-token logprob entries)."""
    eng = LLMEngine(model, CFG)
    return joined(drain(eng, eng.add_request(None, prompt, params)))


def joined(outs):
    return [t for o in outs for t in o.new_token_ids], [e for o in outs for e in o.logprobs]


@pytest.mark.parametrize("n", [1, 21, 32])  # 32 ends on a page and on a snapshot page, 21 on neither
@pytest.mark.parametrize("hit", ["none", "on prefill", "on decode"])
def test_prefill_here_decode_there_equals_one_engine(tiny_model, n, hit):
    prompt = rand(n, seed=n)
    whole_toks, whole_lps = whole_run(tiny_model, prompt, GREEDY)
    a, b = LLMEngine(tiny_model, CFG), LLMEngine(tiny_model, CFG)
    if hit == "on prefill":
        a.generate([prompt[:n - 1] + [5]], SamplingParams(max_tokens=1))
    if hit == "on decode":
        b.generate([prompt + [9, 9]], SamplingParams(max_tokens=1))
    first = prefill(a, prompt, GREEDY)
    outs = decode(b, prompt, first.cache_state, GREEDY, busy=[rand(30, 1), rand(11, 2)])
    toks, lps = joined(outs)
    assert toks == whole_toks and outs[-1].finished and outs[-1].finish_reason == "length"
    assert [e["token"] for e in lps] == [e["token"] for e in whole_lps]
    assert np.allclose([e["logprob"] for e in lps], [e["logprob"] for e in whole_lps], atol=1e-4)
    assert [sorted(e["top"]) for e in lps] == [sorted(e["top"]) for e in whole_lps]
    assert outs[0].new_token_ids == first.new_token_ids  # the first token comes across as chosen
    if hit == "on decode" and n >= 8:
        assert outs[-1].cached_tokens == (n // 8) * 8  # pages B already held were shared, not copied
    assert b.stats()["pages_in_use"] == 0 and b.stats()["running"] == 0


def test_seeded_sampling_continues_identically(tiny_model):
    prompt = rand(19, seed=7)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    whole, _ = whole_run(tiny_model, prompt, sp)
    first = prefill(LLMEngine(tiny_model, CFG), prompt, sp)
    toks, _ = joined(decode(LLMEngine(tiny_model, CFG), prompt, first.cache_state, sp, busy=[rand(9, 3)]))
    assert toks == whole


def test_a_first_token_that_ends_the_request_is_not_handed_over(tiny_model):
    out = prefill_or_final(LLMEngine(tiny_model, CFG), rand(12, 8), SamplingParams(max_tokens=1, temperature=0))
    assert out.finished and out.finish_reason == "length" and out.cache_state is None


def prefill_or_final(eng, prompt, params):
    rid = eng.add_request(None, prompt, params, prefill_only=True)
    return drain(eng, rid)[-1]


def tampered(state, **changes):
    return dataclasses.replace(state, **changes).seal()


@pytest.fixture(scope="module")
def handed(tiny_model):
    prompt = rand(21, seed=9)
    return prompt, prefill(LLMEngine(tiny_model, CFG), prompt, GREEDY).cache_state


def bad_states(state, prompt):
    mla, kda = min(state.mla_latents), min(state.kda_recurrent)
    other = K3ForCausalLM(get_preset("k3-tiny", hidden_size=96)).eval()
    return {
        "fingerprint": (tampered(state, model_fingerprint="0" * 32), prompt),
        "another config": (prefill(LLMEngine(other, CFG), prompt, GREEDY).cache_state, prompt),
        "digest": (dataclasses.replace(state, first_token=state.first_token + 1), prompt),
        "latents": (tampered(state, mla_latents={**state.mla_latents, mla: state.mla_latents[mla][:-1]}), prompt),
        "recurrent state": (tampered(state, kda_recurrent={**state.kda_recurrent,
                                                           kda: state.kda_recurrent[kda].astype(np.float64)}), prompt),
        "conv state": (tampered(state, kda_conv={**state.kda_conv, kda: state.kda_conv[kda][:, :1]}), prompt),
        "prompt_token_ids": (state, prompt[:-1] + [prompt[-1] ^ 1]),
        "page_size": (tampered(state, page_size=16), prompt),
        "version": (tampered(state, version=99), prompt),
        "generator state": (state, None),  # a seeded request needs one; this state has none
    }


@pytest.mark.parametrize("case", ["fingerprint", "another config", "digest", "latents", "recurrent state",
                                  "conv state", "prompt_token_ids", "page_size", "version", "generator state"])
def test_a_mismatched_state_is_refused_and_changes_nothing(tiny_model, handed, case):
    prompt, state = handed
    bad, p = bad_states(state, prompt)[case]
    params = SamplingParams(max_tokens=4, temperature=0.5, seed=3) if p is None else GREEDY
    b = LLMEngine(tiny_model, CFG)
    b.generate([rand(17, 4)], SamplingParams(max_tokens=2))
    before = b.stats()
    with pytest.raises(ValueError, match="cache state refused"):
        b.import_request(None, p or prompt, bad, params)
    assert b.stats() == before and not b.has_unfinished()
    toks, _ = joined(decode(b, prompt, state, GREEDY))  # the good state still goes in
    assert len(toks) == GREEDY.max_tokens


def test_state_is_plain_numpy_and_its_size_is_the_cache_it_holds(tiny_model, handed):
    prompt, state = handed
    assert isinstance(state, HybridCacheState)
    assert all(isinstance(a, np.ndarray) for _, a in state.arrays())
    cfg = tiny_model.cfg
    kda = cfg.layer_types.count("kda")
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    want = kda * (H * K * K * 4 + 3 * H * K * (cfg.kda_conv_size - 1) * 4) + \
        cfg.layer_types.count("mla") * len(prompt) * cfg.mla_latent_dim * 4 + len(prompt) * 8
    assert state.nbytes == want
