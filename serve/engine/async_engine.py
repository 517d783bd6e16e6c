"""asyncio front end: `generate()` is an async iterator of outputs; steps run in a worker thread."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from .engine import LLMEngine, RequestOutput
from .params import SamplingParams


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            try:
                outs = await asyncio.to_thread(self.engine.step)
            except Exception as e:  # a failed step fails the requests in it, not the loop
                for q in self._queues.values():
                    q.put_nowait(e)
                continue
            for o in outs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises ValueError for bad input before anything runs.

        Leaving the iteration early (client disconnect, cancellation) aborts the request."""
        rid = self.engine.add_request(request_id, prompt_token_ids, params)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        self._ensure_loop()
        done = False
        try:
            while not done:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                done = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not done:
                self.engine.abort_request(rid)
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        if self._wake is not None:
            self._wake.set()

    def stats(self) -> dict:
        return self.engine.stats()
