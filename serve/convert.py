"""Between the OpenAI wire models (protocol.py) and the engine: a request's choice as the engine's
SamplingParams arguments, checked against the served model (context length, vocabulary), and
the engine's per-token logprobs in OpenAI's two shapes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .errors import OpenAIError
from .protocol import (MAX_SEED, ChatCompletionRequest, ChatLogprobs, ChatTokenLogprob, CompletionLogprobs,
                       CompletionRequest, TopLogprob)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 naming `param` unless every id is a token of the served model's vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"{param}: token ids out of range [0, {vocab_size}) of this model's vocabulary: {bad[:5]}",
                          param=param)


def _max_tokens(req: CompletionRequest | ChatCompletionRequest, max_model_len: int, prompt_len: int,
                default: int | None = None) -> int | None:
    """OpenAI's budget: chat's `max_completion_tokens` wins over `max_tokens`, and without either a
    chat answer may run to the end of the context (None: max_model_len, or the end of the serving
    engine's cache when it holds fewer tokens) or to `default` (the deployment's
    default_max_tokens) when that comes first; completions default to 16 (the request's default)."""
    chat = isinstance(req, ChatCompletionRequest)
    param = "messages" if chat else "prompt"
    room = max_model_len - prompt_len
    if room < 1:
        raise OpenAIError.context_length_exceeded(max_model_len, prompt_len, param=param)
    asked = (req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens) if chat \
        else req.max_tokens
    if asked is not None and asked > room:
        raise OpenAIError.context_length_exceeded(max_model_len, prompt_len, asked, param=param)
    if asked is None and default is not None and default < room:
        asked = default
    if req.min_tokens > (room if asked is None else asked):
        raise OpenAIError(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({room if asked is None else asked})",
                          param="min_tokens")
    return asked


def sampling_kwargs(req: CompletionRequest | ChatCompletionRequest, *, max_model_len: int, prompt_len: int,
                    vocab_size: int, choice_index: int = 0, default_max_tokens: int | None = None) -> dict[str, Any]:
    """Keyword arguments of `k3.serve.engine.SamplingParams` for choice `choice_index` of `req`
    (prompt-major over a batch: choice j of prompt i is i * n + j).

    A prompt that leaves no room, or a max_tokens that does not fit beside the prompt, is a 400
    `context_length_exceeded`; a stop token or logit_bias key outside the vocabulary a 400 naming
    it. With a seed, choice k samples with seed + k (mod 2**63), so the choices differ and each
    stays reproducible.
    """
    if max_model_len < 1 or prompt_len < 0 or vocab_size < 1:
        raise ValueError(f"max_model_len and vocab_size must be >= 1 and prompt_len >= 0, got {max_model_len}, "
                         f"{vocab_size}, {prompt_len}")
    choices = req.n * (len(req.prompts()) if isinstance(req, CompletionRequest) else 1)
    if not 0 <= choice_index < choices:
        raise ValueError(f"choice_index must be in [0, {choices}), got {choice_index}")
    check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    check_token_ids(list(bias), vocab_size, "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return {
        "max_tokens": _max_tokens(req, max_model_len, prompt_len, default_max_tokens),
        "min_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": max(req.top_k, 0),
        "seed": None if req.seed is None else (req.seed + choice_index) % (MAX_SEED + 1),
        "stop": req.stop_list(),
        "stop_token_ids": list(req.stop_token_ids),
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "include_stop_str_in_output": False,
        "logit_bias": bias,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
    }


# ---------------------------------------------------------------------------------------------
# The engine's logprobs in OpenAI's shapes

TokenBytes = Callable[[int], bytes]  # token id -> its bytes (k3: Detokenizer(tok).table[id])


def _token_text(token_bytes: TokenBytes, token_id: int) -> tuple[str, list[int]]:
    # a byte-level token may hold part of a UTF-8 character: its text has U+FFFD, its bytes are exact
    b = token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(entries: Sequence[dict], token_bytes: TokenBytes) -> ChatLogprobs:
    """The engine's per-token logprobs (RequestOutput.logprobs: {"token": id, "logprob": x,
    "top": {id: x}}) in chat's shape: one entry per token, its alternatives in `top_logprobs`."""
    content = []
    for e in entries:
        text, raw = _token_text(token_bytes, e["token"])
        top = []
        for tid, lp in (e.get("top") or {}).items():
            t, b = _token_text(token_bytes, tid)
            top.append(TopLogprob(token=t, logprob=lp, bytes=b))
        content.append(ChatTokenLogprob(token=text, logprob=e["logprob"], bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(entries: Sequence[dict], token_bytes: TokenBytes, text_offset: int = 0) -> CompletionLogprobs:
    """The engine's per-token logprobs in completions' shape (parallel lists). Each token's
    `top_logprobs` holds its alternatives and the chosen token (as vLLM and OpenAI do); `text_offset`
    is where the first token starts in the choice's text (in a stream: the length sent before)."""
    out = CompletionLogprobs()
    offset = text_offset
    for e in entries:
        text, _ = _token_text(token_bytes, e["token"])
        top = {_token_text(token_bytes, tid)[0]: lp for tid, lp in (e.get("top") or {}).items()}
        top.setdefault(text, e["logprob"])
        out.tokens.append(text)
        out.token_logprobs.append(e["logprob"])
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out
