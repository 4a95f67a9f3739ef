"""Resume benchmark: time from ``load_state_dict`` to the first batch, state size, and the cost
of the planned (resumable) pipeline on the raw and decode rows, side by side in one run.

    .venv/bin/python bench/bench_resume.py            # small data set of bench/common.py
    .venv/bin/python bench/bench_resume.py --quick    # the --quick layout (4 x 1500 samples)

Rows:

1. ``fresh``: a planned pipeline (``readers=12``, ``.shuffle(1000)``, ``.batched(64)``; the
   shard table given, as a manifest gives it), from construction to its first batch.
2. ``resume@10%/50%/90%``: a new pipeline, ``load_state_dict`` of a state saved at that point of
   the epoch, to its first batch (the shuffle buffers are replayed on positions and refilled by
   seeking to the samples' offsets; nothing before the position is read), checked against the
   uninterrupted run's batch (``NOT EXACT`` otherwise). Rows 1 and 2 are taken in turn, best
   of ``--repeat`` rounds.
3. ``state``: the state's size (JSON bytes).
4. MosaicML Streaming (``--peer-python``, default ``bench/.venv``; the samples converted once to
   MDS as bench/bench_index.py does): ``StreamingDataset(shuffle=True, batch_size=64)`` through
   ``StreamingDataLoader``; a loader run to step k gives ``state_dict()``; a new dataset and
   loader, ``load_state_dict``, first batch, checked against step k of an uninterrupted run.
   Its times include opening its index (ours are given the shard table).
5. ``raw`` / ``decode``: samples per CPU second over a whole epoch, plain pipeline (shard
   split) vs planned pipeline (same stages), taken in turn, best of ``--repeat``. The raw rows
   add the planned pipeline with one virtual reader (``V=1``): what the plan costs without the
   interleaving of readers (global batch ``g`` comes from reader ``g mod V``). The shuffled raw
   row adds the plain pipeline with ``shuffle(V * 1000)``: as many samples held as the planned
   pipeline's V readers hold in their buffers of 1000 (each reader shuffles its own segment),
   which is what bounds that row (samples held long in buffers go cold in the CPU caches).

Figures from a loaded machine are noisy; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
PEER_VENV = os.path.join(HERE, ".venv", "bin", "python")
READERS, BATCH, BUF, SEED = 12, 64, 1000, 0
FRACTIONS = (0.1, 0.5, 0.9)


def planned(urls, table=None, decode=False, shuffle=BUF, readers=READERS):
    from tarshards.pipeline.dataset import WebDataset

    # remainder="drop": the rates compare like with like (the plain pipeline has no carry-over)
    ds = WebDataset(urls, shardshuffle=True, seed=SEED, readers=readers, remainder="drop")
    if table is not None:
        ds.set_table(table)
    return _stages(ds, decode, shuffle)


def plain(urls, decode=False, shuffle=BUF):
    from tarshards.pipeline.dataset import WebDataset

    return _stages(WebDataset(urls, shardshuffle=True, seed=SEED), decode, shuffle)


def _stages(ds, decode, shuffle):
    if shuffle:
        ds = ds.shuffle(shuffle)
    if decode:
        ds = ds.decode("rgb8")
    return ds.to_tuple("jpg", "cls").batched(BATCH, collation_fn=list)


def batch_crc(batch) -> int:
    return zlib.crc32(b"".join(jpg for jpg, _ in batch))


def first_batch(make, state=None) -> tuple[float, float, int]:
    """Seconds (wall and CPU) from making the pipeline (and loading ``state``) to its first
    batch, and that batch's checksum."""
    t0, c0 = time.perf_counter(), time.process_time()
    ds = make()
    if state is not None:
        ds.load_state_dict(state)
    batch = next(iter(ds))
    return time.perf_counter() - t0, time.process_time() - c0, batch_crc(batch)


def rates(makes: dict, repeat: int) -> dict:
    """Samples per CPU second of each pipeline over a whole epoch, best of ``repeat``, the
    pipelines taken in turn in every round (CPU time: other processes on a loaded machine
    change it less than wall time; these pipelines run in one thread)."""
    best = dict.fromkeys(makes, 0.0)
    for _ in range(repeat):
        for name, make in makes.items():
            ds = make()
            t0 = time.process_time()
            n = sum(len(b) for b in ds)
            best[name] = max(best[name], n / (time.process_time() - t0))
    return best


