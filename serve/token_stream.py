"""A request's outputs after its first, from the server replica that runs it straight to the
ingress replica that answers it: one TCP connection per (server replica, ingress replica) pair,
each output one length-prefixed frame, in place of one Ray streaming item per output (as vLLM's
API server reads its engine core over a socket, here between two Ray actors).

Why: a Serve streaming call costs both of its ends CPU for every item (the replica's report of
it, the caller's core worker and event loop), more than a decode step of a small model on a
2-core host ("Where a served token's CPU goes", docs/benchmarks.md); a frame is a pickle and a
write on one end, a read and an unpickle on the other.

The request's control stays with Ray. The ingress's Serve call (`server.generate`) carries the
first output (a refusal is still an error before any byte goes to the client; the prefill
handoff and its retries do not change), stays open while the request runs (cancelling it aborts
the request in its engine; a replica's error or death ends it with that error) and ends once the
replica has written the last output. Only what the call would have carried after its first
output goes on the socket; a replica that cannot connect sends it through the call as before.

Trust: the listener binds its node's address, and a connection must open with the listener's
secret (random bytes the replicas learn only inside requests, through Ray) before any frame of it
is read, so the socket unpickles only frames from processes that learned the secret through Ray.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from k3.serve.engine.engine_core import Wire, frame

log = logging.getLogger(__name__)

# each frame on a connection, after its secret: `frame((key, output))`, the engine core's framing
SECRET_BYTES = 32
KEY_BYTES = 16
CONNECT_TIMEOUT_S = 5.0
# a listener that could not be reached is not tried again for this long (its requests go through
# the Serve call at once, not after a connect timeout each)
UNREACHABLE_RETRY_S = 60.0


@dataclass(frozen=True)
class StreamTo:
    """Where one request's later outputs go: an ingress replica's listener and the request's key."""

    host: str
    port: int
    secret: bytes = field(repr=False)  # never in a log line that prints a request
    key: bytes = field(repr=False)

    @property
    def listener(self) -> tuple[str, int, bytes]:
        return self.host, self.port, self.secret


class Unreachable(ConnectionError):
    """The listener could not be reached: nothing of the request was sent on the socket."""


class _Route:
    """A request's entry at the listener: where its outputs are delivered (an output, or the
    exception that ends the stream), whether its last output came, and the connection its outputs
    came on."""

    __slots__ = ("deliver", "finished", "inbound")

    def __init__(self, deliver: Callable[[object], None]) -> None:
        self.deliver = deliver
        self.finished = asyncio.Event()
        self.inbound: _Inbound | None = None


class _Inbound(asyncio.Protocol):
    """One server replica's connection at the listener: the secret first, then its frames, read by
    a `Wire` (the engine core's framing) and delivered to their requests' routes."""

    def __init__(self, listener: StreamListener) -> None:
        self.listener = listener
        self.secret = bytearray()  # the first SECRET_BYTES bytes, until they match
        self.wire: Wire | None = None  # once they did
        self.keys: set[bytes] = set()  # the open requests this connection carries (closed ones leave it)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.wire is None:
            need = SECRET_BYTES - len(self.secret)
            self.secret += data[:need]
            if len(self.secret) < SECRET_BYTES:
                return
            if not hmac.compare_digest(bytes(self.secret), self.listener.secret):
                log.warning("token stream: a connection from %s without this listener's secret closed",
                            self.transport.get_extra_info("peername"))
                self.transport.close()
                return
            self.wire = Wire(self.deliver, lambda exc: None, source="a server replica's token stream")
            data = data[need:]
        self.wire.data_received(data)

    def deliver(self, msg) -> None:
        key, out = msg
        route = self.listener.routes.get(key)
        if route is None:  # the request left (its client went away): its late outputs are dropped
            return
        if route.inbound is None:
            route.inbound = self
            self.keys.add(key)
        route.deliver(out)
        if out.finished:
            route.finished.set()

    def connection_lost(self, exc) -> None:
        why = ConnectionError(f"the server replica's connection to this ingress closed mid-answer"
                              f"{f' ({exc})' if exc else ''}")
        for key in self.keys:
            route = self.listener.routes.get(key)
            if route is not None and not route.finished.is_set():
                route.deliver(why)


