"""k3's app behind Ray Serve's direct ingress with HAProxy (`direct_ingress_env`, `k3 cluster up
--haproxy`): a Ray of its own started with that environment, the app deployed on it by a driver
as `serve run` would, then requests on Serve's HTTP port, where HAProxy (not Serve's Python proxy)
listens and forwards each request to the ingress replica's own HTTP server."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys

import httpx
import psutil
import pytest
from helpers import wait_until

from k3.platform.ops.local_ray import HAPROXY_PORT_ENV, LocalRayHead, direct_ingress_env, free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DEPLOY = """
import sys
from ray import serve
from k3.serve.builder import build_app
port = int(sys.argv[1])
one = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(build_app({"model_id": "k3", "model": {"preset": "k3-tiny", "seed": 0},
                     "engine": {"max_num_seqs": 4, "cache_memory_bytes": 32 * 2**20, "compile_decode": False},
                     "llm": one, "ingress": one}), name="k3", route_prefix="/")
"""

STATS = """
import json
from ray import serve
print(json.dumps(serve.get_deployment_handle("LLMServer", app_name="k3").stats.remote().result(timeout_s=60)))
"""


def test_the_env_gives_each_ray_its_own_haproxy_ports_and_refuses_a_bad_drain():
    a, b = direct_ingress_env(), direct_ingress_env(haproxy=False, drain_s=0)
    assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in a
    assert len({a[name] for name in HAPROXY_PORT_ENV}) == len(HAPROXY_PORT_ENV)  # none of 9101, 8404, 8500, 9500 fixed
    assert b == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="drain_s"):
            direct_ingress_env(drain_s=bad)


def _listener(port: int) -> psutil.Process | None:
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    return None


def _ok(client: httpx.Client, path: str) -> bool:
    try:
        return client.get(path).status_code == 200
    except httpx.TransportError:  # nothing listens yet
        return False


def _sse_text(lines: list[str]) -> str:
    body = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(ev["choices"][0]["text"] for ev in body)


@contextlib.contextmanager
def _taken(*ports: int):
    """Listeners on Ray's fixed HAProxy-mode ports, as another such Ray on the machine would hold them."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("0.0.0.0", port))
                s.listen()
            except OSError:  # taken already: as good
                pass
        yield


def test_haproxy_forwards_to_the_ingress_replica_streams_refuses_and_aborts(tmp_path):
    # a second Ray with HAProxy on this machine: its HAProxy would fail to bind 9101 and 8404
    with _taken(9101, 8404, 8500, 9500), \
            LocalRayHead(num_cpus=2, workdir=tmp_path, env=direct_ingress_env(drain_s=0)) as head:
        driver_env = {**head.env, "RAY_ADDRESS": head.gcs_address}
        port = free_port()
        out = subprocess.run([sys.executable, "-c", DEPLOY, str(port)], env=driver_env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=120) as client:
            wait_until(lambda: _ok(client, "/health"), 120, "the app answers on Serve's port", every_s=1)
            # Serve's HTTP port is HAProxy's, not the Python proxy's
            listener = _listener(port)
            assert listener is not None and listener.name() == "haproxy", listener
            health = client.get("/-/healthz")  # what KubeRay's probes and load balancers ask Serve's port
            assert health.status_code == 200, health.text

            body = {"model": "k3", "prompt": "def main():", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert _sse_text(lines) == whole.json()["choices"][0]["text"]

            bad = client.post("/v1/completions", json={**body, "max_tokens": -1})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

            # a client that leaves mid-answer: the request is aborted in the replica's engine
            long = {**body, "max_tokens": 3000, "stream": True}
            with client.stream("POST", "/v1/completions", json=long) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 4:
                        break  # the connection closes here, 3,000 tokens short

            def stats() -> dict:
                p = subprocess.run([sys.executable, "-c", STATS], env=driver_env, capture_output=True, text=True,
                                   timeout=120)
                assert p.returncode == 0, p.stderr[-2000:]
                return json.loads(p.stdout.strip().splitlines()[-1])

            wait_until(lambda: stats()["running"] == 0, 60, "the abandoned request aborted", every_s=1)
            assert stats()["steps"] < 3000  # aborted, not decoded to the end
            # and it keeps answering
            assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == \
                whole.json()["choices"][0]["text"]

        # Serve's request counts, which k3's dashboards and alerts read, now come from HAProxy's logs
        metrics = f"http://127.0.0.1:{head.ports['metrics-export-port']}/metrics"

        def counted() -> set[str]:
            text = httpx.get(metrics, timeout=30).text
            return {line.split('status_code="')[1][:3] for line in text.splitlines()
                    if line.startswith("ray_serve_num_http_requests_total{") and 'status_code="' in line}

        wait_until(lambda: {"200", "400"} <= counted(), 90, "HAProxy's request counts exported", every_s=2)
