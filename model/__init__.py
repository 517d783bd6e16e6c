"""k3.model: the K3 architecture in plain PyTorch, single device."""
from .cache import CacheBatch, HybridCache, cache_bytes, layer_cache_specs
from .config import PRESETS, K3Config, get_preset
from .generate import SamplingConfig, generate
from .model import CausalLMOutput, K3ForCausalLM, K3Model
from .pretrained import load_pretrained, save_pretrained

__all__ = [
    "K3Config", "PRESETS", "get_preset", "K3ForCausalLM", "K3Model", "CausalLMOutput",
    "HybridCache", "CacheBatch", "cache_bytes", "layer_cache_specs", "SamplingConfig", "generate",
    "load_pretrained", "save_pretrained",
]
