"""Training and serving plans of one model on one cluster (`make_plan`)."""
from __future__ import annotations

from dataclasses import dataclass

from k3.model.config import K3Config

from .hardware import GPU, get_gpu
from .serving import ServePlan, plan_serving
from .training import PRECISIONS, Counts, TrainPlan, TrainSetup, best_plan, pinned_text


MAX_GPUS = 2**20  # a million GPUs: beyond any cluster planned today
MIN_UTILISATION = 0.01  # below 1% of the bf16 peak the times printed mean nothing


@dataclass
class Plan:
    preset: str
    cfg: K3Config
    gpu: GPU
    gpus: int
    context: int
    utilisation: float
    counts: Counts
    setup: TrainSetup
    train: TrainPlan | None  # the chosen layout; None when nothing fits
    considered: list[TrainPlan]  # every layout, best first
    serve: ServePlan | None
    serve_error: str | None


def count(cfg: K3Config) -> Counts:
    """Dense (vision included), routed-expert and active parameter counts of cfg (meta device)."""
    from k3.model.params import count_parameters, count_vision_parameters

    c = count_parameters(cfg)
    v = count_vision_parameters(cfg)
    return Counts(dense=c.total - c.routed_experts + (v.total if v else 0), experts=c.routed_experts, active=c.active)


def cpu_run_setup(cfg: K3Config, context: int, micro_batch: int, checkpointing: bool) -> TrainSetup:
    """The setup of a k3 training run on CPU as the benchmarks measure one (fp32, the CPU KDA
    kernel, ZeRO-1): what jobs/bench_plan.py and jobs/bench_long_context.py check their measured
    memory and bytes against. The GPU only fills the setup's device slot: neither memory nor bytes
    depend on it."""
    return TrainSetup(cfg, count(cfg), get_gpu("h100"), context=context, micro_batch=micro_batch, zero_stage=1,
                      checkpointing=checkpointing, precision=PRECISIONS["fp32"], backend="cpu")


def make_plan(cfg: K3Config, preset: str, context: int, gpus: int, gpu: str, micro_batch: int = 1,
              zero_stage: int | None = None, checkpointing: bool = True, utilisation: float = 0.4,
              expert_format: str = "mxfp4", dp: int | None = None, cp: int | None = None,
              ep: int | None = None) -> Plan:
    """Training and serving plans; ValueError for input no plan can be made of (an unknown GPU, a
    pinned layout that does not exist or does not fit). zero_stage None tries ZeRO-1 and ZeRO-2."""
    hw = get_gpu(gpu)
    if not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"--gpus must be in [1, {MAX_GPUS:,}], got {gpus:,}")
    if not 1 <= context <= cfg.max_position_embeddings:
        raise ValueError(f"--context must be in [1, {cfg.max_position_embeddings:,}] for {preset}, got {context:,}")
    if not MIN_UTILISATION <= utilisation <= 1:  # also refuses nan
        raise ValueError(f"--utilisation must be in [{MIN_UTILISATION}, 1], got {utilisation}")
    counts = count(cfg)
    pinned = {"dp": dp, "cp": cp, "ep": ep}
    best = None
    for stage in ([zero_stage] if zero_stage is not None else [1, 2]):
        setup = TrainSetup(cfg, counts, hw, context, micro_batch, stage, checkpointing, PRECISIONS["bf16"])
        chosen, considered = best_plan(setup, gpus, utilisation, **pinned)
        if best is None or _better(chosen, considered[0], best[1], best[2][0]):
            best = (setup, chosen, considered)
    setup, chosen, considered = best
    if chosen is None and any(v is not None for v in pinned.values()):
        p = considered[0]
        raise ValueError(f"the layout {pinned_text(pinned)} does not fit: {p.layout} needs "
                         f"{p.total_bytes / 2**30:,.1f} GiB per GPU, a {hw.name} has {hw.usable_bytes / 2**30:.1f} "
                         f"GiB usable")
    try:
        serve, serve_error = plan_serving(cfg, counts, hw, gpus, context, expert_format=expert_format,
                                          utilisation=utilisation), None
    except ValueError as e:
        serve, serve_error = None, str(e)
    return Plan(preset, cfg, hw, gpus, context, utilisation, counts, setup, chosen, considered, serve, serve_error)


def _better(chosen: TrainPlan | None, first: TrainPlan, best_chosen: TrainPlan | None, best_first: TrainPlan) -> bool:
    """A fitting plan beats none; between fitting plans the faster per sequence, else the smaller need."""
    if (chosen is None) != (best_chosen is None):
        return chosen is not None
    if chosen is not None:
        return chosen.seconds_per_sequence < best_chosen.seconds_per_sequence
    return first.total_bytes < best_first.total_bytes
