"""k3's inference engine: continuous batching over a hybrid KDA/MLA cache with prefix caching.

    engine = LLMEngine(model, EngineConfig(...), tokenizer)
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

`AsyncEngine` wraps it for asyncio callers (the Ray Serve deployments); `ProcessEngine`
(engine_core.py) gives the same streams over an engine stepped in a process of its own.

engine.py (requests and the step loop), scheduler.py (continuous batching), cache_manager.py
(the only owner of the memory: KDA slots, MLA pages, the prefix cache; others hold opaque
handles), handoff.py (the connector to other engines: cache states and prefix-pool pages,
exported sealed, imported checked), async_engine.py, engine_core.py, sampler.py, detokenizer.py,
prompt_media.py, params.py.
"""
from .async_engine import AsyncEngine, RequestFailed
from .engine import LLMEngine, RequestOutput
from .handoff import HybridCacheState
from .params import EngineConfig, SamplingParams

__all__ = ["LLMEngine", "AsyncEngine", "RequestOutput", "RequestFailed", "EngineConfig", "SamplingParams",
           "HybridCacheState"]
