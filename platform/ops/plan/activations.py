"""Bytes per token that a K3 model's training forward keeps for its backward, read off the code.

Each function counts the tensors autograd saves in one part of `k3.model` (and the kernels it
calls) for one token, in the model's dtype `b` bytes (2 for bf16, 4 for fp32) with fp32 where the
code computes in fp32 (`F` = 4). A `.float()` of a bf16 tensor is a copy autograd may keep; of an
fp32 tensor it is the same tensor, so several terms depend on whether b == F. The counts were
checked tensor by tensor against `torch.autograd.graph.saved_tensors_hooks` on k3-tiny in fp32
and bf16 (tests/platform/test_plan.py keeps that check).

The chunked KDA kernel saves a different set per backend: the CPU path keeps the state entering
each chunk (and recomputes the rest), the Triton path keeps its WY/UT intermediates (G, Aqk,
Tinv, u, w). `backend` picks which ("cpu" or "triton").
"""
from __future__ import annotations

from k3.model.config import LOSS_CHUNK_BYTES, K3Config
from k3.model.mla_span import K_SLICE, TILE_SCORES

F = 4  # fp32
I64 = 8


def _copy(b: int, n: int) -> int:
    """Bytes of an fp32 copy of n values that exists only when the model is not fp32."""
    return n * F if b != F else 0


def _rms_norm(n: int, b: int, weighted: bool) -> int:
    """rms_norm over n values: the fp32 input (a copy unless b is fp32; otherwise the caller's
    tensor, counted by the caller), the reciprocal root, and the normalised values before the
    weight when there is one."""
    return _copy(b, n) + F + (n * F if weighted else 0)


def kda_layer(cfg: K3Config, b: int, backend: str) -> int:
    """One KDA attention sub-layer (model/kda.py `_chunkwise`, then `_out`)."""
    D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    HK, C = H * K, cfg.kda_chunk_size
    n = D * b  # x, read by every projection
    n += 3 * HK * b  # the conv's input, after W-1 zero rows (a sequence's first rows redone: per sequence)
    n += 2 * 3 * HK * b  # SiLU input and output (v is a view of the output)
    n += 2 * (H * F + _copy(b, HK) + HK * b)  # l2norm of q and k: the norms, the fp32 copies, the outputs
    n += K * b + 3 * HK * F  # decay: the low-rank z, z in fp32, its squashed form, g
    n += H * F  # beta
    if backend == "triton":
        n += H * (2 * K + 2 * C + K) * F  # G, Aqk, Tinv, u, w (V == K in every preset)
    else:
        n += H * K * K * F // C  # the state entering each chunk
    n += 4 * HK * F + H * F + HK * b  # o, its norm, the weighted norm, sigmoid(gate), o_proj's input
    if cfg.kda_output_gate == "low_rank":
        n += K * b
    return n


def mla_layer(cfg: K3Config, b: int) -> int:
    """One Gated MLA attention sub-layer in the naive (training) form (model/mla.py `_naive`)."""
    D, H = cfg.hidden_size, cfg.num_heads
    L, R, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    dqk = cfg.qk_head_dim
    n = D * b
    # kv_a's output in fp32 (the copy of c, or the whole fp32 output c is a view of), the norm, the latent
    n += (L * F if b != F else (L + R) * F) + F + L * F + (L + R) * b
    if cfg.q_lora_rank is not None:
        Q = cfg.q_lora_rank
        n += Q * F + F + Q * F + Q * b
    dv = max(V, dqk)  # v is zero-padded to the q/k head width for SDPA's fused kernel
    n += H * dqk * b * 2 + H * dv * b * 2 + H * F  # SDPA: q, k, v, its output, the log-sum-exp
    if cfg.mla_output_gate:
        n += H * V * F + (H * V * b if b != F else 0) + H * V * b  # sigmoid(gate), its cast, o_proj's input
    else:
        n += H * V * b
    return n


def glu(cfg: K3Config, b: int, width: int) -> int:
    """The gated activation over `width` values and the down projection's input: SiTU-GLU's
    kernel keeps gate and up; SwiGLU (plain torch in fp32) keeps their fp32 forms and SiLU's."""
    if cfg.activation == "situ_glu":
        return 3 * width * b
    return 3 * width * F + width * b


def dense_mlp(cfg: K3Config, b: int, width: int) -> int:
    """A gated MLP of `width` (the dense layer, or the fused shared experts): its input and the
    gated activation."""
    return cfg.hidden_size * b + glu(cfg, b, width)


