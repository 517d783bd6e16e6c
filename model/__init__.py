"""k3.model: the K3 architecture in plain PyTorch, single device.

The names below are loaded from their module on first use (PEP 562), so importing a torch-free
module such as `k3.model.config` does not import torch: the `k3` CLI parses its arguments and
lists presets without it.
"""
import sys
import types
from importlib import import_module

_EXPORTS = {
    "K3Config": "config", "PRESETS": "config", "get_preset": "config",
    "K3ForCausalLM": "model", "K3Model": "model", "CausalLMOutput": "model",
    "K3ForConditionalGeneration": "multimodal", "K3VisionConfig": "vision_config",
    "HybridCache": "cache", "CacheBatch": "cache", "cache_bytes": "cache", "layer_cache_specs": "cache",
    "SamplingConfig": "generate", "generate": "generate",
    "load_model_dir": "pretrained", "save_model_dir": "pretrained",
}

__all__ = list(_EXPORTS)


class _LazyPackage(types.ModuleType):
    def __getattr__(self, name: str):
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", self.__name__), name)
        super().__setattr__(name, value)  # later lookups are plain attribute reads
        return value

    def __setattr__(self, name: str, value) -> None:
        # Importing a submodule binds it on the package; `generate` names both a submodule and
        # the function exported here, and the package's `generate` stays the function.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(__all__))


sys.modules[__name__].__class__ = _LazyPackage
