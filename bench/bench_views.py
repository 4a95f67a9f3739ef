"""Views (issue 37): reading a 10% view against a full read with ``select()``, and ``dedup`` by
content against a full read.

    .venv/bin/python bench/bench_views.py              # 4,000 samples of 100 KB (~400 MB)
    .venv/bin/python bench/bench_views.py --samples 1000 --repeat 3   # a quick run

The data set (git-ignored, made once into ``bench/_data/views-N``): 8 plain shards of 100 KB
samples (``bin``: random bytes, ``txt``: a caption, ``cls``), written with their indexes and
manifest; 5 % of the samples repeat an earlier sample's content under another key (what
``dedup`` finds).

Measured in one run, sides interleaved, medians of ``--repeat`` passes (wall time, and this
process's CPU time: steadier on a shared host; ``dedup(by="bin")`` runs in 2 worker processes,
whose CPU time is not counted), on page-cached shards
("warm": the harder case for the view, every read costs only its copy) and, where
``posix_fadvise`` is there, on shards dropped from the page cache before each pass ("cold": read
from the disk, as a data set bigger than memory is):

1. ``WebDataset(view)``: a 10 % view (random rows, ``tarshards.view`` by keys), every sample
   read (raw bytes); against ``WebDataset(manifest).select(key in keep)``: the same samples
   found by reading everything. The same samples must come out of both. Twice: each pass
   making its ``WebDataset`` (the view file, manifest and the indexes' offsets loaded), and an
   epoch of ``WebDataset`` objects made before (as a training loop's later epochs).
2. ``tarshards.dedup(manifest, by="content")`` (the indexes' member checksums, no data read)
   against one full raw read of the data set (``WebDataset(manifest)``, every sample), and
   against ``dedup(by="bin")`` (the field read and hashed). Both dedups must find the planted
   duplicates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from common import machine_info  # noqa: E402

import tarshards  # noqa: E402
from tarshards import ShardWriter, WebDataset  # noqa: E402

SAMPLE_BYTES = 100_000
SHARDS = 8
DUP_SHARE = 0.05


def make_data(n: int) -> tuple[str, int]:
    """The data set's directory and the number of planted duplicates."""
    root = os.path.join(HERE, "_data", f"views-{n}")
    stamp = os.path.join(root, "made.json")
    rng = np.random.default_rng(0)
    dups = {
        int(j): int(rng.integers(0, j))
        for j in rng.choice(np.arange(1, n), int(n * DUP_SHARE), replace=False)
    }
    if os.path.exists(stamp):
        return root, len(dups)
    os.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    pool = [rng.bytes(SAMPLE_BYTES) for _ in range(64)]
    content = list(range(n))
    for j in sorted(dups):
        content[j] = content[dups[j]]

    def body(c: int) -> bytes:  # distinct for each content id, 100 KB
        return c.to_bytes(8, "little") + pool[c % 64][8:]

    per = -(-n // SHARDS)
    with ShardWriter(
        os.path.join(root, "v-%04d.tar"), maxcount=per, manifest=os.path.join(root, "m.json")
    ) as w:
        for i in range(n):
            c = content[i]
            w.write({"__key__": f"s{i:07d}", "bin": body(c), "txt": f"caption {c}", "cls": c % 10})
    with open(stamp, "w") as f:
        json.dump({"samples": n, "seconds": time.perf_counter() - t0}, f)
    return root, len(dups)


def drop_cache(paths) -> None:
    for p in paths:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def warm(paths) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 22):
                pass


