"""The key table (``tarshards.KeyIndex``): build time, lookups per second, memory, size per key.

    .venv/bin/python bench/bench_keyindex.py                  # 10M keys (1,000 shards x 10,000)
    .venv/bin/python bench/bench_keyindex.py --keys 1000000   # a quick run
    .venv/bin/python bench/bench_keyindex.py --no-sqlite      # without the SQLite peer

The shard indexes are made directly from arrays (``ShardIndex(...)`` and ``ManifestRecorder``:
one member per sample, keys ``img-%012d``, 16 bytes), so no tar shard is written: the key table
reads only the indexes. They are made once into ``bench/_data/keyindex-N`` (git-ignored) and
reused; the time they took is printed.

Measured, in one run:

1. ``KeyIndex.build`` with 1 worker and with 2 (the processes engine), wall time and keys/s; the
   peak resident memory of this process and of the worker processes (``ru_maxrss``).
2. ``KeyIndex.open`` (memory-mapped, the table's pages dropped from the page cache first) and
   single lookups ``ki[key]`` of random keys per second, one at a time in a Python loop: the
   first 1,000 (from disk), then all (the table's pages coming in), the same again (warm), and
   absent keys; the resident memory after them.
3. Vectorised ``ki.lookup(keys)`` of random keys in batches of 100,000, keys/s.
4. Bytes on disk per key.
5. The peer: SQLite (stdlib ``sqlite3``), the store of Megatron-Energon's index: a table
   ``(key TEXT PRIMARY KEY, shard INTEGER, row INTEGER) WITHOUT ROWID`` filled with
   ``executemany`` in shard order in one transaction (journal off, synchronous off: its fastest
   setting), then single ``SELECT``s of the same random keys; ratios against it. (Energon's own
   index also holds byte offsets and builds by reading every tar; its issue #231 reports over 13
   hours for 244M rows.)

Finally the projection to 1B keys: the build scales as n log n at most (the merge is linear in
the keys; the sort of each range is over ``chunk_keys`` keys), so it is taken linear from the
10M figure, and memory stays at the merge's chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sqlite3
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from tarshards.curate import KeyIndex  # noqa: E402
from tarshards.format.index import ShardIndex  # noqa: E402
from tarshards.format.manifest import ManifestRecorder  # noqa: E402

DATA = os.path.join(HERE, "_data")
KEY_LEN = 16


def key_of(i: int) -> str:
    return f"img-{i:012d}"


def key_blob(first: int, n: int) -> bytes:
    """``key_of(first) ... key_of(first + n - 1)`` back to back, made with numpy."""
    idx = np.arange(first, first + n, dtype=np.int64)
    digits = (idx[:, None] // (10 ** np.arange(11, -1, -1, dtype=np.int64))) % 10 + 48
    out = np.empty((n, KEY_LEN), np.uint8)
    out[:, :4] = np.frombuffer(b"img-", np.uint8)
    out[:, 4:] = digits
    return out.tobytes()


def shard_index(shard: int, first: int, n: int) -> ShardIndex:
    size = np.full(n, 100_000, np.int64)
    starts = np.arange(n, dtype=np.int64) * (512 + 100_352)
    return ShardIndex(
        sample_offsets=starts,
        sample_ends=starts + 512 + 100_352,
        tar_offsets=starts,
        sample_flags=np.zeros(n, np.uint8),
        key_offsets=np.arange(n + 1, dtype=np.int64) * KEY_LEN,
        key_blob=np.frombuffer(key_blob(first, n), np.uint8),
        member_sample=np.arange(n, dtype=np.uint32),
        member_ext=np.zeros(n, np.uint16),
        member_offsets=starts,
        member_data_offsets=starts + 512,
        member_sizes=size,
        member_checksums=np.arange(first, first + n, dtype=np.uint64),
        extensions=("jpg",),
        nbytes=int(n * (512 + 100_352) + 1024),
        hash=f"xxh3_64:{shard:016x}",
    )


def make_set(keys: int, per_shard: int) -> tuple[str, float]:
    folder = os.path.join(DATA, f"keyindex-{keys}-{per_shard}")
    manifest = os.path.join(folder, "manifest.json")
    if os.path.exists(manifest):
        with open(os.path.join(folder, "made.json")) as f:
            return manifest, json.load(f)["seconds"]
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    t0 = time.perf_counter()
    with ManifestRecorder(manifest) as rec:
        for s, first in enumerate(range(0, keys, per_shard)):
            n = min(per_shard, keys - first)
            rec.add(os.path.join(folder, f"shard-{s:06d}.tar"), shard_index(s, first, n))
        rec.save()
    seconds = time.perf_counter() - t0
    with open(os.path.join(folder, "made.json"), "w") as f:
        json.dump({"seconds": seconds}, f)
    return manifest, seconds


def rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[name] = int(value.split()[0]) * 1024
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def drop_cache(path: str) -> None:
    """Ask the kernel to drop the table's pages (posix_fadvise DONTNEED), so the first lookups
    read from disk as after a reboot would not: best effort."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a table just built) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_build(manifest: str, out: str, workers: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    t0 = time.perf_counter()
    ki = KeyIndex.build(manifest, out, workers=workers)
    seconds = time.perf_counter() - t0
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {
        "workers": workers,
        "seconds": seconds,
        "keys_per_s": len(ki) / seconds,
        "peak_rss_self": rss()["VmHWM"],
        "peak_rss_workers": children if children > before else None,
        "keys": len(ki),
        "nbytes": ki.nbytes,
    }


