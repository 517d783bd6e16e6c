"""The last context-parallel rank's MLA layer, forward + backward, two ways, printed as JSON.

    python jobs/bench_mla_span.py [--preset k3-tiny] [--T 8192 16384 32768] [--C 2] [--repeats 3]

The last of C ranks holds T / C queries that see all T keys. `sliced` is what
`GatedMLA.forward_shard` runs (model/mla_span.py: keys expanded slice by slice, again in the
backward); `fused` is what it ran before: every key of the span expanded at once and one fused
causal SDPA call with the queries zero-padded in front to the span's length. Per T: the bytes the
layer keeps for its backward (autograd's saved tensors, each storage counted once, the gathered
latents included) and the time of one forward + backward (median of `--repeats`, the two ways
interleaved). One torch thread; fp32. A whole training step's peak memory with either is
bench_long_context.py's to measure (each rank's RSS, the rest of the model around it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from k3.model import get_preset
from k3.model.mla import GatedMLA
from k3.model.mla_span import latent_span_attention


def fused(layer: GatedMLA, x: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
    """The former forward_shard for one document over the whole span."""
    n, S = x.shape[1], lat.shape[0]
    k, v = layer._kv_heads(lat[None])
    q = layer._q_heads(x)
    past = S - n
    qs = torch.cat([q.new_zeros(*q.shape[:2], past, q.shape[-1]), q], dim=2)
    o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=layer.scale)[:, :, past:]
    return layer._finish(o[..., : layer.vdim].transpose(1, 2), x)


def sliced(layer: GatedMLA, x: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
    n, S = x.shape[1], lat.shape[0]
    o = latent_span_attention(layer._q_heads(x)[0], lat, layer.kv_b_proj.weight, [(0, n, 0, S)], layer._dims,
                              layer.scale)
    return layer._finish(o.transpose(0, 1)[None], x)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward of fn(), each storage once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def step(layer: GatedMLA, way, x: torch.Tensor, lat_in: torch.Tensor, grad: torch.Tensor) -> float:
    layer.zero_grad(set_to_none=True)
    lat = lat_in.clone().requires_grad_()
    t0 = time.perf_counter()
    (way(layer, x, lat) * grad).sum().backward()
    return time.perf_counter() - t0


def setup(preset: str, T: int, C: int):
    torch.set_num_threads(1)
    cfg = get_preset(preset)
    torch.manual_seed(0)
    layer = GatedMLA(cfg, 3)
    layer.reset_parameters()
    n = T // C
    x = torch.randn(1, n, cfg.hidden_size, requires_grad=True)
    with torch.no_grad():
        lat = layer.latent(torch.randn(T, cfg.hidden_size))
    return layer, x, lat, torch.randn(1, n, cfg.hidden_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--C", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for T in args.T:
        layer, x, lat, grad = setup(args.preset, T, args.C)
        with torch.no_grad():
            diff = (fused(layer, x, lat) - sliced(layer, x, lat)).abs().max().item()
        row = {"T": T, "C": args.C, "queries": x.shape[1], "keys": T, "max_abs_diff": diff}
        for name, way in (("fused", fused), ("sliced", sliced)):
            row[f"{name}_saved_MiB"] = round(saved_bytes(lambda: way(layer, x, lat.requires_grad_())) / 2**20, 1)
        times = {"fused": [], "sliced": []}
        for _ in range(args.repeats):
            for name, way in (("fused", fused), ("sliced", sliced)):
                times[name].append(step(layer, way, x, lat, grad))
        for name, ts in times.items():
            row[f"{name}_s"] = round(statistics.median(ts), 3)
        row["load_1min"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"preset": args.preset, "threads": 1, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
