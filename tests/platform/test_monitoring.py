"""Dashboards as code, the Grafana push (grafana-client against a loopback server that checks
Grafana's documented HTTP API), run reports, and the monitor's bad-input paths. The dashboards'
queries against a real Prometheus and cluster: test_autoscaling_monitoring.py."""
from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from helpers import run_killed_midway, tree_bytes
from k3.platform.ops.cli import main
from k3.platform.ops.local_ray import free_port
from k3.platform.ops.metrics import SERVE_METRICS
from k3.platform.ops.dashboards import (
    PENDING_PANELS, GrafanaPushError, panel_queries, push_dashboards, serving_dashboard, training_dashboard,
    write_dashboards)
from k3.platform.ops.prometheus import PrometheusClient, PrometheusError
from k3.platform.ops.report import write_report

REPO = Path(__file__).resolve().parents[2]
TOKEN = "glsa_k3-test-token"


# -- a loopback Grafana: the parts of its HTTP API the push uses, as documented ----------------------
class FakeGrafana(BaseHTTPRequestHandler):
    """GET /api/folders/:uid, POST /api/folders, POST /api/dashboards/db with Bearer-token auth."""

    def log_message(self, *a):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        srv = self.server
        body = None
        if method == "POST":
            if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
                return self._reply(415, {"message": "Content-Type must be application/json"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.seen.append((method, self.path, body))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"message": "invalid API key"})
        if method == "GET" and self.path.startswith("/api/folders/"):
            uid = self.path.rsplit("/", 1)[1]
            if uid in srv.folders:
                return self._reply(200, {"uid": uid, "title": srv.folders[uid]})
            return self._reply(404, {"message": "folder not found"})
        if method == "POST" and self.path == "/api/folders":
            if not isinstance(body.get("title"), str) or set(body) - {"title", "uid", "parentUid"}:
                return self._reply(400, {"message": "bad folder payload"})
            srv.folders[body.get("uid") or "generated"] = body["title"]
            return self._reply(200, {"id": len(srv.folders), "uid": body.get("uid"), "title": body["title"]})
        if method == "POST" and self.path == "/api/dashboards/db":
            d = body.get("dashboard")
            ok = (isinstance(d, dict) and set(body) <= {"dashboard", "folderUid", "folderId", "overwrite", "message"}
                  and isinstance(d.get("title"), str) and isinstance(d.get("uid"), str) and d.get("id") is None
                  and isinstance(d.get("panels"), list) and body.get("overwrite") is True)
            if not ok:
                return self._reply(400, {"message": "bad dashboard payload"})
            if body.get("folderUid") not in srv.folders:
                return self._reply(400, {"message": "folder not found"})
            srv.dashboards[d["uid"]] = body
            return self._reply(200, {"id": len(srv.dashboards), "uid": d["uid"], "url": f"/d/{d['uid']}/{d['uid']}",
                                     "status": "success", "version": 1, "slug": d["uid"]})
        return self._reply(404, {"message": "not found"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


@pytest.fixture
def grafana():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    srv.seen, srv.folders, srv.dashboards = [], {}, {}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_push_creates_the_folder_and_posts_both_dashboards(grafana):
    srv, url = grafana
    replies = push_dashboards(url, TOKEN)
    assert [r["uid"] for r in replies] == ["k3-training", "k3-serving"]
    assert [(m, p) for m, p, _ in srv.seen] == [("GET", "/api/folders/k3"), ("POST", "/api/folders"),
                                               ("POST", "/api/dashboards/db"), ("POST", "/api/dashboards/db")]
    assert srv.dashboards["k3-serving"]["folderUid"] == "k3"
    assert srv.dashboards["k3-training"]["dashboard"]["panels"] == training_dashboard()["panels"]
    push_dashboards(url, TOKEN)  # again: the folder exists, the dashboards are overwritten
    assert [p for _, p, _ in srv.seen[4:]] == ["/api/folders/k3", "/api/dashboards/db", "/api/dashboards/db"]


@pytest.mark.parametrize("token, err, match", [
    ("wrong", GrafanaPushError, r"refused the token \(HTTP 401\)"),
    (None, ValueError, "no Grafana token"),
    ("", ValueError, "no Grafana token"),
])
def test_push_with_a_bad_token_is_one_clear_line(grafana, token, err, match):
    srv, url = grafana
    with pytest.raises(err, match=match) as e:
        push_dashboards(url, token)
    assert "\n" not in str(e.value) and not srv.dashboards
    if token is None or token == "":
        assert srv.seen == [], "no request may leave without a token"


def test_push_to_an_unreachable_grafana_is_one_clear_line():
    with pytest.raises(GrafanaPushError, match="is unreachable") as e:
        push_dashboards(f"http://127.0.0.1:{free_port()}", TOKEN, timeout_s=3)
    assert "\n" not in str(e.value)


# -- the dashboards themselves ---------------------------------------------------------------------------
def test_committed_dashboards_are_what_the_code_builds(tmp_path):
    written = write_dashboards(tmp_path)
    for p in written:
        committed = REPO / "cluster" / "grafana" / p.relative_to(tmp_path)
        assert committed.read_text() == p.read_text(), f"{committed} is stale: run `k3 monitor dashboards`"


def test_dashboards_killed_midway_leave_the_previous_version_whole(tmp_path):
    out = tmp_path / "grafana"
    write_dashboards(out)
    for p in out.glob("*.json"):  # an older version of the dashboards, and a file of the user's own
        p.write_text('{"title": "an older version"}\n')
    (out / "notes.md").write_text("mine\n")
    before = tree_bytes(out)
    run_killed_midway(f"from k3.platform.ops.dashboards import write_dashboards\nwrite_dashboards({str(out)!r})",
                      "pathlib:Path.write_text", after=1)
    assert tree_bytes(out) == before, "the killed writer changed the previous dashboards"
    written = write_dashboards(out)
    assert all(p.parent.exists() and p.read_text() for p in written) and (out / "notes.md").read_text() == "mine\n"
    assert json.loads((out / "k3-training.json").read_text())["title"] == "k3 training"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grafana"], "a killed writer's leftovers stayed"


def test_serving_dashboard_reads_every_serve_metric_by_its_prometheus_name():
    exprs = " ".join(e for _, e in panel_queries(serving_dashboard()))
    suffix = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
    for name, (kind, *_rest) in SERVE_METRICS.items():
        assert f"ray_{name}{suffix[kind]}" in exprs, f"no serving panel reads {name} ({kind})"
    assert "ray_serve_deployment_replica_healthy" in exprs


def test_training_dashboard_has_the_panels_asked_for_or_says_why_not():
    titles = {p["title"] for p in training_dashboard()["panels"]}
    for want in ("Loss", "Tokens per second", "Learning rate", "Gradient norm", "MaxVio per MoE layer",
                 "Quantile Balancing bias spread", "QB histogram bytes", "Coordinator wait", "Expert all-to-all time",
                 "Checkpoint time"):
        assert want in titles
    assert "Worker restarts" in PENDING_PANELS and "Worker restarts" not in titles
    heat = next(p for p in training_dashboard()["panels"] if p["type"] == "heatmap")
    assert heat["options"]["calculate"] is False and heat["targets"][0]["expr"] == "ray_k3_train_maxvio"
    for d in (training_dashboard(), serving_dashboard()):
        assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in d["panels"])


# -- Prometheus and `k3 monitor` bad input ----------------------------------------------------------------
def test_prometheus_unreachable_is_one_clear_line():
    with pytest.raises(PrometheusError, match="is unreachable") as e:
        PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=3).query("up")
    assert "\n" not in str(e.value)


