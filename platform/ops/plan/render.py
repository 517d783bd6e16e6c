"""A plan as text (one line per quantity, each with the reason for its number) or as JSON."""
from __future__ import annotations

from . import activations as act
from .planner import Plan
from .training import TrainPlan, activation_parts, last_rank_reach

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB"


def _size(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:,.0f}"


def header(p: Plan) -> list[str]:
    c, g = p.counts, p.gpu
    return [f"k3 plan: {p.preset} ({_size(c.dense + c.experts)} parameters: {_size(c.dense)} dense incl. vision, "
            f"{_size(c.experts)} routed experts; {_size(c.active)} active per token), context {p.context:,} tokens, "
            f"{p.gpus} x {g.name}",
            f"  assumed per GPU: {gib(g.memory_bytes)} of which {gib(g.usable_bytes)} usable, "
            f"{g.bf16_flops / 1e12:,.0f} TFLOP/s bf16 dense at {p.utilisation:.0%}, NVLink {g.nvlink_bytes_s / 1e9:,.0f} "
            f"GB/s inside {g.gpus_per_node}-GPU nodes, network {g.network_bytes_s / 1e9:,.0f} GB/s between them "
            f"(one direction; {g.source})"]


def memory_lines(p: Plan, t: TrainPlan) -> list[str]:
    s, c, pr, l = p.setup, p.counts, p.setup.precision, t.layout
    W, local = l.world, c.experts // l.ep
    a = activation_parts(s, l)
    per_tok = sum(a.values()) / t.tokens_per_gpu
    grad_dense = f"{_size(c.dense)} x {pr.grad} B" + (f" / {W} (ZeRO-2)" if s.zero_stage == 2 else " (ZeRO-1 keeps all)")
    return [
        f"  {'weights':<13}{gib(t.memory['weights']):>13}   dense {_size(c.dense)} x {pr.weight} B on every rank "
        f"+ experts {_size(c.experts)} / EP {l.ep} x {pr.weight} B",
        f"  {'gradients':<13}{gib(t.memory['gradients']):>13}   dense {grad_dense} + local experts {_size(local)} x "
        f"{pr.grad} B",
        f"  {'optimizer':<13}{gib(t.memory['optimizer']):>13}   ZeRO: dense {_size(c.dense)} x {pr.zero_fp32 + pr.moments}"
        f" B (fp32 master + grad partition + Adam moments) / world {W}; experts' AdamW {_size(local)} x "
        f"{pr.expert_moments} B, not sharded",
        f"  {'activations':<13}{gib(t.memory['activations']):>13}   {t.tokens_per_gpu:,} tokens ({s.micro_batch} x "
        f"{s.context:,} / CP {l.cp}) x {per_tok / 2**20:,.2f} MiB: residual path {gib(a['residual_path'])} "
        f"(Block AttnRes statistics in fp32 and the partial sums; the mixing is recomputed in backward), "
        f"sub-layers {gib(a['sublayers'])}, MLA keys over earlier CP shards {gib(a['mla_reach'])}, "
        f"loss {gib(a['loss'])} (the head's input; logits a chunk of rows at a time over {p.cfg.vocab_size:,}, "
        f"recomputed in backward), backward transient {gib(a['transient'])}",
        f"  {'total':<13}{gib(t.total_bytes):>13}   {'fits' if t.fits else 'does NOT fit'} in {gib(p.gpu.usable_bytes)}",
    ]


def traffic_lines(p: Plan, t: TrainPlan) -> list[str]:
    l, cfg = t.layout, p.cfg
    bins = p.setup.qb_bins
    tr, sec = t.traffic, t.seconds

    def line(name: str, key: str, why: str) -> str:
        when = f"{sec[key]:8.2f} s" if key in sec else " " * 10
        return f"  {name:<19}{tr[key] / 1e9:>10,.2f} GB {when}   {why}"

    return [
        "  bytes each GPU sends per step, and the time at the assumed link:",
        line("all-to-all", "all_to_all", f"{cfg.mlp_types.count('moe')} MoE layers x {t.tokens_per_gpu:,} tokens x "
             f"top-{cfg.num_experts_per_token} x {(l.ep - 1) / l.ep:.3f} leaving the rank x latent "
             f"{cfg.moe_latent_size or cfg.hidden_size} x out and back x forward, backward"
             f"{', recompute' if p.setup.checkpointing else ''}"),
        line("CP exchange", "cp_exchange", f"CP {l.cp}: per KDA layer the shards' (h_ext, M) fp32 states, per MLA "
             f"layer the shards' latents ({cfg.mla_latent_dim} per token), all-gathered in each pass"),
        line("grad reduction", "grad_reduction", f"dense gradients reduce-scattered and parameters all-gathered over "
             f"{l.world}; expert gradients all-reduced over their {l.world // l.ep} replicas"),
        f"  {'QB histograms':<19}{tr['qb_histograms'] / 1e9:>10,.3f} GB {'':10}   {cfg.mlp_types.count('moe')} layers x "
        f"{cfg.num_experts} experts x {bins} int32 bins (+ counts, bias back); the coordinator receives "
        f"{l.world} x this = {tr['qb_histograms'] * l.world / 1e9:,.1f} GB per step",
        f"  {'compute':<19}{'':>13} {sec['compute']:8.2f} s   {'4' if p.setup.checkpointing else '3'} forward-passes"
        f" of FLOPs (forward, backward x 2{', recompute' if p.setup.checkpointing else ''}) at "
        f"{p.utilisation:.0%} of peak",
    ]


