"""Kernel benchmarks on CPU, printed as JSON: KDA, SiTU-GLU, MLA decode, each side by side.

    make bench-kernels                           # installs the peers (fla) aside, runs the full set
    python jobs/bench_kernels.py                 # the full set (over an hour: each slow peer
                                                 # takes minutes per process at T=16384 fwd+bwd)
    python jobs/bench_kernels.py --quick         # small shapes, a smoke run
    python jobs/bench_kernels.py --only kda --T 1024 4096

Every (implementation, shape, mode) runs in two processes of its own. One times it: the best of
--repeats wall-clock runs after one warm-up (a run slower than --slow-s is timed once). The
other measures its peak memory in one call after a warm-up call (no warm-up for runs slower than
--slow-s): the high-water RSS minus the RSS just before the call (inputs, imports and one-time
initialisation not counted). glibc is
told to return every block >= 128 KB to the OS on free (MALLOC_MMAP_THRESHOLD_) and the
warm-up's smaller freed blocks are trimmed (malloc_trim), so RSS follows the live tensors
instead of the allocator's cache. All implementations in a group get the same inputs (same
seed) and their outputs are compared against the reference's. Every process runs --threads
torch threads (default 1: on a shared 2-core machine, two OpenMP threads made timings swing 10x
from one run to the next).

KDA (B=1, H=4, K=V=64, K3's bounded gate g = -5 sigmoid(z), q and k L2-normalised):
- k3_cpu: k3.kernels.kda.chunk_kda on CPU, told the gate's lower bound (-5);
- k3_cpu_unbounded: the same without the bound (the Kimi Linear code path);
- k3_reference: k3's readable per-token recurrence;
- hf_chunk, hf_recurrent: transformers' Kimi Linear torch functions, called directly (with fla
  installed transformers would dispatch to fla's Triton kernels, which cannot run on a CPU);
- fla_naive_chunk, fla_naive_recurrent: fla's naive_chunk_kda and naive_recurrent_kda.
SiTU-GLU ([tokens, 3072], K3's expert width): k3's fused function vs autograd through the formula.
MLA decode (K3's MLA: 96 heads, latent 512 + rope 64, bf16 paged cache of 64-token pages,
batch 1): k3's absorbed kernel, its readable reference, and attention over an expanded
per-head K/V cache (what a non-absorbed decoder keeps and reads).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
import time

from k3.platform.ops.proc_memory import reset_peak, status_kb

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--only", nargs="*", default=["kda", "situ", "mla"], choices=["kda", "situ", "mla"])
p.add_argument("--T", nargs="*", type=int, default=[1024, 4096, 16384], help="KDA sequence lengths")
p.add_argument("--contexts", nargs="*", type=int, default=[1024, 8192, 32768], help="MLA decode contexts")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--slow-s", type=float, default=5.0, help="time a run this slow only once")
p.add_argument("--mem-cap-gb", type=float, default=12.0, help="kill a worker whose RSS passes this")
p.add_argument("--timeout-s", type=float, default=900.0, help="kill a worker running longer")
p.add_argument("--threads", type=int, default=1, help="torch threads in every worker")
p.add_argument("--quick", action="store_true", help="tiny shapes: check that everything runs")
p.add_argument("--impls", nargs="*", help="run only these implementations (default: all)")
p.add_argument("--worker", help=argparse.SUPPRESS)
args = p.parse_args()


# ---------------------------------------------------------------------------------------------
# Worker: one implementation, one shape, one mode; prints one JSON line.

def _load_fla_naive():
    """fla's naive KDA functions, loaded from the file alone: importing the fla package pulls in
    every Triton kernel and model, none of which a CPU needs."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flash-linear-attention is not importable: run `make bench-kernels` (installs it into "
                          ".cache/fla-bench, outside the test venv)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _hf_torch_functions():
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    chunk, rec = inspect.unwrap(mk.chunk_kimi_delta_attention), inspect.unwrap(mk.recurrent_kimi_delta_attention)
    for fn in (chunk, rec):  # the torch bodies, not a kernel the hub or fla supplied
        assert fn.__module__ == mk.__name__, f"{fn} is not transformers' torch function"
    return chunk, rec


