"""The OpenAI-compatible front door: FastAPI through `@serve.ingress`.

The ingress owns text: it authenticates, renders chat templates, tokenizes, processes images and
video (serve/chat_media.py: data URLs only, into patches it `ray.put`s for the replica that runs the
prompt), checks the context limit and the token ids against the model's vocabulary, and turns
OpenAI fields into SamplingParams, then streams `RequestOutput`s from the server deployment
(DecodeServer when disaggregated, LLMServer otherwise) and shapes them into OpenAI responses or
server-sent events. A batch prompt is one engine request per prompt and choice, answered
prompt-major (choice j of prompt i has index i * n + j). It measures what a client sees: time to
first token, inter-token latency, end-to-end latency, token counts and finish reasons (k3_serve_*).

Each replica builds its own FastAPI app after its constructor (`__serve_build_asgi_app__`), so
routes, handlers and the API key are the deployment's own, not module state.

Bad input is a 4xx with OpenAI's error body (serve/errors.py) and touches no engine. What a server
deployment refuses or fails reaches the client as the OpenAIError it raised; anything else is a
500 `server_error` with a request id, its traceback logged under that id (`client_error`). A
client that disconnects cancels its stream, and the cancellation reaches the replica that holds
the request, which aborts it in its engine.
"""
# No `from __future__ import annotations` here: FastAPI must see the real classes of the route
# parameters (a string annotation is read as a body field).

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from ray import serve

from k3.platform.ops.metrics import ServeMetrics
from k3.serve.chat import ChatTemplate, PromptEncoder
from k3.serve.config import LLMServingConfig
from k3.serve.convert import chat_logprobs, check_token_ids, completion_logprobs, sampling_kwargs
from k3.serve.engine import RequestOutput
from k3.serve.engine.detokenizer import Detokenizer
from k3.serve.errors import (ErrorResponse, OpenAIError, api_key_dependency, install_error_handlers, log_fault,
                             require_model)
from k3.serve.chat_media import ChatMedia
from k3.serve.protocol import (SSE_DONE, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                               ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatDelta,
                               ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse,
                               CompletionStreamResponse, ModelCard, ModelList, TextChunks, UsageInfo, new_id,
                               sse_error, sse_event)
from k3.serve.servers import GenerateRequest, stamp
from k3.serve.token_stream import StreamListener
import k3.model

logger = logging.getLogger("ray.serve")

# once a server's Serve call has ended without error, the seconds its last output may still take
# to arrive on the token stream (it was written before the call ended)
STREAM_TAIL_S = 30.0
# A prompt longer than this (characters, or token ids) is tokenized and checked in a thread, so the
# event loop, which serves every other request, is not held (a 1 MB prompt takes about a second to
# encode); a shorter one stays on the loop: the hop costs ~90 us, encoding 1024 characters ~0.5 ms.
OFF_LOOP_CHARS = 1024


def client_error(e: BaseException) -> OpenAIError:
    """What a client gets for an exception from a server deployment: the OpenAIError the replica
    raised (Ray wraps it in a RayTaskError, once per deployment it crossed, whose text holds the
    replica's pid, address and traceback: none of that goes out), or a 500 with a request id."""
    from ray.exceptions import RayTaskError

    cause = e
    while isinstance(cause, RayTaskError) and cause.cause is not None and cause.cause is not cause:
        cause = cause.cause
    if isinstance(cause, OpenAIError):
        return cause
    return log_fault(e, "a request to the model's servers")


# One server-sent event of a stream (OpenAPI 3.1 documents an event stream by the schema of each
# event): `data` is a JSON chunk of the answer, an error body, or the closing `[DONE]`.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}


