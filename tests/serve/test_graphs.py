"""The compiled decode forward (serve/engine/graphs.py) against the eager one, on a 2-layer model
(one KDA and one MLA layer, MoE, Block AttnRes) so the compiles stay short: the same greedy
tokens and logprobs within float rounding, across batch sizes and a page-table bucket change,
with every graph compiled when the engine starts (none inside a step), or in a background thread
while requests run eagerly and then go on through the graphs; on by default on CPU only; the
eager switch; a model that cannot be traced falls back to eager steps."""
from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

from k3.model import K3ForCausalLM, get_preset
from k3.model.cache import CacheBatch, KDAPool
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams, graphs
from k3.serve.engine.graphs import MIN_TABLE_PAGES, Bound, DecodeGraph, OneRowMatmuls, bind, compiled_forward, replays


def two_layer_model():
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny", num_layers=2, layer_types=["kda", "mla"], mlp_types=["moe", "moe"],
                     attn_res_block_size=1)
    m = K3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.attn_res.queries.normal_(0, 0.05)
    return m


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]


def run(model, ps, compile_decode: bool, max_tokens: int, **config):
    eng = LLMEngine(model, EngineConfig(compile_decode=compile_decode, page_size=8, **config))
    # the compile at start gave back every slot and page it took, and cached nothing
    assert eng.cache.usage() == LLMEngine(model, EngineConfig(page_size=8, **config)).cache.usage()
    graphs = counters["stats"]["unique_graphs"]
    outs = eng.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True))
    # every graph was compiled when the engine started: batch sizes, the batch shrinking as
    # sequences finish, and the page table's growth past its first bucket compile nothing more
    assert counters["stats"]["unique_graphs"] == graphs
    return eng, outs


@pytest.fixture(scope="module")
def model():
    return two_layer_model()


# torch.compile of the decode graphs: ~70 s on 2 cores, the full tier
@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[5], [3, 17, 9]])
def test_compiled_decode_gives_the_eager_tokens(model, lengths):
    # 60 tokens from prompts of up to 17 cross the first page-table bucket (8 pages of 8 tokens)
    ps = prompts(lengths, seed=len(lengths))
    eager_eng, eager = run(model, ps, False, 60)
    eng, compiled = run(model, ps, True, 60)
    assert eager_eng.decode_graph is None
    g = eng.decode_graph
    assert g.error is None and g.calls >= 59
    # no step went through dynamo: a width the start did not compile ran the graph whose guards
    # accept it (the table's width is dynamic on CPU); the first step of each batch shape learnt
    # its graph's arguments, the later ones called it with them
    assert g.replayed == g.calls
    assert g._bound and all(isinstance(b, Bound) for b in g._bound.values())
    assert eng.stats()["decode_graph_compile_s"] > 0
    for a, b in zip(compiled, eager):
        assert a.token_ids == b.token_ids
        worst = max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs))
        assert worst < 1e-4, f"logprob differs by {worst}"


@pytest.mark.slow
def test_a_shrinking_batch_binds_each_shape_and_keeps_the_eager_tokens(model):
    # requests ending at different steps: the batch goes 4 -> 3 -> 2 -> 1 across a page-table
    # bucket, each (sequences, width) bound on its first served step; a second batch on the same
    # engine runs its shapes through the bounds learnt by the first
    lengths, ends = [12, 5, 9, 7], [70, 20, 40, 55]
    for round_ in range(2):
        ps = prompts(lengths, seed=10 + round_)
        sps = [SamplingParams(max_tokens=n, temperature=0, logprobs=0, ignore_eos=True) for n in ends]
        want = LLMEngine(model, EngineConfig(page_size=8)).generate(ps, sps)
        if round_ == 0:
            eng = LLMEngine(model, EngineConfig(compile_decode=True, page_size=8))
        bound_before = dict(eng.decode_graph._bound)
        got = eng.generate(ps, sps)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    g = eng.decode_graph
    assert {n for n, _ in g._bound} == {1, 2, 3, 4} and all(isinstance(b, Bound) for b in g._bound.values())
    assert bound_before == g._bound  # the second round learnt nothing new: every shape was bound
    assert g.replayed == g.calls  # no step through dynamo: a new width runs the graph that accepts it


