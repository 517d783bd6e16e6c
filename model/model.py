"""K3ForCausalLM: embedding, the hybrid KDA/MLA stack with (Block AttnRes or standard) residuals,
final norm, untied head, next-token loss.

Inputs are [B, T] token ids, or one packed row [1, T] with `cu_seqlens` [N + 1] so sequences of
different lengths share a batch without padding. A `CacheBatch` (model/cache.py) turns the
forward into prefill or decode against memory someone else owns.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from k3.kernels.dispatch import eager

from .attn_res import BlockAttnRes, BlockStats, merge_partial, mix_naive
from .cache import CacheBatch
from .config import LOSS_CHUNK_BYTES, K3Config
from .directory import Source
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .moe import GatedMLP, LatentMoE, RouterOutput
from .norm import RMSNorm, rms_norm
from .shard import SequenceShard


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, idx: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[idx]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = KimiDeltaAttention(cfg, idx) if self.kind == "kda" else GatedMLA(cfg, idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.mlp_types[idx] == "moe"
        self.mlp = LatentMoE(cfg, idx) if self.is_moe else GatedMLP(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.idx = idx

    def attention(self, h: torch.Tensor, cu_seqlens: torch.Tensor | None, cache: CacheBatch | None,
                  shard: SequenceShard | None = None) -> torch.Tensor:
        x = self.input_layernorm(h)
        if cache is not None:
            return self.self_attn.forward_cached(x, cache)
        if shard is not None:
            return self.self_attn.forward_shard(x, shard)
        if self.kind == "mla":
            return self.self_attn(x, cu_seqlens)
        return self.self_attn(x, cu_seqlens)[0]

    def feed_forward(self, h: torch.Tensor) -> tuple[torch.Tensor, RouterOutput | None]:
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            return self.mlp(x)
        return self.mlp(x), None


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, vocab] or [len(logits_at), vocab]
    loss: torch.Tensor | None = None
    router: list[RouterOutput] | None = None  # one per MoE layer, in layer order


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_res = (
            BlockAttnRes(cfg.hidden_size, cfg.num_layers, cfg.attn_res_block_size, cfg.rms_norm_eps)
            if cfg.attn_res_block_size is not None else None
        )
        self.activation_checkpointing = False  # recompute each sub-layer in backward (training memory)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                cache: CacheBatch | None = None, collect_router: bool = False,
                inputs_embeds: torch.Tensor | None = None,
                shard: SequenceShard | None = None) -> tuple[torch.Tensor, list[RouterOutput]]:
        # inputs_embeds [B, T, D]: the token embeddings with media features spliced in
        # (K3ForConditionalGeneration); default: the embedding of input_ids. With a shard,
        # input_ids is the whole stream [1, total] and only the shard's tokens run.
        if shard is not None:
            input_ids = shard.local(input_ids)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        routers: list[RouterOutput] = []
        n_moe = sum(1 for layer in self.layers if layer.is_moe)

        def run(l: int, x: torch.Tensor) -> torch.Tensor:
            layer = self.layers[l // 2]
            if l % 2 == 0:
                return layer.attention(x, cu_seqlens, cache, shard)
            out, r = layer.feed_forward(x)
            if r is not None and collect_router and len(routers) < n_moe:  # recompute in backward adds none
                routers.append(r)
            return out

        # Training keeps only what backward cannot cheaply redo: the AttnRes mixing is always
        # recomputed in backward (no bit changes; its fp32 copies of every block were the largest
        # activation after the sub-layers'), and with activation_checkpointing every sub-layer is.
        training = self.training and cache is None and torch.is_grad_enabled()
        recompute = training and self.activation_checkpointing
        if self.attn_res is None:
            for l in range(2 * self.cfg.num_layers):
                h = h + (checkpoint(run, l, h) if recompute else run(l, h))
            return self.norm(h), routers
        return self._attn_res_stack(h, run, training, recompute), routers

    @contextmanager
    def solving_router_bias(self, solve):
        """Inside it, each MoE layer's router calls `solve(moe_index, router_output)` as the forward
        reaches it (margins and counts under the bias in hand) and routes with the bias [E] that
        returns (None: the bias in hand), so the layers after it see the tokens that bias gives them:
        a balancer solves every layer, each for its real inputs, in one forward."""
        gates = [layer.mlp.gate for layer in self.layers if layer.is_moe]
        for i, gate in enumerate(gates):
            gate.rebias = lambda out, i=i: solve(i, out)
        try:
            yield
        finally:
            for gate in gates:
                gate.rebias = None

    def _attn_res_stack(self, h: torch.Tensor, run, training: bool, recompute: bool) -> torch.Tensor:
        """The sub-layers over Block AttnRes (see attn_res.py); run(l, x) is sub-layer l."""
        ar, eps = self.attn_res, self.cfg.rms_norm_eps
        blocks, partial = [h], None
        stats, base = None, 0

        def mixed(l: int, s: int, m, z, hs, partial) -> torch.Tensor:
            return merge_partial(BlockStats(m, z, hs), s, partial, ar.queries[l], eps, h.dtype)

        def mixed_run(l: int, s: int, m, z, hs, partial) -> torch.Tensor:
            return run(l, mixed(l, s, m, z, hs, partial))

        for l in range(ar.num_sublayers):
            if ar.block_start(l):
                blocks.append(partial)
                partial = None
            if l == 0 or ar.block_start(l):
                span = ar.block_range(l)
                queries = ar.queries[span.start:span.stop]
                stats = checkpoint(block_stats, queries, eps, *blocks) if training else \
                    block_stats(queries, eps, *blocks)
                base = l
            if recompute:
                out = checkpoint(mixed_run, l, l - base, *stats, partial)
            elif training:
                out = run(l, checkpoint(mixed, l, l - base, *stats, partial))
            else:
                out = run(l, mixed(l, l - base, *stats, partial))
            partial = out if partial is None else partial + out
        final = blocks + [partial]
        if training:
            return self.norm(checkpoint(lambda q, *b: mix_naive(list(b), q, eps), ar.queries[-1], *final))
        return self.norm(mix_naive(final, ar.queries[-1], eps))


def checkpoint(fn, *args):
    """fn(*args), its activations recomputed in backward (non-reentrant: any outputs, kwargs-free)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def block_stats(queries: torch.Tensor, eps: float, *blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(m, z, h) of BlockStats for a block's sub-layers over the completed blocks."""
    V = torch.stack([b.float() for b in blocks])
    st = BlockStats.compute(V, rms_norm(V, None, eps), queries)
    return st.m, st.z, st.h


# Tensors a K3 model keeps in fp32 whatever dtype it is loaded in: the router (selection and
# balancing arithmetic) and the KDA gate's rates, conv and output norm (recurrent-state arithmetic).
FP32_TENSORS = ("conv_weight", "A_log", "dt_bias", "o_norm_weight", "mlp.gate.weight", "mlp.gate.bias")


def load_dtype(name: str, stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype tensor `name` (stored as `stored`) takes when a model is loaded as `requested`
    (None: as stored)."""
    if name.endswith(FP32_TENSORS):
        return torch.float32
    return requested or stored


INDEX_DTYPES = (torch.int32, torch.int64)  # token ids, labels, offsets and indices


def host_ints(values: list[torch.Tensor]) -> list[int]:
    """0-d tensors as Python ints (bools as 0/1): on the CPU each read as it is (no sync to
    save, and a stack costs more than the reads), on a device all in one host sync."""
    out: list[int] = [0] * len(values)
    on_device = []
    for i, x in enumerate(values):
        if x.device.type == "cpu":
            out[i] = int(x)
        else:
            on_device.append(i)
    by_device: dict[torch.device, list[int]] = {}
    for i in on_device:
        by_device.setdefault(values[i].device, []).append(i)
    for idx in by_device.values():
        for i, x in zip(idx, torch.stack([values[i].to(torch.int64) for i in idx]).tolist()):
            out[i] = x
    return out


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, T] -> (targets [B, T]: position t's is labels[t + 1], -100 at the end of each
    row and, packed, of each sequence; the number of targets that are not -100)."""
    target = torch.full_like(labels, -100)
    target[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        target[0, (cu_seqlens[1:-1] - 1).clamp_min(0)] = -100  # no prediction across a boundary
    return target, (target != -100).sum()


def next_token_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, count) -> torch.Tensor:
    """Cross-entropy of the head's logits (h [B, T, D] @ weight [V, D]^T, in fp32) against target
    [B, T] (-100 ignored), summed and divided by count. The [rows, V] logits exist a chunk of rows
    at a time, in forward and again in backward: the loss keeps only h."""
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    rows = max(1, LOSS_CHUNK_BYTES // (4 * weight.shape[0]))
    total = None
    for i in range(0, flat_h.shape[0], rows):
        args = (flat_h[i:i + rows], weight, flat_t[i:i + rows])
        part = checkpoint(_chunk_ce, *args) if torch.is_grad_enabled() else _chunk_ce(*args)
        total = part if total is None else total + part
    return total / count


def _chunk_ce(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), target, ignore_index=-100, reduction="sum")


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.source: Source | None = None  # where a loader read the weights from (model/directory.py)
        self.model = K3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        nn.init.normal_(self.model.embed_tokens.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters") and not isinstance(m, (nn.Embedding, nn.Linear)):
                m.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: CacheBatch | None = None,
        logits_at: torch.Tensor | None = None,
        collect_router: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        shard: SequenceShard | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T] (or [1, T] packed with cu_seqlens [N + 1]).

        labels: same shape as input_ids, int32 or int64; position t is trained to predict
        labels[t + 1] (-100 ignored; with packing, never across a sequence boundary). Labels
        that leave no target are a ValueError (the mean over none would be NaN).
        logits_at: a 1-D int tensor of flat token indices in [0, tokens) to compute logits for
        (e.g. each sequence's last token); default all (training passes an empty one: the loss
        needs no [T, vocab] logits).
        inputs_embeds: [B, T, hidden] embeddings in the model's dtype to run instead of embedding
        input_ids (which still give the shape and the packing checks).
        shard: this process's piece of a stream split over a group (context parallelism,
        model/shard.py): input_ids and labels are the whole stream [1, total] (its documents are
        the shard's, so no cu_seqlens), the outputs are the piece's, and the loss is the piece's
        share of the stream's mean (the group's losses add up to it).
        """
        cu = cu_seqlens if cache is None else cache.cu_seqlens
        self._check(input_ids, cu, labels, cache, logits_at, inputs_embeds, shard)
        if shard is not None:
            self._check_shard(input_ids, cu_seqlens, cache, inputs_embeds, shard)
        target = count = None
        if labels is not None:  # int32 labels as int64 (cross-entropy's target type), as int32 input_ids are taken
            labels = labels.long()
            target, count = next_token_targets(labels, cu_seqlens) if shard is None else \
                shard.next_token_targets(labels)
        if eager():  # values: a captured graph (the engine's decode step) cannot read them back
            rows = input_ids.numel() if shard is None else shard.end - shard.start
            self._check_values(input_ids, cu, logits_at, rows, inputs_embeds, target, count, documents=cache is None)
        h, routers = self.model(input_ids, cu, cache, collect_router, inputs_embeds, shard)
        loss = None if labels is None else next_token_loss(h, self.lm_head.weight, target, count)
        flat = h.reshape(-1, h.shape[-1])
        logits = self.lm_head(flat if logits_at is None else flat[logits_at])
        if logits_at is None:
            logits = logits.reshape(*h.shape[:2], -1)
        return CausalLMOutput(logits=logits, loss=loss, router=routers if collect_router else None)

    @staticmethod
    def _check_shard(input_ids, cu_seqlens, cache, inputs_embeds, shard: SequenceShard) -> None:
        if cu_seqlens is not None or cache is not None or inputs_embeds is not None:
            raise ValueError("a shard carries its stream's documents and runs text only: no cu_seqlens, cache or "
                             "inputs_embeds with it")
        if input_ids.shape != (1, shard.total):
            raise ValueError(f"with a shard, input_ids is the whole stream [1, {shard.total}], got "
                             f"{tuple(input_ids.shape)}")

    def _check(self, input_ids, cu, labels, cache, logits_at, inputs_embeds, shard=None) -> None:
        """Types, shapes and dtypes of the inputs (free: no value is read; a packed stream's
        longest document is measured in _check_values)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a [B, T] tensor, got {shape}")
        if input_ids.dtype not in INDEX_DTYPES:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.dtype not in INDEX_DTYPES:
                raise ValueError(f"labels must be an int32 or int64 tensor of token ids (-100: no target), got "
                                 f"{getattr(labels, 'dtype', type(labels).__name__)}")
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
            if labels.device != input_ids.device:
                raise ValueError(f"labels is on {labels.device} but input_ids is on {input_ids.device}")
        # a sequence, not a batch, holds positions: a row of [B, T], or a document of a packed stream
        # (cu_seqlens: measured with the values; a shard's documents are host ints already)
        limit = self.cfg.max_position_embeddings
        if shard is not None:
            if shard.longest_document > limit:
                raise ValueError(f"the shard's stream holds a document of {shard.longest_document} tokens > "
                                 f"max_position_embeddings {limit}")
        elif cache is None and cu is None and input_ids.shape[1] > limit:
            raise ValueError(f"input_ids has {input_ids.shape[1]} tokens > max_position_embeddings {limit}")
        if cu is not None:
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in INDEX_DTYPES:
                got = f"{tuple(cu.shape)} {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
                raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor [N + 1], got {got}")
            if input_ids.shape[0] != 1 and cache is None:
                raise ValueError(f"packed input (cu_seqlens given) must be [1, T], got input_ids "
                                 f"{tuple(input_ids.shape)}")
        if logits_at is not None and (not isinstance(logits_at, torch.Tensor) or logits_at.dim() != 1
                                      or logits_at.dtype not in INDEX_DTYPES):
            got = f"{tuple(logits_at.shape)} {logits_at.dtype}" if isinstance(logits_at, torch.Tensor) else \
                type(logits_at).__name__
            raise ValueError(f"logits_at must be a 1-D int32 or int64 tensor of flat token indices, got {got}")
        if inputs_embeds is not None:
            want = (*input_ids.shape, self.cfg.hidden_size)
            if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.shape != want:
                got = tuple(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor) else \
                    type(inputs_embeds).__name__
                raise ValueError(f"inputs_embeds must be [{want[0]}, {want[1]}, {want[2]}], got {got}")
            dtype = self.model.embed_tokens.weight.dtype
            if inputs_embeds.dtype != dtype:
                raise ValueError(f"inputs_embeds must be in the model's dtype {dtype}, got {inputs_embeds.dtype}")
            if inputs_embeds.device != input_ids.device:
                raise ValueError(f"inputs_embeds is on {inputs_embeds.device} but input_ids is on {input_ids.device}")

    def _check_values(self, input_ids, cu, logits_at, rows: int, inputs_embeds, target, count,
                      documents: bool = True) -> None:
        """The values of the inputs, read back in one host sync (rows: the tokens whose logits
        logits_at picks from; target, count: next_token_targets of the labels; documents: cu
        delimits whole documents, each held to the model's positions, not a cache's new tokens)."""
        stats = dict(zip(("lo", "hi"), torch.aminmax(input_ids)))
        if cu is not None:
            stats |= {"cu_first": cu[0], "cu_last": cu[-1], "cu_falls": (cu[1:] < cu[:-1]).any()}
            if documents:
                stats["longest"] = (cu[1:] - cu[:-1]).max()
        if inputs_embeds is not None:
            stats["embeds_bad"] = ~torch.isfinite(inputs_embeds).all()
        if logits_at is not None and logits_at.numel():
            stats |= dict(zip(("at_lo", "at_hi"), torch.aminmax(logits_at)))
        if target is not None:
            stats |= {"t_lo": target.masked_fill(target == -100, 0).min(), "t_hi": target.max()}
            if isinstance(count, torch.Tensor):
                stats["count"] = count
        v = dict(zip(stats, host_ints(list(stats.values()))))
        V = self.cfg.vocab_size
        if v["lo"] < 0 or v["hi"] >= V:
            raise ValueError(f"input_ids out of range [0, {V}): min {v['lo']}, max {v['hi']}")
        if cu is not None and (v["cu_first"] != 0 or v["cu_last"] != input_ids.numel() or v["cu_falls"]):
            raise ValueError(f"cu_seqlens must rise from 0 to {input_ids.numel()}, got {cu.tolist()[:8]}")
        if v.get("longest", 0) > self.cfg.max_position_embeddings:
            raise ValueError(f"cu_seqlens holds a document of {v['longest']} tokens > max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        if v.get("embeds_bad"):
            raise ValueError("inputs_embeds holds NaN or inf")
        if "at_lo" in v and (v["at_lo"] < 0 or v["at_hi"] >= rows):
            raise ValueError(f"logits_at out of range [0, {rows}) (flat token indices): min {v['at_lo']}, "
                             f"max {v['at_hi']}")
        if target is not None:
            if v["t_lo"] < 0 or v["t_hi"] >= V:
                raise ValueError(f"labels out of range [0, {V}) (or -100, no target) where they are targets: "
                                 f"min {v['t_lo']}, max {v['t_hi']}")
            if v.get("count", count) == 0:
                raise ValueError("labels give no targets: every next-token label is -100 (or each sequence has one "
                                 "token), and a mean over none is NaN")

    def set_router_bias(self, biases: torch.Tensor) -> None:
        """biases [num_moe_layers, E]: selection biases for the next batch (no gradient)."""
        moe = [l.mlp for l in self.model.layers if l.is_moe]
        if biases.shape != (len(moe), self.cfg.num_experts):
            raise ValueError(f"biases must be [{len(moe)}, {self.cfg.num_experts}], got {tuple(biases.shape)}")
        with torch.no_grad():
            for m, b in zip(moe, biases):
                m.gate.bias.copy_(b)
