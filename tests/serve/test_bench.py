"""The load generator and the soak, against a tiny in-test OpenAI-shaped server on 127.0.0.1 that
streams with known delays and fails on request."""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time

import psutil
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from k3.platform.ops.local_ray import free_port
from k3.serve.bench import (BenchConfig, RequestResult, arrival_gaps, cpu_ms_per_token, make_prompts, parse_prometheus,
                            process_cpu_seconds, run_benchmark,
                            run_side_by_side, summarize, trace_hops, trace_summary)
from k3.serve.errors import OpenAIError, install_error_handlers
from k3.serve.protocol import (
    SSE_DONE,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatDelta,
    CompletionChoice,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    sse_event,
)
from k3.serve.soak import SoakConfig, process_verdicts, rss_verdict, run_soak, serve_process_rss

TTFT_S = 0.25     # the server's delay before the first token
ITL_S = 0.08      # and between tokens
TOKENS = 4        # tokens per answer
SLACK_S = 0.12    # scheduling on a loaded 2-core machine
HANDOFF_S = 0.025  # what the fake's /metrics reports per answer


class FakeServer:
    """Streams TOKENS chunks: the first after TTFT_S, the rest ITL_S apart; request number k
    (1-based) fails with HTTP 503 when k is in `fail`."""

    def __init__(self) -> None:
        self.fail: set[int] = set()
        self.count = 0
        self.served = 0  # answers streamed to the end: each "hands off" HANDOFF_S, as /metrics says
        self.app = FastAPI()
        install_error_handlers(self.app)
        self.app.get("/v1/models")(lambda: ModelList(data=[ModelCard(id="fake")]))
        self.app.get("/metrics")(self.metrics)
        self.app.post("/v1/completions")(self.handle)
        self.app.post("/v1/chat/completions")(self.handle)

    async def handle(self, request: Request):
        arrived = time.time()
        body = await request.json()
        traced = request.headers.get("x-k3-trace") == "1"
        self.count += 1
        if self.count in self.fail:
            raise OpenAIError("overloaded, try later", status=503, type="server_error")
        chat = "messages" in body

        def chunk(text: str | None, finish=None, usage=None) -> str:
            if chat:
                choices = [] if text is None else [ChatCompletionStreamChoice(
                    index=0, delta=ChatDelta(content=text), finish_reason=finish)]
                return sse_event(ChatCompletionStreamResponse(id="c", model="fake", choices=choices, usage=usage))
            choices = [] if text is None else [CompletionChoice(index=0, text=text, finish_reason=finish)]
            return sse_event(CompletionStreamResponse(id="c", model="fake", choices=choices, usage=usage))

        async def events():
            if chat:  # OpenAI's first chat chunk carries the role and no text: not a token
                yield sse_event(ChatCompletionStreamResponse(id="c", model="fake", choices=[
                    ChatCompletionStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))]))
            stamps = {"ingress_in": arrived, "engine_in": time.time()}
            await asyncio.sleep(TTFT_S)  # the "engine"
            stamps["engine_first"] = time.time()
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(ITL_S)
                yield chunk(f" t{i}", "length" if i == TOKENS - 1 else None)
            yield chunk(None, usage=UsageInfo.of(7, TOKENS))
            if traced:  # as k3's ingress sends a traced request's stamps
                yield f": k3-trace {json.dumps([stamps])}\n\n"
            self.served += 1
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")


    def metrics(self):
        n = self.served
        text = (
            "# HELP ray_k3_serve_handoff_seconds seconds to move one request's cache state\n"
            "# TYPE ray_k3_serve_handoff_seconds histogram\n"
            f'ray_k3_serve_handoff_seconds_bucket{{le="0.05",model="fake"}} {n}\n'
            f'ray_k3_serve_handoff_seconds_sum{{model="fake"}} {n * HANDOFF_S}\n'
            f'ray_k3_serve_handoff_seconds_count{{model="fake"}} {n}\n'
            "# TYPE ray_k3_serve_generation_tokens_total counter\n"
            f'ray_k3_serve_generation_tokens_total{{model="fake",role="decode"}} {n * TOKENS}\n'
            "# TYPE ray_k3_serve_num_requests_running gauge\n"
            f'ray_k3_serve_num_requests_running{{model="fake"}} {n % 3}\n'
            "# TYPE ray_other_metric counter\n"
            "ray_other_metric 5\n")
        return PlainTextResponse(text)


