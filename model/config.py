"""The model configuration: one dataclass, presets in one registry, JSON in and out.

The hybrid schedule (`layer_types`) and the MLP schedule (`mlp_types`) are explicit per-layer
lists; no feature is ever inferred from a size. Each K3 feature has its own switch, which is
how the Kimi Linear preset is written: standard residuals, unbounded gate, low-rank KDA output
gate, no MLA output gate, no q_lora, no latent MoE, SwiGLU.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fields import check_field_types
from .vision_config import K3VisionConfig, k3_vision, tiny_vision

# Rows whose logits the training loss computes at once: [rows, vocab] fp32 of 64 MB (k3-tiny:
# 4096 rows, K3: 102); about four such tensors live while a chunk's loss and gradient are
# computed, and each chunk's logits are recomputed in backward instead of kept (model/model.py).
# Here, not in model.py, so the capacity planner reads it without torch.
LOSS_CHUNK_BYTES = 64 << 20

LAYER_KINDS = ("kda", "mla")
MLP_KINDS = ("dense", "moe")
ACTIVATIONS = ("situ_glu", "swiglu")
KDA_GATES = ("bounded", "unbounded")
KDA_OUTPUT_GATES = ("full", "low_rank")
# Chunk sizes of the KDA chunkwise form, the kernels' rule (kernels.kda.contract.check_chunk_size:
# up to 16, or a multiple of 16, at most 256; each chunk holds [C, C] and [C, K] fp32 blocks per
# head, so 2^20 asked for 35 TB). The config keeps its own copy of the rule and of the gate floor
# because importing the kernels takes torch (~3 s for `k3 plan`); tests/model/test_model.py pins
# both to the kernels'.
KDA_MAX_CHUNK_SIZE = 256


def kda_chunk_size_ok(n: int) -> bool:
    return 1 <= n <= KDA_MAX_CHUNK_SIZE and (n <= 16 or n % 16 == 0)


# kernels.kda.GATE_FLOOR: a log-decay below -88 is clamped there (exp(-88) is below fp32's smallest
# normal number, the state is gone), so a lower bound under it means nothing.
KDA_GATE_FLOOR = -88.0
# Upper limits of the float fields, each far above any model k3 knows of and inside fp32 (a value
# past fp32's 3.4e38 becomes inf in the model: NaN logits). The SiTU-GLU clamps bound activations
# (K3: 4 and 25, |h| < 100); at 1e4 they no longer clamp anything. Released routed_scaling is 1
# (K3) to 16 (DeepSeek-V2). An eps or an init std above 1 swamps what it is added to or scales.
FLOAT_LIMITS = {"situ_b1": 1e4, "situ_b2": 1e4, "routed_scaling": 1e3, "rms_norm_eps": 1.0, "mla_norm_eps": 1.0,
                "initializer_range": 1.0}
# Fields a k3 config.json may leave out: absent, the model is text-only (to_dict writes them as null).
OPTIONAL_FIELDS = ("vision_config", "media_placeholder_token_id")


def hybrid_schedule(num_layers: int, every: int, last_is_mla: bool = True) -> list[str]:
    """'mla' at 1-based layers every, 2*every, ... (and the last one if asked), 'kda' elsewhere."""
    kinds = ["mla" if (i + 1) % every == 0 else "kda" for i in range(num_layers)]
    if last_is_mla:
        kinds[-1] = "mla"
    return kinds


def moe_schedule(num_layers: int, first_k_dense: int) -> list[str]:
    return ["dense"] * first_k_dense + ["moe"] * (num_layers - first_k_dense)


@dataclass
class K3Config:
    """Every architectural choice of a K3-family model. Field docs say what each switch does."""

    # Stack
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    layer_types: list[str] = field(default_factory=lambda: hybrid_schedule(93, 4))  # per layer: "kda" or "mla"
    mlp_types: list[str] = field(default_factory=lambda: moe_schedule(93, 1))  # per layer: "dense" or "moe"
    intermediate_size: int = 33792  # dense MLP width
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1_048_576
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    activation: str = "situ_glu"  # all gated MLPs (dense, shared, routed): "situ_glu" or "swiglu"
    situ_b1: float = 4.0  # SiTU-GLU gate clamp: b1 * tanh(g / b1)
    situ_b2: float = 25.0  # SiTU-GLU up clamp: b2 * tanh(u / b2)

    # Kimi Delta Attention
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate: str = "bounded"  # "bounded": g = lb * sigmoid(...); "unbounded": g = -exp(A) softplus(...)
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: str = "full"  # "full": one D -> H*K projection; "low_rank": D -> K -> H*K
    kda_chunk_size: int = 64

    # Gated MLA (NoPE: the rope slice is never rotated)
    num_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True  # sigmoid(g_proj x) times the attention output, per head
    mla_norm_eps: float = 1e-6  # eps of the q_lora and kv_lora RMSNorms (DeepSeek/Kimi Linear use 1e-6)

    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16  # the release's name; "k" in the routing and balancing code
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    moe_latent_size: int | None = 3584  # LatentMoE width; None runs experts on the full width
    routed_scaling: float = 1.0
    moe_renormalize: bool = True

    # Block Attention Residuals: decoder layers per block; None = standard pre-norm residuals
    attn_res_block_size: int | None = 12

    # Token ids (tokenizer-specific; used by generate and serving)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # Vision (MoonViT-V2, model/vision.py): None for a text-only model. Its features replace the
    # media placeholder tokens one to one (K3ForConditionalGeneration).
    vision_config: K3VisionConfig | None = None
    media_placeholder_token_id: int | None = None  # the `<|media_pad|>` id of the tokenizer

    def __post_init__(self) -> None:
        if isinstance(self.vision_config, dict):
            self.vision_config = K3VisionConfig.from_dict(self.vision_config)
        self.validate()

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, fld: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"K3Config.{fld}: {msg}")

        check_field_types(self, skip=("K3VisionConfig",))  # vision_config: checked below
        for fld, most in FLOAT_LIMITS.items():
            v = getattr(self, fld)
            need(0 < v <= most, fld, f"must be in (0, {most:g}], got {v!r}")
        for fld in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "kda_num_heads",
                    "kda_head_dim", "kda_conv_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "v_head_dim", "num_experts", "num_experts_per_token", "moe_intermediate_size",
                    "kda_chunk_size", "max_position_embeddings"):
            v = getattr(self, fld)
            need(isinstance(v, int) and v > 0, fld, f"must be a positive int, got {v!r}")
        need(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0, "qk_rope_head_dim",
             f"must be a non-negative int, got {self.qk_rope_head_dim!r}")
        need(len(self.layer_types) == self.num_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
        need(len(self.mlp_types) == self.num_layers, "mlp_types",
             f"has {len(self.mlp_types)} entries but num_layers is {self.num_layers}")
        bad = [t for t in self.layer_types if t not in LAYER_KINDS]
        need(not bad, "layer_types", f"entries must be one of {LAYER_KINDS}, got {bad[:3]}")
        bad = [t for t in self.mlp_types if t not in MLP_KINDS]
        need(not bad, "mlp_types", f"entries must be one of {MLP_KINDS}, got {bad[:3]}")
        need(self.activation in ACTIVATIONS, "activation", f"must be one of {ACTIVATIONS}, got {self.activation!r}")
        need(self.kda_gate in KDA_GATES, "kda_gate", f"must be one of {KDA_GATES}, got {self.kda_gate!r}")
        need(self.kda_output_gate in KDA_OUTPUT_GATES, "kda_output_gate",
             f"must be one of {KDA_OUTPUT_GATES}, got {self.kda_output_gate!r}")
        need(KDA_GATE_FLOOR <= self.kda_gate_lower_bound < 0, "kda_gate_lower_bound",
             f"must be a log-decay in [{KDA_GATE_FLOOR:g}, 0), got {self.kda_gate_lower_bound}")
        need(kda_chunk_size_ok(self.kda_chunk_size), "kda_chunk_size",
             f"must be at most 16 or a multiple of 16, up to {KDA_MAX_CHUNK_SIZE}, got {self.kda_chunk_size}")
        need(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
             "q_lora_rank", f"must be None or a positive int, got {self.q_lora_rank!r}")
        need(self.moe_latent_size is None or (isinstance(self.moe_latent_size, int) and self.moe_latent_size > 0),
             "moe_latent_size", f"must be None or a positive int, got {self.moe_latent_size!r}")
        if "moe" in self.mlp_types:
            need(self.num_experts_per_token < self.num_experts, "num_experts_per_token",
                 f"must be smaller than num_experts={self.num_experts}, got {self.num_experts_per_token}")
        need(self.attn_res_block_size is None or (isinstance(self.attn_res_block_size, int)
                                                   and self.attn_res_block_size >= 1),
             "attn_res_block_size", f"must be None (standard residuals) or >= 1, got {self.attn_res_block_size!r}")
        need(self.num_shared_experts >= 0, "num_shared_experts", f"must be >= 0, got {self.num_shared_experts}")
        if self.vision_config is not None:
            need(isinstance(self.vision_config, K3VisionConfig), "vision_config",
                 f"must be a K3VisionConfig or None, got {type(self.vision_config).__name__}")
            need(self.vision_config.text_hidden_size == self.hidden_size, "vision_config",
                 f"text_hidden_size {self.vision_config.text_hidden_size} != hidden_size {self.hidden_size}")
            need(self.media_placeholder_token_id is not None, "media_placeholder_token_id",
                 "is required with a vision_config")
        for fld in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
            v = getattr(self, fld)
            need(v is None or 0 <= v < self.vocab_size, fld, f"must be in [0, vocab_size={self.vocab_size}), got {v}")

    # -- derived ------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: c_kv plus the shared (unrotated) rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attn_res_num_blocks(self) -> int:
        """Depth slots of Block AttnRes: completed-block sums the last layer can see (embedding aside)."""
        if self.attn_res_block_size is None:
            return 0
        return math.ceil(self.num_layers / self.attn_res_block_size)

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # vision_config becomes a nested dict; from_dict reads it back

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        """The config `to_dict` wrote. Every field it writes must be there (a vision_config too):
        a missing one is refused, never filled in from the K3 defaults; only OPTIONAL_FIELDS may
        be left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"K3Config: unknown field(s) {unknown}")
        missing = sorted(known - set(d) - set(OPTIONAL_FIELDS))
        if isinstance(d.get("vision_config"), dict):
            vision = {f.name for f in dataclasses.fields(K3VisionConfig)}
            missing += [f"vision_config.{n}" for n in sorted(vision - set(d["vision_config"]))]
        if missing:
            raise ValueError(f"K3Config: missing field(s) {missing} (k3 does not fill them in from the defaults)")
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "K3Config":
        """A K3Config from a JSON file, or from JSON text (a string starting with "{")."""
        text = str(path_or_text)
        where = text or "''"
        is_file = isinstance(path_or_text, Path) or (not text.lstrip().startswith("{") and Path(text).exists())
        if is_file:
            try:
                text = Path(path_or_text).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{where}: cannot read a K3Config JSON file ({e})") from None
        else:
            shown = text if len(text) <= 400 else text[:400] + "..."  # a path in full, not a long text
            where = "K3Config" if text.lstrip().startswith("{") else f"K3Config {shown!r}"
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            what = "not valid JSON" if is_file or where == "K3Config" else "no such file, and not JSON text"
            raise ValueError(f"{where}: {what} ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a K3Config must be a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            if is_file:
                raise ValueError(f"{where}: {e}") from None
            raise

    def replace(self, **changes: Any) -> "K3Config":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"K3Config: unknown field(s) {unknown}")
        return dataclasses.replace(self, **changes)


