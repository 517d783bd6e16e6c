"""Layer-level contracts: KDA modes, MLA forms, MoE grouping and bias, AttnRes mixing."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from k3.kernels.situ_glu import naive_swiglu, situ_glu
from k3.model import get_preset
from k3.model.attn_res import BlockStats, merge_partial, mix_naive
from k3.model.cache import CacheBatch, KDAPool
from k3.model.kda import SHORT_CHUNK, KimiDeltaAttention, _depthwise, causal_conv1d
from k3.model.mla import GatedMLA
from k3.model.moe import Experts, LatentMoE, read_by_index, tokens_per_expert
from k3.model.norm import rms_norm


def tiny(**kw):
    return get_preset("k3-tiny", **kw)


def kda_batch(layer, lens, context, pool, slots=None, offsets=None, max_new=None):
    """A CacheBatch over one KDA layer's pool (slot i for sequence i unless given; max_new: the
    longest sequence's new tokens unless given, 0 for not known)."""
    cu = torch.tensor([0] + lens).cumsum(0)
    return CacheBatch(cu_seqlens=cu, context_lens=torch.tensor(context),
                      kda_slots=torch.arange(len(lens)) if slots is None else slots, kda={layer.layer_idx: pool},
                      decode=all(n == 1 for n in lens), max_context=max(context),
                      max_new=max(lens) if max_new is None else max_new, snapshot_offsets=offsets or {})


def mla_batch(layer, lens, context, pages, table):
    cu = torch.tensor([0] + lens).cumsum(0)
    return CacheBatch(cu_seqlens=cu, context_lens=torch.tensor(context), page_table=table,
                      mla_pages={layer.layer_idx: pages}, decode=all(n == 1 for n in lens), max_context=max(context))


def build(cls, cfg, seed=0):
    torch.manual_seed(seed)
    m = cls(cfg) if cls is LatentMoE else cls(cfg, 0)
    m.reset_parameters()
    return m.eval()


@pytest.mark.parametrize("gate,og", [("bounded", "full"), ("unbounded", "low_rank")])
def test_kda_prefill_then_decode_equals_one_forward(gate, og):
    cfg = tiny(kda_gate=gate, kda_output_gate=og)
    layer = build(KimiDeltaAttention, cfg)
    x = torch.randn(2, 40, cfg.hidden_size)
    with torch.no_grad():
        full, full_state = layer(x)
        out, st = layer(x[:, :33])
        pool = KDAPool(st.recurrent.clone(), st.conv.clone())
        steps = [out]
        for t in range(33, 40):
            o = layer.forward_cached(x[:, t:t + 1].reshape(1, 2, -1), kda_batch(layer, [1, 1], [t, t], pool))
            steps.append(o.reshape(2, 1, -1))
    assert_close("decode outputs", torch.cat(steps, 1), full, 1e-5)
    assert_close("recurrent state", pool.recurrent, full_state.recurrent, 1e-5)
    assert_close("conv state", pool.conv, full_state.conv, 1e-6)


def test_kda_prefill_in_pieces_and_packed():
    cfg = tiny()
    layer = build(KimiDeltaAttention, cfg)
    x = torch.randn(1, 50, cfg.hidden_size)
    with torch.no_grad():
        full, _ = layer(x)
        a, st = layer(x[:, :2])  # shorter than the conv window: state must carry old inputs
        b, st = layer(x[:, 2:21], state=st)
        c, _ = layer(x[:, 21:], state=st)
        assert_close("pieces", torch.cat([a, b, c], 1), full, 1e-5)
        y = torch.randn(1, 13, cfg.hidden_size)
        packed, _ = layer(torch.cat([x, y], 1), cu_seqlens=torch.tensor([0, 50, 63]))
        alone, _ = layer(y)
    assert_close("packed seq 0", packed[:, :50], full, 1e-5)
    assert_close("packed seq 1", packed[:, 50:], alone, 1e-5)


