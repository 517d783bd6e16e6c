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
- the k3 app's args are checked as the `k3.serve.config.LLMServingConfig` its builder reads, and
  the engine deployments it runs (prefill and decode, or the aggregated `llm`) ask for one GPU each
  and CPUs from a GPU's share of the worker groups (one left for the proxy and ingress), and at
  most as many replicas as the groups have GPUs;
- the weights come from a model directory on the shared volume (`--model-path`), not a preset's
  random weights. Each engine replica holds the whole model on its one GPU (serving has no tensor
  or expert parallelism), so the model must fit one GPU (k3-small does, the full K3 does not),
  and the engine keeps the Serve config's sizing (`engine.cache_memory_bytes`: 256 MiB in
  serve/config.yaml, a laptop's) until you raise it there; serveConfigV2 opens with a comment
  saying both.
"""
from __future__ import annotations

import math
import os
import re
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


# KubeRay's default maxReplicas of a worker group that gives none (its CRD's kubebuilder default)
KUBERAY_MAX_REPLICAS = 2**31 - 1
_CPU_QUANTITY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(m?)")
_COUNT = re.compile(r"\d+")


def cpu_quantity(value: object, where: str) -> float:
    """A Kubernetes CPU quantity in CPUs: a plain number ('8', 8, '1.5') or millicores ('500m')."""
    m = _CPU_QUANTITY.fullmatch(str(value).strip())
    if m is None:
        raise ValueError(f"{where}: {value!r} is not a CPU quantity (e.g. '8', '1.5', '500m')")
    return float(m[1]) / (1000 if m[2] else 1)


def _count(value: object, where: str) -> int:
    if _COUNT.fullmatch(str(value).strip()) is None:
        raise ValueError(f"{where}: {value!r} is not a whole number")
    return int(str(value).strip())


def gpu_groups(cluster_spec: dict) -> list[dict]:
    """Per worker group: name, GPUs and CPUs per Ray node, and max Ray nodes, as KubeRay starts
    them: `num-cpus` / `num-gpus` of rayStartParams if given, else the container's limits (CPUs
    rounded up, as KubeRay's `Quantity.Value()` does; the request when there is no limit);
    maxReplicas (default KubeRay's, unbounded) pods of numOfHosts (default 1) nodes each."""
    groups = []
    for g in cluster_spec.get("workerGroupSpecs", []):
        name = g.get("groupName", "?")
        where = f"workerGroupSpecs {name}"
        (c,) = g["template"]["spec"]["containers"]
        resources = c.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        params = g.get("rayStartParams") or {}
        if "num-gpus" in params:
            gpus = _count(params["num-gpus"], f"{where}: rayStartParams.num-gpus")
        else:
            gpus = _count(limits.get("nvidia.com/gpu", 0), f"{where}: limits.nvidia.com/gpu")
        if "num-cpus" in params:
            cpus = cpu_quantity(params["num-cpus"], f"{where}: rayStartParams.num-cpus")
        elif "cpu" in limits or "cpu" in requests:
            field = "limits" if "cpu" in limits else "requests"
            cpus = cpu_quantity((limits if "cpu" in limits else requests)["cpu"], f"{where}: {field}.cpu")
        else:
            cpus = 0.0  # sized below: a GPU group without CPUs is refused by name
        max_pods = _count(g.get("maxReplicas", KUBERAY_MAX_REPLICAS), f"{where}: maxReplicas")
        hosts = _count(g.get("numOfHosts", 1), f"{where}: numOfHosts")
        groups.append({"name": name, "gpus": gpus, "cpus": math.ceil(cpus), "max_pods": max_pods * hosts})
    return groups


def engine_deployments(disaggregated: bool) -> list[str]:
    """The deployments of the k3 app that hold an engine."""
    return ["prefill", "decode"] if disaggregated else ["llm"]


# the k3 app's engine deployments by their Serve names (k3.serve.builder), with the args field that
# sizes each, and the options a config's `deployments:` entry could set over that sizing
ENGINE_DEPLOYMENTS = {"LLMServer": "llm", "PrefillServer": "prefill", "DecodeServer": "decode"}
SIZING_OPTIONS = ("num_replicas", "autoscaling_config", "ray_actor_options", "placement_group_bundles",
                  "placement_group_strategy", "max_replicas_per_node")


def check_no_sizing_overrides(app: dict, where: str) -> None:
    """Refuses a `deployments:` entry that sizes an engine deployment: Serve applies such entries
    over what the app's builder made, so the sizing here (one GPU each, the groups' CPUs, at most
    their GPUs' count of replicas) would be replaced unseen."""
    for j, d in enumerate(app.get("deployments") or []):
        field = ENGINE_DEPLOYMENTS.get(d.get("name"))
        sized = [k for k in SIZING_OPTIONS if k in d]
        if field and sized:
            raise ValueError(f"{where}.deployments[{j}] ({d['name']}) sets {', '.join(sized)}: Serve would apply it "
                             f"over the sizing for the cluster's GPUs; set it in args.{field} instead")


def engine_cpus(groups: list[dict]) -> int:
    """CPUs of each engine replica (one GPU): a GPU's share of its pod's CPUs less one left for
    the proxy and the ingress, the smallest over the GPU groups."""
    for g in groups:
        if g["cpus"] // g["gpus"] < 2:
            raise ValueError(f"worker group {g['name']}: {g['cpus']} CPUs for {g['gpus']} GPUs; each engine "
                             f"replica (one GPU) needs 2 CPUs beside its GPU (one for it, one left for the proxy "
                             f"and ingress): give the group at least {2 * g['gpus']} CPUs (limits.cpu)")
    return min(g["cpus"] // g["gpus"] for g in groups) - 1


def serving_config(app_args: dict, model_path: str, where: str):
    """The k3 app's args as the `k3.serve.config.LLMServingConfig` the builder will read, with the
    model at `model_path` (a directory inside the pods, not here: the replicas check it)."""
    from pydantic import ValidationError

    from k3.serve.config import LLMServingConfig

    class InPods(LLMServingConfig):
        model: dict  # {"path": model_path}: ModelSource would look for the directory here

    try:
        return InPods.model_validate({**app_args, "model": {"path": model_path}})
    except ValidationError as e:
        fields = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{where}: not a k3 LLMServingConfig: {fields}") from None


def _max_replicas(spec, where: str) -> int:
    """The most replicas a DeploymentSpec may run: its autoscaling_config's max_replicas (read
    with Ray Serve's AutoscalingConfig, default 1) or num_replicas (default 1)."""
    if spec.autoscaling_config is None:
        return spec.num_replicas or 1
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    try:
        return AutoscalingConfig(**spec.autoscaling_config).max_replicas
    except ValidationError as e:
        fields = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{where}.autoscaling_config: {fields}") from None


def size_for_cluster(app_args: dict, cfg, cluster_spec: dict, model_path: str, where: str) -> dict:
    """The k3 app's args (`cfg` is them as `serving_config` read them) sized for the cluster's GPU
    worker groups: each engine replica one GPU and `engine_cpus`, at most as many as the groups'
    GPUs. The engine's own sizing (`engine`: cache_memory_bytes, max_num_seqs) is kept as it is."""
    groups = [g for g in gpu_groups(cluster_spec) if g["gpus"] > 0]
    if not groups:
        raise ValueError("the RayService's cluster has no GPU worker group (nvidia.com/gpu limit): nothing to size "
                         "the engines for")
    cpus = engine_cpus(groups)
    total_gpus = sum(g["gpus"] * g["max_pods"] for g in groups)
    args = {**app_args, "model": {"path": model_path}, "disaggregated": cfg.disaggregated}
    wanted = 0
    for name in engine_deployments(cfg.disaggregated):
        wanted += _max_replicas(getattr(cfg, name), f"{where}.{name}")
        spec = dict(args.get(name) or {})
        spec["ray_actor_options"] = {**spec.get("ray_actor_options", {}), "num_gpus": 1, "num_cpus": cpus}
        args[name] = spec
    if wanted > total_gpus:
        raise ValueError(f"the engine deployments may grow to {wanted} replicas of one GPU each, the worker groups "
                         f"hold {total_gpus} GPUs: lower their max_replicas")
    return args


def serve_config_v2(serve_config: str | os.PathLike, cluster_spec: dict, model_path: str) -> str:
    """The Serve config as RayService's `serveConfigV2` string, fit for KubeRay and the cluster,
    headed by a comment on what it keeps from `serve_config` as it is."""
    cfg = load_serve_config(serve_config)
    apps, notes = [], []
    for i, a in enumerate(cfg["applications"]):
        if a.get("import_path") == "k3.serve.builder:app_builder":
            check_no_sizing_overrides(a, f"{serve_config}: applications[{i}]")
            where = f"{serve_config}: applications[{i}].args"
            app = serving_config(a.get("args") or {}, model_path, where)
            a = {**a, "args": size_for_cluster(a.get("args") or {}, app, cluster_spec, model_path, where)}
            notes.append(f"# {a.get('name', i)}: each engine replica holds the whole model ({model_path}) on its one "
                         f"GPU (no tensor or expert parallelism: the full K3 does not fit one), and its cache "
                         f"is engine.cache_memory_bytes {app.engine.cache_memory_bytes} from {serve_config}")
        apps.append(a)
    cfg = {**cfg, "proxy_location": "EveryNode",
           "http_options": {**cfg.get("http_options", {}), "host": "0.0.0.0", "port": SERVE_PORT},
           "applications": apps}
    return "".join(n + "\n" for n in notes) + yaml.safe_dump(cfg, sort_keys=False)


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
