"""k3 against transformers on the same Kimi Linear weights, side by side in this process, as JSON.

    python jobs/bench_vs_transformers.py [--only decode,train] [--repeats 3] [--threads 1] [--engines default,eager]

Two Kimi-Linear-shaped models, built by transformers (random weights, seed 0), saved, and
imported into k3 with `load_kimi_linear`:
- `kimi8`: 8 layers (KDA KDA KDA MLA) x 2, hidden 256, 8 experts top-2, 1 shared, 11M parameters;
- `kimi4`: 4 layers (KDA KDA KDA MLA), hidden 256, 16 experts top-4, 9M parameters.

decode: k3's engines (`default`: the default `EngineConfig`, on CPU its decode graphs compiled
when the engine starts, outside the timing; `compiled`: `compile_decode=True` whatever
K3_COMPILE_DECODE says; `eager`: `compile_decode=False`; a fresh engine per repeat, warmed up)
against transformers' `generate`, 128-token prompts and 64 greedy tokens at 1 and 8 sequences,
prefill included on every side; the repeats interleave the sides and the best of each is kept;
tokens compared. `floor` is the shortest time k3's run could take here, its work at
this machine's best rates (`decode_floor`: the prefill's counted FLOPs at the matmul rate, each
decode step's weight, expert and cache bytes at the best read rate, from memory or from the cache
for a step's bytes, or its FLOPs, whichever is longer; rates measured in the same run),
`max_speedup` transformers' time over it, and each engine's `fraction_of_floor` how close it came.
train: one training step on the same batch (forward, loss, backward, AdamW step) of transformers'
model against k3's model (the same AdamW), and against k3's `Trainer.train_step` (DeepSpeed ZeRO-1,
the experts' own AdamW, one global clip; world size 1, no balancing), first-step losses compared.
Each side's step is also counted in floating-point operations (torch's FlopCounterMode: matmuls,
attention, convolutions, a convolution's backward by its groups) and set against this machine's own
matmul rate, measured in the same run on the step's largest shapes: `floor_s` is the time the
step's counted arithmetic takes at that rate, so `max_speedup` (transformers' measured step over
k3's floor) bounds what any k3 step could reach here. `--profile` adds k3 Trainer's step by op
(torch.profiler, self CPU time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from k3.model.hf_kimi import kimi_linear_torch_only, load_kimi_linear


kimi_linear_torch_only()  # transformers' own torch path (never fla's GPU kernels)
import transformers  # noqa: E402

from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

COMMON = dict(vocab_size=4096, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, linear_head_dim=64,
              linear_num_heads=4, linear_conv_kernel_dim=4, n_shared_experts=1, routed_scaling_factor=2.446,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    "kimi8": dict(COMMON, num_hidden_layers=8, intermediate_size=512, moe_intermediate_size=128, kv_lora_rank=64,
                  qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2),
    "kimi4": dict(COMMON, num_hidden_layers=4, intermediate_size=768, moe_intermediate_size=128, kv_lora_rank=128,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"]),
}


def build(name: str, d: str):
    """(transformers model, its checkpoint directory) for MODELS[name], seed 0."""
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**MODELS[name]))
    path = os.path.join(d, name)
    hf.save_pretrained(path)
    return hf, path


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


PROMPT_LEN = 128  # decode: tokens per prompt
ENGINES = {"default": EngineConfig, "compiled": lambda: EngineConfig(compile_decode=True),
           "eager": lambda: EngineConfig(compile_decode=False)}


def decode(name: str, path: str, hf, batches: list[int], new: int, repeats: int, gen: torch.Generator,
           engines: list[str]) -> dict:
    """k3's engines vs generate: best of `repeats` interleaved runs per batch size."""
    hf.eval()
    ours = load_kimi_linear(path).eval()
    out: dict = {}
    for batch in batches:
        prompts = [torch.randint(3, 4096, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
        ids = torch.tensor(prompts)
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

        def run_hf():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[:, PROMPT_LEN:].tolist()

        def run_k3(eng):
            return [o.token_ids for o in eng.generate(prompts, sp)]

        with torch.no_grad():
            hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        hf_times: list[float] = []
        k3_times: dict[str, list[float]] = {e: [] for e in engines}
        same: dict[str, list[int]] = {e: [] for e in engines}
        for _ in range(repeats):
            dt, want = timed(run_hf)
            hf_times.append(dt)
            for e in engines:
                eng = LLMEngine(ours, ENGINES[e]())
                eng.generate([p[:8] for p in prompts], SamplingParams(max_tokens=2, temperature=0))  # warm-up
                dt, got = timed(lambda: run_k3(eng))
                k3_times[e].append(dt)
                same[e].append(sum(g == w for g, w in zip(got, want)))
        hf_s = min(hf_times)
        floor = decode_floor(ours, prompts, new)
        floor["max_speedup"] = round(hf_s / floor["floor_s"], 2)
        out[str(batch)] = {"transformers_s": round(hf_s, 3), "transformers_tokens_per_s": round(batch * new / hf_s, 1),
                           "floor": floor}
        for e in engines:
            k3_s = min(k3_times[e])
            out[str(batch)][e] = {"k3_s": round(k3_s, 3), "k3_tokens_per_s": round(batch * new / k3_s, 1),
                                  "speedup": round(hf_s / k3_s, 2), "sequences_identical": f"{min(same[e])}/{batch}",
                                  "fraction_of_floor": round(floor["floor_s"] / k3_s, 3)}
    return out


def stream_rate(nbytes: int = 1 << 28, seconds: float = 0.5) -> float:
    """Best bytes/s this process reads a buffer of `nbytes` at, read over and over (torch's threads
    summing it): from memory for a buffer larger than the caches, from the cache for one that fits,
    so a step that reads that many bytes cannot beat it."""
    x = torch.ones(max(nbytes // 4, 1))
    x.sum()
    best, t0 = 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        x.sum()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def routed_run(model, prompts: list[list[int]], new: int) -> tuple[int, int, list[int]]:
    """Eager runs of the prompts in fresh engines, counted by torch's FlopCounterMode: (FLOPs
    of the prefill alone, FLOPs of the whole run of `new` tokens, the routed experts' bytes each
    decode step read: the distinct experts its tokens chose in every MoE layer, recorded by hooks)."""
    from k3.model.moe import LatentMoE

    batch = len(prompts)
    chosen: list[int] = []  # expert bytes read per decode-step call of each MoE layer, in call order

    def record(moe):
        per_expert = sum(w[0].numel() * w.element_size() for w in (moe.experts.w_gate, moe.experts.w_up,
                                                                      moe.experts.w_down))

        def hook(_, args, out):
            if args[0].reshape(-1, args[0].shape[-1]).shape[0] <= batch:  # a decode step: a token a sequence
                chosen.append(int(out[1].expert_ids.unique().numel()) * per_expert)
        return hook

    hooks = [m.register_forward_hook(record(m)) for m in model.modules() if isinstance(m, LatentMoE)]
    try:
        eager = EngineConfig(compile_decode=False)  # the hooks see every MoE call; the counter every op
        prefill_flops = step_flops(lambda: LLMEngine(model, eager).generate(
            prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
        chosen.clear()
        run_flops = step_flops(lambda: LLMEngine(model, eager).generate(
            prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)))
    finally:
        for h in hooks:
            h.remove()
    steps, n_moe = new - 1, len(hooks)  # the first token comes from the prefill
    if len(chosen) != steps * n_moe:
        raise RuntimeError(f"recorded {len(chosen)} decode-step MoE calls, expected {steps} steps x {n_moe} layers")
    return prefill_flops, run_flops, [sum(chosen[i * n_moe:(i + 1) * n_moe]) for i in range(steps)]


def decode_floor(model, prompts: list[list[int]], new: int) -> dict:
    """The shortest time k3's run of these prompts could take here, its work at the best rates: the
    prefill's arithmetic (the FLOPs torch counts in k3's own prefill) at the matmul rate, then
    every decode step's bytes at the best read rate or its FLOPs at the matmul rate, whichever
    is longer. A decode step reads every weight but the routed experts' and the embedding table's
    (one row per sequence), the experts its tokens chose (recorded per layer and step in an eager
    run of the same prompts: the same tokens, so the same routing, as the timed runs), each
    sequence's KDA state (read and written) and its MLA latents so far. Rates are the best single
    calls measured in this process (reads from memory and, for a step's bytes, from the cache),
    so the floor is a lower bound on the timed runs. Every sequence must decode in every step: at
    most `max_num_seqs` prompts whose prefill fits one step (`main` checks `--batches`)."""
    from k3.model.cache import cache_bytes
    from k3.model.moe import Experts

    cfg, batch = model.cfg, len(prompts)
    prefill_flops, run_flops, chosen = routed_run(model, prompts, new)
    steps = len(chosen)  # routed_run's decode steps (the first token comes from the prefill)
    expert_ids = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    table = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if id(p) not in expert_ids and (p is not table or model.lm_head.weight is table))
    weights += batch * table[0].numel() * table.element_size() if model.lm_head.weight is not table else 0
    dtype = getattr(torch, EngineConfig().dtype)  # the latents' and conv state's (the KDA state is fp32)
    fixed = cache_bytes(cfg, 0, dtype)
    context = [sum(cache_bytes(cfg, len(p) + i, dtype) - fixed for p in prompts) for i in range(steps)]
    step_bytes = [weights + chosen[i] + batch * 2 * fixed + context[i] for i in range(steps)]
    rate = step_matmul_rate(cfg, sum(len(p) for p in prompts))
    # from memory, or from the cache if a step's bytes fit there (the weights it shares with the
    # step before stay): the faster of the two
    from_memory, from_cache = stream_rate(), stream_rate(int(sum(step_bytes) / max(steps, 1)))
    bw = max(from_memory, from_cache)
    step_flop = (run_flops - prefill_flops) / max(steps, 1)
    all_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_s = max(prefill_flops / rate, all_weights / bw) + sum(max(step_flop / rate, b / bw) for b in step_bytes)
    return {"prefill_gflop": round(prefill_flops / 1e9, 3), "decode_mflop_per_step": round(step_flop / 1e6, 2),
            "decode_mb_per_step": round(sum(step_bytes) / max(steps, 1) / 1e6, 2),
            "matmul_gflop_per_s": round(rate / 1e9, 1), "read_gb_per_s": round(bw / 1e9, 1),
            "read_gb_per_s_256mb": round(from_memory / 1e9, 1), "read_gb_per_s_step_bytes": round(from_cache / 1e9, 1),
            "floor_s": round(floor_s, 4)}


def hf_step(hf, opt, ids) -> float:
    opt.zero_grad(set_to_none=True)
    loss = hf(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss)


def k3_step(model, opt, ids) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss)


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, *args, out_shape=None, **kw) -> int:
    """A convolution's backward: its forward's count (which reads the groups from the weight's
    shape) once per gradient asked for. torch's own rule ignores the groups there and counts a
    depthwise conv's backward as a dense one's (768x too much for a 768-channel short conv)."""
    from torch.utils.flop_counter import conv_flop_count

    transposed, output_mask = args[4], args[7]
    fwd = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)
    return fwd * (int(output_mask[0]) + int(output_mask[1]))


def step_flops(fn) -> int:
    """Floating-point operations torch counts in one call of fn (matmuls, attention, convolutions;
    a convolution's backward by `_conv_backward_flops`)."""
    from torch.utils.flop_counter import FlopCounterMode

    rules = {torch.ops.aten.convolution_backward: _conv_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=rules) as fc:
        fn()
    return fc.get_total_flops()


def matmul_rate(shapes: list[tuple[int, int, int]], seconds: float = 1.0) -> float:
    """Best fp32 FLOP/s of torch.mm on this machine over the [m, k] @ [k, n] shapes given (the
    fastest single call: a floor computed from it stays below what load does to the timed runs)."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / len(shapes):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


def step_matmul_rate(cfg, tokens: int) -> float:
    """matmul_rate on a step's largest matmuls: the vocabulary projection, the dense MLP, the
    attention projections (cfg: a transformers or k3 config: hidden_size, vocab_size,
    intermediate_size)."""
    return matmul_rate([(tokens, cfg.hidden_size, cfg.vocab_size), (tokens, cfg.hidden_size, cfg.intermediate_size),
                        (tokens, cfg.hidden_size, cfg.hidden_size)])


def profile_step(fn, rows: int = 12) -> list[dict]:
    """fn's ops by self CPU time (the step's largest), each as ms, share and calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ev = [e for e in prof.key_averages() if e.key.startswith("aten::") or e.key[:1].isupper()]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    ev.sort(key=lambda e: -e.self_cpu_time_total)
    out = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1),
            "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in ev[:rows]]
    out.append({"op": "(all aten ops)", "calls": sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")),
                "self_ms": round(total / 1e3, 1)})
    return out


