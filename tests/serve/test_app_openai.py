"""The OpenAI API of both Serve applications beyond the happy path: what a replica refuses or
fails reaches the client as its reason (no Ray internals), the request fields OpenAI has
(batch prompts, developer role, penalties, logit_bias, ...), the deliberate refusals, and
schemathesis' conformance checks against each app's own OpenAPI document, serve/config.yaml's
app included."""
from __future__ import annotations

import json

import httpx
import pytest

from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.errors import OpenAIError
from serve_apps import AUTH, ENGINE, KEY, client, rand

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.ray


INTERNALS = ("pid=", "ip=", "actor_id", "\x1b[", "\\u001b", "Traceback", "ray::", "RayTaskError")


def post(base, body, path="/v1/completions", headers=AUTH):
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("app", ["pd", "agg"])
@pytest.mark.parametrize("body,param,reason", [
    ({"prompt": [1, 99999]}, "prompt", "[0, 4096)"),
    ({"prompt": [[1, 2], [3, 4096]]}, "prompt", "[0, 4096)"),
    ({"prompt": "hi", "stop_token_ids": [5, 99999]}, "stop_token_ids", "[0, 4096)"),
    ({"prompt": "hi", "logit_bias": {"99999": 5}}, "logit_bias", "[0, 4096)"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"4096": 1}}, "logit_bias", "[0, 4096)"),
    # only the replica knows its cache: it refuses, and the reason still reaches the client
    ({"prompt": [1, 2, 3], "max_tokens": 60000}, None, "cache pages"),
    ({"prompt": [1, 2, 3], "max_tokens": 60000, "stream": True}, None, "cache pages"),
])
def test_refusals_carry_the_reason_and_no_internals(apps, app, body, param, reason):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(apps[app], {"model": "k3-tiny", **body}, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"
    assert not [s for s in INTERNALS if s in r.text], r.text


def ray_error(cause):
    """cause as the caller of a replica receives it: wrapped by Ray with the replica's pid, ip, traceback."""
    from ray.exceptions import RayTaskError

    return RayTaskError("DecodeServer.generate", "Traceback (most recent call last):\n  boom", cause,
                        proctitle="ray::ServeReplica", pid=4242, ip="10.1.2.3", actor_id="ff00").as_instanceof_cause()


@pytest.mark.parametrize("cause,status,type_,needle", [
    (lambda: OpenAIError("prompt token ids out of range [0, 4096): [99999]"), 400, "invalid_request_error",
     "out of range"),
    (lambda: ray_error(OpenAIError("no room", status=503, type="server_error")), 503, "server_error", "no room"),
    (lambda: RuntimeError("secret internal detail"), 500, "server_error", "request id req-"),
    (lambda: ValueError("secret internal detail"), 500, "server_error", "request id req-"),
])
def test_a_replica_error_reaches_the_client_as_its_reason_and_nothing_else(cause, status, type_, needle):
    from k3.serve.ingress import client_error

    err = client_error(ray_error(cause()))
    text = json.dumps(err.body())
    assert (err.status, err.type) == (status, type_) and needle in err.message
    assert "secret internal detail" not in text and not [s for s in INTERNALS if s in text], text


def test_the_ingress_module_holds_no_app():
    # each Ingress replica builds its own FastAPI app: routes, handlers and state are per deployment
    from fastapi import FastAPI

    import k3.serve.ingress as ingress

    assert not [k for k, v in vars(ingress).items() if isinstance(v, FastAPI)]
    assert callable(getattr(ingress.Ingress, "__serve_build_asgi_app__", None))


@pytest.mark.parametrize("app", ["pd", "agg"])
def test_the_bearer_scheme_is_case_insensitive(apps, app):
    r = post(apps[app], {"model": "k3-tiny", "prompt": [1, 2], "max_tokens": 1},
             headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200, r.text


def _choices(r, stream):
    """{index: (text, finish_reason)} of a completion answer or of its stream."""
    if not stream:
        return {c["index"]: (c["text"], c["finish_reason"]) for c in r.json()["choices"]}, r.json()["usage"]
    out, usage = {}, None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev["choices"]:
                text, fin = out.get(c["index"], ("", None))
                out[c["index"]] = (text + c["text"], c["finish_reason"] or fin)
    return out, usage


@pytest.mark.parametrize("app,n", [("pd", 2), ("agg", 3)])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts", [[rand(5, 21), rand(9, 22)], ["def main():", "class A:"]])
def test_a_batch_prompt_answers_prompt_major(apps, app, n, stream, prompts):
    one = {"model": "k3-tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    singles = [post(apps[app], {**one, "prompt": p}).json() for p in prompts]
    r = post(apps[app], {**one, "prompt": prompts, "n": n, "stream": stream,
                         **({"stream_options": {"include_usage": True}} if stream else {})})
    assert r.status_code == 200, r.text
    got, usage = _choices(r, stream)
    assert got == {i * n + j: (singles[i]["choices"][0]["text"], "length") for i in range(2) for j in range(n)}
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 4 * 2 * n


def test_penalties_and_logit_bias_are_the_same_both_ways(apps, engine_model, tokenizer):
    prompt = rand(13, 31)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                        logit_bias={7: 3.0})
    want = LLMEngine(engine_model, EngineConfig(**ENGINE), tokenizer).generate([prompt], sp)[0]
    assert want.token_ids[0] == 7 and want.token_ids.count(7) == 1  # the bias picks it, the penalties drop it
    body = {"model": "k3-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "frequency_penalty": 2.0, "presence_penalty": 2.0, "logit_bias": {"7": 3.0}}
    assert [post(apps[a], body).json()["choices"][0]["text"] for a in ("pd", "agg")] == [want.text] * 2


def _served(request, app):
    """(base URL, model id) of a shared app: "pd" and "agg" (tests/serve_apps.py) or "default"
    (serve/config.yaml as `serve run` deploys it); only the apps a test asks for are deployed."""
    if app == "default":
        d = request.getfixturevalue("default_app")
        return d["url"], d["model"]
    return request.getfixturevalue("apps")[app], "k3-tiny"


def _bounded(case, model):
    """A generated valid request for the served model, kept cheap on a CPU: few tokens, choices, prompts."""
    body = case.body
    if not isinstance(body, dict):
        return
    body["model"] = model  # a random name is a 404 before anything runs
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if k in body and (v is None or isinstance(v, int) and not isinstance(v, bool) and v > 4):
            body[k] = 4  # null would run to the end of the context (the cache), long on a CPU
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # chat's default runs to the end of the context as well
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    batch = body.get("prompt")
    if isinstance(batch, list) and batch and isinstance(batch[0], (str, list)):
        body["prompt"] = batch[:2]


def _conformance_failures(base, model, op, mode, max_examples):
    """Run generated cases of one operation against base; what failed schemathesis' checks."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    if mode.name == "NEGATIVE":
        checks.append(negative_data_rejection)
    failures = []

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        if mode.name == "POSITIVE":
            _bounded(case, model)
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
        r = case.call(base_url=base, timeout=120)
        try:
            case.validate_response(r, checks=checks)
        except Exception as e:  # noqa: BLE001 - collected, reported together
            failures.append((op.method, op.path, mode.name, case.body, r.status_code, r.text[:300], str(e)[:600]))

    run()
    return failures


@pytest.mark.parametrize("app", ["pd", "agg", "default"])
def test_schemathesis_finds_no_server_error_or_schema_violation(request, app):
    """Requests generated from the app's own OpenAPI document, valid and invalid: no 5xx, every
    status and body as the document declares, and every invalid request refused."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    base, model = _served(request, app)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "GET":  # no parameters: nothing to vary, nothing invalid to send
            failures += _conformance_failures(base, model, op, GenerationMode.POSITIVE, 3)
            continue
        for mode, examples in ((GenerationMode.POSITIVE, 30), (GenerationMode.NEGATIVE, 15)):
            failures += _conformance_failures(base, model, op, mode, examples)
    assert not failures, failures[:3]


MSG = [{"role": "user", "content": "hello"}]
CALLS = {  # every endpoint and option through the official client: name -> (call(client, n), check(answer, n))
    "models": (lambda c, n: c.models.list(), lambda r, n: [m.id for m in r.data] == ["k3-tiny"]),
    "text": (lambda c, n: c.completions.create(model="k3-tiny", prompt="def f(", max_tokens=3, temperature=0),
             lambda r, n: r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3),
    "batch of strings": (lambda c, n: c.completions.create(model="k3-tiny", prompt=["a", "b"], max_tokens=2, n=n),
                         lambda r, n: [ch.index for ch in r.choices] == list(range(2 * n))),
    "batch of token lists, logprobs": (
        lambda c, n: c.completions.create(model="k3-tiny", prompt=[[1, 2], [3]], max_tokens=2, logprobs=2),
        lambda r, n: len(r.choices) == 2 and len(r.choices[1].logprobs.token_logprobs) == 2),
    "sampling options": (lambda c, n: c.completions.create(
        model="k3-tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.7, top_p=0.9, seed=3, stop=["x", "y"],
        presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"9": 2}, user="u", n=n,
        extra_body={"top_k": 20, "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [11]}),
        lambda r, n: len(r.choices) == n and r.usage.completion_tokens >= n),
    "completion stream": (lambda c, n: list(c.completions.create(model="k3-tiny", prompt="x", max_tokens=2,
                                                                 stream=True, stream_options={"include_usage": True})),
                          lambda r, n: r[-1].usage.completion_tokens == 2),
    "chat, developer, options": (lambda c, n: c.chat.completions.create(
        model="k3-tiny", messages=[{"role": "developer", "content": "be brief"}, *MSG], max_completion_tokens=3,
        logprobs=True, top_logprobs=2, response_format={"type": "text"}, store=False, metadata={"team": "k3"},
        parallel_tool_calls=False, n=n, seed=1, temperature=0.5, logit_bias={"4": -100}),
        lambda r, n: len(r.choices) == n and len(r.choices[0].logprobs.content[0].top_logprobs) == 2),
    "chat stream": (lambda c, n: list(c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=2,
                                                                stream=True)),
                    lambda r, n: r[0].choices[0].delta.role == "assistant" and r[-1].choices[0].finish_reason),
}
REFUSED = {  # the deliberate refusals (docs/openai-api.md lists them): name -> (call, param)
    "json_object": (lambda c: c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=2,
                                                        response_format={"type": "json_object"}), "response_format"),
    "tools": (lambda c: c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=2, tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), "tools"),
    "echo": (lambda c: c.completions.create(model="k3-tiny", prompt="x", max_tokens=2, echo=True), "echo"),
    "best_of": (lambda c: c.completions.create(model="k3-tiny", prompt="x", max_tokens=2, best_of=2), "best_of"),
    "suffix": (lambda c: c.completions.create(model="k3-tiny", prompt="x", max_tokens=2, suffix="y"), "suffix"),
    "too many stops": (lambda c: c.completions.create(model="k3-tiny", prompt="x", max_tokens=2,
                                                      stop=[str(i) for i in range(17)]), "stop"),
}


@pytest.mark.parametrize("app,n", [("pd", 3), ("agg", 2)])
def test_every_option_through_the_openai_client(apps, app, n):
    c = client(apps[app])
    for name, (call, ok) in CALLS.items():
        assert ok(call(c, n), n), name
    for name, (call, param) in REFUSED.items():
        with pytest.raises(openai.BadRequestError) as e:
            call(c)
        assert e.value.param == param and e.value.type == "invalid_request_error", name
