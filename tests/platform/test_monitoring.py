"""Dashboards as code, the Grafana push (grafana-client against a loopback server that checks
Grafana's documented HTTP API), run reports, and the monitor's bad-input paths. The dashboards'
queries against a real Prometheus and cluster: test_autoscaling_monitoring.py."""
from __future__ import annotations

import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from helpers import run_killed_midway, tree_bytes
from k3.platform.ops.cli import main
from k3.platform.ops.local_ray import free_port
from k3.platform.ops.metrics import SERVE_METRICS, TRAIN_GAUGES, TRAIN_LAYER_GAUGES, TrainMetrics
from k3.platform.ops.dashboards import (
    RAY_DASHBOARDS, GrafanaPushError, cluster_dashboard, k3_dashboards, panel_queries, push_dashboards,
    serving_dashboard, training_dashboard, write_dashboards)
from k3.platform.ops.panels import CLUSTER_PANELS, SERVING_PANELS, TRAINING_PANELS
from k3.platform.ops.prometheus import PrometheusClient, PrometheusError, scrape_config

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


def test_push_creates_the_folders_and_posts_every_dashboard(grafana):
    srv, url = grafana
    replies = push_dashboards(url, TOKEN)
    ray_uids = [json.loads((REPO / "cluster" / "grafana" / "ray" / n).read_text())["uid"] for n in RAY_DASHBOARDS]
    assert [r["uid"] for r in replies] == ["k3-training", "k3-serving", "k3-cluster", *ray_uids]
    posts = ["/api/dashboards/db"]
    assert [(m, p) for m, p, _ in srv.seen] == [
        ("GET", "/api/folders/k3"), ("POST", "/api/folders"), *[("POST", p) for p in posts * 3],
        ("GET", "/api/folders/ray"), ("POST", "/api/folders"), *[("POST", p) for p in posts * len(ray_uids)]]
    assert srv.folders == {"k3": "k3", "ray": "Ray"}
    assert srv.dashboards["k3-serving"]["folderUid"] == "k3" and srv.dashboards[ray_uids[0]]["folderUid"] == "ray"
    assert srv.dashboards["k3-training"]["dashboard"]["panels"] == training_dashboard()["panels"]
    n = len(srv.seen)
    push_dashboards(url, TOKEN)  # again: the folders exist, the dashboards are overwritten
    assert [m for m, _, _ in srv.seen[n:]].count("GET") == 2 and ("POST", "/api/folders", None) not in srv.seen[n:]


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


@pytest.mark.parametrize("url", ["grafana:3000", "localhost:3000", "ftp://grafana"])
def test_push_to_a_url_without_http_is_refused_naming_the_flag(url):
    # grafana:3000 used to reach requests and come back as "unreachable: InvalidSchema"
    with pytest.raises(ValueError, match=r"--grafana-url must start with http:// or https://") as e:
        push_dashboards(url, TOKEN)
    assert "\n" not in str(e.value)


def test_monitor_dashboards_writes_under_the_checkout_from_any_directory(tmp_path, capsys, monkeypatch):
    import k3.platform.ops.alerts as alerts
    import k3.platform.ops.dashboards as dashboards

    written = []
    monkeypatch.setattr(dashboards, "write_dashboards", lambda out: written.append(Path(out)) or [])
    monkeypatch.setattr(alerts, "write_alerts", lambda out, config: written.append(Path(out)) or [])
    monkeypatch.chdir(tmp_path)  # `cd /tmp && k3 monitor dashboards` made /tmp/cluster/{grafana,prometheus}
    rc, _, err = k3(capsys, monkeypatch, "monitor", "dashboards")
    assert rc == 0, err
    assert written == [REPO / "cluster" / "grafana", REPO / "cluster" / "prometheus"]