def trainer(path: str | None, batch: int, preset: str | None = None):
    """k3's Trainer on this process alone (gloo, world 1), starting from the checkpoint at path (or
    the preset's random initialisation)."""
    import torch.distributed as dist

    from k3.platform.ops.local_ray import free_port
    from k3.platform.train.config import TrainConfig
    from k3.platform.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    if not dist.is_initialized():
        os.environ["MASTER_PORT"] = str(free_port())
        from k3.platform.ops.extensions import init_distributed

        init_distributed("gloo")  # its build line on stderr: stdout is the JSON result
    start = {"init_from": path} if path else {"preset": preset}
    cfg = TrainConfig(**start, num_workers=1, micro_batch=batch, steps=1000, lr=1e-3, warmup_steps=0,
                      balance={"method": "none"}, seed=0)
    t = Trainer(cfg, 0, 1).build()
    t.start()
    return t


def train(name: str, path: str, hf, batch: int, seq: int, repeats: int, gen: torch.Generator,
          profile: bool = False) -> dict:
    """One training step, transformers vs k3 (model + AdamW) vs k3's Trainer; first losses compared."""
    hf.train()
    ours = load_kimi_linear(path, dtype=torch.float32).train()
    ids = torch.randint(3, 4096, (batch, seq), generator=gen)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    k3_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    tr = trainer(path, batch)
    first = {"transformers": hf_step(hf, hf_opt, ids), "k3_model": k3_step(ours, k3_opt, ids),
             "k3_trainer": tr.train_step(tr.make_batch({"tokens": ids}), 0).loss}
    times: dict[str, list[float]] = {k: [] for k in first}
    for r in range(repeats):  # interleaved, after the first (warm-up) step of each
        times["transformers"].append(timed(lambda: hf_step(hf, hf_opt, ids))[0])
        times["k3_model"].append(timed(lambda: k3_step(ours, k3_opt, ids))[0])
        times["k3_trainer"].append(timed(lambda: tr.train_step(tr.make_batch({"tokens": ids}), r + 1))[0])
    best = {k: min(v) for k, v in times.items()}
    flops = {"transformers": step_flops(lambda: hf_step(hf, hf_opt, ids)),
             "k3_model": step_flops(lambda: k3_step(ours, k3_opt, ids)),
             "k3_trainer": step_flops(lambda: tr.train_step(tr.make_batch({"tokens": ids}), repeats + 1))}
    rate = step_matmul_rate(hf.config, batch * seq)
    floor = {k: v / rate for k, v in flops.items()}
    out = {"batch": batch, "seq_len": seq, "first_step_loss": {k: round(v, 6) for k, v in first.items()},
            "loss_abs_diff_k3_model": abs(first["k3_model"] - first["transformers"]),
            "loss_abs_diff_k3_trainer": abs(first["k3_trainer"] - first["transformers"]),
            "step_s": {k: round(v, 4) for k, v in best.items()},
            "speedup_k3_model": round(best["transformers"] / best["k3_model"], 2),
            "speedup_k3_trainer": round(best["transformers"] / best["k3_trainer"], 2),
            "gflop_per_step": {k: round(v / 1e9, 2) for k, v in flops.items()},
            "matmul_gflop_per_s": round(rate / 1e9, 1),
            "floor_s": {k: round(v, 4) for k, v in floor.items()},
            "fraction_of_matmul_rate": {k: round(floor[k] / best[k], 3) for k in best},
            "max_speedup": {k: round(best["transformers"] / floor[k], 2) for k in ("k3_model", "k3_trainer")}}
    if profile:
        out["k3_trainer_profile"] = profile_step(lambda: tr.train_step(tr.make_batch({"tokens": ids}), repeats + 2))
    return out