@pytest.mark.slow
def test_one_sequence_at_a_time_compiles_the_batch_of_one_only(model):
    ps = prompts([4, 11], seed=5)
    (_, eager), (eng, compiled) = (run(model, ps, c, 12, max_num_seqs=1) for c in (False, True))
    assert eng.stats()["decode_graph_compile_s"] > 0 and eng.decode_graph.calls >= 2 * 11
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]


def test_decode_graphs_are_on_by_default_on_cpu_only(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("K3_COMPILE_DECODE", raising=False)
    assert EngineConfig().decode_graphs_on(cpu) and not EngineConfig().decode_graphs_on(gpu)
    assert not EngineConfig(compile_decode=False).decode_graphs_on(cpu)
    assert EngineConfig(compile_decode=True).decode_graphs_on(gpu)
    monkeypatch.setenv("K3_COMPILE_DECODE", "0")  # the default only: a config's own value wins
    assert not EngineConfig().decode_graphs_on(cpu) and EngineConfig(compile_decode=True).decode_graphs_on(cpu)
    monkeypatch.setenv("K3_COMPILE_DECODE", "1")
    assert EngineConfig().decode_graphs_on(gpu)
    monkeypatch.setenv("K3_COMPILE_DECODE", " ")  # empty: unset
    assert EngineConfig().decode_graphs_on(cpu) and not EngineConfig().decode_graphs_on(gpu)
    monkeypatch.setenv("K3_COMPILE_DECODE", "yes")
    with pytest.raises(ValueError, match="K3_COMPILE_DECODE must be 0 or 1.*'yes'"):
        LLMEngine(two_layer_model())
    assert EngineConfig(compile_decode=False).decode_graphs_on(cpu) is False  # not read when not needed


def pools(eng) -> list[torch.Tensor]:
    c = eng.cache
    return [t.clone() for p in c._kda.values() for t in (p.recurrent, p.conv)] + [t.clone() for t in c._mla.values()]


@pytest.mark.slow
def test_graphs_compiled_in_the_background_take_over_from_eager_steps(monkeypatch):
    # compile_decode_wait=False: the engine is usable at once, its steps run eagerly while a thread
    # compiles the graphs over scratch pools (the engine's own are not written), and the running
    # requests' decode steps go on through the graphs once they are ready, compiling nothing more:
    # the eager engine's tokens
    gate, real = threading.Event(), DecodeGraph.compile
    monkeypatch.setattr(DecodeGraph, "compile", lambda self, ids, cb: gate.wait() and real(self, ids, cb))
    m = two_layer_model()  # a model of its own: its graphs are traced anew
    ps = prompts([5, 12, 3], seed=7)
    sp = SamplingParams(max_tokens=20, temperature=0, logprobs=0, ignore_eos=True)
    want = LLMEngine(m, EngineConfig(page_size=8, compile_decode=False)).generate(ps, sp)
    eng = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True, compile_decode_wait=False))
    rids, final = [], {}
    try:
        assert eng.stats()["decode_graphs"] == "compiling" and not eng.wait_for_graphs(timeout=0.1)
        rids = [eng.add_request(None, p, sp) for p in ps]
        for _ in range(6):  # the prefills and a few decode steps, eagerly
            final.update({o.request_id: o for o in eng.step() if o.finished})
        assert eng.decode_graph.calls == 0 and not final
        before = pools(eng)
    finally:
        gate.set()  # the compile thread ends whatever failed (the interpreter waits for it)
    assert eng.wait_for_graphs(timeout=600), eng.decode_graph.error
    assert all(torch.equal(a, b) for a, b in zip(before, pools(eng)))
    stats, graphs = eng.stats(), counters["stats"]["unique_graphs"]
    assert stats["decode_graphs"] == "ready" and stats["decode_graph_compile_s"] > 0
    while len(final) < len(rids):  # the same requests go on through the graphs
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.decode_graph.calls >= 10 and counters["stats"]["unique_graphs"] == graphs
    for rid, b in zip(rids, want):
        a = final[rid]
        assert a.token_ids == b.token_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.slow
