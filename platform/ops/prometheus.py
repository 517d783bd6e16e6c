"""Prometheus on 127.0.0.1 scraping a Ray cluster, and a small client for its HTTP API.

    prom = Prometheus(session_dir=head.session_dir, workdir="...").start()
    prom.query("ray_k3_train_loss")                              # instant vector, a list of series
    prom.query_range("rate(ray_k3_serve_generation_tokens_total[1m])", start, end, step=5)
    prom.stop()

Targets come from Ray's service-discovery file (`<session dir>/prom_metrics_service_discovery.json`,
rewritten by the head as nodes join and leave), so nodes the autoscaler adds are scraped without a
restart. The binary is Debian's `prometheus` package: on PATH, or unpacked without root into
`.cache/prometheus` by `make prometheus` (`apt-get download prometheus`, `dpkg-deb -x`).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from .process_group import group_alive, recorded_group_alive, start_time, stop_group, valid_pid

REPO = Path(__file__).resolve().parents[2]
CACHED_BINARY = REPO / ".cache" / "prometheus" / "root" / "usr" / "bin" / "prometheus"
SD_FILE = "prom_metrics_service_discovery.json"


class PrometheusError(RuntimeError):
    """Prometheus is unreachable or answered with an error (the message is one line)."""


def find_binary() -> Path:
    """`prometheus` on PATH, else the copy `make prometheus` unpacks into .cache/."""
    on_path = shutil.which("prometheus")
    if on_path:
        return Path(on_path)
    if CACHED_BINARY.exists():
        return CACHED_BINARY
    raise PrometheusError(f"no prometheus binary: not on PATH and not at {CACHED_BINARY} (run `make prometheus`)")


MAX_INTERVAL_S = 86400.0


def duration(seconds: float) -> str:
    """seconds as a Prometheus duration in whole milliseconds, its resolution (`500ms`, `5s`);
    ValueError for nan, inf or a value outside [0.001, MAX_INTERVAL_S]."""
    if not (math.isfinite(seconds) and 0.001 <= seconds <= MAX_INTERVAL_S):
        raise ValueError(f"must be a number of seconds from 0.001 to {MAX_INTERVAL_S:g}, got {seconds}")
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def scrape_config(session_dir: str | os.PathLike, interval_s: float, rules_file: Path | None = None) -> dict:
    """prometheus.yml scraping every node Ray lists in its service-discovery file (and evaluating
    the alerting rules of rules_file, if given)."""
    every = duration(interval_s)
    return {"global": {"scrape_interval": every, "evaluation_interval": every},
            **({"rule_files": [str(rules_file)]} if rules_file is not None else {}),
            "scrape_configs": [{"job_name": "ray",
                                "file_sd_configs": [{"files": [str(Path(session_dir) / SD_FILE)],
                                                     "refresh_interval": every}]}]}


class PrometheusClient:
    """Prometheus's HTTP API (`/api/v1/query`, `/api/v1/query_range`, `/api/v1/series`)."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict) -> dict:
        full = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(full, timeout=self.timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                detail = json.loads(e.read()).get("error", e.reason)
            except ValueError:
                detail = e.reason
            raise PrometheusError(f"Prometheus at {self.url} refused {path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise PrometheusError(f"Prometheus at {self.url} is unreachable: {reason}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.url}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result (one dict per series: `metric` labels and `value`)."""
        return self._get("/api/v1/query", {"query": expr})["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """A range query's result (one dict per series: `metric` labels and `values`)."""
        return self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})["result"]

    def metric_names(self, prefix: str = "") -> list[str]:
        names = self._get("/api/v1/label/__name__/values", {})
        return sorted(n for n in names if n.startswith(prefix))

    def alerts(self) -> list[dict]:
        """The alerts the server's rules hold now (pending or firing)."""
        return self._get("/api/v1/alerts", {})["alerts"]

    def rule_names(self) -> list[str]:
        """Names of the rules the server evaluates."""
        return [r["name"] for g in self._get("/api/v1/rules", {})["groups"] for r in g["rules"]]

    def targets_up(self) -> int:
        """How many scrape targets answered on the last scrape."""
        return int(sum(float(s["value"][1]) for s in self.query("up")))


class Prometheus:
    """A Prometheus server owned by this process, on a free 127.0.0.1 port.

    Args:
        session_dir: the Ray session directory whose service-discovery file lists the targets.
        workdir: where prometheus.yml, the TSDB and the log go.
        scrape_interval_s: seconds between scrapes (and service-discovery re-reads).
        port: the HTTP port (a free one by default).
        rules_file: alerting rules to evaluate (k3.platform.ops.alerts writes them), or None.
    """

    def __init__(self, session_dir: str | os.PathLike, workdir: str | os.PathLike, scrape_interval_s: float = 5.0,
                 port: int | None = None, start_timeout_s: float = 60.0, rules_file: str | os.PathLike | None = None):
        from k3.platform.ops.local_ray import free_port

        try:
            duration(scrape_interval_s)
        except ValueError as e:
            raise ValueError(f"scrape_interval_s {e}") from None
        self.session_dir = Path(session_dir)
        self.workdir = Path(workdir)
        self.interval_s = scrape_interval_s
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.rules_file = Path(rules_file).resolve() if rules_file is not None else None
        if self.rules_file is not None and not self.rules_file.is_file():
            raise ValueError(f"{rules_file}: no such rules file")
        self.pid: int | None = None
        self.started: int | None = None  # its start time (process_group.start_time): pid alone may be reused
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> PrometheusClient:
        return PrometheusClient(self.url)

    def start(self) -> "Prometheus":
        if not self.session_dir.is_dir():
            raise PrometheusError(f"Ray session directory {self.session_dir} does not exist (is the cluster up?)")
        binary = find_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(scrape_config(self.session_dir, self.interval_s, self.rules_file),
                                      sort_keys=False))
        cmd = [str(binary), f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=2d"]
        with open(self.workdir / "prometheus.log", "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.started = start_time(self.pid)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.time() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = (self.workdir / "prometheus.log").read_text().strip().splitlines()[-1:]
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}: {' '.join(tail)}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.time() > deadline:
                raise PrometheusError(f"prometheus not ready on {self.url} after {self.start_timeout_s:.0f} s")
            time.sleep(0.5)

    def state(self) -> dict:
        return {"pid": self.pid, "started": self.started, "port": self.port, "url": self.url, "workdir": str(self.workdir),
                "session_dir": str(self.session_dir)}

    @classmethod
    def from_state(cls, state: dict) -> "Prometheus":
        """A handle on a server started by another process (`k3 monitor down`): KeyError or
        TypeError when `state` lacks a field or holds one of the wrong type."""
        if not valid_pid(state["pid"]):
            raise TypeError(f"pid must be a positive integer, got {state['pid']!r}")
        prom = cls(session_dir=state["session_dir"], workdir=state["workdir"], port=state["port"])
        prom.pid = state["pid"]
        prom.started = state.get("started")  # None in a state from before k3 recorded it
        return prom

    def alive(self) -> bool:
        """Whether any process of the server's process group still runs; for a server rebuilt
        from a state file, only while its PID still names the process that was started."""
        if self.proc is None:
            return recorded_group_alive(self.pid, self.started)
        return group_alive(self.pid, self.proc)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; a no-op when not running,
        or when its PID now names another process."""
        if self.alive():
            stop_group(self.pid, self.proc, grace_s=30.0)

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