def bench_lookups(
    path: str, manifest: str, keys: int, per_shard: int, n_single: int, n_vector: int
) -> dict:
    rng = random.Random(1)
    drop_cache(path)
    t0 = time.perf_counter()
    ki = KeyIndex.open(path, manifest=manifest)
    open_s = time.perf_counter() - t0
    present = [key_of(rng.randrange(keys)) for _ in range(n_single)]
    absent = [f"img-{rng.randrange(10**12, 10**13)}" for _ in range(n_single)]
    rss0 = rss()
    t0 = time.perf_counter()
    cold = [ki[k] for k in present[:1000]]
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = [ki[k] for k in present]
    single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = [ki[k] for k in present]  # the same keys: their pages now mapped
    warm_s = time.perf_counter() - t0
    assert again == got
    t0 = time.perf_counter()
    miss = [ki.get(k) for k in absent]
    absent_s = time.perf_counter() - t0
    assert all(g is None for g in miss) and len(cold) == 1000
    for k, (url, row) in zip(present[:100], got[:100]):  # the right shard and row
        i = int(k[4:])
        assert row == i % per_shard and url.endswith(f"shard-{i // per_shard:06d}.tar")
    rss1 = rss()
    batch = 100_000
    vkeys = [key_of(i) for i in np.random.default_rng(2).integers(0, keys, n_vector).tolist()]
    t0 = time.perf_counter()
    found = 0
    for a in range(0, n_vector, batch):
        shard, _ = ki.lookup(vkeys[a : a + batch])
        found += int((shard >= 0).sum())
    vector_s = time.perf_counter() - t0
    assert found == n_vector
    return {
        "open_s": open_s,
        "cold_single_per_s": 1000 / cold_s,
        "single_per_s": n_single / single_s,
        "warm_single_per_s": n_single / warm_s,
        "absent_per_s": n_single / absent_s,
        "vector_per_s": n_vector / vector_s,
        "rss_before": rss0,
        "rss_after_single": rss1,
        "rss_after_vector": rss(),
    }


