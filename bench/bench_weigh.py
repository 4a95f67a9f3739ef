"""Weighing two mechanisms (issue 36, item 7): what each saves on its own benchmark row.

    .venv/bin/python bench/bench_weigh.py                 # both, 6 processes a side
    .venv/bin/python bench/bench_weigh.py --only jpeg --processes 10

1. ``readback``: the tar read-back thread of ``_c/readback.c`` (``_xxh3.Background``: while
   ``ShardWriter(manifest=...)`` writes a plain shard, a pthread reads the file back, hashes it
   and each member and lays out the index's columns). Its switch is
   ``tarshards.format.hashing.background_hasher``: where it returns ``None`` the writer hashes and
   records inline (``_speedups.Recorder`` in ``tar_sample``, the file hashed as it is written).
   The row is ``bench_index.py --only-recording``'s: 4 KB samples (the small layout's, raw
   fields, ``encoder=False``) written by ``ShardWriter`` into 4 shards on ``/dev/shm``, with and
   without ``manifest=``. Each process runs interleaved rounds of three sides (no manifest; the
   manifest recorded by the read-back thread; recorded inline) and reports its medians; the
   processes alternate which side comes first.
2. ``jpeg``: loading the libjpeg-turbo that Pillow's wheel bundles (``images._pillow_libjpeg``
   globs ``pillow.libs/libjpeg*.so*``, ``_jpeg.use_library`` dlopens it) instead of the one
   ``_jpeg`` was linked with (the system's). Its switch is ``TARSHARDS_LIBJPEG=system``. The row
   is ``bench_decode.py``'s overhead row: 64x64 JPEGs (q=90) decoded by the C decoder
   (``_jpeg.image``, what the ``rgb8`` mode calls per JPEG), beside simplejpeg's
   ``decode_jpeg`` and Pillow's ``Image.open(...).convert("RGB")`` on the same bytes. The choice
   is made once per process, so each side is a process of its own, alternated, pinned to one
   CPU; the figure is CPU time per JPEG (the wall clock of a loaded host varies more).

The processes' medians are printed and the median over processes of each side is compared.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- 1. the read-back thread ----------------------------------------------------------------


def readback_child(rounds: int, n: int, first: str) -> dict:
    sys.path.insert(0, HERE)
    import common

    import tarshards.format.hashing as hashing
    from tarshards import ShardWriter
    from tarshards.pipeline.dataset import iter_samples

    samples = []
    for s in iter_samples(common.make_dataset("small", quick=n <= 8000)):
        samples.append({k: v for k, v in s.items() if k != "__url__"})
        if len(samples) >= n:
            break
    real = hashing.background_hasher
    tmp = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def once(side: str) -> tuple:
        hashing.background_hasher = real if side == "readback" else (lambda *a, **k: None)
        d = tempfile.mkdtemp(dir=tmp)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        with ShardWriter(
            os.path.join(d, "w-%05d.tar"),
            maxcount=max(1, len(samples) // 4),
            encoder=False,
            manifest=None if side == "plain" else os.path.join(d, "m.json"),
        ) as w:
            for s in samples:
                w.write(s)
        dt = (time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0)
        shutil.rmtree(d)
        return dt

    sides = ["plain", "readback", "inline"]
    if first == "inline":
        sides = ["plain", "inline", "readback"]
    times: dict = {s: [] for s in sides}
    for s in sides:  # warm-up
        once(s)
    for _ in range(rounds):
        for s in sides:
            times[s].append(once(s))
    hashing.background_hasher = real
    out: dict = {"samples": len(samples)}
    for i, clock in enumerate(("", "_thread", "_process")):  # wall, writing thread's, all CPU
        out |= {s + clock: statistics.median(t[i] for t in v) for s, v in times.items()}
    return out


def bench_readback(processes: int, rounds: int, n: int) -> dict:
    runs = []
    for p in range(processes):
        first = "readback" if p % 2 == 0 else "inline"
        cmd = [sys.executable, __file__, "--child", "readback", "--rounds", str(rounds)]
        cmd += ["--n", str(n), "--first", first]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.splitlines()[-1]))
        r = runs[-1]
        print(
            f"  process {p}: plain {r['plain'] * 1e3:7.1f} ms  read-back {r['readback'] * 1e3:7.1f}"
            f" ms ({r['readback'] / r['plain'] - 1:+6.1%})  inline {r['inline'] * 1e3:7.1f} ms"
            f" ({r['inline'] / r['plain'] - 1:+6.1%})",
            flush=True,
        )
    med = {s: statistics.median(r[s] for r in runs) for s in ("plain", "readback", "inline")}
    per = {
        s: statistics.median(r[s] / r["plain"] - 1 for r in runs) for s in ("readback", "inline")
    }
    saved = statistics.median(1 - r["readback"] / r["inline"] for r in runs)
    cpu = {
        c: {s: statistics.median(r[s + c] / r["plain" + c] - 1 for r in runs) for s in per}
        for c in ("_thread", "_process")
    }
    print(
        f"readback: {runs[0]['samples']} samples of ~4 KB, 4 shards, /dev/shm; median over "
        f"{processes} processes of {rounds} rounds each:\n"
        f"  recording costs {per['readback']:+.1%} with the read-back thread, "
        f"{per['inline']:+.1%} inline; the thread saves {saved:.1%} of the recorded row's time "
        f"(rate {1 / (1 - saved) - 1:+.1%})\n"
        f"  CPU time, writing thread: {cpu['_thread']['readback']:+.1%} read-back, "
        f"{cpu['_thread']['inline']:+.1%} inline; whole process: "
        f"{cpu['_process']['readback']:+.1%} read-back, {cpu['_process']['inline']:+.1%} inline"
    )
    return {"runs": runs, "median_s": med, "cost": per, "saved": saved, "cpu": cpu}


# ---- 2. Pillow's libjpeg-turbo ----------------------------------------------------------------


def jpegs(n: int = 400) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        base = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
        img = np.kron(base, np.ones((8, 8, 1), np.uint8)).astype(np.int16)
        img = np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def jpeg_child(side: str, rounds: int) -> dict:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    data = jpegs()
    if side in ("pillow-lib", "system-lib"):
        from tarshards import _jpeg
        from tarshards.codecs import images

        assert images._cjpeg() is not None
        library = _jpeg.library()

        def decode(b):
            return _jpeg.image(b, 3, False)
    elif side == "simplejpeg":
        import simplejpeg

        library = None

        def decode(b):
            return simplejpeg.decode_jpeg(b, "RGB")
    else:
        from PIL import Image

        library = None

        def decode(b):
            with Image.open(io.BytesIO(b)) as im:
                return im.convert("RGB")

    for b in data:
        decode(b)
    per = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(5):
            for b in data:
                decode(b)
        per.append((time.process_time() - t0) / (5 * len(data)))
    return {"side": side, "us": statistics.median(per) * 1e6, "library": library}


def bench_jpeg(processes: int, rounds: int) -> dict:
    sides = ["pillow-lib", "system-lib", "simplejpeg", "Pillow"]
    runs: dict = {s: [] for s in sides}
    libs: dict = {}
    for p in range(processes):
        for s in sides if p % 2 == 0 else sides[::-1]:
            env = dict(os.environ)
            env.pop("TARSHARDS_LIBJPEG", None)
            if s == "system-lib":
                env["TARSHARDS_LIBJPEG"] = "system"
            cmd = [sys.executable, __file__, "--child", "jpeg", "--side", s]
            cmd += ["--rounds", str(rounds)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            r = json.loads(out.stdout.splitlines()[-1])
            runs[s].append(r["us"])
            libs[s] = r["library"]
    med = {s: statistics.median(v) for s, v in runs.items()}
    print(f"jpeg: 64x64 JPEGs (q=90), CPU us per JPEG, median over {processes} processes:")
    for s in sides:
        lib = f"  ({libs[s]})" if libs[s] else ""
        print(f"  {s:12s} {med[s]:7.2f} us  {med['system-lib'] / med[s]:5.2f}x system-lib{lib}")
    saved = 1 - med["pillow-lib"] / med["system-lib"]
    print(f"  Pillow's libjpeg-turbo saves {saved:.1%} of the C decoder's time per JPEG")
    return {"runs": runs, "median_us": med, "libraries": libs, "saved": saved}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["readback", "jpeg"], default=None)
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=20000, help="samples written a round (readback)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--first", default="readback", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "readback":
        print(json.dumps(readback_child(args.rounds, args.n, args.first)))
        return 0
    if args.child == "jpeg":
        print(json.dumps(jpeg_child(args.side, args.rounds)))
        return 0
    print(f"# bench_weigh (load average {os.getloadavg()[0]:.1f})", flush=True)
    out = {}
    if args.only in (None, "readback"):
        out["readback"] = bench_readback(args.processes, args.rounds, args.n)
    if args.only in (None, "jpeg"):
        out["jpeg"] = bench_jpeg(args.processes, args.rounds)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
