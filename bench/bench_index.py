"""The manifest and index: indexing speed, random access, the cost of recording while writing.

    .venv/bin/python bench/bench_index.py             # the small benchmark shards (common.py)
    .venv/bin/python bench/bench_index.py --quick     # fewer shards, fewer repetitions
    .venv/bin/python bench/bench_index.py --layout large

Three measurements, side by side in one run (figures are best of ``--repeat``):

1. ``tarshards index`` on plain local shards (page-cached), one process, hashing on (xxh3_64 of
   every file and of every member), as MB/s against ``cat FILES > /dev/null``. Target >= 0.5.
2. 2,000 random ``ds[i]`` on the same local shards (raw samples, no decoding) with
   ``tarshards.IndexedDataset``, ``wids.ShardListDataset`` (``wids==0.1.11``) and MosaicML
   Streaming's ``StreamingDataset`` (``mosaicml-streaming``; the samples converted once to its MDS
   format). Targets: >= 2x wids, >= 1x Streaming. Every reader returns a checksum of the bytes it
   read, so they are compared on the same samples.
3. ``ShardWriter`` samples/s with and without ``manifest=`` (raw bytes fields, ``encoder=False``;
   CPU time of this process, the writes going to page cache). Target: <= 5% slower.

The peers run in their own virtual environment, ``bench/.venv`` (git-ignored), because
``mosaicml-streaming`` pins ``numpy<2.2`` and imports ``torchvision`` and ``transformers`` when
imported. Make it once (``torch`` exactly 2.13.0, CPU; ``--no-deps`` for the peers)::

    python -m venv bench/.venv
    bench/.venv/bin/pip install torch==2.13.0 "numpy<2.2"      # or the local CPU wheel
    bench/.venv/bin/pip install --no-deps wids==0.1.11 mosaicml-streaming torchvision \\
        "transformers<5" "huggingface_hub<1" "tokenizers>=0.22,<=0.23.0" safetensors regex \\
        requests packaging pillow charset-normalizer idna urllib3 certifi
    bench/.venv/bin/pip install braceexpand pyyaml xxhash zstd tqdm catalogue Brotli \\
        python-snappy

(``--peer-python`` points elsewhere). Without it the peers' rows say "not installed". Before
``import streaming`` the peer defines the schemas of ``torchvision::nms`` / ``qnms`` (the
torchvision wheel's own operators do not load against this torch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_VENV = os.path.join(HERE, ".venv", "bin", "python")


# ---------------------------------------------------------------------------------------------
# the peers (run in bench/.venv; nothing of tarshards is imported there)
# ---------------------------------------------------------------------------------------------


def _peer_checksum(samples) -> int:
    import zlib

    total = 0
    for s in samples:
        for k in sorted(s):
            v = s[k]
            if hasattr(v, "getvalue"):  # wids hands out io.BytesIO
                v = v.getvalue()
            if not k.startswith("__") and isinstance(v, (bytes, bytearray, memoryview)):
                total = (total + zlib.crc32(bytes(v))) & 0xFFFFFFFF
    return total


def peer_wids(job: dict) -> dict:
    import wids

    shards = [{"url": u, "nsamples": n} for u, n in zip(job["urls"], job["counts"])]
    cache = tempfile.mkdtemp(prefix="wids-cache-")
    try:
        ds = wids.ShardListDataset(shards, cache_dir=cache, transformations=[])
        for i in job["warm"]:  # open every shard once (wids reads each shard's member list)
            ds[i]
        best = float("inf")
        for _ in range(job["repeat"]):
            t0 = time.perf_counter()
            got = [ds[i] for i in job["indices"]]
            best = min(best, time.perf_counter() - t0)
        fields = [{k[1:] if k.startswith(".") else k: v for k, v in s.items()} for s in got]
        return {
            "seconds": best,
            "checksum": _peer_checksum(fields),
            "version": wids.__version__ if hasattr(wids, "__version__") else "0.1.11",
        }
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _mds_dir(job: dict) -> str:
    """The samples of ``job["urls"]`` converted once to MDS (bench/_data/mds-<name>)."""
    import tarfile

    from streaming import MDSWriter

    out = job["mds_dir"]
    stamp = os.path.join(out, "source.json")
    source = {"urls": job["urls"], "sizes": [os.path.getsize(u) for u in job["urls"]]}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == source:
                return out
    shutil.rmtree(out, ignore_errors=True)
    columns = None
    writer = None
    try:
        for url in job["urls"]:
            with tarfile.open(url) as tf:
                key, sample = None, {}
                for m in tf:
                    if not m.isfile():
                        continue
                    k, _, ext = m.name.partition(".")
                    if k != key and sample:
                        if writer is None:
                            columns = {e: "bytes" for e in sample}
                            writer = MDSWriter(
                                out=out, columns=columns, compression=None, size_limit=1 << 26
                            )
                        writer.write(sample)
                        sample = {}
                    key = k
                    sample[ext] = tf.extractfile(m).read()
                if sample:
                    writer.write(sample)
    finally:
        if writer is not None:
            writer.finish()
    with open(stamp, "w") as f:
        json.dump(source, f)
    return out


def peer_streaming(job: dict) -> dict:
    import torch

    lib = torch.library.Library("torchvision", "DEF")  # noqa: F841 - keep it alive
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    import streaming
    from streaming import StreamingDataset

    local = _mds_dir(job)
    streaming.base.util.clean_stale_shared_memory()
    ds = StreamingDataset(local=local, batch_size=1, shuffle=False)
    for i in job["warm"]:
        ds[i]
    best = float("inf")
    for _ in range(job["repeat"]):
        t0 = time.perf_counter()
        got = [ds[i] for i in job["indices"]]
        best = min(best, time.perf_counter() - t0)
    return {"seconds": best, "checksum": _peer_checksum(got), "version": streaming.__version__}


def run_peer(python: str, name: str, job: dict, timeout: float = 1200) -> dict:
    if not os.path.exists(python):
        return {"error": f"not installed ({python} missing; see this file's docstring)"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        path = f.name
    try:
        proc = subprocess.run(
            [python, os.path.abspath(__file__), "--peer", name, path],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        return {
            "error": proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"exit {proc.returncode}"
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# ours
# ---------------------------------------------------------------------------------------------


def _best_wall(cmd: list[str] | str, repeat: int, env=None) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(
            cmd,
            shell=isinstance(cmd, str),
            check=True,
            env=env,
            executable="/bin/bash" if isinstance(cmd, str) else None,
        )
        best = min(best, time.perf_counter() - t0)
    return best


def bench_index_vs_cat(paths, tmp: str, repeat: int) -> dict:
    import common

    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    nbytes = common.total_bytes(paths)
    cat = _best_wall("cat " + " ".join(paths) + " > /dev/null", repeat)
    out = os.path.join(tmp, "index-cli", "manifest.json")
    cmd = [
        sys.executable,
        "-c",
        "from tarshards.cli.main import main; main()",
        "index",
        "-q",
        "-p",
        "1",
        *paths,
        "-o",
        out,
    ]
    index = _best_wall(cmd, repeat, env)
    from tarshards.index import index_url

    inproc = float("inf")
    for _ in range(repeat):  # the same work without the interpreter's start-up
        t0 = time.perf_counter()
        for p in paths:
            index_url(p)
        inproc = min(inproc, time.perf_counter() - t0)
    ncpu = os.cpu_count() or 1
    par = _best_wall(cmd[:5] + ["-q", "-p", str(ncpu), *paths, "-o", out], repeat, env)
    return {
        "bytes": nbytes,
        "cat_s": cat,
        "index_s": index,
        "index_parallel_s": par,
        "ncpu": ncpu,
        "index_inprocess_s": inproc,
    }


def bench_random(manifest, indices, warm, repeat: int) -> dict:
    from tarshards.indexed import IndexedDataset

    ds = IndexedDataset(manifest)
    for i in warm:
        ds[i]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = [ds[i] for i in indices]
        best = min(best, time.perf_counter() - t0)
    ds.close()
    return {"seconds": best, "checksum": _peer_checksum(got)}


def bench_recording(samples, tmp: str, repeat: int) -> dict:
    from tarshards import ShardWriter

    def once(manifest: bool) -> float:
        d = tempfile.mkdtemp(dir=tmp)
        t0 = time.process_time()
        with ShardWriter(
            os.path.join(d, "rec-%05d.tar"),
            maxcount=max(1, len(samples) // 4),
            encoder=False,
            manifest=os.path.join(d, "m.json") if manifest else None,
        ) as w:
            for s in samples:
                w.write(s)
        dt = time.process_time() - t0
        shutil.rmtree(d)
        return dt

    plain, recorded = [], []
    for _ in range(repeat):  # interleaved, so that a busy moment hits both
        plain.append(once(False))
        recorded.append(once(True))
    return {"samples": len(samples), "plain_s": min(plain), "manifest_s": min(recorded)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shards, fewer repetitions")
    ap.add_argument("--layout", default="small", choices=["small", "large"])
    ap.add_argument("--samples", type=int, default=2000, help="random accesses")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--peer-python", default=PEER_VENV)
    ap.add_argument("--peer", nargs=2, metavar=("NAME", "JOB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        name, path = args.peer
        with open(path) as f:
            job = json.load(f)
        result = {"wids": peer_wids, "streaming": peer_streaming}[name](job)
        print(json.dumps(result))
        return

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import numpy as np

    import common
    from tarshards.manifest import build_manifest
    from tarshards.pipeline import iter_samples

    repeat = args.repeat or (2 if args.quick else 5)
    paths = common.make_dataset(args.layout, quick=args.quick)
    common.warm_cache(paths)
    tmp = tempfile.mkdtemp(
        prefix="bench-index-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    results: dict = {"machine": common.machine_info(), "layout": args.layout, "quick": args.quick}
    try:
        # 1. indexing vs cat
        r1 = bench_index_vs_cat(paths, tmp, repeat)
        results["index"] = r1
        # 2. random access
        manifest = build_manifest(paths, os.path.join(tmp, "ra", "manifest.json"), workers=1)
        total = manifest.num_samples
        rng = np.random.default_rng(7)
        indices = rng.integers(0, total, args.samples).tolist()
        starts = np.concatenate([[0], np.cumsum([r.samples for r in manifest.shards])])
        warm = [int(s) for s in starts[:-1]]
        ours = bench_random(manifest, indices, warm, repeat)
        job = {
            "urls": manifest.shard_urls(),
            "counts": [r.samples for r in manifest.shards],
            "indices": indices,
            "warm": warm,
            "repeat": repeat,
            "mds_dir": os.path.join(
                common.DATA, f"mds-{args.layout}{'-quick' if args.quick else ''}"
            ),
        }
        peers = {name: run_peer(args.peer_python, name, job) for name in ("wids", "streaming")}
        results["random"] = {"tarshards": ours, **peers}
        # 3. recording overhead
        n = 8000 if args.quick else 20000
        samples = []
        for s in iter_samples(paths):
            samples.append({k: v for k, v in s.items() if k != "__url__"})
            if len(samples) >= n:
                break
        results["recording"] = bench_recording(samples, tmp, repeat + 2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, args.samples)


def report(r: dict, nrandom: int) -> None:
    i = r["index"]
    mb = i["bytes"] / 1e6
    cat, ix, par = mb / i["cat_s"], mb / i["index_s"], mb / i["index_parallel_s"]
    print(
        f"# bench_index ({r['layout']}{', quick' if r['quick'] else ''}; "
        f"{r['machine'].get('cpu', '')}; load average {os.getloadavg()[0]:.1f})"
    )
    print(f"\n1. indexing {mb:.0f} MB of plain shards (page cache), hashing on")
    print(f"   cat FILES > /dev/null            {cat:8.0f} MB/s")
    print(
        f"   tarshards index -p 1             {ix:8.0f} MB/s   {ix / cat:.2f}x cat (target >= 0.5)"
    )
    print(
        f"   tarshards index -p {i['ncpu']:<2d}            {par:8.0f} MB/s   {par / cat:.2f}x cat"
    )
    inproc = mb / i["index_inprocess_s"]
    print(
        f"   index_url() in one process       {inproc:8.0f} MB/s   {inproc / cat:.2f}x cat "
        "(no interpreter start-up)"
    )
    ra = r["random"]
    ours = ra["tarshards"]
    print(f"\n2. {nrandom} random ds[i], raw samples, local shards")
    print(f"   tarshards IndexedDataset         {nrandom / ours['seconds']:8.0f} samples/s")
    for name, target in (("wids", 2.0), ("streaming", 1.0)):
        p = ra[name]
        if "error" in p:
            print(f"   {name:<32s} {p['error']}")
            continue
        same = "same samples" if p["checksum"] == ours["checksum"] else "DIFFERENT samples"
        ratio = p["seconds"] / ours["seconds"]
        print(
            f"   {name + ' ' + p.get('version', ''):<32s} {nrandom / p['seconds']:8.0f} "
            f"samples/s   tarshards {ratio:.2f}x (target >= {target:g}; {same})"
        )
    rec = r["recording"]
    a, b = rec["samples"] / rec["plain_s"], rec["samples"] / rec["manifest_s"]
    print(f"\n3. ShardWriter, {rec['samples']} samples (CPU time)")
    print(f"   without manifest                 {a:8.0f} samples/s")
    print(
        f"   manifest=PATH                    {b:8.0f} samples/s   "
        f"{100 * (a / b - 1):.1f}% slower (target <= 5%)"
    )
    print("\n(figures from a loaded machine are noisy; ratios matter)")


if __name__ == "__main__":
    main()
