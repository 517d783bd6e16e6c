"""Decode steps through a compiled graph: the model's forward over a decode batch, traced once per
shape bucket and replayed every step after.

Eagerly, a decode step dispatches a few hundred small ops from Python (thousands of
interpreter-level calls for an 8-layer model), so it costs many times its arithmetic. Here
`torch.compile` traces the forward of a decode batch once (with no host sync inside: the kernels
skip their value checks while a graph is traced, `k3.kernels.dispatch.eager`), inductor fuses the
pointwise work into a few C++ loops (Triton kernels on a GPU), and later steps of the same shape
run the compiled code:

- batch: the number of sequences is a dynamic dimension, so one graph serves every batch of 2 to
  max_num_seqs sequences (torch specialises a batch of 1 into its own graph);
- page table: padded to a power of two of pages, at least `MIN_TABLE_PAGES` (the padding holds
  page 0, never read: it lies past every sequence's length); on CPU its width is a dynamic
  dimension too, and the traced attention reads the whole table in one slice, so the same two
  graphs serve every context up to `k3.kernels.mla_decode.cpu.TRACED_SLICE` (64K) tokens; past
  it the context is read in slices, and a graph is traced once per doubling, as it is for every
  bucket on a GPU (a CUDA graph records one shape);
- when: `LLMEngine` compiles both graphs when it starts (`compile_decode`, on by default on CPU),
  for the first bucket, so on CPU no request's step pays for a compile below that length; on CPU
  over scratch pools of the cache's shapes (`CacheManager.compile_batch`: guards check shapes,
  dtypes and strides, not addresses), so it may run in a background thread while the engine's
  steps run eagerly (`compile_decode_wait=False`): decode steps take the graphs once both are
  ready;
- mode: inductor's default on CPU (its max-autotune CPU GEMM templates fail an assertion on
  these shapes in torch 2.13 and tune for minutes) with a C++ wrapper (`cpp_wrapper`: the
  graph's few hundred kernel and GEMM calls made from C++, not from generated Python; ~25-30 s
  more to compile cold); "reduce-overhead" (CUDA graphs) on a GPU;
- experts: traced without autograd on a CPU, the routed experts read each token's weights by
  index in fused loops instead of the sort and grouped calls (`k3.model.moe.read_by_index`:
  25-44% off a decode step, docs/benchmarks.md);
- one-row matmuls (the batch of one's every projection and its lm_head): on CPU a graph pass
  (`OneRowMatmuls`) makes each fp32 `mm`/`addmm` with a single row an inductor multiply-and-sum,
  which reads the weight's rows in vectorised C++ loops and fuses into its neighbours, instead
  of a BLAS GEMV call (MKL's GEMV read 13-18 GB/s on the AMD EPYC host where this was measured,
  where one thread sums memory at 43: about 30% off kimi8's compiled step at 1 sequence; on an
  Intel Xeon host, whose MKL GEMV is faster, still ~6%; docs/benchmarks.md); a batch of 2+ and
  bf16 keep the BLAS call (as a sum a batch reads each weight once a row: slower);
- guards: each model gets a traced function of its own (one per model, shared by the engines on
  it), so the graphs in its cache were all traced from that model, and on CPU the guards that
  would check the model's modules before every step (hundreds, ~0.3 ms a step for an 8-layer
  model) are skipped (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`); the inputs' guards
  (batch, table width, dtypes) stay. Together the two cut a CPU decode step by 7-18%
  (docs/benchmarks.md). The contract: weights may change in place (they are the graph's inputs,
  read at every call), but a model's modules and parameters are not replaced (nor retied,
  reshaped or recast) once an engine has compiled its graphs: nothing checks them any more.
  A call of a shape a graph has served (batch of one or more, table width) runs the first of
  the forward's graphs whose guards pass (~6 us), as dynamo's frame hook would but without it
  (~90 us of Python a call, `replays`): the first such call through the code dynamo made for
  that graph, which also learns the graph's arguments for the batch's exact shape (`bind`: the
  model's tensors, the sizes, where each of the batch's tensors sits), later ones straight to
  the compiled graph with the batch's tensors read from the call (`Bound`: ~40 us less again,
  the ~100 attribute reads of a 4-layer model's code). Code that does more than gather its
  inputs and call its graph is never bound; a call no graph's guards pass goes through dynamo,
  which may trace it; only a new shape is set up to trace (its dimensions marked dynamic, the
  recompile limit raised by a config patch: ~60 us a call).

Numerics: inductor fuses and reorders pointwise ops and reductions, so logits differ from the
eager forward's by float rounding (about 1e-6 for fp32 logits of order 1): greedy tokens agree
(tests/serve/test_graphs.py), and an engine that switches from eager steps to graphs mid-request
gives the same greedy tokens. `EngineConfig.compile_decode` turns graphs on or off (by default on
for a CPU engine, off on a GPU, where the CUDA-graph path is untested; the compile at start costs
~1.5 min for k3-tiny on a 2-core CPU with a cold inductor cache, ~10 s warm, docs/benchmarks.md);
a graph that cannot be compiled here (no C++ compiler, an unsupported op) turns it off for the
engine with a warning, and that step runs eagerly.

The traced code keeps the model's weights as inputs (not constants): a change to them is seen.
"""
from __future__ import annotations

