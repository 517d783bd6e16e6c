"""KDA over a sequence cut into shards (k3.kernels.kda.shards, context parallelism's math): each
shard run from zero, folded with the shards before it, equals the whole sequence in one pass, in
output and in every input gradient; the transition equals the token-by-token product; bad input."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from kernel_cases import FWD_TOL, GRAD_TOL, kda_inputs, lower_bound_for, one_thread  # noqa: F401
from k3.kernels.kda import chunk_kda
from k3.kernels.kda.shards import chunk_kda_shard, fold_shard_states, naive_kda_transition, shard_output

# Documents over 300 tokens: one crosses two shard bounds, one starts exactly on a bound (240
# with 4 shards), one is a single token.
DOCS = [0, 50, 170, 171, 240, 300]


def _shard_cu(docs: list[int], a: int, b: int) -> tuple[torch.Tensor, bool]:
    inner = [d - a for d in docs if a < d < b]
    return torch.tensor([0, *inner, b - a]), a not in docs


def _run_sharded(xs, bounds, docs, chunk_size, lower_bound):
    """Every shard from zero, then folded: the output [1, T, H, V] the shards give together."""
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        cu, continues = _shard_cu(docs, a, b)
        pieces.append(chunk_kda_shard(*[x[:, a:b] for x in xs], cu_seqlens=cu, continues=continues,
                                      chunk_size=chunk_size, lower_bound=lower_bound))
    states = torch.stack([p.state for p in pieces])
    transitions = torch.stack([p.transition for p in pieces])
    return torch.cat([shard_output(p, fold_shard_states(states, transitions, r), xs[2].dtype)
                      for r, p in enumerate(pieces)], dim=1)


@pytest.mark.parametrize("bounds", [[0, 300], [0, 150, 300], [0, 100, 170, 300], [0, 80, 160, 240, 300]])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_folded_shards_equal_one_pass(bounds, gate, chunk_size):
    xs = [x.requires_grad_() for x in kda_inputs(1, 300, 2, 16, 8, gate, seed=len(bounds))]
    cu = torch.tensor(DOCS)
    lb = lower_bound_for(gate)
    ref = chunk_kda(*xs, cu_seqlens=cu, chunk_size=chunk_size, lower_bound=lb).o
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad((ref * do).sum(), xs)
    out = _run_sharded(xs, bounds, DOCS, chunk_size, lb)
    assert_close("o", out, ref, FWD_TOL)
    for name, g, r in zip(["dq", "dk", "dv", "dg", "dbeta"], torch.autograd.grad((out * do).sum(), xs), ref_grads):
        assert_close(name, g, r, GRAD_TOL)


@pytest.mark.parametrize("gate", ["zero", "bounded"])
def test_transition_is_the_product_of_token_transitions(gate):
    q, k, v, g, beta = kda_inputs(1, 37, 2, 8, 4, gate, seed=5)
    if gate == "bounded":
        g = g / 40  # a product over 37 tokens of the full gate is 0 to fp32: keep it measurable
    piece = chunk_kda_shard(q, k, v, g, beta, chunk_size=16)
    assert_close("transition", piece.transition, naive_kda_transition(k[0], g[0], beta[0]), FWD_TOL)
    # and the state from zero is chunk_kda's final state
    ref = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=16).final_state[0]
    assert_close("state", piece.state, ref, FWD_TOL)


def test_boundary_inside_a_shard_cuts_the_carry():
    q, k, v, g, beta = kda_inputs(1, 40, 2, 8, 4, "zero", seed=6)
    piece = chunk_kda_shard(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10, 40]), chunk_size=16)
    assert torch.equal(piece.transition, torch.zeros_like(piece.transition))
    assert piece.readout[:, :10].abs().sum() > 0 and torch.equal(piece.readout[:, 10:], torch.zeros(1, 30, 2, 8))
    fresh = chunk_kda_shard(q, k, v, g, beta, continues=False, chunk_size=16)
    assert torch.equal(fresh.readout, torch.zeros_like(fresh.readout))


def test_fold_is_oldest_first():
    H, K, V = 1, 2, 1
    states = torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1, 1).expand(3, H, K, V)
    transitions = (torch.eye(K) * 2).expand(3, H, K, K)
    # h1 = s0; h2 = 2 s0 + s1; h3 = 2 (2 s0 + s1) + s2
    assert fold_shard_states(states, transitions, 0).abs().sum() == 0
    assert torch.equal(fold_shard_states(states, transitions, 2)[0, :, 0], torch.tensor([12.0, 12.0]))
    assert torch.equal(fold_shard_states(states, transitions, 3)[0, :, 0], torch.tensor([124.0, 124.0]))


@pytest.mark.parametrize("case, match", [
    ("batch", "one packed row"),
    ("transitions", "transitions must be"),
    ("upto", "upto must lie"),
])
def test_bad_input(case, match):
    q, k, v, g, beta = kda_inputs(2, 8, 1, 4, 4, "zero", seed=7)
    with pytest.raises(ValueError, match=match):
        if case == "batch":
            chunk_kda_shard(q, k, v, g, beta)
        elif case == "transitions":
            fold_shard_states(torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 3), 1)
        else:
            fold_shard_states(torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 4), 3)
