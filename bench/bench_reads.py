"""Raw local reads of 100 KB samples against ``cat``, in the page-cache states a shard is read in.

    .venv/bin/python bench/bench_reads.py              # 5 interleaved rounds
    .venv/bin/python bench/bench_reads.py --rounds 9 --quick

The issue (41, item 5): a shard read from pages its writer left in the page cache (every shard
the cache downloads, every shard a conversion just wrote) read at 0.70x ``cat``, against 0.89x
after a fresh sequential read (the memory-mapped path: small page-cache folios). This script
measures the read methods in each state, side by side, so that the method is chosen by
measurement:

States (the same samples, ``bench/_data/large``: ~100 KB JPEGs + ``cls``, 8 x 500 samples):

* ``writer``: shards rewritten by ``tarshards.TarWriter`` just before (the pages it left);
* ``64k-writes``: shards copied with 64 KB ``write()`` calls (a downloader's pages);
* ``fresh``: the original shards dropped from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``)
  and read once sequentially (``common.warm_cache(fresh=True)``).

(Reading never changes the folios a file's pages are cached in, so each state holds for every
round.) Methods:

* ``cat``: ``cat FILES > /dev/null`` (``common.null_sink()``: a device that discards);
* ``ours``: ``tarshards.WebDataset(urls)`` iterated (raw sample dicts: bench/run.py's row 2),
  which reads a local plain shard with ``pread``: a member its buffer cuts straight into the
  member's ``bytes`` (one copy, no page faults);
* ``ours:mapped``: the same as it was before (the shard memory-mapped, each member copied out
  of the map: one copy, a page fault per folio or per 64 KB of fault-around);
* ``reader:mmap``, ``reader:read``, ``reader:pread``: the tar reader alone (no samples
  grouped) over the map, over ``read()`` into its reused buffer (two copies), and with
  ``pread`` as ``ours``;
* floors, no tar parsing (the member ranges known in advance): ``floor:mmap`` slices each member
  out of a map (one copy, the map's page faults), ``floor:pread`` reads each member straight into
  its own ``bytes`` with ``os.pread`` (one copy, no faults), ``floor:readinto`` is ``cat`` in
  Python (1 MiB ``readinto`` into one reused buffer).

Two clocks: CPU seconds (this process's, and the ``cat`` child's user+sys: stable on a shared
host, where other jobs' load moves wall-clock rates by 2x between rounds) and wall seconds; best
of ``--rounds`` interleaved rounds for each. Ratios are ``cat``'s time over the method's (>= 0.85
is the target). Minor page faults per pass are printed beside the CPU figures.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import common  # noqa: E402


def writer_copies(paths, folder) -> list[str]:
    """The shards rewritten by TarWriter (raw bytes), into ``folder``."""
    from tarshards import TarWriter
    from tarshards.pipeline import iter_samples

    os.makedirs(folder, exist_ok=True)
    out = []
    for p in paths:
        q = os.path.join(folder, os.path.basename(p))
        samples = [{k: v for k, v in s.items() if k != "__url__"} for s in iter_samples([p])]
        with TarWriter(q, encoder=False) as w:
            for s in samples:
                w.write(s)
        out.append(q)
    return out


def plain_copies(paths, folder, block: int = 1 << 16) -> list[str]:
    """The shards copied with ``block``-byte ``write()`` calls, into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    out = []
    for p in paths:
        q = os.path.join(folder, os.path.basename(p))
        with open(p, "rb") as f, open(q + ".tmp", "wb", buffering=0) as g:
            while chunk := f.read(block):
                g.write(chunk)
        os.replace(q + ".tmp", q)
        out.append(q)
    return out


def cat(paths) -> None:
    with open(common.null_sink(), "wb") as sink:
        subprocess.run(["cat", *paths], stdout=sink, check=True)


def ours(paths) -> int:
    from tarshards.pipeline import WebDataset

    return sum(1 for _ in WebDataset(paths))


def ours_mapped(paths) -> int:
    """``ours`` as it read local shards before pread: memory-mapped."""
    import tarshards.tario.buffer as buffer

    real = buffer.direct_local
    buffer.direct_local = lambda stream, length=-1: None  # type: ignore[assignment]
    try:
        return ours(paths)
    finally:
        buffer.direct_local = real