@pytest.mark.parametrize("seconds, written", [(5, "5s"), (0.5, "500ms"), (0.001, "1ms"), (90.25, "90250ms")])
def test_scrape_intervals_are_written_as_prometheus_durations(seconds, written):
    # "0.5s" is not a duration Prometheus reads: it refused the config after it had started
    cfg = scrape_config("/session", seconds)
    assert cfg["global"]["scrape_interval"] == cfg["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] \
        == written


# -- the dashboards themselves ---------------------------------------------------------------------------
def test_committed_dashboards_are_what_the_code_builds(tmp_path):
    written = write_dashboards(tmp_path)
    assert len([p for p in written if p.parent.name == "ray"]) == len(RAY_DASHBOARDS) == 5
    for p in written:
        committed = REPO / "cluster" / "grafana" / p.relative_to(tmp_path)
        assert committed.read_text() == p.read_text(), f"{committed} is stale: run `k3 monitor dashboards`"


def test_rays_own_dashboards_keep_rays_uids_for_the_ray_dashboards_metrics_tab():
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_default_grafana_dashboard

    default = json.loads((REPO / "cluster" / "grafana" / "ray" / "default_grafana_dashboard.json").read_text())
    assert default["uid"] == generate_default_grafana_dashboard()[1] == "rayDefaultDashboard"
    providers = {p["folderUid"]: p["options"]["path"] for p in
                 yaml.safe_load((REPO / "cluster/grafana/provisioning/dashboards/k3.yaml").read_text())["providers"]}
    assert providers == {"k3": "/etc/grafana/dashboards/k3", "ray": "/etc/grafana/dashboards/ray"}


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
    for ray_metric in ("ray_serve_deployment_replica_healthy", "ray_serve_num_http_requests_total",
                       "ray_serve_deployment_queued_queries"):
        assert ray_metric in exprs


def exported_train_metrics() -> set[str]:
    """Every k3_train_* metric name the code creates (rank 0's gauges, the coordinator's)."""
    names = set()
    for f in (REPO / "platform").rglob("*.py"):
        names |= set(re.findall(r'"(k3_train_[a-z_]+)"', f.read_text()))
    names |= {f"k3_train_{k}" for k in (*TRAIN_GAUGES, *TRAIN_LAYER_GAUGES)}
    return names


def test_every_exported_training_metric_is_drawn():
    exprs = " ".join(e for _, e in panel_queries(training_dashboard()))
    names = exported_train_metrics()
    assert {"k3_train_step", "k3_train_maxvio_mean", "k3_train_qb_maxvio", "k3_train_restarts"} <= names
    undrawn = sorted(n for n in names if not re.search(rf"\bray_{n}(_total)?\b", exprs))
    assert not undrawn, f"exported but drawn nowhere: {undrawn}"


def test_dashboards_have_what_an_operator_looks_at_first():
    titles = {d["uid"]: {p["title"] for p in d["panels"]} for d in k3_dashboards()}
    assert {"Loss", "Tokens per second", "MaxVio per MoE layer", "Router bias spread", "Worker restarts",
            "Checkpoints", "Step"} <= titles["k3-training"]
    assert {"HTTP requests by status code", "HTTP error ratio", "Queue lengths", "Handoff retries",
            "Replicas per deployment"} <= titles["k3-serving"]
    assert {"Nodes", "CPU utilisation per node", "GPU utilisation per node", "Memory per node",
            "GPU memory per node", "Object store", "Worker failures"} <= titles["k3-cluster"]
    heat = next(p for p in training_dashboard()["panels"] if p["type"] == "heatmap")
    assert heat["options"]["calculate"] is False and heat["targets"][0]["expr"] == "ray_k3_train_maxvio"
    for d in k3_dashboards():
        assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in d["panels"])
    assert {p.title for p in CLUSTER_PANELS if p.needs == "gpu"} == {"GPU utilisation per node",
                                                                     "GPU memory per node"}
    assert all(p.needs is None for p in (*TRAINING_PANELS, *SERVING_PANELS))


