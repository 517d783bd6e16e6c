"""BalanceConfig: how a model balances its routed experts (the `--balance` knobs of training)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

METHODS = ("quantile", "quantile_hist", "loss_free", "aux_loss", "none")


class BalanceConfig(BaseModel):
    """How a model balances its routed experts. Loadable from YAML/JSON (`BalanceConfig(**d)`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)  # no "2" for 2

    method: Literal[METHODS] = Field(
        "quantile_hist",
        description="quantile: exact QB on one process's margins; quantile_hist: QB from margin "
        "histograms (what the distributed coordinator runs); loss_free: DeepSeek-V3 sign update of "
        "the bias; aux_loss: Switch auxiliary loss added to the training loss (bias stays zero); "
        "none: plain top-k.",
    )
    bins: int = Field(256, ge=2, description="quantile_hist: bins per expert in each margin histogram.")
    range_policy: Literal["follow", "fixed"] = Field(
        "follow",
        description="quantile_hist: 'follow' gives expert e the window -b_e +- w (its current selection "
        "boundary), w per layer adapted to how far the thresholds moved; 'fixed' uses fixed_range for all.",
    )
    fixed_range: tuple[float, float] = Field((-1.0, 1.0), strict=False, description="quantile_hist, range_policy='fixed': [lo, hi) of every histogram.")
    init_halfwidth: float = Field(1.0, gt=0, description="'follow': first half-width w; 1.0 covers every margin of sigmoid scores at b = 0.")
    min_halfwidth: float = Field(1e-4, gt=0, description="'follow': w never shrinks below this.")
    max_halfwidth: float = Field(4.0, gt=0, description="'follow': w never grows beyond this.")
    fine_pass: bool = Field(
        False,
        description="quantile_hist: bin the margins a second time inside the bin each threshold fell "
        "in (same bin count), dividing the error by `bins`. Single-process Balancer only for now.",
    )
    gain: Literal["one", "adaptive"] = Field(
        "one",
        description="QB update b <- b + g (b_solve - b). 'one' (g = 1) is the algorithm of DESIGN.md. "
        "'adaptive' sets g = clip(1 - 1/z2, min_gain, 1), z2 = mean over experts of "
        "(load - q)^2 / (q (1 - k/E)) on the batch just seen: g is 1 while loads are far off and "
        "drops once they are within sampling noise, which averages the solve over batches.",
    )
    min_gain: float = Field(0.1, gt=0, le=1, description="gain='adaptive': lower bound of g.")
    margins_after_step: bool = Field(
        True,
        description="quantile/quantile_hist in the training job: solve from the margins of a no-grad forward of "
        "the step's batch under the weights the optimizer step just produced (one extra forward per step), not "
        "from the training forward's. The bias is then solved for the router (and router inputs) that will use "
        "it; at high learning rates the deep layers' routers move more per step than their tokens differ, and "
        "a bias solved for the previous weights lets them collapse (docs/benchmarks.md, 'Quantile Balancing in "
        "the training job').",
    )
    layerwise: bool = Field(
        True,
        description="quantile/quantile_hist in the training job, with margins_after_step (without it the default "
        "is False, the only value that means anything there): the after-step forward "
        "solves each MoE layer as it reaches it and routes that layer with its new bias before going on, so each "
        "layer's bias is solved for the router inputs the new biases below it give (one forward; with the "
        "coordinator, one histogram round trip per layer and alternation, each a few ms). A layer's router "
        "input depends on how the layers below it route: solved all at once from one forward, the deep layers' "
        "biases are solved for inputs they will not see. False: every layer is solved from the same forward.",
    )
    solve_rounds: int = Field(
        2, ge=1, le=8,
        description="quantile/quantile_hist in the training job, with margins_after_step (without it the default "
        "is 1): alternations of QB's solve per step. Layerwise, each layer's scores in hand are re-routed with "
        "the bias just solved and solved again, solve_rounds times, before the forward goes on (no extra "
        "forward; with the coordinator, one more round trip per layer each). Otherwise each round routes the "
        "whole batch again under the biases the round before solved: one more no-grad forward each. A token's "
        "margins are measured from its (k+1)-th biased score, so a solve moves the margins it was solved from; "
        "the second alternation re-solves under the first's routing and keeps deep layers balanced at high "
        "learning rates (docs/benchmarks.md, 'Solving layer by layer').",
    )
    loss_free_step: float = Field(1e-3, gt=0, description="loss_free: step size of b += step * sign(mean load - load).")
    aux_loss_coef: float = Field(1e-2, ge=0, description="aux_loss: coefficient of the Switch load-balancing loss.")

    @model_validator(mode="before")
    @classmethod
    def _training_forward_defaults(cls, data):
        # Solving from the training forward's margins is one solve of every layer per step: the
        # after-step settings default to what that is, and are refused below only when given.
        if isinstance(data, dict) and data.get("margins_after_step") is False:
            data = {"layerwise": False, "solve_rounds": 1, **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> "BalanceConfig":
        lo, hi = self.fixed_range
        if not lo < hi:
            raise ValueError(f"fixed_range must have lo < hi, got {self.fixed_range}")
        if self.min_halfwidth > self.max_halfwidth:
            raise ValueError(f"min_halfwidth {self.min_halfwidth} > max_halfwidth {self.max_halfwidth}")
        if not self.margins_after_step and self.method in ("quantile", "quantile_hist"):
            if self.solve_rounds > 1:
                raise ValueError(f"solve_rounds={self.solve_rounds} re-solves from the after-step forward: it needs "
                                 "margins_after_step=True (or solve_rounds=1)")
            if self.layerwise:
                raise ValueError("layerwise=True solves each layer inside the after-step forward: it needs "
                                 "margins_after_step=True (or layerwise=False)")
        return self

    def rounds_per_step(self, num_layers: int) -> int:
        """Solves per training step in the after-step forward(s): every layer at once per round, or
        (layerwise) one per layer and alternation. The coordinator numbers them step * this + round."""
        return self.solve_rounds * (num_layers if self.layerwise else 1)
