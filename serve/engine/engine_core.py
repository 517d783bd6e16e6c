"""The engine's steps in a process of their own (an engine core, as vLLM's V1 runs it), and the
asyncio front end that talks to it: `ProcessEngine`, `AsyncEngine`'s streams over a socket.

Why: in one process a step gives the GIL up and takes it back at every torch op around its
compiled graph (~150 times a step), and a Serve replica's per-token Python (the stream's
chunks, Ray's streaming) runs in between, so a served decode step took 2.3-3.2 ms where the
same step takes 1.1-1.3 ms alone (docs/benchmarks.md). Here the replica's Python and the steps
run side by side on two cores, and what crosses between them is small: a request's prompt and
sampling (or its imported cache state) one way, each step's new tokens the other.

The child (`python -m k3.serve.engine.engine_core FD`) reads one pickled, zero-argument factory
from the socket, calls it to build its `LLMEngine` (the model is built there, not in the
replica), answers "ready", then runs two threads:

- a reader, which takes each message as it comes: a request is validated and queued at once
  (`LLMEngine.add_request` / `import_request` are thread-safe), its answer (its id or the
  ValueError) sent back; an abort is applied and confirmed with the engine's delivery count;
- the stepper (the main thread), which steps while the engine has work and sends each step's
  outputs with that count; it waits on an event while the engine is idle.

A running request's outputs carry only their deltas (the child's engine makes them so,
`LLMEngine.cumulative_outputs`: resent every token the answer so far would cost a pickle of
everything generated); the finished output carries it whole. The child exits when the
socket closes (the replica ended or died); the replica sees the child's death as an error on
every open stream and in `check_health`, which makes Serve replace it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable

from .async_engine import AsyncEngine
from .engine import LLMEngine, RequestOutput
from .handoff import HybridCacheState
from .params import SamplingParams

log = logging.getLogger(__name__)

# the engine methods a parent may call by name, between two steps, and have the result back
CALLS = frozenset({"stats", "cached_prefix_tokens", "reset_prefix_cache"})


def _dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


# each end's send and receive buffers (Linux caps them at net.core.wmem_max / rmem_max)
SOCKET_BUFFER_BYTES = 8 * 2**20
_HEADER = struct.Struct("!Q")  # each message on the socket: its pickle's length, then the pickle


def _widen(sock: socket.socket) -> None:
    """Ask for SOCKET_BUFFER_BYTES each way, so a prompt's cache state (MBs) goes in one write, not
    in the kernel's default pieces. An OS that refuses the size (macOS caps a Unix socket's
    buffers) keeps its default: the wire reads and writes in pieces either way, only slower."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError as e:
            log.info("the engine core's socket keeps the OS's buffer size (%s refused: %s)",
                     "SO_SNDBUF" if opt == socket.SO_SNDBUF else "SO_RCVBUF", e)


def frame(msg) -> bytes:
    """One message on a socket: its pickle's length, then the pickle (read back by `Wire`)."""
    data = _dumps(msg)
    return _HEADER.pack(len(data)) + data


def _request_frame(msg: tuple) -> bytes:
    """A request for the child: its (kind, token) head and the rest pickled apart, so a body the
    child cannot unpickle (a class it cannot import) is answered as that request's error. The
    body's arrays (an imported cache state's MBs) go out of band, after it as they are, and the
    child reads each into a buffer of its own (`_read_request`): copied once each way, where an
    in-band pickle copied them into the pickle, the frame and out again (4.2 -> 2.5 ms for a
    1.4 MB state here)."""
    buffers: list[pickle.PickleBuffer] = []
    head = _dumps(tuple(msg[:2]))
    body = pickle.dumps(tuple(msg[2:]), protocol=5, buffer_callback=buffers.append)
    parts = [_HEADER.pack(len(head)), head, _HEADER.pack(len(body)), body, _HEADER.pack(len(buffers))]
    for b in buffers:
        raw = b.raw()
        parts += [_HEADER.pack(raw.nbytes), raw]
    return b"".join(parts)


