"""Prefill on one engine, decode on another: the handed-over hybrid cache state (KDA recurrent +
conv states, MLA latents, first token, sampling state) continues the request exactly. A state the
importer cannot trust (another model, another key, changed, malformed, non-finite) is refused
before anything is allocated, and an import never replaces what the importer holds."""
from __future__ import annotations

import copy
import dataclasses

import blake3
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


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=10, temperature=0, logprobs=2, frequency_penalty=2.0, logit_bias={7: 1.0}),
    SamplingParams(max_tokens=10, temperature=0.9, seed=5, presence_penalty=1.5, frequency_penalty=0.5,
                   logit_bias={7: 3.0}),
])
def test_penalties_count_the_handed_over_first_token(tiny_model, sp):
    # the decode side counts what was generated from the request's own tokens, the first one
    # (sampled by the prefill engine) included: the same tokens as one engine
    prompt = rand(14, seed=11)
    whole, _ = whole_run(tiny_model, prompt, sp)
    first = prefill(LLMEngine(tiny_model, CFG), prompt, sp)
    toks, _ = joined(decode(LLMEngine(tiny_model, CFG), prompt, first.cache_state, sp, busy=[rand(9, 4)]))
    assert toks == whole
    if sp.greedy:  # without the penalty the bias would repeat token 7 every step
        assert whole[0] == 7 and whole.count(7) == 1


def test_a_first_token_that_ends_the_request_is_not_handed_over(tiny_model):
    out = prefill_or_final(LLMEngine(tiny_model, CFG), rand(12, 8), SamplingParams(max_tokens=1, temperature=0))
    assert out.finished and out.finish_reason == "length" and out.cache_state is None


def prefill_or_final(eng, prompt, params):
    rid = eng.add_request(None, prompt, params, prefill_only=True)
    return drain(eng, rid)[-1]


KEY = CFG.handoff_key.get_secret_value()  # what a holder of the key could reseal a changed state with
SEEDED = SamplingParams(max_tokens=4, temperature=0.5, seed=3, logprobs=3)


def tampered(state, **changes):
    return dataclasses.replace(state, **changes).seal(KEY)


def sealed_without_key(state, **changes):
    """Changed, and given a digest computed as one could without the key (unkeyed BLAKE3, the MAC's
    own hash)."""
    state = dataclasses.replace(state, **changes)
    h = blake3.blake3()
    for _, a in state.arrays():
        h.update(a.tobytes())
    return dataclasses.replace(state, digest=h.digest())


def filled(arrays, value):
    """A copy of {layer: array} whose first layer holds value everywhere."""
    k = min(arrays)
    return {**arrays, k: np.full_like(arrays[k], value)}


def shifted(arrays, by=0.44):
    return {k: a + by for k, a in arrays.items()}


@pytest.fixture(scope="module")
def handed(tiny_model):
    prompt = rand(21, seed=9)
    return prompt, prefill(LLMEngine(tiny_model, CFG), prompt, GREEDY).cache_state


def other_model_state(m, s, p):
    other = K3ForCausalLM(get_preset("k3-tiny", hidden_size=96)).eval()
    return prefill(LLMEngine(other, CFG), p, GREEDY).cache_state, p, GREEDY


def other_key_state(m, s, p):
    cfg = EngineConfig.model_validate({**CFG.model_dump(), "handoff_key": "another-secret-012"})
    return prefill(LLMEngine(m, cfg), p, GREEDY).cache_state, p, GREEDY


