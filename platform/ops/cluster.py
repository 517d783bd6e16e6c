"""Cluster YAMLs: checked before anything starts, and the local autoscaling cluster's lifecycle.

    cfg = load_autoscaling_config("cluster/local-autoscaling.yaml")   # fake multi-node, laptop
    cfg = load_cloud_config("cluster/aws-gpu.yaml")                    # what `ray up` would run

Both raise ValueError with one line naming the file and the field: an unknown node type, a
resource that is not a non-negative integer, or whatever Ray's own schema check
(`ray.autoscaler._private.util.validate_config` against the wheel's `ray-schema.json`) refuses.
`up()`, `status()` and `down()` are `k3 cluster up|status|down`: one local autoscaling head per
state file (k3.platform.ops.state), stopped by its process group (never `ray stop`), and only while
the PID recorded there is still the head's.
"""
from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path

import yaml

from .state import StateFile, default_cluster_state

FAKE_HEAD_TYPE = "ray.head.default"  # the fake provider names its head node type this way
FAKE_NODES = "k3.platform.ops.fake_nodes.FakeNodes"  # the fake provider, one log monitor per machine
# Ray keeps resource quantities as int64 counts of 1/10000 units (FixedPoint): more does not fit
MAX_RESOURCE = (2**63 - 1) // 10_000


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such cluster YAML")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a mapping at the top level, got {type(cfg).__name__}")
    return cfg


