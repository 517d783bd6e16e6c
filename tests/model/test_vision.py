"""MoonViT-V2 and K3ForConditionalGeneration against plain references (tiny preset, CPU)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

from k3.model import K3Config, K3ForConditionalGeneration, get_preset
from k3.model.norm import rms_norm
from k3.model.params import count_vision_parameters
from k3.model.vision import Rope2D, sd2_tpool
from k3.model.vision_config import K3VisionConfig

PAD = 6  # k3-tiny-vl's media placeholder id


def tiny_model(seed: int = 0) -> K3ForConditionalGeneration:
    torch.manual_seed(seed)
    return K3ForConditionalGeneration(get_preset("k3-tiny-vl")).eval()


def patches(grids, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g)


def item_slices(grids):
    off, out = 0, []
    for t, h, w in grids:
        out.append(slice(off, off + t * h * w))
        off += t * h * w
    return out


# Different sizes, an exact match of the 8x8 position table, a 4-frame and a 3-frame chunk.
MIXED = [(1, 4, 6), (1, 8, 8), (4, 4, 4), (1, 2, 2), (3, 6, 2), (1, 10, 4)]


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 2, 0, 4, 1, 3]])
def test_packed_items_equal_each_alone(order):
    model = tiny_model()
    grids = [MIXED[i] for i in order]
    pv = patches(MIXED)
    sl = item_slices(MIXED)
    packed_pv = torch.cat([pv[sl[i]] for i in order])
    with torch.no_grad():
        packed = model.encode_media(packed_pv, grids)
        for row, i in zip(packed, order):
            alone = model.encode_media(pv[sl[i]], [MIXED[i]])[0]
            assert_close(f"item {MIXED[i]}", row, alone, 1e-5)


def rope_reference(row: int, col: int, head_dim: int) -> torch.Tensor:
    f = [10000.0 ** (-4 * i / head_dim) for i in range(head_dim // 4)]
    return torch.tensor([(col if j % 2 == 0 else row) * f[j // 2] for j in range(head_dim // 2)])


@pytest.mark.parametrize("grid", [(1, 3, 5), (4, 2, 7), (2, 6, 1)])
def test_rotary_depends_only_on_row_and_column(grid):
    rope = Rope2D(head_dim=32, max_grid=64)
    t, h, w = grid
    ang = rope.angles([grid]).view(t, h, w, -1)
    for f in range(t):
        for r in range(h):
            for c in range(w):
                torch.testing.assert_close(ang[f, r, c], rope_reference(r, c, 32), rtol=1e-6, atol=1e-5)
    # relative property: q.k after rotation depends on the (row, column) offset only
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)
    big = rope.angles([(1, 9, 9)]).view(9, 9, -1)

    def score(a, b):
        return float((Rope2D.rotate(q, big[a][None]) * Rope2D.rotate(k, big[b][None])).sum())

    assert math.isclose(score((1, 2), (3, 5)), score((4, 4), (6, 7)), rel_tol=1e-4, abs_tol=1e-5)


def test_time_embedding_only_when_more_than_one_frame():
    model = tiny_model()
    pe = model.vision_tower.patch_embed.pos_emb
    D = pe.weight.shape[-1]
    omega = 1.0 / 10000.0 ** (torch.arange(D // 2).double() / (D / 2))
    ref_time = torch.cat([(torch.arange(4).double()[:, None] * omega).sin(),
                          (torch.arange(4).double()[:, None] * omega).cos()], dim=1).float()
    torch.testing.assert_close(pe.time_table(), ref_time)
    zeros = lambda n: torch.zeros(n, D)  # noqa: E731
    with torch.no_grad():
        one = pe(zeros(8 * 8), [(1, 8, 8)])
        torch.testing.assert_close(one, pe.weight.flatten(0, 1))  # matching grid: table as is, no time term
        three = pe(zeros(3 * 8 * 8), [(3, 8, 8)]).view(3, 64, D)
        for f in range(3):
            torch.testing.assert_close(three[f], pe.weight.flatten(0, 1) + ref_time[f])
        with pytest.raises(ValueError, match="init_pos_emb_time"):
            pe(zeros(5 * 4), [(5, 2, 2)])


def bilinear_reference(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Half-pixel-centre bilinear resampling of table [H0, W0, D] to [h, w, D], by hand."""
    H0, W0, _ = table.shape

    def taps(n_out, n_in, i):
        x = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        lo = min(int(math.floor(x)), n_in - 1)
        return lo, min(lo + 1, n_in - 1), x - lo

    out = torch.empty(h, w, table.shape[-1])
    for i in range(h):
        y0, y1, wy = taps(h, H0, i)
        for j in range(w):
            x0, x1, wx = taps(w, W0, j)
            top = table[y0, x0] * (1 - wx) + table[y0, x1] * wx
            bot = table[y1, x0] * (1 - wx) + table[y1, x1] * wx
            out[i, j] = top * (1 - wy) + bot * wy
    return out