def _read_request(f) -> tuple[tuple, bytearray, list[bytearray]]:
    """One `_request_frame` from the child's end: its head, body and out-of-band buffers (the
    body is unpickled by the caller, with the buffers, so its failure is that request's)."""
    head = pickle.loads(_read_bytes(f))
    body = _read_bytes(f)
    n, = _HEADER.unpack(_read_exactly(f, _HEADER.size))
    return head, body, [_read_bytes(f) for _ in range(n)]


def _read_exactly(f, n: int) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise EOFError("the socket closed")
        got += k
    return out


def _read_frame(f) -> object:
    """One message from a blocking binary file over the socket; EOFError when it closed."""
    return pickle.loads(_read_bytes(f))


def _read_bytes(f) -> bytes:
    n, = _HEADER.unpack(_read_exactly(f, _HEADER.size))
    return _read_exactly(f, n)


class Wire(asyncio.Protocol):
    """The replica's end of the socket on its event loop: bytes in, whole messages out (the
    frames may arrive in any pieces); its buffer outlives a transport, so a socket taken over by
    another event loop goes on mid-message. The token stream's listener reads its connections
    with one too (serve/token_stream.py)."""

    def __init__(self, on_message: Callable, on_lost: Callable, source: str = "the engine process") -> None:
        self.buf = bytearray()
        self.on_message, self.on_lost = on_message, on_lost
        self.source = source  # who sends the messages, for the log
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= _HEADER.size:
            n, = _HEADER.unpack_from(self.buf)
            end = _HEADER.size + n
            if len(self.buf) < end:
                return
            try:
                msg = pickle.loads(self.buf[_HEADER.size:end])  # a copy: the buffer is cut below
                self.on_message(msg)
            except Exception:  # noqa: BLE001 - a fault here must not end the reading of the others
                log.exception("a message from %s could not be delivered", self.source)
            finally:
                del self.buf[:end]

    def connection_lost(self, exc) -> None:
        self.on_lost(exc)


