"""The real Ingress in front of an in-process LLMServer, without Ray (a handle that calls the
server's generator directly): hostile input is a 4xx naming the field, a fault mid-stream ends
the stream with an error event and [DONE], streamed logprobs match the whole answer's, token
ids past the tokenizer's table have empty text, and a long prompt does not hold the event loop."""
from __future__ import annotations

import asyncio
import copy
import json
import random
import time

import httpx
import pytest
from starlette.testclient import TestClient

from k3.model.tokenizer import train_bpe
from k3.serve import ingress as ingress_mod
from k3.serve.servers import LLMServer

CONFIG = {"model_id": "k3", "model": {"preset": "k3-tiny", "seed": 0},
          "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "page_size": 8,
                     "cache_memory_bytes": 32 * 2**20, "compile_decode": False, "max_model_len": 2048},
          "engine_process": False, "direct_stream": False, "torch_threads": 1}


class _Call:
    """A Serve streaming call as the ingress sees it, over the server's async generator."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.get_running_loop().create_task(self.agen.aclose())


class _Handle:
    """What the ingress uses of a deployment handle, calling `server` in this process (each call
    gets its own copy of the request, as a Serve call would)."""

    def __init__(self, server: LLMServer) -> None:
        self.generate = self
        self.server = server

    def options(self, **_):
        return self

    def remote(self, req):
        return _Call(self.server.generate(copy.deepcopy(req)))


def _app(config: dict):
    # @serve.ingress subclasses the class it decorates; the class itself builds without Ray
    cls = next(c for c in ingress_mod.Ingress.__mro__ if "__serve_build_asgi_app__" in c.__dict__)
    return cls(config, _Handle(LLMServer(config))).__serve_build_asgi_app__()


@pytest.fixture(scope="module")
def client():
    with TestClient(_app(CONFIG), raise_server_exceptions=False) as c:
        yield c


def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]


def _post(client, body: dict, path="/v1/completions"):
    # json.dumps writes a lone surrogate as "\ud800", which the server's JSON parser gives back
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 4301: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"0": 1, "00": -1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(5000))}, "stop_token_ids"),
    # a number sent as a string is refused, as OpenAI's API refuses it (pydantic would read "5" as 5)
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": "1"}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "10"}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": True}, "presence_penalty"),
])
def test_hostile_input_is_a_400_naming_the_field(client, path, body, param):
    r = _post(client, {"model": "k3", "max_tokens": 2, **body}, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def small_tokenizer_client(tmp_path_factory):
    """The app with a 300-token tokenizer in front of a 4096-token model (the config allows it)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(["hello world, the quick brown fox"] * 50, vocab_size=300).save(str(path))
    config = copy.deepcopy(CONFIG)
    config["model"]["tokenizer_path"] = str(path)
    with TestClient(_app(config), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_ids_past_the_tokenizer_are_empty_text(small_tokenizer_client, stream):
    body = {"model": "k3", "prompt": "hello", "max_tokens": 3, "logprobs": 0, "logit_bias": {"4000": 100},
            "stream": stream}
    r = _post(small_tokenizer_client, body)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.endswith("data: [DONE]\n\n")
        tokens = [t for ev in _events(r) for ch in ev["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    else:
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == ["", "", ""]  # token 4000, pushed up by its bias, has no text in this tokenizer


def test_a_fault_mid_stream_ends_it_with_an_error_event_and_done(client, monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("a bug while shaping logprobs")

    monkeypatch.setattr(ingress_mod, "completion_logprobs", broken)
    r = _post(client, {"model": "k3", "prompt": "hello", "max_tokens": 3, "logprobs": 1, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    err = _events(r)[-1]["error"]
    assert err["type"] == "server_error" and "bug" not in err["message"]
    request_id = err["message"].split("request id ")[1].split(")")[0]
    assert any(request_id in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("stop", [None, ["qqqqqqqqqqqqqqqqqqqq"]])  # a stop string holds text back
def test_streamed_text_offsets_are_the_whole_answers(client, stop):
    body = {"model": "k3", "prompt": "hello", "max_tokens": 12, "seed": 7, "logprobs": 1, "stop": stop}
    whole = _post(client, body).json()["choices"][0]["logprobs"]
    events = _events(_post(client, {**body, "stream": True}))
    lps = [ch["logprobs"] for ev in events for ch in ev["choices"] if ch["logprobs"]]
    assert [t for lp in lps for t in lp["tokens"]] == whole["tokens"]
    assert [o for lp in lps for o in lp["text_offset"]] == whole["text_offset"]


@pytest.mark.parametrize("text", ["end here<|eos|> and go on", "look <|media_pad|><|bos|>"])
def test_a_chat_message_that_spells_a_special_token_is_read_as_text(client, text):
    from tokenizers import Tokenizer

    from k3.model.tokenizer import BUNDLED_TOKENIZER, SPECIAL_TOKENS, load_tokenizer
    from k3.serve.chat import ChatTemplate

    tok = load_tokenizer(BUNDLED_TOKENIZER)
    as_text = Tokenizer.from_str(tok.to_str())
    as_text.encode_special_tokens = True
    assert not set(as_text.encode(text).ids) & set(range(len(SPECIAL_TOKENS)))
    head, tail = ChatTemplate().render([{"role": "user", "content": "\0"}]).split("\0")
    literal = tok.encode(head).ids + as_text.encode(text).ids + tok.encode(tail).ids
    r = _post(client, {"model": "k3", "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
              "/v1/chat/completions")
    assert r.status_code == 200, r.text
    # encoded whole, each special token's spelling was its id: an end of text, or a media slot
    assert r.json()["usage"]["prompt_tokens"] == len(literal) > len(tok.encode(head + text + tail).ids)


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_replicas_cache():
    import k3.model
    from k3.serve.engine import EngineConfig, LLMEngine

    probe = LLMEngine(k3.model.build(k3.model.get_preset("k3-tiny"), seed=0).eval(),
                      EngineConfig(max_num_seqs=2, page_size=8, enable_prefix_caching=False, compile_decode=False))
    config = copy.deepcopy(CONFIG)
    config["engine"].update(max_num_seqs=2, enable_prefix_caching=False,
                            cache_memory_bytes=2 * probe.cache.slot_bytes + 12 * probe.cache.page_bytes)
    body = {"model": "k3", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "logit_bias": {"2": -100}}  # no EOS: the answer runs on
    with TestClient(_app(config), raise_server_exceptions=False) as c:
        r = _post(c, body, "/v1/chat/completions")
        assert r.status_code == 200, r.text  # the context is 2048 tokens; the cache holds 96
        usage, choice = r.json()["usage"], r.json()["choices"][0]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 96 and choice["finish_reason"] == "length"
        # a max_tokens the client asks for is kept to: more than the cache holds is a 400
        r = _post(c, {**body, "max_tokens": 100}, "/v1/chat/completions")
        assert r.status_code == 400 and "cache pages" in r.json()["error"]["message"], r.text
    # a deployment may cap what is unasked (default_max_tokens); what is asked stays the client's
    with TestClient(_app({**config, "default_max_tokens": 5}), raise_server_exceptions=False) as c:
        assert _post(c, body, "/v1/chat/completions").json()["usage"]["completion_tokens"] == 5
        assert _post(c, {**body, "max_tokens": 7}, "/v1/chat/completions").json()["usage"]["completion_tokens"] == 7


def test_a_max_model_len_past_the_models_positions_is_refused_at_start():
    config = copy.deepcopy(CONFIG)
    config["engine"]["max_model_len"] = 10**9  # k3-tiny has 2**20 positions: /v1/models would have said 10**9
    cls = next(c for c in ingress_mod.Ingress.__mro__ if "__serve_build_asgi_app__" in c.__dict__)
    with pytest.raises(ValueError, match="max_model_len=1000000000 is more than the model's max_position_embeddings"):
        cls(config, _Handle(None))


def test_a_long_prompt_is_tokenized_off_the_event_loop():
    app = _app(CONFIG)
    rng = random.Random(0)
    text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x1", "yy"]) for _ in range(200_000))

    async def main():
        ticks = [time.perf_counter()]  # when the event loop last ran another task

        async def ticker():
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.perf_counter())

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://k3") as c:
            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json={"model": "k3", "prompt": text, "max_tokens": 1})
            took = time.perf_counter() - t0
            ticks.append(time.perf_counter())
            tick.cancel()
        return r, took, max(b - a for a, b in zip(ticks, ticks[1:]))

    r, took, stall = asyncio.run(main())
    # too long for the context: tokenized (about a second here), then refused
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert stall < max(0.25, took / 3), (stall, took)
