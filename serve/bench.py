"""Load generation against an OpenAI-compatible server, measured per request (`vllm bench serve`'s
measures): time to first token (TTFT), time per output token after the first (TPOT), inter-token
latency (ITL, between streamed chunks), end-to-end latency (E2E); throughput, and goodput under
latency SLOs.

    cfg = BenchConfig(base_url="http://127.0.0.1:8000", num_prompts=64, request_rate=8.0)
    summary = asyncio.run(run_benchmark(cfg))     # a JSON-able dict

Every request streams (SSE) with `stream_options.include_usage`, so token counts come from the
server's `usage`; without it, each non-empty chunk counts as one token. `jobs/serve_bench.py` is
the command line; `jobs/serve_soak.py` reuses `stream_request`.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx
import numpy as np
import psutil
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Prompt words: short, common in code and English, each about one BPE token, so a prompt of
# n words is close to n tokens (the server's usage.prompt_tokens gives the exact count).
_WORDS = ("the of and to in is for on it as with be at by this that from or an are not def "
          "return if else import class self value data list name type int str none true false "
          "print len range for while try except with open file path key item error test run "
          "time set get add new old one two ten six red blue cat dog sun day way man car").split()


class BenchConfig(BaseModel):
    """One benchmark run."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="The server, e.g. http://127.0.0.1:8000 (the /v1 paths are added).")
    model: str | None = Field(None, description="Model name; default the first of GET /v1/models.")
    endpoint: Literal["completions", "chat"] = Field("completions", description="Which API to call.")
    api_key: str | None = Field(None, description="Sent as `Authorization: Bearer <key>`.")
    num_prompts: int = Field(100, ge=1, description="Requests to send.")
    request_rate: float = Field(math.inf, gt=0, description="Poisson arrival rate, requests/s; inf sends all at once.")
    max_concurrency: int | None = Field(None, ge=1, description="Most requests in flight at once.")
    dataset: Literal["random", "shared-prefix"] = Field("random", description="random: independent prompts; "
                                                        "shared-prefix: groups of prompts sharing a long prefix.")
    input_len: int = Field(128, ge=1, description="Words per prompt (random), or per unique suffix (shared-prefix).")
    output_len: int = Field(64, ge=1, description="max_tokens of each request.")
    prefix_len: int = Field(512, ge=1, description="shared-prefix: words of each group's shared prefix.")
    num_prefix_groups: int = Field(4, ge=1, description="shared-prefix: how many distinct prefixes.")
    ignore_eos: bool = Field(False, description="Ask for exactly output_len tokens (a vLLM/k3 extension).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of every request.")
    seed: int = Field(0, description="Seed of the prompts and the arrival times.")
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput: a request's TTFT must be at most this.")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput: a request's TPOT must be at most this.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    metrics_urls: list[str] = Field(default_factory=list, description="Prometheus endpoints (Ray's per-node "
                                    "metrics export) scraped before and after the run for the k3_serve_* deltas.")
    metrics_settle_s: float = Field(12.0, ge=0, description="Wait before the last scrape: Ray reports metrics "
                                                            "every few seconds.")
    trace: bool = Field(False, description="Ask a k3 server for each request's path (header X-K3-Trace: 1) "
                                           "and report where the time to first token went, hop by hop.")

    @model_validator(mode="after")
    def _check(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        return self


@dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    ok: bool
    start_s: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None
    # wall-clock stamps of the request's path to its first token (TRACE_STAMPS), when traced
    trace: dict[str, float] | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_prompts(cfg: BenchConfig) -> list[str]:
    """The run's prompts, fixed by cfg.seed. shared-prefix: prompt i belongs to group
    i % num_prefix_groups and is that group's prefix + a unique suffix of input_len words."""
    rng = random.Random(cfg.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    if cfg.dataset == "random":
        return [words(cfg.input_len) for _ in range(cfg.num_prompts)]
    prefixes = [words(cfg.prefix_len) for _ in range(cfg.num_prefix_groups)]
    return [prefixes[i % cfg.num_prefix_groups] + " " + words(cfg.input_len) for i in range(cfg.num_prompts)]


def arrival_gaps(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each of n requests: exponential gaps (a Poisson process) of mean
    1/rate; all zero for an infinite rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


def request_body(cfg: BenchConfig, model: str, prompt: str) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": cfg.temperature}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = cfg.output_len
    else:
        body["prompt"] = prompt
        body["max_tokens"] = cfg.output_len
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw.decode(errors="replace")[:200]
    return f"HTTP {status}: {msg}"


# The stamps of a traced request, in the order its first token passes them: the client's, then the
# servers' (serve/servers.py, serve/ingress.py); "pd" passes all, "agg" skips the prefill hops.
TRACE_STAMPS = ("client_send", "ingress_in", "ingress_call", "server_in", "prefill_call", "prefill_in", "pool_local",
                "pool_fetched", "pool_done",
                "engine_in", "engine_first", "prefill_out", "decode_reply", "server_out", "ingress_first",
                "sse_first", "client_first")
TRACE_HEADER = {"X-K3-Trace": "1"}


def trace_hops(trace: dict[str, float]) -> dict[str, float]:
    """Seconds between consecutive stamps of one traced request, {"a->b": s} in path order; they
    add up to the client's time to first token."""
    present = [k for k in TRACE_STAMPS if k in trace]
    return {f"{a}->{b}": trace[b] - trace[a] for a, b in zip(present, present[1:])}


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


@dataclass
class _StreamClock:
    """What `stream_request` keeps while it reads one stream: its start (monotonic and wall), the
    last text chunk's time, the text chunks counted, and the first one's wall time."""
    start: float
    sent: float
    last: float
    chunks: int = 0
    first_wall: float | None = None


def _read_line(line: str, res: RequestResult, clock: _StreamClock, chat: bool, trace: bool) -> bool:
    """Take one line of an SSE stream into `res`; True once it is the stream's `[DONE]`."""
    if line.startswith(": k3-trace ") and trace:
        stamps = json.loads(line[len(": k3-trace "):])
        if clock.first_wall is not None and stamps and stamps[0]:
            res.trace = {"client_send": clock.sent, **stamps[0], "client_first": clock.first_wall}
        return False
    if not line.startswith("data:"):
        return False
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        res.ok = res.error is None
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        res.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return False
    now = time.perf_counter()
    if _chunk_text(chunk, chat):
        clock.chunks += 1
        if res.ttft_s is None:
            res.ttft_s = now - clock.start
            clock.first_wall = time.time()
        else:
            res.itl_s.append(now - clock.last)
        clock.last = now
    usage = chunk.get("usage")
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens")
        res.output_tokens = usage.get("completion_tokens", clock.chunks)
    return False


async def stream_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str],
                         trace: bool = False) -> RequestResult:
    """Send one streaming request and time its chunks; never raises for a failed request (the
    failure is in the result). With `trace`, the server's stamps of the first choice's path (the
    stream's `: k3-trace` comment) go into `result.trace` with the client's own."""
    chat = "messages" in body
    if trace:
        headers = {**headers, **TRACE_HEADER}
    sent = time.time()
    start = time.perf_counter()
    clock = _StreamClock(start=start, sent=sent, last=start)
    res = RequestResult(ok=False, start_s=start)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = _error_text(resp.status_code, await resp.aread())
                res.e2e_s = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                if _read_line(line, res, clock, chat, trace):
                    break
            else:
                res.error = res.error or "stream ended without [DONE]"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    except json.JSONDecodeError as e:
        res.error = f"bad SSE chunk: {e}"
    res.e2e_s = time.perf_counter() - start
    if res.ok and not res.output_tokens:
        res.output_tokens = clock.chunks
    if res.ok and res.ttft_s is None:
        res.ok, res.error = False, "no token streamed"
    return res


async def served_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model of GET /v1/models."""
    try:
        resp = await client.get(f"{base_url}/v1/models", headers=auth_headers(api_key))
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {base_url}/v1/models: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models failed: {_error_text(resp.status_code, resp.content)}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model")
    return data[0]["id"]


def endpoint_url(base_url: str, endpoint: str) -> str:
    return f"{base_url.rstrip('/')}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"


def new_client(timeout_s: float) -> httpx.AsyncClient:
    # no connection cap (the benchmark's own concurrency limit decides), no proxies from the environment
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_benchmark(cfg: BenchConfig, progress: Callable[[], None] | None = None) -> dict:
    """Send cfg.num_prompts requests as configured and return the summary (see `summarize`).
    `progress` is called once per finished request."""
    prompts = make_prompts(cfg)
    gaps = arrival_gaps(cfg.num_prompts, cfg.request_rate, random.Random(cfg.seed + 1))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with new_client(cfg.timeout_s) as client:
        model = cfg.model or await served_model(client, cfg.base_url.rstrip("/"), cfg.api_key)
        url = endpoint_url(cfg.base_url, cfg.endpoint)
        headers = auth_headers(cfg.api_key)

        async def one(prompt: str) -> RequestResult:
            if sem is None:
                r = await stream_request(client, url, request_body(cfg, model, prompt), headers, cfg.trace)
            else:
                async with sem:
                    r = await stream_request(client, url, request_body(cfg, model, prompt), headers, cfg.trace)
            if progress is not None:
                progress()
            return r

        before = await scrape_metrics(client, cfg.metrics_urls) if cfg.metrics_urls else None
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = None
        if before is not None:
            await asyncio.sleep(cfg.metrics_settle_s)
            after = await scrape_metrics(client, cfg.metrics_urls)
    summary = summarize(results, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
    if after is not None:
        summary["server_metrics"] = server_metric_deltas(before, after, summary["ttft_ms"]["mean"])
    summary["config"] = {**cfg.model_dump(exclude={"api_key"}), "model": model,
                         "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate}
    return summary


async def run_side_by_side(cfg: BenchConfig, targets: dict[str, str],
                            progress: Callable[[], None] | None = None) -> dict:
    """The same workload (prompts, arrivals, SLOs) against each target {name: base_url}, one after
    the other in the given order: {"runs": {name: summary}}."""
    if not targets:
        raise ValueError("targets must name at least one server")
    runs = {}
    for name, url in targets.items():
        runs[name] = await run_benchmark(cfg.model_copy(update={"base_url": url}), progress)
    return {"runs": runs}


# how a replica's engine process (`engine_process`) is started: `python -m` this module, the name
# by which its process is told from others (k3.serve.engine.engine_core starts it by `__name__`)
ENGINE_CORE_MODULE = "k3.serve.engine.engine_core"


def _process_label(proc: psutil.Process, labels: dict[int, str], root: int) -> str:
    """A process of a private Ray by its part: the driver, a Serve replica ("<app>:<deployment>"),
    a replica's engine process ("<app>:<deployment> engine"), Serve's proxy and controller, Ray's
    own processes ("ray system"; idle workers "ray idle workers"); under direct ingress with HAProxy,
    "haproxy" and the actor that runs it ("HAProxyManager")."""
    if proc.pid == root:
        return "driver (the load generator)"
    cmd = proc.cmdline()
    parent = labels.get(proc.ppid())
    if ENGINE_CORE_MODULE in cmd:
        return f"{parent or 'unknown'} engine"
    title = cmd[0] if cmd else ""
    if os.path.basename(title) == "haproxy":
        return "haproxy"
    if not title.startswith("ray::"):
        # a process a replica or an engine started (inductor's compile workers) counts as its parent
        return parent if parent is not None and parent not in ("driver (the load generator)", "ray system") \
            else "ray system"
    name = title[len("ray::"):]
    if name.startswith("ServeReplica:"):  # "ServeReplica:<app>:<deployment>[.<method running now>]"
        _, app, deployment = (name.split(":", 2) + ["", ""])[:3]
        return f"{app}:{deployment.split('.', 1)[0]}"
    name = name.split(".", 1)[0]  # the worker's actor, less the method running now
    return {"ProxyActor": "serve proxy", "ServeController": "serve controller", "IDLE": "ray idle workers"}.get(name, name)


def process_cpu_seconds(root_pid: int | None = None) -> dict[int, tuple[str, float]]:
    """{pid: (label, user + system CPU seconds so far)} of `root_pid` (default this process) and every
    process under it: for a driver that started a private Ray, its GCS, raylet and workers (Serve's
    replicas, proxy and controller) and the replicas' engine processes."""
    root = psutil.Process(root_pid)
    out: dict[int, tuple[str, float]] = {}
    labels: dict[int, str] = {}
    for proc in [root, *root.children(recursive=True)]:  # parents before their children
        try:
            labels[proc.pid] = _process_label(proc, labels, root.pid)
            cpu = proc.cpu_times()
            out[proc.pid] = (labels[proc.pid], cpu.user + cpu.system)
        except psutil.Error:  # ended meanwhile
            continue
    return out


def cpu_ms_per_token(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                     tokens: int) -> dict[str, float]:
    """CPU milliseconds per output token by process label between two `process_cpu_seconds`
    readings (a process that started in between counts from zero), largest first, with "total"."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    by: dict[str, float] = {}
    for pid, (label, cpu) in after.items():
        by[label] = by.get(label, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
    rows = {k: round(v * 1e3 / tokens, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0}
    return {**rows, "total": round(sum(by.values()) * 1e3 / tokens, 3)}


def parse_prometheus(text: str, skip_gauges: bool = False) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}; gauges
    (by their `# TYPE` line) left out when asked."""
    out: dict[str, float] = {}
    gauges = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4 and parts[3] == "gauge":
                gauges.add(parts[2])
            continue
        if not line or line.startswith("#"):
            continue
        name_labels, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        name = name_labels.split("{", 1)[0].strip()
        fields = rest.split()
        if not name or not fields or (skip_gauges and name in gauges):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(fields[0])
        except ValueError:
            continue
    return out


async def scrape_metrics(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float]:
    """The k3_serve_* counter and histogram samples of every endpoint, summed (one endpoint per Ray
    node); gauges are left out, a difference of two gauge readings means nothing."""
    total: dict[str, float] = {}
    for url in urls:
        resp = await client.get(url)
        resp.raise_for_status()
        for k, v in parse_prometheus(resp.text, skip_gauges=True).items():
            if "k3_serve_" in k:
                total[k] = total.get(k, 0.0) + v
    return total


def server_metric_deltas(before: dict[str, float], after: dict[str, float], ttft_mean_ms: float | None) -> dict:
    """What the run added to the servers' k3_serve_* metrics: histograms as {count, mean}, counters
    as their increase; and the handoff's mean seconds as a share of the client-measured mean TTFT.

    Ray 2.60 exports a histogram's _sum as if every observation sat at its bucket's midpoint, so
    `mean` is exact only to the bucket's width; counts and counters are exact."""
    out: dict[str, dict | float] = {}
    for name in sorted(after):
        delta = after[name] - before.get(name, 0.0)
        if name.endswith("_count") and name[:-6] + "_sum" in after:
            base = name[:-6]
            d_sum = after[base + "_sum"] - before.get(base + "_sum", 0.0)
            out[base] = {"count": delta, "mean": d_sum / delta if delta else None}
        elif not name.endswith(("_sum", "_bucket", "_count")):
            out[name] = delta
    handoff = next((v for k, v in out.items() if k.endswith("k3_serve_handoff_seconds")), None)
    if isinstance(handoff, dict) and handoff["mean"] is not None and ttft_mean_ms:
        out["handoff_share_of_ttft"] = round(handoff["mean"] / (ttft_mean_ms / 1e3), 4)
    return out


HEAD_GAPS = 8  # inter-token gaps reported one by one (itl_p50_by_position_ms)


def stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of seconds, in milliseconds (None without values)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3)}


