"""Sidecar columns (``tarshards.add_columns``): reading one small sidecar field vs full samples,
and the bytes a sidecar costs against its base.

    .venv/bin/python bench/bench_columns.py                 # 3,000 samples of 100 KB (300 MB)
    .venv/bin/python bench/bench_columns.py --samples 1000  # a quick run

The base (``--samples`` samples of 100 KB of random bytes, 300 a shard, with a manifest) is
written once into ``bench/_data/columns-N`` (git-ignored) and reused. Measured, in one run:

1. ``add_columns(base, fn, output=...)`` with ``fn`` returning a 100-byte ``txt`` field, on the
   processes engine (2 workers): wall time, and the bytes it wrote (sidecar shards and their
   indexes) against the base's bytes (shards and indexes). A 100-byte field costs one 512-byte
   tar header and one 512-byte data block a sample: ~1 % of a 100 KB sample.
2. Reading: ``WebDataset(base)`` (every full sample) vs ``WebDataset(sidecar,
   fields=["txt"])`` (only the sidecar group is opened), samples/s, each pass iterated to its
   end, and the same through ``IndexedDataset(..., fields=["txt"])`` for 2,000 random rows.
   Cold: each file's pages dropped from the page cache first (``posix_fadvise(DONTNEED)``), as
   a data set larger than memory reads; warm: the same again with the pages cached (the base's
   read is then a memory copy). Medians of ``--repeat`` interleaved passes.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import tarshards  # noqa: E402
from tarshards import IndexedDataset, Manifest, ShardWriter, WebDataset  # noqa: E402

DATA = os.path.join(HERE, "_data")
SAMPLE = 100_000


def caption(sample):
    """A 100-byte text field (module level: the processes engine pickles it)."""
    return {"txt": (sample["__key__"] + " " + "x" * 100)[:100]}


def make_base(n: int) -> str:
    folder = os.path.join(DATA, f"columns-{n}")
    manifest = os.path.join(folder, "base", "manifest.json")
    if os.path.exists(manifest):
        return manifest
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "base"))
    t0 = time.perf_counter()
    with ShardWriter(
        os.path.join(folder, "base", "b-%06d.tar"), maxcount=300, manifest=manifest
    ) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:08d}", "bin": os.urandom(SAMPLE)})
    print(f"base written: {n} samples in {time.perf_counter() - t0:.1f} s")
    return manifest


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_of(folder: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(folder, "*")) if os.path.isfile(p)]


def read_all(ds) -> tuple[int, int]:
    n = nbytes = 0
    for s in ds:
        n += 1
        nbytes += sum(len(v) for k, v in s.items() if not k.startswith("__"))
    return n, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    base = make_base(args.samples)
    folder = os.path.dirname(os.path.dirname(base))
    cols_dir = os.path.join(folder, "cols")
    shutil.rmtree(cols_dir, ignore_errors=True)
    side = os.path.join(cols_dir, "manifest.json")

    t0 = time.perf_counter()
    m = tarshards.add_columns(base, caption, output=side, name="caption", workers=2, progress=False)
    t_add = time.perf_counter() - t0
    base_bytes = sum(os.path.getsize(p) for p in files_of(os.path.dirname(base)))
    side_bytes = sum(os.path.getsize(p) for p in files_of(cols_dir) if not p.endswith(".json"))
    shard_bytes = sum(r.nbytes for r in m.columns[0].shards)
    print(
        f"add_columns: {args.samples} samples in {t_add:.2f} s "
        f"({args.samples / t_add:,.0f} samples/s, {base_bytes / t_add / 1e6:,.0f} MB/s of base); "
        f"wrote {side_bytes:,} bytes (shards {shard_bytes:,} + indexes "
        f"{side_bytes - shard_bytes:,}) = {100 * side_bytes / base_bytes:.2f} % of the base's "
        f"{base_bytes:,} ({side_bytes / args.samples:,.0f} bytes a sample)"
    )
    assert Manifest.load(side).columns[0].fields == ("txt",)

    base_files = files_of(os.path.dirname(base))
    side_files = files_of(cols_dir)
    results: dict[str, list[float]] = {}

    def timed(name, make, files, cold):
        if cold:
            drop_cache(files)
        t = time.perf_counter()
        n, nbytes = read_all(make())
        dt = time.perf_counter() - t
        assert n == args.samples or name.startswith("random"), (name, n)
        results.setdefault(name, []).append(n / dt)
        return nbytes

    import random

    rows = random.Random(0).sample(range(args.samples), min(2000, args.samples))

    def rand_side():
        ids = IndexedDataset(side, fields=["txt"])
        return (ids[i] for i in rows)

    def rand_base():
        ids = IndexedDataset(base)
        return (ids[i] for i in rows)

    for _ in range(args.repeat):
        for cold in (True, False):
            tag = "cold" if cold else "warm"
            if not cold:  # the pages in cache
                read_all(WebDataset(base))
                read_all(WebDataset(side, fields=["txt"]))
            timed(f"full samples, {tag}", lambda: WebDataset(base), base_files, cold)
            timed(
                f"sidecar txt, {tag}",
                lambda: WebDataset(side, fields=["txt"]),
                side_files,
                cold,
            )
            timed(f"random full, {tag}", rand_base, base_files, cold)
            timed(f"random sidecar txt, {tag}", rand_side, side_files, cold)
    med = {k: statistics.median(v) for k, v in results.items()}
    for tag in ("cold", "warm"):
        full, txt = med[f"full samples, {tag}"], med[f"sidecar txt, {tag}"]
        rf, rt = med[f"random full, {tag}"], med[f"random sidecar txt, {tag}"]
        print(
            f"{tag}: sequential full {full:,.0f} samples/s ({full * SAMPLE / 1e6:,.0f} MB/s), "
            f"sidecar txt only {txt:,.0f} samples/s: {txt / full:.1f}x; "
            f"random ds[i] full {rf:,.0f}/s, txt only {rt:,.0f}/s: {rt / rf:.1f}x"
        )


if __name__ == "__main__":
    main()
