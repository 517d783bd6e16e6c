"""The Ray Serve deployments around the engine, in Ray Serve LLM's shape (each server owns one
engine; configs are pydantic; builder.py binds them).

- `LLMServer`: the aggregated setup, prompt and decode on one engine.
- `PrefillServer`: runs a prompt to its first token and exports the hybrid cache state
  (`HybridCacheState`), which it `ray.put`s and returns as an ObjectRef nested in the reply
  (Serve resolves only top-level refs). The replica owns what it put.
- `DecodeServer`: takes each request, asks a prefill replica (through the prefix-affinity
  router) for its state, imports it and decodes. A prefill replica that dies or is scaled down
  before the state arrives (`OwnerDiedError`, a dead actor) is retried on another replica, up to
  `handoff_attempts`, then the request fails cleanly; it never hangs (a timeout bounds the wait).

Every server streams `RequestOutput`s (async generators: call with `handle.options(stream=True)`);
a caller that goes away cancels the generator, which aborts the request in the engine. What a
server raises for a request is an `OpenAIError` carrying the reason a client may read and its
HTTP status (`engine_stream`); Ray delivers it wrapped in its RayTaskError, which the ingress
unwraps (serve/ingress.py: `client_error`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from k3.model import K3ForCausalLM, K3ForConditionalGeneration, get_preset
from k3.platform.ops.metrics import ServeMetrics
from k3.serve.config import LLMServingConfig, ModelSource
from k3.serve.engine import AsyncEngine, HybridCacheState, LLMEngine, RequestFailed, RequestOutput, SamplingParams
from k3.serve.engine.async_engine import background_executor
from k3.serve.engine.cache_manager import page_hashes
from k3.serve.engine.engine_core import ProcessEngine
from k3.serve.engine.handoff import PoolRun
from k3.serve.errors import OpenAIError, log_fault
from k3.serve.prefix_pool import PrefixPool, pack_pages, unpack_pages
from k3.serve.router import DEFAULT_ROUTE_PAGES, prefix_route_key
from k3.serve.token_stream import StreamLinks, StreamTo, Unreachable
import k3.model

logger = logging.getLogger("ray.serve")


@dataclass
class GenerateRequest:
    """What the ingress sends a server: token ids and sampling (the servers never see text)."""

    prompt_token_ids: list[int]
    sampling: dict  # SamplingParams fields
    request_id: str | None = None
    route_key: str | None = None  # prefix-affinity key of the prompt's first pages (serve/router.py)
    # [ObjectRef of list[MediaItem]]: the prompt's processed images / video chunks, put by the
    # ingress; nested so a DecodeServer forwards the reference and only the replica that runs the
    # prompt fetches the patches
    media: list | None = None
    arrival: float = field(default_factory=time.time)
    # {stamp: time.time()} when the client asked for the request's path to be traced: every hop
    # adds its stamps (`stamp`) and the first output carries them back (RequestOutput.trace)
    trace: dict[str, float] | None = None
    # the ingress's token stream for the outputs after the first (serve/token_stream.py); None:
    # every output goes back through the Serve call
    stream_to: StreamTo | None = None


def stamp(trace: dict[str, float] | None, name: str) -> None:
    """Note the wall-clock time of a point on a traced request's path (nothing when not traced).
    Wall clocks, because the stamps come from several processes (one host's clock, or clocks
    kept in sync across hosts)."""
    if trace is not None:
        trace[name] = time.time()


async def engine_stream(outputs: AsyncIterator[RequestOutput], input_checked: bool = False
                        ) -> AsyncIterator[RequestOutput]:
    """One request's outputs from the engine, its exceptions turned into the errors a client gets.
    A ValueError is the engine refusing the request's input (400, its message says why), unless
    that input was checked already: then it is a server fault (500, logged). A RequestFailed ends
    the request for a reason the engine wrote for its owner (500 `server_error`).

    What crosses the Serve hop of a running request is the step's delta: an unfinished output's
    cumulative `token_ids` and `text` are emptied here (the engine's own object, handed to this
    stream alone), and the finished output carries them whole. Sent every token they cost a
    pickle and an unpickle of everything generated so far: 20 KB and ~100 us a token after 4K
    generated tokens, 162 KB and ~790 us after 32K (docs/benchmarks.md)."""
    async with contextlib.aclosing(outputs):
        try:
            async for out in outputs:
                if not out.finished:
                    out.token_ids, out.text = [], ""
                yield out
        except RequestFailed as e:
            logger.warning("request failed in the engine: %s", e)
            raise OpenAIError(str(e), status=500, type="server_error", code="request_failed") from None
        except ValueError as e:
            if input_checked:
                raise log_fault(e, "a request the prefill accepted") from None
            raise OpenAIError(str(e)) from None


def load_model(src: ModelSource) -> K3ForCausalLM | K3ForConditionalGeneration:
    """The served model (with its vision tower when the config has one). A preset's random weights
    come from `src.seed`, so every replica builds the same model."""
    if src.path is not None:
        return k3.model.load(src.path)
    return k3.model.build(get_preset(src.preset), seed=src.seed).eval()


async def fetch_media(req: GenerateRequest) -> list | None:
    """The request's MediaItems (fetched from the object store), or None."""
    return await req.media[0] if req.media else None