def bench_sqlite(manifest: str, keys: int, per_shard: int, n_single: int) -> dict:
    path = os.path.join(os.path.dirname(manifest), "peer.sqlite")
    if os.path.exists(path):
        os.remove(path)
    t0 = time.perf_counter()
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=OFF")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("CREATE TABLE k (key TEXT PRIMARY KEY, shard INTEGER, row INTEGER) WITHOUT ROWID")
    for s, first in enumerate(range(0, keys, per_shard)):
        n = min(per_shard, keys - first)
        db.executemany(
            "INSERT INTO k VALUES (?, ?, ?)", ((key_of(first + r), s, r) for r in range(n))
        )
    db.commit()
    build_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    rng = random.Random(1)
    present = [key_of(rng.randrange(keys)) for _ in range(n_single)]
    q = "SELECT shard, row FROM k WHERE key = ?"
    t0 = time.perf_counter()
    got = [db.execute(q, (k,)).fetchone() for k in present]
    single_s = time.perf_counter() - t0
    assert all(g is not None for g in got)
    db.close()
    os.remove(path)
    return {"build_s": build_s, "single_per_s": n_single / single_s, "nbytes": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--per-shard", type=int, default=10_000)
    p.add_argument("--single", type=int, default=200_000, help="single lookups timed")
    p.add_argument("--vector", type=int, default=2_000_000, help="vectorised lookups timed")
    p.add_argument("--no-sqlite", action="store_true")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    manifest, made_s = make_set(args.keys, args.per_shard)
    print(
        f"{args.keys:,} keys in {-(-args.keys // args.per_shard):,} shard indexes "
        f"(made from arrays in {made_s:.1f} s, reused when present)"
    )
    out = os.path.join(os.path.dirname(manifest), "keys.tski")
    builds = []
    for workers in (1, 2):
        shutil.rmtree(out, ignore_errors=True)
        b = bench_build(manifest, out, workers)
        builds.append(b)
        print(
            f"build, {workers} worker(s): {b['seconds']:.1f} s = {b['keys_per_s']:,.0f} keys/s; "
            f"peak RSS {mb(b['peak_rss_self'])} here"
            + (f", {mb(b['peak_rss_workers'])} a worker" if b["peak_rss_workers"] else "")
        )
    size = builds[-1]["nbytes"]
    print(f"on disk: {mb(size)} = {size / args.keys:.1f} bytes/key ({KEY_LEN}-byte keys)")
    lk = bench_lookups(out, manifest, args.keys, args.per_shard, args.single, args.vector)
    print(f"open (memory-mapped, page cache dropped): {lk['open_s'] * 1e3:.1f} ms")
    print(f"single lookups ki[key], first 1,000 from disk: {lk['cold_single_per_s']:,.0f}/s")
    print(
        f"single lookups ki[key], present: {lk['single_per_s']:,.0f}/s (the same keys again: "
        f"{lk['warm_single_per_s']:,.0f}/s); absent (ki.get): {lk['absent_per_s']:,.0f}/s"
    )
    print(f"vectorised ki.lookup(keys), batches of 100,000: {lk['vector_per_s']:,.0f} keys/s")
    r0, r1, r2 = lk["rss_before"], lk["rss_after_single"], lk["rss_after_vector"]
    print(
        f"resident after open: {mb(r0['RssAnon'])} anon + {mb(r0['RssFile'])} file; after "
        f"{args.single:,} random lookups: {mb(r1['RssAnon'])} + {mb(r1['RssFile'])}; after "
        f"{args.vector:,} vectorised: {mb(r2['RssAnon'])} + {mb(r2['RssFile'])}"
    )
    peer = None
    if not args.no_sqlite:
        peer = bench_sqlite(manifest, args.keys, args.per_shard, args.single)
        best = min(b["seconds"] for b in builds)
        print(
            f"peer SQLite (Energon's store): build {peer['build_s']:.1f} s "
            f"({best / peer['build_s']:.2f}x KeyIndex's time: "
            f"KeyIndex {peer['build_s'] / best:.1f}x faster), "
            f"{peer['single_per_s']:,.0f} lookups/s (KeyIndex "
            f"{lk['single_per_s'] / peer['single_per_s']:.2f}x), "
            f"{mb(peer['nbytes'])} on disk ({peer['nbytes'] / args.keys:.1f} bytes/key)"
        )
    best = min(b["seconds"] for b in builds)
    scale = 1e9 / args.keys
    print(
        f"projection to 1B keys (linear): build {best * scale / 60:,.0f} min on this machine, "
        f"{size * scale / 1e9:,.0f} GB on disk; Energon: over 13 h for 244M rows (#231)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "keys": args.keys,
                    "made_s": made_s,
                    "builds": builds,
                    "lookups": lk,
                    "sqlite": peer,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