def _portable(e: BaseException) -> Exception:
    """`e` if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(_dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that cannot travel is described instead
        return RuntimeError(f"{type(e).__name__}: {e}")


# -- the child ---------------------------------------------------------------------------------

class _Core:
    """The child's side: one engine, its reader thread and its step loop."""

    def __init__(self, sock: socket.socket, rfile, engine: LLMEngine) -> None:
        self.sock, self.rfile = sock, rfile
        self.engine = engine
        self.wake = threading.Event()
        self.send_lock = threading.Lock()

    def send(self, msg) -> None:
        data = frame(msg)
        with self.send_lock:
            self.sock.sendall(data)

    def read(self) -> None:
        """The reader thread: every message handled as it arrives; the process ends when the
        parent's end of the socket closes (or this reader fails: nothing could reach it then)."""
        try:
            while True:
                head, body, buffers = _read_request(self.rfile)
                try:
                    self.handle((*head, *pickle.loads(body, buffers=buffers)))
                except Exception as e:  # noqa: BLE001 - that request's error (an unreadable body, ...)
                    log.exception("engine core: request %r failed", head)
                    self.send(("reply", head[1], False, _portable(e)))
        except (EOFError, OSError):
            pass
        except BaseException:  # noqa: BLE001 - logged; the process must not outlive its reader
            log.exception("engine core: the reader failed")
        finally:
            os._exit(0)  # the replica is gone (or unreachable): nothing is waiting for this process's work

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        eng = self.engine
        if kind in ("add", "import"):
            _, token, rid, args = msg
            try:
                if kind == "add":
                    prompt, params, prefill_only, media = args
                    eng.add_request(rid, prompt, params, prefill_only=prefill_only, media=media)
                    reply = ("reply", token, True, rid)
                else:
                    prompt, state, params = args
                    eng.import_request(rid, prompt, state, params, owned=True)  # this reader's own unpickled copy
                    reply = ("reply", token, True, state.timings)  # its check's time, for the caller's copy
            except Exception as e:  # noqa: BLE001 - the request's own error, for its caller
                reply = ("reply", token, False, _portable(e))
            self.wake.set()
            self.send(reply)
        elif kind == "abort":
            rid = msg[2]
            eng.abort_request(rid)
            # outputs of rid in steps delivered up to here belong to the stream that left
            self.send(("aborted", rid, eng.deliveries))
            self.wake.set()
        elif kind == "call":
            _, token, name, args = msg
            if name not in CALLS:
                self.send(("reply", token, False, ValueError(f"no engine call {name!r}; calls: {sorted(CALLS)}")))
                return
            fut = eng.call(lambda: getattr(eng, name)(*args))
            fut.add_done_callback(lambda f: self.answer(token, f))
            self.wake.set()
        else:
            log.error("engine core: unknown message %r ignored", kind)

    def answer(self, token: int, fut) -> None:
        """A call's result (or error) to its caller; one that cannot be pickled as an error."""
        e = fut.exception()
        try:
            self.send(("reply", token, True, fut.result()) if e is None else ("reply", token, False, _portable(e)))
        except Exception as err:  # noqa: BLE001 - the caller must get an answer
            self.send(("reply", token, False, RuntimeError(f"the engine's answer could not be sent: {err!r}")))

    def run(self) -> None:
        """The step loop (the main thread)."""
        eng = self.engine
        while True:
            self.wake.clear()
            if not eng.has_unfinished():
                self.wake.wait()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - the engine itself broke: every stream is told
                log.exception("engine step failed")
                self.send(("broken", _portable(e)))
                continue
            self.send(("out", eng.deliveries, outs))


