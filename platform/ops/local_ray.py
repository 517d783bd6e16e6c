"""A private Ray head on loopback: `ray start --head --block` as a child process, ended by its PID.

    with LocalRayHead(num_cpus=2) as head:
        rc = head.submit_job(["python", "jobs/pretrain.py", ...], working_dir=repo)

    # an autoscaling laptop cluster (Ray's fake multi-node provider; worker nodes come and go)
    with LocalRayHead(autoscaling_config="cluster/local-autoscaling.yaml") as head: ...

    init_local_ray(num_cpus=2)   # in-process: a private `ray.init` on loopback

Used by `make demo` and by the tests that exercise the CLI path a user takes (`ray job submit`
against a cluster started with `ray start`). Three things make that path reliable on a shared
machine, and this module does all three:

- every port the node opens is chosen free on 127.0.0.1 (GCS, dashboard, dashboard agent HTTP and
  gRPC, runtime-env agent, metrics export, node and object managers, Ray client, and the
  autoscaler's and the dashboard's own metrics servers, which Ray takes from the environment).
  Ray's defaults are fixed numbers (the agent's HTTP port is 52365, the metrics servers 44217 and
  44227): a second Ray on the machine, such as a test session's `ray.init()`, already holds them,
  the new agent fails to bind and every job submission answers "No available agent", and a
  metrics server that fails to bind leaves Prometheus scraping the other cluster under this
  one's service-discovery entry. The head is ready only once both metrics servers answer with
  this cluster's SessionName;
- the cluster gets its own auth token (Ray clusters require token auth by default) and stays on
  loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from swapping 127.0.0.1 for the
  machine's outward address);
- it is ready only when the job server answers and the head node's job agent accepts
  connections; a submission that still races the agent's registration is retried.

Never `ray stop`: it ends every Ray process on the machine. `ray start --block` tears down
what it started when its process group gets SIGTERM, which is what `stop()` sends; the
autoscaler's fake worker nodes are started by the head's monitor inside that process group and
go with it. Ray 2.60's `ray start` first drains its node on SIGTERM, waiting up to
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s by default) for the node to go idle, so that a
Kubernetes pod's Serve replicas can move elsewhere; a head that hosts Serve's detached actors
never goes idle, and the whole cluster stopping has nowhere to move them to: its stop took 34 s
with a Serve app up against 4 s without the drain (docs/benchmarks.md). The head's environment
sets the timeout to 0 unless the caller's environment sets it.

The `ray` CLI runs as `python -m ray.scripts.scripts` under this interpreter, so the cluster's
processes import the same k3 as the caller (a venv that layers another venv's packages has no
`ray` script of its own, and the other venv's script would import that venv's k3).
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from .process_group import group_alive, recorded_group_alive, start_time, stop_group, valid_pid

NO_AGENT = "No available agent"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 instead of the outward address
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # how long `ray start` drains its node on SIGTERM


def init_local_ray(**kwargs):
    """`ray.init` of a fresh private single-node Ray on 127.0.0.1 (never a `ray start` cluster found
    on the machine), without the dashboard unless asked. Ray on Linux swaps 127.0.0.1 for the
    machine's outward address (torch's rendezvous included) unless LOOPBACK_ENV is "0": it is set
    here for raylet and workers, and in Ray's already-imported constants for this driver."""
    os.environ[LOOPBACK_ENV] = "0"
    import ray
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    return ray.init(**{"address": "local", "_node_ip_address": "127.0.0.1", "include_dashboard": False, **kwargs})


def json_stdout():
    """This process's stdout, kept for a JSON result; from now on whatever else goes through
    `sys.stdout` goes to stderr. Ray's driver prints the raylet's error messages (a killed actor's
    task retried, as every Serve shutdown gives) to `sys.stdout` whatever `log_to_driver` says, so a
    benchmark run as `python jobs/bench_serve.py > out.json` wrote them above its JSON."""
    out = sys.stdout
    sys.stdout = sys.stderr
    return out


# Ray Serve's direct ingress: each ingress replica answers HTTP on a port of its own; with HAProxy
# (the binary `ray[serve]` installs on Linux) on Serve's HTTP port in front of them, in place of
# the Python proxy. Ports HAProxy mode otherwise binds at fixed numbers on every interface, so a
# second Ray on the machine with it on would fail to start its HAProxy: each gets free ones here.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