@pytest.mark.parametrize("q_lora,gate", [(64, True), (None, False)])
def test_mla_absorbed_equals_naive(q_lora, gate):
    cfg = tiny(q_lora_rank=q_lora, mla_output_gate=gate)
    layer = build(GatedMLA, cfg)
    B, T = 2, 21
    x = torch.randn(B, T, cfg.hidden_size)
    with torch.no_grad():
        naive = layer(x)
        # absorbed: a paged cache with page size 8, pages deliberately out of order
        pages = torch.zeros(8, 8, cfg.mla_latent_dim)
        table = torch.tensor([[5, 1, 6], [0, 7, 3]])
        flat = lambda t: t.reshape(1, -1, cfg.hidden_size)  # noqa: E731
        layer.forward_cached(flat(x[:, :5]), mla_batch(layer, [5, 5], [0, 0], pages, table))
        outs = [layer.forward_cached(flat(x[:, t:t + 1]), mla_batch(layer, [1, 1], [t, t], pages, table)).reshape(B, 1, -1)
                for t in range(5, T)]
        # multi-token chunks continuing from a context: 3 tokens (absorbed form), 12 (expanded)
        pages2 = torch.zeros_like(pages)
        layer.forward_cached(flat(x[:, :6]), mla_batch(layer, [6, 6], [0, 0], pages2, table))
        assert layer.absorbs(3, 9, 8)
        short = layer.forward_cached(flat(x[:, 6:9]), mla_batch(layer, [3, 3], [6, 6], pages2, table))
        layer.absorb_below = 12  # 21 keys fit one slice: 12 tokens take the expanded form from 6 on
        assert not layer.absorbs(12, 21, 8)
        chunk = layer.forward_cached(flat(x[:, 9:]), mla_batch(layer, [12, 12], [9, 9], pages2, table))
        # and a mixed batch: one decode row beside a chunk
        pages3 = torch.zeros_like(pages)
        layer.forward_cached(flat(x[:, :9]), mla_batch(layer, [9, 9], [0, 0], pages3, table))
        mixed = layer.forward_cached(torch.cat([x[:1, 9:10], x[1:, 9:]], 1), mla_batch(layer, [1, 12], [9, 9], pages3, table))
    assert_close("absorbed short chunk", short.reshape(B, 3, -1), naive[:, 6:9], 1e-5)
    assert_close("mixed decode row", mixed[:, :1], naive[:1, 9:10], 1e-5)
    assert_close("mixed chunk row", mixed[:, 1:], naive[1:, 9:], 1e-5)
    assert_close("absorbed decode", torch.cat(outs, 1), naive[:, 5:], 1e-5)
    assert_close("expanded chunk", chunk.reshape(B, 12, -1), naive[:, 9:], 1e-5)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize("slice_tokens,context,n", [(8, 9, 12), (16, 37, 20), (8, 3, 16), (24, 50, 31)])
def test_mla_sliced_chunk_equals_naive(monkeypatch, slice_tokens, context, n, form):
    # a chunk over a context longer than one slice runs slice by slice with an online softmax, in
    # either form
    import k3.model.mla as mla

    cfg = tiny()
    layer = build(GatedMLA, cfg)
    layer.absorb_below = 0 if form == "expanded" else n + 1  # the keys span slices: the threshold as it is
    monkeypatch.setattr(mla, "SCORE_BUDGET", cfg.num_heads * n * slice_tokens)
    x = torch.randn(1, context + n, cfg.hidden_size)
    pages = torch.zeros(16, 8, cfg.mla_latent_dim)
    table = torch.randperm(16)[None]  # pages out of order
    with torch.no_grad():
        naive = layer(x)
        layer.forward_cached(x[:, :context], mla_batch(layer, [context], [0], pages, table))
        chunk = layer.forward_cached(x[:, context:], mla_batch(layer, [n], [context], pages, table))
    assert layer.slice_tokens(n, 8) == slice_tokens < context + n
    assert_close("sliced chunk", chunk, naive[:, context:], 1e-5)


