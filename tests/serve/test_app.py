"""The Serve application end to end on a local Ray: the disaggregated app (Ingress -> DecodeServer
-> PrefillServer, the hybrid cache handed over through the object store) and the aggregated app
answer the official `openai` client, token for token as the bare engine does; bad input gets
OpenAI-style 4xx bodies and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

import k3.model
from k3.model import get_preset
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.errors import OpenAIError

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.ray

KEY = "sk-test-k3"
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512, page_size=8, snapshot_interval=2,
              cache_memory_bytes=32 * 2**20)


def app_config(tok_path, disaggregated):
    small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    # the key reaches the ingress replica as users pass secrets to Serve: its runtime_env
    ingress = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1,
                                                        "runtime_env": {"env_vars": {"K3_TEST_API_KEY": KEY}}}}
    # decode autoscales from 1 replica: a burst of requests beyond 2 in flight adds one
    decode = {"ray_actor_options": {"num_cpus": 0.1}, "max_ongoing_requests": 8, "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
        "downscale_delay_s": 4, "look_back_period_s": 1}}
    return {"model_id": "k3-tiny", "model": {"preset": "k3-tiny", "seed": 0, "tokenizer_path": tok_path},
            "engine": ENGINE, "disaggregated": disaggregated, "prefill": small, "decode": decode, "llm": small,
            "ingress": ingress, "api_key_env": "K3_TEST_API_KEY"}


@pytest.fixture(scope="module")
def apps(serve_session, tokenizer, tmp_path_factory):
    """{"pd": base URL, "agg": base URL}; both apps share one Serve instance."""
    from ray import serve

    from k3.serve.builder import build_app, build_pd_app

    d = tmp_path_factory.mktemp("tok")
    tokenizer.save(str(d / "tokenizer.json"))
    serve.run(build_pd_app(app_config(str(d / "tokenizer.json"), True)), name="pd", route_prefix="/pd")
    serve.run(build_app(app_config(str(d / "tokenizer.json"), False)), name="agg", route_prefix="/agg")
    try:
        yield {"pd": f"{serve_session}/pd", "agg": f"{serve_session}/agg"}
    finally:
        serve.delete("pd")
        serve.delete("agg")


@pytest.fixture(scope="module")
def engine_model():
    return k3.model.build(get_preset("k3-tiny"), seed=0).eval()  # the replicas' random weights


def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def rand(n, seed):
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_completions_chat_streaming_logprobs_through_the_openai_client(apps):
    c = client(apps["pd"])
    assert [m.id for m in c.models.list().data] == ["k3-tiny"]
    r = c.completions.create(model="k3-tiny", prompt="def main():", max_tokens=6, temperature=0, logprobs=2)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    # n=2 on the aggregated app: on the disaggregated one two same-prompt choices in one request
    # stalled for 30-55 s once in three full-suite runs (an open bug, see the issue note)
    chat = client(apps["agg"]).chat.completions.create(
        model="k3-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.choices[0].logprobs.content and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    pieces, usage = [], None
    for ev in c.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hello"}],
                                        max_tokens=5, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            pieces.append(ch.delta.content or "")
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens // 2


@pytest.mark.parametrize("n", [5, 8, 21, 32])  # 8 and 32 end on a page; 32 on a snapshot page too
def test_disaggregated_equals_aggregated_equals_the_engine(apps, engine_model, tokenizer, n):
    prompt = rand(n, seed=n)
    eng = LLMEngine(engine_model, EngineConfig(**ENGINE), tokenizer)
    rid = eng.add_request(None, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    want_text, want_lp = outs[-1].text, [e["logprob"] for o in outs for e in o.logprobs]
    for name in ("pd", "agg"):
        for attempt in ("miss", "local hit"):  # the second time the prefix is cached on the replica
            r = httpx.post(f"{apps[name]}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                           json={"model": "k3-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == want_text, f"{name}, {attempt}, prompt {n}"
            got_lp = choice["logprobs"]["token_logprobs"]
            assert len(got_lp) == 8 and max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4, (name, attempt)


def test_a_prompt_that_hits_only_the_pool_answers_the_same(apps):
    import time

    from ray import serve

    prefill = serve.get_deployment_handle("PrefillServer", app_name="pd")
    prompt = rand(40, seed=99)  # 5 pages of 8: snapshots at pages 2 and 4
    body = {"model": "k3-tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    post = lambda: httpx.post(f"{apps['pd']}/v1/completions", json=body, timeout=120,  # noqa: E731
                              headers={"Authorization": f"Bearer {KEY}"}).json()["choices"][0]
    first = post()
    time.sleep(1.0)  # the replica publishes to the pool after replying
    before = prefill.pool_stats.remote().result()["pool_hit_tokens"]
    assert prefill.reset_prefix_cache.remote().result() > 0
    again = post()
    assert prefill.pool_stats.remote().result()["pool_hit_tokens"] - before == 32  # resumed at page 4 from the pool
    assert again["text"] == first["text"]
    assert max(abs(a - b) for a, b in zip(again["logprobs"]["token_logprobs"],
                                          first["logprobs"]["token_logprobs"])) < 1e-4


def test_seeded_sampling_is_the_same_both_ways(apps):
    body = {"model": "k3-tiny", "prompt": rand(19, 3), "max_tokens": 8, "temperature": 0.9, "top_p": 0.9,
            "seed": 77, "ignore_eos": True}
    texts = [httpx.post(f"{apps[a]}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=120).json()["choices"][0]["text"] for a in ("pd", "agg", "pd")]
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("case,status,param", [
    ("malformed json", 400, None), ("missing model", 400, "model"), ("wrong type", 400, "max_tokens"),
    ("unknown model", 404, None), ("max_tokens 0", 400, "max_tokens"), ("negative temperature", 400, "temperature"),
    ("top_p 0", 400, "top_p"), ("top_p 1.5", 400, "top_p"), ("too long", 400, None), ("no key", 401, None),
    ("wrong key", 401, None), ("token id out of range", 400, None),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(apps, case, status, param):
    good = {"model": "k3-tiny", "prompt": "hi", "max_tokens": 2}
    body, headers, raw = dict(good), {"Authorization": f"Bearer {KEY}"}, None
    if case == "malformed json":
        raw = b'{"model": "k3-tiny", "prompt": '
    elif case == "missing model":
        body.pop("model")
    elif case == "wrong type":
        body["max_tokens"] = "many"
    elif case == "unknown model":
        body["model"] = "gpt-9"
    elif case == "max_tokens 0":
        body["max_tokens"] = 0
    elif case == "negative temperature":
        body["temperature"] = -1
    elif case == "top_p 0":
        body["top_p"] = 0
    elif case == "top_p 1.5":
        body["top_p"] = 1.5
    elif case == "too long":
        body["prompt"] = [5] * 70000
    elif case == "no key":
        headers = {}
    elif case == "wrong key":
        headers = {"Authorization": "Bearer nope"}
    elif case == "token id out of range":
        body["prompt"] = [1, 99999]
    url = f"{apps['pd']}/v1/completions"
    r = httpx.post(url, content=raw, headers={**headers, "content-type": "application/json"}, timeout=60) \
        if raw is not None else httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(url, json=good, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200


AUTH = {"Authorization": f"Bearer {KEY}"}
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
    ({"messages": [{"role": "user", "content": "hi"}]}, None, "cache pages"),  # chat's default: the context
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


# n=1 on the disaggregated app: same-prompt choices there meet the open handoff bug (see above)
@pytest.mark.parametrize("app,n", [("pd", 1), ("agg", 2)])
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


def test_streaming_sse_ends_with_done(apps):
    with httpx.stream("POST", f"{apps['pd']}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "k3-tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _replica_actor(app: str, deployment: str):
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
    assert names, f"no {deployment} replica in app {app}"
    return ray.get_actor(names[0], namespace="serve")


def test_a_prefill_replica_killed_mid_request_gives_a_retry_or_a_clean_error(apps):
    import concurrent.futures
    import time

    import ray

    url = f"{apps['pd']}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "k3-tiny", "prompt": rand(3000, 11), "max_tokens": 4, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url, json=body, headers=headers, timeout=300)
        time.sleep(1.5)  # the prompt is in prefill by now (a 3000-token prompt takes seconds here)
        ray.kill(_replica_actor("pd", "PrefillServer"), no_restart=True)
        r = fut.result(timeout=300)  # never a hang
    assert r.status_code == 200 or (r.status_code >= 500 and r.json()["error"]["message"]), r.text
    deadline = time.time() + 240  # Serve replaces the replica; then requests succeed again
    while True:
        ok = httpx.post(url, json={"model": "k3-tiny", "prompt": [1, 2, 3], "max_tokens": 2}, headers=headers,
                        timeout=120)
        if ok.status_code == 200 or time.time() > deadline:
            break
        time.sleep(2)
    assert ok.status_code == 200, ok.text


def _read_stream(url: str, body: dict, log: dict) -> None:
    """Read one SSE completion stream into log: tokens seen, finish reason, error message, [DONE]."""
    try:
        with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as r:
            log["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    log["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        log["error"] = event["error"]["message"]
                    for c in event.get("choices", []):
                        log["tokens"] = log.get("tokens", 0) + 1
                        log["finish"] = c.get("finish_reason") or log.get("finish")
    except httpx.HTTPError as e:  # a broken connection counts as a failure too, just not a clean one
        log["broken"] = repr(e)


def test_a_killed_decode_replica_fails_only_its_own_streams(serve_session, tokenizer, tmp_path):
    import os
    import threading
    import time

    import ray
    from ray import serve

    from k3.serve.builder import build_pd_app

    tokenizer.save(str(tmp_path / "tokenizer.json"))
    cfg = app_config(str(tmp_path / "tokenizer.json"), True)
    cfg["decode"] = {"num_replicas": 2, "max_ongoing_requests": 16, "ray_actor_options": {"num_cpus": 0.1}}
    cfg["prefix_pool_bytes"] = 0
    serve.run(build_pd_app(cfg), name="pdkill", route_prefix="/pdkill")
    try:
        url = f"{serve_session}/pdkill/v1/completions"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::pdkill#DecodeServer#")]
        actors = [ray.get_actor(n, namespace="serve") for n in names]
        pids = ray.get([a.__ray_call__.remote(lambda _self: os.getpid()) for a in actors])
        assert len(set(pids)) == 2
        logs = [{} for _ in range(6)]
        threads = [threading.Thread(target=_read_stream, args=(url, {
            "model": "k3-tiny", "prompt": rand(12, 500 + i), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}, logs[i])) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while time.time() < deadline and not all(log.get("tokens", 0) >= 2 for log in logs):
            time.sleep(0.2)
        assert all(log.get("tokens", 0) >= 2 for log in logs), logs  # every stream is decoding now
        # each replica's streams in flight (Serve's own count of its ongoing requests)
        ongoing = ray.get([a.get_num_ongoing_requests.remote() for a in actors])
        running = dict(zip(pids, ongoing))
        assert sum(ongoing) == 6, running
        victim = max(running, key=running.get)
        ray.kill(actors[pids.index(victim)], no_restart=True)
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a stream hung after its decode replica died"
        failed = [log for log in logs if "error" in log or "broken" in log]
        finished = [log for log in logs if log.get("finish") == "length" and log.get("done") and "error" not in log]
        assert len(failed) == running[victim] and len(finished) == 6 - running[victim], logs
        assert all(log["tokens"] == 400 for log in finished)
        assert all("error" in log and log.get("done") for log in failed), logs  # a clean error event, then [DONE]
        ok = httpx.post(url, json={"model": "k3-tiny", "prompt": [1, 2, 3], "max_tokens": 2},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert ok.status_code == 200, ok.text  # the surviving replica serves on
    finally:
        serve.delete("pdkill")


def _bounded(case):
    """A generated valid request for the served model, kept cheap on a CPU: few tokens, choices, prompts."""
    body = case.body
    if not isinstance(body, dict):
        return
    body["model"] = "k3-tiny"  # a random name is a 404 before anything runs
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if k in body and (v is None or isinstance(v, int) and not isinstance(v, bool) and v > 4):
            body[k] = 4  # null would run to the context, which the test cache cannot hold
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # chat's default runs to the context, which the test cache cannot hold
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 1:
        body["n"] = 1  # n > 1 on the disaggregated app meets the open handoff bug (see above)
    batch = body.get("prompt")
    if isinstance(batch, list) and batch and isinstance(batch[0], (str, list)):
        body["prompt"] = batch[:2] if len(batch) > 1 and batch[0] != batch[1] else batch[:1]  # distinct: as n


def _conformance_failures(base, op, mode, max_examples):
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
            _bounded(case)
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
        r = case.call(base_url=base, timeout=120)
        try:
            case.validate_response(r, checks=checks)
        except Exception as e:  # noqa: BLE001 - collected, reported together
            failures.append((op.method, op.path, mode.name, case.body, r.status_code, r.text[:300], str(e)[:600]))

    run()
    return failures


@pytest.mark.parametrize("app", ["pd", "agg"])
def test_schemathesis_finds_no_server_error_or_schema_violation(apps, app):
    """Requests generated from the app's own OpenAPI document, valid and invalid: no 5xx, every
    status and body as the document declares, and every invalid request refused."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{apps[app]}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "GET":  # no parameters: nothing to vary, nothing invalid to send
            failures += _conformance_failures(apps[app], op, GenerationMode.POSITIVE, 3)
            continue
        for mode, examples in ((GenerationMode.POSITIVE, 30), (GenerationMode.NEGATIVE, 15)):
            failures += _conformance_failures(apps[app], op, mode, examples)
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


