"""The OpenAI-compatible front door: FastAPI through `@serve.ingress`.

The ingress owns text: it authenticates, renders chat templates, tokenizes, processes images and
video (serve/chat_media.py: data URLs only, into patches it `ray.put`s for the replica that runs the
prompt), checks the context limit and turns OpenAI fields into SamplingParams, then streams
`RequestOutput`s from the server deployment (DecodeServer when disaggregated, LLMServer
otherwise) and shapes them into OpenAI responses or server-sent events. It measures what a client sees: time to first token,
inter-token latency, end-to-end latency, token counts and finish reasons (k3_serve_*).

Bad input is a 4xx with OpenAI's error body (serve/errors.py) and touches no engine. A client
that disconnects cancels its stream, and the cancellation reaches the replica that holds the
request, which aborts it in its engine.
"""
# No `from __future__ import annotations` here: FastAPI must see the real classes of the route
# parameters (a string annotation on a @serve.ingress method is read as a body field).

import asyncio
import os
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve

from k3.platform.ops.metrics import ServeMetrics
from k3.serve.chat import ChatTemplate
from k3.serve.config import LLMServingConfig
from k3.serve.engine import RequestFailed, RequestOutput
from k3.serve.engine.detokenizer import Detokenizer
from k3.serve.errors import OpenAIError, install_error_handlers, require_model
from k3.serve.chat_media import ChatMedia
from k3.serve.protocol import (SSE_DONE, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                               ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatDelta,
                               ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse,
                               CompletionStreamResponse, ModelCard, ModelList, UsageInfo, chat_logprobs,
                               completion_logprobs, new_id, sampling_kwargs, sse_error, sse_event)
from k3.serve.servers import GenerateRequest, HandoffFailed
import k3.model

api = FastAPI(title="k3", description="OpenAI-compatible API of a k3 model served on Ray Serve.")
install_error_handlers(api)


def _engine_error(e: BaseException) -> OpenAIError:
    """A server-side exception as the OpenAI error a client gets."""
    if isinstance(e, ValueError):  # the engine's validation (token ids, cache size, ...)
        return OpenAIError(str(e).split("\n")[0][:500], param=None)
    if isinstance(e, HandoffFailed):
        return OpenAIError(str(e)[:500], status=503, type="service_unavailable", code="handoff_failed")
    if isinstance(e, RequestFailed):
        return OpenAIError(str(e)[:500], status=500, type="server_error", code="request_failed")
    return OpenAIError.internal()


