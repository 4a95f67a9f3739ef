"""Shared helpers for the benchmark: synthetic shards, timing, machine description.

The data lives in ``bench/_data/`` (git-ignored) and is made once with a fixed seed; a small
manifest records the parameters so that a changed layout is rebuilt and an unchanged one reused.

* ``small``: ~4 KB JPEGs (96x96, q=90, noisy smooth fields) + ``cls`` + ``json`` per sample.
* ``large``: ~100 KB ImageNet-like JPEGs (500x375, q=90) + ``cls``.

To keep generation quick, a pool of distinct images (fixed seed) is encoded once and cycled
through the samples; decoding cost does not depend on whether two samples share bytes.
"""

from __future__ import annotations

import io
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "_data")
SEED = 20240501

# name -> layout; "quick" shrinks the data for --quick runs
LAYOUTS = {
    "small": dict(shards=8, per_shard=2500, size=(96, 96), noise=4.0, pool=3000, json=True),
    "large": dict(shards=8, per_shard=500, size=(500, 375), noise=13.0, pool=300, json=False),
}
QUICK = {
    "small": dict(shards=4, per_shard=1500),
    "large": dict(shards=4, per_shard=300),
}


def layout(name: str, quick: bool = False) -> dict:
    lay = dict(LAYOUTS[name])
    if quick:
        lay.update(QUICK[name])
    return lay


