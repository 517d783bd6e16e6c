"""The engine's steps in a process of its own (`ProcessEngine`, serve/engine/engine_core.py): the
same tokens as the engine in a thread, bad input refused by name with the engine going on, one
failing request failing alone, ids freed and reused without crosstalk, a child that cannot start
or dies said so."""
from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal
import socket
import sys
import threading
import time
import types

import numpy as np
import pytest

from k3.serve.engine import AsyncEngine, RequestFailed, SamplingParams
from k3.serve.engine import engine_core
from k3.serve.engine.engine_core import EngineProcessDied, ProcessEngine
from serve_apps import POISON, tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
PROMPTS = [list(range(5, 60)), list(range(100, 130)), [7, 8, 9] * 20]


@pytest.fixture(scope="module")
def core():
    eng = ProcessEngine(functools.partial(tiny_engine, "raise", max_num_seqs=4))
    yield eng
    eng.close()
    assert eng._proc.returncode == 0  # ended by its socket closing, not killed


async def _collect(agen):
    return [o async for o in agen]


def _run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_same_tokens_as_the_engine_in_a_thread(core):
    local = AsyncEngine(tiny_engine("raise", max_num_seqs=4))

    async def both(e):
        return await asyncio.gather(*(_collect(e.generate(p, GREEDY if i % 2 == 0 else SEEDED))
                                      for i, p in enumerate(PROMPTS)))

    got, want = _run(both(core)), _run(both(local))
    for g, w in zip(got, want):
        assert g[-1].finished and g[-1].token_ids == w[-1].token_ids
        assert [t for o in g for t in o.new_token_ids] == g[-1].token_ids  # the deltas add up to the whole
        glp, wlp = [lp for o in g for lp in o.logprobs], [lp for o in w for lp in o.logprobs]
        # batches form by arrival, so the float sums may differ in their last bits
        assert [lp["token"] for lp in glp] == [lp["token"] for lp in wlp]
        assert [lp["logprob"] for lp in glp] == pytest.approx([lp["logprob"] for lp in wlp], abs=1e-5)
        # a running request's outputs cross the socket as deltas only
        assert all(o.token_ids == [] and o.text == "" for o in g if not o.finished)
    assert len(got[0][-1].token_ids) == 12


@pytest.mark.parametrize("prompt,params,request_id,match", [
    ([], SamplingParams(), None, "prompt"),
    ([1, 2, 3], SamplingParams(max_tokens=10**9), None, "max_tokens|cache"),
    ([1, 2, 10**7], SamplingParams(), None, "token id|vocab"),
    ([1, 2, 3], SamplingParams(), "", "request_id"),
])
def test_bad_input_is_refused_by_name_and_the_engine_goes_on(core, prompt, params, request_id, match):
    async def go():
        with pytest.raises(ValueError, match=match):
            await _collect(core.generate(prompt, params, request_id=request_id))
        return await _collect(core.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))

    assert len(_run(go())[-1].token_ids) == 3
    core.check_health()


def test_a_failing_request_fails_alone(core):
    async def go():
        return await asyncio.gather(_collect(core.generate([1, 2, 3], GREEDY)),
                                    _collect(core.generate([5, POISON, 7], GREEDY)),
                                    _collect(core.generate([8, 9], GREEDY)), return_exceptions=True)

    ok1, bad, ok2 = _run(go())
    assert isinstance(bad, RequestFailed) and "poisoned" in str(bad)
    assert len(ok1[-1].token_ids) == 12 and len(ok2[-1].token_ids) == 12


