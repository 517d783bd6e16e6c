"""The token stream (serve/token_stream.py): a request's outputs after its first, from its server
replica straight to its ingress. Outputs arrive in order at their own request; a connection
without the listener's secret is closed before anything of it is read; a connection that breaks
mid-answer ends that answer with an error; a server that cannot reach the ingress sends through
the Serve call, and one whose connection broke fails the request rather than skip outputs; an
ingress whose server's call ended without the last output on the stream fails the request (no
hang), and an error after the last output reaches no one."""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import types

import pytest

from k3.serve import ingress as ingress_mod
from k3.serve.engine import RequestOutput
from k3.serve.errors import OpenAIError
from k3.serve.servers import GenerateRequest, _direct
from k3.serve.token_stream import SECRET_BYTES, StreamLinks, StreamListener, StreamTo, Unreachable


def _out(k: int, finished: bool = False, rid: str = "r") -> RequestOutput:
    return RequestOutput(rid, [k], [], text_delta=f"<{k}>", finished=finished,
                         finish_reason="length" if finished else None)


def _run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _listener() -> StreamListener:
    lis = StreamListener("127.0.0.1")
    await lis.start()
    await lis.start()  # started once
    return lis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_outputs_arrive_in_order_at_their_own_request():
    async def main():
        lis, links = await _listener(), StreamLinks()
        got = {"a": [], "b": []}
        to_a, route_a = lis.open(got["a"].append)
        to_b, route_b = lis.open(got["b"].append)
        to_gone, _ = lis.open(lambda item: pytest.fail(f"a closed request got {item!r}"))
        lis.close(to_gone)
        w = await links.connect(to_a)
        assert await links.connect(to_b) is w  # one connection per listener
        for k in range(6):
            await links.send(w, to_a, _out(k, finished=k == 5, rid="a"))
            await links.send(w, to_gone, _out(k, rid="gone"))  # the request left: dropped
            await links.send(w, to_b, _out(100 + k, finished=k == 5, rid="b"))
        await asyncio.wait_for(asyncio.gather(route_a.finished.wait(), route_b.finished.wait()), 10)
        inbound = route_a.inbound
        carried = set(inbound.keys)
        lis.close(to_a)
        lis.close(to_b)
        assert carried == {to_a.key, to_b.key} and not inbound.keys  # a long-lived connection keeps no closed request
        links.close()
        lis.shutdown()
        return got

    got = _run(main())
    assert [o.new_token_ids[0] for o in got["a"]] == list(range(6))
    assert [o.new_token_ids[0] for o in got["b"]] == list(range(100, 106))
    assert got["a"][-1].finished and not any(o.finished for o in got["a"][:-1])


def test_a_connection_without_the_secret_is_closed_unread():
    async def main():
        lis = await _listener()
        got = []
        to, route = lis.open(got.append)
        frame = pickle.dumps((to.key, _out(0, finished=True)))
        for secret in (b"\0" * SECRET_BYTES, to.secret[:-1] + bytes([to.secret[-1] ^ 1])):
            reader, writer = await asyncio.open_connection("127.0.0.1", lis.port)
            writer.write(secret + struct.pack("!Q", len(frame)) + frame)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the listener
            writer.close()
        lis.shutdown()
        return got, route

    got, route = _run(main())
    assert got == [] and not route.finished.is_set()


def test_a_connection_lost_mid_answer_ends_that_answer():
    async def main():
        lis, links = await _listener(), StreamLinks()
        got = []
        to, route = lis.open(got.append)
        w = await links.connect(to)
        await links.send(w, to, _out(0))
        while not got:
            await asyncio.sleep(0.01)
        w.close()  # the server replica went away
        while len(got) < 2:
            await asyncio.sleep(0.01)
        lis.shutdown()
        return got, route

    got, route = _run(main())
    assert got[0].new_token_ids == [0]
    assert isinstance(got[1], ConnectionError) and "closed mid-answer" in str(got[1])
    assert not route.finished.is_set()