def _jpeg_pool(rng: np.random.Generator, n: int, size, noise: float) -> list[bytes]:
    from PIL import Image

    w, h = size
    pool = []
    for _ in range(n):
        base = (rng.random((h // 8 + 2, w // 8 + 2, 3)) * 255).astype(np.uint8)
        img = np.asarray(
            Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32
        )
        img = img + rng.normal(0.0, noise, img.shape).astype(np.float32)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        pool.append(buf.getvalue())
    return pool


def _write_plain_tar(path: str, samples) -> None:
    """Write a plain ustar shard with the standard library (neutral: neither side's writer)."""
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key, fields in samples:
            for ext, data in fields:
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                ti.mtime = 1_700_000_000
                ti.mode = 0o444
                tf.addfile(ti, io.BytesIO(data))
    os.replace(tmp, path)


def is_made(stamp: str, want, paths=()) -> bool:
    """Whether what ``stamp`` (a JSON file written by :func:`mark_made`) records equals ``want``
    and every one of ``paths`` exists: data made once and reused while its recipe is the same."""
    try:
        with open(stamp) as f:
            return json.load(f) == want and all(os.path.exists(p) for p in paths)
    except (OSError, ValueError):
        return False


def mark_made(stamp: str, want) -> None:
    with open(stamp, "w") as f:
        json.dump(want, f)


def make_dataset(name: str, quick: bool = False) -> list[str]:
    """Make (or reuse) the shards of one layout; returns their paths."""
    lay = layout(name, quick)
    tag = f"{name}-q" if quick else name
    outdir = os.path.join(DATA, tag)
    manifest = os.path.join(outdir, "manifest.json")
    want = json.loads(json.dumps(dict(lay, seed=SEED, version=1)))
    paths = [os.path.join(outdir, f"{name}-{i:04d}.tar") for i in range(lay["shards"])]
    if is_made(manifest, want, paths):
        return paths
    os.makedirs(outdir, exist_ok=True)
    t0 = time.time()
    rng = np.random.default_rng([SEED, len(name)])
    pool = _jpeg_pool(rng, lay["pool"], lay["size"], lay["noise"])
    labels = rng.integers(0, 1000, size=lay["shards"] * lay["per_shard"])
    k = 0
    for i, path in enumerate(paths):
        samples = []
        for _ in range(lay["per_shard"]):
            fields = [("cls", str(int(labels[k])).encode())]
            fields.append(("jpg", pool[k % len(pool)]))
            if lay["json"]:
                meta = {
                    "index": k,
                    "label": int(labels[k]),
                    "source": "synthetic",
                    "width": lay["size"][0],
                    "height": lay["size"][1],
                }
                fields.append(("json", json.dumps(meta).encode()))
            samples.append((f"{name}_{k:08d}", sorted(fields)))
            k += 1
        _write_plain_tar(path, samples)
    mark_made(manifest, want)
    total = sum(os.path.getsize(p) for p in paths)
    print(
        f"made {name} shards: {len(paths)} x {lay['per_shard']} samples, "
        f"{total / 1e6:.0f} MB, {time.time() - t0:.1f} s",
        file=sys.stderr,
    )
    return paths


def null_sink() -> str:
    """A device that discards what is written to it, for ``cat FILES > SINK``: ``/dev/null``
    where it is the null device, else ``/dev/zero`` (whose writes the kernel discards the same
    way). In some sandboxes ``/dev/null`` is a regular file, and ``cat`` into it copies every
    byte into a tmpfs file: 2-5x its time reading (measured: 160 ms of CPU against 27 ms)."""
    import stat

    for path in ("/dev/null", "/dev/zero"):
        try:
            if stat.S_ISCHR(os.stat(path).st_mode):
                return path
        except OSError:
            pass
    return os.devnull


def total_bytes(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


def warm_cache(paths, fresh: bool = False) -> None:
    """Read the files once so that every measurement sees them page-cached.

    ``fresh``: first drop them from the page cache (``fsync``, then ``POSIX_FADV_DONTNEED``),
    so that the cache holds what one sequential read of them leaves, whatever wrote or read
    them before (the state a job reading shards from disk starts from). It matters on kernels
    whose page cache keeps large folios (Linux 6.x on ext4, xfs): pages left there by the
    writer came in small folios, and a memory-mapped reader pays its page-table work per folio
    (on the 2-core host of bench/RESULTS.md, 100 KB samples read at 0.75x ``cat`` from pages
    the writer left, and at 0.95-0.97x after a fresh read; ``cat`` itself went from 8.9 to
    10.4 GB/s)."""
    for p in paths:
        with open(p, "rb") as f:
            if fresh and hasattr(os, "posix_fadvise"):
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while f.read(1 << 22):
                pass


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine_info() -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True)
        info["nproc"] = int(nproc.stdout.strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    versions = {}
    for mod in ("tarshards", "webdataset", "torch", "numpy", "PIL", "simplejpeg"):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except ImportError:
            versions[mod] = "not installed"
    info["versions"] = versions
    return info


def timed_passes(fn, min_time: float, max_passes: int = 50):
    """Run ``fn()`` (returns ``(items, nbytes)``) until ``min_time`` seconds have passed.

    Returns totals over all passes: ``{"items", "bytes", "seconds", "passes"}``.
    """
    items = nbytes = passes = 0
    t0 = time.perf_counter()
    while True:
        n, b = fn()
        items += n
        nbytes += b
        passes += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or passes >= max_passes:
            return {"items": items, "bytes": nbytes, "seconds": elapsed, "passes": passes}


_TORCHVISION_SHIM: list = []  # the Library that defines the schemas, kept alive


def torchvision_importable() -> None:
    """Make ``import torchvision`` (and MosaicML Streaming, which imports it) work in a peer's
    environment. Where torchvision's build matches torch, its compiled operators load and
    nothing is done. Where they do not (PyPI's torchvision beside a torch it was not built for:
    "operator torchvision::nms does not exist"), the schemas of the two operators its Python
    code looks up are defined first, so that its Python transforms import (its compiled
    operators stay unusable; the benchmarks do not call them). Which case holds is tried in a
    child process, since a failed import leaves torchvision half-loaded."""
    if _TORCHVISION_SHIM or "torchvision" in sys.modules:
        return
    ok = (
        subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode
        == 0
    )
    if ok:
        _TORCHVISION_SHIM.append(None)
        return
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SHIM.append(lib)