def kda_case(spec, torch):
    import torch.nn.functional as F

    T, H, K = spec["T"], 4, 64
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen) * 2)
    beta = torch.rand(1, T, H, generator=gen)
    xs = [q, k, v, g, beta]
    impl = spec["impl"]
    if impl in ("k3_cpu", "k3_cpu_unbounded"):
        from k3.kernels.kda import chunk_kda

        lb = -5.0 if impl == "k3_cpu" else None
        fn = lambda *a: chunk_kda(*a, lower_bound=lb, backend="torch")[0]  # noqa: E731
    elif impl == "k3_reference":
        from k3.kernels.kda import naive_recurrent_kda

        fn = lambda *a: naive_recurrent_kda(*a)[0]  # noqa: E731
    elif impl in ("hf_chunk", "hf_recurrent"):
        chunk, rec = _hf_torch_functions()
        fn = (lambda *a: chunk(*a)[0]) if impl == "hf_chunk" else (lambda *a: rec(*a, None, False)[0])
    elif impl in ("fla_naive_chunk", "fla_naive_recurrent"):
        mod = _load_fla_naive()
        f = mod.naive_chunk_kda if impl == "fla_naive_chunk" else mod.naive_recurrent_kda
        fn = lambda *a: f(*a)[0]  # noqa: E731
    else:
        raise ValueError(impl)
    return fn, xs


def situ_case(spec, torch):
    from k3.kernels.situ_glu import naive_situ_glu, situ_glu

    dtype = getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(spec["tokens"], 3072, generator=gen) * 3).to(dtype)
    up = (torch.randn(spec["tokens"], 3072, generator=gen) * 3).to(dtype)
    fn = {"k3_fused": lambda a, b: situ_glu(a, b, backend="torch"), "unfused_torch": naive_situ_glu}[spec["impl"]]
    return fn, [gate, up]


def mla_case(spec, torch):
    from k3.kernels.mla_decode import mla_decode, naive_mla_decode

    ctx, H, L, R, ps, nope, vd = spec["context"], spec["heads"], 512, 64, 64, 128, 128
    gen = torch.Generator().manual_seed(0)
    n_pages = (ctx + ps - 1) // ps
    kv = (torch.randn(n_pages, ps, L + R, generator=gen) * 0.5).to(torch.bfloat16)
    table = torch.randperm(n_pages, generator=gen)[None].to(torch.int32)
    lens = torch.tensor([ctx], dtype=torch.int32)
    q_nope = torch.randn(1, H, nope, generator=gen) * 0.1
    q_rope = torch.randn(1, H, R, generator=gen) * 0.1
    w_kv = torch.randn(H, nope + vd, L, generator=gen) * L ** -0.5  # kv_b_proj, per head
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    scale = (nope + R) ** -0.5
    impl = spec["impl"]
    if impl == "expanded_kv_sdpa":
        # A non-absorbed decoder caches per-head keys and values (bf16), built once at prefill.
        lat = kv[table[0].long()].reshape(-1, L + R)[:ctx].float()
        k_cache = torch.cat([torch.einsum("tl,hdl->htd", lat[:, :L], w_uk),
                             lat[None, :, L:].expand(H, ctx, R)], -1).to(torch.bfloat16)
        v_cache = torch.einsum("tl,hdl->htd", lat[:, :L], w_uv).to(torch.bfloat16)
        del lat
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fn(q_nope, q_rope):
            q = torch.cat([q_nope, q_rope], -1)[0][:, None].to(torch.bfloat16)  # [H, 1, nope + R]
            return sdpa(q, k_cache, v_cache, scale=scale)[:, 0][None].float()
    else:
        f = {"k3_absorbed": lambda *a: mla_decode(*a, backend="torch"), "k3_reference": naive_mla_decode}[impl]

        def fn(q_nope, q_rope):
            q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
            return f(q_lat, q_rope, kv, table, lens, scale, w_uv)
    return fn, [q_nope, q_rope]