@pytest.mark.parametrize("hw", [(4, 6), (12, 3), (8, 8)])
def test_position_table_interpolated_bilinearly(hw):
    pe = tiny_model().vision_tower.patch_embed.pos_emb
    with torch.no_grad():
        got = pe.spatial(*hw).view(*hw, -1)
        assert_close(f"pos {hw}", got, bilinear_reference(pe.weight, *hw), 1e-6)


def sd2_tpool_reference(x: torch.Tensor, grid, kernel) -> torch.Tensor:
    t, h, w = grid
    kh, kw = kernel
    v = x.view(t, h, w, -1)
    rows = []
    for i in range(h // kh):
        for j in range(w // kw):
            parts = [v[:, i * kh + a, j * kw + b].mean(0) for a in range(kh) for b in range(kw)]
            rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(4, 2, 4), (1, 6, 2), (3, 4, 4)]])
def test_sd2_tpool_equals_loop_reference(grids):
    x = torch.randn(sum(t * h * w for t, h, w in grids), 5)
    ref = torch.cat([sd2_tpool_reference(x[s], g, [2, 2]) for s, g in zip(item_slices(grids), grids)])
    torch.testing.assert_close(sd2_tpool(x, grids, [2, 2]), ref)
    with pytest.raises(ValueError, match="merge_kernel_size"):
        sd2_tpool(torch.randn(6, 5), [(1, 3, 2)], [2, 2])


def test_projector_equals_plain_reference():
    proj = tiny_model().mm_projector
    x = torch.randn(7, 4 * 64)
    w0, w2, g = proj.proj[0].weight, proj.proj[2].weight, proj.post_norm.weight
    hid = x @ w0.T
    hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))  # exact GELU
    y = hid @ w2.T
    ref = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    with torch.no_grad():
        assert_close("projector", proj(x), ref, 1e-6)


def tower_reference(model: K3ForConditionalGeneration, pv: torch.Tensor, grid) -> torch.Tensor:
    """One item through the tower written out: explicit softmax attention, no packing."""
    vt, cfg = model.vision_tower, model.cfg.vision_config
    t, h, w = grid
    x = F.conv2d(pv, vt.patch_embed.proj.weight, stride=14).flatten(1)
    pos = bilinear_reference(vt.patch_embed.pos_emb.weight, h, w).view(h * w, -1)
    x = x + (pos if t == 1 else (pos[None] + vt.patch_embed.pos_emb.time_table()[:t, None]).reshape(-1, x.shape[1]))
    ang = torch.stack([rope_reference(r, c, cfg.head_dim) for _ in range(t) for r in range(h) for c in range(w)])
    H, K = cfg.vt_num_attention_heads, cfg.head_dim
    for blk in vt.encoder.blocks:
        y = rms_norm(x, blk.norm0.weight, cfg.vt_rms_norm_eps)
        q, k, v = (y @ blk.wqkv.weight.T).view(-1, 3, H, K).unbind(1)
        q, k = Rope2D.rotate(q, ang), Rope2D.rotate(k, ang)
        att = torch.softmax(torch.einsum("nhk,mhk->hnm", q, k) / math.sqrt(K), dim=-1)
        x = x + torch.einsum("hnm,mhk->nhk", att, v).reshape(-1, H * K) @ blk.wo.weight.T
        y = rms_norm(x, blk.norm1.weight, cfg.vt_rms_norm_eps)
        x = x + F.gelu(y @ blk.mlp.fc0.weight.T, approximate="tanh") @ blk.mlp.fc1.weight.T
    x = rms_norm(x, vt.encoder.final_layernorm.weight, cfg.vt_rms_norm_eps)
    return sd2_tpool_reference(x, grid, [2, 2])