def test_ids_held_refused_and_a_reused_id_gets_only_its_own_outputs(core):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def go():
        first = core.generate([1, 2, 3], long, request_id="x")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await core.generate([4, 5], long, request_id="x").__anext__()
        await first.aclose()  # leaves early: aborted in the child, the id free at once
        # leave and reuse the id many times in a row, each time before the child confirms
        for _ in range(5):
            again = core.generate([1, 2, 3], long, request_id="x")
            await again.__anext__()
            await again.aclose()
        last = await _collect(core.generate([4, 5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                            request_id="x"))
        stats = await core.stats()
        return last, stats

    last, stats = _run(go())
    assert last[-1].finished and len(last[-1].token_ids) == 4
    assert [t for o in last for t in o.new_token_ids] == last[-1].token_ids  # nothing of the aborted ones
    assert stats["running"] == 0 and stats["waiting"] == 0  # every abort reached the engine


@pytest.mark.parametrize("buffers,arrays", [("widened", "read-only"), ("refused", "writable")])
def test_a_prefilled_state_imported_on_uvloop_decodes_as_one_engine_would(buffers, arrays, monkeypatch):
    """The pd path: a state of a long prompt (hundreds of KB, more than a socket takes at once)
    sent to the child from a Serve-like uvloop event loop, whose transport does not block; also
    where the OS refuses the wider socket buffers (macOS's cap) and the default sizes carry it.
    Its arrays read-only as the object store's zero-copy reads give them, or writable."""
    uvloop = pytest.importorskip("uvloop")  # Ray Serve's replicas run on it (ray[serve] installs it)
    if buffers == "widened":
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 2**20)
        except OSError:
            pytest.skip("this OS refuses 8 MB socket buffers (the 'refused' case covers it)")
        finally:
            probe.close()
    if buffers == "refused":
        def refuse(sock, level, opt, value):
            raise OSError(55, "No buffer space available")
        monkeypatch.setattr(socket.socket, "setsockopt", refuse)
    key = {"handoff_key": "engine-core-test-key"}
    prompt = [(i * 37) % 4000 + 5 for i in range(1500)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    local = AsyncEngine(tiny_engine(None, **key))
    remote = ProcessEngine(functools.partial(tiny_engine, None, **key))
    monkeypatch.undo()
    default = socket.socket(socket.AF_UNIX).getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    sndbuf = remote._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert (sndbuf == default) == (buffers == "refused"), (sndbuf, default)
    try:
        async def go():
            whole = await _collect(local.generate(prompt, params))
            first = await _collect(local.generate(prompt, params, prefill_only=True))
            state = first[-1].cache_state
            assert state.nbytes > 256 * 1024
            if arrays == "read-only":
                for _, a in state.arrays():
                    a.flags.writeable = False
            got = await _collect(remote.import_request(prompt, state, params))
            assert state.timings["check_s"] > 0  # measured in the child, told to the caller's copy
            return whole, got

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            whole, got = r.run(asyncio.wait_for(go(), 120))
        assert got[-1].token_ids == whole[-1].token_ids and len(got[-1].token_ids) == 8
    finally:
        remote.close()


def test_a_request_frame_carries_its_arrays_out_of_band_and_the_child_owns_them():
    """`_request_frame` / `_read_request` over a socket: the arrays come back equal, each in a
    buffer of the reader's own (writable where they were, so they need no copy), read-only
    where the sender's were (a view of memory another holds: the importer copies those)."""
    rng = np.random.default_rng(0)
    rw = rng.standard_normal((300, 160), dtype=np.float32)
    ro = rng.standard_normal((4, 32, 32), dtype=np.float32)
    ro.flags.writeable = False
    arrays = {"rw": rw, "ro": ro, "odd": rw[:, ::2], "fortran": np.asfortranarray(rw[:7]), "empty": rw[:0]}
    msg = ("import", 7, "rid", ([1, 2, 3], arrays, None))
    a, b = socket.socketpair()
    try:
        data = engine_core._request_frame(msg)
        sender = threading.Thread(target=a.sendall, args=(data,))
        sender.start()
        with b.makefile("rb") as f:
            head, body, buffers = engine_core._read_request(f)
        sender.join()
    finally:
        a.close()
        b.close()
    assert head == ("import", 7) and len(buffers) == 4  # the strided view goes in band
    rid, (prompt, got, params) = pickle.loads(body, buffers=buffers)
    assert rid == "rid" and prompt == [1, 2, 3] and params is None
    for k, want in arrays.items():
        np.testing.assert_array_equal(got[k], want)
        assert got[k].dtype == want.dtype and got[k].shape == want.shape
    assert got["rw"].flags.writeable and not np.shares_memory(got["rw"], rw)
    assert not got["ro"].flags.writeable


def test_a_stream_cancelled_before_the_child_answers_aborts_its_request(core):
    endless = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)

    async def go():
        await core.stats()  # this loop's transport is up: the task below sends its request at once
        task = asyncio.get_running_loop().create_task(_collect(core.generate([1, 2, 3], endless, request_id="gone")))
        await asyncio.sleep(0)  # the request is on its way to the child, not yet answered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the abort follows it: the child drops the request
            s = await core.stats()
            if s["running"] == 0 and s["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        again = await _collect(core.generate([4, 5], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                             request_id="gone"))
        return s, again

    s, again = _run(go())
    assert s["running"] == 0 and s["waiting"] == 0
    assert len(again[-1].token_ids) == 3  # the id is free again


def test_a_request_the_engine_process_cannot_read_fails_alone(core):
    # a SamplingParams of a module only this process has: the child cannot unpickle the request
    mod = types.ModuleType("k3_test_parent_only")
    mod.Params = type("Params", (SamplingParams,), {"__module__": "k3_test_parent_only"})
    sys.modules["k3_test_parent_only"] = mod
    try:
        async def go():
            with pytest.raises(ModuleNotFoundError, match="k3_test_parent_only"):
                await _collect(core.generate([1, 2, 3], mod.Params(max_tokens=3)))
            return await _collect(core.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0,
                                                                          ignore_eos=True)))

        assert len(_run(go())[-1].token_ids) == 3
        core.check_health()
    finally:
        del sys.modules["k3_test_parent_only"]


def test_a_factory_that_cannot_be_pickled_fails_before_any_process_starts():
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        ProcessEngine(lambda: None)


def test_calls_by_name_only(core):
    async def go():
        assert (await core.call_engine("stats"))["steps"] > 0
        with pytest.raises(ValueError, match="no engine call 'step'"):
            await core.call_engine("step")
        with pytest.raises(TypeError):
            await core.call(lambda: 1)

    _run(go())