def test_mla_packed_matches_separate():
    cfg = tiny()
    layer = build(GatedMLA, cfg)
    a, b = torch.randn(1, 7, cfg.hidden_size), torch.randn(1, 12, cfg.hidden_size)
    with torch.no_grad():
        packed = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 7, 19]))
        assert_close("seq a", packed[:, :7], layer(a), 1e-6)
        assert_close("seq b", packed[:, 7:], layer(b), 1e-6)


def test_kda_projections_of_a_long_chunk_in_one_matmul_equal_three():
    cfg = tiny()
    layer = build(KimiDeltaAttention, cfg)
    for rows in (cfg.hidden_size + 1, 3 * cfg.hidden_size, 5):  # past D rows: one matmul; a few rows: three
        x = torch.randn(rows, cfg.hidden_size)
        want = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
        with torch.no_grad():
            assert_close(f"{rows} rows", layer._qkv_in(x), want, 1e-6)
        assert_close(f"{rows} rows with autograd", layer._qkv_in(x), want, 1e-6)


def test_kda_projections_traced_take_no_guard_on_the_row_count():
    # a traced graph (the decode graphs: rows = the batch, a dynamic dimension) keeps the three
    # projections without comparing its symbolic row count with D: a guard there would recompile
    # once a batch passed D rows
    from torch._dynamo.testing import CompileCounter

    cfg = tiny()
    layer = build(KimiDeltaAttention, cfg)
    counter = CompileCounter()
    fn = torch.compile(layer._qkv_in, backend=counter, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for rows in (3, 8, cfg.hidden_size + 50):
            x = torch.randn(rows, cfg.hidden_size)
            assert_close(f"{rows} rows traced", fn(x), layer._qkv_in(x), 1e-6)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_mla_packed_runs_of_equal_lengths_match_separate():
    """Consecutive sequences of one length attend in one batched call, lone ones alone, empty ones
    not at all: outputs and input gradients equal each sequence run by itself."""
    cfg = tiny()
    layer = build(GatedMLA, cfg)
    lengths = [7, 12, 12, 0, 5, 5, 5, 3, 0]
    x = torch.randn(1, sum(lengths), cfg.hidden_size, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = layer(x, cu_seqlens=cu)
    grad = torch.randn_like(packed)
    (gx,) = torch.autograd.grad((packed * grad).sum(), x)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        if a == b:
            continue
        xs = x[:, a:b].detach().requires_grad_(True)
        alone = layer(xs)
        assert_close(f"seq {i}", packed[:, a:b], alone, 1e-6)
        (gs,) = torch.autograd.grad((alone * grad[:, a:b]).sum(), xs)
        assert_close(f"seq {i} grad", gx[:, a:b], gs, 1e-5)


@pytest.mark.parametrize("latent", [64, None])
def test_grouped_experts_equal_loop(latent):
    cfg = tiny(moe_latent_size=latent)
    moe = build(LatentMoE, cfg)
    x = torch.randn(3, 17, cfg.hidden_size)
    y, r = moe(x)
    moe.experts.forward = moe.experts.forward_loop  # the readable per-expert loop, on this instance
    y2, r2 = moe(x)
    assert torch.equal(r.expert_ids, r2.expert_ids)
    assert_close("moe output", y, y2, 1e-6)
    assert int(r.counts.sum()) == 3 * 17 * cfg.num_experts_per_token


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_tokens_per_expert_counts_as_bincount(dtype):
    ids = torch.randint(0, 6, (37, 3), generator=torch.Generator().manual_seed(0))
    got = tokens_per_expert(ids.to(dtype), 8)
    assert got.dtype == torch.int64 and torch.equal(got, torch.bincount(ids.reshape(-1), minlength=8))
    assert torch.equal(tokens_per_expert(ids[:0], 8), torch.zeros(8, dtype=torch.long))
    with pytest.raises((IndexError, RuntimeError)):  # an id past the experts is not a longer count
        tokens_per_expert(torch.tensor([[1, 8]]), 8)


def test_router_bias_changes_selection_only_and_gets_no_gradient():
    cfg = tiny()
    moe = build(LatentMoE, cfg).train()
    x = torch.randn(64, cfg.hidden_size)
    _, r0 = moe(x)
    bias = torch.zeros(cfg.num_experts)
    bias[3] = 10.0  # expert 3 chosen by every token
    moe.gate.bias.copy_(bias)
    y, r1 = moe(x)
    assert bool((r1.expert_ids == 3).any(-1).all()), "the bias did not change the selection"
    assert not torch.equal(r0.expert_ids, r1.expert_ids)
    # weights are the unbiased scores of the chosen experts, renormalised, times routed_scaling
    chosen = r1.scores.gather(1, r1.expert_ids)
    expect = chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling
    assert_close("weights from unbiased scores", r1.expert_weights, expect, 1e-6)
    assert_close("scores unchanged by bias", r1.scores, r0.scores, 0)
    y.sum().backward()
    assert not moe.gate.bias.requires_grad and moe.gate.bias.grad is None
    assert "gate.bias" not in dict(moe.named_parameters())
    assert moe.gate.weight.grad is not None
    # margins: exactly k experts have a positive margin under the bias that chose them
    biased_margin = r1.margins + moe.gate.bias
    assert bool(((biased_margin > 0).sum(-1) == cfg.num_experts_per_token).all())


def test_attn_res_zero_queries_mix_uniformly():
    srcs = [torch.randn(2, 5, 16) for _ in range(4)]
    out = mix_naive(srcs, torch.zeros(16), 1e-5)
    assert_close("uniform", out, torch.stack(srcs).mean(0), 1e-6)


def test_attn_res_two_phase_equals_one_softmax():
    torch.manual_seed(0)
    blocks = [torch.randn(2, 5, 16) for _ in range(3)]
    partial = torch.randn(2, 5, 16)
    Q = torch.randn(4, 16)
    V = torch.stack(blocks)
    stats = BlockStats.compute(V, rms_norm(V, None, 1e-5), Q)
    for s in range(4):
        assert_close(f"sub-layer {s}", merge_partial(stats, s, partial, Q[s], 1e-5, torch.float32),
                     mix_naive(blocks + [partial], Q[s], 1e-5), 1e-6)
        assert_close(f"sub-layer {s} (block start)", merge_partial(stats, s, None, Q[s], 1e-5, torch.float32),
                     mix_naive(blocks, Q[s], 1e-5), 1e-6)


def test_k3_preset_has_8_depth_slots():
    assert get_preset("k3").attn_res_num_blocks == 8
    assert get_preset("k3").attn_res_block_size == 12
    assert get_preset("kimi-linear-48b-a3b").attn_res_num_blocks == 0


def test_situ_glu_bounds_and_small_signal():
    g = torch.linspace(-1e3, 1e3, 1001)
    h = situ_glu(g, g.flip(0))
    assert h.abs().max() <= 100.0
    small = torch.randn(100) * 1e-2
    assert_close("~SwiGLU near 0", situ_glu(small, small), naive_swiglu(small, small), 1e-2)
    assert situ_glu(torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shape"):
        situ_glu(torch.ones(3), torch.ones(4))


@pytest.mark.parametrize("short", [True, False])
def test_kda_snapshots_are_the_exact_prefix_states(short):
    """A cached forward (snapshots inside it, then a continuation) equals uncached forwards, in
    the short chunks a short batch runs (`short`) and in the config's."""
    cfg = tiny()
    layer = build(KimiDeltaAttention, cfg)
    x = torch.randn(1, 100, cfg.hidden_size)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    pool = KDAPool(torch.zeros(2, H, K, K), torch.zeros(2, 3 * H * K, cfg.kda_conv_size - 1))
    with torch.no_grad():
        cb = kda_batch(layer, [60, 40], [0, 0], pool, offsets={0: [2, 33], 1: [5]}, max_new=None if short else 0)
        assert layer._chunk_size(cb) == (SHORT_CHUNK if short else cfg.kda_chunk_size) and SHORT_CHUNK < cfg.kda_chunk_size
        y = layer.forward_cached(x, cb)
        full0, st0 = layer(x[:, :60])
        assert_close("output unchanged by snapshots", y[:, :60], full0, 1e-5)
        want = {(0, 2): layer(x[:, :2])[1], (0, 33): layer(x[:, :33])[1], (1, 5): layer(x[:, 60:65])[1]}
    snaps = [(s.seq, s.offset, s) for s in cb.snapshots[layer.layer_idx]]
    assert sorted((i, c) for i, c, _ in snaps) == sorted(want)
    assert_close("slot 0 after the chunk", pool.recurrent[0], st0.recurrent[0], 1e-5)
    for i, c, s in snaps:
        assert_close(f"recurrent@{i},{c}", s.recurrent, want[(i, c)].recurrent[0], 1e-5)
        assert_close(f"conv@{i},{c}", s.conv, want[(i, c)].conv[0], 1e-6)
    with torch.no_grad():  # sequence 0 goes on from its slot
        cb = kda_batch(layer, [20], [60], pool, slots=torch.tensor([0]), max_new=None if short else 0)
        more = layer.forward_cached(x[:, 60:80], cb)
        assert_close("continued from the slot", more, layer(x[:, :80])[0][:, 60:], 1e-5)
    assert layer._chunk_size(kda_batch(layer, [200], [0], pool, slots=torch.tensor([0]))) == cfg.kda_chunk_size


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_decode_sized_expert_batches_equal_the_loop(tokens):
    cfg = tiny()
    moe = build(LatentMoE, cfg)
    x = torch.randn(tokens, cfg.hidden_size)
    with torch.no_grad():
        fast, r = moe(x)  # few rows, most experts without one: empty groups in the grouped matmuls
        moe.experts.forward = moe.experts.forward_loop
        slow, _ = moe(x)
    assert_close("grouped vs loop", fast, slow, 1e-6)


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
@pytest.mark.parametrize("first,count", [(0, 16), (8, 8)])
def test_experts_read_by_index_equal_the_loop(activation, first, count):
    cfg = tiny(activation=activation)
    experts = Experts(cfg, cfg.moe_latent_size, first=first, count=count)
    torch.manual_seed(0)
    experts.reset_parameters()
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, cfg.moe_latent_size)
        idx = torch.stack([first + torch.randperm(count)[:cfg.num_experts_per_token] for _ in range(tokens)])
        w = torch.rand(tokens, cfg.num_experts_per_token)
        with torch.no_grad():
            assert_close(f"by index, {tokens} tokens", experts.by_index(x, idx, w), experts.forward_loop(x, idx, w), 1e-6)


def test_which_expert_path_runs():
    one, many, small, large = torch.randn(1, 8), torch.randn(4, 8), 1 << 20, 8 << 20
    assert not read_by_index(one, small)  # autograd on: grouped (the weights' gradient per expert)
    with torch.no_grad():
        assert read_by_index(one, small) and not read_by_index(many, small)  # eagerly: one token only,
        assert not read_by_index(one, large)  # and only while its experts' copy is small
        assert not read_by_index(one.to("meta"), small)  # not a CPU tensor
        traces = []

        def count(gm, example_inputs):
            traces.append(gm)
            return gm.forward

        fixed = torch.compile(lambda t, b: read_by_index(t, b), fullgraph=True, backend="eager", dynamic=False)
        assert fixed(many, large)  # a compiled CPU graph reads them in place,
        assert not fixed(many, 64 << 20)  # not experts of 64 MB a token (behind from 16 tokens),
        assert not fixed(torch.randn(1000, 8), small)  # nor in a graph traced at a long sequence
        batch = torch.randn(2, 8)
        torch._dynamo.mark_dynamic(batch, 0)
        decode = torch.compile(lambda t, b: read_by_index(t, b), fullgraph=True, backend=count)
        assert decode(batch, small) and decode(torch.randn(40, 8), small)  # as the decode graphs:
        assert len(traces) == 1  # traced at 2, one graph for every batch, no guard on the count
        auto = torch.compile(lambda t, b: read_by_index(t, b), fullgraph=True, backend="eager")
        assert auto(torch.randn(3, 8), small)
        assert not auto(torch.randn(1000, 8), small) and not auto(torch.randn(1200, 8), small)  # made dynamic at 1000


def test_a_compiled_inference_graph_reads_the_experts_by_index():
    """No grouped call in a compiled no-grad MoE forward (the decode graphs'), and the same
    output; with autograd on the graph keeps the grouped calls."""
    cfg = tiny()
    moe = build(LatentMoE, cfg)
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    x = torch.randn(6, cfg.hidden_size)
    forward = torch.compile(lambda t: moe(t)[0], backend=record, fullgraph=True)
    torch._dynamo.mark_dynamic(x, 0)  # as the decode graphs' batch
    with torch.no_grad():
        assert_close("compiled by index", forward(x), moe(x)[0], 1e-6)
    forward(x)
    assert [any("grouped_mm" in t for t in g) for g in graphs] == [False, True]


def test_grouped_expert_gradients_equal_the_loop():
    cfg = tiny()
    moe = build(LatentMoE, cfg)
    x = torch.randn(2, 9, cfg.hidden_size)
    grads = []
    for forward in (moe.experts.forward, moe.experts.forward_loop):
        moe.experts.forward = forward
        moe.zero_grad()
        moe(x)[0].pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert_close(n, grads[0][n], grads[1][n], 1e-5)


def test_the_short_conv_is_conv1d_on_cpu_fp32_and_conv1d_itself_elsewhere():
    # the CPU fp32 path (a multiply-add per tap over token-major rows) makes conv1d's sums in its
    # order: the same values; gradients by autograd through it, to rounding
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    for L, C, W in ((131, 96, 4), (5, 16, 3), (4, 8, 4), (40, 24, 2)):
        x = torch.randn(L, C, generator=gen, requires_grad=True)
        w = torch.randn(C, W, generator=gen, requires_grad=True)
        got = _depthwise(x, w)
        want = F.conv1d(x.T[None], w[:, None, :], groups=C)[0].T
        assert got.shape == (L - W + 1, C) and torch.equal(got, want)
        up = torch.randn(want.shape, generator=gen)
        for a, b, name in zip(torch.autograd.grad((got * up).sum(), (x, w)),
                              torch.autograd.grad((want * up).sum(), (x, w)), ("dx", "dw")):
            assert_close(name, a, b, 1e-5)
    xb, wb = torch.randn(30, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    assert torch.equal(_depthwise(xb, wb), F.conv1d(xb.T[None], wb[:, None, :], groups=16)[0].T)
    # packed sequences (one empty, one shorter than the window) continuing from their states:
    # each sequence's windows start in its own state, and its new state is its last 3 inputs
    x, w = torch.randn(23, 12, generator=gen), torch.randn(12, 4, generator=gen)
    state = torch.randn(5, 12, 3, generator=gen)
    cu = torch.tensor([0, 10, 10, 11, 13, 23])
    y, new = causal_conv1d(x, w, state, cu)
    assert y.shape == (23, 12) and new.shape == (5, 12, 3)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ext = torch.cat([state[i].T, x[a:b]])
        if b > a:
            assert torch.equal(y[a:b], F.conv1d(ext.T[None], w[:, None, :], groups=12)[0].T)
        assert torch.equal(new[i], ext[-3:].T)
    y, new = causal_conv1d(x[:0], w, state[:2], torch.tensor([0, 0, 0]))  # no tokens: the states as they were
    assert y.shape == (0, 12) and torch.equal(new, state[:2])
    y, new = causal_conv1d(x[:5], w, None, torch.tensor([0, 5]))  # no state: zeros before the sequence
    assert torch.equal(y, F.conv1d(F.pad(x[:5], (0, 0, 3, 0)).T[None], w[:, None, :], groups=12)[0].T)
    # without autograd the stream's rows past the window are made in place and every row before
    # it is redone from its sequence's state (fewer tokens than the window, an empty first
    # sequence): the same values as through autograd's padded path, and as each sequence alone
    for cu in ([0, 10, 10, 11, 13, 23], [0, 2], [0, 0, 2, 23], [0, 1, 2, 3]):
        T = cu[-1]
        cu = torch.tensor(cu)
        ys = [causal_conv1d(x[:T].requires_grad_(grad), w, state[:len(cu) - 1], cu)[0] for grad in (False, True)]
        assert torch.equal(ys[0], ys[1].detach()) and ys[0].shape == (T, 12)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            ext = torch.cat([state[i].T, x[a:b]])
            if b > a:
                assert torch.equal(ys[0][a:b], F.conv1d(ext.T[None], w[:, None, :], groups=12)[0].T)


@pytest.mark.parametrize("top_k", [2, 3])
def test_routed_experts_with_and_without_autograd_equal_the_loop(top_k):
    # the sorted path (each row gathered straight from its token): eagerly without autograd through
    # the grouped matmuls' own kernels, with it through the custom op; values and gradients against
    # the loop
    cfg = tiny(num_experts_per_token=top_k)
    experts = Experts(cfg, cfg.moe_latent_size)
    torch.manual_seed(1)
    experts.reset_parameters()
    x = torch.randn(37, cfg.moe_latent_size)
    idx = torch.stack([torch.randperm(cfg.num_experts)[:top_k] for _ in range(37)])
    w = torch.rand(37, top_k)
    with torch.no_grad():
        fast, loop = experts(x, idx, w), experts.forward_loop(x, idx, w)
        # the sums of one index_add over the (token, slot) rows in order, bit for bit (a training
        # run's trajectory depends on them: tests/platform/test_qb_training.py)
        token = torch.arange(37).repeat_interleave(top_k)
        rows = experts.grouped(x[token], idx.reshape(-1)) * w.reshape(-1, 1)
        assert torch.equal(fast, torch.zeros_like(x).index_add(0, token, rows))
    assert_close("no autograd", fast, loop, 1e-6)
    grads = []
    for fn in (experts.forward, experts.forward_loop):
        xg = x.clone().requires_grad_()
        y = fn(xg, idx, w)
        if fn == experts.forward:
            assert torch.equal(y.detach(), fast)  # the same numbers either way
        y.square().sum().backward()
        grads.append([xg.grad] + [p.grad.clone() for p in (experts.w_gate, experts.w_up, experts.w_down)])
        experts.zero_grad()
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), *grads):
        assert_close(name, a, b, 1e-5)



def test_mla_short_chunks_take_the_absorbed_form_where_it_does_less_work():
    # the forms cost the same per key at 170 new tokens with K3's dims, 64 with k3-tiny's; while
    # the keys fit one fused SDPA call (one slice) the expanded form is taken from half that
    with torch.device("meta"):
        k3, tiny_layer = GatedMLA(get_preset("k3"), 0), GatedMLA(get_preset("k3-tiny"), 3)
    assert (k3.absorb_below, tiny_layer.absorb_below) == (170, 64)
    assert k3.absorbs(169, 10**6, 64) and not k3.absorbs(170, 10**6, 64)
    assert k3.slice_tokens(84, 64) == 512 and k3.absorbs(84, 300, 64) and not k3.absorbs(85, 300, 64)
    assert tiny_layer.absorbs(31, 2048 + 31, 16) and not tiny_layer.absorbs(32, 2048 + 32, 16)
    assert tiny_layer.absorbs(48, 8192 + 48, 16) and not tiny_layer.absorbs(64, 8192 + 64, 16)
