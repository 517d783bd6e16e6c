"""MLA decode's Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU tensors): paged,
out-of-order pages, context splits merged, the W_uv and gate epilogue."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import (BF16_TOL, assert_interpreted, check_mla, interpreter_or_skip, mla_case,  # noqa: F401
                          one_thread)

interpreter_or_skip()

from k3.kernels.mla_decode import mla_decode  # noqa: E402
from k3.kernels.mla_decode import triton as mla_triton  # noqa: E402


def mla_decode_triton(*args, **kw):
    return mla_decode(*args, backend="triton", **kw)


def setup_module():
    assert_interpreted(mla_triton.mla_decode_split_kernel)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("L", [32, 64])
def test_matches_reference_out_of_order_pages(page_size, L):
    check_mla(mla_decode_triton, mla_case([1, 17, 100, 64], L=L, page_size=page_size, seed=L + page_size),
              with_uv=page_size == 16)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_context_splits_merge(splits):
    # 5 splits over 2 or 7 pages: some splits are empty and must weigh nothing.
    q_lat, q_rope, kv, table, lens = mla_case([20, 100], H=17, seed=splits)  # 17 heads: two head blocks
    got = mla_triton.mla_decode_triton(q_lat, q_rope, kv, table, lens, 0.125, num_splits=splits)
    check_mla(lambda *a: got, (q_lat, q_rope, kv, table, lens))


def test_odd_sizes_and_bf16():
    check_mla(mla_decode_triton, mla_case([3, 33], H=2, L=40, R=8, page_size=24, seed=7))
    check_mla(mla_decode_triton, mla_case([5, 70], dtype=torch.bfloat16, seed=8), with_uv=True, tol=BF16_TOL)


def test_latent_too_wide_for_the_kernel():
    q_lat, q_rope, kv, table, lens = mla_case([3], L=2048, R=16)
    with pytest.raises(ValueError, match="q_lat latent dim 2048"):
        mla_decode_triton(q_lat, q_rope, kv, table, lens, 0.1)
