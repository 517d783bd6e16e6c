"""The protocol models and error bodies as the official `openai` client reads them, through a small
FastAPI app that answers with them (no engine): answers, streams, logprobs, usage and errors."""
from __future__ import annotations

import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from k3.serve.errors import OpenAIError, api_key_dependency, install_error_handlers, require_model
from k3.serve.protocol import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    new_id,
    sse_error,
    sse_event,
)
from k3.serve.convert import sampling_kwargs

openai = pytest.importorskip("openai")

KEY = "sk-k3"
MODEL = "k3-tiny"
TOKENS = ["Hel", "lo", "!"]
LOGPROBS = [-0.25, -0.5, -1.0]


def chat_logprobs(tokens, logprobs, top):
    return ChatLogprobs(content=[ChatTokenLogprob(
        token=t, logprob=lp, bytes=list(t.encode()),
        top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))] * top)
        for t, lp in zip(tokens, logprobs)])


def make_app() -> FastAPI:
    """Answers every request with TOKENS, as the real app answers with generated ones."""
    app = FastAPI()
    install_error_handlers(app)
    auth = [Depends(api_key_dependency(KEY))]

    @app.get("/v1/models", dependencies=auth)
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id=MODEL, max_model_len=64)])

    @app.post("/v1/completions", dependencies=auth)
    def completions(req: CompletionRequest):
        require_model(req.model, [MODEL])
        sampling_kwargs(req, max_model_len=64, prompt_len=len(req.prompt), vocab_size=4096)
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs(tokens=TOKENS, token_logprobs=LOGPROBS,
                                    top_logprobs=[{t: x} for t, x in zip(TOKENS, LOGPROBS)], text_offset=[0, 3, 5])
        usage = UsageInfo.of(4, len(TOKENS) * req.n)
        if not req.stream:
            return CompletionResponse(model=MODEL, usage=usage, choices=[
                CompletionChoice(index=i, text="".join(TOKENS), logprobs=lp, finish_reason="length")
                for i in range(req.n)])
        rid = new_id("cmpl")

        def events():
            for j, t in enumerate(TOKENS):
                yield sse_event(CompletionStreamResponse(id=rid, model=MODEL, choices=[CompletionChoice(
                    index=0, text=t, finish_reason="length" if j == len(TOKENS) - 1 else None)]))
            if req.stream_options and req.stream_options.include_usage:
                yield sse_event(CompletionStreamResponse(id=rid, model=MODEL, choices=[], usage=usage))
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=auth)
    def chat(req: ChatCompletionRequest):
        require_model(req.model, [MODEL])
        kw = sampling_kwargs(req, max_model_len=64, prompt_len=8, vocab_size=4096)
        lp = chat_logprobs(TOKENS, LOGPROBS, kw["logprobs"]) if kw["logprobs"] is not None else None
        usage = UsageInfo.of(8, len(TOKENS))
        if not req.stream:
            return ChatCompletionResponse(model=MODEL, usage=usage, choices=[ChatCompletionChoice(
                index=0, message=ChatResponseMessage(content="".join(TOKENS)), logprobs=lp, finish_reason="stop")])
        rid = new_id("chatcmpl")
        fail = req.user == "fail-mid-stream"

        def events():
            yield sse_event(ChatCompletionStreamResponse(id=rid, model=MODEL, choices=[
                ChatCompletionStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))]))
            for j, t in enumerate(TOKENS):
                if fail and j == 1:
                    yield sse_error(OpenAIError("the replica holding this request died", status=500,
                                                type="server_error"))
                    yield SSE_DONE
                    return
                yield sse_event(ChatCompletionStreamResponse(id=rid, model=MODEL, choices=[ChatCompletionStreamChoice(
                    index=0, delta=ChatDelta(content=t),
                    logprobs=chat_logprobs([t], [LOGPROBS[j]], kw["logprobs"]) if lp else None,
                    finish_reason="stop" if j == len(TOKENS) - 1 else None)]))
            if req.stream_options and req.stream_options.include_usage:
                yield sse_event(ChatCompletionStreamResponse(id=rid, model=MODEL, choices=[], usage=usage))
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_with_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="def f(", max_tokens=3, logprobs=1, n=2)
    assert [c.text for c in r.choices] == ["Hello!"] * 2 and r.choices[1].index == 1
    assert r.choices[0].logprobs.tokens == TOKENS and r.choices[0].logprobs.token_logprobs == LOGPROBS
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 4 + 6 and r.id.startswith("cmpl-")


def test_chat_with_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                       max_completion_tokens=3)
    msg = r.choices[0].message
    assert (msg.role, msg.content, r.choices[0].finish_reason) == ("assistant", "Hello!", "stop")
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == TOKENS and len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[0].bytes == list(b"Hel") and r.usage.completion_tokens == 3


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream(client, include_usage):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, logprobs=True,
                                                 stream_options={"include_usage": include_usage}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello!" and chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "stop" and set(finish[:-1]) == {None}
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == TOKENS
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 11
    else:
        assert all(c.usage is None for c in chunks)


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="x", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello!"
    assert chunks[-1].usage.prompt_tokens == 4


def test_error_mid_stream_raises_in_the_client(client):
    with pytest.raises(openai.APIError, match="replica holding this request died"):
        list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, user="fail-mid-stream"))


@pytest.mark.parametrize("call,exc,param,code", [
    (lambda c: c.chat.completions.create(model="gpt-x", messages=MESSAGES), openai.NotFoundError, "model",
     "model_not_found"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", max_tokens=0), openai.BadRequestError, "max_tokens", None),
    (lambda c: c.completions.create(model=MODEL, prompt="x", temperature=-1), openai.BadRequestError, "temperature",
     None),
    (lambda c: c.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=1.5), openai.BadRequestError, "top_p",
     None),
    (lambda c: c.completions.create(model=MODEL, prompt=list(range(64))), openai.BadRequestError, "prompt",
     "context_length_exceeded"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", extra_body={"bogus": 1}), openai.BadRequestError,
     "bogus", None),
    (lambda c: c.with_options(api_key="sk-wrong").models.list(), openai.AuthenticationError, None, "invalid_api_key"),
])
def test_errors_as_the_client_sees_them(client, call, exc, param, code):
    with pytest.raises(exc) as e:
        call(client)
    assert (e.value.param, e.value.code) == (param, code)
    assert e.value.type in ("invalid_request_error", "authentication_error")
