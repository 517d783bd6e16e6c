"""The training step of one worker, in parts (torchtitan's shape): `Trainer.build`,
`make_batch`, `train_step`, `save` and `load`.

The Trainer assumes torch.distributed is initialised (Ray Train's worker, or a test's spawned
processes) and knows nothing of Ray Data or reporting: the worker loop in
k3.platform.train.worker feeds it batches and reports what `train_step` returns. Its model holds
only this rank's experts (k3.model.build / k3.model.load), expert parallelism is applied from
outside (k3.platform.train.expert_parallel), so is context parallelism (k3.platform.train.context_parallel:
ranks = DP x CP, the ranks of a CP group run pieces of the same sequences), DeepSpeed sits behind one adapter
(k3.platform.train.ds_adapter: the dense parameters' ZeRO optimizer, the experts' AdamW, one
global gradient norm) and balancing is one strategy object (k3.platform.balance.strategies).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

import k3.model
from k3.model import training_checkpoint as ckpt
from k3.model.moe import is_expert_param
from k3.platform.balance.strategies import make_strategy

from .context_parallel import ContextParallel, cp_groups, stream_cu_seqlens
from .data import read_manifest, read_tokenizer
from .ds_adapter import DeepSpeedAdapter
from .expert_parallel import apply_expert_parallel, ep_groups
from .optim import cosine_lr
from .vision_data import ExampleEncoder, MediaSchedule, collate, read_vision_rows


NO_LOGITS = torch.zeros(0, dtype=torch.long)  # logits_at for training: the loss alone, no [T, vocab] logits


def initial_model(cfg, mcfg, ep_rank: int, ep_size: int, device: torch.device):
    """This rank's model before training: cfg.init_from's weights (the K3 release streams only
    this rank's experts), or the preset initialised from cfg.seed."""
    if cfg.init_from:
        return k3.model.load(cfg.init_from, dtype=torch.float32, device=device, ep_rank=ep_rank, ep_size=ep_size)
    return k3.model.build(mcfg, ep_rank, ep_size, seed=cfg.seed, device=device)


@dataclass
class StepResult:
    """What one optimizer step measured (the same on every rank unless noted)."""

    loss: float  # mean training loss over workers
    grad_norm: float  # global norm before clipping, over every parameter of every rank
    lr: float
    maxvio: list[float]  # per MoE layer: max load / mean load - 1 over all workers' tokens
    tokens: int  # tokens of this step over all workers
    step_s: float
    wait_s: float  # waiting for the balance coordinator
    all_to_all_s: float  # expert all-to-all, this rank
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """One worker's model shard, optimizers and balancing. See the module docstring."""

    def __init__(self, cfg, rank: int, world: int, device: torch.device | str = "cpu") -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = torch.device(device)
        self.ep_size = cfg.ep_size
        self.ep_rank, self.edp_rank = rank % self.ep_size, rank // self.ep_size
        self.cp_size = cfg.context_parallel
        self.dp_rank = rank // self.cp_size  # which sequences this rank's group reads
        self.model = self.ds = self.ep = self.cp = self.balance = None
        self.pad_id = 0  # padding of media batches (masked out of the loss); media_schedule sets it

    # -- build ----------------------------------------------------------------------------------
    def build(self) -> "Trainer":
        from k3.platform.ops.extensions import use_interpreter_ninja, wait_for_extension_locks

        cfg = self.cfg
        mcfg = cfg.model_cfg()
        use_interpreter_ninja()  # DeepSpeed may build an op below: with one ninja, never on a dead
        wait_for_extension_locks()  # build's lock
        model = initial_model(cfg, mcfg, self.ep_rank, self.ep_size, self.device).train()
        model.model.activation_checkpointing = cfg.activation_checkpointing
        ep_group, edp_group = ep_groups(self.rank, self.world, self.ep_size)
        self.ep = apply_expert_parallel(model, ep_group, edp_group, self.world)
        cp_group = cp_groups(self.rank, self.world, self.cp_size)
        self.cp = ContextParallel(cp_group, self.cp_size, self.rank % self.cp_size)
        self.ds = DeepSpeedAdapter(cfg, model, self.ep)
        self.model = model
        num_moe = sum(layer.is_moe for layer in model.model.layers)
        self.balance = make_strategy(cfg.balance if num_moe else cfg.balance.model_copy(update={"method": "none"}),
                                     num_moe, mcfg.num_experts, mcfg.num_experts_per_token, self.device,
                                     rank=self.rank, coordinator_name=cfg.coordinator_name)
        return self

    def start(self) -> None:
        """After build (and load): every rank ready, balancing connected."""
        dist.barrier()
        self.balance.start(self.model)

    # -- data -----------------------------------------------------------------------------------
    @property
    def multimodal(self) -> bool:
        return self.cfg.model_cfg().vision_config is not None

    def media_schedule(self) -> MediaSchedule:
        """This rank's image/video examples and the text/media step pattern (multimodal presets)."""
        cfg = self.cfg
        manifest = read_manifest(cfg.data)
        tok = Tokenizer.from_str(read_tokenizer(cfg.data, manifest))
        ids = manifest.special_ids
        self.pad_id = ids["pad"]
        encoder = ExampleEncoder(lambda s: tok.encode(s).ids, tok.token_to_id, bos=ids["bos"], eos=ids["eos"])
        return MediaSchedule(read_vision_rows(cfg.data, "train"), encoder, cfg.media_micro_batch, cfg.text_every,
                             cfg.seed, self.rank, self.world)

    def make_batch(self, raw: dict) -> dict[str, torch.Tensor]:
        """A data-loader batch -> the model's inputs on the device.

        Text: {"tokens": [B, T+1] int64} -> {"input_ids": [B, T'], "labels": [B, T']}
        (labels[t + 1] is the target of position t); with {"doc_start": [B, T+1]} (documents
        inside rows) or context parallelism, the rows become one stream [1, B (T+1)] with its
        documents in "cu_seqlens", or in "shard" (this rank's piece, k3.model.shard).
        Media: {"examples": [Example, ...]} -> right-padded input_ids/labels (-100 on padding) plus pixel_values [N, 3, p, p] and
        grid_thws [M, 3] for the tower."""
        if "examples" in raw:
            b = collate(raw["examples"], pad_id=self.pad_id)
            out = {"input_ids": b["input_ids"], "labels": b["labels"]}
            if b["pixel_values"] is not None:
                out |= {"pixel_values": b["pixel_values"], "grid_thws": b["grid_thws"]}
            return {k: v.to(self.device) for k, v in out.items()}
        tokens = raw["tokens"].to(self.device, torch.long)
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got {tuple(tokens.shape)}")
        doc_start = raw["doc_start"].to(self.device) if "doc_start" in raw else None
        if self.cp_size > 1:
            stream, shard = self.cp.shard(tokens, doc_start)
            return {"input_ids": stream, "labels": stream, "shard": shard}
        if doc_start is not None:  # documents inside rows: one packed stream
            stream = tokens.reshape(1, -1)
            return {"input_ids": stream, "labels": stream, "cu_seqlens": stream_cu_seqlens(tokens, doc_start)}
        return {"input_ids": tokens, "labels": tokens}

    def forward(self, batch: dict[str, torch.Tensor]):
        """The model on one batch -> CausalLMOutput with router outputs. A multimodal model runs
        its tower on text batches too (zero-weighted), so every rank's gradients match."""
        media = {k: batch[k] for k in ("pixel_values", "grid_thws") if k in batch}
        text = {k: batch[k] for k in ("cu_seqlens", "shard") if k in batch}
        return self.ds(batch["input_ids"], labels=batch["labels"], collect_router=True, logits_at=NO_LOGITS, **text,
                       **media)

    @torch.no_grad()
    def router_pass(self, batch: dict[str, torch.Tensor]):
        """A function that runs the batch's router outputs under the current weights and biases,
        without the LM head or loss (what balancing solves from after the optimizer step; each
        solve round calls it again). Called with `solve`, each MoE layer is solved as the forward
        reaches it (K3Model.solving_router_bias). A media batch's placeholders get the tower's
        rows, as in the training forward, encoded once here: the routers see what they will route."""
        embeds = None
        if "pixel_values" in batch:
            rows = torch.cat(self.model.encode_media(batch["pixel_values"], batch["grid_thws"]))
            embeds = self.model.splice(batch["input_ids"], rows)

        @torch.no_grad()
        def run(solve=None) -> list:
            with self.model.model.solving_router_bias(solve) if solve is not None else nullcontext():
                return self.model.model(batch["input_ids"], batch.get("cu_seqlens"), collect_router=True,
                                        inputs_embeds=embeds, shard=batch.get("shard"))[1]

        return run

    # -- one step -------------------------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor], step: int) -> StepResult:
        """Forward, backward, one global clip and one optimizer step on every parameter; the
        balancing bias for the next step. `step` counts from 0."""
        cfg = self.cfg
        lr = cosine_lr(step, cfg.steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        self.ds.set_lr(lr)
        t0 = time.perf_counter()
        wait_s = self.balance.begin_step(self.model)
        self.ep.reset_counters()
        out = self.forward(batch)
        routers = out.router or []
        loss = out.loss
        # DeepSpeed and the expert reduction average gradients over all DP x CP ranks, and the C
        # ranks of a group hold shares of one mean: C times each share makes that average right.
        loss = loss * self.cp_size if self.cp_size > 1 else loss
        extra = self.balance.extra_loss(routers)
        if extra is not None:
            loss = loss + extra
        if not self.balance.refreshed_margins:
            self.balance.observe(self.model, step, routers)
        grad_norm = self.ds.backward_and_step(loss)
        if self.balance.refreshed_margins:  # the batch's margins under the weights that will route next
            wait_s += self.balance.refresh(self.model, step, self.router_pass(batch))
        # Step statistics over all workers, reduced where the process group can (NCCL takes only
        # CUDA tensors), then read on the host.
        counts = (torch.stack([r.counts for r in routers]).float() if routers
                  else torch.zeros(0, device=self.device))
        stats = torch.cat([out.loss.detach().reshape(1).float(), counts.reshape(-1).to(self.device)])
        if self.world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        loads = stats[1:].reshape(len(routers), -1) if routers else torch.zeros(0, 0)
        maxvio = (loads.max(1).values / loads.mean(1) - 1).tolist() if routers else []
        self.balance.after_step(self.model, step, loads)
        dp = self.world // self.cp_size  # a CP group's shares add up to its batch's mean loss
        return StepResult(loss=float(stats[0]) / dp, grad_norm=grad_norm, lr=lr, maxvio=maxvio,
                          tokens=batch["input_ids"].numel() * dp, step_s=time.perf_counter() - t0,
                          wait_s=wait_s, all_to_all_s=self.ep.all_to_all_seconds(),
                          extra=self.balance.metrics(self.model))

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, out: Path, state: dict[str, Any], tokenizer_json: str | None = None,
             midway: Callable[[], None] | None = None) -> None:
        """Every rank writes its part of a checkpoint under `out` (layout: k3.platform.train.config).
        `state` (rank 0): step, history, ... ; the balancing state is added here. `midway` runs once
        DeepSpeed's files are written, before k3's (the fault drill kills the worker there)."""
        out = Path(out)
        self.ds.save(out)
        if midway is not None:
            midway()
        k3dir = out / "k3"
        k3dir.mkdir(parents=True, exist_ok=True)
        balance_state = self.balance.state_dict()
        if self.rank == 0:
            ckpt.save_shared(self.model, k3dir)
            torch.save({**state, "balance": balance_state, "config": self.cfg.model_dump()}, k3dir / "state.pt")
            if tokenizer_json is not None:
                (k3dir / "tokenizer.json").write_text(tokenizer_json)
        if self.edp_rank == 0:
            ckpt.save_experts(self.model, k3dir, self.ep_rank, self.ep_size,
                              self.ds.expert_optimizer_state(self.model))

    def load(self, d: Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save` with the same world size and any ep_size that
        divides the experts; returns the saved state (step, history, ...)."""
        d = Path(d)
        self.ds.load(d, is_expert_param)
        weights, opt_state = ckpt.read_experts(d)
        self.ep.load_weights(weights, str(d))
        self.ds.load_expert_optimizer_state(self.model, opt_state)
        state = ckpt.read_state(d / "k3")
        self.balance.load_state_dict(state.get("balance", state.get("coordinator")))
        return state
