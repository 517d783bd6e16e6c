"""k3.model: the K3 architecture in plain PyTorch, single device."""
from .cache import CacheBatch, HybridCache, cache_bytes, layer_cache_specs
from .config import PRESETS, K3Config, get_preset
from .generate import SamplingConfig, generate
from .loading import build, load, load_config
from .model import CausalLMOutput, K3ForCausalLM, K3Model
from .pretrained import load_model_dir, save_model_dir
from .multimodal import K3ForConditionalGeneration
from .vision_config import K3VisionConfig

__all__ = [
    "K3Config", "PRESETS", "get_preset", "K3ForCausalLM", "K3Model", "CausalLMOutput",
    "K3ForConditionalGeneration", "K3VisionConfig",
    "HybridCache", "CacheBatch", "cache_bytes", "layer_cache_specs", "SamplingConfig", "generate",
    "build", "load", "load_config", "load_model_dir", "save_model_dir",
]
