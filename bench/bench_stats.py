"""The cost of ``WebLoader(..., stats=True)``: samples/s with and without the statistics, in
paired runs within one process (target: under 1% lost).

    .venv/bin/python bench/bench_stats.py [--quick] [--pairs 9] [--workers 0]

Each pair runs one epoch of ``WebDataset(urls).decode("rgb8").to_tuple("jpg",
"cls").batched(64)`` (the ``small`` shards of ``common.py``: 96x96 JPEGs) through
``WebLoader(batch_size=None, num_workers=W)`` twice, once with ``stats=True`` and once
without, in alternating order; the ratio of each pair's samples/s is taken and the median
ratio over the pairs reported (pairs cancel most of a shared machine's drift). With
``--workers 0`` the pipeline runs in this process, where the counting's cost is not hidden
behind worker parallelism, and the rates are samples per CPU second of this process (steadier
than wall time on a machine shared with other jobs); ``--workers 2`` measures wall time, as
trainers see it.

A shared machine moves samples/s by a few percent from one epoch to the next, more than the
cost being measured; so the run also measures the cost directly, in the same process: the
counting layers a sample and a batch pass through (``timed_source`` and ``timed_stage`` around
pass-through generators standing for the pipeline's own, ``timed_items`` and the loader's wait
clock per batch, and a worker's news: taken, pickled, unpickled and added up), best of many
repetitions, against the same generators without them; that cost over the pipeline's CPU time
per sample (from the ``stats=False`` runs) is the second ratio printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import machine_info, make_dataset  # noqa: E402


def epoch(urls, workers: int, stats: bool) -> tuple[float, int]:
    from tarshards.torch.adapter import WebDataset, WebLoader

    ds = WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls").batched(64)
    loader = WebLoader(ds, batch_size=None, num_workers=workers, stats=stats)
    n = 0
    it = iter(loader)
    first = next(it)  # start-up (workers) excluded
    t0 = time.process_time() if workers == 0 else time.perf_counter()
    for batch in it:
        n += len(batch[1])
    seconds = (time.process_time() if workers == 0 else time.perf_counter()) - t0
    del first
    if stats:
        assert loader.stats().samples >= n
    return n / seconds, n


def _drain(it) -> None:
    for _ in it:
        pass


def _passing(it):
    yield from it


def instrumentation_ns(n: int = 200_000, repeat: int = 15) -> tuple[float, float]:
    """(ns per sample, ns per batch) that the counting adds, best of ``repeat``."""
    from tarshards.stats import Counters, clock, timed_items, timed_source, timed_stage

    items = list(range(n))

    def best(fn) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return min(times) / n

    c = Counters()

    def loop_clock(it):  # the loader's wait clock per batch (WebLoader._count_timed)
        t0 = clock()
        for x in it:
            c.waited(clock() - t0)
            yield x
            t0 = clock()

    per_sample = best(lambda: _drain(timed_stage(_passing(timed_source(_passing(items), c)), c)))
    per_sample -= best(lambda: _drain(_passing(_passing(items))))
    per_batch = best(lambda: _drain(loop_clock(timed_items(_passing(items), c))))
    per_batch -= best(lambda: _drain(_passing(items)))
    # a worker's news with each batch: taken, pickled with it, unpickled and added up
    main = Counters()

    def news():
        for _ in range(n // 10):
            c.samples += 64
            main.add(pickle.loads(pickle.dumps(c.take())))

    per_batch += best(news) * 10
    return per_sample, per_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the raw figures here")
    args = ap.parse_args()
    urls = make_dataset("small", args.quick)
    epoch(urls, args.workers, False)  # warm the page cache and the imports
    ratios, on, off = [], [], []
    for i in range(args.pairs):
        order = (True, False) if i % 2 else (False, True)
        rates = {}
        for stats in order:
            rates[stats], n = epoch(urls, args.workers, stats)
        on.append(rates[True])
        off.append(rates[False])
        ratios.append(rates[True] / rates[False])
        print(
            f"pair {i}: stats off {rates[False]:9.0f}/s  on {rates[True]:9.0f}/s  "
            f"ratio {ratios[-1]:.4f}",
            file=sys.stderr,
        )
    med = statistics.median(ratios)
    print(f"workers={args.workers}, {n} samples/epoch, {args.pairs} pairs")
    print(f"stats=False  median {statistics.median(off):9.0f} samples/s")
    print(f"stats=True   median {statistics.median(on):9.0f} samples/s")
    print(f"ratio on/off median {med:.4f}  (cost {100 * (1 - med):+.2f}%; target < 1%)")
    sample_ns, batch_ns = instrumentation_ns()
    cpu_ns = 1e9 / statistics.median(off) if args.workers == 0 else None
    print(
        f"counting costs {sample_ns:.0f} ns per sample + {batch_ns:.0f} ns per batch of 64 "
        f"= {sample_ns + batch_ns / 64:.0f} ns per sample"
        + (
            f" of {cpu_ns:.0f} ns: {100 * (sample_ns + batch_ns / 64) / cpu_ns:.2f}% (target < 1%)"
            if cpu_ns
            else ""
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ratios": ratios,
                    "on": on,
                    "off": off,
                    "workers": args.workers,
                    "instrumentation_ns": [sample_ns, batch_ns],
                    "machine": machine_info(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
