"""Parallel shard processing: 2 workers vs 1 process on a CPU-bound per-sample function.

    .venv/bin/python bench/bench_parallel.py            # ~1 minute
    .venv/bin/python bench/bench_parallel.py --quick

The data are synthetic shards (``--shards`` x ``--per-shard`` samples of ~4 KB) in a temporary
directory. The per-sample function burns ``--ms`` milliseconds of pure-Python CPU and returns a
small derived sample, so the job is CPU-bound (reading and writing are a few percent).

Rows (best of ``--repeat``; every run rewrites all outputs, ``overwrite=True``):

* ``1 process``: the same work in this process: ``shard_samples`` -> fn -> ``TarWriter``, shard
  after shard. This is the reference.
* ``map_samples p=2``: ``map_samples(fn, samples, processes=2)`` (ordered), results written by the
  parent to one shard.
* ``processes engine w=2``: ``map_shards(fn, ..., engine="processes", workers=2)``.
* ``dask LocalCluster w=2``: ``map_shards(..., engine="dask", client=...)`` on a ``LocalCluster``
  of 2 single-threaded worker processes started once before timing; the start-up time of the
  cluster is reported on its own line, and the row ``dask incl. start-up`` has it included.

Targets: processes engine >= 1.7x, Dask >= 1.5x the 1-process reference. The machine needs at
least 2 free cores for the figures to mean anything; the script prints the CPU count and the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from tarshards import TarWriter, shard_samples  # noqa: E402
from tarshards.parallel import map_samples, map_shards  # noqa: E402


class Burn:
    """fn(sample) -> sample after about ``ms`` milliseconds of CPU (picklable)."""

    def __init__(self, loops: int):
        self.loops = loops

    def __call__(self, sample):
        acc = len(sample["bin"])
        for i in range(self.loops):
            acc = (acc * 1103515245 + i) & 0xFFFFFFFF
        return {"__key__": sample["__key__"], "txt": str(acc), "bin": sample["bin"][:64]}


def calibrate(ms: float) -> int:
    loops = 20000
    fn = Burn(loops)
    sample = {"__key__": "k", "bin": b"x" * 100}
    while True:
        t = time.perf_counter()
        fn(sample)
        dt = time.perf_counter() - t
        if dt > 0.02:
            return max(1, int(loops * ms / 1000 / dt))
        loops *= 2
        fn = Burn(loops)


def make_shards(d: str, nshards: int, per_shard: int) -> list[str]:
    rnd = os.urandom(4096)
    paths = []
    for s in range(nshards):
        p = os.path.join(d, f"in-{s:04d}.tar")
        with TarWriter(p) as w:
            for i in range(per_shard):
                w.write({"__key__": f"s{s:04d}_{i:05d}", "bin": rnd, "cls": str(i % 10)})
        paths.append(p)
    return paths


def one_process(fn, inputs, outputs) -> int:
    n = 0
    for inp, out in zip(inputs, outputs):
        with TarWriter(out) as w:
            for s in shard_samples(inp):
                w.write(fn(s))
                n += 1
    return n


def best(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--per-shard", type=int, default=40)
    ap.add_argument("--ms", type=float, default=8.0, help="CPU milliseconds per sample")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-dask", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.shards, args.per_shard, args.repeat = 8, 30, 2
    loops = calibrate(args.ms)
    fn = Burn(loops)
    d = tempfile.mkdtemp(prefix="tarshards-bench-parallel-")
    try:
        inputs = make_shards(d, args.shards, args.per_shard)
        outputs = [os.path.join(d, f"out-{i:04d}.tar") for i in range(args.shards)]
        nsamples = args.shards * args.per_shard
        print(
            f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
            f"{args.shards} shards x {args.per_shard} samples, ~{args.ms:g} ms CPU per sample; "
            f"best of {args.repeat}"
        )
        rows = []
        t1 = best(lambda: one_process(fn, inputs, outputs), args.repeat)
        rows.append(("1 process", t1))

        def via_map_samples():
            samples = (s for p in inputs for s in shard_samples(p))
            with TarWriter(os.path.join(d, "all.tar")) as w:
                for r in map_samples(fn, samples, processes=2, chunksize=4):
                    w.write(r)

        rows.append(("map_samples p=2", best(via_map_samples, args.repeat)))

        def via_processes():
            reports = map_shards(
                fn, inputs, outputs, engine="processes", workers=2, overwrite=True, progress=False
            )
            assert all(r.status == "done" for r in reports), reports

        rows.append(("processes engine w=2", best(via_processes, args.repeat)))
        if not args.no_dask:
            import distributed

            t = time.perf_counter()
            cluster = distributed.LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                silence_logs=40,
                scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
            )
            client = distributed.Client(cluster)
            startup = time.perf_counter() - t
            try:

                def via_dask():
                    reports = map_shards(
                        fn,
                        inputs,
                        outputs,
                        engine="dask",
                        client=client,
                        overwrite=True,
                        progress=False,
                    )
                    assert all(r.status == "done" for r in reports), reports

                td = best(via_dask, args.repeat)
            finally:
                client.close()
                cluster.close()
            rows.append(("dask LocalCluster w=2", td))
            rows.append(("dask incl. start-up", td + startup))
            print(f"# dask LocalCluster start-up: {startup:.2f} s")
        print(f"{'':24s} {'seconds':>8s} {'samples/s':>10s} {'speed-up':>8s}")
        for name, secs in rows:
            print(f"{name:24s} {secs:8.2f} {nsamples / secs:10.1f} {t1 / secs:7.2f}x")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