import contextlib
import dis
import itertools
import logging
import threading
import types
import weakref
from collections.abc import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import Arg, CallFunction, Match, PatternMatcherPass, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

from k3.model.cache import CacheBatch

log = logging.getLogger(__name__)

MIN_TABLE_PAGES = 8
# Graphs one model's decode forward may trace: (batch of 1, batch of 2+) x page buckets.
MAX_GRAPHS = 64


_aten = torch.ops.aten
_one_row = PatternMatcherPass(pass_name="k3_one_row_matmuls")


def _is_one_row(mat1: torch.fx.Node, mat2: torch.fx.Node) -> bool:
    """A CPU fp32 matmul whose left operand has exactly one row (known when traced)."""
    a, b = mat1.meta.get("val"), mat2.meta.get("val")
    return (a is not None and b is not None and a.dim() == 2 and b.dim() == 2 and a.device.type == "cpu"
            and a.dtype == b.dtype == torch.float32 and statically_known_true(a.shape[0] == 1))


def _row_times(row: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    # [1, K] x [K, N] (an nn.Linear's weight seen transposed: each output reads one contiguous
    # weight row) as a product and a sum over K, which inductor lowers to one vectorised reduction
    return torch.sum(row[:, :, None] * mat[None, :, :], dim=-2)


@register_graph_pattern(CallFunction(_aten.mm.default, Arg(), Arg()), pass_dict=_one_row)
def _one_row_mm(match: Match, mat1: torch.fx.Node, mat2: torch.fx.Node) -> None:
    if _is_one_row(mat1, mat2):
        match.replace_by_example(_row_times, [mat1, mat2])
        OneRowMatmuls.replaced += 1


@register_graph_pattern(CallFunction(_aten.addmm.default, Arg(), Arg(), Arg()), pass_dict=_one_row)
def _one_row_addmm(match: Match, bias: torch.fx.Node, mat1: torch.fx.Node, mat2: torch.fx.Node) -> None:
    scaled = any(match.output_node().kwargs.get(k, 1) != 1 for k in ("beta", "alpha"))  # beta * bias + alpha * mm
    if _is_one_row(mat1, mat2) and not scaled:
        match.replace_by_example(lambda c, a, b: _row_times(a, b) + c, [bias, mat1, mat2])
        OneRowMatmuls.replaced += 1


class OneRowMatmuls(CustomGraphPass):
    """Inductor's post-grad pass for CPU decode graphs: every fp32 matmul of one row becomes a
    multiply-and-sum (module docstring). `replaced` counts the matmuls it rewrote in this process
    (graphs loaded from inductor's cache were rewritten when first compiled)."""

    replaced = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        _one_row.apply(graph)

    def uuid(self) -> bytes:  # the FX graph cache's key for this pass: this file's contents
        return get_hash_for_files((__file__,))


def _decode_logits(model, input_ids: torch.Tensor, cache: CacheBatch) -> torch.Tensor:
    return model(input_ids, cache=cache).logits[0]


_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {device type: compiled forward}
_serial = itertools.count()


def compiled_forward(model: torch.nn.Module, device: torch.device):
    """The compiled decode forward of `model` on `device`'s type: one per model, shared by every
    engine on it. A code object of its own gives it a dynamo cache of its own, so the guards
    need not tell this model's graphs from another model's."""
    per_device = _TRACED.setdefault(model, {})
    fn = per_device.get(device.type)
    if fn is None:
        code = _decode_logits.__code__.replace(co_name=f"_decode_logits_{next(_serial)}")
        traced = types.FunctionType(code, _decode_logits.__globals__, code.co_name)
        if device.type == "cuda":
            fn = torch.compile(traced, fullgraph=True, mode="reduce-overhead")
        else:
            fn = torch.compile(traced, fullgraph=True, options={
                "cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                "post_grad_custom_post_pass": OneRowMatmuls()})
        per_device[device.type] = fn
    return fn


def replays(fn) -> list[tuple[Callable[[dict], bool], Callable]]:
    """(guard check, traced code) of each graph dynamo holds for the compiled function `fn`, in
    dynamo's order: a call whose arguments pass a graph's check may run that graph's code as a
    plain function. That is what dynamo's frame hook does on a cache hit, less the hook itself
    (~90 us of Python a call): the same guards, the same code, its side effects included. Empty
    where this torch does not expose its cache entries (or `fn` is not a compiled function):
    every call then goes through dynamo."""
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if not isinstance(orig, types.FunctionType) or entries is None:
        return []
    out = []
    for e in entries(orig.__code__):
        check, code = getattr(getattr(e, "guard_manager", None), "check", None), getattr(e, "code", None)
        if check is None or not isinstance(code, types.CodeType) or code.co_freevars:
            return []
        out.append((check, types.FunctionType(code, orig.__globals__, code.co_name)))
    return out


# What a traced code object may do to be bound (`bind`): read its inputs (the model's
# parameters, the batch's tensors and sizes), call its graph and return an output of it.
_PURE_OPS = frozenset({"RESUME", "NOP", "LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_CONST", "LOAD_GLOBAL",
                       "LOAD_ATTR", "LOAD_METHOD", "BINARY_SUBSCR", "BUILD_LIST", "BUILD_TUPLE", "LIST_EXTEND",
                       "UNPACK_SEQUENCE", "PRECALL", "CALL", "KW_NAMES", "PUSH_NULL", "COPY", "SWAP", "POP_TOP",
                       "RETURN_VALUE"})
# A decode batch's metadata tensors (CacheBatch fields); its pools are `kda` and `mla_pages`.
_BATCH_TENSORS = ("cu_seqlens", "context_lens", "kda_slots", "page_table")
_PURE_NAMES = frozenset({"_modules", "_parameters", "_buffers", "call_size", "record_pregraph_bytecode_enter",
                         "record_pregraph_bytecode_exit", *_BATCH_TENSORS, "kda", "recurrent", "conv", "mla_pages"})
# Batch shapes (sequences, table width) a DecodeGraph keeps a Bound for.
MAX_BOUND = 1024


class Bound:
    """One graph's compiled function called with the inputs its traced code gathers, found once
    (`bind`): the model's tensors kept, the batch's read from each call's arguments (its tensors
    and pools, by where they sit in the batch). Skips the traced code's Python (~100 attribute
    reads a call for a 4-layer model) and leaves what the graph computes as it is."""

    __slots__ = ("check", "fn", "args", "reads")

    def __init__(self, check, fn, args: list, reads: list[tuple[int, Callable]]) -> None:
        self.check, self.fn, self.args, self.reads = check, fn, args, reads

    def __call__(self, input_ids: torch.Tensor, cache: CacheBatch) -> torch.Tensor:
        args = self.args.copy()
        for i, read in self.reads:
            args[i] = read(input_ids, cache)
        return self.fn(*args)[0]


def _batch_reads(input_ids: torch.Tensor, cache: CacheBatch) -> dict[int, Callable] | None:
    """{id(tensor): how to read it from a call's (input_ids, cache)} for every tensor of the
    batch; None when one tensor sits in two places (which one a graph read could not be told)."""
    places = [(input_ids, lambda ids, cb: ids)]
    for name in _BATCH_TENSORS:
        if getattr(cache, name) is not None:
            places.append((getattr(cache, name), lambda ids, cb, name=name: getattr(cb, name)))
    for layer, pool in cache.kda.items():
        for part in ("recurrent", "conv"):
            places.append((getattr(pool, part), lambda ids, cb, layer=layer, part=part: getattr(cb.kda[layer], part)))
    for layer, pages in cache.mla_pages.items():
        places.append((pages, lambda ids, cb, layer=layer: cb.mla_pages[layer]))
    found = {id(t): read for t, read in places}
    return found if len(found) == len(places) else None


_GRAPH_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # traced code -> `_only_calls_its_graph`
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ids of its parameters and buffers


def _only_calls_its_graph(code: types.CodeType) -> str | None:
    """The global name of the graph a traced code object calls, when all it does is read its
    inputs, call that one graph and return (`_PURE_OPS`, `_PURE_NAMES`); else None."""
    ops = list(dis.get_instructions(code))
    names = {i.argval for i in ops if i.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD")}
    graphs = [n for n in names if n.startswith("__compiled_fn")]
    pure = len(graphs) == 1 and all(i.opname in _PURE_OPS for i in ops) and \
        all(n in _PURE_NAMES or n.startswith("__import_") for n in names if n != graphs[0])
    return graphs[0] if pure else None


def bind(check, run, model: torch.nn.Module, input_ids: torch.Tensor, cache: CacheBatch):
    """Run `run` (a graph's traced code, from `replays`) on this call and, when it only gathers
    its inputs and calls its graph, learn that graph's arguments: -> (output, Bound or None).
    A Bound serves later calls of the same batch shape whose guards `check` passes: the model's
    tensors are the same objects (the engine's contract: modules and parameters are not
    replaced), the sizes the same numbers, the batch's tensors read from the call."""
    code = run.__code__
    if code not in _GRAPH_OF:
        _GRAPH_OF[code] = _only_calls_its_graph(code)
    graph = _GRAPH_OF[code]
    if graph is None:
        return run(model, input_ids, cache), None
    fn, seen = run.__globals__[graph], []

    def recorder(*args):
        seen.append((args, fn(*args)))
        return seen[-1][1]

    # a copy of the code's globals with the graph recorded: the shared ones stay as they are
    out = types.FunctionType(code, {**run.__globals__, graph: recorder}, code.co_name)(model, input_ids, cache)
    reads = _batch_reads(input_ids, cache)
    if len(seen) != 1 or reads is None or not isinstance(seen[0][1], (list, tuple)) or seen[0][1][0] is not out:
        return out, None
    kept = _KEPT.get(model)
    if kept is None:  # the model's parameters and buffers: the same objects for its life (the contract)
        kept = _KEPT[model] = frozenset(id(t) for t in itertools.chain(model.parameters(), model.buffers()))
    sizes = {n for t in [input_ids, *(getattr(cache, name) for name in _BATCH_TENSORS)] if t is not None
             for n in t.shape}
    args, at = list(seen[0][0]), []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and id(a) in reads:
            at.append((i, reads[id(a)]))
            args[i] = None  # not kept alive: read from each call
        elif not (isinstance(a, torch.Tensor) and id(a) in kept or type(a) is int and a in sizes):
            return out, None  # something the batch's shape does not fix: every call runs the code
    return out, Bound(check, fn, args, at)


class DecodeGraph:
    """The compiled decode forward of one engine's model."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self._fn = compiled_forward(model, device)
        self.error: str | None = None  # why graphs are off, once they are
        self.calls = 0  # decode steps the graphs ran
        self.replayed = 0  # of those, the steps run without dynamo's frame hook (`replays`)
        self._replayed = False
        self.compile_seconds: float | None = None  # the engine's compile at its start
        self.ready = False  # the graphs compiled at the engine's start are there: steps may use them
        self.compiled = threading.Event()  # that compile has ended (ready, or failed)
        # (batch of one, page-table width) of the calls made so far: a graph serves each, so a
        # later call of the same shape neither traces nor needs the recompile limit raised
        self._served: set[tuple[bool, int]] = set()
        # (guard check, traced code) of each graph dynamo holds for the forward (`replays`)
        self._replays: list[tuple[Callable[[dict], bool], Callable]] = []
        # (sequences, table width) -> the Bound call of the graph that first served it (None: that
        # graph's code does more than gather its inputs, or they could not all be placed)
        self._bound: dict[tuple[int, int], Bound | None] = {}

    @property
    def state(self) -> str:
        """"compiling", "ready" or "failed" (steps run eagerly but when ready)."""
        return "failed" if self.error is not None else "ready" if self.ready else "compiling"

    @staticmethod
    def table_width(pages: int) -> int:
        """The page-table width of the bucket that holds `pages` pages."""
        return max(MIN_TABLE_PAGES, 1 << max(0, pages - 1).bit_length())

    def logits(self, input_ids: torch.Tensor, cache: CacheBatch) -> torch.Tensor | None:
        """Logits [N, vocab] of a decode batch (input_ids [1, N], one new token per sequence;
        its page table one of `table_width`'s buckets), or None when graphs are off (the caller
        then runs the eager forward)."""
        out = self.compile(input_ids, cache)
        if out is not None:
            self.calls += 1
            self.replayed += self._replayed
        return out

    def compile(self, input_ids: torch.Tensor, cache: CacheBatch) -> torch.Tensor | None:
        """`logits` without counting a step: compiles the batch's graph if no graph serves it."""
        self._replayed = False  # this call ran a graph without dynamo's frame hook (`logits` counts it)
        if self.error is not None:
            return None
        shape = (input_ids.shape[1] == 1, cache.page_table.shape[1])
        # A call runs the first graph whose guards pass, as dynamo would, without its frame hook
        # (`replays`; `Bound` once its arguments are known for this batch shape), a shape not
        # served before too (a new table width on CPU, where the width is dynamic: the graph that
        # accepts it); one none passes goes through dynamo. A new shape is set up to trace: its
        # dynamic dimensions marked, the recompile limit raised (a config patch costs ~60 us, 3%
        # of a kimi8 step at one sequence: not paid every step)
        served = shape in self._served
        frame = {"model": self.model, "input_ids": input_ids, "cache": cache}
        key = (input_ids.shape[1], cache.page_table.shape[1])
        bound = self._bound.get(key) if served else None
        if bound is not None and bound.check(frame):
            self._replayed = True
            return bound(input_ids, cache)
        for check, run in self._replays:
            if check(frame):
                self._replayed = True
                self._served.add(shape)
                if key in self._bound or len(self._bound) >= MAX_BOUND:
                    return run(self.model, input_ids, cache)
                out, self._bound[key] = bind(check, run, self.model, input_ids, cache)
                return out
        return self._trace(input_ids, cache, shape, served)

    def _trace(self, input_ids: torch.Tensor, cache: CacheBatch, shape: tuple[bool, int],
               served: bool) -> torch.Tensor | None:
        """Call the compiled forward through dynamo, which traces the call when no graph of it
        serves it; the logits, or None when that failed (graphs are then off)."""
        if not served:
            self._mark(input_ids, cache)
        try:
            with contextlib.nullcontext() if served else torch._dynamo.config.patch(recompile_limit=MAX_GRAPHS):
                out = self._fn(self.model, input_ids, cache)
        except torch._dynamo.exc.TorchDynamoException as e:  # raised while tracing or compiling: nothing ran
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("decode graphs are off for this engine, steps run eagerly: %s", self.error)
            return None
        self._served.add(shape)
        self._replays = replays(self._fn)
        return out

    @staticmethod
    def _mark(input_ids: torch.Tensor, cache: CacheBatch) -> None:
        if input_ids.is_cuda:  # CUDA graphs replay fixed addresses: the pools stay where they are
            for t in [*(x for p in cache.kda.values() for x in (p.recurrent, p.conv)), *cache.mla_pages.values()]:
                torch._dynamo.mark_static_address(t)
        dims = [(input_ids, 1), (cache.cu_seqlens, 0), (cache.context_lens, 0), (cache.kda_slots, 0),
                (cache.page_table, 0)]
        if not input_ids.is_cuda:  # CUDA graphs record one width each anyway: a graph per bucket there
            dims.append((cache.page_table, 1))
        for t, dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)
