"""Raw local reads of 100 KB samples against ``cat``, in the page-cache states a shard is read in.

    .venv/bin/python bench/bench_reads.py              # 5 interleaved rounds (~40 s)
    .venv/bin/python bench/bench_reads.py --rounds 3   # one short run (~30 s)
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

Beside them, litdata (``bench/.venv``, see ``bench_index.py``; ``--peer-python``): its
``StreamingDataset`` over its own copy of the samples (``litdata.optimize``, 64 MB chunks) in
the same three states (written by ``optimize`` in this run; copied with 64 KB writes; dropped and
read once), values copied into ``bytes`` (``litdata:bytes``: values the consumer owns, as ours)
and as it hands them out (``litdata:views``, memoryviews into its chunk); CPU seconds of all its
threads, best of ``--rounds`` passes in one process per state. A summary prints each ratio.

Two clocks: CPU seconds (this process's, and the ``cat`` child's user+sys: stable on a shared
host, where other jobs' load moves wall-clock rates by 2x between rounds) and wall seconds; best
of ``--rounds`` interleaved rounds for each. Ratios are ``cat``'s time over the method's (>= 0.85
is the target). Minor page faults per pass are printed beside the CPU figures.
"""

from __future__ import annotations

import argparse
import json
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
    from tarshards.pipeline.dataset import iter_samples

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
    from tarshards.pipeline.dataset import WebDataset

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


# ---------------------------------------------------------------------------------------------
# litdata (the peer): its StreamingDataset over the same samples, run in bench/.venv
# ---------------------------------------------------------------------------------------------

PEER_VENV = os.path.join(HERE, ".venv", "bin", "python")


def litdata_states(paths, tag: str, peer: str) -> dict | None:
    """litdata's copy of the samples (``litdata.optimize``, 64 MB chunks) in each page-cache
    state: ``writer`` written by ``optimize`` in this run (the pages its writer left),
    ``64k-writes`` its files copied with 64 KB writes, ``fresh`` a copy dropped and read once.
    None where the peer's environment is missing."""
    if not os.path.exists(peer):
        return None
    base = os.path.join(common.DATA, f"{tag}-litdata")
    out = {"writer": os.path.join(base, "writer")}
    job = {"make": out["writer"], "urls": list(paths)}
    got = subprocess.run(
        [peer, __file__, "--peer-job", json.dumps(job)], capture_output=True, text=True
    )
    if got.returncode:
        print(f"   litdata: not measured ({got.stderr.strip().splitlines()[-1:]})")
        return None
    files = sorted(os.listdir(out["writer"]))
    for state in ("64k-writes", "fresh"):
        folder = os.path.join(base, state)
        made = plain_copies([os.path.join(out["writer"], f) for f in files], folder)
        if state == "fresh":
            common.warm_cache(made, fresh=True)
        out[state] = folder
    return out


def _litdata_shard(path):
    """The samples of one tar shard (read with tarfile: neither side's reader), for optimize()
    (as bench/run.py's row 2c makes them)."""
    import tarfile

    sample: dict = {}
    with tarfile.open(path) as tf:
        for ti in tf:
            key, ext = ti.name.split(".", 1)
            if sample and sample["key"] != key:
                yield sample
                sample = {}
            sample["key"] = key
            f = tf.extractfile(ti)
            sample[ext] = f.read() if f is not None else b""
    if sample:
        yield sample


def peer_job(job: dict) -> None:
    """In bench/.venv: make litdata's copy (``make``), or time passes over one (``read``):
    samples with their values copied into ``bytes`` (values the consumer owns, as ours are)."""
    import litdata

    if "make" in job:
        import shutil

        shutil.rmtree(job["make"], ignore_errors=True)
        litdata.optimize(
            fn=_litdata_shard,
            inputs=job["urls"],
            output_dir=job["make"],
            chunk_bytes="64MB",
            num_workers=1,
            verbose=False,
        )
        return
    best = float("inf")
    for _ in range(job["passes"] + 1):  # the first: imports and first-use set-up, not counted
        t0 = time.process_time()
        n = 0
        if job["copy"]:
            for sample in litdata.StreamingDataset(job["read"]):
                {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}
                n += 1
        else:  # as it comes: memoryviews into its chunk (no copy at all)
            for sample in litdata.StreamingDataset(job["read"]):
                n += 1
        best = min(best, time.process_time() - t0) if n else best
    print(json.dumps({"cpu": best, "samples": n, "version": litdata.__version__}))


def litdata_pass(folder: str, peer: str, passes: int = 3, copy: bool = True) -> float:
    """CPU seconds (all its threads) of litdata's best pass over ``folder`` (of ``passes``, in
    one process): values copied into ``bytes``, or (``copy=False``) its memoryviews."""
    job = {"read": folder, "passes": passes, "copy": copy}
    got = subprocess.run(
        [peer, __file__, "--peer-job", json.dumps(job)], capture_output=True, text=True, check=True
    )
    return json.loads(got.stdout.strip().splitlines()[-1])["cpu"]


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
    ap.add_argument("--peer-python", default=PEER_VENV, help="litdata's environment")
    ap.add_argument("--peer-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_job:
        peer_job(json.loads(args.peer_job))
        return
    paths = common.make_dataset("large", quick=args.quick)
    tag = "large-q" if args.quick else "large"
    states = {
        "writer": writer_copies(paths, os.path.join(common.DATA, f"{tag}-writer")),
        "64k-writes": plain_copies(paths, os.path.join(common.DATA, f"{tag}-64k")),
        "fresh": paths,
    }
    peer = litdata_states(paths, tag, args.peer_python)
    common.warm_cache(paths, fresh=True)
    res = measure(states, args.rounds)
    lit = {}
    if peer is not None:  # best of --rounds passes in one process per state
        for state in peer:
            for copy in (True, False):
                lit[state, copy] = litdata_pass(peer[state], args.peer_python, args.rounds, copy)
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
        for copy, name in ((True, "litdata:bytes"), (False, "litdata:views")):
            if (state, copy) in lit:
                cpu = lit[state, copy]
                print(f"   {name:16s} {mb / cpu:9.0f} {cat_cpu / cpu:6.2f}")
    print("\n   summary (CPU time): ours against cat (target >= 0.85) and against litdata")
    for state in states:
        ours, cat_cpu = res["best"][state, "ours"][0], res["best"][state, "cat"][0]
        line = f"   {state:12s} {cat_cpu / ours:5.2f}x cat"
        if (state, True) in lit:
            line += (
                f"   {lit[state, True] / ours:5.2f}x litdata (bytes), "
                f"{lit[state, False] / ours:5.2f}x litdata (its views, no copy)"
            )
        print(line)
    if hasattr(os, "getloadavg"):
        print(f"   (load average {os.getloadavg()[0]:.2f} at the end of the run)")


if __name__ == "__main__":
    main()
