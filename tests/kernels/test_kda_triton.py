"""KDA's Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU tensors, small shapes):
chunked forward and backward, and the slot-pool decode step, against the recurrence."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import (BF16_TOL, assert_interpreted, check_kda, check_kda_states, check_kda_step,  # noqa: F401
                          interpreter_or_skip, kda_inputs, lower_bound_for, one_thread, packed_lengths_cu)

interpreter_or_skip()

from k3.kernels.kda import chunk_kda, kda_step  # noqa: E402
from k3.kernels.kda import triton_bwd, triton_fwd, triton_step  # noqa: E402


def chunk_kda_triton(*args, **kwargs):
    return chunk_kda(*args, backend="triton", **kwargs)


def setup_module():
    for kernel in (triton_fwd.kda_state_kernel, triton_bwd.kda_bwd_state_kernel, triton_step.kda_step_kernel):
        assert_interpreted(kernel)


# Each T and head dim, with and without a state, under both gates (a covering set, not the full
# product: the interpreter runs a chunk of fwd + bwd in about a second).
CASES = [
    (1, 32, False, "bounded"), (1, 64, True, "unbounded"),
    (15, 64, False, "bounded"), (15, 32, True, "unbounded"),
    (16, 32, True, "bounded"), (16, 64, False, "unbounded"),
    (17, 64, True, "bounded"), (17, 32, False, "unbounded"),
    (63, 32, False, "bounded"), (63, 64, True, "unbounded"),
    (100, 64, False, "bounded"), (100, 32, True, "unbounded"),
]


@pytest.mark.parametrize("T,K,with_state,gate", CASES)
def test_forward_and_gradients_match_recurrence(T, K, with_state, gate):
    xs = kda_inputs(2, T, 2, K, 32, gate, seed=T + K)
    h0 = torch.randn(2, 2, K, 32, generator=torch.Generator().manual_seed(T)) if with_state else None
    check_kda(chunk_kda_triton, xs, h0, lower_bound=lower_bound_for(gate))


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_packed_sequences(chunk_size):
    lengths = [17, 0, 40, 1, 70]
    xs = kda_inputs(1, sum(lengths), 1, 16, 16, "bounded" if chunk_size != 32 else "unbounded", seed=3)
    check_kda(chunk_kda_triton, xs, torch.randn(len(lengths), 1, 16, 16), cu_seqlens=packed_lengths_cu(lengths),
              chunk_size=chunk_size, lower_bound=None if chunk_size == 32 else -5.0)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_states_at_any_offset_equal_the_recurrence(chunk_size):
    # the state kernel stores the state entering each chunk that starts at an asked-for offset;
    # off a chunk boundary, the pass cuts a chunk there
    check_kda_states(chunk_kda_triton, [40, 0, 33, 5], {0: [3, 16, 40], 2: [32, 17], 3: [1]}, chunk_size)


def test_states_at_chunk_boundaries_change_nothing():
    check_kda_states(chunk_kda_triton, [40, 0, 33, 5], {0: [16, 32], 2: [32]}, 16)


def test_a_bound_too_low_for_tritons_sub_chunks_is_dropped():
    # lower_bound=-15 with chunk_size=4 is safe for the torch path's 4-token sub-chunks, but Triton
    # always works in 16-token sub-chunks anchored mid-way, where e^(8 x 14) overflows fp32: the
    # public function must take the unbounded path there instead of returning inf.
    q, k, v, g, beta = kda_inputs(1, 40, 1, 16, 16, "bounded", seed=11)
    check_kda(chunk_kda_triton, [q, k, v, torch.full_like(g, -14.0), beta], chunk_size=4, lower_bound=-15.0,
              grads=False)


def test_odd_head_dims_and_bf16():
    # K and V that are not powers of two (masked lanes), and bf16 inputs converted in the kernel.
    check_kda(chunk_kda_triton, kda_inputs(1, 20, 1, 24, 40, "bounded", seed=4), torch.randn(1, 1, 24, 40))
    check_kda(chunk_kda_triton, kda_inputs(1, 20, 1, 32, 32, "bounded", seed=5, dtype=torch.bfloat16),
              fwd_tol=BF16_TOL, grad_tol=BF16_TOL)


@pytest.mark.slow  # the Triton interpreter over long sequences (~20 s), the full tier
@pytest.mark.parametrize("gate", ["low", "zero"])
def test_stress_long_gates_at_the_bound_and_near_zero(gate):
    xs = kda_inputs(1, 2048, 1, 16, 16, gate, seed=6)
    check_kda(chunk_kda_triton, xs, torch.randn(1, 1, 16, 16), grads=gate == "low")


def test_stress_unbounded_gate_far_below_the_bound():
    q, k, v, g, beta = kda_inputs(1, 80, 1, 16, 16, "unbounded", seed=7)
    check_kda(chunk_kda_triton, [q, k, v, g * 20, beta], torch.randn(1, 1, 16, 16), lower_bound=None)


@pytest.mark.parametrize("K,V", [(32, 32), (64, 16), (24, 40)])
def test_step_over_slots(K, V):
    check_kda_step("triton", K, V, seed=K)


def test_bad_input_for_the_kernel():
    q, k, v, g, beta = kda_inputs(1, 4, 1, 512, 16, "bounded")
    with pytest.raises(ValueError, match="k head dim 512"):
        chunk_kda_triton(q, k, v, g, beta)
    step = [x[:, 0] for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="k head dim 512"):
        kda_step(*step, torch.zeros(2, 1, 512, 16), torch.tensor([0]), backend="triton")
    xs = [x[:, 0] for x in kda_inputs(1, 1, 1, 16, 16)]
    pool = torch.zeros(2, 1, 16, 32)[..., ::2]  # a strided view the kernel could not write in place
    with pytest.raises(ValueError, match="state_pool"):
        kda_step(*xs, pool, torch.tensor([0]), backend="triton")
