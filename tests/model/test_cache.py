"""HybridCache, the contiguous cache owner of generate() and the tests: what it refuses."""
from __future__ import annotations

import pytest
import torch

from k3.model import HybridCache, get_preset


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, "float32"])
def test_a_dtype_that_is_not_floating_point_is_refused(dtype):
    # an integer cache truncated the KDA conv states it stored: decode went on from wrong state
    with pytest.raises(ValueError, match="HybridCache: dtype must be a floating-point"):
        HybridCache(get_preset("k3-tiny"), 1, 10, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floating_dtypes_allocate_in_that_dtype(dtype):
    cache = HybridCache(get_preset("k3-tiny"), 2, 10, dtype=dtype)
    assert {p.conv.dtype for p in cache.kda.values()} == {dtype}
    assert {p.recurrent.dtype for p in cache.kda.values()} == {torch.float32}  # recurrent state stays fp32
    assert {t.dtype for t in cache.mla_pages.values()} == {dtype}