@serve.ingress(api)
class Ingress:
    def __init__(self, config: LLMServingConfig | dict, server) -> None:
        self.config = LLMServingConfig.model_validate(config)
        self.server = server.options(stream=True)
        tok_file = self.config.model.tokenizer_file()
        self.tokenizer = self.config.model.tokenizer()
        # the chat template travels with the tokenizer (tokenizer_config.json beside it)
        self.chat = ChatTemplate.from_checkpoint(tok_file.parent) if tok_file is not None else ChatTemplate()
        self.token_bytes = Detokenizer(self.tokenizer).table.__getitem__ if self.tokenizer is not None else None
        model_cfg = self._model_config()
        self.max_len = self.config.engine.max_model_len or model_cfg.max_position_embeddings
        self.media = ChatMedia(model_cfg, self.config.media, self.config.model_id)
        self.api_key = None
        if self.config.api_key_env:
            self.api_key = os.environ.get(self.config.api_key_env)
            if not self.api_key:  # asked for a key and none is there: refuse to start, never serve open
                raise ValueError(f"api_key_env={self.config.api_key_env!r}, but that environment variable is "
                                 f"not set in the ingress replica (pass it in ray_actor_options.runtime_env)")
        self.metrics = ServeMetrics(self.config.model_id, "ingress")

    def _model_config(self):
        from k3.model import get_preset

        src = self.config.model
        if src.preset:
            return get_preset(src.preset)
        return k3.model.load_config(src.path)

    # -- helpers ----------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not got:
            raise OpenAIError.invalid_api_key(missing=True)
        if got != f"Bearer {self.api_key}":
            raise OpenAIError.invalid_api_key()

    def _encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("this model was deployed without a tokenizer: send token ids", param=param)
        return self.tokenizer.encode(text).ids

    def _requests(self, body, ids: list[int], media: list | None = None) -> list[GenerateRequest]:
        reqs = []
        for i in range(body.n):
            kw = sampling_kwargs(body, max_model_len=self.max_len, prompt_len=len(ids), choice_index=i)
            if isinstance(body, ChatCompletionRequest):
                kw["stop"] = list(dict.fromkeys(kw["stop"] + self.chat.stop))
            reqs.append(GenerateRequest(prompt_token_ids=ids, sampling=kw, media=media))
        return reqs

    async def _choices(self, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs as they come, tagged with the choice index. The first output of
        each choice is awaited before anything is yielded, so a refused request is still a 4xx."""
        gens = [self.server.generate.remote(r) for r in reqs]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen, first):
            try:
                await queue.put((i, first))
                if not first.finished:
                    async for out in gen:
                        await queue.put((i, out))
                        if out.finished:
                            break
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))

        try:
            firsts = []
            for g in gens:
                firsts.append(await g.__anext__())
        except BaseException as e:  # noqa: BLE001
            for g in gens:
                g.cancel()
            raise _engine_error(e) from e
        tasks = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts))]
        done = 0
        try:
            while done < len(reqs):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise _engine_error(item) from item
                if item.finished:
                    done += 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for g in gens:
                g.cancel()  # no-op for finished streams; aborts the rest on their replicas

    def _observe(self, t0: float, outs: list[RequestOutput], times: list[float]) -> None:
        if not outs:
            return
        self.metrics.observe("k3_serve_time_to_first_token_seconds", times[0] - t0)
        for a, b in zip(times, times[1:]):
            self.metrics.observe("k3_serve_inter_token_latency_seconds", b - a)
        self.metrics.observe("k3_serve_e2e_request_latency_seconds", times[-1] - t0)
        self.metrics.inc("k3_serve_prompt_tokens", outs[-1].prompt_tokens)
        self.metrics.inc("k3_serve_generation_tokens", len(outs[-1].token_ids))
        self.metrics.inc("k3_serve_requests_finished", finish_reason=outs[-1].finish_reason or "abort")

    # -- routes -------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._auth(request)
        return ModelList(data=[ModelCard(id=self.config.model_id, max_model_len=self.max_len)])

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._auth(request)
        require_model(body.model, [self.config.model_id])
        ids = self._encode(body.prompt, "prompt") if isinstance(body.prompt, str) else list(body.prompt)
        if not ids:
            raise OpenAIError("prompt must not be empty", param="prompt")
        return await self._respond(body, ids, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._auth(request)
        require_model(body.model, [self.config.model_id])
        if body.media():
            import ray

            # decoding and resizing is CPU work: off the event loop, which serves every other request
            ids, items = await asyncio.to_thread(self.media.prompt, self.chat, body.messages, self.tokenizer)
            return await self._respond(body, ids, chat=True, media=[ray.put(items)])
        ids = self._encode(self.chat.render(body.messages), "messages")
        return await self._respond(body, ids, chat=True)

    async def _respond(self, body, ids: list[int], chat: bool, media: list | None = None):
        reqs = self._requests(body, ids, media)
        t0 = time.perf_counter()
        stream = self._choices(reqs)
        try:
            first = await stream.__anext__()  # refusals surface here, before any byte is sent
        except StopAsyncIteration:
            raise OpenAIError.internal() from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(rid, body.model, chat, first, stream, len(reqs), len(ids),
                                               include_usage, t0), media_type="text/event-stream")
        per: dict[int, list[RequestOutput]] = {i: [] for i in range(len(reqs))}
        times: dict[int, list[float]] = {i: [] for i in range(len(reqs))}
        item = first
        while True:
            per[item[0]].append(item[1])
            times[item[0]].append(time.perf_counter())
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                break
        for i in per:
            self._observe(t0, per[i], times[i])
        usage = UsageInfo.of(len(ids), sum(len(per[i][-1].token_ids) for i in per))
        if chat:
            choices = [ChatCompletionChoice(
                index=i, message=ChatResponseMessage(content="".join(o.text_delta for o in per[i])),
                logprobs=chat_logprobs([e for o in per[i] for e in o.logprobs], self._bytes())
                if body.logprobs else None, finish_reason=per[i][-1].finish_reason) for i in per]
            return ChatCompletionResponse(id=rid, model=body.model, choices=choices, usage=usage)
        choices = [CompletionChoice(
            index=i, text="".join(o.text_delta for o in per[i]),
            logprobs=completion_logprobs([e for o in per[i] for e in o.logprobs], self._bytes())
            if body.logprobs is not None else None, finish_reason=per[i][-1].finish_reason) for i in per]
        return CompletionResponse(id=rid, model=body.model, choices=choices, usage=usage)

    def _bytes(self):
        if self.token_bytes is None:
            return lambda t: str(t).encode()
        return self.token_bytes

    async def _sse(self, rid, model, chat, first, stream, n, prompt_len, include_usage, t0):
        per: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
        times: dict[int, list[float]] = {i: [] for i in range(n)}
        offsets = [0] * n
        item = first
        try:
            while item is not None:
                i, out = item
                started = not per[i]
                per[i].append(out)
                times[i].append(time.perf_counter())
                if chat:
                    delta = ChatDelta(role="assistant" if started else None, content=out.text_delta)
                    lp = chat_logprobs(out.logprobs, self._bytes()) if out.logprobs else None
                    chunk = ChatCompletionStreamResponse(id=rid, model=model, choices=[ChatCompletionStreamChoice(
                        index=i, delta=delta, logprobs=lp, finish_reason=out.finish_reason if out.finished else None)])
                else:
                    lp = completion_logprobs(out.logprobs, self._bytes(), offsets[i]) if out.logprobs else None
                    offsets[i] += len(out.text_delta)
                    chunk = CompletionStreamResponse(id=rid, model=model, choices=[CompletionChoice(
                        index=i, text=out.text_delta, logprobs=lp,
                        finish_reason=out.finish_reason if out.finished else None)])
                yield sse_event(chunk)
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    item = None
            if include_usage:
                usage = UsageInfo.of(prompt_len, sum(len(v[-1].token_ids) for v in per.values() if v))
                cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
                yield sse_event(cls(id=rid, model=model, choices=[], usage=usage))
        except OpenAIError as e:
            yield sse_error(e)
        finally:
            await stream.aclose()  # a disconnected client lands here: cancels what still runs
            for i in per:
                self._observe(t0, per[i], times[i])
        yield SSE_DONE

