"""No regression: every benchmark row of a base revision, run on the base and on this tree.

    .venv/bin/python bench/bench_regress.py                          # against main, 3 rounds
    .venv/bin/python bench/bench_regress.py --base /work/main --quick --rounds 2
    .venv/bin/python bench/bench_regress.py --base abc123 --only raw_small,pil_small --json

Comparing today's figures with an old ``RESULTS.md`` says little (another day, another load on a
shared host: absolute rates moved 2.5-4x between the runs kept there), so this script measures
both sides now, side by side, in one run:

1. the base (``--base``, default ``main``): a directory holding a checkout (its ``src/`` used as
   it is, C accelerators as built there; nothing is written into it), or a git revision, which is
   exported (``git archive``, no worktree) into a temporary directory and its C accelerators
   built there (``setup.py build_ext --inplace``);
2. the harness is **the base's own** ``bench/`` (``run.py`` and ``common.py``), copied into a
   temporary directory whose data folder is a link to this tree's ``bench/_data`` (the generator
   is the same, seeded): every row its ``run.py`` defines (``CHILDREN``) is measured by
   ``run.py --child ROW ours``, once with the base's ``src/`` first on ``PYTHONPATH`` and once
   with this tree's, in alternating order round by round, each run in a fresh process, over the
   same shards;
3. the best of ``--rounds`` runs per side is kept (as ``bench/run.py`` does) and the ratio
   ``this tree / base`` printed per row: rates (samples/s) must be >= 0.95, the memory row's peak
   RSS above baseline <= 1.05x (it is a bound, so lower is better).

The rows are the ``ours`` side of each benchmark (a peer's side does not change). ``--quick``
(the harness's smaller data and times) is the short mode; on a loaded machine take several
rounds, as single runs vary by more than 5%. Exit status 0 when every row is within 5%, else 1.
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
BASE = "main"
TOLERANCE = 0.05


def base_tree(base: str, tmp: str) -> str:
    """The base's tree: ``base`` itself when it is a checkout, else revision ``base`` exported
    into ``tmp/tree`` with its C accelerators built."""
    if os.path.isdir(os.path.join(base, "src", "tarshards")):
        return os.path.abspath(base)
    where = os.path.join(tmp, "tree")
    os.makedirs(where)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", base], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"--base {base!r}: neither a checkout nor a revision of {ROOT}")
    subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
        cwd=where,
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        print(f"note: the base's C accelerators did not build:\n{build.stderr}", file=sys.stderr)
    return where


def harness(tree: str, tmp: str) -> str:
    """A copy of the base's ``bench/`` scripts, its data folder a link to this tree's."""
    where = os.path.join(tmp, "bench")
    os.makedirs(where)
    for name in os.listdir(os.path.join(tree, "bench")):
        if name.endswith(".py"):
            shutil.copy(os.path.join(tree, "bench", name), where)
    os.makedirs(os.path.join(HERE, "_data"), exist_ok=True)
    os.symlink(os.path.join(HERE, "_data"), os.path.join(where, "_data"))
    return where


def harness_rows(bench: str, src: str) -> list[str]:
    """The rows the harness's ``run.py`` defines (its ``CHILDREN``)."""
    code = "import json, run; print(json.dumps(list(run.CHILDREN)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([bench, src])),
        cwd=bench,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_row(bench: str, src: str, row: str, quick: bool) -> dict:
    """One fresh process: the harness's child for ``row``, importing tarshards from ``src``."""
    env = dict(os.environ, PYTHONPATH=src)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both sides read their compiled modules alike
    cmd = [sys.executable, os.path.join(bench, "run.py"), "--child", row, "ours"]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=bench)
    if out.returncode != 0:
        raise RuntimeError(f"{row} with {src} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    check = subprocess.run(
        [sys.executable, "-c", "import tarshards, os; print(os.path.dirname(tarshards.__file__))"],
        env=env,
        capture_output=True,
        text=True,
        cwd=bench,
    )
    where = check.stdout.strip()
    if not where.startswith(src):
        raise RuntimeError(f"tarshards came from {where}, not {src}")
    return res


def figure(row: str, res: dict) -> float:
    """The row's figure: samples/s (bytes/s for a row that counts no samples, such as
    ``cat_large``), or for ``memory`` the peak RSS above baseline (bytes)."""
    if row == "memory":
        return float(res["above_baseline"])
    return (res["items"] or res.get("bytes", 0)) / res["seconds"]


def unit(row: str, res: dict) -> tuple[str, float]:
    """How the row's figure is printed: its unit and scale."""
    if row == "memory":
        return "MiB above baseline", 1 / 2**20
    return ("samples/s", 1) if res.get("items") else ("MB/s", 1e-6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--base",
        "--rev",
        default=BASE,
        help=f"a checkout's directory or a git revision to compare with (default {BASE})",
    )
    ap.add_argument("--rounds", type=int, default=3, help="runs per side and row (best kept)")
    ap.add_argument("--only", default=None, help="comma-separated rows (default: every row)")
    ap.add_argument("--quick", action="store_true", help="the harness's --quick data and times")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = ap.parse_args(argv)
    here_src = os.path.join(ROOT, "src")
    tmp = tempfile.mkdtemp(prefix="tarshards-base-")
    results: dict = {}
    try:
        tree = base_tree(args.base, tmp)
        base_src = os.path.join(tree, "src")
        bench = harness(tree, tmp)
        every = harness_rows(bench, base_src)
        rows = every if args.only is None else [r.strip() for r in args.only.split(",")]
        unknown = [r for r in rows if r not in every]
        if unknown:
            ap.error(f"unknown rows {unknown}; the base defines {', '.join(every)}")
        print(f"base {args.base} ({tree}) vs this tree ({ROOT}); {args.rounds} rounds", flush=True)
        for row in rows:
            runs: dict = {"base": [], "this": []}
            for r in range(args.rounds):
                order = [("base", base_src), ("this", here_src)]
                if r % 2:
                    order.reverse()
                for side, src in order:
                    res = run_row(bench, src, row, args.quick)
                    runs[side].append(figure(row, res))
            pick = min if row == "memory" else max
            b, t = pick(runs["base"]), pick(runs["this"])
            ratio = t / b if b else float("nan")
            ok = ratio <= 1 + TOLERANCE if row == "memory" else ratio >= 1 - TOLERANCE
            results[row] = {"base": b, "this": t, "ratio": ratio, "ok": ok, "runs": runs}
            what, scale = unit(row, res)
            print(
                f"{row:14s} base {b * scale:12,.1f}  this tree {t * scale:12,.1f} {what:20s}"
                f" ratio {ratio:5.2f}  {'ok' if ok else 'REGRESSION'}",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"base": args.base, "rounds": args.rounds, "rows": results}, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