def build_engine(config: LLMServingConfig, decodes: bool, device: str) -> LLMEngine:
    """A replica's engine on `device`: its model loaded (`load_model`), torch's threads set, the
    decode graphs compiled only where decode steps run (a prefill replica would compile them for
    nothing). Called in the replica, or in the engine's own process (`ProcessEngine`)."""
    torch.set_num_threads(config.torch_threads)
    model = load_model(config.model).to(device)
    ec = config.engine if decodes else config.engine.model_copy(update={"compile_decode": False})
    engine = LLMEngine(model, ec, config.model.tokenizer())
    engine.cumulative_outputs = False  # a server sends each step's delta (engine_stream)
    return engine


def _in_replica() -> bool:
    """Whether this runs in a Ray Serve replica (not a test or script building a server by hand)."""
    try:
        from ray import serve

        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica (or no Ray at all)
        return False
    return True


def replica_device() -> torch.device:
    """cuda when Ray gave this replica a GPU (`ray_actor_options.num_gpus`), else cpu."""
    import ray

    return torch.device("cuda") if ray.is_initialized() and ray.get_gpu_ids() else torch.device("cpu")


def _counted(method):
    """A server method counted in `EngineHost._requests` while it runs (an async generator until
    it ends or is closed): what a replica whose engine died waits for before it exits, requests
    not yet in the engine (a handoff's fetch, a pool lookup) included."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, *args, **kwargs):
            self._requests += 1
            try:
                async with contextlib.aclosing(method(self, *args, **kwargs)) as inner:
                    async for item in inner:
                        yield item
            finally:
                self._requests -= 1
        return stream

    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        self._requests += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._requests -= 1
    return call


def _direct(method):
    """A server's `generate`, its outputs after the first written on the request's token stream
    (`GenerateRequest.stream_to`, serve/token_stream.py) instead of yielded through the Serve call,
    which carries the first and then stays open until the last is written. A request whose
    ingress cannot be reached sends them through the call (nothing went on the socket); one whose
    connection breaks mid-answer fails with a 500 (what was on the broken connection may be lost)."""
    @functools.wraps(method)
    async def stream(self, req: GenerateRequest):
        to = req.stream_to
        writer = None
        async with contextlib.aclosing(method(self, req)) as inner:
            first = True
            async for out in inner:
                if first or to is None:
                    first = False
                    yield out
                    continue
                if writer is None:
                    try:
                        writer = await self.links.connect(to)
                    except Unreachable:  # logged by the links, once a while per listener
                        to = None
                        yield out
                        continue
                try:
                    await self.links.send(writer, to, out)
                except ConnectionError as e:
                    raise OpenAIError(f"the answer's stream to the ingress broke: {e}", status=500,
                                      type="server_error", code="stream_broken") from None
    return stream


# a Serve replica whose engine died checks this often, and waits at most this long for its
# requests to end (with the error) before it exits
ENGINE_WATCH_PERIOD_S = 0.5
ENGINE_DEATH_GRACE_S = 10.0


class EngineHost:
    """One engine in a replica, and the replica's engine gauges reported every second.

    In a Serve replica a thread watches the engine: once it has died (its process killed, its
    loop broken) the replica's open streams end with the error; it waits for its requests to end
    (`_counted`, at most ENGINE_DEATH_GRACE_S) and exits, so Ray marks the actor dead, the routers stop
    sending it requests and Serve starts a replacement at its next health check (a replica that
    stayed up would answer every request with an error until three health checks had failed)."""

    role = "llm"
    decodes = True  # runs decode steps (a prefill replica stops at each prompt's first token)

    def __init__(self, config: LLMServingConfig | dict) -> None:
        self.config = LLMServingConfig.model_validate(config)
        torch.set_num_threads(self.config.torch_threads)
        build = functools.partial(build_engine, self.config, self.decodes, str(replica_device()))
        # a replica that decodes steps its engine in a process of its own (engine_process); a
        # prefill replica, whose prefix pool reads and writes the cache, in its own thread
        self.engine = ProcessEngine(build) if self.decodes and self.config.engine_process else AsyncEngine(build())
        self.metrics = ServeMetrics(self.config.model_id, self.role)
        self._reporter: asyncio.Task | None = None
        self._seen = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0}
        self._closing = threading.Event()
        self._requests = 0  # server calls running (`_counted`)
        self.links = StreamLinks()  # to the ingress replicas' token streams (`_direct`)
        if _in_replica():
            threading.Thread(target=self._watch_engine, name="k3-engine-watch", daemon=True).start()

    def _watch_engine(self, exit_process: Callable[[int], None] = os._exit) -> None:
        """Until the replica shuts down: once the engine is dead, exit (see the class)."""
        while not self._closing.wait(ENGINE_WATCH_PERIOD_S):
            try:
                self.engine.check_health()
            except Exception as e:  # noqa: BLE001 - whatever killed the engine, the replica goes
                if self._closing.is_set():
                    return
                logger.error("this replica's engine died (%s): its %d requests end with the error, then the "
                             "replica exits for Serve to replace it", e, self._requests)
                deadline = time.monotonic() + ENGINE_DEATH_GRACE_S
                while (self._requests or self.engine.open_streams) and time.monotonic() < deadline:
                    if self._closing.wait(0.05):  # Serve is shutting the replica down itself
                        return
                if not self._closing.wait(0.5):  # the last events on their way to the callers
                    exit_process(1)
                return

    def __del__(self) -> None:
        """Serve's shutdown of the replica: the engine (its process) ends with it, not as a death."""
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
            close = getattr(getattr(self, "engine", None), "close", None)
            if close is not None:
                close()

    def _start_reporting(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report())

    async def _report(self) -> None:
        while True:
            # read in the engine's step thread: the cache's dicts change while a step runs
            s = await self.engine.stats()
            self.metrics.set("k3_serve_num_requests_running", s["running"])
            self.metrics.set("k3_serve_num_requests_waiting", s["waiting"])
            self.metrics.set("k3_serve_cache_usage_ratio", s["pages_in_use"] / max(1, s["pages_total"]))
            q = s["prefix_query_tokens"] - self._seen["prefix_query_tokens"]
            h = s["prefix_hit_tokens"] - self._seen["prefix_hit_tokens"]
            if q:
                self.metrics.inc("k3_serve_prefix_cache_queries", q, source="local")
            if h:
                self.metrics.inc("k3_serve_prefix_cache_hits", h, source="local")
            self._seen = {"prefix_query_tokens": s["prefix_query_tokens"], "prefix_hit_tokens": s["prefix_hit_tokens"]}
            await asyncio.sleep(1.0)

    def check_health(self) -> None:
        """Serve's health probe: the engine loop must not have died."""
        self.engine.check_health()

    async def stats(self) -> dict:
        # pid: the replica; engine_pid: the process that steps its engine (the same pid without engine_process);
        # stream_*: the token stream's outputs written, requests that fell back to the Serve call, connections
        return {**await self.engine.stats(), "pid": os.getpid(), "engine_pid": getattr(self.engine, "pid", os.getpid()),
                "role": self.role, **self.stream_stats()}

    def stream_stats(self) -> dict:
        """The token stream's counts (`StreamLinks.stats`)."""
        return self.links.stats()

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._start_reporting()
        media = await fetch_media(req)
        stamp(req.trace, "engine_in")
        first = True
        async for out in engine_stream(self.engine.generate(req.prompt_token_ids, SamplingParams(**req.sampling),
                                                            media=media)):
            if first and req.trace is not None:
                first = False
                stamp(req.trace, "engine_first")
                out.trace = req.trace
            yield out


