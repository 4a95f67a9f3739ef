"""Mixing by tokens: the cost of planning a token-weighted mixture against a sample-weighted one,
and the token shares each delivers (issue 38, item 4), side by side in one run.

    .venv/bin/python bench/bench_mix.py              # 2 sources x 250,000 samples
    .venv/bin/python bench/bench_mix.py --quick      # 2 x 20,000
    .venv/bin/python bench/bench_mix.py --samples 1000000 --repeat 3

Data (made once in ``bench/_data/mix-*``, fixed seed): two sources written by ``ShardWriter``
with a ``tokens`` metadata column in their manifests: ``long`` (long-tailed, Pareto 1.2 x 40,
capped at 8,192 tokens: documents) and ``short`` (uniform 20-200 tokens: chat turns). Both
mixtures are ``mix({...}, weights={"long": 0.5, "short": 0.5}, readers=60, stop="cycle")``,
``.batched(256)``, ``long`` with ``.shuffle(1000)``.

Rows:

1. ``plan``: from ``mix(...)`` on the manifests to the epoch's plan (``steps_per_epoch()``: the
   per-source plans and, by tokens, every reader's composition from the ``tokens`` columns and
   the shuffle buffers replayed on positions), caches cleared, best of ``--repeat``; ratio
   tokens / samples. The same with a step schedule (two points) for both units.
2. ``shares``: over the first ``--batches`` global batches (read through the pipeline, the
   tokens counted from the samples' own field, not from the plan): the ``long`` source's share
   of tokens (target 0.5), the largest per-batch error ``|t_s - w_s T|`` in tokens and in units
   of the largest sample (the bound: one sample), and the spread of the per-batch shares.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import DATA, is_made, machine_info, mark_made  # noqa: E402

B, READERS = 256, 60


def _tokens(sample):
    return int(sample["tok"])


def make_sources(n: int) -> dict[str, str]:
    from tarshards import ShardWriter

    out = {}
    draws = {
        "long": lambda r: min(8192, int(r.paretovariate(1.2) * 40)),
        "short": lambda r: r.randint(20, 200),
    }
    for seed, (name, draw) in enumerate(draws.items()):
        d = os.path.join(DATA, f"mix-{name}-{n}")
        os.makedirs(d, exist_ok=True)
        manifest = os.path.join(d, "manifest.json")
        want = {"n": n, "name": name, "version": 1}
        stamp = os.path.join(d, "made.json")
        if not is_made(stamp, want, [manifest]):
            rng = random.Random(seed)
            with ShardWriter(
                os.path.join(d, "part-%04d.tar"),
                maxcount=max(1, n // 8),
                manifest=manifest,
                meta={"tokens": _tokens},
            ) as w:
                for i in range(n):
                    w.write({"__key__": f"{name}{i:08d}", "tok": str(draw(rng)).encode()})
            mark_made(stamp, want)
        out[name] = manifest
    return out


SCHEDULE = [(0, {"long": 0.8, "short": 0.2}), (500, {"long": 0.5, "short": 0.5})]


def build(sources, unit, scheduled=False):
    from tarshards.pipeline.dataset import WebDataset
    from tarshards.plan.mixing import mix

    srcs = {
        "long": WebDataset(sources["long"], seed=0).shuffle(1000),
        "short": WebDataset(sources["short"], seed=0),
    }
    weights = SCHEDULE if scheduled else {"long": 0.5, "short": 0.5}
    return (
        mix(srcs, weights, readers=READERS, stop="cycle", seed=1, unit=unit)
        .to_tuple("__source__", "tok")
        .batched(B)
    )


def clear_caches():
    from tarshards.plan import epoch as plan
    from tarshards.plan import mixing

    mixing._LAYOUTS.clear()
    mixing._EPOCH_BATCHES.clear()
    mixing.batch_quotas.cache_clear()
    plan._cached_plan.cache_clear()
    gc.collect()


def plan_time(sources, unit, scheduled, repeat):
    best = float("inf")
    steps = 0
    for _ in range(repeat):
        clear_caches()
        t = time.perf_counter()
        ds = build(sources, unit, scheduled)
        steps = ds.steps_per_epoch(0, world_size=1)
        best = min(best, time.perf_counter() - t)
    return best, steps


def shares(sources, unit, batches, largest):
    import itertools

    ds = build(sources, unit)
    tot = {"long": 0, "short": 0}
    worst = 0.0
    per_batch = []
    for src, tok in itertools.islice(iter(ds), batches):
        toks = [int(t) for t in tok]
        T = sum(toks)
        t_long = sum(t for s, t in zip(src, toks) if s == "long")
        tot["long"] += t_long
        tot["short"] += T - t_long
        worst = max(worst, abs(t_long - 0.5 * T))
        per_batch.append(t_long / T)
    import numpy as np

    share = tot["long"] / (tot["long"] + tot["short"])
    return {
        "long_token_share": round(share, 4),
        "worst_batch_error_tokens": worst,
        "worst_batch_error_samples": round(worst / largest, 3),
        "batch_share_p5_p95": [round(float(x), 3) for x in np.percentile(per_batch, [5, 95])],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=250_000, help="samples per source")
    p.add_argument("--quick", action="store_true", help="2 x 20,000 samples")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batches", type=int, default=600, help="global batches read for shares")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    n = 20_000 if args.quick else args.samples
    t = time.perf_counter()
    sources = make_sources(n)
    made = time.perf_counter() - t
    from tarshards import Manifest

    largest = max(float(Manifest.load(m).meta("tokens").max()) for m in sources.values())
    out = {"machine": machine_info(), "samples_per_source": n, "made_s": round(made, 1)}
    rows = []
    for scheduled in (False, True):
        tm = {}
        for unit in ("samples", "tokens"):
            tm[unit], steps = plan_time(sources, unit, scheduled, args.repeat)
        label = "schedule" if scheduled else "constant"
        rows.append(
            {
                "row": f"plan, {label} weights",
                "samples_s": round(tm["samples"], 4),
                "tokens_s": round(tm["tokens"], 4),
                "ratio": round(tm["tokens"] / tm["samples"], 2),
                "steps": steps,
            }
        )
    out["plan"] = rows
    out["shares"] = {
        unit: shares(sources, unit, args.batches, largest) for unit in ("samples", "tokens")
    }
    out["largest_sample_tokens"] = largest
    print(f"{2 * n:,} samples in 2 sources, readers={READERS}, batches of {B}")
    for r in rows:
        print(
            f"{r['row']:<28} samples {r['samples_s'] * 1e3:8.1f} ms   tokens "
            f"{r['tokens_s'] * 1e3:8.1f} ms   x{r['ratio']:.2f}"
        )
    for unit, sh in out["shares"].items():
        print(f"shares by {unit:<8} {sh}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