def test_steps_beside_a_background_compile_stay_eager():
    # while one thread traces, torch.compiler.is_compiling() is True in every thread (torch 2.13):
    # the eager steps beside it must not take the traced paths (no value checks, whole-table
    # attention, experts read by index) that the model's kernels choose while a graph is traced
    from k3.kernels.dispatch import eager

    m = two_layer_model()
    ps, sp = prompts([9, 4], seed=8), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLMEngine(m, EngineConfig(page_size=8, compile_decode=False)).generate(ps, sp)]
    eng = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True, compile_decode_wait=False))
    seen, runs = [], 0
    while not eng.wait_for_graphs(timeout=0):
        seen.append(eager())
        if eng.decode_graph.calls == 0:
            assert [o.token_ids for o in eng.generate(ps, sp)] == want
            runs += 1
    assert eng.wait_for_graphs(timeout=600) and runs >= 1 and seen and all(seen), (runs, seen.count(False), len(seen))


@pytest.mark.slow
def test_a_process_that_ends_while_graphs_compile_exits_cleanly():
    # the compile thread is no daemon: the interpreter waits for it (a daemon thread stopped at
    # exit inside torch, with the GIL released, aborted the process: "terminate called ...")
    code = ("import torch\nfrom k3.model import K3ForCausalLM, get_preset\n"
            "from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams\n"
            "m = K3ForCausalLM(get_preset('k3-tiny', num_layers=2, layer_types=['kda', 'mla'], "
            "mlp_types=['moe', 'moe'], attn_res_block_size=1)).eval()\n"
            "e = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True, compile_decode_wait=False))\n"
            "print(e.stats()['decode_graphs'], len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids))\n")
    # at this process's torch threads, the count inductor's cache keys CPU code by: the graphs the
    # tests above compiled for this model load from the cache (seconds, not ~40 s), and the
    # compile is still under way when the 3 tokens are done
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["compiling", "3"], (r.returncode, r.stdout, r.stderr[-3000:])
    assert "terminate called" not in r.stderr


def other_model():
    """The same layers and cache as two_layer_model, another MLP schedule: nothing the graphs'
    guards check tells the two apart, and a graph traced from one is wrong for the other."""
    torch.manual_seed(1)
    cfg = get_preset("k3-tiny", num_layers=2, layer_types=["kda", "mla"], mlp_types=["dense", "moe"],
                     attn_res_block_size=1)
    return K3ForCausalLM(cfg).eval()


def test_each_model_has_its_own_compiled_forward(model):
    # its graphs' guards skip the model's modules, so no other model may reach them
    cpu = torch.device("cpu")
    assert compiled_forward(model, cpu) is compiled_forward(model, cpu)
    assert DecodeGraph(model, cpu)._fn is compiled_forward(model, cpu)
    assert compiled_forward(other_model(), cpu) is not compiled_forward(model, cpu)


@pytest.mark.slow
def test_engines_on_other_models_and_changed_weights_get_their_own_tokens(model):
    # in one process: a model of another structure compiles its own graphs (one traced from the
    # fixture's model would run its first MLP as experts it does not have), and weights changed in
    # place after the compile are what the graphs read
    ps, sp = prompts([7, 3], seed=6), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for m in (model, other_model()):
        eng = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True))
        want = LLMEngine(m, EngineConfig(page_size=8)).generate(ps, sp)
        assert [o.token_ids for o in eng.generate(ps, sp)] == [o.token_ids for o in want]
        assert eng.decode_graph.error is None and eng.decode_graph.calls >= 9
    m = other_model()
    eng = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True))
    before = [o.token_ids for o in eng.generate(ps, sp)]
    with torch.no_grad():
        m.lm_head.weight.copy_(torch.randn_like(m.lm_head.weight))
    after = [o.token_ids for o in eng.generate(ps, sp)]
    assert after != before
    assert after == [o.token_ids for o in LLMEngine(m, EngineConfig(page_size=8)).generate(ps, sp)]
    # the per-model traced function does not keep its model alive
    gone = weakref.ref(m)
    del eng, m
    gc.collect()
    assert gone() is None


