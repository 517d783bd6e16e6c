"""MLA over latents in key slices (model/mla_span.py) against dense masked attention: output and
the gradients of the queries, the latents and kv_b_proj's weight, with several documents,
queries reaching back over earlier keys, and tiles small enough that most need a mask."""
from __future__ import annotations

import pytest
import torch

import k3.model.mla_span as mla_span
from k3.model.mla_span import expand_latents, latent_span_attention

H, NOPE, ROPE, V, L = 3, 8, 4, 6, 10
DIMS = (H, NOPE, ROPE, V)


def dense(q, lat, w, spans, scale):
    """Every key expanded at once, one [n, S] mask: the reference."""
    k, v = expand_latents(lat, w, DIMS)
    n, S = q.shape[1], lat.shape[0]
    visible = torch.zeros(n, S, dtype=torch.bool)
    for q0, q1, k0, k1 in spans:
        diag = k1 - (q1 - q0)
        for i in range(q0, q1):
            visible[i, k0: diag + (i - q0) + 1] = True
    score = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(score, -1) @ v


def inputs(n, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, n, NOPE + ROPE, generator=g, dtype=torch.float64)
    lat = torch.randn(S, L + ROPE, generator=g, dtype=torch.float64)
    w = torch.randn(H * (NOPE + V), L, generator=g, dtype=torch.float64) / L ** 0.5
    return q, lat, w


# (n queries, S keys, spans): one piece reaching back over everything before it; documents, one
# starting inside the piece, one crossing in from before it; a piece whose queries see exactly
# their own keys (rank 0)
CASES = [
    (20, 57, [(0, 20, 0, 57)]),
    (24, 50, [(0, 7, 0, 33), (7, 19, 33, 45), (19, 24, 45, 50)]),
    (16, 16, [(0, 16, 0, 16)]),
]


@pytest.mark.parametrize("budget,k_slice", [(H * 4 * 8, 8), (H * 5 * 7, 7), (2**22, 2048)])
@pytest.mark.parametrize("n,S,spans", CASES)
def test_sliced_equals_dense_with_gradients(monkeypatch, n, S, spans, budget, k_slice):
    monkeypatch.setattr(mla_span, "TILE_SCORES", budget)
    monkeypatch.setattr(mla_span, "K_SLICE", k_slice)
    q, lat, w = inputs(n, S)
    scale = (NOPE + ROPE) ** -0.5
    grad = torch.randn(H, n, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got_in = [t.clone().requires_grad_() for t in (q, lat, w)]
    ref_in = [t.clone().requires_grad_() for t in (q, lat, w)]
    got = latent_span_attention(*got_in, spans, DIMS, scale)
    ref = dense(*ref_in, spans, scale)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    (got * grad).sum().backward()
    (ref * grad).sum().backward()
    for name, a, b in zip(("q", "lat", "w_kv"), got_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad of {name}: {m}")


def test_keys_nobody_sees_get_no_gradient():
    q, lat, w = inputs(6, 30)
    lat.requires_grad_()
    latent_span_attention(q, lat, w, [(0, 6, 10, 30)], DIMS, 0.3).sum().backward()
    assert lat.grad[:10].abs().max() == 0 and lat.grad[10:].abs().max() > 0


def test_float32_matches_float64():
    q, lat, w = inputs(33, 70)
    spans = [(0, 33, 0, 70)]
    got = latent_span_attention(q.float(), lat.float(), w.float(), spans, DIMS, 0.3)
    torch.testing.assert_close(got.double(), dense(q, lat, w, spans, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,message", [
    (lambda q, lat, w: (q[:, :, :5], lat, w, [(0, 4, 0, 9)]), "q has shape"),
    (lambda q, lat, w: (q, lat[:, :7], w, [(0, 4, 0, 9)]), "lat has shape"),
    (lambda q, lat, w: (q, lat, w, [(0, 4, 0, 3)]), "does not fit"),
    (lambda q, lat, w: (q, lat, w, [(0, 5, 0, 9)]), "does not fit"),
])
def test_bad_shapes_and_spans_name_the_problem(change, message):
    q, lat, w = inputs(4, 9)
    a, b, c, spans = change(q, lat, w)
    with pytest.raises(ValueError, match=message):
        latent_span_attention(a, b, c, spans, DIMS, 0.3)


@pytest.mark.parametrize("rank", [1, 2])
def test_a_later_piece_of_the_mla_layer_equals_the_packed_layer(rank):
    """GatedMLA.forward_shard on piece `rank` of a stream of three documents (one crossing both
    piece bounds), the other pieces' latents standing in for the group's all-gather: the piece's
    output and the gradients of its input and of every weight equal the packed layer's."""
    from k3.model import get_preset
    from k3.model.mla import GatedMLA
    from k3.model.shard import SequenceShard

    cfg = get_preset("k3-tiny")
    torch.manual_seed(0)
    layer = GatedMLA(cfg, 3).double()
    layer.reset_parameters()
    bounds, cu = (0, 40, 80, 120), torch.tensor([0, 25, 95, 120])
    x = torch.randn(1, 120, cfg.hidden_size, dtype=torch.float64)
    grad = torch.randn(1, 120, cfg.hidden_size, dtype=torch.float64)
    s, e = bounds[rank], bounds[rank + 1]

    ref_x = x.clone().requires_grad_()
    (layer(ref_x, cu_seqlens=cu)[:, s:e] * grad[:, s:e]).sum().backward()
    ref = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    ref_out = layer(x, cu_seqlens=cu)[:, s:e]
    layer.zero_grad()

    with torch.no_grad():
        others = layer.latent(x[0])  # every piece's latents, as the other processes would send them

    def gather(t):  # [width, *] per piece; this piece's own rows keep their graph
        rows = [others[a:b] for a, b in zip(bounds, bounds[1:])]
        rows[rank] = t
        return torch.stack(rows)

    piece = x[:, s:e].clone().requires_grad_()
    out = layer.forward_shard(piece, SequenceShard(rank, bounds, cu, gather))
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    (out * grad[:, s:e]).sum().backward()
    torch.testing.assert_close(piece.grad, ref_x.grad[:, s:e], rtol=1e-9, atol=1e-12)
    # this piece's share of each weight's gradient: the packed reference's, whose other pieces'
    # latents were held fixed here (they belong to the other processes), for the weights that
    # only touch this piece's tokens; kv_b_proj and the query side see every key the piece reads
    for name in ("q_proj.weight", "q_a_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight",
                 "g_proj.weight"):
        p = dict(layer.named_parameters()).get(name)
        if p is not None:
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("n,S", [(1, 1), (5, 5), (1, 9), (4, 37), (16, 16), (16, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bottom_right_sdpa_is_torchs_causal_lower_right_bit_for_bit(n, S, dtype):
    # The chunked prefill's attention (queries are the last n of S positions) without importing
    # torch.nn.attention.bias: the same numbers as torch's own bias, to the bit.
    from torch.nn.attention.bias import causal_lower_right

    from k3.model.mla import sdpa_bottom_right

    g = torch.Generator().manual_seed(n * 100 + S)
    q, k, v = (torch.randn(1, 3, m, 24, generator=g).to(dtype) for m in (n, S, S))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, S), scale=0.3)
    assert torch.equal(sdpa_bottom_right(q, k, v, 0.3), want)


def test_importing_the_model_leaves_torch_dynamo_unimported():
    # torch._dynamo costs ~2 s to import: what only a GPU or a compile needs stays out of the
    # model's import (a CLI, a job's driver and every worker import it).
    import subprocess
    import sys

    probe = "import sys, k3.model, k3.model.model; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