class LLMServer(EngineHost):
    """Aggregated: one engine does prompt and decode."""

    role = "llm"

    @_direct
    @_counted
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        stamp(req.trace, "server_in")
        async for out in self._stream(req):
            yield out


class PrefixPoolServer:
    """The prefix pool as a Serve deployment (one replica: a named actor whose lifetime Serve
    manages with the application's)."""

    def __init__(self, budget_bytes: int) -> None:
        self.pool = PrefixPool(budget_bytes)
        self._unpacker = background_executor("k3-pool-unpack")

    def wanted(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        return self.pool.wanted(hashes)

    async def publish(self, pages: bytes | list) -> int:
        """Store a publish: pages packed by `pack_pages` (unpacked in a thread below normal
        priority, so the replicas decoding beside the pool do not wait on it; stored on this
        event loop, where the lookups run) or a list of pages."""
        if isinstance(pages, (bytes, bytearray)):
            unpacked = await asyncio.get_running_loop().run_in_executor(self._unpacker, unpack_pages, pages)
            return self.pool.publish(unpacked, copy=False)
        return self.pool.publish(pages)

    def fetch_deeper(self, hashes: list[bytes], have_pages: int) -> PoolRun | None:
        return self.pool.fetch_deeper(hashes, have_pages)

    def stats(self) -> dict:
        return self.pool.stats()


class PrefillServer(EngineHost):
    role = "prefill"
    decodes = False

    def __init__(self, config: LLMServingConfig | dict, pool=None) -> None:
        super().__init__(config)
        self.pool = pool if self.config.engine.enable_prefix_caching else None  # PrefixPoolServer handle
        self.pool_hit_tokens = 0
        self._publishing: set[asyncio.Task] = set()

    async def _from_pool(self, prompt: list[int], spans: list, trace: dict | None = None) -> None:
        """Load the prompt's prefix from the pool when it holds more than this replica does
        (stamping a traced request after the local lookup and after the pool's answer)."""
        # only pages that end before the prompt's last token: a request resumes strictly inside its
        # prompt (the last token's logits are computed), so a snapshot at the prompt's end is no use
        ps = self.config.engine.page_size
        hashes = page_hashes(prompt, ps, media=spans)[: (len(prompt) - 1) // ps]
        self.metrics.inc("k3_serve_prefix_cache_queries", len(prompt), source="pool")
        # what this replica holds (in process, between two steps), then one round trip to the pool
        # that brings the pages only when it holds more; none when this replica holds all it could
        local = await self.engine.cached_prefix_tokens(prompt, spans)
        stamp(trace, "pool_local")
        if local >= len(hashes) * ps:
            return
        run = await self.pool.fetch_deeper.remote(hashes, local // ps)
        stamp(trace, "pool_fetched")
        if run is None:
            return
        got = await self.engine.import_prefix(prompt, run, spans)
        if got > local:
            self.pool_hit_tokens += got - local
            self.metrics.inc("k3_serve_prefix_cache_hits", got - local, source="pool")

    async def _publish(self, prompt: list[int], spans: list) -> None:
        hashes = page_hashes(prompt, self.config.engine.page_size, media=spans)
        missing, bare = map(set, await self.pool.wanted.remote(hashes))
        if not missing and not bare:  # the pool holds this prefix whole: nothing to copy or send
            return
        # new pages, and pages the pool holds without the snapshot this replica has (every
        # `snapshot_interval` pages, a prompt's end, where prompts part: the engine copies only those)
        pages = await self.engine.export_prefix(prompt, spans, only=missing | bare, bare=bare)
        if pages:  # packed in the sealing thread: the pages' objects are walked below normal priority
            await self.pool.publish.remote(await self.engine.in_background(pack_pages, pages))

    async def reset_prefix_cache(self) -> int:
        """Forget every idle cached page of this replica (memory pressure, an operator's reset;
        tests use it to make a prompt hit only the pool). Returns the pages dropped."""
        return await self.engine.reset_prefix_cache()

    def pool_stats(self) -> dict:
        return {"pool_hit_tokens": self.pool_hit_tokens}

    @_counted
    async def prefill(self, req: GenerateRequest) -> dict:
        """Run the prompt to its first token. Returns {"output": RequestOutput without state,
        "state": [ObjectRef of the HybridCacheState] or None when the first token ended the
        request, "nbytes"}."""
        import ray

        stamp(req.trace, "prefill_in")
        self._start_reporting()
        media = await fetch_media(req)
        spans = []
        if self.pool is not None:
            try:  # the pool's pages are keyed by media-aware hashes; bad media is refused below
                spans = self.engine.media_spans(req.prompt_token_ids, media)
                await self._from_pool(req.prompt_token_ids, spans, req.trace)
            except Exception as e:  # noqa: BLE001 - a dead pool or a page that does not fit is a miss, not a failure
                logger.warning("prefix pool skipped for this request: %s: %s", type(e).__name__, e)
            stamp(req.trace, "pool_done")
        final = None
        stamp(req.trace, "engine_in")
        async for out in engine_stream(self.engine.generate(req.prompt_token_ids, SamplingParams(**req.sampling),
                                                            prefill_only=True, media=media)):
            final = out
        stamp(req.trace, "engine_first")
        final.trace = req.trace
        state, final.cache_state = final.cache_state, None
        if self.pool is not None:  # after the reply is on its way; a failed publish loses only sharing
            task = asyncio.get_running_loop().create_task(self._publish(req.prompt_token_ids, spans))
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)
        if state is None:
            stamp(req.trace, "prefill_out")
            return {"output": final, "state": None, "nbytes": 0}
        # Nested in a list: Serve resolves only top-level refs, and the decode side must fetch it
        # itself (so the bytes go object store to object store, and an owner death is visible).
        ref = ray.put(state)
        stamp(req.trace, "prefill_out")
        return {"output": final, "state": [ref], "nbytes": state.nbytes}


class DecodeServer(EngineHost):
    role = "decode"

    def __init__(self, config: LLMServingConfig | dict, prefill) -> None:
        super().__init__(config)
        self.prefill = prefill  # DeploymentHandle of the PrefillServer deployment
        self.handoffs = 0  # handoffs asked for
        self.handoff_retries = 0  # prefill attempts after a handoff's first one failed

    def handoff_stats(self) -> dict:
        return {"handoffs": self.handoffs, "handoff_retries": self.handoff_retries}

    async def _handoff(self, req: GenerateRequest) -> AsyncIterator[RequestOutput | HybridCacheState]:
        """The prompt's first output as soon as a prefill replica answers, then its cache state
        (nothing more when the first token ended the request), retrying on failures that lose the
        state (its owner died, the replica died), never waiting without a bound. A retry after the
        first token went out must choose the same token (greedy and seeded requests do); one that
        does not fails the request rather than decode from a token the client never saw."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, OwnerDiedError, RayActorError

        lost = (OwnerDiedError, ObjectLostError, ActorDiedError, RayActorError, ActorUnavailableError)
        last: Exception | None = None
        sent: RequestOutput | None = None
        t0 = time.perf_counter()
        self.handoffs += 1
        for attempt in range(self.config.handoff_attempts):
            if last is not None:
                self.handoff_retries += 1
                self.metrics.inc("k3_serve_handoff_retries", error=type(last).__name__)
                logger.warning("handoff attempt %d of %d failed, retrying (%s: %s)", attempt, self.config.handoff_attempts,
                               type(last).__name__, last)
                if not isinstance(last, asyncio.TimeoutError):  # let Serve notice and replace the replica
                    await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
            try:
                reply = await asyncio.wait_for(self.prefill.prefill.remote(req), self.config.handoff_timeout_s)
            except (*lost, asyncio.TimeoutError) as e:
                last = e
                continue
            first = reply["output"]
            if sent is None:
                stamp(first.trace, "decode_reply")
                sent = first
                # not finished unless the first token ended it: the engine's import goes on from here
                yield first if reply["state"] is None else dataclasses.replace(first, finished=False)
            elif first.new_token_ids != sent.new_token_ids:
                raise OpenAIError("the prompt's prefill was lost after its first token went out, and the retry "
                                  "chose another token; retry the request", status=503, type="server_error",
                                  code="handoff_failed")
            if reply["state"] is None:
                return
            t_fetch = time.perf_counter()
            try:
                state = await asyncio.wait_for(reply["state"][0], self.config.handoff_timeout_s)
            except (*lost, asyncio.TimeoutError) as e:
                last = e
                continue
            state.timings["fetch_s"] = time.perf_counter() - t_fetch
            self.metrics.observe("k3_serve_handoff_bytes", reply["nbytes"])
            yield state
            return
        logger.error("handoff failed after %d attempts (%.1f s); last error: %s: %s", self.config.handoff_attempts,
                     time.perf_counter() - t0, type(last).__name__, last)
        raise OpenAIError(f"no prefill replica delivered the prompt's cache state in {self.config.handoff_attempts} "
                          f"attempts; retry the request", status=503, type="server_error", code="handoff_failed")

    @_direct
    @_counted
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        stamp(req.trace, "server_in")
        self._start_reporting()
        if req.route_key is None:
            # the key needs only the first pages' chain hashes: hash those, not the whole prompt
            ps = self.config.engine.page_size
            req.route_key = prefix_route_key(page_hashes(req.prompt_token_ids[:DEFAULT_ROUTE_PAGES * ps], ps))
        stamp(req.trace, "prefill_call")
        # The first token goes out as soon as the prefill replica answers, while the state is
        # fetched, checked and loaded (time to first token waits for none of it); the engine's own
        # first output repeats it.
        first = state = None
        async with contextlib.aclosing(self._handoff(req)) as handoff:
            async for item in handoff:
                if isinstance(item, RequestOutput):
                    first = item
                    stamp(first.trace, "server_out")
                    yield first
                else:
                    state = item
        if state is None:  # the first token ended it
            return
        params = SamplingParams(**req.sampling)
        first_out = True
        async for out in engine_stream(self.engine.import_request(req.prompt_token_ids, state, params),
                                       input_checked=True):
            if first_out:  # the state has been checked and loaded: the whole handoff is known
                first_out = False
                t = state.timings
                self.metrics.observe("k3_serve_handoff_seconds",
                                     t.get("export_s", 0.0) + t["fetch_s"] + t.get("check_s", 0.0))
                if out.new_token_ids != first.new_token_ids:  # cannot happen: the state carries the token
                    raise RuntimeError(f"imported first token {out.new_token_ids} != prefill's {first.new_token_ids}")
                if not out.finished:
                    continue
                out = dataclasses.replace(out, new_token_ids=[], text_delta="", logprobs=[])  # sent already
            yield out
