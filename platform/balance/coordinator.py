"""BalanceCoordinator: the named Ray actor that turns the workers' QB histograms into biases.

Protocol, one round per training step t, all MoE layers at once:

1. A worker registers once (`register(worker_id)`) and gets the latest `BiasUpdate`.
2. At step t it routes layer l with `update.bias[l]`, bins that layer's margins over the window
   `update.lo[l], update.hi[l]` (`qb_histogram`, `update.bins` bins) and sends
   `report(worker_id, t, hist [L, E, bins], counts [L, E], bias_step=update.step)` (one layer's
   rows per report when the rounds are layerwise, below). In the
   training job the margins are, by default, those of a no-grad forward of step t's batch under
   the weights step t produced (BalanceConfig.margins_after_step), routed with the same bias.
3. Once every live worker has reported t, the coordinator sums the histograms, solves each layer
   (`k3.platform.balance.quantile.hist_step`) and publishes `BiasUpdate(step=t)`: the bias and the bin
   windows for step t+1. Margins depend on the bias they were routed with, so a report must be
   binned with the update of step t-1; any other is refused.
4. Right after reporting, the worker launches `wait_bias.remote(t)` and collects it at the start
   of step t+1, so the round trip overlaps with whatever the worker does in between
   (`BalanceClient` does 2-4).

Rounds: a training step is `config.rounds_per_step(L)` rounds of 2-3, numbered step * that +
round, "step" above meaning a round. With BalanceConfig.layerwise (the default) a round solves one
layer: the worker reports layer l's histogram [1, E, bins] and counts [1, E] as its after-step
forward reaches layer l, waits for the solve and routes layer l with it before going on, so each
layer is solved for the inputs the new biases below it give. With BalanceConfig.solve_rounds = R
the worker re-routes layer l's scores in hand with each solve and reports again, R alternations
of the solve per layer in the one forward: rounds l * R .. l * R + R - 1 of a step are layer l's.
Otherwise a round solves every layer at once ([L, E, bins]), and with R > 1 the workers route
the same batch again after the step's solves and solve again, R forwards. The last round's update
routes the next step. The maxvio gauge of a layer is set from its first solve of each step (the
bias in hand under the new weights), the other gauges from every solve.

Bin edges: the coordinator owns them. Each update carries the windows for the next step,
centred on each expert's new selection boundary -b_e with a half-width per layer that follows
how far the thresholds moved (BalanceConfig.range_policy); workers never derive edges themselves.

Failures: reports are idempotent per (worker, step): a restarted worker that re-registers and
re-sends a step replaces its earlier report, and a re-sent step that is already solved is
ignored. After every solved step and every change of the worker set the state (biases, windows,
workers, recent updates, metrics) is written atomically to `state_path`; a coordinator that Ray
restarts (`max_restarts`) reloads it in `__init__`. Reports of the step in flight are not
saved: clients re-send them when `wait_bias` times out. `state_dict`/`load_state_dict` put the
same state in the training checkpoint. Bad input raises ValueError and changes nothing.

Metrics (ray.util.metrics, tag `layer`): gauges k3_train_qb_maxvio (max load / mean load - 1
of the step just solved) and k3_train_qb_bias_spread (max - min of the new bias), counter
k3_train_qb_hist_bytes (histogram bytes received). `metrics()` returns the same and more.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import ray
import torch

from k3.kernels.qb_histogram import qb_histogram
from k3.platform.balance.config import BalanceConfig
from k3.platform.balance.quantile import HistLayerState, hist_step
from k3.platform.balance.routing import check_layers, max_violation

STATE_FORMAT = 1


@dataclass(frozen=True)
class BiasUpdate:
    """Solved from step `step`'s histograms; route and bin step `step + 1` with it."""

    step: int
    bias: torch.Tensor  # [L, E] fp32, centred per layer
    lo: torch.Tensor  # [L, E] histogram window of step + 1
    hi: torch.Tensor  # [L, E]
    bins: int