def _documented(answer: type[BaseModel]) -> dict:
    """The OpenAPI `responses` of a generation route: the answer or its event stream, and errors."""
    errors = {400: "bad input (param names the field)", 401: "missing or wrong API key",
              404: "unknown model", 500: "server fault (the message has a request id)",
              503: "no prefill replica answered in time"}
    return {200: {"model": answer, "description": "The answer; with stream=true server-sent events of its chunks.",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **{status: {"model": ErrorResponse, "description": why} for status, why in errors.items()}}


@serve.ingress()
class Ingress:
    """The OpenAI API of one served model, in front of its server deployment (`server`)."""

    def __init__(self, config: LLMServingConfig | dict, server) -> None:
        self.config = LLMServingConfig.model_validate(config)
        self.server = server.options(stream=True)
        tok_file = self.config.model.tokenizer_file()
        self.tokenizer = self.config.model.tokenizer()
        # the chat template travels with the tokenizer (tokenizer_config.json beside it)
        self.chat = ChatTemplate.from_checkpoint(tok_file.parent) if tok_file is not None else ChatTemplate()
        self.token_bytes = Detokenizer(self.tokenizer).token_bytes if self.tokenizer is not None else None
        # a chat's messages stay text: a special token spelled in one is encoded as its characters
        self.encoder = PromptEncoder(self.tokenizer) if self.tokenizer is not None else None
        model_cfg = self._model_config()
        self.max_len = self.config.engine.context_length(model_cfg)
        self.vocab_size = model_cfg.vocab_size
        self.media = ChatMedia(model_cfg, self.config.media, self.config.model_id)
        self.api_key = None
        if self.config.api_key_env:
            self.api_key = os.environ.get(self.config.api_key_env)
            if not self.api_key:  # asked for a key and none is there: refuse to start, never serve open
                raise ValueError(f"api_key_env={self.config.api_key_env!r}, but that environment variable is "
                                 f"not set in the ingress replica (pass it in ray_actor_options.runtime_env)")
        self.metrics = ServeMetrics(self.config.model_id, "ingress")
        # the servers' outputs after each request's first, straight to this replica (serve/token_stream.py)
        self.direct = StreamListener(_node_address()) if self.config.direct_stream else None

    def __serve_build_asgi_app__(self) -> FastAPI:
        """This replica's app, its routes bound to this instance (Serve calls it after __init__)."""
        api = FastAPI(title="k3", description="OpenAI-compatible API of a k3 model served on Ray Serve.")
        install_error_handlers(api)
        auth = [Depends(api_key_dependency(self.api_key))]
        api.add_api_route("/health", self.health, methods=["GET"])
        api.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth,
                          responses={401: {"model": ErrorResponse, "description": "missing or wrong API key"}})
        api.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=auth,
                          responses=_documented(CompletionResponse))
        api.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=auth,
                          responses=_documented(ChatCompletionResponse))
        return api

    def _model_config(self):
        from k3.model import get_preset

        src = self.config.model
        if src.preset:
            return get_preset(src.preset)
        return k3.model.load_config(src.path)

    # -- helpers ----------------------------------------------------------------------------------
    def _encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("this model was deployed without a tokenizer: send token ids", param=param)
        # encode_batch lets go of the GIL while it works (encode does not), so a thread encoding a
        # long prompt leaves the event loop running
        return self.tokenizer.encode_batch([text])[0].ids

    async def _off_loop(self, size: int, fn, *args):
        """fn(*args): in a thread when `size` (of the text it works on) is over OFF_LOOP_CHARS."""
        if size <= OFF_LOOP_CHARS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def _chat_ids(self, messages) -> list[int]:
        if self.encoder is None:
            raise OpenAIError("this model was deployed without a tokenizer: send token ids", param="messages")
        return self.encoder.encode_pieces(self.chat.render_pieces(messages, self.encoder.specials))

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise OpenAIError("prompt must not be empty", param="prompt")
        check_token_ids(ids, self.vocab_size, "prompt")
        return ids

    def _requests(self, body, prompts: list[list[int]], media: list | None = None,
                  trace: dict[str, float] | None = None) -> list[GenerateRequest]:
        """One engine request per prompt and choice, prompt-major: choice j of prompt i is i * n + j
        (each with its own copy of `trace`, when the request is traced)."""
        reqs = []
        for i, ids in enumerate(prompts):
            for j in range(body.n):
                kw = sampling_kwargs(body, max_model_len=self.max_len, prompt_len=len(ids),
                                     vocab_size=self.vocab_size, choice_index=i * body.n + j,
                                     default_max_tokens=self.config.default_max_tokens)
                if isinstance(body, ChatCompletionRequest):
                    kw["stop"] = list(dict.fromkeys(kw["stop"] + self.chat.stop))
                reqs.append(GenerateRequest(prompt_token_ids=ids, sampling=kw, media=media,
                                            trace=dict(trace) if trace is not None else None))
        return reqs

    async def _choices(self, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs as they come, tagged with the choice index. The first output of
        each choice is awaited before anything is yielded, so a refused request is still a 4xx.
        Outputs of one choice that arrived while the reader was away come as one (a slow client
        gets one chunk per read, not one per engine step)."""
        queue: asyncio.Queue = asyncio.Queue()
        # a choice's outputs from the token stream wait until its first (from the Serve call) is queued
        early: list[list | None] = [[] for _ in reqs]
        direct, routes = await self._open_streams(reqs, queue, early)

        def close_streams() -> None:
            for r in reqs:
                if r.stream_to is not None:
                    direct.close(r.stream_to)

        for r in reqs:
            stamp(r.trace, "ingress_call")
        gens = [self.server.generate.remote(r) for r in reqs]
        try:
            firsts = []
            for g in gens:
                firsts.append(await g.__anext__())
                stamp(firsts[-1].trace, "ingress_first")
        except BaseException as e:  # noqa: BLE001
            for g in gens:
                g.cancel()
            close_streams()
            if isinstance(e, asyncio.CancelledError):  # the client left: nothing to answer or log
                raise
            raise client_error(e) from e
        tasks = [asyncio.create_task(_pump(queue, early, i, g, f, routes[i] if routes else None))
                 for i, (g, f) in enumerate(zip(gens, firsts))]
        done = 0
        held: deque = deque()  # taken from the queue, not yet yielded
        started: set[int] = set()  # the choices whose first output went out (a first is never merged:
        try:                       # its chunk opens the choice, and in pd it is the prefill's output)
            while done < len(reqs):
                if not held:
                    held.append(await queue.get())
                while not queue.empty():
                    held.append(queue.get_nowait())
                i, item = held.popleft()
                while i in started and not isinstance(item, BaseException) and not item.finished:
                    j = next((k for k, (c, _) in enumerate(held) if c == i), None)
                    if j is None or isinstance(held[j][1], BaseException):
                        break
                    item = item.followed_by(held[j][1])
                    del held[j]
                if isinstance(item, BaseException):
                    raise client_error(item) from item
                if item.finished:
                    done += 1
                started.add(i)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for g in gens:
                g.cancel()  # no-op for finished streams; aborts the rest on their replicas
            close_streams()

    async def _open_streams(self, reqs: list[GenerateRequest], queue: asyncio.Queue, early: list):
        """(the listener, each request's route) with every request's `stream_to` set, or (None, [])
        when this ingress has no token stream (off, or it cannot listen: then never tried again).
        A route's outputs go to `early[i]` until its first is queued, then to `queue`."""
        direct = self.direct  # this request's listener, whatever a concurrent one finds
        if direct is None:
            return None, []
        try:
            await direct.start()
        except OSError as e:  # no socket for it on this node: every output through the Serve calls
            if self.direct is direct:
                logger.warning("the token stream cannot listen on %s (%s): every output goes through the "
                               "Serve calls", direct.host, e)
                self.direct = None
            return None, []
        routes = []
        for i, r in enumerate(reqs):
            def deliver(item, i=i):
                if early[i] is not None:
                    early[i].append(item)
                else:
                    queue.put_nowait((i, item))
            r.stream_to, route = direct.open(deliver)
            routes.append(route)
        return direct, routes

    def _observe(self, t0: float, outs: list[RequestOutput], times: list[float]) -> None:
        if not outs:
            return
        self.metrics.observe("k3_serve_time_to_first_token_seconds", times[0] - t0)
        for a, b in zip(times, times[1:]):
            self.metrics.observe("k3_serve_inter_token_latency_seconds", b - a)
        self.metrics.observe("k3_serve_e2e_request_latency_seconds", times[-1] - t0)
        self.metrics.inc("k3_serve_prompt_tokens", outs[-1].prompt_tokens)
        # from the deltas: a stream left early counts what it got (only a last output holds them all)
        self.metrics.inc("k3_serve_generation_tokens", sum(len(o.new_token_ids) for o in outs))
        self.metrics.inc("k3_serve_requests_finished", finish_reason=outs[-1].finish_reason or "abort")

    # -- routes (bound in __serve_build_asgi_app__) ------------------------------------------------
    async def health(self) -> dict:
        return {"status": "ok"}

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.config.model_id, max_model_len=self.max_len)])

    async def completions(self, body: CompletionRequest, request: Request):
        trace = _trace(request)
        require_model(body.model, [self.config.model_id])
        prompts = body.prompts()
        ids = await self._off_loop(sum(len(p) for p in prompts), lambda: [self._prompt_ids(p) for p in prompts])
        return await self._respond(body, ids, chat=False, trace=trace)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        trace = _trace(request)
        require_model(body.model, [self.config.model_id])
        if body.media():
            import ray

            # decoding and resizing is CPU work: off the event loop, which serves every other request
            ids, items = await asyncio.to_thread(self.media.prompt, self.chat, body.messages, self.encoder,
                                                 self.max_len)
            return await self._respond(body, [ids], chat=True, media=[ray.put(items)], trace=trace)
        ids = await self._off_loop(sum(len(m.text()) for m in body.messages), self._chat_ids, body.messages)
        return await self._respond(body, [ids], chat=True, trace=trace)

    async def _respond(self, body, prompts: list[list[int]], chat: bool, media: list | None = None,
                       trace: dict[str, float] | None = None):
        reqs = self._requests(body, prompts, media, trace)
        prompt_tokens = sum(len(ids) for ids in prompts)
        t0 = time.perf_counter()
        stream = self._choices(reqs)
        try:
            first = await stream.__anext__()  # refusals surface here, before any byte is sent
        except StopAsyncIteration:
            raise log_fault(RuntimeError("the servers' streams ended without an output"), "a request") from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(rid, body.model, chat, first, stream, len(reqs), prompt_tokens,
                                               include_usage, t0, traced=trace is not None),
                                     media_type="text/event-stream")
        per = await self._collect(first, stream, len(reqs), t0)
        usage = UsageInfo.of(prompt_tokens, sum(len(per[i][-1].token_ids) for i in per))
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

    async def _collect(self, first, stream, n: int, t0: float) -> dict[int, list[RequestOutput]]:
        """Every choice's outputs, in order, once all have finished (and their latencies observed)."""
        per: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
        times: dict[int, list[float]] = {i: [] for i in range(n)}
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
        return per

    def _bytes(self):
        if self.token_bytes is None:
            return lambda t: str(t).encode()
        return self.token_bytes

    async def _sse(self, rid, model, chat, first, stream, n, prompt_len, include_usage, t0, traced=False):
        per: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
        times: dict[int, list[float]] = {i: [] for i in range(n)}
        offsets = [0] * n
        created = int(time.time())
        text_chunks = TextChunks(rid, model, chat, created)
        item = first
        try:
            while item is not None:
                i, out = item
                started = not per[i]
                per[i].append(out)
                times[i].append(time.perf_counter())
                if not started and not out.finished and not out.logprobs:
                    yield text_chunks.event(i, out.text_delta)
                else:
                    yield sse_event(self._chunk(rid, model, created, chat, i, out, started, offsets))
                    if started:  # resumed once the first chunk was handed to the connection
                        stamp(out.trace, "sse_first")
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    item = None
            if include_usage:
                usage = UsageInfo.of(prompt_len, sum(len(v[-1].token_ids) for v in per.values() if v))
                cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
                yield sse_event(cls(id=rid, model=model, created=created, choices=[], usage=usage))
            if traced:
                # an SSE comment: OpenAI clients skip it; the benchmark reads the path's stamps from it
                yield f": k3-trace {json.dumps([v[0].trace for v in per.values() if v])}\n\n"
        except Exception as e:  # noqa: BLE001 - the 200 went out: the error is the stream's last event
            yield sse_error(e if isinstance(e, OpenAIError) else log_fault(e, "a stream"))
        finally:
            await stream.aclose()  # a disconnected client lands here: cancels what still runs
            for i in per:
                self._observe(t0, per[i], times[i])
        yield SSE_DONE

    def _chunk(self, rid, model, created, chat, i, out: RequestOutput, started: bool, offsets: list[int]):
        """The stream chunk of one choice's output (its first, its last, or one with logprobs)."""
        if chat:
            delta = ChatDelta(role="assistant" if started else None, content=out.text_delta)
            lp = chat_logprobs(out.logprobs, self._bytes()) if out.logprobs else None
            return ChatCompletionStreamResponse(id=rid, model=model, created=created, choices=[
                ChatCompletionStreamChoice(index=i, delta=delta, logprobs=lp,
                                           finish_reason=out.finish_reason if out.finished else None)])
        lp = None
        if out.logprobs:
            # offsets count the tokens' text, as the whole answer's do: text_delta lags while stop
            # strings hold text back
            lp = completion_logprobs(out.logprobs, self._bytes(), offsets[i])
            offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
        return CompletionStreamResponse(id=rid, model=model, created=created, choices=[CompletionChoice(
            index=i, text=out.text_delta, logprobs=lp, finish_reason=out.finish_reason if out.finished else None)])