def _k3() -> K3Config:
    # The defaults are the K3 language model; the vision tower and projector are the release's.
    # Placeholder id: `<|media_pad|>` of the Kimi tokenizer (as in Kimi K2.5's release config).
    return K3Config(vision_config=k3_vision(), media_placeholder_token_id=163605)


def _kimi_linear_48b() -> K3Config:
    return K3Config(
        vocab_size=163840, hidden_size=2304, num_layers=27,
        layer_types=hybrid_schedule(27, 4), mlp_types=moe_schedule(27, 1), intermediate_size=9216,
        activation="swiglu", kda_num_heads=32, kda_head_dim=128, kda_gate="unbounded", kda_output_gate="low_rank",
        num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_output_gate=False, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
        moe_intermediate_size=1024, moe_latent_size=None, routed_scaling=2.446, attn_res_block_size=None,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


def _k3_small() -> K3Config:
    # Every K3 feature on, a few hundred million parameters: fits one GPU for training.
    return K3Config(
        vocab_size=32768, hidden_size=1024, num_layers=24, layer_types=hybrid_schedule(24, 4),
        mlp_types=moe_schedule(24, 1), intermediate_size=4096, kda_num_heads=8, kda_head_dim=128,
        num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        num_experts=32, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=320,
        moe_latent_size=384, attn_res_block_size=6, max_position_embeddings=131072,
    )


def _k3_tiny() -> K3Config:
    # Every K3 feature on, a few million parameters: trains in minutes on a 2-core CPU. The release's
    # 1M positions: nothing in the model uses a position (NoPE MLA, KDA), so only memory bounds a prompt.
    return K3Config(
        vocab_size=4096, hidden_size=128, num_layers=8, layer_types=hybrid_schedule(8, 4),
        mlp_types=moe_schedule(8, 1), intermediate_size=384, kda_num_heads=4, kda_head_dim=32,
        num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_experts=16, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=64,
        moe_latent_size=64, attn_res_block_size=2, max_position_embeddings=1_048_576,
    )


def _k3_tiny_vl() -> K3Config:
    # k3-tiny with a MoonViT-V2 tower, every vision feature on. The placeholder id is
    # `<|media_pad|>` in tokenizers trained by k3.model.tokenizer (its 7th special token).
    return _k3_tiny().replace(vision_config=tiny_vision(128), media_placeholder_token_id=6)


PRESETS = {
    "k3": _k3,
    "kimi-linear-48b-a3b": _kimi_linear_48b,
    "k3-small": _k3_small,
    "k3-tiny": _k3_tiny,
    "k3-tiny-vl": _k3_tiny_vl,
}


def get_preset(name: str, **overrides: Any) -> K3Config:
    """A fresh config for a preset name, with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
