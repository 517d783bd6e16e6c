"""The OpenAI API as pydantic models: requests, responses, streaming chunks, the model list.

Requests are checked here, at the HTTP boundary: a bad value is a validation error naming the
field (the handlers in `k3.serve.errors` make it a 400 with `param`). Unknown fields are refused
like OpenAI refuses them; vLLM's sampling extensions (`top_k`, `min_tokens`, `stop_token_ids`,
`ignore_eos`) are accepted. OpenAI fields k3 cannot honour (`response_format` other than text,
`tools`, `tool_choice` other than none, `echo`) are declared, so the answer says they are not
supported rather than unknown. `k3.serve.convert` turns a request into the engine's
SamplingParams arguments; `sse_event`/`SSE_DONE` frame a stream.

Shapes follow OpenAI's reference exactly where the two endpoints differ: completions return
`choices[i].text` and logprobs as parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`); chat returns `choices[i].message` (stream: `delta`) and logprobs as
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from .engine.params import Bias, Number, Penalty
from .errors import OpenAIError

MAX_LOGPROBS = 20  # the engine's SamplingParams.logprobs bound
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 2**63 - 1  # torch's generator takes a 64-bit seed; the engine keeps it signed-positive
MAX_CHOICES = 128  # n, and n times the prompts of a batch: the choices one request may ask for
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; k3 matches each one every step)
MAX_LOGIT_BIAS_ENTRIES = 1024  # logit_bias entries per request
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key's digits: any vocabulary's ids, and int() stays cheap
MAX_STOP_TOKEN_IDS = 4096  # stop_token_ids per request
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's metadata limits


def new_id(prefix: str) -> str:
    """A response id in OpenAI's form: "cmpl-<hex>", "chatcmpl-<hex>"."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _integer(v: Any) -> Any:
    # pydantic takes true as 1 and "5" as 5 for an int; either where a count or a token id goes is
    # a mistake (OpenAI's API refuses both)
    if isinstance(v, bool):
        raise ValueError(f"must be an integer, got {str(v).lower()}")
    if isinstance(v, str):
        raise ValueError(f"must be an integer, got the string {v!r}")
    return v


def _unicode(v: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they are not text, and the tokenizer cannot take them
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"must be valid Unicode: a lone surrogate at position {e.start}") from None
    return v


Int = Annotated[int, BeforeValidator(_integer)]
Text = Annotated[str, AfterValidator(_unicode)]


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
    temperature: Number = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                               description="Softmax temperature in [0, 2]; 0 means greedy.")
    top_p: Number = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass, in (0, 1].")
    top_k: Int = Field(0, ge=-1, description="Extension (vLLM): keep the k most likely tokens; 0 or -1 keeps all.")
    min_tokens: Int = Field(0, ge=0, description="Extension (vLLM): suppress stop tokens and EOS until "
                                                 "this many tokens exist.")
    seed: Int | None = Field(None, ge=0, le=MAX_SEED,
                             description="Sampling seed in [0, 2**63 - 1]: the same seed and request give the "
                                         "same tokens.")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"A string or up to {MAX_STOP} strings that end generation; the stop string is not "
                          f"returned.")
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS,
        description=f"Extension (vLLM): up to {MAX_STOP_TOKEN_IDS} token ids that end generation.")
    ignore_eos: bool = Field(False, description="Extension (vLLM): keep generating past EOS (benchmarks).")
    n: Int = Field(1, ge=1, le=MAX_CHOICES, description="How many choices to generate for each prompt.")
    stream: bool = Field(False, description="Send the answer as server-sent events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options; only with stream=true.")
    presence_penalty: Penalty = Field(0.0, description="In [-2, 2]: subtracted once from the logit of every token "
                                                       "generated so far.")
    frequency_penalty: Penalty = Field(0.0, description="In [-2, 2]: subtracted from a token's logit once per time "
                                                        "it was generated so far.")
    logit_bias: dict[str, Bias] | None = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES,
        json_schema_extra={"propertyNames": {"pattern": f"^(0|[1-9][0-9]{{0,{MAX_TOKEN_ID_DIGITS - 1}}})$"}},
        description=f"Token id (a decimal string without leading zeros) -> bias in [-100, 100] added to its "
                    f"logit before sampling; at most {MAX_LOGIT_BIAS_ENTRIES} entries.")
    user: str | None = Field(None, description="An end-user id; accepted and not used.")

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # one spelling per id: "0" and "00" would be two entries for one token, the later silently winning
        bad = [k for k in (v or {}) if not (k.isascii() and k.isdecimal() and len(k) <= MAX_TOKEN_ID_DIGITS
                                            and (k == "0" or k[0] != "0"))]
        if bad:
            raise ValueError(f"keys must be token ids written as decimal strings without leading zeros "
                             f"(\"50256\", at most {MAX_TOKEN_ID_DIGITS} digits), got {[k[:20] for k in bad[:3]]}")
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


