"""The sampler's per-request logit adjustments: logit_bias, presence and frequency penalties
(OpenAI's definitions), applied per row before greedy or sampled choice; a row without them is
drawn bit for bit as before."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from k3.serve.engine import SamplingParams
from k3.serve.engine.sampler import SampleRow, sample

V = 64


def logits(m, seed=0):
    return torch.randn(m, V, generator=torch.Generator().manual_seed(seed))


def row(output=(), banned=(), **kw):
    return SampleRow(SamplingParams(**{"temperature": 0, "logprobs": 5, **kw}), None, list(banned), list(output))


def draw(x, rows, seed=0):
    return sample(x, rows, torch.Generator().manual_seed(seed))


def openai_adjusted(x, output, presence=0.0, frequency=0.0, bias=None):
    """OpenAI's formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]."""
    x = x.clone()
    for j in range(V):
        c = output.count(j)
        x[j] = x[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence + (bias or {}).get(j, 0.0)
    return x


def entry_of(x, k=5):
    """The logprob entry the sampler gives a greedy row whose (adjusted) logits are x."""
    logp = torch.log_softmax(x.float(), -1)
    tok = int(x.argmax())
    top = logp.topk(k)
    return tok, {"token": tok, "logprob": float(logp[tok]),
                 "top": {int(t): float(v) for v, t in zip(top.values, top.indices)}}


@pytest.mark.parametrize("output,presence,frequency,bias", [
    ([3, 3, 7], 0.5, 0.8, None),
    ([1, 2, 2, 2, 9], -1.0, 2.0, {4: 3.0, 2: -1.5}),
    ([], 2.0, 2.0, {10: 100.0}),  # nothing generated yet: only the bias counts
    ([5] * 40, 0.0, -2.0, None),  # a negative penalty favours repetition
])
def test_adjustments_follow_openais_formula(output, presence, frequency, bias):
    x = logits(1, seed=len(output))
    got = draw(x, [row(output, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias or {})])[0]
    tok, entry = entry_of(openai_adjusted(x[0], output, presence, frequency, bias))
    assert got.token == tok and got.logprob["token"] == tok
    assert got.logprob["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
    assert sorted(got.logprob["top"]) == sorted(entry["top"])


def test_rows_without_adjustments_are_bit_identical_to_plain_sampling():
    x = logits(4, seed=1)
    plain = [row(), row(output=[1, 2]), SampleRow(SamplingParams(temperature=0.8, seed=3, logprobs=2),
                                                  torch.Generator().manual_seed(3), [], [])]
    mixed = [plain[0], row(output=[1, 1], frequency_penalty=1.5), plain[1],
             SampleRow(SamplingParams(temperature=0.8, seed=3, logprobs=2), torch.Generator().manual_seed(3), [], [])]
    alone = draw(x[[0, 2, 3]], plain)
    together = draw(x, mixed)
    for a, b in zip(alone, [together[0], together[2], together[3]]):
        assert (a.token, a.logprob) == (b.token, b.logprob)  # exact: same bits
    for i in (0, 2):  # and what the sampler computed before penalties existed: argmax, log_softmax
        tok, entry = entry_of(x[i])
        assert together[i].token == tok and together[i].logprob == entry


def test_logit_bias_steers_greedy_and_sampled_rows():
    x = logits(3, seed=2)
    favourite, top = 17, int(x[1].argmax())
    d = draw(x, [row(logit_bias={favourite: 100.0}), row(logit_bias={top: -100.0}),
                 SampleRow(SamplingParams(temperature=1.0, logit_bias={favourite: 100.0}), None, [], [])])
    assert d[0].token == favourite and d[2].token == favourite
    assert d[1].token not in (top, None)


def test_a_ban_wins_over_a_bias():
    d = draw(logits(1), [row(banned=[9], logit_bias={9: 100.0})])
    assert d[0].token != 9


def test_a_frequency_penalty_breaks_a_greedy_repeat():
    x = torch.zeros(1, V)
    x[0, 4], x[0, 6] = 1.0, 0.5
    assert draw(x, [row(output=[4, 4])])[0].token == 4
    assert draw(x, [row(output=[4, 4], frequency_penalty=0.3)])[0].token == 6  # 1 - 0.6 < 0.5
    assert draw(x, [row(output=[4], presence_penalty=0.6)])[0].token == 6


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.1), ("frequency_penalty", -2.5), ("presence_penalty", float("nan")),
    ("logit_bias", {3: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("inf")}),
])
def test_bad_adjustments_name_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_rows_with_nan_inf_or_nothing_left_fail_alone():
    x = logits(6)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    x[3, 5], x[3, 6] = float("inf"), float("nan")
    rows = [row(), row(), row(), row(), row(banned=range(V)), row()]
    rows[5] = SampleRow(SamplingParams(temperature=0.8, seed=3), None, [], [])  # a sampled row among them
    got = draw(x, rows)
    assert [d.error is not None for d in got] == [False, True, True, True, True, False]
    assert all(d.token is None for d in got[1:5])
    assert got[0].token == int(x[0].argmax()) and got[0].error is None
    assert 0 <= got[5].token < V


def test_banned_tokens_are_no_alternatives_in_logprobs():
    # only two tokens allowed: -inf alternatives are no tokens (and no JSON number either)
    x = logits(2)
    got = draw(x, [row(banned=range(2, V)), SampleRow(SamplingParams(temperature=0.7, seed=1, logprobs=5), None,
                                                      list(range(2, V)), [])])
    for d in got:
        assert d.token in (0, 1) and set(d.logprob["top"]) == {0, 1}
        assert all(v > float("-inf") for v in d.logprob["top"].values())


@pytest.mark.parametrize("rows", [
    [row(), row()],  # nothing to adjust: the logits are read as they are
    [row(banned=[3, 4]), row(output=[1, 1, 2], presence_penalty=1.0), row(logit_bias={5: 9.0})],
])
def test_the_caller_s_logits_are_left_as_they_were(rows):
    x = logits(len(rows))
    before = x.clone()
    got = draw(x, rows)
    assert torch.equal(x, before)
    if rows[0].banned:
        assert got[0].token not in (3, 4) and got[2].token == 5


def test_greedy_ties_go_to_the_first_index_as_argmax_gives():
    # the greedy token and the finite check come from one max pass: its index must be argmax's
    x = torch.zeros(3, V)
    x[0, [9, 4, 30]] = 2.0  # ties at 4, 9 and 30: the first, 4
    x[1, [V - 1, 0]] = 1.0  # ties at both ends: 0
    x[2] = -3.0  # every token ties: 0
    got = draw(x, [row(), row(), row()])
    assert [d.token for d in got] == [int(r.argmax()) for r in x] == [4, 0, 0]
    assert all(d.error is None for d in got)