# The variable that puts HAProxy on Serve's HTTP port (Ray 2.60's direct ingress), read by every
# Ray process of a node when it starts
HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"


def direct_ingress_env(haproxy: bool = True, drain_s: float | None = None) -> dict[str, str]:
    """The environment a Ray's processes need (set before `ray start` / `ray.init`: the controller,
    proxies and replicas read it when they start) for Serve to answer HTTP from the ingress
    replicas themselves: `haproxy` puts HAProxy on Serve's HTTP port (clients keep the URL),
    without it each ingress replica listens on a port of its own (30000 up, listed in Serve's
    REST API `target_groups`) and Serve's proxy stays on the HTTP port. `drain_s`: how long a
    stopping ingress replica keeps answering before it closes (Ray's default, 30 s, when None)."""
    env = {HAPROXY_FLAG if haproxy else "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    if haproxy:
        ports = _distinct_free_ports(len(HAPROXY_PORT_ENV))
        env |= {name: str(port) for name, port in zip(HAPROXY_PORT_ENV, ports)}
    if drain_s is not None:
        if not 0 <= drain_s < math.inf:  # NaN and infinity too: a replica that never stops draining
            raise ValueError(f"drain_s must be a finite number of seconds >= 0, got {drain_s}")
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(drain_s)
    return env


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


PORT_NAMES = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port",
              "ray-client-server-port")
# The head's two Prometheus endpoints outside the raylet: `ray start` has no flag for them, the
# monitor and the dashboard read these variables when they import Ray's constants.
METRICS_PORT_ENV = {"autoscaler-metrics-port": "AUTOSCALER_METRIC_PORT",
                    "dashboard-metrics-port": "DASHBOARD_METRIC_PORT"}
# What a Ray process logs when the port it was given is taken by then (a port free when it was
# picked can be handed to another process's socket before Ray binds it, on a busy machine): the
# gRPC servers in *.out, the metrics servers (prometheus_client) in dashboard.log / monitor.log.
PORT_TAKEN = ("Failed to start the grpc server", "Address already in use")


def _distinct_free_ports(n: int) -> list[int]:
    """n free ports, all different (two calls to free_port may hand out the same port)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _pick_ports() -> dict[str, int]:
    """One distinct free port per name."""
    names = (*PORT_NAMES, *METRICS_PORT_ENV)
    return dict(zip(names, _distinct_free_ports(len(names))))


def metrics_session(port: int) -> str | None:
    """The SessionName label a Prometheus endpoint on 127.0.0.1:port exports (None: it does not
    answer, or exports no SessionName)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return None
    m = re.search(r'SessionName="([^"]+)"', text)
    return m.group(1) if m else None


class _PortTaken(RuntimeError):
    pass


