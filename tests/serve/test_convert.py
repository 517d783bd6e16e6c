"""A request's conversion for the engine (k3.serve.convert): sampling arguments from the OpenAI
fields, token-id checks, and the engine's logprobs in OpenAI's shapes (no engine, no Ray)."""
from __future__ import annotations

import pytest

from k3.serve.convert import chat_logprobs, check_token_ids, completion_logprobs, sampling_kwargs
from k3.serve.engine import SamplingParams
from k3.serve.errors import OpenAIError
from k3.serve.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 4096


def completion(**kw):
    return {"model": "k3-tiny", "prompt": "def f(", **kw}


def chat(content="hi", **kw):
    return {"model": "k3-tiny", "messages": [{"role": "user", "content": content}], **kw}


# ---- sampling arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("body,prompt_len,max_tokens", [
    (completion(), 10, 16),               # OpenAI's completion default
    (completion(max_tokens=None), 10, None),  # to the end of the context (the engine's, or its cache's)
    (completion(max_tokens=54), 10, 54),
    (chat(), 10, None),                   # chat: the same
    (chat(max_tokens=5), 10, 5),
    (chat(max_tokens=5, max_completion_tokens=7), 10, 7),  # max_completion_tokens wins
])
def test_sampling_kwargs_max_tokens(body, prompt_len, max_tokens):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    kw = sampling_kwargs(model.model_validate(body), max_model_len=64, prompt_len=prompt_len, vocab_size=VOCAB)
    assert kw["max_tokens"] == max_tokens
    SamplingParams(**kw)  # the engine takes every key


@pytest.mark.parametrize("body,prompt_len,max_tokens", [
    (chat(), 10, 20),                        # unasked: the deployment's default
    (chat(), 50, None),                      # ... unless the context ends first
    (completion(max_tokens=None), 10, 20),
    (chat(max_tokens=40), 10, 40),           # asked: kept, over the default too
    (completion(), 10, 16),                  # a completion's own default is asked by its schema
])
def test_the_deployments_default_max_tokens_caps_only_what_is_unasked(body, prompt_len, max_tokens):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    kw = sampling_kwargs(model.model_validate(body), max_model_len=64, prompt_len=prompt_len, vocab_size=VOCAB,
                         default_max_tokens=20)
    assert kw["max_tokens"] == max_tokens


@pytest.mark.parametrize("body,prompt_len,param", [
    (completion(), 64, "prompt"),
    (completion(max_tokens=55), 10, "prompt"),
    (chat(), 70, "messages"),
    (chat(max_completion_tokens=60), 10, "messages"),
])
def test_sampling_kwargs_context_length_exceeded(body, prompt_len, param):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(OpenAIError) as e:
        sampling_kwargs(model.model_validate(body), max_model_len=64, prompt_len=prompt_len, vocab_size=VOCAB)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", param)
    assert "64" in e.value.message


def test_sampling_kwargs_maps_openai_fields():
    kw = sampling_kwargs(CompletionRequest.model_validate(completion(
        temperature=0, top_p=0.9, top_k=-1, seed=5, stop="END", logprobs=3, n=3, min_tokens=2, ignore_eos=True,
        stop_token_ids=[9], logit_bias={"17": -3.5}, presence_penalty=0.5, frequency_penalty=-1)),
        max_model_len=128, prompt_len=4, vocab_size=VOCAB, choice_index=2)
    assert kw == {"max_tokens": 16, "min_tokens": 2, "temperature": 0.0, "top_p": 0.9, "top_k": 0, "seed": 7,
                  "stop": ["END"], "stop_token_ids": [9], "ignore_eos": True, "logprobs": 3,
                  "include_stop_str_in_output": False, "logit_bias": {17: -3.5}, "presence_penalty": 0.5,
                  "frequency_penalty": -1.0}
    SamplingParams(**kw)


def test_sampling_kwargs_choice_index_counts_over_the_batch():
    req = CompletionRequest.model_validate(completion(prompt=["a", "b"], n=2, seed=10))
    seeds = [sampling_kwargs(req, max_model_len=64, prompt_len=1, vocab_size=VOCAB, choice_index=k)["seed"]
             for k in range(4)]
    assert seeds == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="choice_index"):
        sampling_kwargs(req, max_model_len=64, prompt_len=1, vocab_size=VOCAB, choice_index=4)


@pytest.mark.parametrize("body,param", [
    (completion(stop_token_ids=[1, VOCAB]), "stop_token_ids"),
    (completion(logit_bias={str(VOCAB + 5): 1}), "logit_bias"),
    (chat(logit_bias={"3": 1, str(VOCAB): 1}), "logit_bias"),
])
def test_sampling_kwargs_refuses_token_ids_outside_the_vocabulary(body, param):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(OpenAIError) as e:
        sampling_kwargs(model.model_validate(body), max_model_len=64, prompt_len=1, vocab_size=VOCAB)
    assert (e.value.status, e.value.param) == (400, param) and str(VOCAB) in e.value.message


