"""The OpenAI protocol models, errors and handlers (no engine, no Ray); the request-to-engine
conversion is tests/serve/test_convert.py."""
from __future__ import annotations

import json

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from k3.serve.convert import sampling_kwargs
from k3.serve.engine import SamplingParams
from k3.serve.errors import OpenAIError, api_key_dependency, install_error_handlers, param_from_loc, require_model
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
    ImageURLPart,
    ModelCard,
    ModelList,
    TextChunks,
    TopLogprob,
    UsageInfo,
    VideoURLPart,
    sse_error,
    sse_event,
)

KEY = "sk-test-123"
VOCAB = 4096


def completion(**kw):
    return {"model": "k3-tiny", "prompt": "def f(", **kw}


def chat(content="hi", **kw):
    return {"model": "k3-tiny", "messages": [{"role": "user", "content": content}], **kw}


def error_param(model, body) -> str | None:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    deepest = max(e.value.errors(), key=lambda er: len(er["loc"]))
    return param_from_loc(deepest["loc"])


# ---- requests: good bodies ---------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    completion(),
    completion(prompt=[1, 2, 3], max_tokens=None),
    completion(temperature=0, top_p=0.5, top_k=-1, seed=3, stop="\n", n=2, logprobs=5, user="u"),
    completion(stop=["a", "b"], stream=True, stream_options={"include_usage": True}, ignore_eos=True,
               min_tokens=2, stop_token_ids=[7], presence_penalty=0, frequency_penalty=0.0, echo=False),
    completion(prompt=["a", "b"], logit_bias={"5": 10, "7": -100}, presence_penalty=-2, frequency_penalty=2),
    completion(prompt=[[1, 2], [3]], stop=[str(i) for i in range(16)], logit_bias={}),
    completion(logit_bias={"0": 1, "10": -1, "9999999999": 2}, stop_token_ids=list(range(4096))),
])
def test_completion_request_accepts(body):
    req = CompletionRequest.model_validate(body)
    assert req.model == "k3-tiny"


@pytest.mark.parametrize("body", [
    chat(),
    chat([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
          {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]),
    {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]},
    chat(max_tokens=4, max_completion_tokens=8, logprobs=True, top_logprobs=20, stream=True,
         stream_options={"include_usage": False}, seed=0, stop=["x"]),
    chat(response_format={"type": "text"}, store=True, metadata={f"k{i}": "v" * 512 for i in range(16)},
         parallel_tool_calls=True, tools=[], tool_choice="none", logit_bias={"0": 100}, presence_penalty=1.5),
    chat(store=False, metadata={}, parallel_tool_calls=False, tool_choice=None),
])
def test_chat_request_accepts(body):
    req = ChatCompletionRequest.model_validate(body)
    assert req.messages[-1].role in ("user", "assistant")


def test_developer_messages_are_system_messages():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                                                           {"role": "user", "content": "hi"}]})
    assert [m.role for m in req.messages] == ["system", "user"]


