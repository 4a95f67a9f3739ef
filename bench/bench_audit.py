"""The data-order ledger: what ``WebLoader(..., ledger=PATH)`` costs per step, and how long
``tarshards audit`` takes over a ledger of 1M steps.

    .venv/bin/python bench/bench_audit.py [--quick] [--pairs 9] [--steps 1000000]

1. ``ledger cost``: paired epochs of a planned raw pipeline (``WebDataset(small shards,
   readers=12).to_tuple("__key__", "jpg", "cls").batched(B)``, no decoding: the cheapest steps,
   where a per-step cost shows most) through ``WebLoader(batch_size=None, num_workers=0)``, with
   and without ``ledger=``, in alternating order; samples per CPU second of this process, the
   median of the pairs' ratios. Batches of 64 and of 8 (8x the records per sample). Beside it
   the cost of one step record measured alone (``LedgerWriter.step``: format and one
   ``os.write``, best of several runs) against the pipeline's CPU time per step.
2. ``audit``: a ledger of ``--steps`` step records (8 ranks, 10 epochs of 12,500 steps a rank,
   one resume from a checkpoint 200 steps back, as a crash leaves it) written with
   ``LedgerWriter``; then ``tarshards.audit`` on it, wall time: reading the files, replaying
   the resumes and checking every epoch's batches (no data given); and the same ledger with one
   step deleted, audited with the data (a manifest of 3,200 shards of 1,000 samples: the
   epochs' plans replayed, the shuffle buffer of the missing step's reader replayed on
   positions, its samples named).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import machine_info, make_dataset  # noqa: E402

READERS = 12


def epoch(urls, batch: int, ledger: str | None) -> tuple[float, int]:
    from tarshards.torch.adapter import WebDataset, WebLoader

    ds = (
        WebDataset(urls, shardshuffle=True, seed=0, readers=READERS, remainder="drop")
        .to_tuple("__key__", "jpg", "cls")
        .batched(batch)
    )
    loader = WebLoader(ds, batch_size=None, num_workers=0, ledger=ledger)
    n = 0
    t0 = time.process_time()
    for _keys, _jpg, cls in loader:
        n += len(cls)
    return n / (time.process_time() - t0), n


def record_ns(n: int = 100_000, repeat: int = 5) -> float:
    from tarshards.plan.ledger import LedgerWriter

    best = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeat):
            with LedgerWriter(os.path.join(tmp, f"r{r}"), 0, 8) as w:
                w.start(
                    {"fingerprint": "x"},
                    epoch=0,
                    position=0,
                    origin=0,
                    num_batches=n,
                    resumed=False,
                )
                t0 = time.perf_counter_ns()
                for k in range(n):
                    w.step(0, k, 8 * k)
                best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def write_ledger(path: str, steps: int, world: int = 8, epochs: int = 10):
    """A ledger of ``steps`` step records; returns the manifest its plan ran over."""
    from tarshards.format.manifest import Manifest
    from tarshards.plan.epoch import PlanConfig, ShardTable, plan_for
    from tarshards.plan.ledger import LedgerWriter

    manifest = Manifest.from_counts([f"shard-{i:05d}.tar" for i in range(3200)], [1000] * 3200)
    table = ShardTable.from_manifest(manifest)
    per_rank = steps // world // epochs  # steps a rank takes in an epoch
    readers = 64
    batch = max(1, table.num_samples // (world * per_rank))
    cfg = PlanConfig(seed=0, readers=readers, batch_size=batch, bufsize=1000)
    identity = cfg.identity(table.fingerprint)
    nb = plan_for(table, cfg, 0).num_batches
    per_rank = nb // world
    writers = [LedgerWriter(path, r, world) for r in range(world)]
    crash_epoch, crash_step, back = epochs // 2, per_rank // 2, 200
    for e in range(epochs):
        for w in writers:
            w.start(identity, epoch=e, position=0, origin=0, num_batches=nb, resumed=False)
        last = crash_step if e == crash_epoch else per_rank
        for k in range(last):
            for r, w in enumerate(writers):
                w.step(e, k, k * world + r)
        if e == crash_epoch:  # the crash: resume from the checkpoint `back` steps ago
            time.sleep(0.01)
            k0 = crash_step - back
            for w in writers:
                w.start(
                    identity, epoch=e, position=k0 * world, origin=0, num_batches=nb, resumed=True
                )
            for k in range(k0, per_rank):
                for r, w in enumerate(writers):
                    w.step(e, k, k * world + r)
    for w in writers:
        w.close()
    return manifest, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=1_000_000)
    args = ap.parse_args()
    info = machine_info()
    print(f"# {info.get('cpu', '?')}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    import tarshards
    from tarshards.plan.ledger import read_ledger

    # ---- 2. the audit of a big ledger -------------------------------------------------------
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ledger")
        t0 = time.perf_counter()
        manifest, batch = write_ledger(path, args.steps)
        written = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        t0 = time.perf_counter()
        ledger = read_ledger(path)
        t_read = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = tarshards.audit(ledger)
        t_audit = time.perf_counter() - t0
        assert report.ok, str(report)
        n = len(ledger)
        replayed = sum(e.replayed for e in report.epochs)
        print(
            f"audit: {n:,} step records ({size / n:.0f} bytes each, {size / 2**20:.0f} MiB, "
            f"written in {written:.1f} s), {replayed} replayed: read {t_read:.2f} s + audit "
            f"{t_audit:.2f} s = {t_read + t_audit:.2f} s ({n / (t_read + t_audit) / 1e6:.2f} M "
            "records/s)"
        )
        # one step deleted: the audit with the data names its samples
        mpath = os.path.join(tmp, "manifest.json")
        manifest.save(mpath)
        victim = os.path.join(path, "rank-3.jsonl")
        with open(victim) as f:
            lines = f.readlines()
        del lines[len(lines) // 3]
        with open(victim, "w") as f:
            f.writelines(lines)
        t0 = time.perf_counter()
        bad = tarshards.audit(path, mpath)
        t_bad = time.perf_counter() - t0
        missing = sum(len(e.missing_samples) for e in bad.epochs)
        assert not bad.ok and missing == batch, (missing, batch)
        print(
            f"audit with one step deleted, the data given (3,200 shards, plans replayed, "
            f"{missing} samples named): {t_bad:.2f} s"
        )

    # ---- 1. the ledger's cost per step ------------------------------------------------------
    urls = make_dataset("small", args.quick)
    ns = record_ns()
    for batch in (64, 8):
        epoch(urls, batch, None)  # warm up
        ratios, on, off = [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.pairs):
                order = (True, False) if i % 2 else (False, True)
                rates = {}
                for with_ledger in order:
                    where = os.path.join(tmp, f"l{i}") if with_ledger else None
                    rates[with_ledger], _n = epoch(urls, batch, where)
                on.append(rates[True])
                off.append(rates[False])
                ratios.append(rates[True] / rates[False])
        med = statistics.median(ratios)
        step_ns = 1e9 / statistics.median(off) * batch
        print(
            f"ledger cost, batch {batch}: without {statistics.median(off):,.0f} samples/s, with "
            f"{statistics.median(on):,.0f}; median ratio of {args.pairs} pairs {med:.4f} "
            f"({100 * (1 - med):+.2f} %); one record {ns / 1000:.1f} us = "
            f"{100 * ns / step_ns:.2f} % of a step's {step_ns / 1000:.0f} us"
        )


if __name__ == "__main__":
    main()