class StreamListener:
    """The ingress replica's end: a TCP server on its node's address (started on first use, on the
    event loop that serves the requests) and the open requests' routes by key."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.secret = os.urandom(SECRET_BYTES)
        self.port: int | None = None
        self.routes: dict[bytes, _Route] = {}
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future | None = None

    async def start(self) -> None:
        if self._server is not None:
            return
        if self._starting is None:
            loop = asyncio.get_running_loop()
            self._starting = asyncio.ensure_future(loop.create_server(lambda: _Inbound(self), self.host, 0))
        try:
            server = await asyncio.shield(self._starting)
        except BaseException:
            self._starting = None if self._starting.done() else self._starting  # a failed start is tried again
            raise
        self._server = server
        self.port = server.sockets[0].getsockname()[1]

    def open(self, deliver: Callable[[object], None]) -> tuple[StreamTo, _Route]:
        """A new request's address (a fresh key) and its route; `close` it when the request ends."""
        if self.port is None:
            raise RuntimeError("the token stream listener is not started (await start())")
        key = os.urandom(KEY_BYTES)
        route = self.routes[key] = _Route(deliver)
        return StreamTo(self.host, self.port, self.secret, key), route

    def close(self, to: StreamTo) -> None:
        route = self.routes.pop(to.key, None)
        if route is not None and route.inbound is not None:
            route.inbound.keys.discard(to.key)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def _broken(link: asyncio.Future) -> bool:
    """Whether a connection (being) made is of no more use: its making failed, or it closed."""
    return link.done() and (link.cancelled() or link.exception() is not None or link.result().is_closing())


class StreamLinks:
    """A server replica's connections to the listeners, one per listener, opened on first use and
    opened again when one broke."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int, bytes], asyncio.Future] = {}
        self._unreachable: dict[tuple[str, int, bytes], tuple[float, Unreachable]] = {}  # until, why
        self.sent = 0  # outputs written
        self.fallbacks = 0  # requests whose listener could not be reached (their outputs went through the call)

    async def connect(self, to: StreamTo) -> asyncio.StreamWriter:
        """The connection to `to`'s listener (made, or the open one). Raises Unreachable when none
        could be made. Every output of one request goes on the connection its first went on (`send`
        to that writer): outputs lost with a broken connection must not be followed by later ones
        on a new one."""
        down = self._unreachable.get(to.listener)
        if down is not None:
            if time.monotonic() < down[0]:
                self.fallbacks += 1
                raise Unreachable(*down[1].args)
            del self._unreachable[to.listener]
        fut = self._links.get(to.listener)
        if fut is None or _broken(fut):
            for key, old in list(self._links.items()):  # this one and any other that broke (an ingress replaced)
                if _broken(old):
                    del self._links[key]
            fut = self._links[to.listener] = asyncio.ensure_future(self._connect(to))
        try:
            return await asyncio.shield(fut)
        except Unreachable as e:
            self.fallbacks += 1
            if self._links.get(to.listener) is fut:
                del self._links[to.listener]
                self._unreachable[to.listener] = (time.monotonic() + UNREACHABLE_RETRY_S, e)
                log.warning("%s: outputs for it go back through the Serve calls for %.0f s", e, UNREACHABLE_RETRY_S)
            raise

    @staticmethod
    async def _connect(to: StreamTo) -> asyncio.StreamWriter:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(to.host, to.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise Unreachable(f"the ingress's token stream at {to.host}:{to.port} cannot be reached: "
                              f"{type(e).__name__}: {e}") from None
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(to.secret)
        return writer

    async def send(self, writer: asyncio.StreamWriter, to: StreamTo, out) -> None:
        """One output of the request `to` names on `writer`, flushed as far as the socket takes it.
        Raises ConnectionError when the connection broke."""
        if writer.is_closing():
            raise ConnectionError(f"the token stream to {to.host}:{to.port} closed")
        writer.write(frame((to.key, out)))
        self.sent += 1
        await writer.drain()

    def stats(self) -> dict:
        return {"stream_outputs": self.sent, "stream_fallbacks": self.fallbacks, "stream_links": len(self._links)}

    def close(self) -> None:
        for fut in self._links.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().close()
            else:
                fut.cancel()
        self._links.clear()
