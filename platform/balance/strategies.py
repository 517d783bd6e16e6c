"""Expert balancing in the training job: the Trainer's hooks over one balancer.

The Trainer calls the same hooks whatever the method (`--balance`):

    begin_step(model) -> seconds     route this step with the bias in hand (coordinated: fetch it)
    extra_loss(routers) -> tensor    added to the training loss (aux_loss) or None
    observe(model, step, routers)    the training forward's router outputs, to balance from when
                                     `refreshed_margins` is False
    refresh(model, step, rerun) -> seconds
                                     when it is True, after the optimizer step: `rerun(solve=None)`
                                     runs a no-grad forward of the step's batch under the updated
                                     weights and returns its router outputs; with `solve` each MoE
                                     layer is solved as the forward reaches it (`layerwise`,
                                     `solve_rounds` alternations on the inputs in hand), or every
                                     layer from each of `solve_rounds` forwards (returns seconds
                                     spent waiting for solves)
    after_step(model, step, loads)   the step's global loads [L, E] (methods without margins)

plus `start()` (after a resume), `state_dict()`/`load_state_dict()` and `metrics()`. What a method
does lives in its balancer (k3.platform.balance.methods); here are only the two ways a job runs
one: `LocalStrategy` steps the balancer on each worker (every worker sees the same global loads,
or there is one worker), `CoordinatedStrategy` sends the margin histograms to the
BalanceCoordinator actor, which solves for all workers (the methods marked `coordinated`).
A bias is never computed from the batch it routes.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .config import BalanceConfig
from .methods import Balancer, balancer_class, make_balancer
from .routing import expert_loads, route


def _bias(model) -> torch.Tensor:
    gates = [layer.mlp.gate for layer in model.model.layers if layer.is_moe]
    return torch.stack([g.bias for g in gates]) if gates else torch.zeros(0, 0)


def check_method(train_cfg, model_cfg) -> None:
    """What the driver checks before any worker starts (ValueError)."""
    if "moe" in model_cfg.mlp_types:
        balancer_class(train_cfg.balance.method).check(train_cfg, model_cfg)


def needs_coordinator(config: BalanceConfig) -> bool:
    return balancer_class(config.method).coordinated


class BalanceStrategy:
    def __init__(self, config: BalanceConfig, device: torch.device) -> None:
        self.config, self.device = config, device

    def _alternate(self, layer: int, out, solve) -> torch.Tensor | None:
        """`config.solve_rounds` alternations of QB's solve for one layer on the router inputs in
        hand (layerwise): `solve(layer, r, margins, counts)` returns alternation r's solved bias
        (None: not collected now), and alternation r + 1 re-routes the same scores with it. No
        forward is re-run: a layer's inputs do not depend on its own bias."""
        margins, counts = out.margins, out.counts
        top_k, num_experts = out.expert_ids.shape[1], out.scores.shape[1]
        bias = None
        for r in range(self.config.solve_rounds):
            bias = solve(layer, r, margins, counts)
            if bias is None or r == self.config.solve_rounds - 1:
                break
            margins, idx = route(out.scores.detach().float(), bias.float(), top_k)
            counts = expert_loads(idx, num_experts)
        return bias

    def start(self, model) -> None:
        """After the model is built and any checkpoint loaded, before the first step."""

    def begin_step(self, model) -> float:
        """Set the routers' bias for this step; returns seconds spent waiting for it."""
        return 0.0

    def extra_loss(self, routers) -> torch.Tensor | None:
        return None

    @property
    def refreshed_margins(self) -> bool:
        """Whether `observe` wants the margins of the batch re-run under the updated weights."""
        return False

    def observe(self, model, step: int, routers) -> None:
        """The training forward's router outputs (when `refreshed_margins` is False)."""

    def refresh(self, model, step: int, rerun) -> float:
        """After the optimizer step (when `refreshed_margins` is True): `rerun(solve=None)` runs the
        step's batch under the updated weights and the routers' current bias. Returns seconds
        spent waiting for solves."""
        return 0.0

    def after_step(self, model, step: int, loads: torch.Tensor) -> None:
        """loads [L, E]: tokens per expert over all workers this step."""

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass

    def metrics(self, model) -> dict[str, list[float]]:
        b = _bias(model)
        return {"bias_spread": (b.max(1).values - b.min(1).values).tolist() if b.numel() else []}


