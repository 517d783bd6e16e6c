"""k3's inference engine: continuous batching over a hybrid KDA/MLA cache with prefix caching.

    engine = LLMEngine(model, EngineConfig(...), tokenizer)
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

`AsyncEngine` wraps it for asyncio callers (the Ray Serve deployments).
"""
from .async_engine import AsyncEngine, RequestFailed
from .engine import LLMEngine, RequestOutput
from .handoff import HybridCacheState
from .params import EngineConfig, SamplingParams

__all__ = ["LLMEngine", "AsyncEngine", "RequestOutput", "RequestFailed", "EngineConfig", "SamplingParams",
           "HybridCacheState"]