class LocalRayHead:
    """A Ray cluster on 127.0.0.1 owned by this process: one node, or an autoscaling one.

    Args:
        num_cpus: CPUs the node advertises (taken from the head node type when
            `autoscaling_config` is given).
        workdir: where the token and the node's log go (a fresh temporary folder by default).
        env: extra environment for the node and for every client command run through it.
        start_timeout_s: how long `start()` waits for the job server and the job agent.
        autoscaling_config: a fake multi-node cluster YAML (cluster/local-autoscaling.yaml):
            checked first (k3.platform.ops.cluster.load_autoscaling_config), then a copy pointing
            the provider at this head's GCS port is handed to `ray start --autoscaling-config`.
        autoscaler_update_s: seconds between the autoscaler's passes (Ray's default is 5).
    """

    def __init__(self, num_cpus: int = 2, workdir: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 180.0,
                 autoscaling_config: str | os.PathLike | None = None, autoscaler_update_s: int = 5):
        self.cluster_config = None
        if autoscaling_config is not None:
            from .cluster import load_autoscaling_config

            self.cluster_config = load_autoscaling_config(autoscaling_config)
            head = self.cluster_config["available_node_types"][self.cluster_config["head_node_type"]]
            num_cpus = head["resources"].get("CPU", 0)
        if num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
        self.num_cpus = num_cpus
        self.workdir = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="k3-ray-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.bin = Path(sys.executable).parent
        self.ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
        self.token_path = self.workdir / "ray_token"
        # Ray's temp dir of its own (short: socket paths have a 107-byte limit), so this cluster's
        # session directory (logs, Prometheus service-discovery file) is not shared with another
        # Ray on the machine the way /tmp/ray/session_latest is.
        self.temp_dir = Path(tempfile.gettempdir()) / f"k3r-{secrets.token_hex(4)}"
        self.log_path = self.workdir / "ray.log"
        self.ports = _pick_ports()
        self.env = {**os.environ, **(env or {}), "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                    LOOPBACK_ENV: "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        self.env.pop("RAY_ADDRESS", None)
        self.env.setdefault(DRAIN_ENV, "0")
        if self.cluster_config is not None:
            self.env.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": str(autoscaler_update_s)})
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # the `ray start --block` process, leader of its process group
        self.started: int | None = None  # its start time (process_group.start_time): pid alone may be reused

    @property
    def address(self) -> str:
        """The job server's address, for `ray job submit --address`."""
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    @property
    def gcs_address(self) -> str:
        """The GCS address, for `ray.init(address=...)` and `ray start --address`."""
        return f"127.0.0.1:{self.ports['port']}"

    @property
    def session_dir(self) -> Path:
        """This cluster's Ray session directory (logs, `prom_metrics_service_discovery.json`)."""
        return self.temp_dir / "session_latest"

    def ray(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """Run the `ray` CLI against this cluster's environment (token, loopback)."""
        return subprocess.run([*self.ray_cli, *args], env=self.env, capture_output=True, text=True, **kw)

    def autoscaling_args(self) -> list[str]:
        """Write the cluster YAML with the provider pointed at this head's GCS port (the fake
        provider assumes 6379 otherwise); the head's other resources go to `--resources`."""
        cfg = {**self.cluster_config, "provider": {**self.cluster_config["provider"], "gcs_address": self.gcs_address}}
        path = self.workdir / "autoscaling.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        args = [f"--autoscaling-config={path}"]
        head = dict(cfg["available_node_types"][cfg["head_node_type"]]["resources"])
        head.pop("CPU", None)
        if "GPU" in head:
            args += ["--num-gpus", str(head.pop("GPU"))]
        if "object_store_memory" in head:
            args += ["--object-store-memory", str(head.pop("object_store_memory"))]
        if head:
            args += ["--resources", json.dumps(head)]
        return args

    def start(self, attempts: int = 3) -> "LocalRayHead":
        """Start the head and wait for its job server; a start that loses one of its ports to
        another process is retried on fresh ports (`attempts` starts in all)."""
        if self.proc is not None or self.pid is not None:
            raise RuntimeError("this LocalRayHead is already started")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
        for attempt in range(attempts):
            try:
                return self._start_once()
            except _PortTaken:
                if attempt == attempts - 1:
                    raise
                self.proc = self.pid = self.started = None
                self.ports = _pick_ports()
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _port_taken(self) -> bool:
        """Whether a Ray process of this start (not of an earlier attempt) logged a taken port."""
        new = [d / "logs" for d in self.temp_dir.glob("session_2*") if d not in self._earlier_sessions]
        logs = [f for d in new for f in (*d.glob("*.out"), d / "dashboard.log", d / "monitor.log") if f.is_file()]
        return any(s in f.read_text(errors="replace") for f in logs for s in PORT_TAKEN)

    def _metrics_servers_ours(self) -> bool:
        """Whether the autoscaler's and the dashboard's metrics servers answer with this head's
        SessionName; _PortTaken when one answers with another's (the port went to another Ray)."""
        if not self.session_dir.exists():
            return False
        ours = self.session_dir.resolve().name
        sessions = {name: metrics_session(self.ports[name]) for name in METRICS_PORT_ENV}
        for name, session in sessions.items():
            if session not in (None, ours):
                raise _PortTaken(f"the {name} {self.ports[name]} serves another Ray session ({session})")
        return all(s == ours for s in sessions.values())

    def _start_once(self) -> "LocalRayHead":
        self.token_path.write_text(secrets.token_hex(32))
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self._earlier_sessions = set(self.temp_dir.glob("session_2*"))
        cmd = [*self.ray_cli, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", str(self.num_cpus),
               "--disable-usage-stats", "--temp-dir", str(self.temp_dir)]
        for name in PORT_NAMES:
            cmd += [f"--{name}", str(self.ports[name])]
        if self.cluster_config is not None:
            cmd += self.autoscaling_args()
        env = {**self.env, **{var: str(self.ports[name]) for name, var in METRICS_PORT_ENV.items()}}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.started = start_time(self.pid)
        try:
            self._wait_ready()
        except _PortTaken:  # a head that never came up has nothing to shut down gracefully
            self.stop(grace_s=0, keep_logs=True)
            raise
        except BaseException:  # the error names the session's logs: they stay
            self.stop(keep_logs=True)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.time() + self.start_timeout_s
        agent = self.ports["dashboard-agent-listen-port"]
        jobs_up = False
        while True:
            if self._port_taken():
                raise _PortTaken(f"a Ray process of this head found its port taken; see {self.session_dir / 'logs'}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-2000:])
            # `job list` is also the dashboard's first request, which gives its metrics a SessionName
            jobs_up = jobs_up or (_port_open(agent)
                                  and self.ray("job", "list", "--address", self.address).returncode == 0)
            if jobs_up and self._metrics_servers_ours():
                return
            if time.time() > deadline:
                raise TimeoutError(f"Ray's job server, job agent (port {agent}) or metrics servers "
                                   f"({', '.join(str(self.ports[n]) for n in METRICS_PORT_ENV)}) not up after "
                                   f"{self.start_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(1.0)

    def submit_job(self, entrypoint: list[str], working_dir: str | os.PathLike | None = None,
                   echo: bool = True, retry_s: float = 120.0) -> subprocess.CompletedProcess:
        """`ray job submit` and wait for the job's end; its output is echoed and returned.

        A submission refused because the head's job agent has not registered yet is retried for
        up to `retry_s`; any other failure is returned as it is.
        """
        cmd = [*self.ray_cli, "job", "submit", "--address", self.address]
        if working_dir is not None:
            cmd += ["--working-dir", str(working_dir)]
        cmd += ["--", *entrypoint]
        deadline = time.time() + retry_s
        while True:
            proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=working_dir)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            rc = proc.wait()
            out = "".join(lines)
            if rc == 0 or NO_AGENT not in out or time.time() > deadline:
                return subprocess.CompletedProcess(cmd, rc, out, "")
            time.sleep(3.0)

    def state(self) -> dict:
        """What another process needs to reach or stop this head (`k3 cluster up` saves it)."""
        return {"pid": self.pid, "started": self.started, "workdir": str(self.workdir), "ports": self.ports,
                "num_cpus": self.num_cpus, "autoscaling": self.cluster_config is not None, "address": self.address,
                "gcs_address": self.gcs_address, "token_path": str(self.token_path),
                "session_dir": str(self.session_dir), "temp_dir": str(self.temp_dir)}

    @classmethod
    def from_state(cls, state: dict) -> "LocalRayHead":
        """A handle on a head started by another process (`k3 cluster status|down`): KeyError or
        TypeError when `state` lacks a field or holds one of the wrong type."""
        if state["pid"] is not None and not valid_pid(state["pid"]):
            raise TypeError(f"pid must be a positive integer, got {state['pid']!r}")
        head = cls(num_cpus=state["num_cpus"], workdir=state["workdir"])
        head.ports = dict(state["ports"])
        head.temp_dir = Path(state["temp_dir"])
        if state.get("autoscaling"):
            head.env["RAY_FAKE_CLUSTER"] = "1"
        head.pid = state["pid"]
        head.started = state.get("started")  # None in a state from before k3 recorded it
        return head

    def alive(self) -> bool:
        """Whether any process of the head's process group still runs; for a head rebuilt from a
        state file, only while its PID still names the process that was started."""
        if self.proc is None:
            return recorded_group_alive(self.pid, self.started)
        return group_alive(self.pid, self.proc)

    def stop(self, grace_s: float = 60.0, keep_logs: bool = False) -> None:
        """SIGTERM to the head's process group (SIGKILL to what is left after `grace_s`); a no-op
        when nothing of it runs, or when its PID now names another process. Once the group is gone,
        Ray's temp dir (its session's logs and sockets, ~40 MB) is removed unless `keep_logs`."""
        if self.alive():
            stop_group(self.pid, self.proc, grace_s)
            if not keep_logs and not self.alive():
                shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRayHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