def test_an_unreachable_listener_is_named():
    to = StreamTo("127.0.0.1", _free_port(), b"s" * SECRET_BYTES, b"k" * 16)
    with pytest.raises(Unreachable, match=f"127.0.0.1:{to.port} cannot be reached"):
        _run(StreamLinks().connect(to))
    with pytest.raises(RuntimeError, match="not started"):
        StreamListener("127.0.0.1").open(print)


class _Server:
    """A server's generate under `_direct`: `outputs` one by one; `broken` closes its connection
    to the ingress after that many outputs (the ingress went away)."""

    def __init__(self, n: int, broken: int | None = None) -> None:
        self.links, self.n, self.broken = StreamLinks(), n, broken

    @_direct
    async def generate(self, req):
        for k in range(self.n):
            if k == self.broken:
                for fut in self.links._links.values():
                    (await fut).transport.abort()
            yield _out(k, finished=k == self.n - 1)


def _req(to=None) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2, 3], sampling={}, stream_to=to)


async def _drain(agen) -> list:
    return [o async for o in agen]


def test_direct_sends_all_but_the_first_on_the_stream():
    async def main():
        lis = await _listener()
        got = []
        to, route = lis.open(got.append)
        through_call = await _drain(_Server(5).generate(_req(to)))
        await asyncio.wait_for(route.finished.wait(), 10)
        without = await _drain(_Server(5).generate(_req()))
        lis.shutdown()
        return through_call, got, without

    through_call, got, without = _run(main())
    assert [o.new_token_ids[0] for o in through_call] == [0]
    assert [o.new_token_ids[0] for o in got] == [1, 2, 3, 4] and got[-1].finished
    assert [o.new_token_ids[0] for o in without] == list(range(5))  # no stream named: all through the call


def test_direct_falls_back_to_the_call_when_the_ingress_is_unreachable(caplog, monkeypatch):
    to = StreamTo("127.0.0.1", _free_port(), b"s" * SECRET_BYTES, b"k" * 16)
    server = _Server(4)
    tries = []
    connect = StreamLinks._connect
    monkeypatch.setattr(StreamLinks, "_connect", staticmethod(lambda to: tries.append(to) or connect(to)))

    async def twice():
        return [await _drain(server.generate(_req(to))) for _ in range(2)]

    for outs in _run(twice()):
        assert [o.new_token_ids[0] for o in outs] == list(range(4)) and outs[-1].finished
    assert len(tries) == 1  # the second request did not try (nor wait on) the listener again
    assert caplog.text.count("go back through the Serve calls") == 1


def test_direct_fails_a_request_whose_connection_broke():
    async def main():
        lis = await _listener()
        to, _ = lis.open(lambda item: None)
        try:
            await _drain(_Server(6, broken=3).generate(_req(to)))
        finally:
            lis.shutdown()

    with pytest.raises(OpenAIError) as e:
        _run(main())
    assert e.value.status == 500 and e.value.code == "stream_broken"


class _Call:
    """A Serve streaming call as the ingress sees it: `items` (outputs or an exception), then its end."""

    def __init__(self, items, then=None) -> None:
        self.items, self.then, self.cancelled = list(items), then, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item
        if self.then is not None:
            await self.then()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def _ingress(calls):
    """An object with what `Ingress._choices` uses: a listener and a server whose calls are `calls`
    (one per request), each given its request as it is made."""
    it = iter(calls)
    made = []

    def remote(req):
        call = next(it)(req)
        made.append(call)
        return call

    server = types.SimpleNamespace(generate=types.SimpleNamespace(remote=remote))
    fake = types.SimpleNamespace(direct=StreamListener("127.0.0.1"), server=server)
    fake._open_streams = lambda *a: ingress_mod.Ingress._open_streams(fake, *a)
    return fake, made


