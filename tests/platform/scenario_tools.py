"""What autoscaling_scenario.py watches and drives: live nodes, dashboard panels sampled at random
moments, Serve traffic checked against one engine, and the removal of a node."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WINDOW = "30s"  # stands for Grafana's $__rate_interval (4 scrape intervals and more)


def alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


class NodeWatch:
    """Largest number of live nodes seen while a phase runs (polled every second)."""

    def __init__(self):
        self.max, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.max = max(self.max, alive_nodes())
            self._stop.wait(1.0)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def dashboard_panels(name: str) -> dict[str, list[str]]:
    """{panel title: [PromQL, ...]} of a shipped dashboard, Grafana's rate window made concrete."""
    from k3.platform.ops.dashboards import panel_queries
    from k3.platform.ops.panels import RATE

    d = json.loads((REPO / "cluster" / "grafana" / f"{name}.json").read_text())
    panels: dict[str, list[str]] = {}
    for title, expr in panel_queries(d):
        panels.setdefault(title, []).append(expr.replace(RATE, WINDOW))
    return panels


def _needs() -> dict[str, str | None]:
    from k3.platform.ops.panels import CLUSTER_PANELS, SERVING_PANELS, TRAINING_PANELS

    return {p.title: p.needs for p in (*TRAINING_PANELS, *SERVING_PANELS, *CLUSTER_PANELS)}


def _finite(series: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in series)


class PanelSampler:
    """Evaluates every panel of the given dashboards at random moments from the time `started()`
    is true until `finished()` is or the block ends: `moments` is one record per moment of the
    panels without data (panels that need a GPU are left out on a cluster without one). Moments
    come 1 to 3 s apart; with `dense` the first that many come 0.3 to 0.8 s apart, so that a
    phase a quiet machine runs in ~10 s (the scenario's 24 training steps took 0.6 s each alone)
    still gets its moments, and a slow day's minutes-long phase is queried only `dense` times more.
    Its start condition must then hold for every panel from the first moment."""

    def __init__(self, prom, dashboards: list[str], started, finished=lambda: False, seed: int = 0, dense: int = 0):
        self.prom, self.started, self.finished, self.rng = prom, started, finished, random.Random(seed)
        self.dense = dense
        needs = _needs()
        self.panels = {f"{d}/{t}": q for d in dashboards for t, q in dashboard_panels(d).items() if needs[t] is None}
        self.moments: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict:
        at = time.time()
        seen = {key: any(_finite(self.prom.client.query(e)) for e in exprs) for key, exprs in self.panels.items()}
        return {"t": at, "empty": sorted(k for k, v in seen.items() if not v), "panels": len(seen)}

    def _run(self):
        while not self._stop.is_set() and not self.started():
            self._stop.wait(1.0)
        while not self._stop.wait(self._gap()) and not self.finished():
            self.moments.append(self._sample())

    def _gap(self) -> float:
        return self.rng.uniform(0.3, 0.8) if len(self.moments) < self.dense else self.rng.uniform(1.0, 3.0)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def panels_over(prom, dashboards: list[str], start: float) -> dict:
    """Series with at least one finite value, per (panel, query), over [start, now]."""
    needs, out = _needs(), {}
    for d in dashboards:
        for title, exprs in dashboard_panels(d).items():
            if needs[title] is not None:
                continue
            for e in exprs:
                series = prom.client.query_range(e, start, time.time(), step=2)
                out[f"{d}/{title} :: {e}"] = sum(1 for s in series
                                                if any(math.isfinite(float(v)) for _, v in s["values"]))
    return out


