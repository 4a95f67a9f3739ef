"""Loader efficiency: two workers against one process, with and without the shared-memory transport.

    .venv/bin/python bench/bench_loader.py [--quick] [--repeat 3]

On the small shards of ``common.py`` (96x96 JPEGs), the pipeline
``WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls").batched(64)`` is run:

1. in one process (the reference the 2-worker rows are divided by);
2. ``WebLoader(ds, batch_size=None, num_workers=2)`` with the shared-memory transport (default);
3. the same with ``transport=None`` (DataLoader's own path: a shared-memory segment per tensor);
4. ``torch.utils.data.DataLoader(ds_unbatched, batch_size=64, num_workers=2)`` (batching in the
   loader, as many users write it).

Each row runs in a fresh process, rows alternate, the median of ``--repeat`` runs is kept.
Samples/s are counted from the first batch (worker start-up excluded). Target (issue 15): row 2
>= 1.6x row 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

ROWS = ["single", "webloader_shm", "webloader_plain", "dataloader_bs64"]


def child(row: str, quick: bool) -> dict:
    import torch

    import common
    from tarshards import WebDataset, WebLoader

    torch.set_num_threads(1)
    urls = common.make_dataset("small", quick=quick)

    def batched():
        return WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls").batched(64)

    if row == "single":
        source = batched()
    elif row == "webloader_shm":
        source = WebLoader(batched(), batch_size=None, num_workers=2)
    elif row == "webloader_plain":
        source = WebLoader(batched(), batch_size=None, num_workers=2, transport=None)
    else:
        ds = WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls")
        source = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2)
    t0 = time.perf_counter()
    it = iter(source)
    first = next(it)
    t1 = time.perf_counter()
    n = 0
    for _x, y in it:
        n += len(y)
    t2 = time.perf_counter()
    return {"rate": n / (t2 - t1), "startup_s": t1 - t0, "items": n + len(first[1])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quick)))
        return
    import common

    common.make_dataset("small", quick=args.quick)  # once, before any timing
    runs: dict[str, list] = {r: [] for r in ROWS}
    for _ in range(args.repeat):
        for row in ROWS:
            cmd = [sys.executable, __file__, "--child", row] + (["--quick"] if args.quick else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[row].append(json.loads(out.stdout.strip().splitlines()[-1]))
    single = statistics.median(r["rate"] for r in runs["single"])
    print(f"{'row':<18} {'samples/s':>10} {'x single':>9}  start-up")
    for row in ROWS:
        rate = statistics.median(r["rate"] for r in runs[row])
        start = statistics.median(r["startup_s"] for r in runs[row])
        print(f"{row:<18} {rate:10,.0f} {rate / single:9.2f}  {start:.2f}s")


if __name__ == "__main__":
    main()