class LocalStrategy(BalanceStrategy):
    """The balancer stepped on this worker: from the step's global loads (the same on every rank)
    for methods without margins, from this worker's margins for exact QB (one worker)."""

    def __init__(self, balancer: Balancer, device: torch.device) -> None:
        super().__init__(balancer.config, device)
        self.balancer = balancer

    def start(self, model) -> None:
        # the bias in use is the model's: a release's router bias, or a resumed run's
        self.balancer.set_bias(_bias(model))

    def extra_loss(self, routers) -> torch.Tensor | None:
        if not routers or not self.balancer.adds_loss:
            return None
        return sum(self.balancer.aux_loss(r.scores, r.expert_ids) for r in routers)

    @property
    def refreshed_margins(self) -> bool:
        return self.balancer.needs_margins and self.config.margins_after_step

    def observe(self, model, step: int, routers) -> None:
        if self.balancer.needs_margins:
            self._solve(model, routers)

    def refresh(self, model, step: int, rerun) -> float:
        if self.config.layerwise:  # the layer routes with its new bias before the next is reached
            rerun(lambda layer, out: self._alternate(layer, out, self._solve_layer))
            return 0.0
        for _ in range(self.config.solve_rounds):
            self._solve(model, rerun())
        return 0.0

    def _solve(self, model, routers) -> None:
        for i, out in enumerate(routers):
            self.balancer.observe(i, out.margins, out.counts)
        self.balancer.step()
        model.set_router_bias(self.balancer.bias().to(self.device))

    def _solve_layer(self, layer: int, r: int, margins: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        self.balancer.observe(layer, margins, counts)
        self.balancer.step()
        return self.balancer.bias(layer).to(self.device)

    def after_step(self, model, step: int, loads: torch.Tensor) -> None:
        if self.balancer.needs_margins:
            return
        for i in range(len(loads)):
            self.balancer.observe(i, None, loads[i].long().cpu())
        self.balancer.step()
        model.set_router_bias(self.balancer.bias().to(self.device))

    def state_dict(self) -> dict[str, Any]:
        return self.balancer.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.balancer.load_state_dict(state)


class CoordinatedStrategy(BalanceStrategy):
    """QB through the BalanceCoordinator actor: histograms out once the step's margins are in
    hand, the solved bias collected at the start of the next step."""

    def __init__(self, config: BalanceConfig, device: torch.device, rank: int, coordinator_name: str,
                 num_layers: int) -> None:
        super().__init__(config, device)
        self.rank, self.coordinator_name, self.num_layers = rank, coordinator_name, num_layers
        self.client = None

    def start(self, model) -> None:
        import ray

        from .coordinator import BalanceClient

        self.client = BalanceClient(ray.get_actor(self.coordinator_name), f"rank-{self.rank}")

    def begin_step(self, model) -> float:
        t0 = time.perf_counter()
        model.set_router_bias(self.client.fetch().bias.to(self.device))
        return time.perf_counter() - t0

    @property
    def refreshed_margins(self) -> bool:
        return self.config.margins_after_step

    def observe(self, model, step: int, routers) -> None:
        self._report(step, routers)

    def refresh(self, model, step: int, rerun) -> float:
        # The coordinator numbers solves, config.rounds_per_step(L) per step; the last is collected
        # at the start of the next step, so its round trip overlaps the step's bookkeeping.
        n, waited = self.num_layers, 0.0

        def fetch():
            nonlocal waited
            t0 = time.perf_counter()
            update = self.client.fetch()
            waited += time.perf_counter() - t0
            return update

        R = self.config.solve_rounds
        if not self.config.layerwise:
            for r in range(R):
                if r:  # the previous round's solve, waited for: this forward routes with it
                    model.set_router_bias(fetch().bias.to(self.device))
                self._report(step * R + r, rerun())
            return waited

        def solve(layer: int, r: int, margins: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
            self.client.report((step * n + layer) * R + r, self.client.histogram(layer, margins)[None], counts[None])
            # the last layer's last solve routes nothing in this forward: collected later
            return None if layer == n - 1 and r == R - 1 else fetch().bias[layer].to(self.device)

        rerun(lambda layer, out: self._alternate(layer, out, solve))
        return waited

    def _report(self, round_: int, routers) -> None:
        hist = torch.stack([self.client.histogram(i, out.margins) for i, out in enumerate(routers)])
        self.client.report(round_, hist, torch.stack([out.counts for out in routers]))

    def state_dict(self) -> dict[str, Any] | None:
        import ray

        if self.rank != 0:
            return None
        return ray.get(ray.get_actor(self.coordinator_name).state_dict.remote())

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        import ray

        if self.rank == 0 and state is not None:  # the coordinator back to the checkpoint's step
            ray.get(ray.get_actor(self.coordinator_name).load_state_dict.remote(state))


def make_strategy(config: BalanceConfig, num_layers: int, num_experts: int, top_k: int, device: torch.device,
                  rank: int = 0, coordinator_name: str | None = None) -> BalanceStrategy:
    """The strategy a training worker runs for `config.method` over `num_layers` MoE layers (a
    model without MoE layers balances nothing)."""
    if num_layers == 0:
        return BalanceStrategy(config, device)
    if balancer_class(config.method).coordinated:
        if coordinator_name is None:
            raise ValueError(f"balance method {config.method!r} runs through the BalanceCoordinator: "
                             "coordinator_name is required")
        return CoordinatedStrategy(config, device, rank, coordinator_name, num_layers)
    return LocalStrategy(make_balancer(config, num_layers, num_experts, top_k), device)