Prompt = str | list[int]  # one prompt: text, or token ids


def _batch(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(
        description=f"The prompt: text or token ids, or a batch of either (each gets n choices; at most "
                    f"{MAX_CHOICES} choices in all). Choice j of prompt i has index i * n + j.")
    max_tokens: Int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1,
                                   description="Most tokens to generate; null: up to the context length.")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Return each chosen token's logprob and this many alternatives.")
    echo: bool = Field(False, description="Only false: echoing the prompt is not supported.")

    @field_validator("prompt")
    @classmethod
    def _prompts_non_empty(cls, v, info: ValidationInfo):
        batch = _batch(v)
        if not batch or any(len(p) == 0 for p in batch):
            raise ValueError("a prompt must not be empty")
        if any(isinstance(p, list) and min(p) < 0 for p in batch):
            raise ValueError("token ids must be >= 0")
        for i, p in enumerate(batch):  # here, not in the union: a bad text is not reported as a bad token id
            if isinstance(p, str):
                try:
                    _unicode(p)
                except ValueError as e:
                    raise ValueError(f"the prompt at index {i} {e}" if len(batch) > 1 else str(e)) from None
        n = info.data.get("n", 1)
        if len(batch) * n > MAX_CHOICES:
            raise ValueError(f"{len(batch)} prompts with n={n} ask for {len(batch) * n} choices; at most "
                             f"{MAX_CHOICES}")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported")
        return v

    def prompts(self) -> list[Prompt]:
        """The prompt as a batch: each text or token-id list, in order."""
        return _batch(self.prompt)


class TextPart(_Request):
    """A text part of a message's content."""

    type: Literal["text"] = Field(description="Always 'text'.")
    text: Text = Field(description="The text.")


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

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="Who speaks; 'developer' (OpenAI's newer name for system instructions) is read as 'system'.")
    content: Text | list[ContentPart] = Field(description="Text, or a list of text / image_url / video_url parts.")
    name: str | None = Field(None, description="The speaker's name; accepted and not used.")

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, v: str) -> str:
        return "system" if v == "developer" else v

    @field_validator("content")
    @classmethod
    def _parts(cls, v: str | list, info: ValidationInfo) -> str | list:
        if isinstance(v, list):
            if not v:
                raise ValueError("must be a string or a non-empty list of parts")
            role = info.data.get("role")
            if role is not None and role != "user" and any(not isinstance(p, TextPart) for p in v):
                # as OpenAI's API: pictures and videos come from the user
                raise ValueError(f"image_url and video_url parts are for user messages, not {role} messages")
        return v

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