@pytest.fixture(scope="module")
def fake():
    srv = FakeServer()
    server = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    srv.url = f"http://127.0.0.1:{server.config.port}"
    yield srv
    server.should_exit = True
    thread.join(timeout=10)


def bench_config(fake, **kw) -> BenchConfig:
    return BenchConfig(**{"base_url": fake.url, "num_prompts": 6, "max_concurrency": 3, "input_len": 8,
                          "output_len": TOKENS, **kw})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_measures_the_known_delays(fake, endpoint):
    fake.count, fake.fail = 0, {2}
    ticks = []
    cfg = bench_config(fake, endpoint=endpoint, slo_ttft_ms=5000)
    s = asyncio.run(run_benchmark(cfg, progress=lambda: ticks.append(1)))
    assert len(ticks) == 6
    assert (s["completed"], s["failed"]) == (5, 1)
    assert s["errors"] == {"HTTP 503: overloaded, try later": 1}
    assert s["config"]["model"] == "fake"  # found through GET /v1/models
    ttft, itl, tpot, e2e = s["ttft_ms"], s["itl_ms"], s["tpot_ms"], s["e2e_ms"]
    assert TTFT_S * 1e3 <= ttft["p50"] <= (TTFT_S + SLACK_S) * 1e3, ttft
    assert (ITL_S - 0.02) * 1e3 <= itl["p50"] <= (ITL_S + SLACK_S) * 1e3, itl
    assert (ITL_S - 0.02) * 1e3 <= tpot["mean"] <= (ITL_S + SLACK_S) * 1e3, tpot
    expected_e2e = TTFT_S + (TOKENS - 1) * ITL_S
    assert expected_e2e * 1e3 <= e2e["p50"] <= (expected_e2e + 2 * SLACK_S) * 1e3, e2e
    assert ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert (s["total_output_tokens"], s["total_input_tokens"]) == (5 * TOKENS, 5 * 7)  # from usage
    assert s["goodput"]["good_requests"] == 5 and s["goodput"]["fraction"] == round(5 / 6, 4)
    assert s["request_throughput"] == pytest.approx(5 / s["duration_s"], rel=0.01)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_traced_run_says_where_the_time_to_first_token_went(fake, endpoint):
    s = asyncio.run(run_benchmark(bench_config(fake, endpoint=endpoint, trace=True)))
    t = s["trace_ms"]
    assert t["requests"] == 6 and list(t["hops"]) == ["client_send->ingress_in", "ingress_in->engine_in",
                                                      "engine_in->engine_first", "engine_first->client_first"]
    # the fake's stamps are wall-clock (time.time) around an asyncio.sleep timed on the monotonic
    # clock, which may end a hair early: a run measured 249.891 ms for the 250 ms sleep
    assert (TTFT_S - 0.005) * 1e3 <= t["engine"]["mean"] <= (TTFT_S + SLACK_S) * 1e3
    assert abs(sum(h["mean"] for h in t["hops"].values()) - t["ttft"]["mean"]) < 0.01
    assert abs(t["ttft"]["mean"] - t["engine"]["mean"] - t["overhead"]["mean"]) < 0.01
    assert abs(t["ttft"]["mean"] - s["ttft_ms"]["mean"]) < 5  # the client's two clocks agree
    assert "trace_ms" not in asyncio.run(run_benchmark(bench_config(fake, endpoint=endpoint)))


def test_trace_hops_follow_the_path_and_skip_what_a_request_did_not_pass():
    t = {"client_first": 9.0, "engine_first": 7.0, "client_send": 0.0, "ingress_in": 1.0, "engine_in": 3.0}
    assert trace_hops(t) == {"client_send->ingress_in": 1.0, "ingress_in->engine_in": 2.0,
                             "engine_in->engine_first": 4.0, "engine_first->client_first": 2.0}
    s = trace_summary([t, {**t, "client_first": 11.0}])
    assert s["engine"] == {"mean": 4000.0, "p50": 4000.0} and s["overhead"]["mean"] == 6000.0
    assert s["hops"]["engine_first->client_first"] == {"mean": 3000.0, "p50": 3000.0}


