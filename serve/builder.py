"""Pure builders: one validated LLMServingConfig in, a bound Ray Serve application out (Ray Serve
LLM's `build_openai_app` / `build_pd_openai_app` shape). Nothing starts here; `serve.run` or
`serve run serve/config.yaml` does.

    from k3.serve.builder import build_pd_app
    serve.run(build_pd_app({"model": {"preset": "k3-tiny"}}), route_prefix="/")
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from k3.serve.config import LLMServingConfig
from k3.serve.ingress import Ingress
from k3.serve.servers import DecodeServer, LLMServer, PrefillServer, PrefixPoolServer


def _deployment(cls, name: str, spec, **extra) -> Any:
    return serve.deployment(cls, name=name).options(**spec.options(), **extra)


def build_app(config: LLMServingConfig | dict):
    """The aggregated application: Ingress -> LLMServer."""
    cfg = LLMServingConfig.model_validate(config)
    dump = cfg.model_dump()
    llm = _deployment(LLMServer, "LLMServer", cfg.llm).bind(dump)
    return _deployment(Ingress, "Ingress", cfg.ingress).bind(dump, llm)


def build_pd_app(config: LLMServingConfig | dict):
    """The disaggregated application: Ingress -> DecodeServer -> PrefillServer (prefix-affinity
    routed, sharing a PrefixPool), the prompt's hybrid cache state handed over through the object
    store."""
    cfg = LLMServingConfig.model_validate(config)
    dump = cfg.model_dump()
    router = RequestRouterConfig(request_router_class="k3.serve.router.PrefixAffinityRouter",
                                 request_router_kwargs={"max_imbalance": 4})
    pool = None
    if cfg.prefix_pool_bytes and cfg.engine.enable_prefix_caching:
        pool = serve.deployment(PrefixPoolServer, name="PrefixPool").options(
            num_replicas=1, ray_actor_options={"num_cpus": 0}).bind(cfg.prefix_pool_bytes)
    prefill = _deployment(PrefillServer, "PrefillServer", cfg.prefill, request_router_config=router).bind(dump, pool)
    decode = _deployment(DecodeServer, "DecodeServer", cfg.decode).bind(dump, prefill)
    return _deployment(Ingress, "Ingress", cfg.ingress).bind(dump, decode)


def app_builder(args: dict):
    """The `import_path` of serve/config.yaml: `args` is an LLMServingConfig; `disaggregated`
    picks the application."""
    cfg = LLMServingConfig.model_validate(args)
    return build_pd_app(cfg) if cfg.disaggregated else build_app(cfg)
