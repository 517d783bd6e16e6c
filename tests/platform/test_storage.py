"""Where a run reads its data and writes its checkpoints (k3.platform.train.storage): paths and
URIs checked on the driver, a relative path refused inside a Ray job with the reason, and on a
multi-node cluster a path some node cannot see refused before any training worker starts."""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from k3.platform.ops.local_ray import LocalRayHead, free_port
from k3.platform.train.config import TrainConfig
from k3.platform.train.data import prepare, read_manifest

REPO = Path(__file__).resolve().parents[2]
# What the job supervisor hands a `ray job submit` entrypoint (Ray 2.60: job_supervisor.py).
JOB_ENV = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"},
                                                      "metadata": {"job_submission_id": "raysubmit_test"}})}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("storage")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare(str(root / "corpus"), root / "data", vocab_size=300, seq_len=16, progress=False)
    return root / "data"


@pytest.mark.parametrize("field, flag, relative", [("data", "--data", "data"),
                                                   ("storage_path", "--storage-path", "runs")])
def test_a_relative_path_inside_a_ray_job_is_refused_with_the_reason(data, tmp_path, monkeypatch, field, flag,
                                                                     relative):
    for k, v in JOB_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)  # the job's working directory: Ray's unpacked copy of --working-dir
    (tmp_path / "data").symlink_to(data)  # even where the relative path exists there
    kw = {"data": str(data), "storage_path": str(tmp_path / "runs"), field: relative}
    with pytest.raises(ValueError, match=f"{flag} {relative!r} is relative") as e:
        TrainConfig(**kw).check()
    assert str(tmp_path) in str(e.value) and f'"$PWD/{relative}"' in str(e.value)


def test_outside_a_ray_job_a_relative_path_is_the_current_directory(data, monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.chdir(data.parent)
    cfg = TrainConfig(data=data.name, storage_path="runs").located()
    assert (cfg.data, cfg.storage_path) == (str(data), str(data.parent / "runs"))
    assert cfg.check()["num_sequences"] == read_manifest(data).num_sequences


@pytest.mark.parametrize("scheme", ["file", "local"])
def test_file_and_local_uris_read_the_node_filesystem(data, tmp_path, monkeypatch, scheme):
    for k, v in JOB_ENV.items():  # a URI is never relative, in a job or not
        monkeypatch.setenv(k, v)
    cfg = TrainConfig(data=f"{scheme}://{data}", storage_path=f"{scheme}://{tmp_path}/runs").located()
    assert (cfg.data, cfg.storage_path) == (f"{scheme}://{data}", f"{scheme}://{tmp_path}/runs")
    assert cfg.check()["num_sequences"] == read_manifest(data).num_sequences


@pytest.mark.parametrize("field, location, match", [
    ("data", "ftp://host/data", "--data 'ftp://host/data': pyarrow cannot open"),
    ("storage_path", "mock:///runs", "--storage-path 'mock:///runs': .*mock"),
    ("data", "file:///nowhere/data", "does not exist"),
])
def test_locations_k3_cannot_use_are_refused(data, tmp_path, field, location, match):
    kw = {"data": str(data), "storage_path": str(tmp_path), field: location}
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).check()


# -- a multi-node cluster on one machine, one of whose nodes cannot see a path ------------------------------
def _can_hide_a_path() -> bool:
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        probe = ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "k3-probe", d]
        return subprocess.run(probe, capture_output=True).returncode == 0


# Started the way Ray's fake multi-node provider starts its nodes (`ray start` refuses to join a
# cluster while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every address on 127.0.0.1).
NODE = """
import signal, sys, time
from ray._private.node import Node
from ray._private.parameter import RayParams

gcs, temp_dir, *ports = sys.argv[1:]
names = ["node_manager_port", "object_manager_port", "dashboard_agent_listen_port", "metrics_agent_port",
         "runtime_env_agent_port", "metrics_export_port"]
Node(RayParams(gcs_address=gcs, node_ip_address="127.0.0.1", num_cpus=1, min_worker_port=0, max_worker_port=0,
               temp_dir=temp_dir, **{n: int(p) for n, p in zip(names, ports)}),
     head=False, shutdown_at_exit=True, spawn_reaper=False)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit runs Node's shutdown of its processes
while True:
    time.sleep(1)
"""


@contextmanager
def node_without(head: LocalRayHead, hidden: Path, log: Path):
    """A second node of `head`'s cluster (1 CPU, same machine) that cannot see `hidden`: its Ray
    processes run in a mount namespace of their own with an empty tmpfs over that directory."""
    temp_dir = Path(tempfile.gettempdir()) / f"k3n-{secrets.token_hex(4)}"  # short: socket paths are limited
    args = [head.gcs_address, str(temp_dir), *(str(free_port()) for _ in range(6))]
    script = f"mount -t tmpfs k3-hidden {shlex.quote(str(hidden))} && " \
             f"exec {shlex.join([sys.executable, '-c', NODE, *args])}"
    with open(log, "w") as out:
        proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=head.env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while _alive_nodes(head) < 2:
            assert proc.poll() is None and time.time() < deadline, "the second node did not join:\n" + log.read_text()
            time.sleep(2)
        yield
    finally:
        _end_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the node's process group (`ray start --block` ends what it started), SIGKILL after 60 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()  # reap the leader so the group check sees it gone
            time.sleep(0.5)


def _alive_nodes(head: LocalRayHead) -> int:
    out = head.ray("list", "nodes", "--address", head.address, "--format", "json", "--filter", "state=ALIVE")
    return len(json.loads(out.stdout)) if out.returncode == 0 else 0


@pytest.mark.ray
@pytest.mark.skipif(not _can_hide_a_path(), reason="hiding a path from one node needs `unshare -m` and tmpfs mounts")
def test_a_path_one_node_cannot_see_is_refused_before_any_worker_starts(data, tmp_path):
    hidden, shared = tmp_path / "node-local", tmp_path / "shared"
    for root in (hidden, shared):
        shutil.copytree(data, root / "data")
    with LocalRayHead(num_cpus=1, workdir=tmp_path / "ray") as head, \
            node_without(head, hidden, tmp_path / "node.log"):
        for bad, where in [("--data", hidden / "data"), ("--storage-path", hidden / "runs")]:
            locations = {"--data": shared / "data", "--storage-path": shared / "runs", bad: where}
            entry = ["python", str(REPO / "jobs" / "pretrain.py"), "--data", str(locations["--data"]),
                     "--storage-path", str(locations["--storage-path"]), "--name", "two-nodes", "--num-workers", "2",
                     "--micro-batch", "2", "--steps", "2", "--sample", "0"]
            t = time.time()
            job = head.submit_job(entry, echo=False)
            logs = job.stdout + job.stderr
            assert job.returncode != 0, logs[-3000:]
            line = next((x for x in logs.splitlines() if "is not the same on every node" in x), logs[-3000:])
            assert f"{bad} {str(where)!r} is not the same on every node: 1 of 2 nodes" in line and "s3://" in line
            assert ("--storage-path" if bad == "--data" else "--data") not in line  # the other one passed
            assert "step " not in logs and time.time() - t < 120, "training started"
