"""KubeRay (`ray.io/v1`) manifests: loading with a kind check, and the RayService generated from
the Serve config so the two never disagree.

    k3 cluster rayservice --serve-config serve/config.yaml > rayservice.yaml && kubectl apply -f rayservice.yaml

`serveConfigV2` is a string holding the Serve config YAML (KubeRay hands it to Serve as it is),
validated here with Ray Serve's own schema (`ray.serve.schema.ServeDeploySchema`) first.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

API_VERSION = "ray.io/v1"
KINDS = ("RayCluster", "RayJob", "RayService")


def load_manifest(path: str | os.PathLike, kind: str) -> dict:
    """One KubeRay resource of the given kind from a YAML file."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such manifest")
    doc = yaml.safe_load(p.read_text())
    if not isinstance(doc, dict) or doc.get("apiVersion") != API_VERSION or doc.get("kind") != kind:
        got = (doc.get("apiVersion"), doc.get("kind")) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{p}: expected apiVersion {API_VERSION} kind {kind}, got {got}")
    return doc


def serve_config_v2(serve_config: str | os.PathLike) -> str:
    """The Serve config file as RayService's `serveConfigV2` string, after Serve's schema check."""
    from ray.serve.schema import ServeDeploySchema

    p = Path(serve_config)
    if not p.is_file():
        raise ValueError(f"{p}: no such Serve config")
    cfg = yaml.safe_load(p.read_text())
    try:
        ServeDeploySchema.model_validate(cfg)
    except Exception as e:  # pydantic's ValidationError, as Ray Serve raises it
        raise ValueError(f"{p}: not a Serve config: {' '.join(str(e).split())}") from None
    return yaml.safe_dump(cfg, sort_keys=False)


def rayservice_manifest(base: str | os.PathLike, serve_config: str | os.PathLike) -> dict:
    """The RayService of `base` (metadata and `rayClusterConfig`) serving `serve_config`."""
    doc = load_manifest(base, "RayService")
    return {**doc, "spec": {**doc["spec"], "serveConfigV2": serve_config_v2(serve_config)}}


class _Literal(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2, runtimeEnvYAML) as YAML block literals, readable in kubectl."""


_Literal.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                              style="|" if "\n" in s else None))


def dump_manifest(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_Literal, sort_keys=False, width=120)