BAD_STATES = {  # case -> f(model, good state, its prompt) -> (state, prompt, params) to import
    "fingerprint": lambda m, s, p: (tampered(s, model_fingerprint="0" * 32), p, GREEDY),
    "another config": other_model_state,
    "another key": other_key_state,
    "changed after sealing": lambda m, s, p: (dataclasses.replace(s, first_token=s.first_token + 1), p, GREEDY),
    "resealed without the key": lambda m, s, p: (sealed_without_key(s, kda_recurrent=shifted(s.kda_recurrent)),
                                                 p, GREEDY),
    "latents": lambda m, s, p: (tampered(s, mla_latents={k: a[:-1] for k, a in s.mla_latents.items()}), p, GREEDY),
    "recurrent state": lambda m, s, p: (
        tampered(s, kda_recurrent={k: a.astype(np.float64) for k, a in s.kda_recurrent.items()}), p, GREEDY),
    "conv state": lambda m, s, p: (tampered(s, kda_conv={k: a[:, :1] for k, a in s.kda_conv.items()}), p, GREEDY),
    "recurrent state not finite": lambda m, s, p: (tampered(s, kda_recurrent=filled(s.kda_recurrent, np.nan)),
                                                   p, GREEDY),
    "conv state not finite": lambda m, s, p: (tampered(s, kda_conv=filled(s.kda_conv, np.nan)), p, GREEDY),
    "latents not finite": lambda m, s, p: (tampered(s, mla_latents=filled(s.mla_latents, np.inf)), p, GREEDY),
    "prompt_token_ids": lambda m, s, p: (s, p[:-1] + [p[-1] ^ 1], GREEDY),
    "page_size": lambda m, s, p: (tampered(s, page_size=16), p, GREEDY),
    "cache_dtype": lambda m, s, p: (tampered(s, cache_dtype="bfloat16"), p, GREEDY),
    "version": lambda m, s, p: (tampered(s, version=99), p, GREEDY),
    "version as text": lambda m, s, p: (tampered(s, version=str(s.version)), p, GREEDY),
    # the prefill engine bans stop ids before min_tokens: this first token was sampled under other params
    "a first token min_tokens forbids": lambda m, s, p: (
        s, p, SamplingParams(**{**GREEDY.model_dump(), "min_tokens": 2, "stop_token_ids": [s.first_token]})),
    "first_logprob": lambda m, s, p: (tampered(s, first_logprob={**s.first_logprob, "token": s.first_token + 1}),
                                      p, GREEDY),
    "no generator state": lambda m, s, p: (s, p, SEEDED),  # a seeded request needs one; this state has none
    "generator state of another size": lambda m, s, p: (tampered(s, generator_state=np.zeros(16, np.uint8)),
                                                        p, SEEDED),
    "generator state no generator takes": lambda m, s, p: (
        tampered(s, generator_state=np.zeros(torch.Generator().get_state().numel(), np.uint8)), p, SEEDED),
    "kda states not a dict": lambda m, s, p: (dataclasses.replace(s, kda_recurrent=list(s.kda_recurrent.values())),
                                              p, GREEDY),
    "not a state": lambda m, s, p: (dataclasses.asdict(s), p, GREEDY),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_a_mismatched_state_is_refused_and_changes_nothing(tiny_model, handed, case):
    prompt, state = handed
    bad, p, params = BAD_STATES[case](tiny_model, state, prompt)
    b = LLMEngine(tiny_model, CFG)
    b.generate([rand(17, 4)], SamplingParams(max_tokens=2))
    before = b.stats()
    with pytest.raises(ValueError, match="cache state refused"):
        b.import_request(None, p, bad, params)
    assert b.stats() == before and not b.has_unfinished()
    toks, _ = joined(decode(b, prompt, state, GREEDY))  # the good state still goes in
    assert len(toks) == GREEDY.max_tokens


def test_refusals_name_the_value(tiny_model, handed):
    prompt, state = handed
    for case, says in [("version as text", f"version '{state.version}'"), ("a first token min_tokens forbids",
                                                                           "min_tokens=2 forbids")]:
        bad, p, params = BAD_STATES[case](tiny_model, state, prompt)
        with pytest.raises(ValueError, match=says):
            LLMEngine(tiny_model, CFG).import_request(None, p, bad, params)


@pytest.mark.parametrize("case", ["another key", "resealed without the key"])
def test_a_state_not_sealed_under_the_engines_key_says_so(tiny_model, handed, case):
    prompt, state = handed
    bad, p, params = BAD_STATES[case](tiny_model, state, prompt)
    with pytest.raises(ValueError, match="does not verify under this engine's handoff_key"):
        LLMEngine(tiny_model, CFG).import_request(None, p, bad, params)


def test_engines_share_a_key_through_their_config(tiny_model):
    prompt = rand(13, seed=12)
    key = {"handoff_key": "a-cluster-secret-0123"}
    first = prefill(LLMEngine(tiny_model, EngineConfig(page_size=8, **key)), prompt, GREEDY)
    toks, _ = joined(decode(LLMEngine(tiny_model, EngineConfig(page_size=8, **key)), prompt, first.cache_state,
                            GREEDY))
    assert toks == whole_run(tiny_model, prompt, GREEDY)[0]
    with pytest.raises(ValueError, match="handoff_key"):
        EngineConfig(handoff_key="short")


def test_an_import_never_replaces_the_snapshot_the_engine_holds(tiny_model):
    # B computed the prompt itself; an imported state for it (changed, but well formed and sealed
    # with the key: only a recompute could tell) must not replace B's snapshot of it.
    prompt = rand(32, seed=3)  # 4 pages: B keeps a snapshot after page 4
    b = LLMEngine(tiny_model, CFG)
    b.generate([prompt + [5]], GREEDY)
    state = prefill(LLMEngine(tiny_model, CFG), prompt, GREEDY).cache_state
    decode(b, prompt, tampered(state, kda_recurrent=shifted(state.kda_recurrent)), GREEDY)
    later = b.generate([prompt + [9, 9]], GREEDY)[0]
    assert later.cached_tokens == 32
    assert later.token_ids == LLMEngine(tiny_model, CFG).generate([prompt + [9, 9]], GREEDY)[0].token_ids


def test_an_imported_prompt_is_shared_and_later_hits_equal_a_cold_run(tiny_model):
    prompt = rand(32, seed=4)
    b = LLMEngine(tiny_model, CFG)
    decode(b, prompt, prefill(LLMEngine(tiny_model, CFG), prompt, GREEDY).cache_state, GREEDY)
    later = b.generate([prompt + [9, 9]], GREEDY)[0]
    assert later.cached_tokens == 32  # the imported pages and the state after them
    assert later.token_ids == LLMEngine(tiny_model, CFG).generate([prompt + [9, 9]], GREEDY)[0].token_ids


def test_arrays_changed_after_the_import_do_not_reach_the_engine(tiny_model, handed):
    prompt, state = handed
    state = copy.deepcopy(state)
    b = LLMEngine(tiny_model, CFG)
    rid = b.import_request(None, prompt, state, GREEDY)
    for arrays in (state.kda_recurrent, state.kda_conv, state.mla_latents):
        for a in arrays.values():
            a += 0.5  # in place, after the check, before the next step loads the state
    toks, _ = joined(drain(b, rid))
    assert toks == whole_run(tiny_model, prompt, GREEDY)[0]


def test_an_owned_state_is_copied_only_where_its_arrays_are_read_only(handed):
    """The engine process's reader owns the state it unpickled: `private_copy(keep_writable=True)`
    takes its writable arrays as they are and copies the read-only ones (memory another holds)."""
    _, state = copy.deepcopy(handed)
    layer = min(state.mla_latents)
    state.mla_latents[layer].flags.writeable = False
    own = state.private_copy(keep_writable=True)
    assert own.mla_latents[layer] is not state.mla_latents[layer] and own.mla_latents[layer].flags.writeable
    np.testing.assert_array_equal(own.mla_latents[layer], state.mla_latents[layer])
    assert all(own.kda_recurrent[k] is a for k, a in state.kda_recurrent.items())
    assert own.prompt_token_ids is state.prompt_token_ids
    whole = state.private_copy()
    assert not any(np.shares_memory(a, b) for (_, a), (_, b) in zip(whole.arrays(), state.arrays()))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_finite_check_finds_one_bad_value_anywhere(dtype):
    # the import's one-pass check (min and max) against torch.isfinite: a single NaN or infinity
    # at either end or inside is found, the largest finite value passes, an empty tensor passes
    from k3.serve.engine.handoff import all_finite

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[3] = torch.finfo(dtype).max
    x[4] = torch.finfo(dtype).min
    assert all_finite(x) and all_finite(x.view(10, 100)) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 517, 999):
            y = x.clone()
            y[at] = bad
            assert not all_finite(y) and not all_finite(y.view(10, 100)), (bad, at)
            assert bool(torch.isfinite(y).all()) is False