def test_bench_poisson_rate_spreads_the_requests(fake):
    fake.count, fake.fail = 0, set()
    s = asyncio.run(run_benchmark(bench_config(fake, request_rate=10.0, max_concurrency=None,
                                               slo_ttft_ms=1.0)))
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["goodput"]["good_requests"] == 0  # a 1 ms TTFT is out of reach
    assert s["config"]["request_rate"] == 10.0


def test_server_metrics_deltas_and_handoff_share(fake):
    fake.count, fake.fail = 0, {1}
    s = asyncio.run(run_benchmark(bench_config(fake, metrics_urls=[f"{fake.url}/metrics"], metrics_settle_s=0)))
    m = s["server_metrics"]
    assert m["ray_k3_serve_handoff_seconds"]["count"] == 5
    assert m["ray_k3_serve_handoff_seconds"]["mean"] == pytest.approx(HANDOFF_S)
    assert m["ray_k3_serve_generation_tokens_total"] == 5 * TOKENS
    assert "ray_k3_serve_num_requests_running" not in m and "ray_other_metric" not in m  # gauge; not k3_serve
    assert m["handoff_share_of_ttft"] == pytest.approx(HANDOFF_S / (s["ttft_ms"]["mean"] / 1e3), rel=1e-3)


def test_parse_prometheus():
    text = ('# HELP x_total a counter\n# TYPE x_total counter\nx_total{a="1"} 2\nx_total{a="}"} 3.5 1700000000\n'
            '# TYPE g gauge\ng 7\nplain 1e3\nbroken{a="1"}\n')
    assert parse_prometheus(text) == {"x_total": 5.5, "g": 7.0, "plain": 1000.0}
    assert parse_prometheus(text, skip_gauges=True) == {"x_total": 5.5, "plain": 1000.0}


def test_side_by_side_runs_the_same_workload_on_each_target(fake):
    fake.count, fake.fail = 0, set()
    dead = f"http://127.0.0.1:{free_port()}"
    out = asyncio.run(run_side_by_side(bench_config(fake, model="fake", timeout_s=5),
                                       {"up": fake.url, "down": dead}))
    assert list(out["runs"]) == ["up", "down"]
    up, down = out["runs"]["up"], out["runs"]["down"]
    assert (up["completed"], down["failed"]) == (6, 6)
    assert (up["config"]["base_url"], down["config"]["base_url"]) == (fake.url, dead)
    with pytest.raises(ValueError):
        asyncio.run(run_side_by_side(bench_config(fake), {}))


def test_connection_refused_is_counted_not_raised():
    cfg = BenchConfig(base_url=f"http://127.0.0.1:{free_port()}", model="m", num_prompts=2, input_len=2,
                      output_len=2, timeout_s=5)
    s = asyncio.run(run_benchmark(cfg))
    assert (s["completed"], s["failed"]) == (0, 2) and "ConnectError" in next(iter(s["errors"]))
    assert s["ttft_ms"]["p50"] is None


def test_shared_prefix_prompts_share_their_group_prefix():
    cfg = BenchConfig(base_url="http://x", dataset="shared-prefix", num_prompts=8, num_prefix_groups=2,
                      prefix_len=20, input_len=5)
    prompts = make_prompts(cfg)
    heads = [" ".join(p.split()[:20]) for p in prompts]
    assert heads[0::2] == [heads[0]] * 4 and heads[1::2] == [heads[1]] * 4 and heads[0] != heads[1]
    assert all(len(p.split()) == 25 for p in prompts)
    assert len(set(prompts)) == 8 and prompts == make_prompts(cfg)
    assert all(len(p.split()) == 5 for p in make_prompts(cfg.model_copy(update={"dataset": "random"})))


@pytest.mark.parametrize("rate", [2.0, float("inf")])
def test_arrival_gaps(rate):
    gaps = arrival_gaps(4000, rate, random.Random(0))
    if rate == float("inf"):
        assert gaps == [0.0] * 4000
    else:
        assert sum(gaps) / len(gaps) == pytest.approx(1 / rate, rel=0.06)


