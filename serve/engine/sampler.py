"""Batched sampling for one step: every row's token from one set of tensor ops.

First each row's logits are adjusted as its request asks, in OpenAI's order and definitions:
`logit_bias` added, then the penalties over the tokens the request generated so far
(logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)), then the banned
tokens set to -inf; a row that asks for none of it is not touched, so its draw is bit for bit
what it was before these existed. Logprobs are those of the adjusted logits (before temperature).

Greedy rows (temperature below GREEDY_BELOW) take the argmax; sampled rows are divided by their
own temperature, cut to their own top-k and top-p in one sort (the most likely token always
kept), and drawn: rows without a seed in one `multinomial` call on the engine's generator,
seeded rows each from their own generator (so a seeded request draws the same numbers alone or
in any batch). A row whose logits hold NaN or +inf, that has no token left, or whose
probabilities are not a distribution gets an error instead of a token; the other rows are
unaffected.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams


NON_FINITE = "the model produced non-finite logits for this request"
NOTHING_LEFT = "no token is left to choose: every token is banned (stop_token_ids and EOS before min_tokens) or -inf"
NO_DISTRIBUTION = "this request's temperature, top_k and top_p left no token with a positive, finite probability"


@dataclass
class Draw:
    token: int | None  # None when the row failed
    logprob: dict | None  # {"token", "logprob", "top": {id: lp}} when asked
    error: str | None = None


@dataclass
class SampleRow:
    """What the sampler needs of one row's request."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own, when it has a seed
    banned: list[int]  # token ids it may not produce now (stop tokens and EOS before min_tokens)
    output: Sequence[int]  # the tokens it generated so far (the penalties count them)


def adjust(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """logits [M, V] float32 -> each row's bias, penalties and bans applied (module doc): a changed
    copy, or logits itself when no row asks for any (the caller's tensor is never written)."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    pen = [i for i, r in enumerate(rows) if r.output and (r.params.presence_penalty or r.params.frequency_penalty)]
    banned = [i for i, r in enumerate(rows) if r.banned]
    if not (biased or pen or banned):
        return logits
    logits = logits.clone()
    for i in biased:
        bias = rows[i].params.logit_bias
        ids = torch.tensor(list(bias), device=logits.device)
        logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device)
    if pen:
        V = logits.shape[-1]
        counts = torch.stack([torch.bincount(torch.tensor(list(rows[i].output), device=logits.device), minlength=V)
                              for i in pen]).float()  # [m, V]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pen], device=logits.device)
        presence = torch.tensor([rows[i].params.presence_penalty for i in pen], device=logits.device)
        logits[pen] -= freq[:, None] * counts + presence[:, None] * (counts > 0).float()
    for i in banned:
        logits[i, rows[i].banned] = float("-inf")
    return logits


def sample(logits: torch.Tensor, rows: list[SampleRow], shared: torch.Generator) -> list[Draw]:
    """logits [M, V] (any float dtype) -> one Draw per row; `shared` draws for rows without a seed."""
    logits = adjust(logits.float(), rows)
    M = logits.shape[0]
    params = [r.params for r in rows]
    generators = [r.generator for r in rows]
    # NaN or +inf anywhere, or nothing left to choose (every token banned or -inf): no token. A
    # row's max is NaN when it holds a NaN (max propagates it), else +inf or -inf exactly then.
    # One pass gives every row's max and its first index: the greedy rows' tokens (argmax's
    # choice on ties) come with the check.
    top_value, top_index = logits.max(-1)
    errors: list[str | None] = [None if math.isfinite(m) else NOTHING_LEFT if m == -math.inf else NON_FINITE
                                for m in top_value.tolist()]
    bad = [e is not None for e in errors]
    tokens = [None] * M
    greedy = [i for i, p in enumerate(params) if p.greedy and not bad[i]]
    if greedy:
        top = top_index.tolist()
        for i in greedy:
            tokens[i] = top[i]
    sampled = [i for i, p in enumerate(params) if not p.greedy and not bad[i]]
    if sampled:
        probs = _probs(logits[sampled], [params[i] for i in sampled])
        # A row whose probabilities are not a distribution fails alone rather than the batch's
        # multinomial (which raises for every row); _probs keeps each row's top token, so this is
        # a last line of defence, not a path any valid parameters take.
        drawable = (torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)).tolist()
        if not all(drawable):
            for j in [j for j, ok in enumerate(drawable) if not ok]:
                errors[sampled[j]], bad[sampled[j]] = NO_DISTRIBUTION, True
            keep = [j for j, ok in enumerate(drawable) if ok]
            sampled, probs = [sampled[j] for j in keep], probs[keep]
        unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
        if unseeded:
            drawn = torch.multinomial(probs[unseeded], 1, generator=shared)[:, 0].tolist()
            for j, t in zip(unseeded, drawn):
                tokens[sampled[j]] = t
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                tokens[i] = int(torch.multinomial(probs[j:j + 1], 1, generator=generators[i])[0, 0])
    want = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] is not None]
    lps: dict[int, dict] = {}
    if want:
        logp = torch.log_softmax(logits[want], -1)
        kmax = max(params[i].logprobs for i in want)
        top = logp.topk(kmax, dim=-1) if kmax else None
        for j, i in enumerate(want):
            entry = {"token": tokens[i], "logprob": float(logp[j, tokens[i]])}
            k = params[i].logprobs
            if k:  # a banned token (-inf) is no alternative: fewer than k when fewer are allowed
                entry["top"] = {int(t): float(v) for v, t in zip(top.values[j, :k], top.indices[j, :k])
                                if v != -math.inf}
            lps[i] = entry
    return [Draw(tokens[i], lps.get(i), errors[i]) for i in range(M)]


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p per row, in one descending sort; -> probabilities [m, V]."""
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    logits = logits / temp[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=logits.device)
    rank = torch.arange(V, device=logits.device)[None]
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device)
    if bool((top_p < 1).any()):
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        # Rows with top_p = 1 keep everything: cumsum can round to 1 before the tail, and a row's
        # result must not depend on the other rows in its batch.
        # The first token stays whatever top_p is: a top_p below float32's smallest number (1e-300
        # passes the (0, 1] check) is 0 here, and dropping every token left NaN to draw from.
        drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None] & (rank > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return out.softmax(-1)