# ---------------------------------------------------------------------------------------------
# MosaicML Streaming beside it (runs in bench/.venv: nothing of tarshards is imported there)
# ---------------------------------------------------------------------------------------------


def peer_streaming(job: dict) -> dict:
    """MosaicML Streaming on the same samples (converted once to MDS): a ``StreamingDataset``
    (shuffled, ``batch_size=BATCH``) through its ``StreamingDataLoader``; for each point of the
    epoch, a loader run to step k gives ``state_dict()``, and a new dataset and loader are timed
    from construction and ``load_state_dict`` to the first batch, which is checked against step
    k of an uninterrupted run."""
    import gc

    import common

    common.torchvision_importable()
    import streaming
    from bench_index import _mds_dir
    from streaming import StreamingDataLoader, StreamingDataset

    local = _mds_dir(job)
    B = job["batch"]

    def loader():
        gc.collect()  # the previous dataset's shared memory goes first
        streaming.base.util.clean_stale_shared_memory()
        ds = StreamingDataset(local=local, batch_size=B, shuffle=True, shuffle_seed=job["seed"])
        return StreamingDataLoader(ds, batch_size=B, num_workers=0, collate_fn=_mosaic_keys)

    def first(state=None):
        t0 = time.perf_counter()
        dl = loader()
        if state is not None:
            dl.load_state_dict(state)
        batch = next(iter(dl))
        return time.perf_counter() - t0, batch

    fresh = min(first()[0] for _ in range(3))
    dl = loader()
    epoch = list(iter(dl))  # the uninterrupted run's batches
    steps = len(epoch)
    del dl
    rows = []
    for frac in job["fractions"]:
        k = int(steps * frac)
        dl = loader()
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        del it, dl
        times, same = [], True
        for _ in range(3):
            t, batch = first(state)
            times.append(t)
            same = same and batch == epoch[k]
        rows.append({"frac": frac, "step": k, "seconds": min(times), "exact": same})
    return {
        "version": streaming.__version__,
        "steps": steps,
        "fresh": fresh,
        "resume": rows,
        "state_bytes": len(json.dumps(state)),
    }


def _mosaic_keys(samples):
    """A batch as the crc32 of each sample's bytes (enough to compare with the uninterrupted
    run), in a dict as StreamingDataLoader counts batches."""
    return {"crc": [zlib.crc32(b"".join(s[k] for k in sorted(s))) for s in samples]}