def test_summarize_tpot_and_goodput():
    fast = RequestResult(ok=True, ttft_s=0.1, e2e_s=0.5, output_tokens=5, itl_s=[0.1] * 4)
    slow = RequestResult(ok=True, ttft_s=0.3, e2e_s=2.3, output_tokens=5, itl_s=[0.5] * 4)
    s = summarize([fast, slow, RequestResult(ok=False, error="boom")], 2.0, slo_ttft_ms=200, slo_tpot_ms=200)
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert s["goodput"]["good_requests"] == 1 and s["errors"] == {"boom": 1}
    assert summarize([fast], 1.0)["goodput"] is None
    # gap by gap: the median over the requests that have a gap there
    long = RequestResult(ok=True, ttft_s=0.1, e2e_s=1.0, output_tokens=12, itl_s=[0.3] + [0.05] * 10)
    by_position = summarize([fast, long], 1.0)["itl_p50_by_position_ms"]
    assert by_position == pytest.approx([200.0, 75.0, 75.0, 75.0] + [50.0] * 4)
    one_token = RequestResult(ok=True, ttft_s=0.1, e2e_s=0.1, output_tokens=1)
    assert summarize([one_token], 1.0)["itl_p50_by_position_ms"] == []
    with pytest.raises(ValueError):
        summarize([fast], 0.0)


@pytest.mark.parametrize("bad", [dict(base_url="127.0.0.1:8000"), dict(base_url="http://x", request_rate=0),
                                 dict(base_url="http://x", dataset="sharegpt")])
def test_bench_config_refuses(bad):
    with pytest.raises(ValueError):
        BenchConfig(**bad)


def test_cpu_per_token_by_process_under_the_driver(tmp_path):
    """A stand-in tree: this process (the driver), a child titled as Ray titles a Serve replica
    while it runs a method, and its child started as the engine core is (which burns 0.3 s of CPU):
    that CPU lands on the engine's label, per output token; a bad token count is refused."""
    import shlex
    import subprocess
    import sys

    burn = tmp_path / "burn.py"
    burn.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\ntime.sleep(60)\n")
    relay = tmp_path / "replica.py"
    # (under `exec -a` the title is argv[0], so the child's Python is named, not sys.executable)
    relay.write_text(f"import subprocess, time\nsubprocess.Popen([{sys.executable!r}, {str(burn)!r}, '-m', "
                     f"'k3.serve.engine.engine_core', '7'])\ntime.sleep(60)\n")
    replica = subprocess.Popen(["bash", "-c", f"exec -a ray::ServeReplica:pd:DecodeServer.generate "
                                f"{shlex.quote(sys.executable)} {shlex.quote(str(relay))}"])
    try:
        before = process_cpu_seconds()
        deadline = time.time() + 30
        while time.time() < deadline:
            after = process_cpu_seconds()
            engine = [cpu for label, cpu in after.values() if label == "pd:DecodeServer engine"]
            if engine and engine[0] >= 0.3:
                break
            time.sleep(0.1)
        labels = {label for label, _ in after.values()}
        assert {"driver (the load generator)", "pd:DecodeServer", "pd:DecodeServer engine"} <= labels, labels
        per = cpu_ms_per_token(before, after, 100)
        assert per["pd:DecodeServer engine"] >= 3.0  # 0.3 s of CPU over 100 tokens
        assert per["total"] >= per["pd:DecodeServer engine"] and list(per)[-1] == "total"
        with pytest.raises(ValueError, match="tokens must be >= 1"):
            cpu_ms_per_token(before, after, 0)
    finally:
        for child in psutil.Process(replica.pid).children(recursive=True):
            child.kill()
        replica.kill()
        replica.wait()


# ---- soak -----------------------------------------------------------------------------------------