def test_a_graph_that_fails_at_start_leaves_the_engine_eager(monkeypatch, caplog):
    # not a tracing error (those are handled inside DecodeGraph): the compiled code itself failing
    def boom(self, input_ids, cache):
        raise MemoryError("no room for the graph")

    monkeypatch.setattr(DecodeGraph, "compile", boom)
    m = two_layer_model()
    ps, sp = prompts([6, 4], seed=4), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eng = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True))
    assert "MemoryError: no room for the graph" in eng.decode_graph.error and "steps run eagerly" in caplog.text
    assert eng.stats()["decode_graph_compile_s"] is None
    eager = LLMEngine(m, EngineConfig(page_size=8))
    assert eng.cache.usage() == eager.cache.usage()
    assert [o.token_ids for o in eng.generate(ps, sp)] == [o.token_ids for o in eager.generate(ps, sp)]


def test_a_model_that_cannot_be_traced_runs_eagerly(caplog):
    m = two_layer_model()
    inner = m.forward

    def branching(input_ids, **kw):  # a branch on a tensor's value: fullgraph tracing refuses it
        return inner(input_ids if bool((input_ids >= 0).all()) else input_ids.clamp_min(0), **kw)

    m.forward = branching
    ps, sp = prompts([6, 4], seed=3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eng = LLMEngine(m, EngineConfig(page_size=8, compile_decode=True))
    outs = eng.generate(ps, sp)
    assert eng.decode_graph.error is not None and eng.decode_graph.calls == 0
    assert "steps run eagerly" in caplog.text
    want = LLMEngine(m, EngineConfig(page_size=8, compile_decode=False)).generate(ps, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def projections(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w)), w2, b2)
    # a scaled addmm (beta * bias + alpha * x @ w) is not a projection: it keeps its BLAS call
    return h + torch.addmm(b2, x, w2[:, :96].t(), beta=0.5, alpha=2.0)


@pytest.mark.parametrize("rows,dtype,dynamic,rewritten", [(1, torch.float32, False, True),
                                                          (3, torch.float32, False, False),
                                                          (5, torch.float32, True, False),
                                                          (1, torch.bfloat16, False, False)])
def test_one_row_matmuls_become_sums_only_for_one_fp32_row(rows, dtype, dynamic, rewritten):
    # the decode graphs' pass: one fp32 row's mm and addmm become a multiply-and-sum (no BLAS
    # call left in the code), other shapes and dtypes keep the BLAS call; same values
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    x, w, w2, b2 = (torch.randn(*s, generator=g).to(dtype) for s in ((rows, 96), (160, 96), (40, 160), (40,)))
    fn = torch.compile(projections, fullgraph=True, dynamic=None if dynamic else False,
                       options={"post_grad_custom_post_pass": OneRowMatmuls(), "fx_graph_cache": False})
    if dynamic:  # the batch-of-more graph's case: rows a symbol, not known to be one
        torch._dynamo.mark_dynamic(x, 0)
    before = OneRowMatmuls.replaced
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got, code = run_and_get_code(fn, x, w, w2, b2)
    assert (OneRowMatmuls.replaced - before == 2) == rewritten
    assert ("extern_kernels.mm(" in code[0]) != rewritten
    assert code[0].count("extern_kernels.addmm(") == (1 if rewritten else 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, projections(x, w, w2, b2), rtol=tol, atol=tol)


@pytest.mark.parametrize("pages,width", [(1, MIN_TABLE_PAGES), (8, 8), (9, 16), (16, 16), (17, 32)])
def test_page_table_buckets(pages, width):
    assert DecodeGraph.table_width(pages) == width