def reader(paths, **how) -> int:
    """The tar reader alone (no samples grouped): ``tar_byte_source(f, **how)``."""
    from tarshards.tario import iter_tar_batches, tar_byte_source

    n = 0
    for p in paths:
        with open(p, "rb") as f:
            for batch in iter_tar_batches(tar_byte_source(f, p, **how), p):
                n += len(batch)
    return n


_RANGES: dict = {}


def member_ranges(path) -> list[tuple[int, int]]:
    """(data offset, size) of each member (ustar members: the data follows the header)."""
    r = _RANGES.get(path)
    if r is None:
        from tarshards.tario import iter_tar_batches, tar_byte_source

        r = []
        with open(path, "rb") as f:
            for batch in iter_tar_batches(tar_byte_source(f, path), path, copy=False):
                r += [(off + 512, len(data)) for _, data, off in batch]
        _RANGES[path] = r
    return r


def floor_mmap(paths) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            for at, size in member_ranges(p):
                m[at : at + size]
                n += 1
            m.close()
    return n


def floor_pread(paths) -> int:
    n = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            for at, size in member_ranges(p):
                os.pread(fd, size, at)
                n += 1
        finally:
            os.close(fd)
    return n


def floor_readinto(paths) -> int:
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return 0


METHODS = {
    "cat": cat,
    "ours": ours,
    "ours:mapped": ours_mapped,
    "reader:mmap": lambda paths: reader(paths),
    "reader:read": lambda paths: reader(paths, mapped=False),
    "reader:pread": lambda paths: reader(paths, direct=True),
    "floor:mmap": floor_mmap,
    "floor:pread": floor_pread,
    "floor:readinto": floor_readinto,
}


def measure(states: dict, rounds: int) -> dict:
    for ps in states.values():
        for p in ps:
            member_ranges(p)
    best: dict = {}
    faults: dict = {}
    for _ in range(rounds):
        for state, ps in states.items():
            for name, fn in METHODS.items():
                c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                s0 = resource.getrusage(resource.RUSAGE_SELF)
                w0, t0 = time.perf_counter(), time.process_time()
                fn(ps)
                t1, w1 = time.process_time(), time.perf_counter()
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                s1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = t1 - t0 + (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
                key = (state, name)
                old = best.get(key, (float("inf"), float("inf")))
                best[key] = (min(old[0], cpu), min(old[1], w1 - w0))
                faults[key] = (s1.ru_minflt - s0.ru_minflt) + (c1.ru_minflt - c0.ru_minflt)
    return {"best": best, "faults": faults}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the smaller 100 KB data set")
    args = ap.parse_args()
    paths = common.make_dataset("large", quick=args.quick)
    tag = "large-q" if args.quick else "large"
    states = {
        "writer": writer_copies(paths, os.path.join(common.DATA, f"{tag}-writer")),
        "64k-writes": plain_copies(paths, os.path.join(common.DATA, f"{tag}-64k")),
        "fresh": paths,
    }
    common.warm_cache(paths, fresh=True)
    res = measure(states, args.rounds)
    mb = common.total_bytes(paths) / 1e6
    print(f"raw 100 KB reads vs cat: {mb:.0f} MB, best of {args.rounds} rounds")
    print(f"   {common.machine_info().get('cpu', '')}, kernel {os.uname().release}")
    for state in states:
        cat_cpu, cat_wall = res["best"][state, "cat"]
        print(f"\n   page cache: {state}")
        head = f"{'CPU MB/s':>9s} {'x cat':>6s} {'faults':>7s}   {'wall MB/s':>9s} {'x cat':>6s}"
        print(f"   {'':16s} {head}")
        for name in METHODS:
            cpu, wall = res["best"][state, name]
            print(
                f"   {name:16s} {mb / cpu:9.0f} {cat_cpu / cpu:6.2f} "
                f"{res['faults'][state, name]:7d}   {mb / wall:9.0f} {cat_wall / wall:6.2f}"
            )


if __name__ == "__main__":
    main()