def node_processes(pgid: int, node_id: str, head_node_id: str) -> list[int]:
    """Every process of one fake worker node, found the way Ray's fake provider would remove it
    (its raylet and agents carry the node id the provider gave them in their environment), and
    every process they started. The node's own processes are looked for in the head's process
    group only; the head itself is refused (its processes carry the fake head's id, and without its
    GCS the whole cluster goes). Found ahead of the removal, so that the removal itself is a few
    signals (it is aimed at a request in flight)."""
    if node_id == head_node_id:
        raise ValueError(f"node {node_id} is the head: remove a worker node")
    marker = f"RAY_OVERRIDE_NODE_ID_FOR_TESTING={node_id}".encode()
    parents: dict[int, int] = {}  # pid -> parent pid, every process on the machine
    marked = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            pid = int(d.name)
            parents[pid] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if os.getpgid(pid) == pgid and marker in (d / "environ").read_bytes().split(b"\0"):
                marked.add(pid)
        except (OSError, ProcessLookupError, ValueError):
            continue
    # the raylet's workers (the replicas) lead process groups of their own and need not carry the
    # marker: they are found as its children (missing them left the replica serving for a moment
    # after its raylet was gone, and the request in flight then finished instead of being lost)
    pids = set(marked)
    while True:
        more = {pid for pid, parent in parents.items() if parent in pids} - pids
        if not more:
            break
        pids |= more
    return sorted(pids)