@pytest.mark.parametrize("grid", [(1, 4, 6), (4, 2, 4)])
def test_tower_equals_written_out_reference(grid):
    model = tiny_model()
    pv = patches([grid])
    with torch.no_grad():
        assert_close(f"tower {grid}", model.vision_tower(pv, [grid]), tower_reference(model, pv, grid), 1e-5)


def prompt_ids(counts: list[int], seed: int = 3) -> torch.Tensor:
    """Text tokens (ids >= 7) with a placeholder run of each count between them."""
    g = torch.Generator().manual_seed(seed)
    ids = [1]
    for n in counts:
        ids += torch.randint(7, 4096, (3,), generator=g).tolist() + [PAD] * n
    return torch.tensor([ids + torch.randint(7, 4096, (4,), generator=g).tolist()])


def test_full_forward_equals_hand_spliced():
    model = tiny_model()
    grids = [(1, 4, 6), (4, 4, 4), (1, 2, 2)]
    pv = patches(grids)
    with torch.no_grad():
        feats = model.encode_media(pv, grids)
        ids = prompt_ids([f.shape[0] for f in feats])
        out = model(ids, pv, grids, labels=ids)
        emb = model.language_model.model.embed_tokens(ids).clone()
        rows = iter(torch.cat(feats))
        for pos in range(ids.shape[1]):
            if ids[0, pos] == PAD:
                emb[0, pos] = next(rows)
        ref = model.language_model(ids, inputs_embeds=emb)
        assert_close("logits", out.logits, ref.logits, 1e-6)
        # loss on text tokens only: targets that are placeholders are left out
        target = ids[0, 1:].clone()
        target[target == PAD] = -100
        ref_loss = F.cross_entropy(ref.logits[0, :-1], target, ignore_index=-100)
        assert_close("loss", out.loss, ref_loss, 1e-6)
        # media_embeds (the serving path) gives the same logits
        assert_close("media_embeds", model(ids, media_embeds=torch.cat(feats)).logits, out.logits, 1e-6)


@pytest.mark.parametrize("extra", [-1, 1])
def test_placeholder_count_mismatch_names_both_counts(extra):
    model = tiny_model()
    grids = [(1, 4, 4)]
    ids = prompt_ids([4 + extra])
    with pytest.raises(ValueError, match=rf"{4 + extra} media placeholder tokens.*but 4 media feature rows"):
        model(ids, patches(grids), grids)


@pytest.mark.parametrize("bad, match", [
    (dict(pixel_values=torch.randn(4, 3, 7, 7), grid_thws=[(1, 2, 2)]), r"\[N, 3, 14, 14\]"),
    (dict(pixel_values=torch.randn(5, 3, 14, 14), grid_thws=[(1, 2, 2)]), "5 patches but grid_thws cover 4"),
    (dict(pixel_values=torch.randn(4, 3, 14, 14)), "go together"),
    (dict(pixel_values=torch.randn(4, 3, 14, 14), grid_thws=[(0, 2, 2)]), r"grid_thws\[0\]"),
])
def test_bad_media_inputs(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_model()(prompt_ids([1]), **bad)


def test_text_only_training_step_reaches_every_vision_parameter():
    model = tiny_model().train()
    ids = prompt_ids([])
    model(ids, labels=ids).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing[:5]


# The release checkpoint's vision tensors (K3 vision_config), shapes as published.
RELEASE_SHAPES = {
    "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
    "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
    "vision_tower.encoder.final_layernorm.weight": (1024,),
    "mm_projector.proj.0.weight": (4096, 4096),
    "mm_projector.proj.2.weight": (7168, 4096),
    "mm_projector.post_norm.weight": (7168,),
    **{f"vision_tower.encoder.blocks.{i}.{n}.weight": s for i in range(27) for n, s in
       (("norm0", (1024,)), ("wqkv", (4608, 1024)), ("wo", (1024, 1536)), ("norm1", (1024,)),
        ("mlp.fc0", (4096, 1024)), ("mlp.fc1", (1024, 4096)))},
}


def test_full_tower_matches_release_shapes():
    cfg = get_preset("k3")
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters() if not n.startswith("language_model.")}
    assert ours == RELEASE_SHAPES
    c = count_vision_parameters(cfg)
    assert c.tower + c.projector == sum(math.prod(s) for s in RELEASE_SHAPES.values()) == 447_358_976


