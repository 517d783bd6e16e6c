"""Quantile Balancing math, the baselines and the single-process Balancer."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from k3.kernels.qb_histogram import qb_histogram
from k3.platform.balance import (
    BalanceConfig,
    make_balancer,
    adaptive_gain,
    centred,
    exact_bias,
    exact_thresholds,
    expert_loads,
    fine_window,
    format_trace,
    histogram_bias,
    histogram_thresholds,
    loss_free_update,
    max_violation,
    quantile_target,
    route,
    solve_batch,
    switch_aux_loss,
    token_margins,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def skewed_scores(seed: int, n: int, e: int, skew: float = 1.5, dtype=torch.float64) -> torch.Tensor:
    """Sigmoid router scores with a per-expert popularity offset; continuous, so no ties."""
    g = torch.Generator().manual_seed(seed)
    pop = torch.randn(e, generator=g, dtype=dtype) * skew
    return torch.sigmoid(torch.randn(n, e, generator=g, dtype=dtype) + pop)


@st.composite
def batches(draw, max_experts=12, max_mult=6):
    """(seed, N, E, k) with q = N k / E an integer in (0, N)."""
    e = draw(st.integers(2, max_experts))
    top_k = draw(st.integers(1, e - 1))
    n = e // math.gcd(e, top_k) * draw(st.integers(1, max_mult))
    return draw(st.integers(0, 2**31 - 1)), n, e, top_k


# ---------------------------------------------------------------------------------------------
# The worked example and the fixed point


# 8 tokens x 4 experts, k = 1. Plain top-1 loads are (4, 3, 1, 0); q = 8 * 1 / 4 = 2.
WORKED_SCORES = [
    [0.95, 0.50, 0.77, 0.47],
    [0.84, 0.88, 0.21, 0.42],
    [0.71, 0.72, 0.74, 0.14],
    [0.66, 0.67, 0.57, 0.37],
    [0.90, 0.49, 0.38, 0.56],
    [0.81, 0.76, 0.35, 0.10],
    [0.54, 0.59, 0.40, 0.28],
    [0.70, 0.51, 0.62, 0.24],
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_worked_example_reaches_equal_loads(dtype):
    scores = torch.tensor(WORKED_SCORES, dtype=dtype)
    plain = expert_loads(route(scores, torch.zeros(4, dtype=dtype), 1)[1], 4).tolist()
    assert plain == [4, 3, 1, 0]
    bias, trace = solve_batch(scores, top_k=1, max_iters=50)
    steps = format_trace(trace)
    assert trace[0]["loads"] == [4, 3, 1, 0], steps
    assert trace[-1]["loads"] == [2, 2, 2, 2], f"exact QB did not balance the worked example:\n{steps}"
    assert abs(float(bias.sum())) < 1e-6, steps  # centred
    # the bias that balances this batch: experts 0 and 1 pay, 2 and 3 are paid
    assert bias[0] < 0 and bias[1] < 0 and bias[2] < 0.0 < bias[3], steps


@FAST
@given(batches(), st.floats(0.0, 3.0))
def test_iterated_exact_solve_reaches_balanced_fixed_point(batch, skew):
    seed, n, e, top_k = batch
    scores = skewed_scores(seed, n, e, skew)
    bias, trace = solve_batch(scores, top_k, max_iters=2000)
    q = n * top_k // e
    _, idx = route(scores, bias, top_k)
    assert all(len(set(row)) == top_k for row in idx.tolist())  # every token has k distinct experts
    loads = expert_loads(idx, e)
    assert loads.tolist() == [q] * e, f"not balanced after {len(trace) - 1} iterations:\n{format_trace(trace[-5:])}"
    # fixed point: one more QB step on this batch keeps the selection
    _, idx2 = route(scores, exact_bias(token_margins(scores, bias, top_k), top_k), top_k)
    assert torch.equal(idx.sort(1).values, idx2.sort(1).values)


# ---------------------------------------------------------------------------------------------
# Exact solve


@pytest.mark.parametrize("n", [2, 3, 10, 101])
def test_exact_thresholds_match_a_full_sort(n):
    # small q counts from the top, large q from the bottom: both against the sorted margins
    m = torch.randn(n, 5, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    desc = m.sort(0, descending=True).values
    for q in range(1, n):
        assert torch.equal(exact_thresholds(m, q), 0.5 * (desc[q - 1] + desc[q])), q


def test_exact_thresholds_midpoint_and_count():
    m = torch.tensor([[0.9], [0.1], [0.5], [0.3], [0.7]])
    assert exact_thresholds(m, 2).tolist() == pytest.approx([0.6])  # between 2nd (0.7) and 3rd (0.5)
    assert exact_thresholds(m, 2.4).tolist() == pytest.approx([0.6])  # fractional q rounds
    m = torch.randn(1000, 7, generator=torch.Generator().manual_seed(0))
    above = (m > exact_thresholds(m, 123)).sum(0)
    assert above.tolist() == [123] * 7


@given(st.integers(0, 10_000), st.integers(1, 5))
@FAST
def test_centring_never_changes_the_selection(seed, top_k):
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(64, 8, generator=g))
    bias = torch.randn(8, generator=g) * 0.3
    shift = float(torch.randn((), generator=g)) * 2
    top = torch.topk(scores + bias, top_k + 1, dim=1).values
    assume(bool(((top[:, top_k - 1] - top[:, top_k]) > 1e-5).all()))  # selection decided beyond rounding
    a = route(scores, bias, top_k)[1].sort(1).values
    assert torch.equal(a, route(scores, bias + shift, top_k)[1].sort(1).values)
    assert torch.equal(a, route(scores, centred(bias), top_k)[1].sort(1).values)
    # and the solve: centred or not, the next batch routes the same
    nxt = skewed_scores(seed + 1, 64, 8, dtype=torch.float32)
    m = token_margins(scores, bias, top_k)
    raw, cen = exact_bias(m, top_k, centre=False), exact_bias(m, top_k)
    top = torch.topk(nxt + raw, top_k + 1, dim=1).values
    assume(bool(((top[:, top_k - 1] - top[:, top_k]) > 1e-5).all()))
    assert torch.equal(route(nxt, raw, top_k)[1].sort(1).values, route(nxt, cen, top_k)[1].sort(1).values)
    assert abs(float(cen.mean())) < 1e-6


def test_margins_definition():
    scores = torch.tensor([[0.9, 0.2, 0.5, 0.7]])
    bias = torch.tensor([0.0, 0.6, 0.0, -0.1])
    # biased: 0.9, 0.8, 0.5, 0.6 -> k=2: alpha = 3rd largest = 0.6
    assert token_margins(scores, bias, 2)[0].tolist() == pytest.approx([0.3, -0.4, -0.1, 0.1])
    # token picks e iff m + b > 0; the (k+1)-th expert sits at m + b = 0 up to rounding
    m = token_margins(scores, bias, 2)
    assert (m + bias)[0].tolist() == pytest.approx([0.3, 0.2, -0.1, 0.0], abs=1e-6)
    assert route(scores, bias, 2)[1].sort(1).values.tolist() == [[0, 1]]


@pytest.mark.parametrize(
    "n,e,top_k,match",
    [(8, 4, 4, "1 <= top_k < experts"), (8, 4, 0, "1 <= top_k < experts"), (8, 4, 5, "1 <= top_k < experts"), (1, 4, 1, "q = ")],
)
def test_exact_bias_bad_input(n, e, top_k, match):
    with pytest.raises(ValueError, match=match):
        exact_bias(torch.randn(n, e), top_k)


def test_quantile_target_names_q():
    with pytest.raises(ValueError, match=r"q = N k / E = 0 \* 2 / 8 = 0"):
        quantile_target(0, 2, 8)
    assert quantile_target(16384, 16, 896) == pytest.approx(292.571, abs=1e-3)


# ---------------------------------------------------------------------------------------------
# Histogram solve


@FAST
@given(
    st.integers(0, 2**31 - 1), st.integers(2, 400), st.integers(2, 16), st.data(), st.integers(2, 300), st.floats(0.0, 0.5)
)
def test_histogram_solve_within_one_bin_of_exact(seed, n, e, data, bins, pad):
    top_k = data.draw(st.integers(1, e - 1))
    q = n * top_k / e  # any q, fractional too: both solves round it
    assume(1 <= round(q) <= n - 1)
    margins = token_margins(skewed_scores(seed, n, e), torch.zeros(e, dtype=torch.float64), top_k)
    lo = margins.min(0).values - pad - 1e-9  # windows that hold every margin
    hi = margins.max(0).values + pad + 1e-9
    hist = qb_histogram(margins, lo, hi, bins)
    got, _ = histogram_thresholds(hist, lo, hi, q)
    want = exact_thresholds(margins, q)
    width = (hi - lo) / bins
    assert bool(((got - want).abs() <= width * (1 + 1e-9)).all()), ((got - want) / width).tolist()


def test_histogram_plateau_takes_middle_of_gap():
    # 2 margins far above 2 others, q = 2: the threshold is anywhere in the gap; take its middle
    hist = torch.tensor([[0, 2, 0, 0, 0, 0, 2, 0]])
    t, sat = histogram_thresholds(hist, 0.0, 8.0, 2)
    assert t.tolist() == pytest.approx([4.0])  # middle of [2, 6)
    assert not bool(sat.any())
    hist = torch.tensor([[0, 0, 4, 0]])
    t, _ = histogram_thresholds(hist, 0.0, 4.0, 1)
    assert t.tolist() == pytest.approx([2.75])  # 4 counts spread over [2, 3): 1 above 2.75


def test_histogram_saturation_flag():
    hist = torch.tensor([[6, 1, 1, 0], [0, 0, 1, 7]])
    _, sat = histogram_thresholds(hist, -1.0, 1.0, 3)
    assert sat.tolist() == [True, True]


@FAST
@given(batches(max_experts=10, max_mult=30), st.integers(1, 6), st.integers(2, 64))
def test_worker_histograms_sum_to_the_histogram_of_all_tokens(batch, workers, bins):
    seed, n, e, top_k = batch
    margins = token_margins(skewed_scores(seed, n, e), torch.zeros(e, dtype=torch.float64), top_k)
    lo, hi = -0.5 * torch.ones(e), 0.5 * torch.ones(e)  # some margins clamp: still exact
    cuts = sorted(torch.randint(0, n + 1, (workers - 1,), generator=torch.Generator().manual_seed(seed)).tolist())
    parts = torch.tensor_split(margins, cuts)
    total = sum(qb_histogram(p, lo, hi, bins) for p in parts)
    assert torch.equal(total, qb_histogram(margins, lo, hi, bins))


def test_fine_pass_shrinks_the_error():
    margins = token_margins(skewed_scores(3, 4096, 16), torch.zeros(16, dtype=torch.float64), 4)
    q = 4096 * 4 / 16
    lo, hi = -1.0, 1.0
    coarse_hist = qb_histogram(margins, lo, hi, 16)
    exact = exact_thresholds(margins, q)
    coarse = histogram_thresholds(coarse_hist, lo, hi, q)[0]
    lo_f, hi_f = fine_window(coarse_hist, lo, hi, q)
    assert bool(((lo_f <= exact) & (exact <= hi_f)).all())
    fine = histogram_thresholds(qb_histogram(margins, lo_f, hi_f, 16), lo_f, hi_f, q)[0]
    assert float((fine - exact).abs().max()) <= 2.0 / 16 / 16 + 1e-12
    assert float((fine - exact).abs().max()) < float((coarse - exact).abs().max())


def test_histogram_bias_bad_input():
    with pytest.raises(ValueError, match="outside"):
        histogram_bias(torch.tensor([[1, 2, 3]]), -1.0, 1.0, 6)  # q = N
    with pytest.raises(ValueError, match="outside"):
        histogram_bias(torch.tensor([[1, 2, 3]]), -1.0, 1.0, 0)
    with pytest.raises(ValueError, match="same N"):
        histogram_bias(torch.tensor([[1, 2, 3], [1, 1, 1]]), -1.0, 1.0, 2)
    with pytest.raises(ValueError, match="integer"):
        histogram_bias(torch.ones(2, 3), -1.0, 1.0, 2)


# ---------------------------------------------------------------------------------------------
# Baselines


def test_loss_free_sign_update():
    b = loss_free_update(torch.zeros(4), torch.tensor([10, 2, 4, 4]), 1e-3)
    assert b.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3])
    assert BalanceConfig().loss_free_step == 1e-3


def test_switch_aux_loss_value_and_gradient():
    n, e, top_k = 64, 4, 2
    idx = torch.arange(n * top_k).remainder(e).view(n, top_k)  # uniform routing
    probs = torch.full((n, e), 1 / e, requires_grad=True)
    loss = switch_aux_loss(probs, idx, coef=0.01)
    assert loss.item() == pytest.approx(0.01)
    # skewed routing: the overloaded expert's probability gets the largest gradient (pushed down)
    idx = torch.zeros(n, top_k, dtype=torch.long)
    idx[:, 1] = 1
    probs = torch.full((n, e), 1 / e, requires_grad=True)
    switch_aux_loss(probs, idx).backward()
    g = probs.grad.sum(0)
    assert g[0] > 0 and g[1] > 0 and g[2] == 0 and g[3] == 0


def test_max_violation():
    assert max_violation(torch.tensor([2, 2, 2, 2])) == 0.0
    assert max_violation(torch.tensor([4, 3, 1, 0])) == pytest.approx(1.0)


def test_adaptive_gain():
    q, top_k, e = 100.0, 2, 64
    noise = torch.full((e,), q) + torch.tensor([1.0, -1.0] * (e // 2)) * math.sqrt(q * (1 - top_k / e)) * 0.9
    assert adaptive_gain(noise, q, top_k, 0.1) == 0.1
    far = torch.full((e,), q)
    far[0], far[1] = 3 * q, 0.0
    assert adaptive_gain(far, q, top_k, 0.1) > 0.85  # z2 = 8


# ---------------------------------------------------------------------------------------------
# The Balancer


def run_balancer(config: BalanceConfig, batches_: list[torch.Tensor], top_k: int) -> list[torch.Tensor]:
    """The bias each batch was routed with."""
    bal = make_balancer(config, num_layers=1, num_experts=batches_[0].shape[1], top_k=top_k)
    used = []
    for scores in batches_:
        used.append(bal.bias(0))
        bal.observe_scores(0, scores)
        bal.step()
    return used


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["quantile", "quantile_hist", "loss_free"]),
    st.integers(0, 2**20),
    st.integers(0, 5),
    st.sampled_from(["one", "adaptive"]),
)
def test_bias_at_step_t_depends_only_on_earlier_batches(method, seed, t, gain):
    e, top_k, n, steps = 8, 2, 64, 6
    config = BalanceConfig(method=method, bins=32, gain=gain)
    data = [skewed_scores(seed + i, n, e, dtype=torch.float32) for i in range(steps)]
    changed = data[:t] + [skewed_scores(seed + 1000 + i, n, e, dtype=torch.float32) for i in range(t, steps)]
    a, b = run_balancer(config, data, top_k), run_balancer(config, changed, top_k)
    for step in range(t + 1):  # batches t.. differ; the biases used up to step t may not
        assert torch.equal(a[step], b[step]), f"bias used at step {step} saw batch {t}"
    if method != "loss_free" and t + 1 < steps:
        assert not torch.equal(a[t + 1], b[t + 1])


def test_observe_does_not_change_the_bias_in_use():
    bal = make_balancer(BalanceConfig(method="quantile"), 2, 8, 2)
    before = bal.bias()
    bal.observe_scores(0, skewed_scores(0, 64, 8, dtype=torch.float32))
    assert torch.equal(bal.bias(), before)
    info = bal.step()
    assert set(info) == {0} and not torch.equal(bal.bias(0), before[0]) and torch.equal(bal.bias(1), before[1])


def test_micro_batches_accumulate_like_one_batch():
    scores = skewed_scores(5, 256, 16, dtype=torch.float32)
    for method in ("quantile", "quantile_hist"):
        one = make_balancer(BalanceConfig(method=method, bins=64), 1, 16, 4)
        one.observe_scores(0, scores)
        one.step()
        two = make_balancer(BalanceConfig(method=method, bins=64), 1, 16, 4)
        two.observe_scores(0, scores[:100])
        two.observe_scores(0, scores[100:])
        two.step()
        assert torch.equal(one.bias(), two.bias()), method


@pytest.mark.parametrize("method", ["quantile", "quantile_hist"])
@pytest.mark.parametrize("gain", ["one", "adaptive"])
def test_qb_balances_a_stationary_router(method, gain):
    e, top_k, n = 32, 4, 8192
    g = torch.Generator().manual_seed(0)
    w, pop = torch.randn(e, 16, generator=g) / 4, torch.randn(e, generator=g)
    bal = make_balancer(BalanceConfig(method=method, bins=256, gain=gain), 1, e, top_k)
    vios = []
    for _ in range(12):
        scores = torch.sigmoid(torch.randn(n, 16, generator=g) @ w.T + pop)
        bal.observe_scores(0, scores)
        vios.append(bal.step()[0]["maxvio"])
    assert vios[0] > 1.0  # skewed without a bias
    assert max(vios[6:]) < 0.15, vios  # fair random assignment: ~0.07 here


def test_fine_pass_balancer_runs():
    bal = make_balancer(BalanceConfig(method="quantile_hist", bins=16, fine_pass=True), 1, 16, 2)
    for i in range(3):
        bal.observe_scores(0, skewed_scores(i, 512, 16, dtype=torch.float32))
        info = bal.step()[0]
    assert info["saturated"] == 0


def test_aux_loss_and_none_keep_zero_bias():
    for method in ("aux_loss", "none"):
        bal = make_balancer(BalanceConfig(method=method), 1, 8, 2)
        idx = bal.observe_scores(0, skewed_scores(0, 64, 8, dtype=torch.float32))
        bal.step()
        assert torch.equal(bal.bias(), torch.zeros(1, 8))
        probs = torch.softmax(torch.randn(64, 8, requires_grad=True), -1)
        loss = bal.aux_loss(probs, idx)
        assert (loss.item() > 0) == (method == "aux_loss")


def test_balancer_state_round_trip():
    cfg = BalanceConfig(method="quantile_hist", bins=32)
    a = make_balancer(cfg, 2, 8, 2)
    for i in range(3):
        for layer in range(2):
            a.observe_scores(layer, skewed_scores(i * 2 + layer, 64, 8, dtype=torch.float32))
        a.step()
    b = make_balancer(cfg, 2, 8, 2)
    b.load_state_dict(a.state_dict())
    nxt = skewed_scores(99, 64, 8, dtype=torch.float32)
    a.observe_scores(0, nxt), b.observe_scores(0, nxt)
    a.step(), b.step()
    assert torch.equal(a.bias(), b.bias())
    with pytest.raises(ValueError, match="this balancer has"):
        make_balancer(cfg, 3, 8, 2).load_state_dict(a.state_dict())


def test_balancer_bad_input():
    with pytest.raises(ValueError, match="1 <= top_k < experts"):
        make_balancer(BalanceConfig(), 1, 8, 8)
    bal = make_balancer(BalanceConfig(), 1, 8, 2)
    with pytest.raises(ValueError, match=r"margins must be \[N, E=8\]"):
        bal.observe(0, torch.zeros(4, 7), torch.zeros(8))
    with pytest.raises(ValueError, match=r"counts must be \[E=8\]"):
        bal.observe(0, torch.zeros(4, 8), torch.zeros(7))
    with pytest.raises(ValueError, match="layer 1 out of range"):
        bal.bias(1)


def test_config_validation():
    with pytest.raises(ValueError):
        BalanceConfig(method="sinkhorn")
    with pytest.raises(ValueError, match="lo < hi"):
        BalanceConfig(fixed_range=(1.0, -1.0))
    with pytest.raises(ValueError):
        BalanceConfig(bins=1)
    assert BalanceConfig(**BalanceConfig(method="loss_free").model_dump()).method == "loss_free"
    with pytest.raises(ValueError, match="layerwise=True solves each layer inside the after-step forward"):
        BalanceConfig(margins_after_step=False, layerwise=True)
    with pytest.raises(ValueError, match="solve_rounds=2 re-solves from the after-step forward"):
        BalanceConfig(margins_after_step=False, solve_rounds=2)
    with pytest.raises(ValueError, match="solve_rounds"):
        BalanceConfig(solve_rounds=0)
    # from the training forward's margins, the after-step settings default to one solve of every layer
    plain = BalanceConfig(margins_after_step=False)
    assert (plain.layerwise, plain.solve_rounds, plain.rounds_per_step(7)) == (False, 1, 1)
    assert BalanceConfig(method="loss_free", margins_after_step=False).method == "loss_free"  # rounds unused
    # the coordinator numbers its solves with this: one per layer and alternation, or one per round
    assert BalanceConfig().rounds_per_step(7) == 14  # the default: layerwise, two alternations
    assert BalanceConfig(solve_rounds=1).rounds_per_step(7) == 7
    assert BalanceConfig(layerwise=False, solve_rounds=2).rounds_per_step(7) == 2
