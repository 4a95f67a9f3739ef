"""No regression: the benchmark rows of an earlier revision, run on that revision and on this tree.

    .venv/bin/python bench/bench_regress.py                  # against BASELINE, 3 rounds
    .venv/bin/python bench/bench_regress.py --rev abc123 --rounds 5 --quick
    .venv/bin/python bench/bench_regress.py --only raw_small,pil_small --json

Issue 15 asks that "the existing bench rows" stay within 5%. Comparing today's figures with an
old ``RESULTS.md`` says little (another day, another load on a shared host: absolute rates moved
2.5-4x between the runs kept there), so this script measures both sides now, side by side:

1. the baseline revision (``--rev``, default :data:`BASELINE`, the first version on main, before
   the work of issues 11-15) is checked out into a temporary directory (``git worktree``) and its
   C accelerators are built there (``setup.py build_ext --inplace``);
2. each row is measured by **the baseline's own** ``bench/run.py --child ROW ours`` (its own
   measuring code and data generator, the rows exactly as they were defined then), once with the
   baseline's ``src/`` first on ``PYTHONPATH`` and once with this tree's, in alternating order
   round by round, each run in a fresh process, over the same shards (the baseline's data folder
   is a link to this tree's ``bench/_data``; the generator is the same, seeded);
3. the best of ``--rounds`` runs per side is kept (as ``bench/run.py`` does) and the ratio
   ``this tree / baseline`` printed: rates (samples/s) must be >= 0.95, the memory row's peak
   RSS above baseline <= 1.05x (it is a bound, so lower is better).

The rows are the ``ours`` side of each of the baseline's benchmarks (webdataset's side is left
out: it does not change). Exit status 0 when every row is within 5%, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINE = "00ec922"  # main at the end of 2026-11-29: the first version, before issues 11-15
ROWS = [
    "raw_small",
    "raw_large",
    "write_small",
    "pil_small",
    "t224_large",
    "loader_small",
    "memory",
]
TOLERANCE = 0.05


def checkout(rev: str, where: str) -> str:
    """The baseline revision in ``where`` (a detached worktree), its C accelerators built."""
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "-q", "--detach", where, rev],
        check=True,
    )
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
        cwd=where,
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        print(
            f"note: the baseline's C accelerators did not build:\n{build.stderr}", file=sys.stderr
        )
    data = os.path.join(where, "bench", "_data")
    os.makedirs(os.path.join(HERE, "_data"), exist_ok=True)
    if not os.path.exists(data):
        os.symlink(os.path.join(HERE, "_data"), data)
    return where


def run_row(base: str, src: str, row: str, quick: bool) -> dict:
    """One fresh process: the baseline's child for ``row``, importing tarshards from ``src``."""
    env = dict(os.environ, PYTHONPATH=src)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both sides read their compiled modules alike
    cmd = [sys.executable, os.path.join(base, "bench", "run.py"), "--child", row, "ours"]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=base)
    if out.returncode != 0:
        raise RuntimeError(f"{row} with {src} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    check = subprocess.run(
        [sys.executable, "-c", "import tarshards, os; print(os.path.dirname(tarshards.__file__))"],
        env=env,
        capture_output=True,
        text=True,
        cwd=base,
    )
    where = check.stdout.strip()
    if not where.startswith(src):
        raise RuntimeError(f"tarshards came from {where}, not {src}")
    return res


def figure(row: str, res: dict) -> float:
    """The row's figure: samples/s, or for ``memory`` the peak RSS above baseline (bytes)."""
    if row == "memory":
        return float(res["above_baseline"])
    return res["items"] / res["seconds"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default=BASELINE, help=f"the baseline revision (default {BASELINE})")
    ap.add_argument("--rounds", type=int, default=3, help="runs per side and row (best kept)")
    ap.add_argument("--only", default=None, help="comma-separated rows: " + ",".join(ROWS))
    ap.add_argument("--quick", action="store_true", help="the baseline's --quick data and times")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = ap.parse_args(argv)
    rows = ROWS if args.only is None else [r.strip() for r in args.only.split(",")]
    here_src = os.path.join(ROOT, "src")
    tmp = tempfile.mkdtemp(prefix="tarshards-baseline-")
    base = os.path.join(tmp, "tree")
    results: dict = {}
    try:
        checkout(args.rev, base)
        base_src = os.path.join(base, "src")
        for row in rows:
            runs: dict = {"baseline": [], "this": []}
            for r in range(args.rounds):
                order = [("baseline", base_src), ("this", here_src)]
                if r % 2:
                    order.reverse()
                for side, src in order:
                    runs[side].append(figure(row, run_row(base, src, row, args.quick)))
            pick = min if row == "memory" else max
            b, t = pick(runs["baseline"]), pick(runs["this"])
            ratio = t / b if b else float("nan")
            ok = ratio <= 1 + TOLERANCE if row == "memory" else ratio >= 1 - TOLERANCE
            results[row] = {"baseline": b, "this": t, "ratio": ratio, "ok": ok, "runs": runs}
            unit = "MiB above baseline" if row == "memory" else "samples/s"
            scale = 1 / 2**20 if row == "memory" else 1
            print(
                f"{row:14s} baseline {b * scale:12,.1f}  this tree {t * scale:12,.1f} {unit:20s}"
                f" ratio {ratio:5.2f}  {'ok' if ok else 'REGRESSION'}",
                flush=True,
            )
    finally:
        subprocess.run(
            ["git", "-C", ROOT, "worktree", "remove", "--force", base], capture_output=True
        )
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"rev": args.rev, "rounds": args.rounds, "rows": results}, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
