"""Resume benchmark: time from ``load_state_dict`` to the first batch, state size, and the cost
of the planned (resumable) pipeline on the raw and decode rows, side by side in one run.

    .venv/bin/python bench/bench_resume.py            # small data set of bench/common.py
    .venv/bin/python bench/bench_resume.py --quick    # the --quick layout (4 x 1500 samples)

Rows:

1. ``fresh``: a planned pipeline (``readers=12``, ``.shuffle(1000)``, ``.batched(64)``), from
   ``iter()`` to its first batch.
2. ``resume@10%/50%/90%``: a new pipeline, ``load_state_dict`` of a state saved at that point of
   the epoch, to its first batch (the shuffle buffers are replayed on positions and refilled by
   seeking to the samples' offsets; nothing before the position is read).
3. ``state``: the state's size (JSON bytes).
4. ``raw`` / ``decode``: samples/s over a whole epoch, plain pipeline (shard split) vs planned
   pipeline (same stages), best of ``--repeat``.

MosaicML Streaming's resume is measured beside it when ``streaming`` imports (bench/.venv).
Figures from a loaded machine are noisy; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import make_dataset, warm_cache  # noqa: E402

from tarshards.pipeline import WebDataset  # noqa: E402

READERS, BATCH, BUF = 12, 64, 1000


def planned(urls, table=None, decode=False):
    ds = WebDataset(urls, shardshuffle=True, seed=0, readers=READERS)
    if table is not None:
        ds.set_table(table)
    ds = ds.shuffle(BUF)
    if decode:
        ds = ds.decode("rgb8")
    return ds.to_tuple("jpg", "cls").batched(BATCH, collation_fn=list)


def plain(urls, decode=False):
    ds = WebDataset(urls, shardshuffle=True, seed=0).shuffle(BUF)
    if decode:
        ds = ds.decode("rgb8")
    return ds.to_tuple("jpg", "cls").batched(BATCH, collation_fn=list)


def first_batch_time(make, state=None) -> float:
    t0 = time.perf_counter()
    ds = make()
    if state is not None:
        ds.load_state_dict(state)
    next(iter(ds))
    return time.perf_counter() - t0


def rate(make, repeat: int) -> float:
    best = 0.0
    for _ in range(repeat):
        ds = make()
        t0 = time.perf_counter()
        n = sum(len(b) for b in ds)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def mosaic_resume(urls) -> str:
    try:
        import streaming  # noqa: F401
    except ImportError:
        return "not installed (bench/.venv)"
    return "installed, not wired up yet"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    urls = make_dataset("small", quick=args.quick)
    warm_cache(urls)

    t0 = time.perf_counter()
    table = planned(urls).table
    scan = time.perf_counter() - t0
    make = lambda: planned(urls, table)  # noqa: E731
    steps = make().steps_per_epoch(0, 1)
    rows = [("scan (counts + offsets, once; free with a manifest)", f"{scan * 1e3:.0f} ms")]
    fresh = min(first_batch_time(make) for _ in range(3))
    rows.append(("fresh: iter() to first batch", f"{fresh * 1e3:.1f} ms"))
    state_size = 0
    for frac in (0.1, 0.5, 0.9):
        k = int(steps * frac)
        state = make().state_from_step(k, world_size=1)
        state_size = len(json.dumps(state))
        t = min(first_batch_time(make, state) for _ in range(3))
        rows.append(
            (
                f"resume@{int(frac * 100)}% (step {k} of {steps}): load to first batch",
                f"{t * 1e3:.1f} ms ({t / fresh:.2f}x fresh)",
            )
        )
    rows.append(("state size (JSON)", f"{state_size} bytes"))
    for name, dec in (("raw", False), ("decode rgb8", True)):
        a = rate(lambda dec=dec: plain(urls, decode=dec), args.repeat)
        b = rate(lambda dec=dec: planned(urls, table, decode=dec), args.repeat)
        rows.append(
            (
                f"{name}: plain / planned samples/s",
                f"{a:,.0f} / {b:,.0f} ({(b / a - 1) * 100:+.1f}%)",
            )
        )
    rows.append(("MosaicML Streaming resume", mosaic_resume(urls)))
    n = sum(table.counts)
    print(
        f"# bench_resume: {len(urls)} shards, {n} samples, readers={READERS}, "
        f"batch={BATCH}, shuffle={BUF}"
    )
    for k, v in rows:
        print(f"{k:62s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