def test_a_mac_is_its_bytes_in_order_whatever_the_arrays_sizes():
    """`_mac` joins small arrays before hashing them (BLAKE3 is faster on larger updates); the
    digest is still keyed BLAKE3 over the header, then every array's bytes in order, so seals made
    before the change check after it. Empty, tiny, mid-size and large arrays, in every mix."""
    from k3.serve.engine.handoff import _JOIN_BELOW, _mac, _mac_key

    rng = np.random.default_rng(1)
    sizes = [0, 1, 1000, 4096, _JOIN_BELOW // 4 - 1, _JOIN_BELOW // 4, 3 * _JOIN_BELOW // 4]  # float32 elements
    for trial in range(30):
        n = int(rng.integers(0, 9))
        arrays = [(f"a{i}", rng.random(int(rng.choice(sizes)), dtype=np.float32)) for i in range(n)]
        ref = blake3.blake3(key=_mac_key("secret", b"k3 pool page"))
        ref.update(repr((("header", trial), [(k, a.dtype.str, a.shape) for k, a in arrays])).encode())
        for _, a in arrays:
            ref.update(a.view(np.uint8).data)
        assert _mac("secret", b"k3 pool page", ("header", trial), arrays) == ref.digest()


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])  # uint16: bf16 pages travel as their bit patterns
def test_pages_sealed_together_seal_as_each_page_alone(dtype):
    """`_page_macs` (a publish's and an import's pages, from whole layer arrays) makes each page's
    `_page_mac`: pages sealed by one check under the other, whatever the depths and layer widths."""
    from k3.serve.engine.handoff import _page_mac, _page_macs

    rng = np.random.default_rng(2)
    ps, n = 4, 6
    latents = {7: (rng.random((n * ps, 5)) * 1000).astype(dtype), 3: (rng.random((n * ps, 9)) * 1000).astype(dtype)}
    hashes = [bytes([k]) * 16 for k in range(n)]
    depths = [1, 2, 5, 6, 9, 12]  # pages of a prompt need not be consecutive (a publish sends those the pool lacks)
    tokens = [tuple(int(t) for t in rng.integers(0, 4000, ps)) for _ in range(n)]
    got = _page_macs("secret", hashes, depths, tokens, latents)
    for k in range(n):
        page = {l: a[k * ps:(k + 1) * ps] for l, a in latents.items()}
        assert got[k] == _page_mac("secret", hashes[k], depths[k], tokens[k], page)
    assert len(set(got)) == n
