"""LocalRayHead: its set-up without starting Ray, and a start that loses a port (the ordinary
start is proven by the job-submit test)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3.platform.ops.local_ray import LocalRayHead

REPO = Path(__file__).resolve().parents[2]


def test_every_port_is_chosen_and_distinct(tmp_path):
    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    ports = list(head.ports.values())
    assert len(set(ports)) == len(ports) == 11  # nine `ray start` flags, two metrics servers
    assert head.env["RAY_AUTH_MODE"] == "token" and head.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "RAY_ADDRESS" not in head.env
    assert head.address.startswith("http://127.0.0.1:") and head.gcs_address.startswith("127.0.0.1:")
    head.stop()  # never started: a no-op


def test_bad_cpu_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match="num_cpus"):
        LocalRayHead(num_cpus=0, workdir=tmp_path)


def test_autoscaling_head_points_the_provider_at_its_own_gcs(tmp_path):
    import yaml

    head = LocalRayHead(autoscaling_config=REPO / "cluster" / "local-autoscaling.yaml", workdir=tmp_path,
                        autoscaler_update_s=1)
    assert head.num_cpus == 1  # the YAML's head node type, not the default
    assert head.env["RAY_FAKE_CLUSTER"] == "1" and head.env["AUTOSCALER_UPDATE_INTERVAL_S"] == "1"
    args = head.autoscaling_args()
    (path,) = [a.split("=", 1)[1] for a in args if a.startswith("--autoscaling-config=")]
    written = yaml.safe_load(open(path))
    assert written["provider"]["gcs_address"] == head.gcs_address  # not the provider's default 6379
    # a second process reaches (and would stop) the same head from its recorded state
    again = LocalRayHead.from_state({**head.state(), "pid": None})
    assert again.gcs_address == head.gcs_address and again.session_dir == head.session_dir
    assert not again.alive()


@pytest.mark.ray  # starts a Ray head
def test_a_port_taken_before_ray_binds_it_is_retried_on_fresh_ports(tmp_path):
    """A port free when it was picked can be taken by another process before Ray binds it (seen
    on a busy machine: the raylet could not start its server and `ray start` timed out)."""
    import socket

    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    taken = head.ports["node-manager-port"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        with head:
            assert head.alive() and head.ports["node-manager-port"] != taken
            assert head.ray("job", "list", "--address", head.address).returncode == 0
    assert not head.alive()


@pytest.mark.parametrize("attempts", [0, -1, 1.5, True])
def test_bad_attempt_count_is_refused_before_anything_starts(tmp_path, attempts):
    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    with pytest.raises(ValueError, match="attempts"):
        head.start(attempts=attempts)
    assert head.pid is None and not head.alive()


def own_sessions(prom_url: str, metric_re: str) -> set[str]:
    """SessionName labels of every series whose name matches metric_re, as a Prometheus sees them."""
    from k3.platform.ops.prometheus import PrometheusClient

    q = f'count by (SessionName) ({{__name__=~"{metric_re}", SessionName!=""}})'
    return {s["metric"]["SessionName"] for s in PrometheusClient(prom_url).query(q)}


def sessions_seen(prom_url: str, timeout_s: float = 120) -> dict[str, set[str]]:
    """SessionNames of all series, the autoscaler's and the dashboard's, once both of those appear."""
    import time

    deadline = time.time() + timeout_s
    while True:
        seen = {kind: own_sessions(prom_url, rx) for kind, rx in (("any", ".+"), ("autoscaler", "autoscaler_.+"),
                                                                  ("dashboard", "ray_dashboard_.+"))}
        if (seen["autoscaler"] and seen["dashboard"]) or time.time() > deadline:
            return seen
        time.sleep(2)


def dashboard_get(address: str, path: str, token_path: str | None = None) -> dict:
    """GET a JSON endpoint (a token-auth Ray dashboard wants `Authorization: Bearer <token>`)."""
    import urllib.request

    headers = {"Authorization": f"Bearer {Path(token_path).read_text().strip()}"} if token_path else {}
    with urllib.request.urlopen(urllib.request.Request(f"{address}{path}", headers=headers), timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.ray
@pytest.mark.slow
def test_two_clusters_at_once_each_prometheus_sees_only_its_own_session(tmp_path, capsys):
    """Every port of a head is its own, the autoscaler's and the dashboard's metrics servers
    included (Ray's fixed 44217 / 44227 were shared: the second head's servers failed to bind and
    its Prometheus scraped the first cluster's series under its own service-discovery file).

    Cluster A is the CLI's (`k3 cluster up`, then `k3 monitor up` on the port the head's
    dashboard was told about); cluster B a bare LocalRayHead with its own Prometheus."""
    from k3.platform.ops.cli import main
    from k3.platform.ops.local_ray import METRICS_PORT_ENV
    from k3.platform.ops.prometheus import Prometheus

    cluster_state, monitor_state = tmp_path / "a" / "cluster.json", tmp_path / "a" / "monitor.json"
    b = LocalRayHead(num_cpus=1, workdir=tmp_path / "b")
    prom_b = Prometheus(b.session_dir, tmp_path / "b-prom", scrape_interval_s=1)
    cli = ["--state", str(cluster_state)]
    try:
        assert main(["cluster", "up", "--config", str(REPO / "cluster" / "local-autoscaling.yaml"), *cli]) == 0
        assert main(["monitor", "up", "--cluster-state", str(cluster_state), "--state", str(monitor_state),
                     "--scrape-interval", "1"]) == 0
        b.start()
        prom_b.start()
        a_state, a_prom = json.loads(cluster_state.read_text()), json.loads(monitor_state.read_text())
        assert a_prom["port"] == a_state["prometheus_port"]  # where A's Ray dashboard was told to look
        health = dashboard_get(a_state["address"], "/api/prometheus_health", a_state["token_path"])
        assert health["result"] is True, health  # the Ray dashboard reaches A's Prometheus
        ports = [a_state["ports"][n] for n in METRICS_PORT_ENV] + [b.ports[n] for n in METRICS_PORT_ENV]
        assert len(set(ports)) == 4
        mine = [Path(a_state["session_dir"]).resolve().name, b.session_dir.resolve().name]
        for session, url in zip(mine, (a_prom["url"], prom_b.url)):
            assert sessions_seen(url) == {"any": {session}, "autoscaler": {session}, "dashboard": {session}}, mine
        rules = {r["name"] for g in dashboard_get(a_prom["url"], "/api/v1/rules")["data"]["groups"]
                 for r in g["rules"]}
        assert "K3NodeDown" in rules  # `k3 monitor up` loads k3's alerting rules
    finally:
        prom_b.stop()
        b.stop()
        capsys.readouterr()
        downs = [(main(["monitor", "down", "--state", str(monitor_state)]), main(["cluster", "down", *cli]))
                 for _ in range(2)]
    out = capsys.readouterr().out.splitlines()
    assert downs == [(0, 0), (0, 0)]
    assert out == ["k3 monitor down: stopped", "k3 cluster down: stopped",
                   "k3 monitor down: was not running", "k3 cluster down: was not running"]
