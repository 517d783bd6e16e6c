"""BalanceCoordinator: the rules in-process (CoordinatorCore), then the actor under local Ray."""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
import ray
import ray.cloudpickle
import torch

from k3.kernels.qb_histogram import qb_histogram
from k3.platform.balance import BalanceConfig, expert_loads, make_balancer, route
from k3.platform.balance.coordinator import BiasUpdate, CoordinatorCore

L, E, K, BINS, N = 2, 8, 2, 32, 48
ALL_LAYERS = {"bins": BINS, "layerwise": False, "solve_rounds": 1}  # one solve of every layer per step (the protocol's rules)
POPULARITY = torch.linspace(-1.0, 1.0, E) * 1.5  # skewed experts, so the biases have work to do


def worker_scores(worker: int, step: int, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(worker * 100_003 + step * 101 + layer)
    return torch.sigmoid(torch.randn(N, E, generator=g) + POPULARITY)


def worker_report(update: BiasUpdate, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a training worker sends for `step`: hist [L, E, bins] and counts [L, E]."""
    hists, counts = [], []
    for layer in range(L):
        margins, idx = route(worker_scores(worker, step, layer), update.bias[layer], K)
        hists.append(qb_histogram(margins, update.lo[layer], update.hi[layer], update.bins))
        counts.append(expert_loads(idx, E))
    return torch.stack(hists), torch.stack(counts)


def reference_biases(workers: int, steps: int) -> list[torch.Tensor]:
    """The single-process solve on the union of every worker's tokens: bias [L, E] after each step."""
    bal = make_balancer(BalanceConfig(**ALL_LAYERS), L, E, K)
    out = []
    for step in range(steps):
        for layer in range(L):
            bal.observe_scores(layer, torch.cat([worker_scores(w, step, layer) for w in range(workers)]))
        bal.step()
        out.append(bal.bias())
    return out


def same_state(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[x], b[x]) for x in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def snapshot(core: CoordinatorCore) -> dict:
    return {"state": core.state_dict(), "pending": {w: list(v) for w, v in core.pending.items()}}


def new_core(workers: int = 4, **kw) -> CoordinatorCore:
    core = CoordinatorCore(L, E, K, ALL_LAYERS, **kw)
    for w in range(workers):
        core.register(f"w{w}")
    return core


# ---------------------------------------------------------------------------------------------
# In-process rules


def test_core_matches_single_process_solve_on_union():
    core, ref = new_core(), reference_biases(4, 20)
    for step in range(20):
        update = core.latest()
        statuses = [core.report(f"w{w}", step, *worker_report(update, w, step), update.step) for w in range(4)]
        assert statuses == ["pending"] * 3 + ["solved"]
        assert torch.equal(core.get_bias(step).bias, ref[step]), f"step {step}"
    m = core.metrics()
    assert m["step"] == 19 and m["pending"] == []
    assert ref[0].abs().max() > 0.1  # the skew needed a real correction
    for layer in m["layers"]:
        assert layer["maxvio"] == pytest.approx(layer["max_load"] / layer["mean_load"] - 1)
        assert layer["mean_load"] == 4 * N * K / E
        assert layer["hist_bytes"] == 20 * 4 * E * BINS * 8  # int64 as sent here
        assert layer["bias_spread"] > 0


def test_resent_report_replaces_the_first():
    core, clean = new_core(), new_core()
    u = core.latest()
    other = worker_report(u, 7, 0)  # a different batch, sent first and then replaced
    assert core.report("w0", 0, *other, u.step) == "pending"
    assert core.register("w0").step == u.step  # a restart re-registers under the same id
    for core_ in (core, clean):
        for w in range(4):
            core_.report(f"w{w}", 0, *worker_report(u, w, 0), u.step)
    assert torch.equal(core.latest().bias, clean.latest().bias)
    assert core.latest().step == 0


def test_resent_solved_step_is_ignored():
    core = new_core()
    u = core.latest()
    for w in range(4):
        core.report(f"w{w}", 0, *worker_report(u, w, 0), u.step)
    before = snapshot(core)
    hist, counts = worker_report(u, 9, 0)
    assert core.report("w1", 0, hist, counts, u.step) == "done"
    before["state"]["hist_bytes"] = core.state_dict()["hist_bytes"]  # bytes were received
    assert same_state(snapshot(core), before)


def test_world_size_waits_for_late_registrations():
    core = new_core(workers=2, world_size=3)
    u = core.latest()
    for w in range(2):
        assert core.report(f"w{w}", 0, *worker_report(u, w, 0), u.step) == "pending"
    core.register("w2")
    assert core.report("w2", 0, *worker_report(u, 2, 0), u.step) == "solved"


def test_deregister_can_complete_a_step():
    core = new_core(workers=3)
    u = core.latest()
    for w in range(2):
        core.report(f"w{w}", 0, *worker_report(u, w, 0), u.step)
    assert core.deregister("w2") is True
    assert core.latest().step == 0 and core.metrics()["workers"] == ["w0", "w1"]
    with pytest.raises(ValueError, match="not registered"):
        core.deregister("w2")


def _bad_reports():
    u = CoordinatorCore(L, E, K, ALL_LAYERS).latest()
    hist, counts = worker_report(u, 0, 0)
    short = hist.clone()
    short[1, 3, 5] += 1
    negative = hist.clone()
    negative[0, 0, 0] = -1
    skew = counts.clone()
    skew[0, 0] += 1
    return {
        "hist shape": (dict(hist=hist[:, :, :-1]), r"hist must be \[layers, experts, bins\] = \[2, 8, 32\]"),
        "hist layers": (dict(hist=hist[:1]), r"got \(1, 8, 32\)"),
        "hist float": (dict(hist=hist.float()), "integer counts"),
        "hist negative": (dict(hist=negative), "non-negative"),
        "hist rows": (dict(hist=short), "same N tokens"),
        "counts shape": (dict(counts=counts[0]), r"counts must be \[layers, experts\]"),
        "counts sum": (dict(counts=skew), "N k"),
        "unregistered": (dict(worker="stranger"), "unregistered worker 'stranger'"),
        "future step": (dict(step=3), "step 1 is still open"),
        "old edges": (dict(bias_step=-1), "must use update 0"),
        "empty step": (dict(hist=hist * 0, counts=counts * 0, all_empty=True), r"q = N k / E = 0 .* outside \(0, N=0\)"),
    }


@pytest.mark.parametrize("case", list(_bad_reports()))
def test_bad_report_raises_and_changes_nothing(case):
    kwargs, match = _bad_reports()[case]
    core = new_core(workers=2)
    u = core.latest()
    for w in range(2):  # step 0 solved; step 1 open with w1's report in
        core.report(f"w{w}", 0, *worker_report(u, w, 0), u.step)
    u = core.latest()
    if kwargs.pop("all_empty", False):
        core.report("w1", 1, kwargs["hist"], kwargs["counts"], u.step)  # one empty worker is fine
    else:
        core.report("w1", 1, *worker_report(u, 1, 1), u.step)
    before = snapshot(core)
    hist, counts = worker_report(u, 0, 1)
    args = dict(worker="w0", step=1, hist=hist, counts=counts, bias_step=u.step) | kwargs
    with pytest.raises(ValueError, match=match):
        core.report(args["worker"], args["step"], args["hist"], args["counts"], args["bias_step"])
    assert same_state(snapshot(core), before)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=8), "1 <= top_k < experts"),
        (dict(top_k=9), "1 <= top_k < experts"),
        (dict(config={"method": "loss_free"}), "quantile_hist"),
        (dict(config={"fine_pass": True}), "fine_pass"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_bad_construction(kwargs, match):
    args = dict(num_layers=L, num_experts=E, top_k=K, config=None) | kwargs
    with pytest.raises(ValueError, match=match):
        CoordinatorCore(**args)


def test_state_dict_round_trip_and_get_bias():
    core = new_core()
    for step in range(6):
        u = core.latest()
        for w in range(4):
            core.report(f"w{w}", step, *worker_report(u, w, step), u.step)
    u = core.latest()
    core.report("w0", 6, *worker_report(u, 0, 6), u.step)  # in flight: not part of the state
    restored = CoordinatorCore(L, E, K, ALL_LAYERS)
    restored.load_state_dict(core.state_dict())
    assert restored.latest().step == 5 and restored.pending == {} and restored.workers == core.workers
    for c in (core, restored):
        for w in range(4):
            c.report(f"w{w}", 6, *worker_report(u, w, 6), u.step)
    assert torch.equal(core.latest().bias, restored.latest().bias)
    assert core.get_bias(7) is None
    with pytest.raises(ValueError, match="is gone"):
        core.get_bias(0)
    with pytest.raises(ValueError, match=r"\(layers, experts, k, bins\)"):
        CoordinatorCore(L, E, 3, ALL_LAYERS).load_state_dict(core.state_dict())
    assert restored.latest().step == 6  # the refused load changed nothing of the others
    # Saved between steps, a state resumes under other solve settings, its solves renumbered: 7
    # steps of one solve are 14 layerwise solves of 2 layers, with the same biases and windows.
    layerwise = CoordinatorCore(L, E, K, {"bins": BINS, "solve_rounds": 1})
    layerwise.load_state_dict(core.state_dict())
    assert layerwise.latest().step == 7 * L - 1 and torch.equal(layerwise.latest().bias, core.latest().bias)
    assert torch.equal(layerwise.latest().lo, core.latest().lo)
    u = layerwise.latest()
    for w in range(4):  # one more solve, layer 0 of step 7: then the state stops inside a step
        layerwise.report(f"w{w}", 7 * L, *(t[:1] for t in worker_report(u, w, 7)), u.step)
    assert layerwise.latest().step == 7 * L
    with pytest.raises(ValueError, match="stopped inside a step .*balance.solve_rounds=1 and balance.layerwise=True"):
        CoordinatorCore(L, E, K, ALL_LAYERS).load_state_dict(layerwise.state_dict())


def test_layerwise_rounds_solve_one_layer_each():
    """layerwise: a step is L rounds, round l carries layer l's histogram alone; with inputs that
    do not depend on the bias (these synthetic scores) that is the all-layers solve, one layer at
    a time. A report of the wrong shape names the layer's round and changes nothing."""
    core = CoordinatorCore(L, E, K, {"bins": BINS, "solve_rounds": 1}, world_size=2)
    for w in range(2):
        core.register(f"w{w}")
    reference = make_balancer(BalanceConfig(**ALL_LAYERS), L, E, K)
    for step in range(3):
        for layer in range(L):
            u = core.latest()
            assert u.step == step * L + layer - 1
            if layer == 1 and step == 1:
                before = snapshot(core)
                with pytest.raises(ValueError, match=r"\[1, 8, 32\] \(layer 1's round\)"):
                    core.report("w0", u.step + 1, *worker_report(u, 0, step), u.step)  # every layer
                assert same_state(snapshot(core), before)
            for w in range(2):
                hist, counts = worker_report(u, w, step)
                status = core.report(f"w{w}", step * L + layer, hist[layer:layer + 1], counts[layer:layer + 1], u.step)
            assert status == "solved" and core.first_solve_of_step(core.last_step)
            solved = core.latest().bias
            assert torch.equal(solved[layer + 1:], u.bias[layer + 1:])  # later layers wait their round
        for layer in range(L):
            reference.observe_scores(layer, torch.cat([worker_scores(w, step, layer) for w in range(2)]))
        reference.step()
        assert torch.equal(core.latest().bias, reference.bias()), f"step {step}"
    bytes_per_layer = [m["hist_bytes"] for m in core.metrics()["layers"]]
    assert bytes_per_layer[0] == bytes_per_layer[1] > 0


def test_layerwise_alternations_are_consecutive_rounds_of_their_layer():
    """solve_rounds=R layerwise: rounds l * R .. l * R + R - 1 of a step are layer l's, and its
    maxvio gauge comes from the first; all layers at once: each round is every layer's."""
    R = 2
    core = CoordinatorCore(L, E, K, {"bins": BINS, "solve_rounds": R})
    assert core.rounds_per_step == R * L
    rounds = range(2 * R * L)  # two steps
    assert [core.round_layers(r)[0] for r in rounds] == [layer for _ in range(2) for layer in range(L) for _ in range(R)]
    assert [core.first_solve_of_step(r) for r in rounds] == [r % R == 0 for r in rounds]
    core = CoordinatorCore(L, E, K, {"bins": BINS, "layerwise": False, "solve_rounds": R})
    assert core.rounds_per_step == R and all(core.round_layers(r) == range(L) for r in rounds)
    assert [core.first_solve_of_step(r) for r in rounds] == [r % R == 0 for r in rounds]


# ---------------------------------------------------------------------------------------------
# Under Ray

from k3.platform.balance.coordinator import BalanceClient, get_or_create_coordinator  # noqa: E402

# Ray workers cannot import this test module by name; ship its classes and helpers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class SimWorker:
    """A training worker reduced to its QB part: route, bin, report, fetch."""

    def __init__(self, coordinator, index: int, poll_s: float):
        self.index = index
        self.client = BalanceClient(coordinator, f"w{index}", poll_s)

    def run_step(self, step: int) -> str:
        update = self.client.fetch(timeout_s=120)  # the update of step - 1
        assert update.step == step - 1, (update.step, step)
        hist, counts = worker_report(update, self.index, step)
        return ray.get(self.client.report(step, hist, counts))


def run_steps(coord, workers, steps, kill=None) -> list[torch.Tensor]:
    biases = []
    for step in steps:
        if kill is not None and step in kill:
            kill[step](step)
        else:
            ray.get([w.run_step.remote(step) for w in workers])
        biases.append(ray.get(coord.get_bias.remote(step)).bias)  # all reported: solved
    return biases


@pytest.mark.ray
def test_four_workers_twenty_steps_match_single_process(ray_local):
    coord = get_or_create_coordinator("qb-test-4x20", num_layers=L, num_experts=E, top_k=K, config=ALL_LAYERS, world_size=4)
    workers = [SimWorker.remote(coord, i, 5.0) for i in range(4)]
    try:
        got = run_steps(coord, workers, range(20))
        ref = reference_biases(4, 20)
        for step in range(20):
            assert torch.equal(got[step], ref[step]), f"step {step}: {got[step] - ref[step]}"
        m = ray.get(coord.metrics.remote())
        assert m["step"] == 19 and m["workers"] == ["w0", "w1", "w2", "w3"]
        for layer in m["layers"]:
            assert layer["hist_bytes"] == 20 * 4 * E * BINS * 4  # the client sends int32
            assert 0 <= layer["maxvio"] < 1.5
    finally:
        for actor in workers + [coord]:
            ray.kill(actor)


@pytest.mark.ray
def test_worker_killed_and_restarted_mid_run(ray_local):
    coord = get_or_create_coordinator("qb-test-kill-worker", num_layers=L, num_experts=E, top_k=K, config=ALL_LAYERS, world_size=4)
    workers = [SimWorker.remote(coord, i, 5.0) for i in range(4)]

    def after_report(step):  # w2 dies after its report landed, comes back and sends it again
        assert ray.get([w.run_step.remote(step) for w in workers[:3]]) == ["pending"] * 3
        ray.kill(workers[2], no_restart=True)
        workers[2] = SimWorker.remote(coord, 2, 5.0)
        assert ray.get(workers[2].run_step.remote(step)) == "pending"  # replaced, not added
        assert ray.get(workers[3].run_step.remote(step)) == "solved"

    def before_report(step):  # w1 dies before reporting
        ray.kill(workers[1], no_restart=True)
        workers[1] = SimWorker.remote(coord, 1, 5.0)
        ray.get([w.run_step.remote(step) for w in workers])

    try:
        got = run_steps(coord, workers, range(10), kill={4: after_report, 7: before_report})
        ref = reference_biases(4, 10)
        for step in range(10):
            assert torch.equal(got[step], ref[step]), f"step {step}"
        assert ray.get(coord.metrics.remote())["workers"] == ["w0", "w1", "w2", "w3"]
    finally:
        for actor in workers + [coord]:
            ray.kill(actor)


@pytest.mark.ray
def test_killed_coordinator_restores_its_last_state(ray_local, tmp_path):
    path = str(tmp_path / "qb_state.pt")
    coord = get_or_create_coordinator(
        "qb-test-kill-coord", num_layers=L, num_experts=E, top_k=K, config=ALL_LAYERS, world_size=4, state_path=path
    )
    workers = [SimWorker.remote(coord, i, 1.0) for i in range(4)]
    seen = {}

    def kill_mid_step(step):
        ray.get([w.run_step.remote(step) for w in workers[:2]])  # two reports, then the crash
        seen["pid"] = ray.get(coord.describe.remote())["pid"]
        ray.kill(coord, no_restart=False)
        ray.get([w.run_step.remote(step) for w in workers[2:]])  # queued until the restart
        seen["after"] = ray.get(coord.describe.remote())
        # w0 and w1's reports died with the old process; their clients re-send on the next fetch

    try:
        got = run_steps(coord, workers, range(4))
        kill_mid_step(4)
        assert ray.get(coord.get_bias.remote(4)) is None  # two reports of step 4 were lost
        ray.get([w.run_step.remote(5) for w in workers])  # fetching update 4 re-sends them
        got += [ray.get(coord.get_bias.remote(step)).bias for step in (4, 5)]
        assert seen["after"]["restored"] and seen["after"]["pid"] != seen["pid"]
        assert seen["after"]["step"] == 3  # state of the last solved step; 4 was in flight
        ref = reference_biases(4, 6)
        for step in range(6):
            assert torch.equal(got[step], ref[step]), f"step {step}"
    finally:
        for actor in workers + [coord]:
            ray.kill(actor)


@pytest.mark.ray
def test_actor_rejects_bad_input_without_changing_state(ray_local):
    with pytest.raises(ValueError, match="1 <= top_k < experts"):
        get_or_create_coordinator("qb-test-bad", num_layers=L, num_experts=E, top_k=E, config=ALL_LAYERS)
    coord = get_or_create_coordinator("qb-test-bad", num_layers=L, num_experts=E, top_k=K, config=ALL_LAYERS)
    try:
        again = get_or_create_coordinator("qb-test-bad", num_layers=L, num_experts=E, top_k=K, config=ALL_LAYERS)
        assert ray.get(again.describe.remote())["pid"] == ray.get(coord.describe.remote())["pid"]
        with pytest.raises(ValueError, match="exists with"):
            get_or_create_coordinator("qb-test-bad", num_layers=L, num_experts=E + 1, top_k=K, config=ALL_LAYERS)
        update = ray.get(coord.register.remote("w0"))
        before = ray.get(coord.state_dict.remote())
        hist, counts = worker_report(update, 0, 0)
        with pytest.raises(ValueError, match="unregistered"):
            ray.get(coord.report.remote("w9", 0, hist, counts, update.step))
        with pytest.raises(ValueError, match=r"\[layers, experts, bins\]"):
            ray.get(coord.report.remote("w0", 0, hist[:, :, :5], counts, update.step))
        with pytest.raises(ValueError, match="outside"):
            ray.get(coord.report.remote("w0", 0, hist * 0, counts * 0, update.step))
        assert same_state(ray.get(coord.state_dict.remote()), before)
        assert ray.get(coord.report.remote("w0", 0, hist, counts, update.step)) == "solved"
        client = BalanceClient(coord, "w0", poll_s=0.2)
        assert client.update.step == 0 and client.ready()
        t0 = time.monotonic()
        assert ray.get(coord.wait_bias.remote(1, 0.2)) is None and time.monotonic() - t0 < 5
    finally:
        ray.kill(coord)


@pytest.mark.ray
def test_local_ray_stays_on_loopback(ray_local):
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


class RoundsModel:
    """Stands in for the model in the strategies: MoE layer l's scores for the step's batch depend
    on the bias layer l - 1 routes with (as a deep router's input depends on how the layers below
    it route), so a second round, or solving layer by layer, moves the deep layers' solve."""

    def __init__(self):
        self.bias = torch.zeros(L, E)

    def set_router_bias(self, bias):
        self.bias = bias.clone()

    @staticmethod
    def layer(step: int, layer: int, bias: torch.Tensor) -> SimpleNamespace:
        shift = 4.0 * bias[layer - 1].roll(1) if layer else 0.0
        scores = torch.sigmoid(torch.logit(worker_scores(0, step, layer)) + shift)
        margins, idx = route(scores, bias[layer], K)
        return SimpleNamespace(margins=margins, counts=expert_loads(idx, E), scores=scores, expert_ids=idx)

    def routers(self, step: int, bias: torch.Tensor) -> list:
        return [self.layer(step, layer, bias) for layer in range(L)]

    def rerun(self, step: int):
        """The trainer's router pass: with `solve`, each layer routes with what it returns before
        the next layer is reached (K3Model.solving_router_bias)."""
        def run(solve=None) -> list:
            out = []
            for layer in range(L):
                r = self.layer(step, layer, self.bias)
                if solve is not None and (new := solve(layer, r)) is not None:
                    self.bias[layer] = new
                    r = self.layer(step, layer, self.bias)
                out.append(r)
            return out
        return run


@pytest.mark.parametrize("rounds", [1, 2])
def test_local_strategy_alternates_each_layer_before_the_next(rounds):
    """Exact QB on one worker, layerwise: each layer's solve_rounds alternations (re-routing its
    scores in hand with each solve) happen before the next layer is reached, as the Balancer
    stepped by hand; the model ends routing with the last solve of every layer."""
    from k3.platform.balance.strategies import make_strategy

    config = BalanceConfig(method="quantile", solve_rounds=rounds)
    strategy = make_strategy(config, L, E, K, torch.device("cpu"))
    model, bal = RoundsModel(), make_balancer(config, L, E, K)
    for step in range(4):
        strategy.refresh(model, step, model.rerun(step))
        for layer in range(L):
            for _ in range(rounds):
                r = model.routers(step, bal.bias())[layer]
                bal.observe(layer, r.margins, r.counts)
                bal.step()
        assert torch.equal(model.bias, bal.bias()), f"step {step}"
    assert bal.steps == 4 * L * rounds


@pytest.mark.ray
@pytest.mark.parametrize("layerwise, rounds", [(True, 1), (True, 2), (False, 2)],
                         ids=["layerwise", "layerwise_two_alternations", "two_rounds"])
def test_quantile_hist_solves_through_the_coordinator_like_the_balancer(ray_local, layerwise, rounds):
    """layerwise: per step the strategy reports layer 0, routes it with the solve (two
    alternations: re-routes layer 0's scores with it and reports again, routes with that), reports
    layer 1 and leaves its last solve for the next step. two_rounds: it reports every layer, routes
    the same batch with the solve, reports again. The biases equal the single-process Balancer
    doing the same on the same batches, and differ (layer 1) from one solve of every layer from
    one forward."""
    from k3.platform.balance.strategies import make_strategy

    config = BalanceConfig(bins=BINS, layerwise=layerwise, solve_rounds=rounds)
    name = f"qb-test-rounds-{layerwise}-{rounds}"
    coord = get_or_create_coordinator(name, num_layers=L, num_experts=E, top_k=K, config=config, world_size=1)
    try:
        strategy = make_strategy(config, L, E, K, torch.device("cpu"), rank=0, coordinator_name=name)
        strategy.start(None)
        model, bal = RoundsModel(), make_balancer(config, L, E, K)
        once = make_balancer(BalanceConfig(**ALL_LAYERS), L, E, K)
        for step in range(6):
            strategy.begin_step(model)
            assert torch.equal(model.bias, bal.bias()), f"step {step}"
            strategy.refresh(model, step, model.rerun(step))
            if layerwise:  # each layer's alternations before the next layer is reached
                for layer in range(L):
                    for _ in range(rounds):
                        r = model.routers(step, bal.bias())[layer]  # the layers below are solved already
                        bal.observe(layer, r.margins, r.counts)
                        bal.step()
            else:
                for _ in range(rounds):
                    for i, r in enumerate(model.routers(step, bal.bias())):
                        bal.observe(i, r.margins, r.counts)
                    bal.step()
            for layer, r in enumerate(model.routers(step, once.bias())):
                once.observe(layer, r.margins, r.counts)
            once.step()
        strategy.begin_step(model)  # waits for the last round's solve (reports return at once)
        assert ray.get(coord.metrics.remote())["step"] == config.rounds_per_step(L) * 6 - 1
        assert torch.equal(model.bias, bal.bias())
        assert torch.equal(bal.bias()[0], once.bias()[0]) == (rounds == 1)  # layer 0's inputs never change
        assert not torch.allclose(bal.bias()[1], once.bias()[1], atol=1e-3)  # solving for its real inputs moved layer 1
    finally:
        ray.kill(coord)
