"""GPU check of every Triton kernel, printed as JSON: correctness in bf16 and fp32, and KDA timing.

    python jobs/gpu_check.py                 # on a CUDA machine: checks + timing, < 5 min on an H100/H200
    python jobs/gpu_check.py --quick         # checks only, smaller shapes
    python jobs/gpu_check.py --compile-only  # no GPU needed: compile every kernel for sm_90 (H100/H200)
    python jobs/gpu_check.py --interpret     # no GPU needed: the checks on CPU, Triton interpreter, tiny shapes

Checks (each against the op's readable reference, or against k3's torch path on the same GPU
where the per-token reference would be too slow): KDA chunked forward and backward (bounded
and unbounded gate, initial state, packed sequences), KDA states at asked-for offsets, the KDA
decode step over state slots (untouched slots bit-identical), SiTU-GLU forward and backward, MLA
decode over shuffled pages with W_uv and the gate, and the QB histogram (bin for bin). Tolerances
are relative RMS errors.

Timing: KDA chunked forward and forward + backward at H=16, K=V=128, bf16, K3's bounded gate:
k3's Triton kernel, fla's chunk_kda (with safe_gate, when fla is installed) and k3's torch path
on the same GPU; median of CUDA-event timings, and peak allocated memory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--quick", action="store_true", help="correctness only, small shapes")
p.add_argument("--compile-only", action="store_true", help="compile every kernel for --arch, no GPU needed")
p.add_argument("--interpret", action="store_true", help="run the checks on CPU under TRITON_INTERPRET=1 (tiny)")
p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only (90 = H100/H200)")
p.add_argument("--T", nargs="*", type=int, default=[4096, 16384], help="KDA timing lengths")
p.add_argument("--heads", type=int, default=16)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--budget-s", type=float, default=270.0, help="stop starting new checks after this long")
args = p.parse_args()
for T in args.T:
    if T < 1:
        p.error(f"--T values must be >= 1, got {T}")
if not 16 <= args.head_dim <= 256:
    p.error(f"--head-dim must be in [16, 256] (the Triton kernel's range), got {args.head_dim}")

if args.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before any k3 Triton module is imported
    args.quick = True

import torch  # noqa: E402

t_start = time.time()
result: dict = {"args": vars(args), "checks": [], "timing": [], "skipped": []}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def record(name: str, dtype: torch.dtype, errors: dict, tol: float, extra: dict | None = None) -> None:
    ok = all(math.isfinite(e) and e <= tol for e in errors.values())
    row = {"check": name, "dtype": str(dtype).replace("torch.", ""), "tol": tol, "pass": ok,
           "errors": {k: float(f"{v:.3e}") for k, v in errors.items()}}
    result["checks"].append({**row, **(extra or {})})
    print(json.dumps(result["checks"][-1]), file=sys.stderr, flush=True)


def within_budget(name: str) -> bool:
    if time.time() - t_start > args.budget_s:
        result["skipped"].append(name)
        return False
    return True


# ---------------------------------------------------------------------------------------------
# --compile-only: capture every launch the launchers make (CPU tensors, nothing runs) and compile
# it for the target GPU, reporting shared memory against the 227 KB an H100/H200 block may use.

if args.compile_only:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("--compile-only needs TRITON_INTERPRET unset")
    launches = []
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))  # capture, don't launch
    from k3.kernels.kda.triton import chunk_kda_triton
    from k3.kernels.kda.triton_step import kda_step_triton
    from k3.kernels.mla_decode.triton import mla_decode_triton
    from k3.kernels.situ_glu.triton import situ_glu_triton

    qb_triton = None
    try:
        from k3.kernels.qb_histogram.triton import qb_histogram_triton as qb_triton
    except ImportError:
        result["skipped"].append("qb_histogram (no triton.py)")
    K = args.head_dim
    for dt in (torch.float32, torch.bfloat16):
        for bounded in (True, False):
            xs = [torch.zeros(1, 100, 2, K, dtype=dt) for _ in range(3)] + [torch.zeros(1, 100, 2, K),
                                                                           torch.zeros(1, 100, 2, dtype=dt)]
            xs = [x.requires_grad_() for x in xs]
            lb = -5.0 if bounded else None
            o, s, _ = chunk_kda_triton(*xs, K ** -0.5, torch.zeros(1, 2, K, K), True, None, 64, lb, {})
            (o.float().sum() + s.sum()).backward()
            with torch.no_grad():  # states_at: the state kernel storing chosen chunks' entering states
                chunk_kda_triton(*xs, K ** -0.5, None, False, None, 64, lb, {0: [10, 64, 100]})
        kda_step_triton(*(torch.zeros(2, 2, K, dtype=dt) for _ in range(4)), torch.zeros(2, 2, dtype=dt),
                        torch.zeros(3, 2, K, K), torch.tensor([0, 2]), 0.1)
        for ps in (16, 64):
            mla_decode_triton(torch.zeros(2, 96, 512, dtype=dt), torch.zeros(2, 96, 64, dtype=dt),
                              torch.zeros(4, ps, 576, dtype=dt), torch.zeros(2, 2, dtype=torch.int32),
                              torch.tensor([5, 9]), 0.1)
        gate = torch.zeros(100, dtype=dt, requires_grad=True)
        situ_glu_triton(gate, gate.detach().clone().requires_grad_()).sum().backward()
        if qb_triton is not None:
            qb_triton(torch.zeros(64, 8, dtype=dt), torch.zeros(8), torch.ones(8), 16)
    names = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
             torch.int32: "*i32", torch.int64: "*i64"}
    seen = set()
    for fn, a, kw in launches:
        vals = dict(zip(fn.arg_names, a), **kw)
        opts = {k: vals.pop(k) for k in ("num_warps", "num_stages") if k in vals}
        sig, const = {}, {}
        for i, n in enumerate(fn.arg_names):
            x = vals[n]
            if fn.params[i].is_constexpr:
                sig[n], const[n] = "constexpr", x
            elif isinstance(x, torch.Tensor):
                sig[n] = names[x.dtype]
            else:
                sig[n] = "i32" if isinstance(x, int) else "fp32"
        key = (fn.__name__, json.dumps(sig, sort_keys=True), json.dumps(const, sort_keys=True, default=str))
        if key in seen:
            continue
        seen.add(key)
        t = time.time()
        try:
            c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                               target=GPUTarget("cuda", args.arch, 32), options=opts)
            row = {"kernel": fn.__name__, "shared_bytes": c.metadata.shared, "fits_227KB": c.metadata.shared <= 232448}
        except Exception as e:  # report every kernel, not just the first failure
            row = {"kernel": fn.__name__, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row.update(constexprs={k: v for k, v in const.items() if k not in ("H",)}, compile_s=round(time.time() - t, 1))
        result["checks"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    result["all_compiled"] = all("error" not in r and r["fits_227KB"] for r in result["checks"])
    result["elapsed_s"] = round(time.time() - t_start, 1)
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["all_compiled"] else 1)

if not torch.cuda.is_available() and not args.interpret:
    result["error"] = "no CUDA device: nothing checked (use --compile-only to compile the kernels without one)"
    print(json.dumps(result, indent=1))
    sys.exit(2)

# ---------------------------------------------------------------------------------------------
# Correctness on the GPU.

import torch.nn.functional as F  # noqa: E402

from k3.kernels.kda import chunk_kda, kda_step, naive_kda_step, naive_recurrent_kda  # noqa: E402
from k3.kernels.mla_decode import mla_decode, naive_mla_decode  # noqa: E402
from k3.kernels.situ_glu import naive_situ_glu, situ_glu  # noqa: E402

from k3.kernels.qb_histogram import naive_qb_histogram, qb_histogram  # noqa: E402

dev = torch.device("cpu" if args.interpret else "cuda")
if args.interpret:
    result["device"] = {"name": "cpu, Triton interpreter", "torch": torch.__version__}
else:
    props = torch.cuda.get_device_properties(dev)
    result["device"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(dev)),
                        "memory_gb": round(props.total_memory / 2**30, 1), "torch": torch.__version__}
try:
    import triton

    result["device"]["triton"] = triton.__version__
except ImportError:
    result["error"] = "triton is not installed"
    print(json.dumps(result, indent=1))
    sys.exit(2)
TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 3e-2)}  # (forward, gradients)


def kda_inputs(B, T, H, K, V, bounded, dtype, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, device=dev, generator=gen)
    z = torch.randn(B, T, H, K, device=dev, generator=gen) * 2
    g = -5.0 * torch.sigmoid(z) if bounded else -F.softplus(z) * 3
    beta = torch.rand(B, T, H, device=dev, generator=gen)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)]


def kda_check(name, T, H, K, bounded, dtype, cu=None, B=1, reference="naive"):
    xs = kda_inputs(B, T, H, K, K, bounded, dtype, seed=T)
    N = B if cu is None else cu.numel() - 1
    h0 = torch.randn(N, H, K, K, device=dev) * 0.1
    lb = -5.0 if bounded else None
    runs = []
    for backend in ("triton", reference):
        a = [x.detach().clone().requires_grad_() for x in xs] + [h0.clone().requires_grad_()]
        if backend == "naive":
            o, s, _ = naive_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu)
        else:
            o, s, _ = chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu, lower_bound=lb,
                                backend=backend)
        gen = torch.Generator(device=dev).manual_seed(1)
        do, ds = torch.randn(o.shape, device=dev, generator=gen), torch.randn(s.shape, device=dev, generator=gen)
        ((o.float() * do).sum() + (s * ds).sum()).backward()
        runs.append([o, s] + [x.grad for x in a])
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = {n: rel_rms(x, y) for n, x, y in zip(names, *runs)}
    fwd_tol, grad_tol = TOL[dtype]
    extra = {"against": reference, "T": T, "K": K}
    record(name + " forward", dtype, {n: errs[n] for n in names[:2]}, fwd_tol, extra)
    record(name + " gradients", dtype, {n: errs[n] for n in names[2:]}, grad_tol, extra)


def kda_states_check(lengths, dtype):
    """states_at at chunk boundaries and off them, against the recurrence's states."""
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
    xs = kda_inputs(1, int(cu[-1]), 2, 64, 64, True, dtype, seed=9)
    want = {0: [1, 64, 100, lengths[0]], 2: [lengths[2] // 2]}
    with torch.no_grad():
        got = chunk_kda(*xs, cu_seqlens=cu, lower_bound=-5.0, states_at=want, backend="triton").states
        ref = naive_recurrent_kda(*xs, cu_seqlens=cu, states_at=want).states
    record("kda_chunk states_at", dtype, {f"state{key}": rel_rms(got[key], ref[key]) for key in ref}, TOL[dtype][0])


small = args.quick
tiny = args.interpret  # the interpreter runs each program in numpy: shapes a GPU would not notice take minutes
for dtype in (torch.float32, torch.bfloat16):
    for bounded in (True, False):
        if within_budget(f"kda_chunk {dtype} bounded={bounded}"):
            kda_check(f"kda_chunk bounded={bounded} vs recurrence", 100 if small else 300, 2, 64, bounded, dtype, B=2)
    if within_budget(f"kda_chunk packed {dtype}"):
        lengths = [17, 0, 40, 1, 70] if tiny else [17, 0, 283, 1, 399]
        cu = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
        kda_check("kda_chunk packed K=128", int(cu[-1]), 1 if tiny else 4, 128, True, dtype, cu=cu)
    if within_budget(f"kda_chunk states_at {dtype}"):
        kda_states_check([130, 0, 41] if tiny else [300, 0, 1001], dtype)
    if not small and within_budget(f"kda_chunk long {dtype}"):
        kda_check("kda_chunk T=8192 K=128 vs torch path", 8192, 8, 128, True, dtype, B=2, reference="torch")
    if within_budget(f"kda_step {dtype}"):
        xs = [x[:, 0] for x in kda_inputs(5, 1, 4, 128, 128, False, dtype, seed=3)]
        pool = torch.randn(9, 4, 128, 128, device=dev)
        ref_pool = pool.clone()
        slots = torch.tensor([7, 0, 3, 8, 1], device=dev)
        o = kda_step(*xs, pool, slots, backend="triton")
        o_ref = naive_kda_step(*xs, ref_pool, slots)
        untouched = [2, 4, 5, 6]
        same = bool(torch.equal(pool[untouched], ref_pool[untouched]))
        record("kda_step over slots", dtype, {"o": rel_rms(o, o_ref), "pool": rel_rms(pool, ref_pool)},
               TOL[dtype][0], {"untouched_slots_bit_identical": same})
        result["checks"][-1]["pass"] &= same
    if within_budget(f"situ_glu {dtype}"):
        gen = torch.Generator(device=dev).manual_seed(4)
        shape = (16, 300) if tiny else (4096, 3072)
        gate = (torch.randn(*shape, device=dev, generator=gen) * 8).to(dtype)
        up = (torch.randn(*shape, device=dev, generator=gen) * 30).to(dtype)
        outs = []
        for f in (lambda a, b: situ_glu(a, b, backend="triton"), naive_situ_glu):
            a = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
            h = f(*a)
            h.float().pow(2).mean().backward()
            outs.append([h, a[0].grad, a[1].grad])
        record("situ_glu", dtype, {n: rel_rms(x, y) for n, x, y in zip(["h", "dgate", "dup"], *outs)}, TOL[dtype][0])
    if within_budget(f"mla_decode {dtype}"):
        gen = torch.Generator(device=dev).manual_seed(5)
        lens = torch.tensor([1, 70, 150, 64] if tiny else [1, 700, 4097, 64], device=dev, dtype=torch.int32)
        H_mla, L_mla = (16, 64) if tiny else (96, 512)
        for ps in (16, 64):
            need = ((lens + ps - 1) // ps).tolist()
            ids = torch.randperm(sum(need) + 5, device=dev, generator=gen).to(torch.int32)
            table = torch.zeros(4, max(need), dtype=torch.int32, device=dev)
            pos = 0
            for i, n in enumerate(need):
                table[i, :n] = ids[pos:pos + n]
                pos += n
            kv = (torch.randn(ids.numel(), ps, L_mla + 64, device=dev, generator=gen) * 0.5).to(dtype)
            q_lat = (torch.randn(4, H_mla, L_mla, device=dev, generator=gen) * 0.05).to(dtype)
            q_rope = (torch.randn(4, H_mla, 64, device=dev, generator=gen) * 0.05).to(dtype)
            w_uv = (torch.randn(H_mla, 128, L_mla, device=dev, generator=gen) * 0.05).to(dtype)
            gate = torch.randn(4, H_mla, 128, device=dev, generator=gen).to(dtype)
            got = mla_decode(q_lat, q_rope, kv, table, lens, 0.07, w_uv, gate, backend="triton")
            want = naive_mla_decode(q_lat, q_rope, kv, table, lens, 0.07, w_uv, gate)
            record(f"mla_decode page_size={ps}", dtype, {"o": rel_rms(got, want)}, TOL[dtype][0])
    if within_budget(f"qb_histogram {dtype}"):
        gen = torch.Generator(device=dev).manual_seed(6)
        n_tok, n_exp = (300, 40) if tiny else (65536, 896)
        margins = (torch.randn(n_tok, n_exp, device=dev, generator=gen) * 0.3).to(dtype)
        lo = -torch.rand(n_exp, device=dev, generator=gen) - 0.5
        hi = torch.rand(n_exp, device=dev, generator=gen) + 0.5
        if tiny:  # on CPU the public function takes the torch path
            from k3.kernels.qb_histogram.triton import qb_histogram_triton as qb_fn
        else:
            qb_fn = qb_histogram
        got, want = qb_fn(margins, lo, hi, 256), naive_qb_histogram(margins, lo, hi, 256)
        record("qb_histogram (bins differing)", dtype, {"bins_differing": float((got != want).sum())}, 0.0)

# ---------------------------------------------------------------------------------------------
# KDA timing: k3 Triton vs fla's chunk_kda vs k3's torch path, bf16, bounded gate.


def cuda_time(fn, reps=10) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / 2**20


fla_chunk = None
try:
    from fla.ops.kda import chunk_kda as fla_chunk
except Exception as e:  # not installed, or an fla that does not match this triton
    result["fla"] = f"unavailable: {type(e).__name__}: {e}"

if not args.quick:
    H, K = args.heads, args.head_dim
    for T in args.T:
        if not within_budget(f"timing T={T}"):
            continue
        xs = kda_inputs(1, T, H, K, K, True, torch.bfloat16, seed=7)
        impls = {"k3_triton": lambda *a: chunk_kda(*a, lower_bound=-5.0, output_final_state=True)[0],
                 "k3_torch_on_gpu": lambda *a: chunk_kda(*a, lower_bound=-5.0, output_final_state=True,
                                                         backend="torch")[0]}
        if fla_chunk is not None:
            impls["fla_chunk_kda"] = lambda *a: fla_chunk(*a, output_final_state=True, safe_gate=True)[0]
        for name, f in impls.items():
            row = {"impl": name, "T": T, "H": H, "K": K, "dtype": "bfloat16"}
            try:
                with torch.no_grad():
                    row["fwd_ms"], row["fwd_peak_mib"] = cuda_time(lambda: f(*xs))
                a = [x.detach().clone().requires_grad_() for x in xs]

                def step():
                    for x in a:
                        x.grad = None
                    f(*a).float().pow(2).mean().backward()

                row["fwd_bwd_ms"], row["fwd_bwd_peak_mib"] = cuda_time(step, reps=5)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            result["timing"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

result["all_pass"] = all(c["pass"] for c in result["checks"])
result["elapsed_s"] = round(time.time() - t_start, 1)
print(json.dumps(result, indent=1))
sys.exit(0 if result["all_pass"] else 1)
