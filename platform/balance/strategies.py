"""Expert balancing in the training job: one strategy object per method.

Each strategy owns its state, its update, its metrics and its checkpoint state; the Trainer
calls the same five hooks whatever the method, so a new method is one class here (plus its name
in `balance.METHODS`, the list the config validates against):

    check(train_cfg, model_cfg)      on the driver, before any worker starts (ValueError)
    begin_step(model) -> seconds     route this step with the bias in hand (QB: fetch it)
    extra_loss(routers) -> tensor    added to the training loss (aux_loss) or None
    observe(model, step, routers, rerun)
                                     QB: the margins to solve from; the Trainer passes those of a
                                     no-grad forward under the updated weights when
                                     `refreshed_margins` is True (and `rerun`, that forward again
                                     under the bias now set, for `solve_rounds` > 1), else the
                                     training forward's
    after_step(model, step, loads)   update the bias for the next step from global loads [L, E]

plus `start()` (after a resume), `state_dict()`/`load_state_dict()` and `metrics()`. A bias is
never computed from the batch it routes.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from k3.platform.balance.quantile import METHODS, BalanceConfig, Balancer, loss_free_update, switch_aux_loss


def _rounds(config: BalanceConfig, rerun) -> int:
    """Solves this step: config.solve_rounds when the margins can be re-run, else one."""
    return config.solve_rounds if rerun is not None else 1


def _bias(model) -> torch.Tensor:
    gates = [layer.mlp.gate for layer in model.model.layers if layer.is_moe]
    return torch.stack([g.bias for g in gates]) if gates else torch.zeros(0, 0)


class BalanceStrategy:
    method: ClassVar[str] = ""
    needs_coordinator: ClassVar[bool] = False

    def __init__(self, config: BalanceConfig, num_layers: int, num_experts: int, k: int, device: torch.device,
                 rank: int = 0, coordinator_name: str | None = None) -> None:
        self.config, self.num_layers, self.num_experts, self.k = config, num_layers, num_experts, k
        self.device, self.rank, self.coordinator_name = device, rank, coordinator_name

    @classmethod
    def check(cls, train_cfg, model_cfg) -> None:
        """Raise ValueError for a run this method cannot do (called on the driver)."""

    def start(self) -> None:
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

    def observe(self, model, step: int, routers, rerun=None) -> None:
        """Router outputs of this step's batch (see `refreshed_margins`); `rerun()` gives them again
        under the routers' current bias (None: the training forward's, which cannot be re-run)."""

    def after_step(self, model, step: int, loads: torch.Tensor) -> None:
        """loads [L, E]: tokens per expert over all workers this step."""

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass

    def metrics(self, model) -> dict[str, list[float]]:
        b = _bias(model)
        return {"bias_spread": (b.max(1).values - b.min(1).values).tolist() if b.numel() else []}


class NoBalance(BalanceStrategy):
    """Plain top-k: the bias stays zero."""

    method = "none"


class AuxLoss(BalanceStrategy):
    """Switch's auxiliary loss on the router (bias stays zero)."""

    method = "aux_loss"

    def extra_loss(self, routers) -> torch.Tensor | None:
        return sum(switch_aux_loss(r.scores, r.topk_idx, self.config.aux_loss_coef) for r in routers)


class LossFree(BalanceStrategy):
    """DeepSeek-V3's sign update from the global loads: the same bias on every rank."""

    method = "loss_free"

    def after_step(self, model, step: int, loads: torch.Tensor) -> None:
        b = _bias(model)
        new = torch.stack([loss_free_update(b[i], loads[i].to(b.device), self.config.loss_free_step)
                           for i in range(len(b))])
        model.set_router_bias(new)


class QuantileExact(BalanceStrategy):
    """Exact QB on one process's margins (one worker only)."""

    method = "quantile"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.balancer = Balancer(self.config, self.num_layers, self.num_experts, self.k)

    @classmethod
    def check(cls, train_cfg, model_cfg) -> None:
        QuantileHist.check(train_cfg, model_cfg)
        if train_cfg.num_workers > 1:
            raise ValueError("balance.method 'quantile' (exact) needs every token's margins in one process; with "
                             "more than one worker use 'quantile_hist' (the coordinator's histogram solve)")

    @property
    def refreshed_margins(self) -> bool:
        return self.config.margins_after_step

    def observe(self, model, step: int, routers, rerun=None) -> None:
        for r in range(_rounds(self.config, rerun)):
            if r:
                routers = rerun()
            for i, out in enumerate(routers):
                self.balancer.observe(i, out.margins, out.counts)
            self.balancer.step()
            model.set_router_bias(self.balancer.bias().to(self.device))

    def state_dict(self) -> dict[str, Any]:
        return self.balancer.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.balancer.load_state_dict(state)


class QuantileHist(BalanceStrategy):
    """QB through the BalanceCoordinator actor: histograms out once the step's margins are in
    hand, the solved bias collected at the start of the next step."""

    method = "quantile_hist"
    needs_coordinator = True

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.client = None

    @classmethod
    def check(cls, train_cfg, model_cfg) -> None:
        if model_cfg.num_experts_per_token >= model_cfg.num_experts:
            raise ValueError("quantile balancing needs num_experts_per_token < num_experts")

    def start(self) -> None:
        import ray

        from k3.platform.balance.coordinator import BalanceClient

        self.client = BalanceClient(ray.get_actor(self.coordinator_name), f"rank-{self.rank}")

    def begin_step(self, model) -> float:
        import time

        t0 = time.perf_counter()
        model.set_router_bias(self.client.fetch().bias.to(self.device))
        return time.perf_counter() - t0

    @property
    def refreshed_margins(self) -> bool:
        return self.config.margins_after_step

    def observe(self, model, step: int, routers, rerun=None) -> None:
        rounds = _rounds(self.config, rerun)
        for r in range(rounds):
            if r:  # the previous round's solve, waited for: the next forward routes with it
                model.set_router_bias(self.client.fetch().bias.to(self.device))
                routers = rerun()
            hist = torch.stack([self.client.histogram(i, out.margins) for i, out in enumerate(routers)])
            counts = torch.stack([out.counts for out in routers])
            # the coordinator numbers solves, `solve_rounds` per step; the last is collected at the
            # start of the next step, so its round trip overlaps the step's bookkeeping
            self.client.report(step * self.config.solve_rounds + r, hist, counts)

    def state_dict(self) -> dict[str, Any] | None:
        import ray

        if self.rank != 0:
            return None
        return ray.get(ray.get_actor(self.coordinator_name).state_dict.remote())

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        import ray

        if self.rank == 0 and state is not None:  # the coordinator back to the checkpoint's step
            ray.get(ray.get_actor(self.coordinator_name).load_state_dict.remote(state))


STRATEGIES: dict[str, type[BalanceStrategy]] = {
    c.method: c for c in (QuantileHist, QuantileExact, LossFree, AuxLoss, NoBalance)}
if set(STRATEGIES) != set(METHODS):
    raise RuntimeError(f"balance methods {sorted(METHODS)} and strategies {sorted(STRATEGIES)} differ")


def strategy_class(method: str) -> type[BalanceStrategy]:
    if method not in STRATEGIES:
        raise ValueError(f"balance method {method!r} is not one of {sorted(STRATEGIES)}")
    return STRATEGIES[method]