@pytest.mark.parametrize("app,n", [("pd", 1), ("agg", 2)])  # n=1 on pd: the open handoff bug (see above)
def test_every_option_through_the_openai_client(apps, app, n):
    c = client(apps[app])
    for name, (call, ok) in CALLS.items():
        assert ok(call(c, n), n), name
    for name, (call, param) in REFUSED.items():
        with pytest.raises(openai.BadRequestError) as e:
            call(c)
        assert e.value.param == param and e.value.type == "invalid_request_error", name


def _running_replicas(app: str, deployment: str) -> int:
    from ray import serve

    st = serve.status().applications[app].deployments[deployment]
    return st.replica_states.get("RUNNING", 0)


def test_decode_scales_up_under_a_burst_and_back_down(apps):
    import concurrent.futures
    import time

    assert _running_replicas("pd", "DecodeServer") == 1
    body = {"model": "k3-tiny", "prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    post = lambda: httpx.post(f"{apps['pd']}/v1/completions", json=body, timeout=300,  # noqa: E731
                              headers={"Authorization": f"Bearer {KEY}"}).status_code
    peak, codes = 1, []
    deadline = time.time() + 240  # a bounded burst: 8 requests kept in flight until a replica is added
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(post) for _ in range(8)]
        while time.time() < deadline and peak < 2:
            peak = max(peak, _running_replicas("pd", "DecodeServer"))
            for i, f in enumerate(futs):
                if f.done():
                    codes.append(f.result())
                    futs[i] = pool.submit(post)
            time.sleep(0.5)
        codes += [f.result(timeout=300) for f in futs]
    assert set(codes) == {200}
    assert peak == 2, "the decode deployment never scaled up"
    deadline = time.time() + 120
    while time.time() < deadline and _running_replicas("pd", "DecodeServer") > 1:
        time.sleep(1)
    assert _running_replicas("pd", "DecodeServer") == 1, "the decode deployment never scaled back down"