def kill_processes(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Traffic:
    """Clients that send /v1/completions requests (distinct prompts of 400 tokens, greedy, 8 tokens)
    in a loop, each answer checked against the same prompt run by one LLMEngine in this process;
    and, on demand, a burst of long prompts (a prefill of seconds: in flight when a node goes)."""

    def __init__(self, url: str, config: dict, seed_prompts: int = 24, prompt_len: int = 400,
                 long_prompts: int = 8, long_len: int = 2000):
        import torch
        from tokenizers import Tokenizer

        import k3.model
        from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams

        torch.set_num_threads(1)
        self.url = f"{url}/v1/completions"
        g = torch.Generator().manual_seed(1)
        shared = torch.randint(3, 4000, (64,), generator=g).tolist()  # a common prefix: local and pool hits
        self.prompts = [shared + torch.randint(3, 4000, (prompt_len - 64,), generator=g).tolist()
                        for _ in range(seed_prompts)]
        self.n_short = seed_prompts  # the looping clients send these; the burst the long ones after them
        self.prompts += [torch.randint(3, 4000, (long_len,), generator=g).tolist() for _ in range(long_prompts)]
        model = k3.model.build(k3.model.get_preset(config["model"]["preset"]), seed=0).eval()
        tokenizer = Tokenizer.from_file(config["model"]["tokenizer_path"])
        engine = LLMEngine(model, EngineConfig(**config["engine"]), tokenizer)
        self.page_size = engine.config.page_size
        self.want = []
        for prompt in self.prompts:
            rid = engine.add_request(None, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                  logprobs=0))
            outs = []
            while engine.has_unfinished():
                outs += [o for o in engine.step() if o.request_id == rid]
            self.want.append((outs[-1].text, [e["logprob"] for o in outs for e in o.logprobs]))
        self.results: list[dict] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def finished(self) -> int:
        return len(self.results)

    def _one(self, i: int) -> dict:
        import httpx

        body = {"model": "k3-tiny", "prompt": self.prompts[i], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        t = time.time()
        try:
            r = httpx.post(self.url, json=body, timeout=300)
        except httpx.HTTPError as e:  # a broken connection: neither an answer nor a clean error
            return {"i": i, "long": i >= self.n_short, "t": t, "s": time.time() - t, "status": None,
                    "broken": repr(e)}
        out = {"i": i, "long": i >= self.n_short, "t": t, "s": time.time() - t, "status": r.status_code}
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            text, lp = self.want[i]
            got = choice["logprobs"]["token_logprobs"]
            out["identical"] = choice["text"] == text and len(got) == len(lp) and \
                max(abs(a - b) for a, b in zip(got, lp)) < 1e-4
        else:
            try:
                out["error"] = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                out["error"] = None  # not an OpenAI-style error body
        return out

    def _record(self, i: int) -> None:
        res = self._one(i)
        with self._lock:
            self.results.append(res)

    def _client(self):
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next % self.n_short, self._next + 1
            self._record(i)

    def _start(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def burst(self, to_replica: str | None = None, replica_ids: list[str] = ()) -> int:
        """Send long prompts once, all at once, beside the looping clients (inside running()): the
        ones the prefill router prefers to send to replica `to_replica` (its unique id among
        `replica_ids`: the rendezvous hashing of serve/router.py), so a replica chosen beforehand
        gets them; every long prompt when none would go there, or without `to_replica`. Returns
        how many were sent."""
        from k3.serve.engine.cache_manager import page_hashes
        from k3.serve.router import DEFAULT_ROUTE_PAGES, prefix_route_key, rendezvous_order

        ps, longs = self.page_size, range(self.n_short, len(self.prompts))
        aimed = [i for i in longs if to_replica is not None and rendezvous_order(
            prefix_route_key(page_hashes(self.prompts[i][:DEFAULT_ROUTE_PAGES * ps], ps)), replica_ids)[0] == to_replica]
        for i in aimed or longs:
            self._start(self._record, i)
        return len(aimed or longs)

    @contextlib.contextmanager
    def running(self, clients: int):
        for _ in range(clients):
            self._start(self._client)
        try:
            yield self
        finally:
            self._stop.set()
            for t in self._threads:
                t.join(timeout=320)
            self.hung = sum(t.is_alive() for t in self._threads)

    def summary(self, t0: float) -> dict:
        """Outcomes; the timeline's times are seconds from t0."""
        rs = self.results
        return {"requests": len(rs), "ok": sum(r["status"] == 200 for r in rs),
                "identical": sum(bool(r.get("identical")) for r in rs),
                "clean_errors": [(r["status"], r["error"]) for r in rs if r["status"] not in (200, None)],
                "broken": [r["broken"] for r in rs if r["status"] is None],
                "max_s": max((r["s"] for r in rs), default=0.0), "hung_clients": getattr(self, "hung", None),
                "timeline": [(round(r["t"] - t0, 1), r["status"], round(r["s"], 2)) for r in rs],
                # what the clients had in flight at t0: how each ended (a retried one answers alike)
                "in_flight_at_t0": [{"long": r["long"], "status": r["status"], "identical": bool(r.get("identical")),
                                     "error": r.get("error"), "s": round(r["s"], 2)}
                                    for r in rs if r["t"] < t0 < r["t"] + r["s"]]}


class Since:
    """Remembers when `cond()` first held: `for_s(s)` is true once it has held for s seconds."""

    def __init__(self, cond):
        self.cond, self.at = cond, None

    def for_s(self, s: float) -> bool:
        if self.at is None and self.cond():
            self.at = time.time()
        return self.at is not None and time.time() - self.at >= s


def sessions_seen(client, timeout_s: float = 120) -> dict[str, set[str]]:
    """SessionName labels of every series a Prometheus holds, of the autoscaler's (autoscaler_*)
    and of the dashboard's (ray_dashboard_*), once both of those have appeared."""
    def names(metric_re: str) -> set[str]:
        q = f'count by (SessionName) ({{__name__=~"{metric_re}", SessionName!=""}})'
        return {s["metric"]["SessionName"] for s in client.query(q)}

    deadline = time.time() + timeout_s
    while True:
        seen = {kind: names(rx) for kind, rx in (("any", ".+"), ("autoscaler", "autoscaler_.+"),
                                                  ("dashboard", "ray_dashboard_.+"))}
        if (seen["autoscaler"] and seen["dashboard"]) or time.time() > deadline:
            return seen
        time.sleep(2)


def dashboard_get(address: str, path: str, token_path) -> dict:
    """GET a JSON endpoint of a token-auth Ray dashboard (`Authorization: Bearer <token>`)."""
    import urllib.request

    headers = {"Authorization": f"Bearer {Path(token_path).read_text().strip()}"}
    with urllib.request.urlopen(urllib.request.Request(f"{address}{path}", headers=headers), timeout=30) as r:
        return json.loads(r.read())
