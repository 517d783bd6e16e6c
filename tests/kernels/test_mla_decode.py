"""Absorbed MLA decode on CPU: the batched torch path against the per-sequence reference."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import BF16_TOL, check_mla, mla_case, one_thread  # noqa: F401
from k3.kernels.mla_decode import mla_decode


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("L", [32, 64])
@pytest.mark.parametrize("with_uv", [False, True])
def test_matches_reference_out_of_order_pages(page_size, L, with_uv):
    check_mla(mla_decode, mla_case([1, 17, 100, 64], L=L, page_size=page_size, seed=L + page_size), with_uv)


def test_bf16_cache_and_queries():
    check_mla(mla_decode, mla_case([5, 130], dtype=torch.bfloat16, seed=2), with_uv=True, tol=BF16_TOL)


def test_strided_cache_view():
    q_lat, q_rope, kv, table, lens = mla_case([9, 40], seed=3)
    wide = torch.zeros(kv.shape[0], kv.shape[1], kv.shape[2] + 8)
    wide[..., :kv.shape[2]] = kv  # a view into a wider buffer: rows strided, last dim contiguous
    check_mla(mla_decode, (q_lat, q_rope, wide[..., :kv.shape[2]], table, lens))


def test_bad_inputs_name_the_argument():
    q_lat, q_rope, kv, table, lens = mla_case([3, 20])
    w, gate = torch.zeros(3, 4, 32), torch.zeros(2, 3, 4)
    cases = [
        ("q_rope", lambda: mla_decode(q_lat, q_rope[:1], kv, table, lens, 0.1)),
        ("kv_cache", lambda: mla_decode(q_lat, q_rope, kv[..., :-1], table, lens, 0.1)),
        ("kv_cache", lambda: mla_decode(q_lat, q_rope, kv.transpose(0, 2).contiguous().transpose(0, 2), table, lens, 0.1)),
        ("page_table", lambda: mla_decode(q_lat, q_rope, kv, table.float(), lens, 0.1)),
        ("page_table", lambda: mla_decode(q_lat, q_rope, kv, table.clone().fill_(kv.shape[0]), lens, 0.1)),
        ("seq_lens", lambda: mla_decode(q_lat, q_rope, kv, table, lens * 0, 0.1)),
        ("seq_lens", lambda: mla_decode(q_lat, q_rope, kv, table, lens * 100, 0.1)),
        ("seq_lens", lambda: mla_decode(q_lat, q_rope, kv, table, lens[:1], 0.1)),
        ("w_uv", lambda: mla_decode(q_lat, q_rope, kv, table, lens, 0.1, w[:, :, :8])),
        ("gate", lambda: mla_decode(q_lat, q_rope, kv, table, lens, 0.1, None, gate)),
        ("gate", lambda: mla_decode(q_lat, q_rope, kv, table, lens, 0.1, w, gate[:, :, :2])),
        ("kv_cache", lambda: mla_decode(q_lat, q_rope, kv.to("meta"), table, lens, 0.1)),
        ("backend", lambda: mla_decode(q_lat, q_rope, kv, table, lens, 0.1, backend="cuda")),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_no_sequences():
    q_lat, q_rope, kv, table, lens = mla_case([3])
    out = mla_decode(q_lat[:0], q_rope[:0], kv, table[:0], lens[:0], 0.1)
    assert out.shape == (0, 3, 32)


def test_context_slices(monkeypatch):
    # Slices of 32 tokens over sequences of 1..200: slices wholly past a short sequence's end.
    import k3.kernels.mla_decode.cpu as cpu_path

    monkeypatch.setattr(cpu_path, "CHUNK", 32)
    check_mla(mla_decode, mla_case([1, 200, 33, 64], page_size=16, seed=11), with_uv=True)


def test_garbage_past_a_sequence_end_stays_out():
    # A reused page, or the page a past-the-end table entry points at, may hold NaN/inf: the
    # output must not see it (a zero softmax weight times NaN is still NaN).
    q_lat, q_rope, kv, table, lens = mla_case([5, 20], page_size=16, seed=12)
    want = mla_decode(q_lat, q_rope, kv.clone(), table, lens, 0.2)
    dirty = kv.clone()
    for i, n in enumerate(lens.tolist()):
        last = int(table[i, (n - 1) // 16])
        dirty[last, n % 16 or 16:] = float("nan")  # the tail of the sequence's last page
    table = table.clone()
    table[table < 0] = int(table[0, 0])  # past-the-end entries point at a real page full of data
    dirty[int(table[0, 0]), 5:] = float("inf")
    got = mla_decode(q_lat, q_rope, dirty, table, lens, 0.2)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-6)


def test_traced_by_torch_compile_one_graph_serves_every_table_width():
    # the engine's decode graphs trace it with the page table's width symbolic (one slice over the
    # whole table, each sequence masked to its length): widths 3, 5 and 9 pages, one graph
    from torch._dynamo.utils import counters

    fn = torch.compile(mla_decode, backend="aot_eager", fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for lens in ([1, 40, 17], [70, 3, 33], [130, 9, 64]):
        case = list(mla_case(lens, seed=len(lens) + lens[0]))
        case[3] = case[3].clamp_min(0)  # the engine pads with page 0, never read
        torch._dynamo.mark_dynamic(case[3], 1)
        torch._dynamo.mark_dynamic(case[2], 0)  # the pool's page count differs between these cases (an engine's is fixed)
        check_mla(fn, case, with_uv=True)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("scale", [None, float("nan"), float("inf"), 0.0, -0.1, "0.1", torch.tensor([0.1, 0.2])])
def test_scale_must_be_a_finite_positive_number(scale):
    # NaN or inf returned NaN; None raised a TypeError from float(). There is no default: the
    # scale is the qk head dim's, which the latent and rope widths do not give.
    q_lat, q_rope, kv, table, lens = mla_case([3, 20])
    with pytest.raises(ValueError, match="mla_decode: scale (must be|is required)"):
        mla_decode(q_lat, q_rope, kv, table, lens, scale)


def test_scale_as_a_0d_tensor_equals_the_float():
    q_lat, q_rope, kv, table, lens = mla_case([3, 20])
    assert torch.equal(mla_decode(q_lat, q_rope, kv, table, lens, torch.tensor(0.25)),
                       mla_decode(q_lat, q_rope, kv, table, lens, 0.25))