def k3(capsys, monkeypatch, *args, env=None) -> tuple[int, str, str]:
    """`k3 ARGS` in this process (a subprocess would pay torch's import again): (status, stdout, stderr)."""
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_monitor_up_bad_input_starts_nothing(tmp_path, capsys, monkeypatch):
    session = tmp_path / "session"
    session.mkdir()
    state = tmp_path / "mon" / "state.json"
    no_grafana = {"GRAFANA_URL": "", "GRAFANA_TOKEN": ""}
    cases = [
        (["--session-dir", str(tmp_path / "missing")], no_grafana, "does not exist"),
        (["--cluster-state", str(tmp_path / "none.json")], no_grafana, "no k3 cluster recorded"),
        (["--session-dir", str(session), "--grafana-url", "http://127.0.0.1:1"], no_grafana, "GRAFANA_TOKEN is not"),
        (["--session-dir", str(session), "--grafana-url", f"http://127.0.0.1:{free_port()}"],
         {"GRAFANA_TOKEN": TOKEN}, "is unreachable"),  # Prometheus starts, the push fails: it is stopped again
    ]
    for args, env, match in cases:
        rc, _, err = k3(capsys, monkeypatch, "monitor", "up", "--state", str(state), *args, env=env)
        assert rc == 1 and err.count("\n") == 1 and match in err, err
        assert not state.exists()
        left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
        assert left == "", f"left running: {left}"


# -- k3 report ----------------------------------------------------------------------------------------------
def fake_run(root: Path, steps: int, layers: int, with_bias: bool = True) -> Path:
    run = root / "run"
    for n in (steps // 2, steps):  # two checkpoints: the report reads the later one
        hist = [{"step": s, "loss": 8.0 / s, "maxvio": [0.5 / s + 0.1 * i for i in range(layers)], "tokens": 512,
                 "step_s": 0.5, "wait_s": 0.01, "all_to_all_s": 0.02,
                 **({"bias_spread": [0.01 * s] * layers} if with_bias else {})} for s in range(1, n + 1)]
        d = run / f"checkpoint_{n:06d}" / "k3"
        d.mkdir(parents=True)
        torch.save({"step": n, "history": hist, "config": {"preset": "k3-tiny", "num_workers": 2,
                                                           "balance": {"method": "quantile_hist"}}}, d / "state.pt")
    return run


@pytest.mark.parametrize("with_bias, pngs", [(True, 4), (False, 3)])
def test_report_draws_the_latest_history(tmp_path, with_bias, pngs):
    page = write_report(fake_run(tmp_path, steps=12, layers=3, with_bias=with_bias))
    text = page.read_text()
    assert text.count("<img ") == pngs and "final loss</th><td>0.6667" in text and "quantile_hist" in text
    for name in ["loss.png", "tokens_per_s.png", "maxvio.png"] + (["bias_spread.png"] if with_bias else []):
        assert (page.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_bad_run_dir_is_one_clear_line(tmp_path, capsys, monkeypatch):
    rc, _, err = k3(capsys, monkeypatch, "report", str(tmp_path))
    assert rc == 1 and err.count("\n") == 1 and "no checkpoint with k3/state.pt" in err
