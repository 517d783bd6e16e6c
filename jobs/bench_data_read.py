"""The training job's data read on the driver, Ray Data's default Parquet reader against k3's.

    python jobs/bench_data_read.py [--data DIR] [--workers 2] [--repeats 3]

`k3.platform.train.launch.data_splits` reads every token shard with Ray Data and splits it into
one equal part per data-parallel group, once per run. Two ways, alternating in one private local
Ray (2 CPUs, 127.0.0.1), each timed from the call until the splits are ready, and the actors Ray
started meanwhile counted by class:

  ray_default: `ray.data.read_parquet(paths).split(n, equal=True)` with Ray's defaults (Ray 2.60:
               the DataSource V2 reader, whose file listing reads the footers through new actors);
  k3:          `data_splits` (the V1 reader, one block per shard).

Both must give the same rows in the same order. One JSON line per read, then a summary line.
Without --data the bundled corpus is prepared as the pretrain tests do (64-token rows, 256 rows a
shard, 1.5 MB of text: 24 shards).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path


def read_default(paths: list[str], n: int) -> list:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.use_datasource_v2 = ray.data.context.DEFAULT_USE_DATASOURCE_V2  # what the driver gets unset
    ctx.execution_options.preserve_order = True
    return ray.data.read_parquet(paths).split(n, equal=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a prepared data directory (default: the bundled corpus, prepared in a temp dir)")
    p.add_argument("--workers", type=int, default=2, help="splits (data-parallel groups)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.workers < 1 or args.repeats < 1:
        p.error("--workers and --repeats must be >= 1")

    import ray
    from ray._private import state

    from k3.platform.ops.local_ray import init_local_ray
    from k3.platform.train import launch
    from k3.platform.train.config import TrainConfig
    from k3.platform.train.data import prepare, read_manifest

    tmp = tempfile.TemporaryDirectory(prefix="k3-bench-data-")
    data = args.data
    if data is None:
        data = str(Path(tmp.name) / "data")
        prepare("bundled", data, vocab_size=4096, seq_len=64, rows_per_shard=256, max_bytes=1_500_000, progress=False)
    paths = read_manifest(data).shard_paths(data)
    cfg = TrainConfig(data=data, storage_path=tmp.name, name="bench", num_workers=args.workers, micro_batch=1)
    init_local_ray(num_cpus=2, log_to_driver=False)
    sides = {"ray_default": lambda: read_default(paths, args.workers), "k3": lambda: launch.data_splits(cfg)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    rows = {}
    try:
        for rep in range(args.repeats):
            for name, read in sides.items():
                before = set(state.actors())
                t = time.perf_counter()
                splits = read()
                dt = time.perf_counter() - t
                started = Counter(a["ActorClassName"] for i, a in state.actors().items() if i not in before)
                got = [[list(map(int, r["tokens"])) for r in s.take_all()] for s in splits]
                rows.setdefault(name, got)
                times[name].append(dt)
                print(json.dumps({"side": name, "repeat": rep, "read_split_s": round(dt, 3),
                                  "actors_started": dict(started), "rows_per_split": [len(g) for g in got],
                                  "load_1m": round(os.getloadavg()[0], 2)}), flush=True)
    finally:
        ray.shutdown()
        tmp.cleanup()
    print(json.dumps({"shards": len(paths), "workers": args.workers, "repeats": args.repeats,
                      "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
                      "same_rows_same_order": rows["ray_default"] == rows["k3"],
                      "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))


if __name__ == "__main__":
    main()
