"""The OpenAI API as pydantic models: requests, responses, streaming chunks, the model list.

Requests are checked here, at the HTTP boundary: a bad value is a validation error naming the
field (the handlers in `k3.serve.errors` make it a 400 with `param`). Unknown fields are refused
like OpenAI refuses them; vLLM's sampling extensions (`top_k`, `min_tokens`, `stop_token_ids`,
`ignore_eos`) are accepted. `sampling_kwargs` turns a request into the engine's SamplingParams
arguments with OpenAI's defaults; `sse_event`/`SSE_DONE` frame a stream.

Shapes follow OpenAI's reference exactly where the two endpoints differ: completions return
`choices[i].text` and logprobs as parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`); chat returns `choices[i].message` (stream: `delta`) and logprobs as
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import OpenAIError

MAX_LOGPROBS = 20  # the engine's SamplingParams.logprobs bound
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 2**63 - 1  # torch's generator takes a 64-bit seed; the engine keeps it signed-positive


def new_id(prefix: str) -> str:
    """A response id in OpenAI's form: "cmpl-<hex>", "chatcmpl-<hex>"."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------
# Requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    """Options of a streamed response."""

    include_usage: bool = Field(False, description="Send one more chunk before [DONE] with the "
                                                   "request's usage and no choices.")


class _SamplingFields(_Request):
    """Fields the two endpoints share."""

    model: str = Field(description="The served model's name (see GET /v1/models).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                               description="Softmax temperature in [0, 2]; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Extension (vLLM): keep the k most likely tokens; 0 or -1 keeps all.")
    min_tokens: int = Field(0, ge=0, description="Extension (vLLM): suppress stop tokens and EOS until "
                                                 "this many tokens exist.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="Sampling seed in [0, 2**63 - 1]: the same seed and request give the "
                                         "same tokens.")
    stop: str | list[str] | None = Field(None, description="Up to any number of strings that end generation; "
                                                           "the stop string is not returned.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list,
                                                              description="Extension (vLLM): token ids that end "
                                                                          "generation.")
    ignore_eos: bool = Field(False, description="Extension (vLLM): keep generating past EOS (benchmarks).")
    n: int = Field(1, ge=1, le=128, description="How many choices to generate for the prompt.")
    stream: bool = Field(False, description="Send the answer as server-sent events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options; only with stream=true.")
    presence_penalty: float = Field(0.0, description="Accepted only at 0: the engine has no penalties.")
    frequency_penalty: float = Field(0.0, description="Accepted only at 0: the engine has no penalties.")
    user: str | None = Field(None, description="An end-user id, for logs.")

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("only 0 is supported: this server applies no presence or frequency penalty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] = Field(
        description="The prompt: text, or token ids.")
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1,
                                   description="Most tokens to generate; null: up to the context length.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Return each chosen token's logprob and this many alternatives.")
    echo: bool = Field(False, description="Only false: echoing the prompt is not supported.")

    @field_validator("prompt")
    @classmethod
    def _token_ids_non_negative(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v


class TextPart(_Request):
    """A text part of a message's content."""

    type: Literal["text"] = Field(description="Always 'text'.")
    text: str = Field(description="The text.")


class MediaURL(_Request):
    """Where a picture or a video is: an http(s) URL or a `data:` URL."""

    url: str = Field(min_length=1, description="http(s) URL or data URL (base64).")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="OpenAI's detail hint; accepted "
                                                                            "and not used.")


class ImageURLPart(_Request):
    """A picture in a message's content."""

    type: Literal["image_url"] = Field(description="Always 'image_url'.")
    image_url: MediaURL = Field(description="The picture.")