def run_peer(python: str, job: dict, timeout: float = 900) -> dict:
    if not os.path.exists(python):
        return {"error": f"not installed ({python} missing; see bench/bench_index.py)"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run(
            [python, os.path.abspath(__file__), "--peer", f.name],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
    finally:
        os.unlink(f.name)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--peer-python", default=PEER_VENV)
    ap.add_argument("--no-peer", action="store_true", help="leave MosaicML Streaming out")
    ap.add_argument(
        "--rates-only", action="store_true", help="only the raw/decode rows (section 5)"
    )
    ap.add_argument("--peer", metavar="JOB", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        with open(args.peer) as f:
            print(json.dumps(peer_streaming(json.load(f))))
        return 0

    from common import make_dataset, warm_cache

    urls = make_dataset("small", quick=args.quick)
    warm_cache(urls)

    t0 = time.perf_counter()
    table = planned(urls).table
    scan = time.perf_counter() - t0
    rows = [("scan (counts + offsets, once; free with a manifest)", f"{scan * 1e3:.0f} ms")]
    if not args.rates_only:
        rows += resume_rows(args, urls, table)
    rows += rate_rows(args, urls, table)
    n = sum(table.counts)
    print(
        f"# bench_resume: {len(urls)} shards, {n} samples, readers={READERS}, "
        f"batch={BATCH}, shuffle={BUF}"
    )
    for k, v in rows:
        print(f"{k:66s} {v}")
    return 0


def resume_rows(args, urls, table) -> list[tuple[str, str]]:
    """Rows 1-4: fresh start, resumes, state size, MosaicML Streaming beside them."""
    from common import DATA

    make = lambda: planned(urls, table)  # noqa: E731
    epoch = [batch_crc(b) for b in make()]  # the uninterrupted run
    steps = len(epoch)
    rows = []
    # the fresh start and the resumes taken in turn, best of --repeat rounds (a loaded machine
    # slows rounds, not one row)
    states = {frac: make().state_from_step(int(steps * frac), world_size=1) for frac in FRACTIONS}
    best = {frac: [float("inf")] * 2 for frac in (None, *FRACTIONS)}  # wall, CPU
    exact = dict.fromkeys(FRACTIONS, True)
    for _ in range(args.repeat):
        for frac, b in best.items():
            wall, cpu, crc = first_batch(make, None if frac is None else states[frac])
            b[:] = min(b[0], wall), min(b[1], cpu)
            if frac is not None:
                exact[frac] = exact[frac] and crc == epoch[int(steps * frac)]
    fresh, fresh_cpu = best[None]
    rows.append(
        (
            "tarshards fresh: iter() to first batch",
            f"{fresh * 1e3:.1f} ms (CPU {fresh_cpu * 1e3:.1f} ms)",
        )
    )
    for frac in FRACTIONS:
        k, (t, c) = int(steps * frac), best[frac]
        rows.append(
            (
                f"tarshards resume@{int(frac * 100)}% (step {k} of {steps}): load to 1st batch",
                f"{t * 1e3:.1f} ms ({t / fresh:.2f}x fresh; CPU {c / fresh_cpu:.2f}x)"
                + ("" if exact[frac] else " NOT EXACT"),
            )
        )
    state_size = len(json.dumps(states[FRACTIONS[-1]]))
    rows.append(("tarshards state size (JSON)", f"{state_size} bytes"))
    if not args.no_peer:
        job = {
            "urls": urls,
            "batch": BATCH,
            "seed": SEED,
            "fractions": FRACTIONS,
            "mds_dir": os.path.join(DATA, f"mds-small{'-quick' if args.quick else ''}"),
        }
        rows += mosaic_rows(run_peer(args.peer_python, job))
    return rows


def rate_rows(args, urls, table) -> list[tuple[str, str]]:
    """Row 5: the planned pipeline's cost on the raw and decode rows."""
    rows = []
    one = planned(urls, readers=1).table
    for name, dec, shuf in (
        ("raw, no shuffle", False, 0),
        (f"raw, shuffle({BUF})", False, BUF),
        ("decode rgb8, no shuffle", True, 0),
        (f"decode rgb8, shuffle({BUF})", True, BUF),
    ):
        makes = {
            "plain": lambda dec=dec, shuf=shuf: plain(urls, decode=dec, shuffle=shuf),
            "planned": lambda dec=dec, shuf=shuf: planned(urls, table, dec, shuf),
            "V=1": lambda dec=dec, shuf=shuf: planned(urls, one, dec, shuf, readers=1),
        }
        if shuf:
            makes["held"] = lambda dec=dec, shuf=shuf: plain(
                urls, decode=dec, shuffle=shuf * READERS
            )
        got = rates(makes, args.repeat)
        a, b = got["plain"], got["planned"]
        rows.append(
            (
                f"{name}: plain / planned samples per CPU s",
                f"{a:,.0f} / {b:,.0f} ({(b / a - 1) * 100:+.1f}%)",
            )
        )
        if "V=1" in got:
            c = got["V=1"]
            rows.append(
                ("  the same, planned with readers=1", f"{c:,.0f} ({(c / a - 1) * 100:+.1f}%)")
            )
        if "held" in got:
            c = got["held"]
            rows.append(
                (
                    f"  the same, plain with shuffle({shuf * READERS}) (as many held)",
                    f"{c:,.0f} ({(c / a - 1) * 100:+.1f}%; planned vs it "
                    f"{(b / c - 1) * 100:+.1f}%)",
                )
            )
    return rows


def mosaic_rows(peer: dict) -> list[tuple[str, str]]:
    if "error" in peer:
        return [("MosaicML Streaming resume", peer["error"])]
    fresh = peer["fresh"]
    name = f"streaming {peer['version']}"
    rows = [(f"{name} fresh: loader to first batch", f"{fresh * 1e3:.1f} ms")]
    for r in peer["resume"]:
        rows.append(
            (
                f"{name} resume@{int(r['frac'] * 100)}% (step {r['step']} of {peer['steps']})",
                f"{r['seconds'] * 1e3:.1f} ms ({r['seconds'] / fresh:.2f}x fresh)"
                + ("" if r["exact"] else " NOT EXACT"),
            )
        )
    rows.append((f"{name} state size (JSON)", f"{peer['state_bytes']} bytes"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
