"""TrainConfig: everything a pretraining run needs, validated on the driver before any worker starts.

Checkpoint layout (one directory per checkpoint; Ray Train merges every worker's files and
registers the checkpoint only once all are persisted, so a half-written one is never "latest"):

    ds/...                      DeepSpeed engine state (ZeRO optimizer partitions per rank)
    k3/config.json              K3Config                                        (k3.model.training_checkpoint)
    k3/shared.pt                every non-expert parameter and buffer (rank 0)  (k3.model.training_checkpoint)
    k3/experts-ep{r}-of-{n}.pt  routed experts + their AdamW state of expert-parallel rank r,
                                by full parameter name (loads with any ep_size)  (k3.model.training_checkpoint)
    k3/state.pt                 step, losses so far, the balancing strategy's state, the run's
                                TrainConfig and its data's rows hash (what --resume compares)
    k3/tokenizer.json           the tokenizer the data was made with

`k3.model.load(checkpoint)` reads one as a single model.

`data` and `storage_path` are paths or URIs (k3.platform.train.storage): `located()` makes them
absolute and refuses a relative one inside a Ray job, where the working directory is Ray's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from k3.model import K3Config, get_preset, load_config
from k3.model.config import PRESETS
from k3.platform.balance.config import BalanceConfig
from k3.platform.balance.strategies import check_method

from . import storage
from .context_parallel import piece_problem
from .data import read_manifest
from .vision_data import read_vision_info


class TrainConfig(BaseModel):
    """Everything a pretraining run needs; validated on the driver before any worker starts."""

    # allow_inf_nan=False: an lr, clip or decay of inf (or NaN) is refused here, naming the field
    # strict: a --config file's "2" or true is not read as a number (pydantic's lax mode would take
    # `"context_parallel": true` as 1, no context parallelism and no word)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    preset: str = Field("k3-tiny", description="Model preset (k3, k3-small, k3-tiny, k3-tiny-vl, "
                        "kimi-linear-48b-a3b).")
    init_from: str | None = Field(None, description="Start from a checkpoint directory's weights (a k3 training "
                                  "checkpoint or model directory, the K3 release layout or Kimi Linear); its "
                                  "config.json replaces the preset.")
    model_overrides: dict[str, Any] = Field(default_factory=dict, description="K3Config fields to change.")
    data: str = Field("data/bundled", description="Directory written by jobs/prepare_data.py: a path (absolute "
                      "inside a Ray job; the same on every node of a cluster) or a URI pyarrow reads (s3://, gs://, "
                      "file://, local://).")
    num_workers: int = Field(2, ge=1, description="Ray Train workers (one model shard each).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel ranks; must divide num_experts and num_workers.")
    context_parallel: int = Field(1, ge=1, description="Ranks that split each step's sequences into contiguous "
                                  "pieces (context parallelism; ranks = data-parallel x this); must divide num_workers "
                                  "and the data's seq_len. Text presets only.")
    zero_stage: Literal[1, 2] = Field(1, description="DeepSpeed ZeRO stage.")
    micro_batch: int = Field(8, ge=1, description="Sequences per worker per step (per context-parallel group: "
                             "its ranks split the same sequences).")
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak (cosine).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay on matrices.")
    grad_clip: float = Field(1.0, gt=0, description="Clip of the one global gradient norm (every parameter of "
                             "every rank, experts included; with optimizer='muon' see there).")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="AdamW, or Muon for the dense matrices + AdamW for the rest (DeepSpeed's Muon). With "
        "Muon, DeepSpeed orthogonalises the matrix gradients before it measures a norm, so its clip is off, the "
        "experts are clipped at grad_clip by their own norm, and grad_norm reports sqrt(orthogonalised-update "
        "norm^2 + expert norm^2); Muon wants a larger peak lr than AdamW, ~0.02.")
    activation_checkpointing: bool = Field(False, description="Recompute sub-layers in backward.")
    balance: BalanceConfig = Field(default_factory=BalanceConfig, description="Expert balancing method and knobs.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints (and at the end).")
    log_every: int = Field(10, ge=1, description="Steps between log lines and metric reports.")
    storage_path: str = Field("runs", description="Where Ray Train persists checkpoints (the run is <storage_path>/"
                              "<name>): a path or URI, with the same rules as data.")
    name: str = Field("k3-pretrain", description="Run name (a directory under storage_path).")
    resume: bool = Field(False, description="Continue from the run's latest checkpoint.")
    max_failures: int = Field(2, ge=0, description="Worker-group restarts after failures.")
    # bounded: a negative seed or one past 64 bits failed only inside the workers, naming nothing
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the model init, data order and sampling, in "
                      "[0, 2**32 - 1].")
    use_gpu: bool = Field(False, description="One GPU per worker (NCCL, bf16).")
    coordinator_name: str = Field("k3-balance", description="Name of the BalanceCoordinator actor.")
    fail_at_step: int | None = Field(None, description="Testing: the fault drill; rank 1 dies once at this step "
                                     "(from 0), at the point fail_in names.")
    fail_in: Literal["step", "save"] = Field("step", description="Testing: where the fault drill kills rank 1: at the "
                                             "start of step fail_at_step, or with SIGKILL midway through writing the "
                                             "checkpoint at its end (the step must end with one).")
    media_micro_batch: int = Field(32, ge=1, description="Multimodal presets: image/video examples per worker per "
                                   "media step (from <data>/media, jobs/prepare_data.py --vision).")
    text_every: int = Field(4, ge=1, description="Multimodal presets: every text_every-th step is a text batch, the "
                            "others image/video batches (1: text only). Text batches still run the vision tower.")

    @field_validator("model_overrides")
    @classmethod
    def _known_model_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - {f.name for f in dataclasses.fields(K3Config)})
        if unknown:
            raise ValueError(f"model_overrides: {unknown} are not K3Config fields")
        return v

    @field_validator("name")
    @classmethod
    def _one_directory_name(cls, v: str) -> str:
        # k3 and Ray Train both find the run at <storage_path>/<name>: an empty name would make
        # storage_path itself the run, and a path (a/b, ../x, /x) would put it somewhere else.
        if v in ("", ".", "..") or any(c in v for c in "/\\\0"):
            raise ValueError(f"name (--name) must be one plain directory name under storage_path, got {v!r}")
        return v

    def model_cfg(self) -> K3Config:
        if self.init_from:
            if self.model_overrides:
                raise ValueError("model_overrides cannot change a model loaded with init_from")
            return load_config(self.init_from)
        return get_preset(self.preset, **self.model_overrides)

    def located(self) -> "TrainConfig":
        """This config with `data` and `storage_path` as every process of the run must read them
        (absolute paths, or the URIs as given); ValueError for a location k3 cannot use."""
        return self.model_copy(update={"data": storage.resolve(self.data, "--data"),
                                       "storage_path": storage.resolve(self.storage_path, "--storage-path")})

    def check(self) -> dict:
        """Everything that can be known before a worker starts, on the located config (`located`);
        returns the data's sizes."""
        run = self.located()
        if run.preset not in PRESETS:
            raise ValueError(f"preset {run.preset!r} is not one of {sorted(PRESETS)}")
        mcfg = run.model_cfg()
        if run.num_workers % run.ep_size:
            raise ValueError(f"ep_size={run.ep_size} must divide num_workers={run.num_workers}")
        if "moe" in mcfg.mlp_types and mcfg.num_experts % run.ep_size:
            raise ValueError(f"ep_size={run.ep_size} must divide num_experts={mcfg.num_experts}")
        if run.fail_in == "save" and run.fail_at_step is not None and (run.fail_at_step + 1) % run.checkpoint_every \
                and run.fail_at_step + 1 != run.steps:
            raise ValueError(f"fail_in='save' needs a checkpoint at the end of step {run.fail_at_step}")
        m = run._check_data(mcfg)
        check_method(run, mcfg)
        return {"num_sequences": m.num_sequences, "seq_len": m.seq_len, "vocab_size": m.vocab_size}

    def _check_data(self, mcfg: K3Config):
        """The prepared data against the model and the batch sizes; returns its manifest."""
        if not storage.exists(self.data):
            raise ValueError(f"data path {self.data!r} does not exist (run jobs/prepare_data.py)")
        m = read_manifest(self.data)
        if m.vocab_size > mcfg.vocab_size:
            raise ValueError(f"tokenizer vocab {m.vocab_size} exceeds the model's vocab_size {mcfg.vocab_size}")
        self._check_context_parallel(mcfg, m.seq_len)
        self._check_positions(mcfg, m.seq_len)
        per_step = self.micro_batch * (self.num_workers // self.context_parallel)
        if per_step > m.num_sequences:
            raise ValueError(f"micro_batch x num_workers / context_parallel = {per_step} sequences per step, but the "
                             f"data has only {m.num_sequences}")
        if mcfg.vision_config is not None:
            if m.special_ids.get("media_pad") != mcfg.media_placeholder_token_id:
                raise ValueError(f"the data's tokenizer has <|media_pad|> id {m.special_ids.get('media_pad')}, the "
                                 f"model expects {mcfg.media_placeholder_token_id}: rerun jobs/prepare_data.py")
            info = read_vision_info(self.data)
            if self.text_every > 1 and info["counts"]["train"]["rows"] < self.media_micro_batch * self.num_workers:
                raise ValueError(f"media_micro_batch x num_workers = {self.media_micro_batch * self.num_workers} "
                                 f"examples per step, but the media set has {info['counts']['train']['rows']}")
        return m

    def _check_positions(self, cfg: K3Config, seq_len: int) -> None:
        """The longest sequence a worker's forward receives against the model's
        max_position_embeddings, which the forward refuses to exceed (K3ForCausalLM._check). A row
        holds seq_len + 1 tokens (the inputs and their shifted labels, Trainer.make_batch); rows laid
        end to end as one stream (document starts, context parallelism) each start a document, so no
        sequence is longer than a row, whatever the micro batch."""
        row, limit = seq_len + 1, cfg.max_position_embeddings
        if row > limit:
            raise ValueError(f"the data's seq_len {seq_len} (--seq-len) gives rows of {row} tokens (seq_len + 1: "
                             f"inputs and shifted labels), more than the model's max_position_embeddings {limit}: "
                             f"prepare the data with --seq-len <= {limit - 1}")

    def _check_context_parallel(self, cfg: K3Config, seq_len: int) -> None:
        """The layout rules of --context-parallel C: C divides the workers (ranks = DP x C) and the
        sequence (equal pieces), each piece reaches back one piece only (KDA's conv window)."""
        C = self.context_parallel
        if self.num_workers % C:
            raise ValueError(f"context_parallel (--context-parallel) = {C} must divide num_workers (--num-workers) "
                             f"= {self.num_workers}")
        problem = piece_problem(C, seq_len, cfg.kda_conv_size)
        if problem is not None:
            raise ValueError(f"context_parallel (--context-parallel) = {C} {problem} (the data's seq_len, --seq-len)")
        if C > 1 and cfg.vision_config is not None:
            raise ValueError(f"context_parallel (--context-parallel) = {C} runs text presets only, not {self.preset}")