def check_node_types(cfg: dict, where: str) -> None:
    """Node types named consistently, resources integers, worker bounds ordered."""
    types = cfg.get("available_node_types")
    if not isinstance(types, dict) or not types:
        raise ValueError(f"{where}: available_node_types must name at least one node type")
    head = cfg.get("head_node_type")
    if not isinstance(head, str) or head not in types:
        raise ValueError(f"{where}: head_node_type {head!r} is not a node type; known: {sorted(types)}")
    for name, spec in types.items():
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: available_node_types.{name} must be a mapping")
        resources = spec.get("resources") or {}
        if not isinstance(resources, dict):
            raise ValueError(f"{where}: available_node_types.{name}.resources must be a mapping, got {resources!r}")
        for res, v in resources.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: available_node_types.{name}.resources.{res} must be a non-negative "
                                 f"integer, got {v!r}")
            if v > MAX_RESOURCE:
                raise ValueError(f"{where}: available_node_types.{name}.resources.{res} must be at most "
                                 f"{MAX_RESOURCE} (what Ray can hold), got {v}")
        lo, hi = spec.get("min_workers", 0), spec.get("max_workers", cfg.get("max_workers", 0))
        for key, v in (("min_workers", lo), ("max_workers", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: available_node_types.{name}.{key} must be a non-negative integer, "
                                 f"got {v!r}")
        if lo > hi:
            raise ValueError(f"{where}: available_node_types.{name}: min_workers {lo} > max_workers {hi}")


def ray_validate(cfg: dict, where: str) -> None:
    """Ray's own check (jsonschema against ray-schema.json plus its cross-field rules), one line."""
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    try:
        validate_config(cfg)
    except jsonschema.ValidationError as e:
        field = ".".join(str(x) for x in e.absolute_path) or "<top level>"
        raise ValueError(f"{where}: {field}: {' '.join(e.message.split())} (Ray's cluster schema)") from None
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None


def load_autoscaling_config(path: str | os.PathLike) -> dict:
    """The local fake multi-node cluster YAML, checked; returned as `ray start` will read it."""
    where = str(path)
    cfg = read_yaml(path)
    provider = cfg.get("provider") or {}
    if not isinstance(provider, dict):
        raise ValueError(f"{where}: provider must be a mapping (type: fake_multinode), got {provider!r}")
    kind = (provider.get("type"), provider.get("module"))
    if kind not in (("fake_multinode", None), ("external", FAKE_NODES)):
        raise ValueError(f"{where}: provider must be Ray's fake multi-node provider (type: fake_multinode) or k3's "
                         f"(type: external, module: {FAKE_NODES}), got type {kind[0]!r}, module {kind[1]!r}")
    check_node_types(cfg, where)
    if cfg["head_node_type"] != FAKE_HEAD_TYPE:
        raise ValueError(f"{where}: head_node_type must be {FAKE_HEAD_TYPE!r} (the fake provider's head), "
                         f"got {cfg['head_node_type']!r}")
    head_cpu = (cfg["available_node_types"][FAKE_HEAD_TYPE].get("resources") or {}).get("CPU", 0)
    if head_cpu < 1:
        raise ValueError(f"{where}: available_node_types.{FAKE_HEAD_TYPE}.resources.CPU must be >= 1")
    speed = cfg.get("upscaling_speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 <= speed < math.inf:
        raise ValueError(f"{where}: upscaling_speed must be a finite number >= 0, got {speed!r}")
    # The monitor reads the file as given: Ray's check on the raw file is the one that matters.
    ray_validate(cfg, where)
    return cfg


def load_cloud_config(path: str | os.PathLike) -> dict:
    """A cloud cluster YAML (`ray up`), checked the way `ray up` checks it: Ray fills in its
    provider's defaults (`prepare_config`), then validates against its schema."""
    return check_cloud_config(read_yaml(path), str(path))


def check_cloud_config(cfg: dict, where: str) -> dict:
    """`load_cloud_config`'s checks of a config already read; returns it as Ray fills it in."""
    from ray.autoscaler._private.util import prepare_config

    check_node_types(cfg, where)
    try:
        full = prepare_config(copy.deepcopy(cfg))
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None
    ray_validate(full, where)
    return full


# -- the local autoscaling cluster: k3 cluster up | status | down --------------------------------
def state_file(state_path: str | os.PathLike | None = None) -> StateFile:
    """The cluster's state file: `state_path`, or the default (k3.platform.ops.state)."""
    return StateFile(default_cluster_state() if state_path is None else state_path, "k3 cluster", "k3 cluster down")


def up(config: str | os.PathLike, state_path: str | os.PathLike | None = None, env: dict | None = None,
       autoscaler_update_s: int = 5, grafana_url: str | None = None, workdir: str | os.PathLike | None = None) -> dict:
    """Start the local autoscaling head (returns its state, also written to `state_path`); refused
    while a head recorded there still runs. `workdir` holds the head's token and log (default: a
    new folder beside the state file).

    The Ray dashboard reads where Prometheus and Grafana are when it starts, and Prometheus can
    only scrape a session that exists: so the head is started pointing at a port reserved here
    for Prometheus (`prometheus_port` in the state), on which `k3 monitor up` starts it later."""
    from k3.platform.ops.local_ray import LocalRayHead, free_port

    # the token path in the state must not depend on the cwd
    file = state_file(None if state_path is None else Path(state_path).resolve())
    old = file.load(LocalRayHead.from_state)
    if old is not None and old.alive():
        raise ValueError(f"a k3 cluster already runs (pid {old.pid}, {old.address}): `k3 cluster down` first")
    file.prepare()  # before the head starts: it must not run unrecorded
    prometheus_port = free_port()
    env = {**(env or {}), "RAY_PROMETHEUS_HOST": f"http://127.0.0.1:{prometheus_port}",
           **({"RAY_GRAFANA_HOST": grafana_url} if grafana_url else {})}
    head = LocalRayHead(autoscaling_config=config, workdir=workdir or file.path.parent / f"head-{int(time.time())}",
                        env=env, autoscaler_update_s=autoscaler_update_s)
    head.start()  # stops what it started if it does not come up
    state = {**head.state(), "prometheus_port": prometheus_port}
    try:
        file.write(state)
    except BaseException:
        head.stop()
        raise
    return state


def recorded_head(state_path: str | os.PathLike | None = None):
    """A handle on the head `k3 cluster up` recorded in state_path (ValueError when there is none)."""
    from k3.platform.ops.local_ray import LocalRayHead

    file = state_file(state_path)
    head = file.load(LocalRayHead.from_state)
    if head is None:
        raise ValueError(f"no k3 cluster recorded in {file.path}: start one with `k3 cluster up`")
    return head


def running_head(state_path: str | os.PathLike | None = None):
    """`recorded_head`, refused (ValueError) when it no longer runs."""
    head = recorded_head(state_path)
    if not head.alive():
        raise ValueError(f"the k3 cluster recorded in {state_file(state_path).path} (pid {head.pid}) is not running "
                         f"(the state is stale): `k3 cluster up` starts one")
    return head


def shell_env(state_path: str | os.PathLike | None = None) -> str:
    """`export` lines that point Ray's own CLIs and drivers at the recorded cluster: `ray job submit`
    reads RAY_API_SERVER_ADDRESS, `serve deploy`/`serve status` RAY_DASHBOARD_ADDRESS, `ray.init`
    and `serve run` RAY_ADDRESS; all of them the token; LOOPBACK_ENV keeps a driver on 127.0.0.1 as the
    cluster is. With these, nothing falls back to Ray's
    default ports, where another cluster on the machine may answer."""
    import shlex

    from k3.platform.ops.local_ray import LOOPBACK_ENV

    head = running_head(state_path)
    values = {"RAY_ADDRESS": head.gcs_address, "RAY_API_SERVER_ADDRESS": head.address,
              "RAY_DASHBOARD_ADDRESS": head.address, "RAY_AUTH_MODE": "token",
              "RAY_AUTH_TOKEN_PATH": str(head.token_path), LOOPBACK_ENV: "0"}
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items())


def status(state_path: str | os.PathLike | None = None) -> str:
    """`ray status` of the recorded cluster (nodes by type, pending demand)."""
    head = running_head(state_path)
    out = head.ray("status", "--address", head.gcs_address, timeout=60)
    if out.returncode != 0:
        last = ((out.stderr or out.stdout).strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"ray status failed: {last}")
    return f"head pid {head.pid}, dashboard {head.address}, GCS {head.gcs_address}\n{out.stdout}"


def down(state_path: str | os.PathLike | None = None, force: bool = False) -> str:
    """Stop the recorded cluster's process group and forget it; what happened, in words ("stopped",
    "was not running", ...). Nothing recorded is not an error (a second `down` answers like
    `k3 monitor down`'s); a stale state is removed without signalling anything; `force` removes a
    file that is not a state file (k3.platform.ops.state.StateFile.stop)."""
    from k3.platform.ops.local_ray import LocalRayHead

    return state_file(state_path).stop(LocalRayHead.from_state, force)