def test_a_shape_served_before_runs_without_the_trace_setup(model):
    # the first call of a (batch of one, table width) marks the dynamic dimensions and raises the
    # recompile limit (a config patch: ~60 us, 3% of a kimi8 step); later calls of that shape go
    # straight to the compiled function, whose guards still check them; a dynamo error on any
    # call turns graphs off and the step runs eagerly
    from k3.serve.engine.graphs import MAX_GRAPHS

    eng = LLMEngine(model, EngineConfig(compile_decode=False, page_size=8))
    g = DecodeGraph(model, torch.device("cpu"))
    seen = []

    def spy(m, input_ids, cache):
        seen.append((torch._dynamo.config.recompile_limit == MAX_GRAPHS,
                     hasattr(cache.page_table, "_dynamo_weak_dynamic_indices")))
        return torch.zeros(input_ids.shape[1], 4)

    g._fn = spy
    calls = [(1, 8), (1, 8), (3, 8), (3, 8), (2, 8), (1, 16), (1, 16)]
    for n, width in calls:
        cb = eng.cache.compile_batch(n, lambda _: width, private=True)
        assert g.logits(torch.zeros((1, n), dtype=torch.long), cb).shape == (n, 4)
    # set up: the first batch of one, the first of more (3; then 2 shares its graph), a new width
    assert [s[0] for s in seen] == [True, False, True, False, False, True, False]
    assert [s[1] for s in seen] == [True, False, True, False, False, True, False]
    assert g.calls == len(calls)

    def broken(*_):
        raise torch._dynamo.exc.InternalTorchDynamoError("boom")

    g._fn = broken
    cb = eng.cache.compile_batch(3, lambda _: 8, private=True)
    assert g.logits(torch.zeros((1, 3), dtype=torch.long), cb) is None and "boom" in g.error


def test_a_served_shape_runs_the_first_graph_whose_guards_pass(model, monkeypatch):
    # as dynamo's frame hook would: the graphs in its order, the first whose guards accept the
    # call, a new shape's too (a new width on CPU, where it is dynamic); a call none accepts goes
    # through dynamo (which may trace it), after which the list is read again
    eng = LLMEngine(model, EngineConfig(compile_decode=False, page_size=8))
    g = DecodeGraph(model, torch.device("cpu"))
    ran = []

    def graph(name, accepts):  # (guard check, traced code), as `replays` gives them
        return (lambda frame: accepts(frame["input_ids"].shape[1], frame["cache"].page_table.shape[1]),
                lambda m, ids, cache: ran.append(name) or torch.full((ids.shape[1], 4), float(len(ran))))

    held = [graph("one", lambda n, w: n == 1 and w == 8), graph("many", lambda n, w: n in (2, 3)),
            graph("any", lambda n, w: n < 3)]
    monkeypatch.setattr(graphs, "replays", lambda fn: list(held))
    g._fn = lambda m, ids, cache: ran.append("dynamo") or torch.zeros(ids.shape[1], 4)

    def step(n, width=8):
        cb = eng.cache.compile_batch(n, lambda _: width, private=True)
        return g.logits(torch.zeros((1, n), dtype=torch.long), cb)

    for n, width in [(1, 8), (1, 8), (3, 8), (3, 8), (2, 8), (1, 16), (1, 16)]:
        assert step(n, width).shape == (n, 4)
    assert ran == ["dynamo", "one", "many", "many", "many", "any", "any"]
    assert g.calls == 7 and g.replayed == 6
    held[:] = [graph("never", lambda n, w: False)]  # dynamo's list changes (read after its next call)
    step(3)  # "many" in the list in hand
    step(4)  # a shape served but accepted by none: through dynamo, then its list is read
    step(3)
    assert ran[-3:] == ["many", "dynamo", "dynamo"] and g.calls == 10 and g.replayed == 7


def test_replays_are_dynamos_own_graphs():
    # each graph's guards and its code: a call the guards accept runs that code as a plain
    # function, with the compiled function's result; other dtypes, shapes and grad modes are not
    # accepted; a function dynamo never compiled has none
    def scaled(x, y):
        return torch.sin(x) + y * 2

    fn = torch.compile(scaled, backend="eager", fullgraph=True)
    assert replays(scaled) == [] and replays(fn) == []
    x, y = torch.randn(5), torch.randn(5)
    with torch.no_grad():
        want = fn(x, y)
    (check, run), = replays(fn)
    with torch.no_grad():
        assert check({"x": x, "y": y})
        assert not check({"x": x.double(), "y": y}) and not check({"x": torch.randn(6), "y": torch.randn(6)})
        torch.testing.assert_close(run(x, y), want)
    assert not check({"x": x, "y": y})  # traced without grad, checked with it


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.arange(4.0))


