"""Request and engine configuration, validated at the boundary (pydantic; every field documented)."""
from __future__ import annotations

import os
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, field_validator, model_validator

# Below GREEDY_BELOW the temperature is greedy, in the engine as in k3.model.generate: dividing
# logits by a denormal temperature overflows to inf and the softmax becomes NaN (vLLM draws the
# same line).
from k3.model.generation import GREEDY_BELOW

MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
COMPILE_DECODE_ENV = "K3_COMPILE_DECODE"  # EngineConfig.compile_decode's default, when set (0 or 1)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias: [-100, 100]


def _a_number(v: Any) -> Any:
    # pydantic would read "0.5" or true as a number; a caller that sends either has made a mistake
    if isinstance(v, (bool, str)):
        raise ValueError(f"must be a number, got {v!r}")
    return v


Number = Annotated[float, BeforeValidator(_a_number)]
Penalty = Annotated[Number, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
Bias = Annotated[Number, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(
        16, ge=1, description="Most tokens to generate; None: to the end of the context, which is max_model_len or, "
                              "when the engine's cache holds fewer tokens, the end of the cache (finish_reason "
                              "'length' there).")
    min_tokens: int = Field(0, ge=0, description="Stop tokens and EOS are suppressed until this many tokens exist.")
    temperature: Number = Field(1.0, ge=0.0, le=1e4, allow_inf_nan=False,
                               description=f"Softmax temperature in [0, 1e4]; below {GREEDY_BELOW} sampling is greedy.")
    top_p: Number = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="Per-request seed in [0, 2**63 - 1]: the same seed gives the same tokens.")
    stop: list[str] = Field(default_factory=list, description="Strings that end generation (not included).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end generation (included).")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token.")
    logprobs: int | None = Field(None, ge=0, le=20,
                                 description="Return the chosen token's logprob and this many top alternatives.")
    include_stop_str_in_output: bool = Field(False, description="Keep a matched stop string in the text.")
    presence_penalty: Penalty = Field(0.0, description="Subtracted once from the logit of every token generated so "
                                                       "far (OpenAI's definition), in [-2, 2].")
    frequency_penalty: Penalty = Field(0.0, description="Subtracted from a token's logit once per time it was "
                                                        "generated so far (OpenAI's definition), in [-2, 2].")
    logit_bias: dict[Annotated[int, Field(ge=0)], Bias] = Field(
        default_factory=dict, description="Token id -> value in [-100, 100] added to its logit before sampling.")

    @field_validator("max_tokens", "min_tokens", "top_k", "seed", "logprobs", mode="before")
    @classmethod
    def _no_bool(cls, v, info):
        # pydantic takes True as 1 and "5" as 5 for an int field; either is always a caller's mistake.
        if isinstance(v, (bool, str)):
            raise ValueError(f"{info.field_name} must be an integer, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def own_copy(params: SamplingParams | None) -> SamplingParams:
    """A checked copy of a request's params for the engine to keep: pydantic checks a model when it
    is built, not when a field is set afterwards (`params.temperature = float("nan")`) or a list
    or dict field is changed in place, and a caller may reuse its object for the next request."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    return SamplingParams.model_validate(params.model_dump())


class EngineConfig(BaseModel):
    """Scheduling and memory of one engine."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(16, ge=1, description="Most sequences running at once (one KDA slot each).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Most tokens in one forward (prefill chunks + decodes).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output; default the model's maximum "
                                                              "(max_position_embeddings), which it may not exceed.")
    page_size: int = Field(16, ge=1, description="Tokens per MLA latent page; also the prefix cache's unit.")
    cache_memory_bytes: int = Field(256 * 2**20, ge=1, description="Memory for KDA slots, snapshots and MLA pages.")
    enable_prefix_caching: bool = Field(True, description="Reuse cached prompt prefixes (MLA pages + KDA snapshots).")
    snapshot_interval: int = Field(4, ge=1, description="Keep a KDA state snapshot every this many prompt pages "
                                   "(and at a prompt's last full page, and where it leaves a cached prompt).")
    snapshot_memory_fraction: float = Field(0.25, ge=0.0, lt=1.0,
                                            description="Share of the memory left after running slots for snapshots.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="MLA latent and conv state dtype.")
    verify_prefix_hits: bool = Field(False, description="Debug: recompute every prefix hit cold and compare states.")
    compile_decode: bool | None = Field(
        None, description="Run decode steps through the model's forward compiled with torch.compile (two graphs, "
                          "a batch of one sequence and of more, each serving every page-table width up to 64K "
                          "tokens of context on CPU; CUDA graphs on a GPU, one per page-table bucket), compiled "
                          "when the engine starts (~1.5 min for k3-tiny on 2 CPU cores with a cold inductor cache, "
                          "~10 s when its on-disk cache holds them; see compile_decode_wait) and replayed by every "
                          "decode step after (docs/benchmarks.md). None (the default): on for a CPU engine, off on a "
                          "GPU (its CUDA-graph path is untested), unless the environment variable K3_COMPILE_DECODE "
                          "(0 or 1) says otherwise. False runs every step eagerly. Text models only.")
    compile_decode_wait: bool = Field(
        True, description="True: the engine's constructor compiles the decode graphs and returns when they are "
                          "ready (a Serve replica takes traffic only then). False (CPU only: a GPU engine always "
                          "waits): a background thread compiles them while the engine's steps run eagerly, and "
                          "decode steps go through the graphs once they are ready (`LLMEngine.wait_for_graphs`); "
                          "the engine serves at once, but steps beside the compile stall now and then while it "
                          "holds the GIL (seconds, docs/benchmarks.md).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the generator used by requests without their own seed.")
    media_cache_bytes: int = Field(32 * 2**20, ge=0, description="Feature rows of recently encoded images / video "
                                                                 "chunks kept by content (0: none); the same picture "
                                                                 "again skips the vision tower.")
    handoff_key: SecretStr = Field(
        default_factory=lambda: SecretStr(secrets.token_hex(32)), min_length=16,
        description="Secret (16+ characters) that seals handoff states and prefix-pool pages with a keyed "
                    "BLAKE3 MAC; engines that exchange them must share it, and a state sealed under another "
                    "key is refused. Default: a random key drawn when this config is validated, so engines "
                    "built from one config share it (the Serve builders validate the application's config "
                    "once: every replica of the application gets the same key).")

    def context_length(self, cfg) -> int:
        """The longest prompt + output an engine serves for model config `cfg`: max_model_len, or
        the model's max_position_embeddings; a max_model_len past the model's is a ValueError."""
        if self.max_model_len is not None and self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} is more than the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        return self.max_model_len or cfg.max_position_embeddings

    def decode_graphs_on(self, device: torch.device) -> bool:
        """Whether an engine on `device` compiles decode graphs: `compile_decode` when set, else
        K3_COMPILE_DECODE when set and not empty (read here, in the engine's process: a Serve
        replica sees its Ray worker's environment; ValueError unless 0 or 1), else on for a CPU."""
        if self.compile_decode is not None:
            return self.compile_decode
        env = os.environ.get(COMPILE_DECODE_ENV, "").strip() or None  # empty: unset
        if env is not None:
            if env not in ("0", "1"):
                raise ValueError(f"{COMPILE_DECODE_ENV} must be 0 or 1 (EngineConfig.compile_decode's default), "
                                 f"got {env!r}")
            return env == "1"
        return device.type == "cpu"
