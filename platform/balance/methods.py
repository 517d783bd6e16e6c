"""One balancer class per `--balance` method: the bias of every MoE layer and its update.

A balancer holds a bias [E] per MoE layer and updates it once per step:

    bal = make_balancer(BalanceConfig(method="quantile_hist"), num_layers, num_experts, k)
    route each layer with bal.bias(layer); bal.observe(layer, margins, counts) per micro-batch
    (or bal.observe_scores(layer, scores)); then bal.step()

Biases solved in `step()` are what `bias()` returns afterwards: a batch is never routed with a
bias computed from itself. This is the whole method in one process (the training job's strategies
in k3.platform.balance.strategies drive these; the distributed histogram solve runs the same
`hist_step` in the coordinator). Adding a method is one class here plus its name in
`config.METHODS`.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from k3.kernels.qb_histogram import qb_histogram

from .config import METHODS, BalanceConfig
from .quantile import HistLayerState, blend, exact_thresholds, fine_window, hist_step
from .routing import (centred, check_layers, expert_loads, loss_free_update, max_violation, quantile_target, route,
                      switch_aux_loss)


class Balancer:
    """The bias of every MoE layer under one method; subclasses differ in `_solve` and what they keep."""

    method: ClassVar[str] = ""
    needs_margins: ClassVar[bool] = False  # observe() must be given the margins
    adds_loss: ClassVar[bool] = False  # aux_loss() is more than zero
    coordinated: ClassVar[bool] = False  # in a training job the solve runs in the BalanceCoordinator actor

    def __init__(self, config: BalanceConfig, num_layers: int, num_experts: int, top_k: int) -> None:
        if config.method != self.method:
            raise ValueError(f"{type(self).__name__} balances with method {self.method!r}, the config says "
                             f"{config.method!r} (use make_balancer)")
        check_layers(num_layers, num_experts, top_k)
        self.config, self.num_layers, self.num_experts, self.top_k = config, num_layers, num_experts, top_k
        self.steps = 0
        self._bias = torch.zeros(num_layers, num_experts)  # [L, E] in use now
        self._loads: dict[int, torch.Tensor] = {}  # tokens per expert observed this step, per layer

    @classmethod
    def check(cls, train_cfg, model_cfg) -> None:
        """Raise ValueError for a training run this method cannot do (on the driver, before workers start)."""

    # -- what the router uses
    def bias(self, layer: int | None = None) -> torch.Tensor:
        """[L, E], or [E] for one layer: the bias to route the current batch with (a copy)."""
        return self._bias.clone() if layer is None else self._bias[self._layer(layer)].clone()

    def set_bias(self, bias: torch.Tensor) -> None:
        """Take `bias` [L, E] as the one in use (e.g. what a loaded model routes with)."""
        if tuple(bias.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"bias must be [L={self.num_layers}, E={self.num_experts}], got {tuple(bias.shape)}")
        self._bias = bias.detach().float().cpu().clone()

    # -- per micro-batch
    def observe_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Route scores [N, E] with the current bias, observe them; returns expert_ids [N, top_k]."""
        margins, expert_ids = route(scores, self._bias[self._layer(layer)], self.top_k)
        self.observe(layer, margins, expert_loads(expert_ids, self.num_experts))
        return expert_ids

    def observe(self, layer: int, margins: torch.Tensor | None, counts: torch.Tensor) -> None:
        """margins [N, E] (from routing with `bias(layer)`; only the QB methods read them), counts [E]."""
        layer = self._layer(layer)
        if counts.shape != (self.num_experts,):
            raise ValueError(f"counts must be [E={self.num_experts}], got {tuple(counts.shape)}")
        if self.needs_margins:
            if margins is None or margins.dim() != 2 or margins.shape[1] != self.num_experts:
                shape = None if margins is None else tuple(margins.shape)
                raise ValueError(f"margins must be [N, E={self.num_experts}], got {shape}")
            self._observe_margins(layer, margins.detach())
        counts = counts.detach().long()
        self._loads[layer] = counts if layer not in self._loads else self._loads[layer] + counts

    def _observe_margins(self, layer: int, margins: torch.Tensor) -> None:
        """Keep what the solve needs of one micro-batch's margins."""

    def aux_loss(self, probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """What this method adds to the training loss (zero but for aux_loss)."""
        return probs.new_zeros(())

    # -- end of step
    def step(self) -> dict[int, dict[str, Any]]:
        """Solve every observed layer; the results route the next batch. Returns per-layer info."""
        infos: dict[int, dict[str, Any]] = {}
        for layer, loads in sorted(self._loads.items()):
            info: dict[str, Any] = {}
            if int(loads.sum()) > 0:
                info["maxvio"] = max_violation(loads)
                info["loads"] = loads
            self._bias[layer] = self._solve(layer, loads, info)
            info["bias_spread"] = float(self._bias[layer].max() - self._bias[layer].min())
            infos[layer] = info
        self._loads.clear()
        self.steps += 1
        return infos

    def _solve(self, layer: int, loads: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
        """The layer's bias for the next step (adds what it measured to `info`)."""
        return self._bias[layer]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return layer

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.model_dump(), "steps": self.steps, "bias": self._bias.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        bias = state["bias"]
        if tuple(bias.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"state is for bias {tuple(bias.shape)}, this balancer has "
                             f"[{self.num_layers}, {self.num_experts}]")
        self.steps = int(state["steps"])
        self._bias = bias.clone().float()
        self._loads.clear()


class NoBalance(Balancer):
    """Plain top-k: the bias stays zero."""

    method = "none"


class AuxLoss(Balancer):
    """Switch's auxiliary loss on the router probabilities; the bias stays zero."""

    method = "aux_loss"
    adds_loss = True

    def aux_loss(self, probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return switch_aux_loss(probs, expert_ids, self.config.aux_loss_coef)


class LossFree(Balancer):
    """DeepSeek-V3's auxiliary-loss-free sign update from the step's loads."""

    method = "loss_free"

    def _solve(self, layer: int, loads: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
        return loss_free_update(self._bias[layer], loads, self.config.loss_free_step)


class _QuantileBase(Balancer):
    needs_margins = True

    @classmethod
    def check(cls, train_cfg, model_cfg) -> None:
        if model_cfg.num_experts_per_token >= model_cfg.num_experts:
            raise ValueError("quantile balancing needs num_experts_per_token < num_experts")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._margins: dict[int, list[torch.Tensor]] = {}

    def _all_margins(self, layer: int) -> torch.Tensor:
        parts = self._margins.pop(layer)
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class QuantileExact(_QuantileBase):
    """Exact QB on one process's margins."""

    method = "quantile"

    @classmethod
    def check(cls, train_cfg, model_cfg) -> None:
        super().check(train_cfg, model_cfg)
        if train_cfg.num_workers > 1:
            raise ValueError("balance.method 'quantile' (exact) needs every token's margins in one process; with "
                             "more than one worker use 'quantile_hist' (the coordinator's histogram solve)")

    def _observe_margins(self, layer: int, margins: torch.Tensor) -> None:
        self._margins.setdefault(layer, []).append(margins)

    def _solve(self, layer: int, loads: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
        margins = self._all_margins(layer)
        q = quantile_target(margins.shape[0], self.top_k, self.num_experts)
        thresholds = exact_thresholds(margins, q)
        bias, gain = blend(self.config, self._bias[layer], centred(-thresholds).float(), loads, q, self.top_k)
        info.update(q=q, thresholds=thresholds, gain=gain)
        return bias


class QuantileHist(_QuantileBase):
    """QB from margin histograms over a window around each expert's selection boundary (in a
    training job the same `hist_step` runs in the BalanceCoordinator over every worker's histograms)."""

    method = "quantile_hist"
    coordinated = True

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.hist_states = [HistLayerState.initial(self.config, self.num_experts) for _ in range(self.num_layers)]
        self._hist: dict[int, torch.Tensor] = {}

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The histogram window (lo [E], hi [E]) of the current step."""
        s = self.hist_states[self._layer(layer)]
        return s.lo.clone(), s.hi.clone()

    def _observe_margins(self, layer: int, margins: torch.Tensor) -> None:
        s = self.hist_states[layer]
        h = qb_histogram(margins, s.lo, s.hi, self.config.bins)
        self._hist[layer] = h if layer not in self._hist else self._hist[layer] + h
        if self.config.fine_pass:
            self._margins.setdefault(layer, []).append(margins)

    def _solve(self, layer: int, loads: torch.Tensor, info: dict[str, Any]) -> torch.Tensor:
        state, hist = self.hist_states[layer], self._hist.pop(layer)
        fine = None
        if self.config.fine_pass:
            margins = self._all_margins(layer)
            q = quantile_target(margins.shape[0], self.top_k, self.num_experts)
            lo_f, hi_f = fine_window(hist, state.lo, state.hi, q)
            fine = (qb_histogram(margins, lo_f, hi_f, self.config.bins), lo_f, hi_f)
        new_state, step_info = hist_step(self.config, state, hist, loads, self.top_k, fine)
        info.update(step_info)
        info["bin_width"] = float(((state.hi - state.lo) / self.config.bins).max())
        self.hist_states[layer] = new_state
        return new_state.bias

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "hist": [(s.bias.clone(), s.lo.clone(), s.hi.clone(), s.halfwidth) for s in self.hist_states]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("hist", ())) != self.num_layers:
            raise ValueError(f"state has {len(state.get('hist', ()))} layers' histogram windows, this balancer has "
                             f"{self.num_layers} layers")
        super().load_state_dict(state)
        self.hist_states = [HistLayerState(b.clone(), lo.clone(), hi.clone(), float(w)) for b, lo, hi, w in state["hist"]]
        self._hist.clear()


BALANCERS: dict[str, type[Balancer]] = {c.method: c for c in (QuantileHist, QuantileExact, LossFree, AuxLoss, NoBalance)}
if set(BALANCERS) != set(METHODS):
    raise RuntimeError(f"balance methods {sorted(METHODS)} and balancer classes {sorted(BALANCERS)} differ")


def balancer_class(method: str) -> type[Balancer]:
    if method not in BALANCERS:
        raise ValueError(f"balance method {method!r} is not one of {sorted(BALANCERS)}")
    return BALANCERS[method]


def make_balancer(config: BalanceConfig, num_layers: int, num_experts: int, top_k: int) -> Balancer:
    """The balancer of `config.method` over `num_layers` MoE layers of `num_experts` experts, top-k."""
    return balancer_class(config.method)(config, num_layers, num_experts, top_k)