def tiny_batch(n: int, width: int) -> tuple[torch.Tensor, CacheBatch]:
    cb = CacheBatch(cu_seqlens=torch.arange(n + 1), context_lens=torch.arange(n) + 3, kda_slots=torch.arange(n),
                    page_table=torch.arange(n * width).view(n, width),
                    kda={0: KDAPool(torch.randn(n, 4), torch.randn(n, 4))}, mla_pages={1: torch.randn(6, 4)},
                    decode=True)
    return torch.arange(n)[None], cb


def reads_everything(model, input_ids, cache):
    pool = cache.kda[0]
    pool.recurrent.mul_(0.5)  # the pools are updated in place, as a decode step's are
    x = pool.recurrent + pool.conv * cache.context_lens[:, None] + cache.mla_pages[1][:input_ids.shape[1]]
    x = x + cache.page_table.float().sum(-1, keepdim=True) / cache.page_table.shape[1] + input_ids[0, :, None]
    return model.proj(x + model.shift + cache.cu_seqlens[1:, None] + cache.kda_slots[:, None])


def replace_pools(cb: CacheBatch) -> CacheBatch:
    """cb with copies of its pools (a reference run must not update the pools under test)."""
    return dataclasses.replace(cb, kda={k: KDAPool(p.recurrent.clone(), p.conv.clone()) for k, p in cb.kda.items()},
                               mla_pages={k: t.clone() for k, t in cb.mla_pages.items()})


def test_a_bound_graph_reads_the_batch_of_each_call():
    # bind learns a graph's arguments once: the model's tensors kept, the batch's tensors and
    # pools read from each call; a later call with other values (same shapes) gets what the
    # traced code itself gives, its in-place updates included
    torch.manual_seed(0)
    model = Tiny()
    fn = torch.compile(reads_everything, backend="eager", fullgraph=True)
    with torch.no_grad():
        ids, cb = tiny_batch(3, 8)
        DecodeGraph._mark(ids, cb)  # the sizes the decode graphs trace as symbols: passed as ints
        fn(model, ids, cb)
        (check, run), = replays(fn)
        ids, cb = tiny_batch(3, 8)
        want = reads_everything(model, ids, replace_pools(cb))
        out, bound = bind(check, run, model, ids, cb)
        assert isinstance(bound, Bound) and torch.equal(out, want)
        for _ in range(2):
            ids, cb = tiny_batch(3, 8)
            cb.context_lens += 5
            cb.mla_pages[1].normal_()
            expected_cb = replace_pools(cb)
            want = reads_everything(model, ids + 1, expected_cb)
            assert check({"model": model, "input_ids": ids + 1, "cache": cb})
            assert torch.equal(bound(ids + 1, cb), want)
            assert torch.equal(cb.kda[0].recurrent, expected_cb.kda[0].recurrent)


OUTSIDE = torch.ones(4)


def sets_a_field(model, input_ids, cache):
    cache.max_new = 7  # a side effect the traced code replays after the graph
    return model.proj(cache.kda[0].recurrent)


def reads_a_global(model, input_ids, cache):
    return model.proj(cache.kda[0].recurrent + OUTSIDE)


@pytest.mark.parametrize("traced", [sets_a_field, reads_a_global])
def test_code_that_does_more_than_gather_its_inputs_is_not_bound(traced):
    # the call still runs (its side effects done), every later call runs the traced code
    model = Tiny()
    fn = torch.compile(traced, backend="eager", fullgraph=True)
    with torch.no_grad():
        fn(model, *tiny_batch(2, 8))
        (check, run), = replays(fn)
        ids, cb = tiny_batch(2, 8)
        out, bound = bind(check, run, model, ids, cb)
        assert bound is None and torch.equal(out, traced(model, ids, cb))
    assert (cb.max_new == 7) == (traced is sets_a_field)


def test_a_tensor_in_two_places_of_the_batch_is_not_bound():
    # which place the graph read could not be told apart
    model = Tiny()
    fn = torch.compile(reads_everything, backend="eager", fullgraph=True)
    with torch.no_grad():
        ids, cb = tiny_batch(2, 8)
        cb.kda_slots = cb.context_lens
        fn(model, ids, cb)
        frame = {"model": model, "input_ids": ids, "cache": cb}
        check, run = next((c, r) for c, r in replays(fn) if c(frame))
        assert bind(check, run, model, ids, cb)[1] is None
