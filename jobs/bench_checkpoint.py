"""Release-checkpoint loading: time, peak memory and bytes read per expert-parallel rank; MXFP4 speed.

    python jobs/bench_checkpoint.py [--experts 32] [--hidden 512] [--layers 4] [--out /tmp/k3-bench]

Top to bottom: export a random K3-architecture model in the release layout (bf16 weights, MXFP4
experts, 16 MiB shards), then load it once
per ep_size in a fresh subprocess (rank 0 of ep_size, fp32), resetting the peak resident size
just before the load; then time an export (save_k3) and the MXFP4 pack/unpack. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from k3.model import K3ForCausalLM, get_preset
from k3.model.hf_k3 import load_k3, save_k3
from k3.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--experts", type=int, default=32)
p.add_argument("--hidden", type=int, default=512, help="hidden size; the experts' latent and intermediate width too")
p.add_argument("--layers", type=int, default=4, help="decoder layers (the first dense, the rest MoE)")
p.add_argument("--out", default="/tmp/k3-bench-release")
args = p.parse_args()
torch.set_num_threads(1)

# 1. A random K3-architecture model exported in the release layout (64 MiB shards: the experts of
# one layer span several, so a rank's experts and another's mostly sit in different shards).
D, L = args.hidden, args.layers
cfg = get_preset("k3-tiny", hidden_size=D, intermediate_size=2 * D, num_layers=L,
                 layer_types=["mla" if (i + 1) % 4 == 0 else "kda" for i in range(L)],
                 mlp_types=["dense"] + ["moe"] * (L - 1), num_experts=args.experts, moe_intermediate_size=D,
                 moe_latent_size=D, kda_num_heads=D // 128, kda_head_dim=128, num_heads=D // 128)
torch.manual_seed(0)
out = Path(args.out)
t0 = time.perf_counter()
save_k3(K3ForCausalLM(cfg), out, max_shard_bytes=16 << 20)
write_s = time.perf_counter() - t0

# 2. Load rank 0 of ep_size in a fresh process each.
_LOAD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from k3.model.hf_k3 import CheckpointReader, load_k3
from k3.model import K3ForCausalLM, get_preset
path, ep = sys.argv[1], int(sys.argv[2])
with torch.device("meta"):  # pulls in torch's lazy imports (dynamo, ~100 MB) before the measurement
    K3ForCausalLM(get_preset("k3-tiny"))
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS:")
r = CheckpointReader(path)
t = time.perf_counter()
m = load_k3(path, dtype=torch.float32, ep_rank=0, ep_size=ep, reader=r)
sec = time.perf_counter() - t
nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
read = sum(r.get(n).numel() * r.get(n).element_size() for n in list(r.reads))
print(json.dumps({"ep_size": ep, "load_s": round(sec, 2), "peak_rss_growth_mb": round((status("VmHWM:") - base) / 2**20, 1),
                  "model_mb": round(nbytes / 2**20, 1), "tensors_read": len(r.reads), "read_mb": round(read / 2**20, 1),
                  "shards_opened": len(r.opened)}))
"""
loads = []
for ep in (1, 2, 4):
    res = subprocess.run([sys.executable, "-c", _LOAD, str(out), str(ep)], capture_output=True, text=True, check=True)
    loads.append(json.loads(res.stdout))

# 3. Export, and MXFP4 on one expert-sized matrix.
model = load_k3(out)
t0 = time.perf_counter()
save_k3(model, out.with_name(out.name + "-export"), max_shard_bytes=64 << 20)
export_s = time.perf_counter() - t0
w = torch.randn(D, D) * 0.02
t0 = time.perf_counter()
packed, scale = quantize_mxfp4(w)
q_s = time.perf_counter() - t0
t0 = time.perf_counter()
dequantize_mxfp4(packed, scale)
dq_s = time.perf_counter() - t0
print(json.dumps({"config": {"hidden": D, "layers": L, "experts": args.experts},
                  "checkpoint_mb": round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20, 1),
                  "write_s": round(write_s, 2), "loads": loads, "export_s": round(export_s, 2),
                  "mxfp4_quantize_melem_s": round(w.numel() / q_s / 1e6, 1),
                  "mxfp4_dequantize_melem_s": round(w.numel() / dq_s / 1e6, 1)}, indent=2))