def training_lines(p: Plan) -> list[str]:
    s = p.setup
    t = p.train or p.considered[0]
    head = (f"Training: {t.layout}, ZeRO-{s.zero_stage}, "
            f"{'activation checkpointing' if s.checkpointing else 'no activation checkpointing'}, "
            f"{s.precision.name}, {s.micro_batch} sequence(s) per DP rank")
    out = [head if p.train else head + "  (the smallest of every layout: none fits)"]
    out += memory_lines(p, t) + traffic_lines(p, t)
    if p.train is None:
        out.append(verdict(p, t))
    return out


def verdict(p: Plan, t: TrainPlan) -> str:
    """Why nothing fits: the parts that do not shrink with more GPUs, against the usable memory."""
    c, pr = p.counts, p.setup.precision
    dense = c.dense * pr.weight
    kept = act.residuals(p.cfg, pr.weight, p.setup.checkpointing)
    text = (f"  verdict: no DP x CP x EP layout of {p.gpus} x {p.gpu.name} fits. Every rank holds all {_size(c.dense)} "
            f"dense parameters ({gib(dense)} of weights alone; ZeRO-1/2 shard only optimizer states and gradients) "
            f"and EP is at most gcd(GPUs, {p.cfg.num_experts} experts); the residual path keeps "
            f"{kept / 2**20:,.1f} MiB per token outside the checkpoints.")
    reach = last_rank_reach(p.setup, t.layout)
    if t.layout.cp > 1 and p.cfg.layer_types.count("mla"):
        span, peak = reach * act.mla_key_span(p.cfg, pr.weight), reach * act.mla_key_span_peak(p.cfg, pr.weight)
        text += (f" The last CP rank's MLA reads the latents of all {reach:,} earlier positions, expanding keys "
                 f"and values a slice at a time (model/mla_span.py): {gib(span)} per MLA layer, {gib(peak)} in its "
                 f"backward, which more CP does not divide.")
    return text


def serving_lines(p: Plan) -> list[str]:
    if p.serve is None:
        return ["Serving:", f"  {p.serve_error}"]
    v = p.serve
    return [
        f"Serving: replicas of {v.replica_gpus} GPUs ({v.replicas} of them), TP {v.tp} for the dense weights, "
        f"experts over the replica, bf16 cache (fp32 KDA state)",
        f"  {'bytes/sequence':<19}{gib(v.kda_state_per_sequence + v.mla_latents_per_sequence):>13}   at "
        f"{p.context:,} tokens: KDA state {v.kda_state_per_sequence / 2**20:,.1f} MiB (fixed: "
        f"{p.cfg.layer_types.count('kda')} layers x {p.cfg.kda_num_heads} heads x {p.cfg.kda_head_dim}^2 fp32 + conv) + "
        f"MLA latents {gib(v.mla_latents_per_sequence)} ({p.cfg.layer_types.count('mla')} layers x "
        f"{p.cfg.mla_latent_dim} x 2 B per token)",
        f"  {'weights/GPU':<19}{gib(v.weights_per_gpu):>13}   dense x 2 B / TP {v.tp} + experts / {v.replica_gpus} in "
        f"the release's MXFP4",
        f"  {'prefill workspace':<19}{gib(v.workspace_per_gpu):>13}   one 8,192-token chunk through the widest "
        f"sub-layer + the sliced MLA scores, / TP",
        f"  {'sequences/GPU':<19}{v.sequences_per_gpu:>13.2f}   {v.sequences_per_tp_group} per TP group of {v.tp} "
        f"(each rank holds every latent of its group's sequences and 1/{v.tp} of their KDA state: "
        f"{gib(v.cache_per_sequence_per_gpu)} per sequence per GPU)",
        f"  {'prefill time':<19}{v.prefill_seconds:>11.1f} s   {v.prefill_flops:.3g} FLOPs for one {p.context:,}-token "
        f"prompt (MLA attention over the causal prefix included) on the replica's {v.replica_gpus} GPUs at "
        f"{p.utilisation:.0%} of peak",
    ]


def render(p: Plan) -> str:
    return "\n".join(header(p) + [""] + training_lines(p) + [""] + serving_lines(p))


def as_json(p: Plan) -> dict:
    return {"preset": p.preset, "context": p.context, "gpus": p.gpus, "gpu": p.gpu.as_dict(),
            "utilisation": p.utilisation, "counts": vars(p.counts),
            "training": {"fits": p.train is not None, "zero_stage": p.setup.zero_stage,
                         "checkpointing": p.setup.checkpointing, "precision": p.setup.precision.name,
                         "micro_batch": p.setup.micro_batch,
                         "plan": (p.train or p.considered[0]).as_dict(),
                         "activations": activation_parts(p.setup, (p.train or p.considered[0]).layout)},
            "serving": p.serve.as_dict() if p.serve else {"error": p.serve_error}}
