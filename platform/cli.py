"""The `k3` command line.

    k3 params --preset k3 [--json]      total and active parameter counts (meta device, no memory)
    k3 params --preset k3 --release-layout   also count the K3 release's tensor layout
    k3 presets                          list the presets
    k3 config --preset k3-tiny          print a preset's config as JSON
"""
from __future__ import annotations

import argparse
import json
import sys

from k3.model.config import PRESETS, get_preset
from k3.model.params import count_parameters, count_release_parameters, count_vision_parameters


def _human(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3f}{unit}"
    return str(n)


def cmd_params(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
    c = count_parameters(cfg)
    v = count_vision_parameters(cfg)
    r = count_release_parameters(cfg) if args.release_layout else None
    if args.json:
        extra = ({} if v is None else {"vision": v.as_dict()}) | ({} if r is None else {"release_layout": r.as_dict()})
        print(json.dumps({"preset": args.preset, **c.as_dict(), **extra}, indent=2))
        return 0
    print(f"preset          {args.preset}")
    print(f"total           {c.total:>20,}  ({_human(c.total)})")
    print(f"active/token    {c.active:>20,}  ({_human(c.active)})")
    print(f"  embedding     {c.embedding:>20,}  (input embedding, not counted as active)")
    print(f"  routed experts{c.routed_experts:>20,}  ({cfg.num_experts_per_token} of {cfg.num_experts} active per MoE layer)")
    print(f"  attention     {c.attention:>20,}")
    if v is not None:
        print(f"vision tower    {v.tower:>20,}  ({_human(v.tower)}, MoonViT-V2)")
        print(f"mm projector    {v.projector:>20,}  ({_human(v.projector)}, PatchMergerV2)")
    print(f"note: {c.note}" + ("; the totals above are the language model, vision is listed apart" if v else ""))
    if r is not None:
        print(f"release layout  {r.total:>20,}  ({_human(r.total)}; language model, MXFP4 experts counted unpacked)")
        print(f"  difference    {r.total - r.k3_total:>20,}  = AttnRes norm weights {r.attn_res_norms:,} (k3 folds "
              f"each into its pseudo-query) + A_log padding {r.a_log_padding:,} + router correction bias "
              f"{r.router_bias:,} (a buffer in k3)")
        print(f"  MXFP4 scales  {r.mxfp4_scales:>20,}  (one E8M0 byte per 32 expert weights, not counted)")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    for name in PRESETS:
        cfg = get_preset(name)
        print(f"{name:22s} layers={cfg.num_layers:3d} hidden={cfg.hidden_size:5d} experts={cfg.num_experts:4d} "
              f"top_k={cfg.num_experts_per_token:2d} mla_layers={cfg.layer_types.count('mla')}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(get_preset(args.preset).to_json())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="k3: train and serve Kimi K3-architecture models on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("params", help="total and active parameter counts of a preset")
    sp.add_argument("--preset", required=True, choices=sorted(PRESETS), help="preset name")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.add_argument("--release-layout", action="store_true",
                    help="also count the release checkpoint's tensors (config.json names, MXFP4 experts)")
    sp.set_defaults(func=cmd_params)
    sp = sub.add_parser("presets", help="list presets")
    sp.set_defaults(func=cmd_presets)
    sp = sub.add_parser("config", help="print a preset's config as JSON")
    sp.add_argument("--preset", required=True, choices=sorted(PRESETS))
    sp.set_defaults(func=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