def test_soak_short_run_counts_errors_and_samples_rss(fake):
    fake.count, fake.fail = 0, {3}
    me = psutil.Process(os.getpid())
    t0 = time.perf_counter()

    def sample():  # this process, and from 1.5 s on a second one of 300 MB (a replica autoscaling added)
        return {f"pytest({me.pid})": me.memory_info().rss, **({"new replica": 300 * 2**20}
                                                              if time.perf_counter() - t0 > 1.5 else {})}

    cfg = SoakConfig(base_url=fake.url, clients=4, duration_s=3.0, input_len=4, output_len=TOKENS, warmup_s=0.5,
                     rss_interval_s=0.25, max_rss_growth=0.5)
    s = asyncio.run(run_soak(cfg, sample))
    # each client runs ~0.5 s requests back to back for 3 s
    assert s["completed"] >= 4 * 4 and s["failed"] == 1 and not s["zero_errors"]
    rss = s["rss"]
    assert len(rss["t_s"]) >= 8 and rss["t_s"] == sorted(rss["t_s"])
    assert sorted(rss["per_process_mb"]) == ["new replica", f"pytest({me.pid})"] and all(x > 10 for x in rss["total_mb"])
    assert rss["per_process_mb"]["new replica"][0] is None and rss["added"] == ["new replica"] and rss["removed"] == []
    # the total grew by 300 MB; no process did (this one does not grow by half in 3 s)
    assert rss["total_mb"][-1] - rss["total_mb"][0] > 250 and rss["flat"] is True and rss["growing"] == [], rss


