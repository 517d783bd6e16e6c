"""Model benchmark: CPU forward throughput and cache memory, printed as JSON.

    python jobs/bench_model.py [--seq-len 512] [--repeats 3] [--skip-small]

- forward tokens/s (no grad, fp32, this machine's threads) for k3-tiny and k3-small;
- cache bytes of k3 against the same configuration with every layer MLA, per token and per
  sequence at several context lengths (bf16 latents, fp32 KDA state).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from k3.model import K3ForCausalLM, get_preset
from k3.model.cache import KDACacheSpec, MLACacheSpec, cache_bytes, layer_cache_specs

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--seq-len", type=int, default=512)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--skip-small", action="store_true", help="only k3-tiny (k3-small needs ~4 GB and a minute)")
args = p.parse_args()

result = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                      "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
          "forward": {}, "cache": {}}

for name in ["k3-tiny"] + ([] if args.skip_small else ["k3-small"]):
    torch.manual_seed(0)
    cfg = get_preset(name)
    model = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    with torch.no_grad():
        model(ids[:, :64])  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t)
    best = min(times)
    result["forward"][name] = {"params": sum(p.numel() for p in model.parameters()), "batch": args.batch,
                               "seq_len": args.seq_len, "best_s": round(best, 4),
                               "tokens_per_s": round(args.batch * args.seq_len / best, 1)}
    del model

k3 = get_preset("k3")
all_mla = k3.replace(layer_types=["mla"] * k3.num_layers)
dt = torch.bfloat16
for label, cfg in (("k3", k3), ("k3_all_mla", all_mla)):
    specs = layer_cache_specs(cfg)
    per_token = sum(s.bytes_per_token(dt) for s in specs if isinstance(s, MLACacheSpec))
    fixed = sum(s.bytes_per_sequence(dt) for s in specs if isinstance(s, KDACacheSpec))
    result["cache"][label] = {
        "mla_layers": sum(isinstance(s, MLACacheSpec) for s in specs),
        "bytes_per_token": per_token, "fixed_bytes_per_sequence": fixed,
        "bytes_per_sequence": {str(n): cache_bytes(cfg, n, dt) for n in (4096, 32768, 131072, 1_048_576)},
    }
c = result["cache"]
c["per_token_ratio"] = round(c["k3"]["bytes_per_token"] / c["k3_all_mla"]["bytes_per_token"], 4)
c["expected_ratio_24_over_93"] = round(24 / 93, 4)
c["break_even_tokens"] = c["k3"]["fixed_bytes_per_sequence"] // (c["k3_all_mla"]["bytes_per_token"]
                                                                  - c["k3"]["bytes_per_token"])
print(json.dumps(result, indent=2))