async def _pump(queue: asyncio.Queue, early: list, i: int, gen, first: RequestOutput, route) -> None:
    """Choice i's outputs onto `queue`: its first, what its token stream delivered before it
    (`early[i]`), then what its Serve call `gen` carries; errors as items. With a token stream the
    call carries nothing more (or everything, when the replica could not reach this ingress) and
    ends once the last output is written, which must then arrive within STREAM_TAIL_S."""
    try:
        await queue.put((i, first))
        for item in early[i]:
            queue.put_nowait((i, item))
        early[i] = None
        if first.finished:
            return
        async for out in gen:
            await queue.put((i, out))
            if out.finished:
                return
        if route is not None and not route.finished.is_set():
            try:
                await asyncio.wait_for(route.finished.wait(), STREAM_TAIL_S)
            except asyncio.TimeoutError:
                raise RuntimeError(f"the server's call ended, and the answer's last output did not "
                                   f"arrive on the token stream in {STREAM_TAIL_S} s") from None
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        if route is None or not route.finished.is_set():  # an error after the last output is no one's
            await queue.put((i, e))


def _node_address() -> str:
    """The address this replica's node is reached at in its Ray cluster (where the servers connect)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _trace(request: Request) -> dict[str, float] | None:
    """The request's trace stamps, begun here, when the client sent `X-K3-Trace: 1` (the stream
    then ends with a `: k3-trace [...]` comment holding each choice's stamps); else None."""
    if request.headers.get("x-k3-trace") != "1":
        return None
    trace: dict[str, float] = {}
    stamp(trace, "ingress_in")
    return trace