def timed(fn, paths, cold: bool):
    if cold:
        drop_cache(paths)
    else:
        warm(paths)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return (time.perf_counter() - t0, time.process_time() - c0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--share", type=float, default=0.10, help="The view's share of the samples.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root, planted = make_data(args.samples)
    mpath = os.path.join(root, "m.json")
    m = tarshards.Manifest.load(mpath)
    paths = m.shard_urls()
    nbytes = sum(os.path.getsize(p) for p in paths)
    rng = np.random.default_rng(1)
    keep_rows = np.flatnonzero(rng.random(m.num_samples) < args.share)
    keep = {f"s{i:07d}" for i in keep_rows.tolist()}
    vpath = os.path.join(root, "ten.view.json")
    view = tarshards.view(mpath, keep, output=vpath)

    def read_view():  # made afresh: the view file, its manifest and indexes loaded
        n = 0
        for _ in WebDataset(vpath):
            n += 1
        return n

    def read_select():
        n = 0
        for _ in WebDataset(mpath).select(lambda s: s["__key__"] in keep):
            n += 1
        return n

    view_ds = WebDataset(vpath)  # an epoch of a data set made before (as in training)
    select_ds = WebDataset(mpath).select(lambda s: s["__key__"] in keep)

    def epoch_view():
        return sum(1 for _ in view_ds)

    def epoch_select():
        return sum(1 for _ in select_ds)

    def read_all():
        n = 0
        for _ in WebDataset(mpath):
            n += 1
        return n

    def dedup_content():
        return tarshards.dedup(mpath, output=None).info["removed"]

    def dedup_field():
        return tarshards.dedup(mpath, by="bin", output=None, workers=2).info["removed"]

    assert [s["__key__"] for s in WebDataset(vpath)] == [
        s["__key__"] for s in WebDataset(mpath).select(lambda s: s["__key__"] in keep)
    ]
    modes = ["warm"] + (["cold"] if hasattr(os, "posix_fadvise") else [])
    results: dict = {
        "machine": machine_info(),
        "samples": m.num_samples,
        "bytes": nbytes,
        "view_samples": len(view),
        "planted": planted,
    }
    sides = {
        "view": read_view,
        "select": read_select,
        "epoch_view": epoch_view,
        "epoch_select": epoch_select,
        "read_all": read_all,
        "dedup_content": dedup_content,
        "dedup_field": dedup_field,
    }
    for mode in modes:
        times: dict[str, list[float]] = {k: [] for k in sides}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.repeat):
            for name, fn in sides.items():
                if name == "dedup_field" and mode == "cold" and times[name]:
                    continue  # one cold pass is enough: it is a full read and more
                (t, c), out = timed(fn, paths, mode == "cold")
                if name.startswith("dedup"):
                    assert out == planted, (name, out, planted)
                elif name.endswith(("view", "select")):
                    assert out == len(view)
                times[name].append(t)
                cpu[name].append(c)
        med = {k: statistics.median(v) for k, v in times.items()}
        cmed = {k: statistics.median(v) for k, v in cpu.items()}
        results[mode] = {
            "seconds": med,
            "cpu_seconds": cmed,
            "view_vs_select_cpu": cmed["select"] / cmed["view"],
            "dedup_vs_read_all_cpu": cmed["read_all"] / cmed["dedup_content"],
            "view_vs_select": med["select"] / med["view"],
            "epoch_view_vs_select": med["epoch_select"] / med["epoch_view"],
            "epoch_view_vs_select_cpu": cmed["epoch_select"] / cmed["epoch_view"],
            "dedup_vs_read_all": med["read_all"] / med["dedup_content"],
            "dedup_vs_dedup_field": med["dedup_field"] / med["dedup_content"],
            "read_all_GBps": nbytes / med["read_all"] / 1e9,
        }
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(
        f"{m.num_samples} samples of 100 KB, {nbytes / 1e6:.0f} MB in {len(paths)} shards; "
        f"view: {len(view)} samples ({len(view) / m.num_samples:.1%}); planted duplicates: "
        f"{planted}; median of {args.repeat}"
    )
    for mode in modes:
        r = results[mode]
        s = r["seconds"]
        print(
            f"[{mode}] 10% view {s['view'] * 1e3:.1f} ms, select() over all {s['select'] * 1e3:.1f}"
            f" ms: {r['view_vs_select']:.1f}x (target >= 5x); CPU time "
            f"{r['view_vs_select_cpu']:.1f}x (each side's WebDataset made in the pass)"
        )
        print(
            f"[{mode}] the same, an epoch of WebDatasets made before: view "
            f"{s['epoch_view'] * 1e3:.1f} ms, select() {s['epoch_select'] * 1e3:.1f} ms: "
            f"{r['epoch_view_vs_select']:.1f}x; CPU time {r['epoch_view_vs_select_cpu']:.1f}x"
        )
        print(
            f"[{mode}] dedup by content {s['dedup_content'] * 1e3:.1f} ms, full read "
            f"{s['read_all'] * 1e3:.1f} ms ({r['read_all_GBps']:.1f} GB/s): "
            f"{r['dedup_vs_read_all']:.1f}x (target >= 10x; CPU time "
            f"{r['dedup_vs_read_all_cpu']:.1f}x); dedup by='bin' "
            f"{s['dedup_field'] * 1e3:.1f} ms: {r['dedup_vs_dedup_field']:.1f}x"
        )


if __name__ == "__main__":
    main()