def test_a_query_with_its_own_unit_goes_on_the_right_axis():
    ckpt = next(p for p in training_dashboard()["panels"] if p["title"] == "Checkpoints")
    (override,) = ckpt["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byFrameRefID", "options": "B"}
    assert {"id": "unit", "value": "s"} in override["properties"]
    assert ckpt["targets"][1]["expr"] == "ray_k3_train_checkpoint_s"
    assert cluster_dashboard()["uid"] == "k3-cluster"


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
    bad_rules = tmp_path / "rules.yaml"
    bad_rules.write_text("groups:\n- name: k3\n  rules:\n  - alert: X\n    expr: avg_over_time(up[0m])\n")
    no_grafana = {"GRAFANA_URL": "", "GRAFANA_TOKEN": ""}
    cases = [
        (["--session-dir", str(tmp_path / "missing")], no_grafana, "does not exist"),
        (["--cluster-state", str(tmp_path / "none.json")], no_grafana, "no k3 cluster recorded"),
        (["--session-dir", str(session), "--grafana-url", "http://127.0.0.1:1"], no_grafana, "GRAFANA_TOKEN is not"),
        (["--session-dir", str(session), "--grafana-url", "grafana:3000"], {"GRAFANA_TOKEN": TOKEN},
         "--grafana-url must start with http://"),
        (["--session-dir", str(session), "--rules", str(bad_rules)], no_grafana,
         "promtool check rules"),  # Prometheus itself said only "error loading config"
        (["--session-dir", str(session), "--grafana-url", f"http://127.0.0.1:{free_port()}"],
         {"GRAFANA_TOKEN": TOKEN}, "is unreachable"),  # Prometheus starts, the push fails: it is stopped again
    ]
    for args, env, match in cases:
        rc, _, err = k3(capsys, monkeypatch, "monitor", "up", "--state", str(state), *args, env=env)
        assert rc == 1 and err.count("\n") == 1 and match in err, err
        assert not state.exists()
        left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
        assert left == "", f"left running: {left}"


# -- training gauges stay exported between steps -------------------------------------------------------
def scrape(ray) -> str:
    import urllib.request

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    with urllib.request.urlopen(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.ray
def test_training_gauges_outlive_ray_s_gauge_expiry_and_restarts_are_counted(ray_local):
    """Ray drops a gauge not set again within two export intervals (20 s here): TrainMetrics keeps
    the last step's values exported between steps, where a gauge set once is gone."""
    import time

    ray = ray_local

    @ray.remote(num_cpus=0)
    class Rank0:
        def __init__(self):
            from ray.util.metrics import Gauge

            from k3.platform.ops.metrics import TrainMetrics

            self.m = TrainMetrics()
            self.once = Gauge("k3_test_set_once", "a gauge set once, as the trainer's were between reports")

        def step(self):
            self.m.update({"step": 7, "loss": 2.5, "maxvio": [0.0, 0.75], "not_a_metric": 1.0, "lr": "bad"})
            self.m.count_restart()
            self.once.set(1.0)

    actor = Rank0.remote()
    ray.get(actor.step.remote())
    ttl_s = 2 * max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    deadline = time.time() + 60
    while "ray_k3_train_restarts_total" not in (text := scrape(ray)) and time.time() < deadline:
        time.sleep(2)
    assert "ray_k3_test_set_once" in text  # exported at first: the control is live
    time.sleep(ttl_s + 6)  # no step in between
    text = scrape(ray)
    ray.kill(actor)
    assert "ray_k3_test_set_once{" not in text, "Ray kept a gauge set once: the expiry this guards against is gone"
    assert re.search(r'ray_k3_train_loss\{[^}]*\} 2\.5', text)
    assert re.search(r'ray_k3_train_step\{[^}]*\} 7\.0', text)
    assert re.search(r'ray_k3_train_maxvio\{[^}]*layer="0"[^}]*\} 0\.0', text)  # exactly zero is a value
    assert re.search(r'ray_k3_train_restarts_total\{[^}]*\} 1\.0', text)
    assert "ray_k3_train_lr{" not in text and "not_a_metric" not in text


def test_train_metrics_refresh_must_be_positive():
    with pytest.raises(ValueError, match="refresh_s must be > 0"):
        TrainMetrics(refresh_s=0)