@pytest.mark.parametrize("prompt,batch", [
    ("text", ["text"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_a_prompt_is_a_batch_of_one_or_more(prompt, batch):
    assert CompletionRequest.model_validate(completion(prompt=prompt)).prompts() == batch


def test_chat_message_text_and_media_keep_the_parts():
    req = ChatCompletionRequest.model_validate(chat(
        [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u1"}},
         {"type": "text", "text": "and"}, {"type": "video_url", "video_url": {"url": "u2"}}]))
    assert req.messages[0].text() == "look\nand"
    media = req.media()
    assert [type(p) for p in media] == [ImageURLPart, VideoURLPart]
    assert [media[0].image_url.url, media[1].video_url.url] == ["u1", "u2"]
    assert ChatCompletionRequest.model_validate(chat()).media() == []


# ---- requests: bad bodies name the field -----------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    (completion(prompt=""), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[1, -2]), "prompt"),
    (completion(prompt=5), "prompt"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(temperature=-0.1), "temperature"),
    (completion(temperature=2.5), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_p=1.01), "top_p"),
    (completion(top_k=-2), "top_k"),
    (completion(logprobs=21), "logprobs"),
    (completion(n=0), "n"),
    (completion(stop=["ok", ""]), "stop"),
    (completion(echo=True), "echo"),
    (completion(presence_penalty=2.5), "presence_penalty"),
    (completion(frequency_penalty=-2.01), "frequency_penalty"),
    (completion(frequency_penalty=float("nan")), "frequency_penalty"),
    (completion(prompt=["a", ""]), "prompt"),
    (completion(prompt=[[1], []]), "prompt"),
    (completion(prompt=[[1], [-1]]), "prompt"),
    (completion(prompt=["a"] * 129), "prompt"),
    (completion(prompt=["a"] * 3, n=50), "prompt"),  # 150 choices
    (completion(stop=[str(i) for i in range(17)]), "stop"),
    (completion(logit_bias={"x": 1}), "logit_bias"),
    (completion(logit_bias={"-1": 1}), "logit_bias"),
    (completion(logit_bias={"5": 101}), "logit_bias"),
    (completion(logit_bias={"5": float("inf")}), "logit_bias"),
    (completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (completion(suffix="x"), "suffix"),
    (completion(best_of=2), "best_of"),
    (completion(max_tokens="many"), "max_tokens"),
    (completion(seed=2**63), "seed"),
    (completion(seed=-1), "seed"),
    (completion(stop_token_ids=[3, -1]), "stop_token_ids[1]"),
    (completion(stream_options={"include_usage": True}), None),  # needs stream=true: a model-level rule
    (completion(prompt="\ud800"), "prompt"),  # a lone surrogate, as json.loads gives "\\ud800"
    (completion(prompt=["ok", "a\udfffb"]), "prompt"),
    (completion(logit_bias={"1" * 5000: 1}), "logit_bias"),  # past int()'s digit limit
    (completion(logit_bias={"0": 1, "00": -1}), "logit_bias"),  # two spellings of one id
    (completion(logit_bias={"12345678901": 1}), "logit_bias"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(n=True), "n"),
    (completion(seed=False), "seed"),
    (completion(logprobs=True), "logprobs"),
    (completion(top_k=True), "top_k"),
    (completion(min_tokens=True), "min_tokens"),
    (completion(prompt=[True, False]), "prompt[0]"),
    (completion(prompt=[[1], [2, True]]), "prompt[1][1]"),
    (completion(stop_token_ids=[3, True]), "stop_token_ids[1]"),
    (completion(stop_token_ids=list(range(4097))), "stop_token_ids"),
])
def test_completion_request_refuses(body, param):
    assert error_param(CompletionRequest, body) == param


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    (chat([{"type": "text", "text": 3}]), "messages[0].content[0].text"),
    (chat([{"type": "image_url", "image_url": {}}]), "messages[0].content[0].image_url.url"),
    (chat([{"type": "audio", "audio": {}}]), "messages[0].content[0]"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (chat(top_logprobs=2), None),  # needs logprobs=true
    (chat(logprobs=3), "logprobs"),
    (chat(echo=False), "echo"),  # chat has no echo field at all
    (chat(response_format={"type": "json_object"}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}), "response_format"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    (chat(metadata={"k": 1}), "metadata.k"),
    (chat(metadata={"k" * 65: "v"}), "metadata"),
    (chat(metadata={"k": "v" * 513}), "metadata.k"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat(tool_choice="auto"), "tool_choice"),
    (chat(parallel_tool_calls=True, tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat(logit_bias={"1": -100.5}), "logit_bias"),
    (chat("a\udfffb"), "messages[0].content"),
    (chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud800"}]), "messages[0].content[1].text"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_completion_tokens=True), "max_completion_tokens"),
    (chat(logprobs=True, top_logprobs=True), "top_logprobs"),
])
def test_chat_request_refuses(body, param):
    assert error_param(ChatCompletionRequest, body) == param


@pytest.mark.parametrize("model,body,needle", [
    (ChatCompletionRequest, chat(response_format={"type": "json_object"}), "not supported"),
    (ChatCompletionRequest, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "not supported"),
    (CompletionRequest, completion(stop=["s"] * 17), "at most 16"),
    (CompletionRequest, completion(logit_bias={"x": 1}), "token id"),
    (CompletionRequest, completion(logit_bias={"00": 1}), "without leading zeros"),
    (CompletionRequest, completion(max_tokens=True), "must be an integer, got true"),
    (CompletionRequest, completion(prompt="\ud800"), "lone surrogate"),
    (ChatCompletionRequest, chat(content=[]), "non-empty list of parts"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "not assistant messages"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "developer", "content": [
        {"type": "video_url", "video_url": {"url": "data:image/gif;base64,AAAA"}}]}]}, "not system messages"),
])
def test_deliberate_refusals_say_why(model, body, needle):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert needle in str(e.value)