def test_vision_config_round_trips_and_rejects_bad_fields():
    cfg = get_preset("k3-tiny-vl")
    assert K3Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        K3VisionConfig.from_dict({"vt_hidden": 3})
    with pytest.raises(ValueError, match="qkv_hidden_size"):
        K3VisionConfig(qkv_hidden_size=1000)
    with pytest.raises(ValueError, match="text_hidden_size 7168 != hidden_size 128"):
        get_preset("k3-tiny").replace(vision_config=K3VisionConfig(), media_placeholder_token_id=6)


@pytest.mark.parametrize("field,value", [
    ("attn_bias", "false"), ("patch_embed_proj_bias", 1), ("patch_size", 14.0), ("vt_hidden_size", True),
    ("projector_ln_eps", float("nan")), ("vt_rms_norm_eps", -1e-6), ("vt_rms_norm_eps", "1e-6"),
    ("merge_kernel_size", [2, True]), ("merge_kernel_size", "22"), ("norm_type", None),
])
def test_vision_config_fields_of_the_wrong_type_or_range_name_the_field(field, value):
    d = get_preset("k3-tiny-vl").to_dict()
    d["vision_config"][field] = value
    with pytest.raises(ValueError, match=f"K3VisionConfig.{field}: must be"):
        K3Config.from_dict(d)


def test_chunked_cached_prefill_with_media_rows_equals_full_forward():
    """The serving contract: media encoded once per item, then each prefill chunk (several
    sequences packed, a KV/state cache) gets the rows of the placeholders it holds, in order."""
    from k3.model import HybridCache

    model = tiny_model()
    grids = {"a": [(1, 4, 6), (1, 2, 2)], "b": [(4, 4, 4)]}
    seqs, rows, full = {}, {}, {}
    with torch.no_grad():
        for k, g in grids.items():
            pv = patches(g, seed=len(k) + ord(k))
            feats = model.encode_media(pv, g)
            seqs[k] = prompt_ids([f.shape[0] for f in feats], seed=ord(k))[0]
            rows[k] = torch.cat(feats)
            full[k] = model(seqs[k][None], pv, g).logits[0]
        cache = HybridCache(model.cfg, 2, 64)
        cuts = {"a": [0, 5, len(seqs["a"])], "b": [0, 9, len(seqs["b"])]}  # chunks split placeholder runs
        got = {"a": [], "b": []}
        for c in range(2):
            ids, media, lens = [], [], []
            for k in ("a", "b"):
                lo, hi = cuts[k][c], cuts[k][c + 1]
                ids.append(seqs[k][lo:hi])
                before = int((seqs[k][:lo] == PAD).sum())
                media.append(rows[k][before:before + int((seqs[k][lo:hi] == PAD).sum())])
                lens.append(hi - lo)
            out = model(torch.cat(ids)[None], media_embeds=torch.cat(media), cache=cache.batch(lens)).logits[0]
            cache.advance(lens)
            got["a"].append(out[:lens[0]])
            got["b"].append(out[lens[0]:])
        for k in ("a", "b"):
            assert_close(f"chunked {k}", torch.cat(got[k]), full[k], 1e-4)


@pytest.mark.parametrize("name", ["pixel_values", "media_embeds"])
def test_nan_in_the_media_is_named_not_blamed_on_the_kda_gate(name):
    model = tiny_model()
    grids = [(1, 4, 4)]
    pv = patches(grids)
    with torch.no_grad():
        rows = torch.cat(model.encode_media(pv, grids))
    media = dict(pixel_values=pv, grid_thws=grids) if name == "pixel_values" else dict(media_embeds=rows)
    media[name] = media[name].clone()
    media[name][1, 0] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match=f"{name} holds NaN or inf"):
        model(prompt_ids([4]), **media)
