"""Request and engine configuration, validated at the boundary (pydantic; every field documented)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    min_tokens: int = Field(0, ge=0, description="Stop tokens and EOS are suppressed until this many tokens exist.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    seed: int | None = Field(None, description="Per-request seed: the same seed gives the same tokens.")
    stop: list[str] = Field(default_factory=list, description="Strings that end generation (not included).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end generation (included).")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")
    logprobs: int | None = Field(None, ge=0, le=20,
                                 description="Return the chosen token's logprob and this many top alternatives.")
    include_stop_str_in_output: bool = Field(False, description="Keep a matched stop string in the text.")

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self


class EngineConfig(BaseModel):
    """Scheduling and memory of one engine."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(16, ge=1, description="Most sequences running at once (one KDA slot each).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Most tokens in one forward (prefill chunks + decodes).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output; default the model's maximum.")
    block_size: int = Field(16, ge=1, description="Tokens per MLA latent page and per prefix-cache block.")
    cache_memory_bytes: int = Field(256 * 2**20, ge=1, description="Memory for KDA slots, checkpoints and MLA pages.")
    enable_prefix_caching: bool = Field(True, description="Reuse cached prompt prefixes (MLA pages + KDA checkpoints).")
    checkpoint_interval: int = Field(4, ge=1, description="Take a KDA state checkpoint every this many blocks.")
    checkpoint_memory_fraction: float = Field(0.25, ge=0.0, lt=1.0,
                                              description="Share of the memory left after running slots for checkpoints.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="MLA latent and conv state dtype.")
    verify_prefix_hits: bool = Field(False, description="Debug: recompute every prefix hit cold and compare states.")
    seed: int = Field(0, description="Seed of the generator used by requests without their own seed.")
