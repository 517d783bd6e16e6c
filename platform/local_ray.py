"""A private Ray head on loopback: `ray start --head --block` as a child process, ended by its PID.

    with LocalRayHead(num_cpus=2) as head:
        rc = head.submit_job(["python", "jobs/pretrain.py", ...], working_dir=repo)

    init_local_ray(num_cpus=2)   # in-process: a private `ray.init` on loopback

Used by `make demo` and by the tests that exercise the CLI path a user takes (`ray job submit`
against a cluster started with `ray start`). Three things make that path reliable on a shared
machine, and this module does all three:

- every port the node opens is chosen free on 127.0.0.1 (GCS, dashboard, dashboard agent HTTP and
  gRPC, runtime-env agent, metrics export, node and object managers, Ray client). Ray's defaults
  are fixed numbers (the agent's HTTP port is 52365): a second Ray on the machine, such as a
  test session's `ray.init()`, already holds them, the new agent fails to bind, and every job
  submission then answers "No available agent";
- the cluster gets its own auth token (Ray clusters require token auth by default) and stays on
  loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from swapping 127.0.0.1 for the
  machine's outward address);
- it is ready only when the job server answers and the head node's job agent accepts
  connections; a submission that still races the agent's registration is retried.

Never `ray stop`: it ends every Ray process on the machine. `ray start --block` tears down
what it started when its process group gets SIGTERM, which is what `stop()` sends.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NO_AGENT = "No available agent"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 instead of the outward address


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


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalRayHead:
    """A one-node Ray cluster on 127.0.0.1 owned by this process.

    Args:
        num_cpus: CPUs the node advertises.
        workdir: where the token and the node's log go (a fresh temporary folder by default).
        env: extra environment for the node and for every client command run through it.
        start_timeout_s: how long `start()` waits for the job server and the job agent.
    """

    def __init__(self, num_cpus: int = 2, workdir: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 180.0):
        if num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
        self.num_cpus = num_cpus
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="k3-ray-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.bin = Path(sys.executable).parent
        self.token_path = self.workdir / "ray_token"
        self.log_path = self.workdir / "ray.log"
        self.ports = {name: free_port() for name in (
            "port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port",
            "ray-client-server-port")}
        self.env = {**os.environ, **(env or {}), "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                    LOOPBACK_ENV: "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        self.env.pop("RAY_ADDRESS", None)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The job server's address, for `ray job submit --address`."""
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    @property
    def gcs_address(self) -> str:
        """The GCS address, for `ray.init(address=...)` and `ray start --address`."""
        return f"127.0.0.1:{self.ports['port']}"

    def ray(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """Run the `ray` CLI against this cluster's environment (token, loopback)."""
        return subprocess.run([str(self.bin / "ray"), *args], env=self.env, capture_output=True, text=True, **kw)

    def start(self) -> "LocalRayHead":
        if self.proc is not None:
            raise RuntimeError("this LocalRayHead is already started")
        self.token_path.write_text(secrets.token_hex(32))
        cmd = [str(self.bin / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", str(self.num_cpus),
               "--disable-usage-stats"]
        for name, port in self.ports.items():
            cmd += [f"--{name}", str(port)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.time() + self.start_timeout_s
        agent = self.ports["dashboard-agent-listen-port"]
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-2000:])
            if _port_open(agent) and self.ray("job", "list", "--address", self.address).returncode == 0:
                return
            if time.time() > deadline:
                raise TimeoutError(f"Ray's job server or job agent (port {agent}) not up after "
                                   f"{self.start_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(1.0)

    def submit_job(self, entrypoint: list[str], working_dir: str | os.PathLike | None = None,
                   echo: bool = True, retry_s: float = 120.0) -> subprocess.CompletedProcess:
        """`ray job submit` and wait for the job's end; its output is echoed and returned.

        A submission refused because the head's job agent has not registered yet is retried for
        up to `retry_s`; any other failure is returned as it is.
        """
        cmd = [str(self.bin / "ray"), "job", "submit", "--address", self.address]
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

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "LocalRayHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