class VideoURLPart(_Request):
    """A video in a message's content (vLLM's extension of OpenAI's parts)."""

    type: Literal["video_url"] = Field(description="Always 'video_url'.")
    video_url: MediaURL = Field(description="The video.")


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: str | list[ContentPart] = Field(description="Text, or a list of text / image_url / video_url parts.")
    name: str | None = Field(None, description="The speaker's name; accepted and not used.")

    def text(self) -> str:
        """The message's text: the content string, or its text parts joined with newlines."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def media(self) -> list[ImageURLPart | VideoURLPart]:
        """The message's pictures and videos, in order."""
        if isinstance(self.content, str):
            return []
        return [p for p in self.content if not isinstance(p, TextPart)]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Most tokens to generate; wins over "
                                                                      "max_tokens; null: up to the context.")
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens.")
    logprobs: bool = Field(False, description="Return each chosen token's logprob.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="How many alternatives per token; needs logprobs=true.")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def media(self) -> list[ImageURLPart | VideoURLPart]:
        """Every picture and video of the conversation, in order (the app refuses them until
        the vision path lands)."""
        return [p for m in self.messages for p in m.media()]


def sampling_kwargs(req: CompletionRequest | ChatCompletionRequest, *, max_model_len: int, prompt_len: int,
                    choice_index: int = 0) -> dict[str, Any]:
    """Keyword arguments of `k3.serve.engine.SamplingParams` for one choice of `req`.

    OpenAI's semantics: chat's `max_completion_tokens` wins over `max_tokens`, and without either
    a chat answer may run to the context length; completions default to 16 tokens. A prompt that
    leaves no room, or a max_tokens that does not fit beside the prompt, is a 400
    `context_length_exceeded`. With n > 1 and a seed, choice i samples with seed + i (mod 2**63),
    so the choices differ and each stays reproducible.
    """
    if max_model_len < 1 or prompt_len < 0:
        raise ValueError(f"max_model_len must be >= 1 and prompt_len >= 0, got {max_model_len}, {prompt_len}")
    if not 0 <= choice_index < req.n:
        raise ValueError(f"choice_index must be in [0, n={req.n}), got {choice_index}")
    chat = isinstance(req, ChatCompletionRequest)
    param = "messages" if chat else "prompt"
    room = max_model_len - prompt_len
    if room < 1:
        raise OpenAIError.context_length_exceeded(max_model_len, prompt_len, param=param)
    asked = (req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens) if chat \
        else req.max_tokens
    if asked is not None and asked > room:
        raise OpenAIError.context_length_exceeded(max_model_len, prompt_len, asked, param=param)
    max_tokens = room if asked is None else asked
    if req.min_tokens > max_tokens:
        raise OpenAIError(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return {
        "max_tokens": max_tokens,
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
    }


# ---------------------------------------------------------------------------------------------
# Responses

FinishReason = Literal["stop", "length", "abort"]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageInfo(_Response):
    """Token counts of one request (all choices)."""

    prompt_tokens: int = Field(ge=0, description="Tokens in the prompt.")
    completion_tokens: int = Field(ge=0, description="Tokens generated, over all choices.")
    total_tokens: int = Field(ge=0, description="prompt_tokens + completion_tokens.")

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)

    @model_validator(mode="after")
    def _total(self):
        if self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise ValueError(f"total_tokens ({self.total_tokens}) != prompt_tokens + completion_tokens "
                             f"({self.prompt_tokens} + {self.completion_tokens})")
        return self


class CompletionLogprobs(_Response):
    """Completions' logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list, description="The tokens' text.")
    token_logprobs: list[float | None] = Field(default_factory=list, description="Each chosen token's logprob.")
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list,
                                                        description="Per token: alternative text -> logprob.")
    text_offset: list[int] = Field(default_factory=list, description="Each token's offset in the choice's text.")


class CompletionChoice(_Response):
    """One choice of a completion (also one choice of a streamed chunk, with the text so far)."""

    index: int = Field(ge=0, description="The choice's number, 0..n-1.")
    text: str = Field(description="Generated text (in a stream: the new text of this chunk).")
    logprobs: CompletionLogprobs | None = Field(None, description="Logprobs, when asked for.")
    finish_reason: FinishReason | None = Field(None, description="Why it ended: stop, length, abort; "
                                                                 "null while streaming.")


class CompletionResponse(_Response):
    """The answer of POST /v1/completions."""

    id: str = Field(default_factory=lambda: new_id("cmpl"), description="The completion's id.")
    object: Literal["text_completion"] = Field("text_completion", description="Always 'text_completion'.")
    created: int = Field(default_factory=_now, description="Unix time of creation, seconds.")
    model: str = Field(description="The model that answered.")
    choices: list[CompletionChoice] = Field(description="One per choice (n).")
    usage: UsageInfo | None = Field(None, description="Token counts.")


class CompletionStreamResponse(_Response):
    """One server-sent event of a streamed completion. The usage chunk has no choices."""

    id: str = Field(description="The completion's id, the same in every chunk.")
    object: Literal["text_completion"] = Field("text_completion", description="Always 'text_completion'.")
    created: int = Field(default_factory=_now, description="Unix time of creation, seconds.")
    model: str = Field(description="The model that answers.")
    choices: list[CompletionChoice] = Field(description="The choices that advanced in this chunk.")
    usage: UsageInfo | None = Field(None, description="Only in the last chunk, with include_usage.")


class TopLogprob(_Response):
    """An alternative token in chat logprobs."""

    token: str = Field(description="The token's text.")
    logprob: float = Field(description="Its log probability.")
    bytes: list[int] | None = Field(None, description="The token's UTF-8 bytes.")


class ChatTokenLogprob(TopLogprob):
    """A generated token in chat logprobs, with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list, description="The most likely alternatives.")


