"""k3.model: the K3 architecture in plain PyTorch, single device.

The names below are loaded from their module on first use (PEP 562), so importing a torch-free
module such as `k3.model.config` does not import torch: the `k3` CLI parses its arguments and
lists presets without it.
"""
from importlib import import_module

_EXPORTS = {
    "K3Config": "config", "PRESETS": "config", "get_preset": "config",
    "K3ForCausalLM": "model", "K3Model": "model", "CausalLMOutput": "model",
    "K3ForConditionalGeneration": "multimodal", "K3VisionConfig": "vision_config",
    "HybridCache": "cache", "CacheBatch": "cache", "cache_bytes": "cache", "layer_cache_specs": "cache",
    "SamplingConfig": "generation", "generate": "generation",
    "build": "loading", "load": "loading", "load_config": "loading",
    "load_model_dir": "pretrained", "save_model_dir": "pretrained",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
