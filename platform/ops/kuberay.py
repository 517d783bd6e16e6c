"""KubeRay (`ray.io/v1`) manifests: loading with a kind check, and the RayService generated from
the Serve config so the two never disagree.

    k3 cluster rayservice --model-path /mnt/k3/models/k3-small | kubectl apply -f -

`serveConfigV2` is a string holding the Serve config YAML (KubeRay hands it to Serve as it is),
validated here with Ray Serve's own schema (`ray.serve.schema.ServeDeploySchema`) first, then
made fit for the cluster it runs on:
- HTTP on 0.0.0.0:8000 with a proxy on every node: KubeRay's Serve Service sends traffic to the
  pods' port 8000 and its readiness probe asks each worker pod's `localhost:8000/-/healthz`, so a
  proxy bound to the head's loopback (`HeadOnly`, 127.0.0.1, what serve/config.yaml says for a
  laptop) is reachable from nowhere and worker pods never become ready;
- the engine deployments (prefill and decode, or the aggregated one) ask for one GPU each and
  CPUs from a GPU of the worker groups, and at most as many replicas as the groups have GPUs;
- the weights come from a model directory on the shared volume (`--model-path`), not a preset's
  random weights.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from .cluster import read_yaml
from .local_ray import HAPROXY_FLAG

API_VERSION = "ray.io/v1"
SERVE_PORT = 8000  # KubeRay's Serve Service and its readiness probe use this port
KINDS = ("RayCluster", "RayJob", "RayService")


def load_manifest(path: str | os.PathLike, kind: str) -> dict:
    """One KubeRay resource of the given kind from a YAML file."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such manifest")
    doc = read_yaml(p)
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != kind:
        raise ValueError(f"{p}: expected apiVersion {API_VERSION} kind {kind}, "
                         f"got {(doc.get('apiVersion'), doc.get('kind'))}")
    return doc


def load_serve_config(serve_config: str | os.PathLike) -> dict:
    """A Serve config file, after Serve's schema check."""
    from ray.serve.schema import ServeDeploySchema

    p = Path(serve_config)
    if not p.is_file():
        raise ValueError(f"{p}: no such Serve config")
    cfg = read_yaml(p)
    try:
        ServeDeploySchema.model_validate(cfg)
    except Exception as e:  # pydantic's ValidationError, as Ray Serve raises it
        raise ValueError(f"{p}: not a Serve config: {' '.join(str(e).split())}") from None
    return cfg


def gpu_groups(cluster_spec: dict) -> list[dict]:
    """Per worker group: name, GPUs and CPUs per pod (container limits), and max pods."""
    groups = []
    for g in cluster_spec.get("workerGroupSpecs", []):
        (c,) = g["template"]["spec"]["containers"]
        limits = c.get("resources", {}).get("limits", {})
        groups.append({"name": g["groupName"], "gpus": int(limits.get("nvidia.com/gpu", 0)),
                       "cpus": int(float(limits.get("cpu", 0))), "max_pods": int(g["maxReplicas"])})
    return groups


def engine_deployments(args: dict) -> list[str]:
    """The deployments of the k3 app that hold an engine."""
    return ["prefill", "decode"] if args.get("disaggregated", True) else ["llm"]


def _max_replicas(spec: dict) -> int:
    auto = spec.get("autoscaling_config")
    return int(auto.get("max_replicas", 1)) if auto else int(spec.get("num_replicas", 1))


def size_for_cluster(app_args: dict, cluster_spec: dict, model_path: str) -> dict:
    """The k3 app's args (an LLMServingConfig) sized for the cluster's GPU worker groups."""
    groups = [g for g in gpu_groups(cluster_spec) if g["gpus"] > 0]
    if not groups:
        raise ValueError("the RayService's cluster has no GPU worker group (nvidia.com/gpu limit): nothing to size "
                         "the engines for")
    cpus_per_gpu = min(g["cpus"] // g["gpus"] for g in groups) - 1  # one per GPU left for the proxy and ingress
    total_gpus = sum(g["gpus"] * g["max_pods"] for g in groups)
    args = {**app_args, "model": {"path": model_path}}
    for name in engine_deployments(args):
        spec = dict(args.get(name) or {})
        spec["ray_actor_options"] = {**spec.get("ray_actor_options", {}), "num_gpus": 1, "num_cpus": cpus_per_gpu}
        args[name] = spec
    wanted = sum(_max_replicas(args[n]) for n in engine_deployments(args))
    if wanted > total_gpus:
        raise ValueError(f"the engine deployments may grow to {wanted} replicas of one GPU each, the worker groups "
                         f"hold {total_gpus} GPUs: lower their max_replicas")
    return args


def serve_config_v2(serve_config: str | os.PathLike, cluster_spec: dict, model_path: str) -> str:
    """The Serve config as RayService's `serveConfigV2` string, fit for KubeRay and the cluster."""
    cfg = load_serve_config(serve_config)
    apps = [{**a, "args": size_for_cluster(a.get("args") or {}, cluster_spec, model_path)}
            if a.get("import_path") == "k3.serve.builder:app_builder" else a for a in cfg["applications"]]
    cfg = {**cfg, "proxy_location": "EveryNode",
           "http_options": {**cfg.get("http_options", {}), "host": "0.0.0.0", "port": SERVE_PORT},
           "applications": apps}
    return yaml.safe_dump(cfg, sort_keys=False)


def with_env(cluster_spec: dict, env: dict[str, str]) -> dict:
    """A RayCluster spec whose every container (head and each worker group) has `env` set,
    replacing entries of the same names; the rest as it was."""
    def pod(group: dict) -> dict:
        spec = group["template"]["spec"]
        containers = [{**c, "env": [e for e in c.get("env") or [] if e.get("name") not in env]
                       + [{"name": k, "value": v} for k, v in env.items()]} for c in spec["containers"]]
        return {**group, "template": {**group["template"], "spec": {**spec, "containers": containers}}}

    return {**cluster_spec, "headGroupSpec": pod(cluster_spec["headGroupSpec"]),
            "workerGroupSpecs": [pod(g) for g in cluster_spec.get("workerGroupSpecs") or []]}


def rayservice_manifest(base: str | os.PathLike, serve_config: str | os.PathLike, model_path: str,
                        haproxy: bool = False) -> dict:
    """The RayService of `base` (metadata and `rayClusterConfig`) serving `serve_config` from
    the model directory `model_path` (a path inside the pods, e.g. on the shared volume).
    `haproxy`: Serve's direct ingress with HAProxy on every pod (its variable in every
    container's environment; each pod is a machine of its own, so Ray's HAProxy ports stay)."""
    if not model_path or not model_path.startswith("/"):
        raise ValueError(f"--model-path must be an absolute path inside the pods (e.g. /mnt/k3/models/k3-small), "
                         f"got {model_path!r}")
    doc = load_manifest(base, "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    if haproxy:
        cluster = with_env(cluster, {HAPROXY_FLAG: "1"})
    v2 = serve_config_v2(serve_config, cluster, model_path)
    return {**doc, "spec": {**doc["spec"], "rayClusterConfig": cluster, "serveConfigV2": v2}}


class _Literal(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2, runtimeEnvYAML) as YAML block literals, readable in kubectl."""


_Literal.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                              style="|" if "\n" in s else None))


def dump_manifest(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_Literal, sort_keys=False, width=120)
