"""The Serve application's configuration: one validated pydantic model, loadable from the `args`
of serve/config.yaml (`serve run` / `serve deploy`), turned into bound deployments by the pure
builders in serve/builder.py. Every field is documented; unknown keys are refused."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from k3.model.tokenizer import BUNDLED_TOKENIZER, check_tokenizer_fits, load_tokenizer
from k3.serve.engine import EngineConfig


class DeploymentSpec(BaseModel):
    """Ray Serve options of one deployment (passed to `.options(...)`)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int | None = Field(1, ge=1, description="Fixed replica count; ignored when autoscaling_config is set.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling (min_replicas, max_replicas, target_ongoing_requests, ...).")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests one replica works on at once.")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1},
                                              description="Resources of each replica (num_cpus, num_gpus, ...).")

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                                "ray_actor_options": dict(self.ray_actor_options)}
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class ModelSource(BaseModel):
    """Where the weights and the tokenizer come from: a k3 model directory, or random weights of a
    preset (tests, load generators, the default serve/config.yaml) with k3's bundled tokenizer."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="A checkpoint directory: a k3 model directory (config.json, "
                                               "model.safetensors, tokenizer.json, optional tokenizer_config.json with "
                                               "the chat template), a K3 release or a Kimi Linear checkpoint.")
    preset: str | None = Field(None, description="A k3 preset name for random weights (no path).")
    seed: int = Field(0, ge=0, description="Seed of the random weights (with preset).")
    tokenizer_path: str | None = Field(None, description="A tokenizer.json to serve with (a tokenizer_config.json "
                                                         "beside it may hold the chat template). Default: the one "
                                                         "in `path`; with a preset, k3's bundled tokenizer (vocab "
                                                         "4096, trained on the bundled corpus).")

    @model_validator(mode="after")
    def _one(self) -> "ModelSource":
        if (self.path is None) == (self.preset is None):
            raise ValueError("model: give exactly one of `path` or `preset`")
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"model.path {self.path!r} is not a directory")
        if self.tokenizer_path is not None and not Path(self.tokenizer_path).is_file():
            raise ValueError(f"model.tokenizer_path {self.tokenizer_path!r} is not a file")
        if self.preset is not None and self.tokenizer_path is None:
            from k3.model import get_preset

            check_tokenizer_fits(load_tokenizer(BUNDLED_TOKENIZER), get_preset(self.preset),
                                 f"k3's bundled tokenizer (give model.tokenizer_path for preset {self.preset!r})")
        return self

    def tokenizer_file(self) -> Path | None:
        """The tokenizer.json served with this model; None for a model directory without one
        (the API then takes token ids only)."""
        if self.tokenizer_path is not None:
            return Path(self.tokenizer_path)
        if self.preset is not None:
            return BUNDLED_TOKENIZER
        own = Path(self.path) / "tokenizer.json"
        return own if own.is_file() else None

    def tokenizer(self):
        """The served `tokenizers.Tokenizer`, or None (tokenizer_file)."""
        f = self.tokenizer_file()
        return load_tokenizer(f) if f is not None else None


class MediaConfig(BaseModel):
    """Limits on images and video in chat requests (the ingress processes them; serve/chat_media.py)."""

    model_config = ConfigDict(extra="forbid")

    image_patch_limit: int = Field(16384, ge=4, description="An image with more 14x14 patches is resized down "
                                                           "(aspect ratio kept) to fit; never refused for it.")
    video_patch_limit_per_frame: int = Field(4096, ge=4, description="Patch budget of each sampled video frame.")
    max_video_frames: int = Field(256, ge=1, description="Most frames a video may have after sampling at 2 fps; "
                                                         "more is refused.")
    max_image_pixels: int = Field(100_000_000, ge=1, le=178_956_970,
                                  description="Hard limit on a source image's width x height, checked from its "
                                              "header before decoding; past it the request is refused. At most "
                                              "178,956,970 (Pillow refuses larger images).")
    max_video_decode_pixels: int = Field(1 << 30, ge=1, description="Hard limit on an animated GIF / PNG's frames x "
                                                                    "width x height (what sampling it decodes); "
                                                                    "past it the request is refused before decoding.")
    max_items: int = Field(32, ge=1, description="Most image / video parts in one request.")


class LLMServingConfig(BaseModel):
    """One served model: engine, deployments, API."""

    model_config = ConfigDict(extra="forbid")

    model_id: str = Field("k3", min_length=1, description="The name clients pass as `model`.")
    model: ModelSource = Field(..., description="The weights and tokenizer.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The engine of every replica.")
    disaggregated: bool = Field(True, description="Separate prefill and decode deployments (False: one LLMServer).")
    prefill: DeploymentSpec = Field(default_factory=DeploymentSpec, description="The PrefillServer deployment.")
    decode: DeploymentSpec = Field(default_factory=DeploymentSpec, description="The DecodeServer deployment.")
    llm: DeploymentSpec = Field(default_factory=DeploymentSpec, description="The aggregated LLMServer deployment.")
    ingress: DeploymentSpec = Field(default_factory=lambda: DeploymentSpec(ray_actor_options={"num_cpus": 0.1}),
                                    description="The OpenAI ingress deployment.")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the API key; when it "
                                                      "is set, requests need `Authorization: Bearer <key>`.")
    prefix_pool_bytes: int = Field(256 * 2**20, ge=0, description="Byte budget of the prefix pool shared by the "
                                                                 "prefill replicas (0: no pool).")
    handoff_attempts: int = Field(3, ge=1, le=10, description="Prefill attempts per request when a prefill replica "
                                                              "dies or its state is lost in transit.")
    handoff_timeout_s: float = Field(120.0, gt=0, description="Seconds a decode replica waits for one prefill.")
    torch_threads: int = Field(1, ge=1, description="torch threads per replica (1 on a shared CPU host).")
    engine_process: bool = Field(True, description="Decode and aggregated replicas step their engine in a process "
                                 "of their own (its engine core), so the replica's per-token Python runs beside the "
                                 "steps; False: in a thread of the replica.")
    direct_stream: bool = Field(True, description="A request's outputs after its first go from the server replica "
                                "straight to the ingress replica on a TCP connection between the two (one per "
                                "pair), not one Ray streaming item each; False: every output through Serve.")
    media: MediaConfig = Field(default_factory=MediaConfig, description="Image and video limits (vision models).")
    default_max_tokens: int | None = Field(
        None, ge=1, description="New tokens of a request that asks no max_tokens (a chat without one, a completion "
                                "with null); None: to the end of the context (OpenAI's rule), which a model that "
                                "never says EOS runs to. A max_tokens a request asks is kept, whatever this is.")