@pytest.mark.parametrize("ids,ok", [([0, VOCAB - 1], True), ([VOCAB], False), ([3, 99999], False)])
def test_check_token_ids(ids, ok):
    if ok:
        check_token_ids(ids, VOCAB, "prompt")
        return
    with pytest.raises(OpenAIError) as e:
        check_token_ids(ids, VOCAB, "prompt")
    assert (e.value.status, e.value.param) == (400, "prompt") and f"[0, {VOCAB})" in e.value.message


@pytest.mark.parametrize("logprobs,top_logprobs,expect", [(False, None, None), (True, None, 0), (True, 4, 4)])
def test_sampling_kwargs_chat_logprobs(logprobs, top_logprobs, expect):
    req = ChatCompletionRequest.model_validate(chat(logprobs=logprobs, top_logprobs=top_logprobs))
    assert sampling_kwargs(req, max_model_len=32, prompt_len=3, vocab_size=VOCAB)["logprobs"] == expect


@pytest.mark.parametrize("kwargs", [dict(max_model_len=0, prompt_len=1), dict(max_model_len=8, prompt_len=-1),
                                    dict(max_model_len=8, prompt_len=1, choice_index=1),
                                    dict(max_model_len=8, prompt_len=1, vocab_size=0)])
def test_sampling_kwargs_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        sampling_kwargs(CompletionRequest.model_validate(completion()), **{"vocab_size": VOCAB, **kwargs})


def test_sampling_kwargs_min_tokens_over_max_tokens_is_a_400():
    with pytest.raises(OpenAIError) as e:
        sampling_kwargs(CompletionRequest.model_validate(completion(min_tokens=20)), max_model_len=64, prompt_len=1,
                        vocab_size=VOCAB)
    assert (e.value.status, e.value.param) == (400, "min_tokens")


# ---- the engine's logprobs in OpenAI's shapes ----------------------------------------------------

TOKEN_BYTES = {1: b"He", 2: b"llo", 3: b"\xc3", 4: b"\xa9", 5: b"!"}  # 3 + 4: "é" split over two tokens
ENTRIES = [{"token": 1, "logprob": -0.1, "top": {1: -0.1, 5: -2.5}},
           {"token": 2, "logprob": -0.2, "top": {2: -0.2, 1: -3.0}},
           {"token": 3, "logprob": -0.3, "top": {3: -0.3, 5: -1.5}}]


def test_chat_logprobs_from_engine_entries():
    lp = chat_logprobs(ENTRIES, TOKEN_BYTES.__getitem__)
    assert [c.token for c in lp.content] == ["He", "llo", "\ufffd"]
    assert lp.content[2].bytes == [0xC3]  # the exact byte, though the text cannot show it
    assert [(t.token, t.logprob) for t in lp.content[0].top_logprobs] == [("He", -0.1), ("!", -2.5)]
    no_top = chat_logprobs([{"token": 5, "logprob": -0.5}], TOKEN_BYTES.__getitem__)
    assert no_top.content[0].top_logprobs == [] and no_top.content[0].token == "!"


def test_completion_logprobs_from_engine_entries():
    lp = completion_logprobs(ENTRIES[:2], TOKEN_BYTES.__getitem__, text_offset=10)
    assert lp.tokens == ["He", "llo"] and lp.token_logprobs == [-0.1, -0.2] and lp.text_offset == [10, 12]
    assert lp.top_logprobs[0] == {"He": -0.1, "!": -2.5}
    chosen_only = completion_logprobs([{"token": 5, "logprob": -0.5}], TOKEN_BYTES.__getitem__)
    assert chosen_only.top_logprobs == [{"!": -0.5}]  # logprobs=0: the chosen token alone


def test_logprobs_with_the_k3_tokenizer_table():
    from k3.model.tokenizer import train_bpe
    from k3.serve.engine.detokenizer import Detokenizer

    tok = train_bpe(["héllo wörld, def f(x): return x"] * 20, vocab_size=300)
    table = Detokenizer(tok).table
    ids = tok.encode("héllo wörld").ids
    lp = chat_logprobs([{"token": i, "logprob": -1.0} for i in ids], table.__getitem__)
    assert bytes(b for c in lp.content for b in c.bytes).decode() == "héllo wörld"


def test_choice_seeds_stay_in_range():
    req = CompletionRequest.model_validate(completion(seed=2**63 - 1, n=3))
    seeds = [sampling_kwargs(req, max_model_len=64, prompt_len=1, vocab_size=VOCAB, choice_index=i)["seed"]
             for i in range(3)]
    assert seeds == [2**63 - 1, 0, 1]
    for i in range(3):
        SamplingParams(**sampling_kwargs(req, max_model_len=64, prompt_len=1, vocab_size=VOCAB, choice_index=i))
