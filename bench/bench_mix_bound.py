"""Token shares of mixtures of three to six sources, per pack and over the whole stream.

For each of ``--mixtures`` random mixtures (weights far apart, sources of small samples with
rare large ones or uniform sizes, packs of a few of the largest samples: the hard case), plan
the packs with ``tarshards.plan.mixing._plan_packs`` (one reader) and report:

- the worst pack's error ``max_s |t_s - w_s T|`` in units of the largest sample ``M`` (the issue
  asks for <= 1 in every pack), and the packs' fill;
- the largest carried error of the whole stream ``max_s |w_s T - t_s|`` over all prefixes of
  packs, in ``M`` (no drift: it stays bounded however many packs);

against the largest deficit rule alone (each reader's stream cut next-fit: the plan before packs
were filled in and checked), computed here with ``TokenDeficits``.
Then the time to plan the packs of a three-source mixture of 3M samples (60 readers).

    python bench/bench_mix_bound.py [--mixtures 300] [--seed 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tarshards.plan.mixing import TokenDeficits, _plan_packs, _Weights


def mixture(rng, n):
    k = int(rng.integers(3, 7))
    w = rng.dirichlet(np.ones(k) * rng.choice([0.3, 1, 5]))
    w = np.maximum(w, 0.01)
    w /= w.sum()
    pools = []
    for _ in range(k):
        hi = int(rng.integers(2, 60))
        if rng.random() < 0.4:
            c = np.where(rng.random(n) < 0.1, float(hi), 1.0)
        else:
            c = rng.integers(1, hi + 1, n).astype(np.float64)
        pools.append(c)
    return w, pools, float(rng.integers(60, 400))


def errors(w, packs, M):
    """(worst pack error, worst carried error), in M."""
    worst = drift = 0.0
    got = np.zeros(len(w))
    for part in packs:
        T = part.sum()
        worst = max(worst, float(np.abs(part - w * T).max()))
        got += part
        drift = max(drift, float(np.abs(w * got.sum() - got).max()))
    return worst / M, drift / M


def rule_alone(w, pools, budget, npacks):
    """The largest deficit rule's stream cut next-fit (no pack composed again)."""
    k = len(w)
    rule = TokenDeficits(1, k)
    pos = [0] * k
    out, part, room = [], np.zeros(k), budget
    W = w[None, :]
    while len(out) < npacks:
        s = int(rule.pick(W)[0])
        if pos[s] >= len(pools[s]):
            break
        c = float(pools[s][pos[s]])
        if part.sum() > 0 and c > room:
            out.append(part)
            part, room = np.zeros(k), budget
        rule.take(np.asarray([s]), np.asarray([c]), W)
        pos[s] += 1
        part[s] += c
        room -= c
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixtures", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--samples", type=int, default=3_000_000)
    ap.add_argument("--time-only", action="store_true", help="the planning time only")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    if not args.time_only:
        shares(rng, args.mixtures)
    plan_time(rng, args.samples)


def shares(rng, mixtures: int) -> None:
    n = 20_000
    ours, alone, over = [], [], 0
    for _ in range(mixtures):
        w, pools, budget = mixture(rng, n)
        names = [f"s{i}" for i in range(len(w))]
        weights = _Weights(dict(zip(names, w)), names, schedule_id=None, interpolate="step")
        largest = [float(p.max()) for p in pools]
        M = max(largest)
        lay = _plan_packs(
            weights, budget, "truncate", 1, [n] * len(w), "first", 0, 1,
            lambda i, _, pools=pools: pools[i][None, :], True, largest,
        )  # fmt: skip
        packs = []
        for j in range(lay.q):
            src, pos = lay.pack(0, j)
            tok = np.asarray([pools[s][p] for s, p in zip(src, pos)])
            packs.append(np.bincount(src, weights=tok, minlength=len(w)))
        ours.append((*errors(w, packs, M), lay.fill(budget)))
        theirs = rule_alone(w, pools, budget, lay.q)
        a = (*errors(w, theirs, M), float(np.mean([p.sum() for p in theirs])) / budget)
        alone.append(a)
        over += a[0] > 1 + 1e-9
    o, a = np.asarray(ours), np.asarray(alone)
    print(f"{mixtures} mixtures of 3-6 sources, packs of 60-400 tokens, largest samples 2-59")
    print(
        f"  worst pack error / M: composed {o[:, 0].max():.4f}, rule alone {a[:, 0].max():.4f} "
        f"({over} mixtures with a pack over one sample)"
    )
    print(
        f"  largest carried error / M: composed {o[:, 1].max():.3f} "
        f"(median {np.median(o[:, 1]):.3f}), rule alone {a[:, 1].max():.3f}"
    )
    print(
        f"  fill (median, lowest): ours {np.median(o[:, 2]):.3f}, {o[:, 2].min():.3f}; the rule's "
        f"stream cut next-fit {np.median(a[:, 2]):.3f}, {a[:, 2].min():.3f}"
    )


def plan_time(rng, samples: int) -> None:
    """Planning time, three sources of long-tailed, uniform and short costs, 60 readers."""
    V = 60
    per = samples // 3 // V
    big = np.minimum(rng.pareto(1.2, (V, per)) * 300 + 20, 8192).astype(np.float64)
    uni = rng.integers(50, 2000, (V, per)).astype(np.float64)
    short = rng.integers(10, 200, (V, per)).astype(np.float64)
    names = ["long", "uniform", "short"]
    weights = _Weights(dict(zip(names, (5, 3, 2))), names, schedule_id=None, interpolate="step")
    c0, w0 = time.process_time(), time.perf_counter()
    lay = _plan_packs(
        weights, 8192, "truncate", V, [per] * 3, "first", 0, 1,
        lambda i, _: (big, uni, short)[i], True,
    )  # fmt: skip
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(
        f"  pack plan of a 3-source mixture of {3 * V * per:,} samples (readers={V}): "
        f"{cpu:.2f} s CPU, {wall:.2f} s wall; {lay.q * V:,} packs, fill {lay.fill(8192):.4f}"
    )


if __name__ == "__main__":
    main()