def _to_config(config: BalanceConfig | dict[str, Any] | None) -> BalanceConfig:
    config = BalanceConfig() if config is None else config
    config = config if isinstance(config, BalanceConfig) else BalanceConfig(**config)
    if config.method != "quantile_hist":
        raise ValueError(f"the coordinator sums histograms: method must be 'quantile_hist', got {config.method!r}")
    if config.fine_pass:
        raise ValueError("fine_pass needs a second report round per step, which the coordinator does not do yet")
    return config


def _check_args(num_layers: int, num_experts: int, top_k: int, config, world_size: int | None) -> BalanceConfig:
    """The coordinator's arguments, checked wherever they are first given; returns the config."""
    check_layers(num_layers, num_experts, top_k)
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _to_config(config)


class CoordinatorCore:
    """The coordinator's state and rules, without Ray (the actor wraps it; tests drive it directly)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        config: BalanceConfig | dict[str, Any] | None = None,
        world_size: int | None = None,
        start_step: int = 0,
        keep_updates: int = 4,
    ):
        """world_size: no step is solved before this many workers are registered (so early
        reporters do not solve the first steps alone); None: whoever is registered.
        start_step: the first step workers will report (a resumed run that has no state)."""
        self.config = _check_args(num_layers, num_experts, top_k, config, world_size)
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.rounds_per_step = self.config.rounds_per_step(num_layers)
        self.bins = self.config.bins
        self.world_size = world_size
        self.keep_updates = max(2, keep_updates)
        self.layers = [HistLayerState.initial(self.config, num_experts) for _ in range(num_layers)]
        self.last_step = start_step - 1
        self.updates: OrderedDict[int, BiasUpdate] = OrderedDict()
        self._publish()
        self.workers: set[str] = set()
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # reports of step last_step + 1
        self.hist_bytes = [0] * num_layers
        self.layer_metrics: list[dict[str, float]] = [{} for _ in range(num_layers)]

    def round_layers(self, round_: int) -> range:
        """The layers round `round_` solves: one (layerwise) or all."""
        if self.config.layerwise:  # a step's rounds: layer 0's solve_rounds alternations, then layer 1's, ...
            layer = round_ % self.rounds_per_step // self.config.solve_rounds
            return range(layer, layer + 1)
        return range(self.num_layers)

    def first_solve_of_step(self, round_: int) -> bool:
        """Whether round `round_` is its layers' first solve in its step."""
        if self.config.layerwise:
            return round_ % self.config.solve_rounds == 0
        return round_ % self.rounds_per_step == 0

    # -- worker set
    def register(self, worker_id: str) -> BiasUpdate:
        """Add a worker (idempotent: a restarted worker re-registers under its old id)."""
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
        self.workers.add(worker_id)
        return self.latest()

    def deregister(self, worker_id: str) -> bool:
        """Drop a worker for good and its report in flight; True if that completed the step."""
        if worker_id not in self.workers:
            raise ValueError(f"worker {worker_id!r} is not registered")
        pending = dict(self.pending)
        pending.pop(worker_id, None)
        workers = self.workers - {worker_id}
        solved = self._solve_if_complete(workers, pending)
        self.workers = workers
        self.pending = pending if solved is None else {}
        if solved is not None:
            self._commit(*solved)
        return solved is not None

    # -- reports
    def report(
        self, worker_id: str, step: int, hist: torch.Tensor, counts: torch.Tensor, bias_step: int
    ) -> str:
        """Take one worker's histograms of one step (round). Returns 'pending', 'solved' or 'done'.

        hist [L', E, bins] integer counts binned over the windows of update `bias_step`; counts
        [L', E] tokens per expert under that update's bias; L' the layers of the round
        (`round_layers`). 'done': the step was already solved (a re-send after a restart), nothing
        changes.
        """
        if worker_id not in self.workers:
            raise ValueError(f"report from unregistered worker {worker_id!r}; call register first")
        for name, value in (("step", step), ("bias_step", bias_step)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        layers = self.round_layers(step)
        self._check_report(hist, counts, layers)
        if step <= self.last_step:
            return "done"
        if step > self.last_step + 1:
            raise ValueError(f"worker {worker_id!r} reported step {step} while step {self.last_step + 1} is still open")
        if bias_step != self.last_step:
            raise ValueError(
                f"worker {worker_id!r} binned step {step} with update {bias_step}, but step {step} must use update {self.last_step}"
            )
        pending = dict(self.pending)
        pending[worker_id] = (hist.detach().cpu(), counts.detach().cpu().long())
        solved = self._solve_if_complete(self.workers, pending)  # raises before anything changes
        for row, layer in enumerate(layers):
            self.hist_bytes[layer] += hist[row].numel() * hist.element_size()
        if solved is None:
            self.pending = pending
            return "pending"
        self._commit(*solved)
        return "solved"

    def _check_report(self, hist: torch.Tensor, counts: torch.Tensor, layers: range) -> None:
        want = (len(layers), self.num_experts, self.bins)
        if not isinstance(hist, torch.Tensor) or tuple(hist.shape) != want:
            got = tuple(hist.shape) if isinstance(hist, torch.Tensor) else type(hist).__name__
            which = f"layer {layers[0]}'s round" if len(layers) == 1 and self.config.layerwise else "every layer"
            raise ValueError(f"hist must be [layers, experts, bins] = {list(want)} ({which}), got {got}")
        if hist.is_floating_point() or hist.is_complex() or hist.dtype == torch.bool:
            raise ValueError(f"hist must hold integer counts, got {hist.dtype}")
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != want[:2]:
            got = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
            raise ValueError(f"counts must be [layers, experts] = {list(want[:2])}, got {got}")
        if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise ValueError(f"counts must be integer, got {counts.dtype}")
        if bool((hist < 0).any()) or bool((counts < 0).any()):
            raise ValueError("hist and counts must be non-negative")
        rows = hist.long().sum(-1)  # [L, E]: every expert of every layer sees all N tokens
        n_tokens = int(rows[0, 0])
        if not bool((rows == n_tokens).all()):
            raise ValueError(f"every [layer, expert] row of hist must count the same N tokens, got sums {rows.unique().tolist()[:8]}")
        routed = counts.long().sum(-1)
        if not bool((routed == n_tokens * self.top_k).all()):
            raise ValueError(f"counts must sum to N k = {n_tokens} * {self.top_k} per layer, got {routed.tolist()}")

    def _solve_if_complete(self, workers: set[str], pending: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        if not workers or not workers <= pending.keys() or len(workers) < (self.world_size or 1):
            return None
        hist = torch.stack([pending[w][0].long() for w in sorted(workers)]).sum(0)  # [L', E, bins]
        counts = torch.stack([pending[w][1] for w in sorted(workers)]).sum(0)  # [L', E]
        layers, metrics = list(self.layers), list(self.layer_metrics)
        for row, layer in enumerate(self.round_layers(self.last_step + 1)):
            state, info = hist_step(self.config, self.layers[layer], hist[row], counts[row], self.top_k)
            loads = counts[row]
            layers[layer] = state
            metrics[layer] = {
                "maxvio": max_violation(loads),
                "max_load": float(loads.max()),
                "mean_load": float(loads.double().mean()),
                "bias_spread": float(state.bias.max() - state.bias.min()),
                "halfwidth": state.halfwidth,
                "saturated": info["saturated"],
                "gain": info["gain"],
                "n_tokens": info["n_tokens"],
            }
        return layers, metrics

    def _commit(self, layers: list[HistLayerState], metrics: list[dict[str, float]]) -> None:
        self.layers, self.layer_metrics = layers, metrics
        self.last_step += 1
        self.pending = {}
        self._publish()

    def _publish(self) -> None:
        update = BiasUpdate(
            step=self.last_step,
            bias=torch.stack([s.bias for s in self.layers]).float(),
            lo=torch.stack([s.lo for s in self.layers]).float(),
            hi=torch.stack([s.hi for s in self.layers]).float(),
            bins=self.bins,
        )
        self.updates[self.last_step] = update
        while len(self.updates) > self.keep_updates:
            self.updates.popitem(last=False)

    # -- reads
    def latest(self) -> BiasUpdate:
        return self.updates[self.last_step]

    def get_bias(self, step: int) -> BiasUpdate | None:
        """The update solved from `step`, or None while that step is open."""
        if step > self.last_step:
            return None
        if step not in self.updates:
            raise ValueError(f"update {step} is gone (kept: {list(self.updates)}); use latest()")
        return self.updates[step]

    def metrics(self) -> dict[str, Any]:
        """Per layer: maxvio (max load / mean load - 1), max/mean load, bias spread, bytes received;
        "step" is the last solve (a training step has `solves_per_step`)."""
        layers = [
            {"layer": i, **self.layer_metrics[i], "hist_bytes": self.hist_bytes[i]}
            for i in range(self.num_layers)
        ]
        return {"step": self.last_step, "solves_per_step": self.rounds_per_step, "workers": sorted(self.workers),
                "pending": sorted(self.pending), "layers": layers}

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "shape": (self.num_layers, self.num_experts, self.top_k, self.bins),
            "config": self.config.model_dump(),
            "last_step": self.last_step,
            "layers": [(s.bias.clone(), s.lo.clone(), s.hi.clone(), s.halfwidth) for s in self.layers],
            "updates": [(u.step, u.bias.clone(), u.lo.clone(), u.hi.clone()) for u in self.updates.values()],
            "workers": sorted(self.workers),
            "hist_bytes": list(self.hist_bytes),
            "layer_metrics": [dict(m) for m in self.layer_metrics],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; the step in flight (if any) starts over. A state saved between
        steps resumes under other solve settings (solve_rounds, layerwise): its solves are
        renumbered to this coordinator's rounds per step."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown coordinator state format {state.get('format')!r}")
        saved = state.get("config", {})
        rounds, layerwise = int(saved.get("solve_rounds", 1)), bool(saved.get("layerwise", False))
        saved_per_step = rounds * (self.num_layers if layerwise else 1)
        last = int(state["last_step"])
        if saved_per_step != self.rounds_per_step and (last + 1) % saved_per_step:
            raise ValueError(f"state stopped inside a step (solve {last}, {saved_per_step} per step with "
                             f"solve_rounds={rounds}, layerwise={layerwise}); this coordinator has "
                             f"solve_rounds={self.config.solve_rounds}, layerwise={self.config.layerwise}: resume with "
                             f"balance.solve_rounds={rounds} and balance.layerwise={layerwise}")
        shape = tuple(state["shape"])
        if shape != (self.num_layers, self.num_experts, self.top_k, self.bins):
            raise ValueError(
                f"state is for (layers, experts, k, bins) = {shape}, this coordinator has "
                f"{(self.num_layers, self.num_experts, self.top_k, self.bins)}"
            )
        layers = [HistLayerState(b.float(), lo.float(), hi.float(), float(w)) for b, lo, hi, w in state["layers"]]
        if len(layers) != self.num_layers or any(s.bias.shape != (self.num_experts,) for s in layers):
            raise ValueError("state holds layer tensors of the wrong shape")
        updates: OrderedDict[int, BiasUpdate] = OrderedDict(
            (int(s), BiasUpdate(int(s), b.float(), lo.float(), hi.float(), self.bins)) for s, b, lo, hi in state["updates"]
        )
        if last not in updates:
            raise ValueError("state lacks the update of its last step")
        if saved_per_step != self.rounds_per_step:  # between steps: the same biases and windows, renumbered
            u = updates[last]
            last = (last + 1) // saved_per_step * self.rounds_per_step - 1
            updates = OrderedDict({last: BiasUpdate(last, u.bias, u.lo, u.hi, self.bins)})
        self.layers, self.updates = layers, updates
        self.last_step = last
        self.workers = set(state["workers"])
        self.pending = {}
        self.hist_bytes = list(state["hist_bytes"])
        self.layer_metrics = [dict(m) for m in state["layer_metrics"]] or [{} for _ in range(self.num_layers)]


@ray.remote(num_cpus=0, max_restarts=3, max_task_retries=3)
class BalanceCoordinator:
    """Named Ray actor around CoordinatorCore: persistence, waiting, Prometheus metrics.

    Create it with `get_or_create_coordinator`. Async methods run one at a time on the actor's
    event loop, so each call sees and leaves a consistent state.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        config: dict[str, Any] | None = None,
        world_size: int | None = None,
        start_step: int = 0,
        state_path: str | None = None,
    ):
        self._core = CoordinatorCore(num_layers, num_experts, top_k, config, world_size, start_step)
        self._state_path = state_path
        self.restored = False
        if state_path and os.path.exists(state_path):
            self._core.load_state_dict(torch.load(state_path, weights_only=False))
            self.restored = True
        self._solved = asyncio.Condition()
        from ray.util import metrics as ray_metrics

        tags = ("layer",)
        self._g_maxvio = ray_metrics.Gauge("k3_train_qb_maxvio", "max expert load / mean load - 1", tags)
        self._g_spread = ray_metrics.Gauge("k3_train_qb_bias_spread", "max bias - min bias", tags)
        self._c_bytes = ray_metrics.Counter("k3_train_qb_hist_bytes", "histogram bytes received", tags)

    async def describe(self) -> dict[str, Any]:
        c = self._core
        return {"num_layers": c.num_layers, "num_experts": c.num_experts, "k": c.top_k, "bins": c.bins,
                "step": c.last_step, "restored": self.restored, "pid": os.getpid()}

    async def register(self, worker_id: str) -> BiasUpdate:
        new = worker_id not in self._core.workers
        update = self._core.register(worker_id)
        if new:
            self._persist()
        return update

    async def deregister(self, worker_id: str) -> bool:
        solved = self._core.deregister(worker_id)
        self._persist()
        if solved:
            await self._after_solve()
        return solved

    async def report(self, worker_id: str, step: int, hist: torch.Tensor, counts: torch.Tensor, bias_step: int) -> str:
        before = list(self._core.hist_bytes)
        status = self._core.report(worker_id, step, hist, counts, bias_step)
        for layer, (a, b) in enumerate(zip(before, self._core.hist_bytes)):
            if b > a:
                self._c_bytes.inc(b - a, tags={"layer": str(layer)})
        if status == "solved":
            self._persist()
            await self._after_solve()
        return status

    async def get_bias(self, step: int) -> BiasUpdate | None:
        return self._core.get_bias(step)

    async def wait_bias(self, step: int, timeout_s: float | None = None) -> BiasUpdate | None:
        """The update of `step` once solved; None if `timeout_s` passes first."""
        async with self._solved:
            try:
                await asyncio.wait_for(self._solved.wait_for(lambda: step <= self._core.last_step), timeout_s)
            except TimeoutError:
                return None
        return self._core.get_bias(step)

    async def latest(self) -> BiasUpdate:
        return self._core.latest()

    async def metrics(self) -> dict[str, Any]:
        return self._core.metrics()

    async def state_dict(self) -> dict[str, Any]:
        return self._core.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self._core.load_state_dict(state)
        self._persist()
        await self._after_solve(every_layer=True)

    async def _after_solve(self, every_layer: bool = False) -> None:
        core = self._core
        first = every_layer or core.first_solve_of_step(core.last_step)
        layers = core.metrics()["layers"]
        for layer in range(core.num_layers) if every_layer else core.round_layers(core.last_step):
            m = layers[layer]
            if "maxvio" in m:
                tags = {"layer": str(layer)}
                if first:
                    self._g_maxvio.set(m["maxvio"], tags=tags)
                self._g_spread.set(m["bias_spread"], tags=tags)
        async with self._solved:
            self._solved.notify_all()

    def _persist(self) -> None:
        if not self._state_path:
            return
        tmp = f"{self._state_path}.tmp.{os.getpid()}"
        torch.save(self._core.state_dict(), tmp)
        os.replace(tmp, self._state_path)  # atomic: a crash leaves the old file or the new one


def get_or_create_coordinator(
    name: str = "k3-balance",
    *,
    num_layers: int,
    num_experts: int,
    top_k: int,
    config: BalanceConfig | dict[str, Any] | None = None,
    world_size: int | None = None,
    start_step: int = 0,
    state_path: str | None = None,
    namespace: str | None = None,
    max_restarts: int = 3,
) -> "ray.actor.ActorHandle":
    """The named coordinator, created on first call. Arguments are checked here, in the caller."""
    cfg = _check_args(num_layers, num_experts, top_k, config, world_size)
    handle = BalanceCoordinator.options(
        name=name, namespace=namespace, get_if_exists=True, max_restarts=max_restarts, max_task_retries=-1 if max_restarts else 0
    ).remote(num_layers, num_experts, top_k, cfg.model_dump(), world_size, start_step, state_path)
    info = ray.get(handle.describe.remote())
    want = {"num_layers": num_layers, "num_experts": num_experts, "k": top_k, "bins": cfg.bins}
    if any(info[key] != value for key, value in want.items()):
        raise ValueError(f"coordinator {name!r} exists with {info}, asked for {want}")
    return handle


class BalanceClient:
    """Worker side of the protocol: route with `update.bias`, bin with `histogram`, then
    `report(step, ...)` and, at the start of the next step, `fetch()`.

    The client keeps its report until the update arrives and re-sends it when a wait times out
    (the coordinator may have restarted and lost the step in flight); re-sends are harmless.
    """

    def __init__(self, coordinator: "ray.actor.ActorHandle", worker_id: str, poll_s: float = 5.0):
        self.coordinator, self.worker_id, self.poll_s = coordinator, worker_id, poll_s
        self.update: BiasUpdate = ray.get(coordinator.register.remote(worker_id))
        self._report: tuple[int, torch.Tensor, torch.Tensor, int] | None = None
        self._refs: tuple[Any, Any] | None = None

    def histogram(self, layer: int, margins: torch.Tensor) -> torch.Tensor:
        """margins [N, E] of `layer`, routed with update.bias[layer] -> [E, bins] int64."""
        u = self.update
        return qb_histogram(margins, u.lo[layer], u.hi[layer], u.bins)

    def report(self, step: int, hist: torch.Tensor, counts: torch.Tensor) -> "ray.ObjectRef":
        """Send hist [L, E, bins] and counts [L, E] of `step`; returns at once.

        The returned ref resolves to the coordinator's answer ('pending', 'solved', 'done');
        there is no need to wait on it: `fetch` raises if the report was refused.
        """
        if step != self.update.step + 1:
            raise ValueError(f"{self.worker_id}: step {step} must follow the update in hand ({self.update.step})")
        # per-worker counts fit int32 and halve the traffic; on the host, for the CPU-only actor
        self._report = (step, hist.to("cpu", torch.int32), counts.to("cpu", torch.long), self.update.step)
        return self._send()

    def _send(self) -> "ray.ObjectRef":
        step, hist, counts, bias_step = self._report
        ref = self.coordinator.report.remote(self.worker_id, step, hist, counts, bias_step)
        self._refs = (ref, self.coordinator.wait_bias.remote(step, self.poll_s))
        return ref

    def ready(self) -> bool:
        """True once the update for the reported step can be fetched without waiting."""
        return self._refs is None or bool(ray.wait([self._refs[1]], timeout=0)[0])

    def fetch(self, timeout_s: float | None = None) -> BiasUpdate:
        """The update of the last reported step (waits for the slowest worker if needed)."""
        if self._report is None:
            return self.update
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            report_ref, wait_ref = self._refs
            ray.get(report_ref)  # raises here if the coordinator refused the report
            update = ray.get(wait_ref)
            if update is not None:
                self.update, self._report, self._refs = update, None, None
                return update
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.worker_id}: no update for step {self._report[0]} after {timeout_s}s")
            self._send()


__all__ = ["BalanceClient", "BalanceCoordinator", "BiasUpdate", "CoordinatorCore", "get_or_create_coordinator"]