def _child_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    rfile = sock.makefile("rb")
    try:
        factory = _read_frame(rfile)
        engine = factory()
        engine.cumulative_outputs = False  # running outputs cross the socket as deltas
    except BaseException as e:  # noqa: BLE001 - the parent is told why the engine could not start
        sock.sendall(frame(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        raise SystemExit(1) from None
    core = _Core(sock, rfile, engine)
    core.send(("ready", {"pid": os.getpid()}))
    threading.Thread(target=core.read, name="k3-core-reader", daemon=True).start()
    core.run()


# -- the replica's side ------------------------------------------------------------------------

class EngineProcessDied(RuntimeError):
    """The engine's process ended (killed, out of memory, a crash): the replica must be replaced."""


class ProcessEngine(AsyncEngine):
    """`AsyncEngine`'s streams (`generate`, `import_request`, `stats`, `check_health`) over an
    engine that steps in a child process. Request ids are given here when the caller gives none
    (`req-` and a UUID); a stream left early aborts its request in the child, and no output of
    the aborted request reaches a later stream that takes the same id."""

    def __init__(self, factory: Callable[[], LLMEngine], start_timeout_s: float | None = None) -> None:
        """Start the child and build its engine with `factory` (picklable: a module-level function
        or a functools.partial of one), waiting until it is ready (model built, decode graphs
        compiled) or `start_timeout_s` passed. Raises RuntimeError with the child's reason when
        the engine cannot start."""
        super().__init__(None)
        payload = frame(factory)  # a factory that cannot be pickled fails here, before any process starts
        mine, theirs = socket.socketpair()
        for sock in (mine, theirs):
            _widen(sock)
        env = dict(os.environ)
        # the child imports k3 the way this process does
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # `-m` this module by its import name: what tools tell the engine's process by (k3.serve.bench)
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._sock = mine
        self._tokens = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}
        self._aborting: dict[str, int] = {}  # request id -> aborts not yet confirmed by the child
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wire = Wire(self._on, self._lost)
        self._connected: asyncio.Task | None = None  # the transport on `_loop`, made or being made
        self._dups: list[socket.socket] = []  # the socket's descriptor each event loop's transport holds
        self._dead: Exception | None = None
        mine.sendall(payload)
        deadline = None if start_timeout_s is None else time.monotonic() + start_timeout_s
        while not select.select([mine], [], [], 0.5)[0]:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self._proc.returncode} before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the engine process was not ready in {start_timeout_s} s")
        try:
            with mine.makefile("rb", buffering=0) as f:  # unbuffered: nothing past this message is read
                first = _read_frame(f)
        except EOFError:
            raise RuntimeError(f"the engine process exited with code {self._proc.wait()} before it was ready") from None
        if first[0] != "ready":
            self._proc.wait()
            raise RuntimeError(f"the engine could not start: {first[1]}")
        self.pid = first[1]["pid"]

    # -- the socket ----------------------------------------------------------------------------
    def _gone(self) -> EngineProcessDied:
        """A fresh exception saying why this engine cannot be used (raised anew each time)."""
        return EngineProcessDied(str(self._dead))

    async def _ensure_reader(self) -> None:
        """The socket on the running event loop. One loop at a time: another may take the engine
        over once the first has stopped (a test's successive asyncio.run calls); a replica has
        its one loop."""
        if self._dead is not None:
            raise self._gone()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            old = self._wire.transport
            if self._loop is not None and self._loop.is_running():
                raise RuntimeError("a ProcessEngine serves one running event loop at a time")
            if old is not None and old.get_write_buffer_size():  # the child would read half a message
                self._died(RuntimeError("an event loop ended with a message to the engine half sent"))
                raise self._gone()
            for d in self._dups:  # the stopped loop's transport holds one; its loop cannot close it
                d.close()
            self._loop, self._wire.transport = loop, None
            # a descriptor of its own: a transport closes what it holds, never the socket itself
            sock = socket.socket(fileno=os.dup(self._sock.fileno()))
            self._dups = [sock]
            self._connected = loop.create_task(loop.create_unix_connection(lambda: self._wire, sock=sock))
        await asyncio.shield(self._connected)  # callers that came meanwhile wait for the same transport

    def _lost(self, exc) -> None:
        self._died(exc)

    def _died(self, exc: BaseException | None = None) -> None:
        """On the event loop: the child is gone (or unusable). Every open stream and every
        pending answer ends with EngineProcessDied, once the reason is known."""
        if self._dead is None:
            try:
                code = self._proc.wait(0.5)
            except subprocess.TimeoutExpired:  # its socket closed and it lives on: it is of no use
                self._proc.kill()
                code = self._proc.wait()
            why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
            self._dead = EngineProcessDied(f"the engine process (pid {self._proc.pid}) exited with code {code}{why}")
            log.error("%s", self._dead)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(self._gone())
        self._replies.clear()
        self._fail_all(self._gone())

    def _fail_open_soon(self) -> None:
        """From any thread, once `_dead` is set: fail what is open, on its event loop."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._died)

    def _on(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            self._dispatch(msg[2], msg[1])
        elif kind == "reply":
            _, token, ok, value = msg
            fut = self._replies.pop(token, None)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
        elif kind == "aborted":
            _, rid, delivery = msg
            n = self._aborting.get(rid, 0) - 1
            if n > 0:
                self._aborting[rid] = n
            else:  # every abort of rid confirmed: drop only what steps delivered before the last
                self._aborting.pop(rid, None)
                self._left[rid] = delivery
        elif kind == "broken":
            self._fail_all(msg[1])

    def _send(self, msg: tuple) -> None:
        """Queue a request (kind, token, ...) on the transport (it never blocks: what the socket
        does not take at once goes out as the child reads)."""
        if self._dead is not None:
            raise self._gone()
        self._wire.transport.write(_request_frame(msg))

    async def _ask(self, kind: str, *rest, sent: list | None = None):
        """Send a request and wait for the child's answer; `sent` gets True once it is on its way."""
        await self._ensure_reader()
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._replies[token] = fut
        try:
            self._send((kind, token, *rest))
        except BaseException:
            self._replies.pop(token, None)
            raise
        if sent is not None:
            sent.append(True)
        return await fut

    # -- AsyncEngine's hooks -------------------------------------------------------------------
    async def _open(self, request_id: str | None, submit: Callable, q: asyncio.Queue) -> str:
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        rid = request_id or f"req-{uuid.uuid4().hex}"
        self._queues[rid] = q  # before the child can step it: its outputs may come ahead of the reply
        sent: list = []
        try:
            await submit(rid, sent)
        except BaseException as e:
            if self._queues.get(rid) is q:
                del self._queues[rid]
            if isinstance(e, asyncio.CancelledError) and sent:  # left before the child answered: it may have taken it
                self._leave(rid)
            raise
        return rid

    def _leave(self, rid: str) -> None:
        if self._dead is not None or self._wire.transport is None:  # nothing to abort, or no way to
            return
        self._aborting[rid] = self._aborting.get(rid, 0) + 1
        self._left[rid] = math.inf  # until the child says which steps came before the abort
        self._send(("abort", None, rid))

    # -- the front end -------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, prefill_only: bool = False,
                 media: list | None = None) -> AsyncIterator[RequestOutput]:
        return self._stream(request_id, lambda rid, sent: self._ask("add", rid, (prompt_token_ids, params,
                                                                                  prefill_only, media), sent=sent))

    def import_request(self, prompt_token_ids: list[int], state: HybridCacheState, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async def submit(rid: str, sent: list) -> None:
            state.timings.update(await self._ask("import", rid, (prompt_token_ids, state, params), sent=sent))

        return self._stream(request_id, submit)

    async def call_engine(self, name: str, *args):
        """The engine's method `name` (one of `CALLS`) called in the child between two steps."""
        return await self._ask("call", name, args)

    async def stats(self) -> dict:
        return await self.call_engine("stats")

    async def cached_prefix_tokens(self, prompt: list[int], media=()) -> int:
        return await self.call_engine("cached_prefix_tokens", prompt, list(media))

    async def reset_prefix_cache(self) -> int:
        return await self.call_engine("reset_prefix_cache")

    async def call(self, fn):
        raise TypeError("a ProcessEngine runs no local functions in its engine; use call_engine(name, *args)")

    def media_spans(self, prompt, media):
        raise TypeError("a ProcessEngine's replica holds no model; media spans are found in the engine's process")

    async def export_prefix(self, *a, **k):
        raise TypeError("the prefix pool's export runs on an in-process engine (a prefill replica's AsyncEngine)")

    async def import_prefix(self, *a, **k):
        raise TypeError("the prefix pool's import runs on an in-process engine (a prefill replica's AsyncEngine)")

    def check_health(self) -> None:
        if self._dead is None and self._proc.poll() is not None:
            self._dead = EngineProcessDied(f"the engine process (pid {self._proc.pid}) exited with code "
                                           f"{self._proc.returncode}")
            self._fail_open_soon()  # the socket's EOF may not have been read yet
        if self._dead is not None:
            raise self._gone()

    def close(self, timeout: float = 10.0) -> None:
        """End the child (its socket closed: it exits by itself; killed if it has not in
        `timeout` seconds)."""
        if self._dead is None:
            self._dead = EngineProcessDied("the engine process was closed")
            self._fail_open_soon()
        try:  # the connection itself, whichever descriptors of it are open: the child reads EOF
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        t, loop = self._wire.transport, self._loop
        if t is not None and loop is not None and loop.is_running() and not loop.is_closed():
            loop.call_soon_threadsafe(t.abort)  # that loop's transport ends there
        else:
            for d in self._dups:
                d.close()
        self._sock.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            self.close(timeout=2.0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    _child_main(int(sys.argv[1]))