class ChatLogprobs(_Response):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = Field(None, description="Per token of the message content.")


class ChatResponseMessage(_Response):
    """The assistant's message in a chat answer."""

    role: Literal["assistant"] = Field("assistant", description="Always 'assistant'.")
    content: str | None = Field(description="The generated text.")


class ChatCompletionChoice(_Response):
    """One choice of a chat answer."""

    index: int = Field(ge=0, description="The choice's number, 0..n-1.")
    message: ChatResponseMessage = Field(description="The generated message.")
    logprobs: ChatLogprobs | None = Field(None, description="Logprobs, when asked for.")
    finish_reason: FinishReason | None = Field(description="Why it ended: stop, length, abort.")


class ChatCompletionResponse(_Response):
    """The answer of POST /v1/chat/completions."""

    id: str = Field(default_factory=lambda: new_id("chatcmpl"), description="The answer's id.")
    object: Literal["chat.completion"] = Field("chat.completion", description="Always 'chat.completion'.")
    created: int = Field(default_factory=_now, description="Unix time of creation, seconds.")
    model: str = Field(description="The model that answered.")
    choices: list[ChatCompletionChoice] = Field(description="One per choice (n).")
    usage: UsageInfo | None = Field(None, description="Token counts.")


class ChatDelta(_Response):
    """What a streamed chunk adds to a choice's message: the role first, then content."""

    role: Literal["assistant"] | None = Field(None, description="Set in a choice's first chunk only.")
    content: str | None = Field(None, description="New text.")


class ChatCompletionStreamChoice(_Response):
    """One choice's step in a streamed chat answer."""

    index: int = Field(ge=0, description="The choice's number, 0..n-1.")
    delta: ChatDelta = Field(description="What this chunk adds.")
    logprobs: ChatLogprobs | None = Field(None, description="Logprobs of this chunk's tokens, when asked for.")
    finish_reason: FinishReason | None = Field(None, description="Set in the choice's last chunk.")


class ChatCompletionStreamResponse(_Response):
    """One server-sent event of a streamed chat answer. The usage chunk has no choices."""

    id: str = Field(description="The answer's id, the same in every chunk.")
    object: Literal["chat.completion.chunk"] = Field("chat.completion.chunk",
                                                     description="Always 'chat.completion.chunk'.")
    created: int = Field(default_factory=_now, description="Unix time of creation, seconds.")
    model: str = Field(description="The model that answers.")
    choices: list[ChatCompletionStreamChoice] = Field(description="The choices that advanced in this chunk.")
    usage: UsageInfo | None = Field(None, description="Only in the last chunk, with include_usage.")


class ModelCard(_Response):
    """One served model in GET /v1/models."""

    id: str = Field(description="The name requests use in `model`.")
    object: Literal["model"] = Field("model", description="Always 'model'.")
    created: int = Field(default_factory=_now, description="Unix time the server started serving it.")
    owned_by: str = Field("k3", description="Who serves it.")
    max_model_len: int | None = Field(None, ge=1, description="Extension (vLLM): longest prompt + output.")


class ModelList(_Response):
    """GET /v1/models."""

    object: Literal["list"] = Field("list", description="Always 'list'.")
    data: list[ModelCard] = Field(description="The served models.")


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


# ---------------------------------------------------------------------------------------------
# Server-sent events

SSE_DONE = "data: [DONE]\n\n"


def sse_event(chunk: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying `chunk` as JSON: `data: {...}\\n\\n`."""
    body = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk, separators=(",", ":"))
    return f"data: {body}\n\n"


def sse_error(err: OpenAIError) -> str:
    """The event a stream sends when it fails after the 200 went out (vLLM's way): the error body;
    send SSE_DONE after it."""
    return sse_event(err.body())