def run_worker(spec):
    import torch

    torch.set_num_threads(spec["threads"])
    build = {"kda": kda_case, "situ": situ_case, "mla": mla_case}[spec["group"]]
    fn, xs = build(spec, torch)
    backward = spec["mode"] == "fwd_bwd"
    if backward:
        xs = [x.requires_grad_() for x in xs]

    def once():
        for x in xs:
            x.grad = None
        if backward:
            out = fn(*xs)
            out.float().pow(2).mean().backward()  # touches every output element
            return out.detach()
        with torch.no_grad():
            return fn(*xs)

    import gc

    if spec["measure"] == "memory" and spec.get("warm", True):  # steady state: one-time costs excluded
        once()
        gc.collect()
        # Hand the warm-up's freed heap pages back to the OS: small blocks (an autograd graph of
        # per-token tensors) would otherwise be reused without raising RSS, and go uncounted.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    gc.collect()
    reset_ok = reset_peak()
    base_kb = status_kb("VmRSS")
    t = time.perf_counter()
    out = once()
    times = [time.perf_counter() - t]
    if spec["measure"] == "time" and times[0] < spec["slow_s"]:
        times = []
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            out = once()
            times.append(time.perf_counter() - t)
    peak_kb = status_kb("VmHWM") if reset_ok else __import__("resource").getrusage(0).ru_maxrss
    gen = torch.Generator().manual_seed(99)
    probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    if spec["measure"] == "time":
        res = {"best_s": min(times), "times_s": [round(x, 4) for x in times], "threads": torch.get_num_threads(),
               "out_norm": float(out.double().norm()), "out_probe": float((out.double() * probe).sum())}
    else:
        res = {"peak_mb": round((peak_kb - base_kb) / 1024, 1), "peak_reset": reset_ok}
    print("RESULT " + json.dumps(res), flush=True)


if args.worker:
    run_worker(json.loads(args.worker))
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# Parent: build the run list, run each in its own process under a memory cap, summarise.

def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(spec: dict) -> dict | None:
    if args.impls and spec["impl"] not in args.impls:
        return None
    row = run_one({**spec, "measure": "time"})
    if "error" not in row:
        # A run slower than --slow-s is measured cold: its one-time costs are noise next to it.
        mem = run_one({**spec, "measure": "memory", "warm": row["best_s"] < args.slow_s})
        if "error" in mem:
            row["memory_error"], row["memory_rss_seen_mb"] = mem["error"], mem.get("rss_seen_mb")
        else:
            row.update(peak_mb=mem["peak_mb"], peak_reset=mem["peak_reset"])
    print(json.dumps(row), file=sys.stderr, flush=True)  # progress
    return row


def run_one(spec: dict) -> dict:
    spec = {**spec, "repeats": args.repeats, "slow_s": args.slow_s, "threads": args.threads}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    env = dict(os.environ)
    if spec["measure"] == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # a fixed threshold also stops glibc raising it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cap_kb, t0, worst = args.mem_cap_gb * 1024 * 1024, time.time(), 0
    killed = None
    while proc.poll() is None:
        worst = max(worst, rss_kb(proc.pid))
        if worst > cap_kb:
            killed = f"RSS passed the {args.mem_cap_gb} GB cap"
        elif time.time() - t0 > args.timeout_s:
            killed = f"ran past {args.timeout_s} s"
        if killed:
            proc.kill()
            break
        time.sleep(0.05)
    out, err = proc.communicate()
    row = {k: spec[k] for k in spec if k not in ("repeats", "slow_s", "group", "measure", "threads", "warm")}
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if killed or not lines:
        row["error"] = killed or (err.strip().splitlines() or ["no output"])[-1][:300]
        row["rss_seen_mb"] = round(worst / 1024, 1)
    else:
        row.update(json.loads(lines[-1][len("RESULT "):]))
    return row