@pytest.mark.parametrize("loc,param", [
    (("body", "max_tokens"), "max_tokens"),
    (("body", "messages", 2, "content", "str"), "messages[2].content"),
    (("body", "prompt", "list[int]", 0), "prompt[0]"),
    (("body",), None),
    (("query", "limit"), "limit"),
    # a content part's tag is dropped, whatever follows it
    (("body", "messages", 0, "content", "list[tagged-union[TextPart,ImageURLPart,VideoURLPart]]", 0, "text", "foo"),
     "messages[0].content[0].foo"),
    (("body", "messages", 0, "content", "list[tagged-union[TextPart]]", 0, "text", "text"), "messages[0].content[0].text"),
    (("body", "messages", 0, "content", "list[x]", 1, "image_url", "image_url", "url"),
     "messages[0].content[1].image_url.url"),
    (("body", "messages", 0, "content", "list[x]", 1, "image_url", "detail"), "messages[0].content[1].detail"),
])
def test_param_from_loc(loc, param):
    assert param_from_loc(loc) == param


# ---- responses and stream chunks -----------------------------------------------------------------

def test_completion_response_shape():
    r = CompletionResponse(model="m", choices=[CompletionChoice(
        index=0, text="ab", finish_reason="length",
        logprobs=CompletionLogprobs(tokens=["a", "b"], token_logprobs=[-0.1, -0.2],
                                    top_logprobs=[{"a": -0.1}, {"b": -0.2}], text_offset=[0, 1]))],
        usage=UsageInfo.of(3, 2))
    d = json.loads(r.model_dump_json())
    assert d["id"].startswith("cmpl-") and d["object"] == "text_completion" and isinstance(d["created"], int)
    assert d["choices"][0] == {"index": 0, "text": "ab", "finish_reason": "length",
                               "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
                                            "top_logprobs": [{"a": -0.1}, {"b": -0.2}], "text_offset": [0, 1]}}
    assert d["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_chat_response_shape():
    lp = ChatLogprobs(content=[ChatTokenLogprob(token="a", logprob=-0.5, bytes=[97],
                                                top_logprobs=[TopLogprob(token="a", logprob=-0.5, bytes=[97])])])
    r = ChatCompletionResponse(model="m", choices=[ChatCompletionChoice(
        index=0, message=ChatResponseMessage(content="a"), logprobs=lp, finish_reason="stop")],
        usage=UsageInfo.of(4, 1))
    d = json.loads(r.model_dump_json())
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": "a"}
    assert d["choices"][0]["logprobs"]["content"][0] == {
        "token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}


def test_usage_total_is_checked():
    with pytest.raises(ValidationError, match="total_tokens"):
        UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=3)


def test_stream_chunks_frame_as_sse():
    first = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))])
    usage = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[], usage=UsageInfo.of(2, 3))
    for chunk in (first, usage):
        ev = sse_event(chunk)
        assert ev.startswith("data: ") and ev.endswith("\n\n") and "\n" not in ev[:-2]
        d = json.loads(ev[len("data: "):])
        assert d["object"] == "chat.completion.chunk" and d["id"] == "chatcmpl-1"
    assert json.loads(sse_event(usage)[6:])["usage"]["total_tokens"] == 5
    assert json.loads(sse_event(first)[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sse_event({"a": 1}) == 'data: {"a":1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    assert json.loads(sse_error(OpenAIError("boom", status=500))[6:])["error"]["message"] == "boom"


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", ["", "plain", ' "quoted" \\ back', "é ß 😀 \u2028\u2029", "\x00\x01\x1f\x7f",
                                  "\n\t\r\b\f", '"content":"" "text":""'])
def test_a_text_chunk_from_its_template_is_the_models_bytes(chat, text):
    chunks = TextChunks("cmpl-1", 'm "content":""', chat, created=1700000000)
    for index in (0, 3, 0):
        assert chunks.event(index, text) == sse_event(chunks.chunk(index, text))
        d = json.loads(chunks.event(index, text)[len("data: "):])
        assert d["choices"][0]["index"] == index and d["created"] == 1700000000
        assert (d["choices"][0]["delta"]["content"] if chat else d["choices"][0]["text"]) == text


def test_model_list_shape():
    d = ModelList(data=[ModelCard(id="k3-tiny", max_model_len=512)]).model_dump()
    assert d["object"] == "list" and d["data"][0]["object"] == "model" and d["data"][0]["id"] == "k3-tiny"


# ---- errors through a FastAPI app ----------------------------------------------------------------