def _choices(fake, reqs):
    return ingress_mod.Ingress._choices(fake, reqs)


def test_ingress_fails_an_answer_whose_last_output_never_comes(monkeypatch):
    monkeypatch.setattr(ingress_mod, "STREAM_TAIL_S", 0.2)

    async def main():
        fake, _ = _ingress([lambda req: _Call([_out(0)])])  # the call ends; nothing on the stream
        got = []
        with pytest.raises(OpenAIError) as e:
            async for item in _choices(fake, [_req()]):
                got.append(item)
        return got, e.value, fake

    got, err, fake = _run(main())
    assert [o.new_token_ids for _, o in got] == [[0]]
    assert err.status == 500 and not fake.direct.routes  # the route closed with the request


def test_ingress_merges_the_stream_behind_each_first_and_ignores_late_errors():
    async def main():
        links = StreamLinks()

        def call(outputs, error_after=False):
            def make(req):
                async def then():  # the replica writes the rest on the stream, then its call ends
                    w = await links.connect(req.stream_to)
                    for o in outputs:
                        await links.send(w, req.stream_to, o)
                    await asyncio.sleep(0.05)
                    if error_after:  # e.g. a cancellation that raced the end: no one's error
                        raise RuntimeError("after the last output")
                return _Call([_out(0, rid=outputs[0].request_id)], then)
            return make

        a = [_out(k, finished=k == 4, rid="a") for k in range(1, 5)]
        b = [_out(k, finished=k == 2, rid="b") for k in range(1, 3)]
        fake, made = _ingress([call(a), call(b, error_after=True)])
        got = [item async for item in _choices(fake, [_req(), _req()])]
        return got, made, fake

    got, made, fake = _run(main())
    per = {0: [], 1: []}
    for i, o in got:
        per[i].extend(o.new_token_ids)
    assert per == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2]}
    firsts = [next(o for i, o in got if i == c) for c in (0, 1)]
    assert all(f.new_token_ids == [0] for f in firsts)  # a first output is never merged with later ones
    assert all(c.cancelled for c in made) and not fake.direct.routes


def test_an_ingress_that_cannot_listen_answers_through_the_calls(monkeypatch, caplog):
    async def refuse(self):
        await asyncio.sleep(0.01)  # both requests wait on the start before either sees it fail
        raise OSError("Cannot assign requested address")

    monkeypatch.setattr(StreamListener, "start", refuse)

    def answer(req):
        return _Call([_out(0), _out(1), _out(2, finished=True)])

    async def main():
        fake, _ = _ingress([answer, answer])
        reqs = [[_req()], [_req()]]

        async def one(r):
            return [item async for item in _choices(fake, r)]

        got = await asyncio.gather(*(one(r) for r in reqs))  # two at once: both see the failed start
        return got, reqs, fake

    got, reqs, fake = _run(main())
    for g in got:
        assert [t for _, o in g for t in o.new_token_ids] == [0, 1, 2]
    assert all(r[0].stream_to is None for r in reqs) and fake.direct is None  # no stream named; not tried again
    assert caplog.text.count("every output goes through the Serve calls") == 1


def test_links_drop_connections_that_broke():
    async def main():
        lis, other, links = await _listener(), await _listener(), StreamLinks()
        to, _ = lis.open(lambda item: None)
        to2, _ = other.open(lambda item: None)
        w = await links.connect(to)
        w.close()  # that ingress replica went away
        await asyncio.sleep(0.05)
        await links.connect(to2)
        kept = set(links._links)
        w2 = await links.connect(to)  # a new connection, not the closed one
        lis.shutdown()
        other.shutdown()
        return kept, to2, w, w2, links.stats()

    kept, to2, w, w2, stats = _run(main())
    assert kept == {to2.listener}  # the broken one was dropped when the next connection was made
    assert w2 is not w and not w2.is_closing() and stats["stream_links"] == 2