def compare(rows: list[dict], ref: str) -> None:
    """Mark each row's output against the reference implementation's (same inputs)."""
    base = next((r for r in rows if r["impl"] == ref and "out_norm" in r), None)
    for r in rows:
        if base is not None and "out_norm" in r:
            r["rel_diff_vs_" + ref] = abs(r["out_probe"] - base["out_probe"]) / max(abs(base["out_probe"]), 1e-30)


if args.quick:
    args.T, args.contexts = [256], [1024]
    args.repeats = 1

load0 = os.getloadavg()
result = {"machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                      "python": platform.python_version()},
          "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "settings": {
              "repeats": args.repeats, "slow_s": args.slow_s, "mem_cap_gb": args.mem_cap_gb, "threads": args.threads}}
import torch  # noqa: E402  (after the worker branch: workers import what they need)

result["machine"]["torch"] = torch.__version__

if "kda" in args.only:
    impls = ["k3_cpu", "k3_cpu_unbounded", "k3_reference", "hf_chunk", "hf_recurrent", "fla_naive_chunk",
             "fla_naive_recurrent"]
    peers = ["hf_chunk", "hf_recurrent", "fla_naive_chunk", "fla_naive_recurrent"]
    kda = result["kda"] = {"shape": "B=1, H=4, K=V=64, fp32, bounded gate", "runs": [], "summary": {}}
    for T in args.T:
        for mode in ("fwd", "fwd_bwd"):
            rows = [r for r in (run({"group": "kda", "impl": i, "T": T, "mode": mode}) for i in impls) if r]
            compare(rows, "k3_reference")
            kda["runs"] += rows
            ok = {r["impl"]: r for r in rows if "best_s" in r}
            done = [ok[i] for i in peers if i in ok]
            if "k3_cpu" in ok and done:
                fastest = min(done, key=lambda r: r["best_s"])
                failed = [r["impl"] for r in rows if r["impl"] in peers and "best_s" not in r]
                k3_mb, peer_mb = ok["k3_cpu"].get("peak_mb"), fastest.get("peak_mb")
                kda["summary"][f"T={T} {mode}"] = {
                    "k3_cpu_s": ok["k3_cpu"]["best_s"], "k3_cpu_peak_mb": k3_mb,
                    "fastest_peer": fastest["impl"], "fastest_peer_s": fastest["best_s"],
                    "fastest_peer_peak_mb": peer_mb,
                    "speedup": round(fastest["best_s"] / ok["k3_cpu"]["best_s"], 2),
                    "k3_peak_le_fastest_peer": None if None in (k3_mb, peer_mb) else k3_mb <= peer_mb,
                    "peers_that_did_not_finish": failed,
                }

if "situ" in args.only:
    situ = result["situ_glu"] = {"shape": "[tokens, 3072]", "runs": []}
    tokens = 256 if args.quick else 4096
    for dtype in ("float32", "bfloat16"):
        for mode in ("fwd", "fwd_bwd"):
            rows = [r for r in (run({"group": "situ", "impl": i, "tokens": tokens, "dtype": dtype, "mode": mode})
                                for i in ("k3_fused", "unfused_torch")) if r]
            compare(rows, "unfused_torch")
            situ["runs"] += rows

if "mla" in args.only:
    mla = result["mla_decode"] = {"shape": "1 sequence, 96 heads, latent 512 + rope 64, bf16 cache", "runs": []}
    for ctx in args.contexts:
        rows = [r for r in (run({"group": "mla", "impl": i, "context": ctx, "heads": 16 if args.quick else 96,
                                 "mode": "fwd"}) for i in ("k3_absorbed", "k3_reference", "expanded_kv_sdpa")) if r]
        compare(rows, "k3_reference")
        mla["runs"] += rows

result["machine"]["loadavg_start_end"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
print(json.dumps(result, indent=1))