def make_app(api_key: str | None = KEY) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    auth = [Depends(api_key_dependency(api_key))]

    @app.get("/health")
    def health():
        return {}

    @app.get("/v1/models", dependencies=auth)
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id="k3-tiny")])

    @app.post("/v1/completions", dependencies=auth)
    def completions(req: CompletionRequest) -> CompletionResponse:
        require_model(req.model, ["k3-tiny"])
        kw = sampling_kwargs(req, max_model_len=32, prompt_len=len(req.prompt), vocab_size=VOCAB)
        SamplingParams(**kw)
        return CompletionResponse(model=req.model, choices=[CompletionChoice(index=0, text="x", finish_reason="stop")])

    @app.post("/v1/chat/completions", dependencies=auth)
    def chat_completions(req: ChatCompletionRequest):
        raise RuntimeError("secret internal detail")

    return app


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


AUTH = {"Authorization": f"Bearer {KEY}"}


def assert_openai_error(resp, status, type_=None, param=None, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if type_ is not None:
        assert body["error"]["type"] == type_
    assert body["error"]["param"] == param
    assert body["error"]["code"] == code


@pytest.mark.parametrize("kind,status,type_,param,code", [
    ("malformed_json", 400, "invalid_request_error", None, None),
    ("no_body", 400, "invalid_request_error", None, None),
    ("missing_field", 400, "invalid_request_error", "prompt", None),
    ("wrong_type", 400, "invalid_request_error", "max_tokens", None),
    ("max_tokens_0", 400, "invalid_request_error", "max_tokens", None),
    ("temperature", 400, "invalid_request_error", "temperature", None),
    ("top_p", 400, "invalid_request_error", "top_p", None),
    ("unknown_model", 404, "invalid_request_error", "model", "model_not_found"),
    ("too_long", 400, "invalid_request_error", "prompt", "context_length_exceeded"),
    ("no_key", 401, "authentication_error", None, "invalid_api_key"),
    ("wrong_key", 401, "authentication_error", None, "invalid_api_key"),
    ("internal", 500, "server_error", None, "internal_error"),
    ("no_route", 404, "not_found_error", None, None),
])
def test_errors_through_the_app(client, kind, status, type_, param, code):
    def post(body, headers=AUTH, path="/v1/completions"):
        return client.post(path, json=body, headers=headers)

    resp = {
        "malformed_json": lambda: client.post("/v1/completions", content=b'{"model": "k3-tiny", "prompt": ',
                                              headers={**AUTH, "Content-Type": "application/json"}),
        "no_body": lambda: client.post("/v1/completions", headers=AUTH),
        "missing_field": lambda: post({"model": "k3-tiny"}),
        "wrong_type": lambda: post(completion(max_tokens="ten")),
        "max_tokens_0": lambda: post(completion(max_tokens=0)),
        "temperature": lambda: post(completion(temperature=-1)),
        "top_p": lambda: post(completion(top_p=1.5)),
        "unknown_model": lambda: post(completion(model="gpt-4")),
        "too_long": lambda: post(completion(prompt=list(range(40)))),
        "no_key": lambda: post(completion(), headers={}),
        "wrong_key": lambda: post(completion(), headers={"Authorization": "Bearer sk-wrong"}),
        "internal": lambda: post(chat(), path="/v1/chat/completions"),
        "no_route": lambda: client.get("/v1/nothing", headers=AUTH),
    }[kind]()
    assert_openai_error(resp, status, type_, param, code)
    assert "secret internal detail" not in resp.text and "Traceback" not in resp.text
    # and the server keeps serving
    assert client.post("/v1/completions", json=completion(), headers=AUTH).status_code == 200


def test_a_server_fault_names_a_request_id_that_the_log_holds(client, caplog):
    resp = client.post("/v1/chat/completions", json=chat(), headers=AUTH)
    err = resp.json()["error"]
    assert (resp.status_code, err["type"]) == (500, "server_error")
    rid = err["message"].split("request id ")[1].split(")")[0]
    assert rid.startswith("req-")
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])


@pytest.mark.parametrize("header", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(client, header):
    assert client.get("/v1/models", headers={"Authorization": f"{header} {KEY}"}).status_code == 200


def test_api_key_optional_and_health_open(client):
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "k3-tiny"
    assert client.get("/v1/models", headers={"Authorization": "Basic abc"}).status_code == 401
    with TestClient(make_app(api_key=None)) as open_client:
        assert open_client.post("/v1/completions", json=completion()).status_code == 200
    with pytest.raises(ValueError):
        api_key_dependency("")


def test_openapi_document_declares_bearer(client):
    doc = client.get("/openapi.json").json()
    assert any(s.get("scheme") == "bearer" for s in doc["components"]["securitySchemes"].values())
    assert "CompletionRequest" in doc["components"]["schemas"]


@pytest.mark.parametrize("status", [399, 600])
def test_openai_error_status_checked(status):
    with pytest.raises(ValueError):
        OpenAIError("x", status=status)