class ResponseFormat(_Request):
    """The form of the answer: k3 produces plain text only (it has no constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="Only 'text' is supported.")
    json_schema: dict[str, Any] | None = Field(None, description="With type json_schema (not supported).")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: Int | None = Field(None, ge=1, description="Most tokens to generate; wins over "
                                                                      "max_tokens; null: up to the context.")
    max_tokens: Int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens.")
    logprobs: bool = Field(False, description="Return each chosen token's logprob.")
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="How many alternatives per token; needs logprobs=true.")
    response_format: ResponseFormat | None = Field(None, description="Only {'type': 'text'}: JSON modes are not "
                                                                     "supported.")
    store: bool | None = Field(None, description="Accepted; k3 stores no completions.")
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE)]] | None = Field(
        None, max_length=MAX_METADATA, json_schema_extra={"propertyNames": {"maxLength": MAX_METADATA_KEY}},
        description=f"Up to {MAX_METADATA} string pairs (keys up to {MAX_METADATA_KEY} characters, values up to "
                    f"{MAX_METADATA_VALUE}); validated, then not used.")
    tools: list[dict[str, Any]] | None = Field(None, description="Only empty: k3 has no tool calling.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only 'none': k3 has no tool calling.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted (no tools are ever called).")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type != "text":
            raise ValueError(f"type {v.type!r} is not supported: k3 has no constrained decoding; use 'text'")
        return v

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and max(len(k) for k in v) > MAX_METADATA_KEY:
            raise ValueError(f"keys may have at most {MAX_METADATA_KEY} characters")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tools are not supported: k3 has no tool calling")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: str | dict | None) -> str | dict | None:
        if v not in (None, "none"):
            raise ValueError("only 'none' is supported: k3 has no tool calling")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def media(self) -> list[ImageURLPart | VideoURLPart]:
        """Every picture and video of the conversation, in order."""
        return [p for m in self.messages for p in m.media()]


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


class _Answer(_Response):
    """What every answer and streamed chunk carries; subclasses narrow `object` and `choices`."""

    id: str = Field(description="The answer's id, the same in every chunk of a stream.")
    object: str = Field(description="The kind of answer.")
    created: int = Field(default_factory=_now, description="Unix time of creation, seconds.")
    model: str = Field(description="The model that answered.")
    choices: list = Field(description="One per choice; in a stream, the choices that advanced in this chunk.")
    usage: UsageInfo | None = Field(None, description="Token counts; in a stream only the last chunk has them "
                                                      "(with include_usage), and that chunk has no choices.")


class CompletionResponse(_Answer):
    """The answer of POST /v1/completions."""

    id: str = Field(default_factory=lambda: new_id("cmpl"), description="The completion's id.")
    object: Literal["text_completion"] = Field("text_completion", description="Always 'text_completion'.")
    choices: list[CompletionChoice] = Field(description="n per prompt, prompt-major.")


class CompletionStreamResponse(_Answer):
    """One server-sent event of a streamed completion."""

    object: Literal["text_completion"] = Field("text_completion", description="Always 'text_completion'.")
    choices: list[CompletionChoice] = Field(description="The choices that advanced in this chunk.")


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


class ChatCompletionResponse(_Answer):
    """The answer of POST /v1/chat/completions."""

    id: str = Field(default_factory=lambda: new_id("chatcmpl"), description="The answer's id.")
    object: Literal["chat.completion"] = Field("chat.completion", description="Always 'chat.completion'.")
    choices: list[ChatCompletionChoice] = Field(description="One per choice (n).")


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


class ChatCompletionStreamResponse(_Answer):
    """One server-sent event of a streamed chat answer."""

    object: Literal["chat.completion.chunk"] = Field("chat.completion.chunk",
                                                     description="Always 'chat.completion.chunk'.")
    choices: list[ChatCompletionStreamChoice] = Field(description="The choices that advanced in this chunk.")


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


class TextChunks:
    """The events of one stream's chunks that only add text to a choice (no role, logprobs or
    finish reason: every chunk between a choice's first and last), written from a template made
    once per choice with only the text JSON-escaped, instead of a response model built and
    serialized per token. The bytes are the model's (`sse_event`); the stream's other chunks use
    the same `created`, so every chunk of a stream says the same time, as OpenAI's do."""

    def __init__(self, rid: str, model: str, chat: bool, created: int) -> None:
        self.rid, self.model, self.chat, self.created = rid, model, chat, created
        self._templates: dict[int, tuple[str, str]] = {}

    def chunk(self, index: int, text: str) -> BaseModel:
        """The response model of such a chunk (what the template is made from)."""
        if self.chat:
            return ChatCompletionStreamResponse(id=self.rid, model=self.model, created=self.created, choices=[
                ChatCompletionStreamChoice(index=index, delta=ChatDelta(content=text))])
        return CompletionStreamResponse(id=self.rid, model=self.model, created=self.created,
                                        choices=[CompletionChoice(index=index, text=text)])

    def event(self, index: int, text: str) -> str:
        """`sse_event(self.chunk(index, text))`, without building the chunk."""
        t = self._templates.get(index)
        if t is None:
            # the text is the choice's last string field: split the empty chunk's JSON around it
            head, key, tail = sse_event(self.chunk(index, "")).rpartition('"content":""' if self.chat else '"text":""')
            t = self._templates[index] = (head + key[:-2], tail)
        return t[0] + json.dumps(text, ensure_ascii=False) + t[1]