def trace_summary(traces: Sequence[dict[str, float]]) -> dict:
    """Where the time to first token went over traced requests (ms, mean and p50): each hop
    (`trace_hops`), the engine's own time to the first token (engine_in->engine_first: its queue,
    prefill steps and sampling, inside the replica), and the Serve path's overhead (the time to
    first token minus the engine's)."""
    def mean_p50(values_s: list[float]) -> dict:
        s = stats_ms(values_s)
        return {"mean": s["mean"], "p50": s["p50"]}

    per = [trace_hops(t) for t in traces]
    names = list(dict.fromkeys(k for h in per for k in h))
    engine = [t["engine_first"] - t["engine_in"] for t in traces]
    total = [t["client_first"] - t["client_send"] for t in traces]
    return {"requests": len(traces),
            "hops": {k: mean_p50([h[k] for h in per if k in h]) for k in names},
            "engine": mean_p50(engine), "ttft": mean_p50(total),
            "overhead": mean_p50([a - b for a, b in zip(total, engine)])}


def summarize(results: Sequence[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The run's numbers: counts, errors by message, throughput, latency statistics (ms) and goodput.

    Goodput counts the successful requests whose TTFT and TPOT meet the given SLOs (a request with
    one output token has no TPOT and meets that SLO); None without an SLO."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.ok]
    errors = Counter(r.error or "unknown error" for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common()),
        "duration_s": round(duration_s, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_throughput": round(out_tokens / duration_s, 3),
        "total_token_throughput": round((in_tokens + out_tokens) / duration_s, 3),
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok]),
        # the gap after the first token apart from the others: a disaggregated server loads the
        # prompt's state there
        "itl_first_ms": stats_ms([r.itl_s[0] for r in ok if r.itl_s]),
        "itl_rest_ms": stats_ms([x for r in ok for x in r.itl_s[1:]]),
        # the median of each of the first gaps: where work after the first token (a state's load,
        # a pool publish on a shared host) shows, and where the gaps settle
        "itl_p50_by_position_ms": [round(float(np.median([r.itl_s[i] for r in ok if len(r.itl_s) > i])) * 1e3, 3)
                                   for i in range(min(HEAD_GAPS, max((len(r.itl_s) for r in ok), default=0)))],
        "goodput": None,
    }
    traced = [r.trace for r in ok if r.trace]
    if traced:
        summary["trace_ms"] = trace_summary(traced)
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        def meets(r: RequestResult) -> bool:
            if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > slo_ttft_ms):
                return False
            return slo_tpot_ms is None or r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms

        good = sum(meets(r) for r in ok)
        summary["goodput"] = {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "good_requests": good,
                              "requests_per_s": round(good / duration_s, 3),
                              "fraction": round(good / len(results), 4) if results else None}
    return summary