def test_soak_measures_each_replica_and_its_engine_process():
    """A stand-in replica (this process) with two children: one started as the engine core is
    (`python -m k3.serve.engine.engine_core ...`: its memory is the engine's), one other (not
    measured); a pid that ended is left out."""
    import subprocess
    import sys

    # each child says when it has started: a Python still starting grows between two readings
    sleep = "import sys, time; print('up', flush=True); time.sleep(60)"
    engine = subprocess.Popen([sys.executable, "-c", sleep, "-m", "k3.serve.engine.engine_core", "5"],
                              stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", sleep], stdout=subprocess.PIPE, text=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        assert engine.stdout.readline() == other.stdout.readline() == "up\n"
        me = os.getpid()
        got = serve_process_rss([("ServeReplica:app:LLMServer", me), ("ServeReplica:app:Ingress", gone.pid)])
        assert sorted(got) == [f"ServeReplica:app:LLMServer {me}", f"ServeReplica:app:LLMServer {me} engine {engine.pid}"]
        assert got[f"ServeReplica:app:LLMServer {me} engine {engine.pid}"] == psutil.Process(engine.pid).memory_info().rss
        # a budgeted store (the prefix pool) is measured less what it says it holds
        pool = serve_process_rss([("ServeReplica:app:PrefixPool", other.pid)], stored={other.pid: 2**20})
        assert list(pool) == [f"ServeReplica:app:PrefixPool {other.pid} less its store"]
        assert abs(pool[f"ServeReplica:app:PrefixPool {other.pid} less its store"]
                   - (psutil.Process(other.pid).memory_info().rss - 2**20)) < 2**16
    finally:
        for proc in (engine, other):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def curves(**spec):
    """60 one-second samples per process: (first second present, last second present, MB at start,
    MB growth over its life); a replica's first 5 s are its warm-up (it loads the model)."""
    out = {}
    for label, (first, last, mb, growth) in spec.items():
        life = last - first
        out[label] = [None if not first <= t <= last else
                      int((mb * (0.6 if t - first < 5 else 1.0) + growth * (t - first) / max(1, life)) * 2**20)
                      for t in range(60)]
    return out


@pytest.mark.parametrize("case,flat,growing,added,removed", [
    ("steady", True, [], [], []),
    ("replica added mid-run", True, [], ["decode 2"], []),
    ("replica removed mid-run", True, [], [], ["decode 2"]),
    ("replica replaced", True, [], ["decode 3"], ["decode 2"]),
    ("one process grows", False, ["decode 1"], [], []),
    ("an added replica grows", False, ["decode 2"], ["decode 2"], []),
    ("an added replica starting up", True, [], ["decode 2"], []),
])
def test_memory_is_judged_per_process(case, flat, growing, added, removed):
    spec = {"ingress": (0, 59, 500, 1), "decode 1": (0, 59, 800, 2)}
    if case == "replica added mid-run":
        spec["decode 2"] = (30, 59, 800, 1)
    elif case == "replica removed mid-run":
        spec["decode 2"] = (0, 40, 800, 1)
    elif case == "replica replaced":
        spec["decode 2"], spec["decode 3"] = (0, 25, 800, 1), (27, 59, 800, 1)
    elif case == "one process grows":
        spec["decode 1"] = (0, 59, 800, 200)  # +25% in a minute
    elif case == "an added replica grows":
        spec["decode 2"] = (20, 59, 800, 200)
    per_process = curves(**spec)
    added_warmup = None
    if case == "an added replica starting up":  # its engine builds and compiles for 15 s, then is flat
        spec["decode 2"] = (20, 59, 800, 0)
        per_process = curves(**spec)
        per_process["decode 2"] = [None if r is None else int(r * min(1.0, 0.2 + 0.8 * (t - 20) / 15))
                                   for t, r in enumerate(per_process["decode 2"])]
        judged_early = process_verdicts([float(t) for t in range(60)], per_process, warmup_s=10, max_growth=0.05)
        assert judged_early["growing"] == ["decode 2"]  # its start counted as growth
        added_warmup = 20
    v = process_verdicts([float(t) for t in range(60)], per_process, warmup_s=10, max_growth=0.05,
                         added_warmup_s=added_warmup)
    assert (v["flat"], v["growing"], v["added"], v["removed"]) == (flat, growing, added, removed), v
    assert set(v["processes"]) == set(spec)
    if case == "replica added mid-run":  # what the total alone would have said
        totals = [sum(c[t] or 0 for c in per_process.values()) for t in range(60)]
        assert rss_verdict([float(t) for t in range(60)], totals, warmup_s=10, max_growth=0.05)["flat"] is False


def test_process_verdicts_refuse_ragged_curves_and_leave_short_lives_unjudged():
    with pytest.raises(ValueError, match="one value per sample"):
        process_verdicts([0.0, 1.0], {"a": [1]}, warmup_s=0, max_growth=0.05)
    with pytest.raises(ValueError, match="no sample"):
        process_verdicts([0.0, 1.0], {"a": [None, None]}, warmup_s=0, max_growth=0.05)
    v = process_verdicts([float(t) for t in range(20)], {"late": [None] * 17 + [2**20] * 3}, warmup_s=0,
                         max_growth=0.05)
    assert v["flat"] is None and v["processes"]["late"]["flat"] is None and v["added"] == ["late"]


@pytest.mark.parametrize("totals,flat", [
    ([100] * 20, True),
    ([100 + i for i in range(20)], False),  # +19% from first to last fifth
    ([200] * 5 + [100] * 15, True),         # the warm-up is ignored
])
def test_rss_verdict(totals, flat):
    v = rss_verdict([float(i) for i in range(20)], [t * 2**20 for t in totals], warmup_s=5, max_growth=0.05)
    assert v["flat"] is flat
    assert rss_verdict([0.0, 1.0], [1, 1], warmup_s=0, max_growth=0.05)["flat"] is None


def _serve_bench(*args: str):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "jobs/serve_bench.py", "--no-progress", *args], cwd=repo,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["--num-prompts", "-1"], "--num-prompts: "),
    (["--request-rate", "nan"], "--request-rate: "),
    (["--max-concurrency", "0"], "--max-concurrency: "),
    (["--out", "no/such/dir/x.json"], "--out no/such/dir/x.json: its directory does not exist"),
    (["--out", "."], "--out .: is a directory"),
])
def test_serve_bench_bad_arguments_are_one_line(args, needle):
    out = _serve_bench(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr and needle in out.stderr, out.stderr


def test_serve_bench_against_no_server_fails_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    out = _serve_bench("--base-url", url, "--num-prompts", "2")  # no --model: asks the server first
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot reach {url}/v1/models" in out.stderr
    out = _serve_bench("--base-url", url, "--num-prompts", "2", "--model", "m")  # every request fails
    assert out.returncode == 1 and "no request completed" in out.stderr, out.stderr
    assert json.loads(out.stdout)["failed"] == 2  # the JSON is still printed