def tiny_step(repeats: int, gen: torch.Generator, batch: int = 8, seq: int = 256) -> dict:
    """k3-tiny's Trainer step at the README job's per-rank shapes: time, counted arithmetic, profile."""
    tr = trainer(None, batch, preset="k3-tiny")
    ids = torch.randint(3, tr.model.cfg.vocab_size, (batch, seq), generator=gen)
    tr.train_step(tr.make_batch({"tokens": ids}), 0)
    best = min(timed(lambda: tr.train_step(tr.make_batch({"tokens": ids}), r + 1))[0] for r in range(repeats))
    flops = step_flops(lambda: tr.train_step(tr.make_batch({"tokens": ids}), repeats + 1))
    rate = step_matmul_rate(tr.model.cfg, batch * seq)
    return {"batch": batch, "seq_len": seq, "step_s": round(best, 4), "gflop_per_step": round(flops / 1e9, 2),
            "matmul_gflop_per_s": round(rate / 1e9, 1), "floor_s": round(flops / rate, 4),
            "fraction_of_matmul_rate": round(flops / rate / best, 3),
            "profile": profile_step(lambda: tr.train_step(tr.make_batch({"tokens": ids}), repeats + 2))}


def check_flags(p: argparse.ArgumentParser, args) -> tuple[set[str], list[str], list[str], list[int]]:
    """(sections, models, engines, batches) of the parsed flags; every bad flag named at once (one
    line each, through p.error), before any model is built."""
    problems = []
    only = set(args.only.split(","))
    if not only or only - {"decode", "train"}:
        problems.append(f"--only takes decode, train, got {args.only!r}")
    models = args.models.split(",")
    if not models or set(models) - set(MODELS):
        problems.append(f"--models takes {', '.join(MODELS)}, got {args.models!r}")
    engines = [e.strip() for e in args.engines.split(",")]
    if not engines or set(engines) - set(ENGINES):
        problems.append(f"--engines takes {', '.join(ENGINES)}, got {args.engines!r}")
    for flag, value in (("--new-tokens", args.new_tokens), ("--repeats", args.repeats),
                        ("--train-batch", args.train_batch), ("--threads", args.threads)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if args.train_seq < 2:
        problems.append(f"--train-seq must be >= 2 (inputs and their next tokens), got {args.train_seq}")
    ec = EngineConfig()
    most = min(ec.max_num_seqs, ec.max_num_batched_tokens // PROMPT_LEN)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
        problems.append(f"--batches takes comma-separated integers, got {args.batches!r}")
    bad = [b for b in batches if not 1 <= b <= most]
    if bad:
        problems.append(f"--batches: each must be 1..{most} (the engine's max_num_seqs, and {PROMPT_LEN}-token "
                        f"prompts prefilled in one step), got {bad}")
    if problems:
        p.error("\n".join(problems))
    return only, models, engines, batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="decode,train", help="comma-separated sections: decode, train")
    p.add_argument("--models", default="kimi8,kimi4", help="comma-separated: kimi8, kimi4")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best of each side is kept")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,8", help="decode: sequences per run")
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--train-seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--engines", default="default,eager",
                   help="decode: k3 engines to time, comma-separated: default (EngineConfig()), compiled "
                        "(compile_decode=True), eager (compile_decode=False)")
    p.add_argument("--profile", action="store_true", help="train: k3 Trainer's step by op, and k3-tiny's step "
                   "(the README job's shapes: 8 x 256 tokens) counted and profiled the same way")
    args = p.parse_args()
    only, models, engines, batches = check_flags(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    res: dict = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                             "torch": torch.__version__, "transformers": transformers.__version__,
                             "load_average_at_start": os.getloadavg()}}
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            hf, path = build(name, d)
            res[name] = {"params_million": round(sum(x.numel() for x in hf.parameters()) / 1e6, 2)}
            if "decode" in only:
                res[name]["decode"] = decode(name, path, hf, batches,
                                             args.new_tokens, args.repeats, gen, engines)
            if "train" in only and name == "kimi8":
                res[name]["train"] = train(name, path, hf, args.train_batch, args.train_seq, args.repeats, gen,
                                           args.profile)
            print(json.dumps({name: res[name]}), file=sys.stderr, flush=True)
        if "train" in only and args.profile:
            res["k3-tiny"] = {"train": tiny_step(args.repeats, gen)}
            print(json.dumps({"k3-tiny": res["k3-tiny"]}), file=sys.stderr, flush=True)
    res["machine"]["load_average_at_end"] = os.getloadavg()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
