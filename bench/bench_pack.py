"""Packing benchmark (issue 38): the packed pipeline's rate against the unpacked one, tokens per
batch packed against padding to the longest, and planning an epoch of 10M samples from metadata;
ratios from one run.

    .venv/bin/python bench/bench_pack.py            # 40,000 samples, 10M planned
    .venv/bin/python bench/bench_pack.py --quick    # 10,000 samples, 2M planned
    .venv/bin/python bench/bench_pack.py --ratio    # the packed/unpacked ratios only (~1 min)

``--ratio``: the issue's target row alone, in one short run: samples per CPU second of the
packed pipeline against the unpacked one over the same shards, bare token samples and with
``.decode()`` of the ``tokens.npy`` field, 12 readers and 2, the sides taken in turn (best of
``--repeat``); it prints each ratio and the pack fill.

Rows:

1. ``rate``: samples per CPU second over a whole epoch of a planned pipeline
   (``WebDataset(manifest, readers=12)``, shards shuffled) over token shards (int32 tokens as a
   raw ``tok`` field, a ``tokens`` metadata column in the manifest, lengths lognormal(5.5, 1.0)
   capped at 8,192, mean ~400): ``.map(tokens).batched(B, collation_fn=None)`` (unpacked: lists
   of B samples, B the mean samples per pack, so both yield about as many units) against
   ``.map(tokens).pack(8192, "tokens")`` (packs planned from the column; default of 4 packs
   open); an unpacked pipeline holding samples (``.shuffle(16 B)``: a shuffle buffer); packs
   with ``window=16`` packs open; then the unpacked and packed ones with their collations,
   ``collate_padded`` against ``collate_packed``; both with per-sample work a trainer's pipeline
   does (``.decode()``: the tokens of a ``tokens.npy`` field decoded to an array); and a mixture
   by tokens of two sources (``mix(..., unit="tokens")``, 2:1) batched against packed. All taken
   in turn, best of ``--repeat`` (the
   first pass, which plans the epoch, is timed apart), with 12 readers in the process (one
   process reading the whole plan) and with 2 (a DataLoader worker's share of 12 readers in 6
   workers).
2. ``tokens/batch``: on the same lengths, the share of a batch's token slots that hold tokens:
   packs of 8,192 (``pack_units``, default packs open) against batches of B samples in the epoch's
   order padded to their longest, and against length buckets (``bucket_units``) padded to their
   longest; the ratio packed / padded is the tokens a batch of the same size carries more.
3. ``plan 10M``: the pack plan of an epoch of 10M samples in 1,000 shards from a cost column
   (the epoch's order of the shards, the column in that order, best-fit with 4 packs open):
   CPU and wall seconds; the bucket plan of the same; the packs of a mixture by tokens of two
   sources of half as many samples each (60 readers, stop="first").

Figures from a loaded machine are noisy; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
DATA = os.path.join(HERE, "_data")
MAX = 8192
READERS = 12


def tokens(sample):
    return {"__key__": sample["__key__"], "tokens": np.frombuffer(sample["tok"], np.int32)}


def make_data(n: int) -> tuple[str, np.ndarray]:
    from tarshards import ShardWriter

    d = os.path.join(DATA, f"pack-npy-{n}")
    manifest = os.path.join(d, "manifest.json")
    rng = np.random.default_rng(38)
    lengths = np.minimum(rng.lognormal(5.5, 1.0, n).astype(np.int64) + 1, MAX)
    if not os.path.exists(manifest):
        os.makedirs(d, exist_ok=True)
        pool = rng.integers(0, 50_000, MAX, dtype=np.int32).tobytes()
        with ShardWriter(
            os.path.join(d, "part-%04d.tar"),
            maxcount=n // 16,
            manifest=manifest,
            meta={"tokens": lambda s: len(s["tok"]) // 4},
        ) as sink:
            for i, m in enumerate(lengths):
                tok = pool[: 4 * int(m)]
                sink.write(
                    {"__key__": f"s{i:08d}", "tok": tok, "tokens.npy": np.frombuffer(tok, np.int32)}
                )
    return manifest, lengths


def epoch_rate(ds) -> tuple[float, int, int]:
    """(samples per CPU second, samples, units) of one epoch (epoch 0)."""
    ds.set_epoch(0)
    gc.collect()
    t0 = time.process_time()
    samples = units = 0
    for unit in ds:
        units += 1
        samples += len(unit["__key__"]) if isinstance(unit, dict) else len(unit)
    return samples / (time.process_time() - t0), samples, units


def rate_rows(manifest: str, b: int, held: int, repeat: int, readers: int) -> None:
    from tarshards import WebDataset, collate_packed, collate_padded

    def base():
        return WebDataset(manifest, shardshuffle=True, seed=0, readers=readers, remainder="drop")

    sides = {
        "unpacked": base().map(tokens).batched(b, collation_fn=None),
        "packed": base().map(tokens).pack(MAX, "tokens"),
        f"unpacked, shuffle({held})": base()
        .shuffle(held)
        .map(tokens)
        .batched(b, collation_fn=None),
        "packed, window=16": base().map(tokens).pack(MAX, "tokens", window=16),
        "unpacked + collate_padded": base()
        .map(tokens)
        .batched(b, collation_fn=functools.partial(collate_padded, fields=["tokens"])),
        "packed + collate_packed": base()
        .map(tokens)
        .pack(MAX, "tokens")
        .map(functools.partial(collate_packed, field="tokens")),
        # work a trainer's pipeline does per sample: the tokens decoded from their .npy field
        "unpacked, .decode() npy": base().decode().batched(b, collation_fn=None),
        "packed, .decode() npy": base().decode().pack(MAX, "tokens"),
        # a mixture by tokens of two sources: batches of B against packs (issue 38, part 4)
        "mix by tokens, batched": mixture(manifest, readers).batched(b, collation_fn=None),
        "mix by tokens, packed": mixture(manifest, readers).pack(MAX, "tokens"),
    }
    first = {}
    for name, ds in sides.items():  # the first pass plans the epoch (timed apart)
        t0 = time.process_time()
        got = epoch_rate(ds)
        first[name] = (*got, time.process_time() - t0)
    best = {name: 0.0 for name in sides}
    for _ in range(repeat):
        for name, ds in sides.items():
            best[name] = max(best[name], epoch_rate(ds)[0])
    for name in sides:
        _, samples, units, t = first[name]
        print(
            f"  {name:28s} {best[name]:>10,.0f} samples/s  ({samples} samples, {units} units; "
            f"first pass, planning included: {t:.2f} s CPU)"
        )
    r = {k: best[k] for k in best}
    shuffled = r[f"unpacked, shuffle({held})"]
    print(
        f"  ratios: packed / unpacked {r['packed'] / r['unpacked']:.3f}; packed / unpacked "
        f"holding as many samples (shuffle({held})) {r['packed'] / shuffled:.3f}; "
        f"window=16 / unpacked {r['packed, window=16'] / r['unpacked']:.3f}; with collation "
        f"{r['packed + collate_packed'] / r['unpacked + collate_padded']:.3f}; with "
        f".decode() (npy) {r['packed, .decode() npy'] / r['unpacked, .decode() npy']:.3f}; "
        f"mix by tokens packed / batched "
        f"{r['mix by tokens, packed'] / r['mix by tokens, batched']:.3f}"
    )


def ratio_rows(manifest: str, lengths: np.ndarray, repeat: int) -> None:
    """The packed pipeline's samples/s over the unpacked one's, bare and with .decode(), for
    12 readers and 2 (same shards; sides in turn, best of ``repeat``)."""
    from tarshards import WebDataset
    from tarshards.plan.packing import pack_units

    plan = pack_units(lengths, MAX)
    b = max(1, round(len(lengths) / len(plan)))
    print(f"pack fill {plan.fill():.4f} ({len(plan):,} packs of {MAX}; B={b})")
    for readers in (READERS, 2):

        def base(readers=readers):
            return WebDataset(
                manifest, shardshuffle=True, seed=0, readers=readers, remainder="drop"
            )

        sides = {
            "unpacked": base().map(tokens).batched(b, collation_fn=None),
            "packed": base().map(tokens).pack(MAX, "tokens"),
            "unpacked .decode()": base().decode().batched(b, collation_fn=None),
            "packed .decode()": base().decode().pack(MAX, "tokens"),
        }
        for ds in sides.values():
            epoch_rate(ds)  # (plans the epoch)
        best = dict.fromkeys(sides, 0.0)
        for _ in range(repeat):
            for name, ds in sides.items():
                best[name] = max(best[name], epoch_rate(ds)[0])
        print(
            f"readers={readers:2d}: bare {best['packed']:,.0f} / {best['unpacked']:,.0f} "
            f"samples/s = {best['packed'] / best['unpacked']:.3f}; .decode() "
            f"{best['packed .decode()']:,.0f} / {best['unpacked .decode()']:,.0f} = "
            f"{best['packed .decode()'] / best['unpacked .decode()']:.3f}"
        )


def mixture(manifest: str, readers: int):
    """A mixture by tokens (2:1) of two sources (the same shards, shuffled apart), planned."""
    from tarshards import WebDataset, mix

    sources = {
        name: WebDataset(manifest, shardshuffle=True, seed=seed)
        for name, seed in (("a", 1), ("b", 2))
    }
    return mix(sources, {"a": 2, "b": 1}, readers=readers, seed=0, unit="tokens", stop="first")


def token_rows(lengths: np.ndarray, b: int) -> None:
    from tarshards.plan.packing import bucket_units, pack_units

    plan = pack_units(lengths, MAX)
    fill = plan.fill()
    n = len(lengths) // b * b
    groups = lengths[:n].reshape(-1, b)
    padded = groups.sum() / (groups.max(axis=1).sum() * b)
    bounds = [64, 128, 256, 512, 1024, 2048, 4096]
    sizes = [max(1, MAX // int(x)) for x in [*bounds, MAX]]  # each bucket's batch fills MAX
    buckets = bucket_units(lengths, bounds, sizes)
    slots = sum(len(buckets.unit(u)) * lengths[buckets.unit(u)].max() for u in range(len(buckets)))
    bucketed = lengths.sum() / slots
    print(
        f"  tokens in a batch's slots: packed {fill:.4f}, padded to the longest (B={b}) "
        f"{padded:.4f}, length buckets padded {bucketed:.4f}"
    )
    print(
        f"  tokens per batch, packed / padded: {fill / padded:.2f}x; packed / bucketed: "
        f"{fill / bucketed:.2f}x ({fill * MAX:,.0f} tokens in a pack of {MAX})"
    )


def plan_rows(n: int) -> None:
    from tarshards.plan.epoch import ShardTable
    from tarshards.plan.packing import _epoch_order, bucket_units, pack_units

    rng = np.random.default_rng(10)
    per = n // 1000
    costs = np.minimum(rng.lognormal(5.5, 1.0, n).astype(np.int64) + 1, MAX).astype(np.float64)
    table = ShardTable([f"part-{i:05d}.tar" for i in range(1000)], [per] * 1000)
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    _, rows = _epoch_order(table, 0, True, 0)
    ordered = costs[rows]
    plan = pack_units(ordered, MAX)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(
        f"  pack plan of {n:,} samples: {cpu:.2f} s CPU, {wall:.2f} s wall; {len(plan):,} packs, "
        f"fill {plan.fill():.4f}"
    )
    c0, w0 = time.process_time(), time.perf_counter()
    b = bucket_units(ordered, [64, 128, 256, 512, 1024, 2048, 4096], 32)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(f"  bucket plan of {n:,} samples: {cpu:.2f} s CPU, {wall:.2f} s wall; {len(b):,} batches")
    # the packs of a mixture by tokens (the largest deficit rule, each of 60 readers' streams cut
    # next-fit): two sources of n / 2 samples, 2:1, the long-tailed costs above and a uniform one
    from tarshards.plan.mixing import _plan_packs, _Weights

    V = 60
    per = n // 2 // V
    long_ = costs[: V * per].reshape(V, per)
    short = rng.integers(50, 500, (V, per)).astype(np.float64)
    weights = _Weights(
        {"long": 2, "short": 1}, ["long", "short"], schedule_id=None, interpolate="step"
    )
    c0, w0 = time.process_time(), time.perf_counter()
    lay = _plan_packs(
        weights, MAX, "truncate", V, [per, per], "first", 0, 1, lambda i, _: (long_, short)[i], True
    )
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(
        f"  mixture pack plan of {2 * V * per:,} samples (readers={V}): {cpu:.2f} s CPU, "
        f"{wall:.2f} s wall; {lay.q * V:,} packs, fill {lay.fill(MAX):.4f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--plan-samples", type=int, default=None)
    ap.add_argument("--ratio", action="store_true", help="the packed/unpacked ratios only")
    args = ap.parse_args()
    n = args.samples or (20_000 if args.ratio else 10_000 if args.quick else 40_000)
    big = args.plan_samples or (2_000_000 if args.quick else 10_000_000)
    print(f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    manifest, lengths = make_data(n)
    if args.ratio:
        ratio_rows(manifest, lengths, max(args.repeat, 5))
        return
    from tarshards.plan.packing import pack_units

    b = max(1, round(len(lengths) / len(pack_units(lengths, MAX))))
    held = b * 16  # the samples of a default window (16 packs' worth)
    for readers in (READERS, 2):
        print(f"1. rate ({n:,} samples, readers={readers} in one process, B={b}):")
        rate_rows(manifest, b, held, args.repeat, readers)
    print("2. tokens per batch:")
    token_rows(lengths, b)
    print("3. planning from metadata:")
    plan_rows(big)


if __name__ == "__main__":
    main()