def moe_layer(cfg: K3Config, b: int) -> int:
    """One LatentMoE sub-layer (model/moe.py), routed rows counted at top-k per token."""
    D, E, k, Im = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    De = cfg.moe_latent_size or D
    n = D * b + _copy(b, D) + E * F  # x, its fp32 copy for the router, the sigmoid scores
    n += (k + 1) * I64 + k * F + F  # top-k ids (a slice of k+1), the gathered scores, their sum
    n += 2 * k * I64  # the sort order and each sorted row's token
    n += k * De * b + glu(cfg, b, k * Im)  # the sorted rows, each expert's gate, up and activation
    n += 2 * k * De * b + k * (F if b == F else b)  # expert outputs, back in token order; the weights
    if cfg.moe_latent_size is not None:
        n += (De * F if b != F else De * b) + F + De * F + De * b  # latent RMSNorm and latent_up's input
    if cfg.num_shared_experts:
        n += dense_mlp(cfg, b, Im * cfg.num_shared_experts) - D * b  # x is counted above
    return n


def pre_norm(cfg: K3Config, b: int) -> int:
    """A sub-layer's input RMSNorm: its fp32 input (the input itself in fp32), the root, the
    normalised values before the weight."""
    D = cfg.hidden_size
    return _rms_norm(D, b, True) + (D * F if b == F else 0)


def sublayers(cfg: K3Config, b: int, backend: str) -> list[int]:
    """Bytes per token of every sub-layer in order (attention side, then MLP side, per layer),
    its input norm included."""
    out = []
    for kind, mlp in zip(cfg.layer_types, cfg.mlp_types):
        out.append(pre_norm(cfg, b) + (kda_layer(cfg, b, backend) if kind == "kda" else mla_layer(cfg, b)))
        out.append(pre_norm(cfg, b) + (moe_layer(cfg, b) if mlp == "moe" else dense_mlp(cfg, b, cfg.intermediate_size)))
    return out


def residuals(cfg: K3Config, b: int, checkpointing: bool) -> int:
    """What the residual path keeps outside the sub-layers. With Block AttnRes the mixing is
    recomputed in backward (model/model.py), so what stays is each sub-layer's block statistics
    (max, normaliser and weighted sum over the completed blocks, fp32), the embedding's output, and
    each partial sum a later sub-layer merges with (a block's last one is the block); checkpointing
    adds nothing there. With standard residuals, checkpointing keeps each sub-layer's input. Then
    the final norm."""
    D, L = cfg.hidden_size, cfg.num_layers
    n = I64  # the embedding's ids
    final_norm = _rms_norm(D, b, True) + (D * F if b == F else 0)
    if cfg.attn_res_block_size is None:
        return n + (2 * L * D * b if checkpointing else 0) + final_norm
    per_block = 2 * cfg.attn_res_block_size
    n += D * b  # the embedding's output: the first source of every mixture
    for i in range(-(-2 * L // per_block)):
        S = min(per_block, 2 * L - i * per_block)
        n += S * (2 * F + D * F)  # per sub-layer: the logits' max, the normaliser, the weighted sum
        n += S * D * b  # the partial sums merged with, the last of them the completed block
    return n + final_norm


def loss(cfg: K3Config, b: int) -> int:
    """lm_head's input and the targets: the loss computes a chunk of rows' logits at a time and
    recomputes them in backward (model/model.py `next_token_loss`), so no logits are kept."""
    return cfg.hidden_size * b + I64


def loss_transient(cfg: K3Config, b: int, tokens: int) -> int:
    """The loss's peak beside what it keeps, for `tokens` tokens: one chunk of rows at a time
    (LOSS_CHUNK_BYTES of fp32 logits, model/model.py `next_token_loss`). While a chunk's gradient
    is built (the checkpointed chunk recomputed) three fp32 [rows, vocab] tensors are live: the
    log-softmax its backward keeps, the gradient arriving at it and the gradient leaving it for the
    logits; in bf16 the logits' copy in the model dtype besides. Measured on k3-tiny in fp32 (the
    long-context sweep, docs/benchmarks.md): 3.2 chunks above the kept tensors at 4K tokens."""
    rows = min(tokens, max(1, LOSS_CHUNK_BYTES // (F * cfg.vocab_size)))
    return rows * cfg.vocab_size * (3 * F + (b if b != F else 0))


def mla_key_span(cfg: K3Config, b: int) -> int:
    """Bytes per key position that one Gated MLA layer keeps beyond its own tokens when its keys
    reach back over earlier context-parallel shards (model/mla.py `forward_shard`): the gathered
    latent (kv_lora + rope values). Keys and values are expanded a slice at a time, in the forward
    and again in the backward (model/mla_span.py), and never kept."""
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * b


def mla_key_span_peak(cfg: K3Config, b: int) -> int:
    """Bytes per key position of that reach while the layer's backward runs: the kept latent, its
    gradient accumulated in fp32 (model/mla_span.py) and the all-gather's gradient in the model
    dtype before it is reduce-scattered to the latents' owners."""
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (2 * b + F)


def mla_tile_transient(cfg: K3Config) -> int:
    """The sliced attention's working set beside its reach (model/mla_span.py): one slice's keys
    and values expanded, with their gradients, and one tile's fp32 scores with their gradient."""
    per_key = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * F
    return 2 * K_SLICE * per_key + 2 * TILE_SCORES * F
