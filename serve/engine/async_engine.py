"""asyncio front end: `generate()` and `import_request()` are async iterators of one request's
outputs; steps run in a worker thread, and everything else that reads or changes the engine
(stats, the prefix pool's export and import) runs there between steps.

Each stream owns its request id from the moment the engine accepts it until the stream ends:
a second stream with an id still held is refused (ValueError), so one stream's cleanup can never
remove or abort another's request. A stream left early aborts its request, which frees the id at
once (the engine returns nothing more of it). A request that fails ends its own stream with
`RequestFailed`; the other streams go on.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor

from .engine import LLMEngine, RequestOutput
from .handoff import HybridCacheState, PoolPage, PoolRun
from .prompt_media import MediaSpan
from .params import SamplingParams


class RequestFailed(RuntimeError):
    """The engine ended this request with an error (the message says why)."""


# How far below normal priority the pool pages are sealed and packed (Linux nice, per thread):
# that work (~12 ms for a 2K-token prompt of k3-tiny) yields the cores to the steps of this
# replica and of the others on the host.
BACKGROUND_NICE = 10


def _background() -> None:
    """A background thread's initializer: below normal priority where the OS lets a thread be so
    (Linux: the nice value is a thread's own); elsewhere it runs at the normal priority."""
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
        except OSError:
            pass


def background_executor(name: str) -> ThreadPoolExecutor:
    """One worker thread below normal priority (`BACKGROUND_NICE`), for work nobody waits on
    (sealing, packing and unpacking the prefix pool's pages) that should yield the cores to
    decode steps in this process and beside it."""
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_background)


def _mergeable(item) -> bool:
    return isinstance(item, RequestOutput) and item.error is None


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        # request id -> the engine's delivery count when a stream left early: a step that had
        # already delivered by then may hold outputs of the aborted request, which must not
        # reach a new stream that took the id
        self._left: dict[str, int] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._background: ThreadPoolExecutor | None = None  # pool pages sealed and packed here

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    await self._wake.wait()
                try:
                    outs = await asyncio.to_thread(self.engine.step)
                except Exception as e:  # noqa: BLE001 - the engine itself broke (not one request): tell every stream
                    self._fail_all(e)
                    continue
                self._dispatch(outs, self.engine.deliveries)  # this step's count (steps never overlap)
        except Exception as e:  # the loop itself broke (outside a step): no stream may wait on it
            self._fail_all(e)
            raise

    @property
    def open_streams(self) -> int:
        """Streams whose readers have not yet taken their last item (safe to read from any thread)."""
        return len(self._queues)

    def _dispatch(self, outs: list[RequestOutput], delivery: int) -> None:
        """One step's outputs to their streams, less those of streams that left before the step
        delivered (`delivery`: the engine's count of delivered steps, this one included)."""
        for o in outs:
            q = self._queues.get(o.request_id)
            if q is not None and self._left.get(o.request_id, 0) < delivery:
                q.put_nowait(o)
        self._left = {r: d for r, d in self._left.items() if d > delivery}

    def _fail_all(self, e: Exception) -> None:
        """The engine itself broke (not one request): every open stream ends with `e`."""
        for q in list(self._queues.values()):
            q.put_nowait(e)

    async def _open(self, request_id: str | None, submit: Callable, q: asyncio.Queue) -> str:
        """Submit a request (validated: ValueError before anything runs) and register its stream's
        queue; its id."""
        rid = submit(request_id)
        self._queues[rid] = q
        self._ensure_loop()
        return rid

    def _leave(self, rid: str) -> None:
        """A stream left before its request finished: abort the request (its id is free at once)."""
        self.engine.abort_request(rid)
        self._left[rid] = self.engine.deliveries
        self._wake.set()

    async def _stream(self, request_id: str | None, submit: Callable) -> AsyncIterator[RequestOutput]:
        if request_id is not None and request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        rid = await self._open(request_id, submit, q)
        done = False
        first = True
        waiting: deque = deque()  # taken from the queue, not yet yielded
        try:
            while not done:
                if not waiting:
                    waiting.append(await q.get())
                while not q.empty():
                    waiting.append(q.get_nowait())
                item = waiting.popleft()
                # Steps that ended while the reader was away go out as one output (one chunk per
                # read, not per step); the first output is never held back for a later one.
                while not first and waiting and _mergeable(item) and _mergeable(waiting[0]):
                    item = item.followed_by(waiting.popleft())
                first = False
                if isinstance(item, Exception):
                    raise item
                done = item.finished
                if item.error is not None:
                    raise RequestFailed(item.error)
                yield item
        finally:
            if self._queues.get(rid) is q:
                del self._queues[rid]
            if not done:  # left early (client disconnect, cancellation): abort, it is still ours
                self._leave(rid)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, prefill_only: bool = False,
                 media: list | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises ValueError for bad input before anything runs.
        Leaving the iteration early (client disconnect, cancellation) aborts the request.
        `media`: the prompt's MediaItems (LLMEngine.add_request)."""
        return self._stream(request_id, lambda rid: self.engine.add_request(rid, prompt_token_ids, params,
                                                                             prefill_only=prefill_only, media=media))

    def import_request(self, prompt_token_ids: list[int], state: HybridCacheState, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request whose prompt another engine prefilled (`LLMEngine.import_request`)."""
        return self._stream(request_id, lambda rid: self.engine.import_request(rid, prompt_token_ids, state, params))

    async def call(self, fn):
        """fn() run in the engine's step thread between steps (LLMEngine.call); its result."""
        fut = self.engine.call(fn)
        self._ensure_loop()
        return await asyncio.wrap_future(fut)

    def media_spans(self, prompt: list[int], media: list | None) -> list[MediaSpan]:
        """The spans of a prompt's media (LLMEngine.media_spans; reads no engine state)."""
        return self.engine.media_spans(prompt, media)[1]

    async def cached_prefix_tokens(self, prompt: list[int], media: list[MediaSpan] = ()) -> int:
        return await self.call(lambda: self.engine.cached_prefix_tokens(prompt, media))

    async def export_prefix(self, prompt: list[int], media: list[MediaSpan] = (), only: set[bytes] | None = None,
                            bare: Collection[bytes] = ()) -> list[PoolPage]:
        """The pages copied between two steps, then sealed (their MACs, most of an export's time)
        in a worker thread below normal priority (`BACKGROUND_NICE`): neither the engine's steps
        nor this event loop wait for the hashing."""
        copied = await self.call(lambda: self.engine.copy_prefix(prompt, media, only, bare))
        if not len(copied[1]):  # nothing to send: no hop to the sealing thread
            return []
        return await self.in_background(self.engine.seal_prefix, *copied)

    async def in_background(self, fn, *args):
        """fn(*args) in this engine's background thread (`background_executor`): its result."""
        if self._background is None:
            self._background = background_executor("k3-pool-seal")
        return await asyncio.get_running_loop().run_in_executor(self._background, fn, *args)

    async def import_prefix(self, prompt: list[int], pages: PoolRun | list[PoolPage], media: list[MediaSpan] = ()) -> int:
        return await self.call(lambda: self.engine.import_prefix(prompt, pages, media))

    async def reset_prefix_cache(self) -> int:
        return await self.call(self.engine.reset_prefix_cache)

    async def stats(self) -> dict:
        return await self.call(self.engine.stats)

    def check_health(self) -> None:
        """Raises when the step loop died of an error (a replica's health probe)."""
        if self._task is not None and self._task.done() and not self._task.cancelled() and self._task.exception():
            raise RuntimeError(f"engine loop died: {self._task.exception()!r}")