def test_an_engine_that_cannot_start_says_why():
    # the child's factory raises (EngineConfig refuses the value): its reason reaches the replica
    with pytest.raises(RuntimeError, match="(?s)could not start: .*max_num_seqs"):
        ProcessEngine(functools.partial(tiny_engine, "raise", max_num_seqs=0))


def test_a_killed_engine_process_ends_every_stream_and_fails_health():
    eng = ProcessEngine(functools.partial(tiny_engine, None))
    try:
        async def go():
            agen = eng.generate([1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True))
            await agen.__anext__()
            os.kill(eng.pid, signal.SIGKILL)
            while eng._proc.poll() is None:  # reaped here, before this loop has read the socket's end
                time.sleep(0.01)
            with pytest.raises(EngineProcessDied):  # a health probe first: the streams must still end
                eng.check_health()
            with pytest.raises(EngineProcessDied, match="exited"):
                async for _ in agen:
                    pass
            with pytest.raises(EngineProcessDied):  # nothing new is accepted
                await _collect(eng.generate([1, 2], SamplingParams(max_tokens=2)))

        _run(go())
        with pytest.raises(EngineProcessDied, match=str(eng.pid)):
            eng.check_health()
    finally:
        eng.close()


def test_a_replica_whose_engine_died_lets_its_streams_end_then_exits():
    """`EngineHost`'s watch (started in a Serve replica): the engine process killed under an open
    stream, the watch waits until the stream has taken its error, then exits the process (here a
    recorded call); a replica shutting down (its engine closed on purpose) does not exit."""
    import threading

    from k3.serve.servers import EngineHost

    host = EngineHost.__new__(EngineHost)
    host.engine = ProcessEngine(functools.partial(tiny_engine, None))
    host._closing, host._requests = threading.Event(), 0
    exits: list = []
    try:
        async def go():
            agen = host.engine.generate([1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True))
            await agen.__anext__()
            watch = threading.Thread(target=host._watch_engine, args=(lambda code: exits.append(
                (code, host.engine.open_streams)),))
            watch.start()
            host._requests = 1  # a request still on its way to the engine (a handoff's fetch)
            os.kill(host.engine.pid, signal.SIGKILL)
            await asyncio.sleep(1.5)  # the watch has seen the death and waits for the stream
            assert not exits and host.engine.open_streams == 1
            with pytest.raises(EngineProcessDied):
                async for _ in agen:
                    pass
            await asyncio.sleep(1.5)  # the stream has its error; the other request is not done
            assert not exits and host.engine.open_streams == 0
            host._requests = 0
            await asyncio.to_thread(watch.join, 30)
            assert not watch.is_alive()

        _run(go())
        assert exits == [(1, 0)]  # exited with 1, after the stream had ended
    finally:
        host.engine.close()

    host = EngineHost.__new__(EngineHost)
    host.engine = ProcessEngine(functools.partial(tiny_engine, None))
    host._closing, host._requests = threading.Event(), 0
    watch = threading.Thread(target=host._watch_engine, args=(exits.append,))
    watch.start()
    host.__del__()  # Serve's shutdown: closes the engine, the watch ends without an exit
    watch.join(10)
    assert not watch.is_alive() and exits == [(1, 0)] and host.engine._proc.returncode == 0


def test_counted_server_calls_are_counted_until_they_end_or_close():
    """`_counted` (what a replica whose engine died waits for): a streaming call counts until it
    ends, fails or its caller closes it (and the inner generator is closed at once, so its
    cleanup, an abort in the engine, runs then); a plain call until it returns or raises."""
    from k3.serve.servers import _counted

    closed: list = []

    class Server:
        _requests = 0

        @_counted
        async def stream(self, n, fail=False):
            try:
                for i in range(n):
                    yield i
                if fail:
                    raise RuntimeError("boom")
            finally:
                closed.append(n)

        @_counted
        async def call(self, fail=False):
            assert self._requests == 1
            if fail:
                raise ValueError("bad")
            return 7

    async def go():
        s = Server()
        assert [x async for x in s.stream(3)] == [0, 1, 2] and s._requests == 0
        agen = s.stream(100)
        assert await agen.__anext__() == 0 and s._requests == 1
        await agen.aclose()  # the caller left: the inner generator closed now, not at collection
        assert s._requests == 0 and closed == [3, 100]
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in s.stream(1, fail=True):
                pass
        assert s._requests == 0
        assert await s.call() == 7 and s._requests == 0
        with pytest.raises(ValueError, match="bad"):
            await s.call(fail=True)
        assert s._requests == 0

    _run(go())


def test_an_engine_loop_that_breaks_outside_a_step_ends_every_stream():
    """An in-thread engine's loop that fails between steps (not in one) tells its streams,
    which would otherwise wait for outputs that never come, and fails the health check."""
    eng = AsyncEngine(tiny_engine(None))
    calls = {"n": 0}
    real = eng.engine.has_unfinished

    def flaky():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("the loop broke")
        return real()

    eng.engine.has_unfinished = flaky

    async def go():
        with pytest.raises(RuntimeError, match="the loop broke"):
            async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)):
                pass
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="engine loop died"):
            eng.check_health()

    _run(go())
