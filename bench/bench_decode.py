"""Decoding rows: per-sample overhead of the image modes, and fused random-resized-crop decoding.

    .venv/bin/python bench/bench_decode.py            # both rows, 5 interleaved repetitions
    .venv/bin/python bench/bench_decode.py --quick    # fewer samples, 3 repetitions
    .venv/bin/python bench/bench_decode.py --only crop --json

Every side runs in this one process (``torch.set_num_threads(1)``, as in DataLoader workers),
sides interleaved (the order reversed every other repetition); the table gives the median
samples/s over the repetitions, by wall clock and by this process's CPU time (the CPU-time
figure is the one to read on a loaded machine).

1. ``overhead``: 64x64 JPEGs (q=90) in one shard, ``WebDataset(shard).decode(MODE)
   .to_tuple("jpg", "cls")`` for ``pil``, ``rgb8`` and ``torchrgb8``, against simplejpeg's
   decode-only rate on the same bytes (``decode_jpeg(data)`` over the list of them, in memory).
   Target: >= 0.9. Where the optional C decoder is built, a row gives its decode-only rate on the
   same list (``tarshards._jpeg.image``, the C decoder the modes call per JPEG): the bound of the
   modes, which add reading the shard (page-cached), grouping, the fused stage and building the
   value (array, PIL image, tensor). Each pass of a side (a whole pass over the shard, the
   pipeline made and opened inside it) takes turns of 250 samples with the reference on as
   many samples (:func:`run_paired`), so both are timed at the same moments of the machine's
   load; the ratio is each pass's, the median over 15 passes (9 with ``--quick``) after a
   warm-up, and the last column gives the range over the passes. The shard is dropped from the
   page cache and read once first (``common.warm_cache(fresh=True)``, as in bench/run.py). The
   process is pinned to one
   CPU for this row (``--no-pin``: not), so that the reference's turns and the side's run on the
   same core: on the 2-core host of bench/RESULTS.md one vCPU decoded the same JPEGs 12 % slower
   than the other at times (19.8 vs 22.5 us each, ``taskset``), and a process moved between
   them mid-pass gave ratios from 0.87 to 0.94 for the same code; pinned, 0.90-0.94.
2. ``crop``: ImageNet-sized JPEGs (500x375, 640x480, 800x600 and 375x500, q=90) to a
   RandomResizedCrop(224) + horizontal flip float CxHxW tensor.
   Ours: ``.decode(random_resized_crop(224)).to_tuple("jpg", "cls")`` (and ``fast=True``).
   Reference, the torchvision idiom written with PIL and torch ops (torchvision itself does
   not install beside this torch): ``.to_tuple("jpg", "cls").map_tuple(transform, None)`` where
   ``transform`` decodes with Pillow (``Image.open(...).convert("RGB")``), draws the crop
   (torchvision's algorithm, :func:`tarshards.codecs.crop.crop_params`),
   ``img.crop(box).resize((224,
   224), BILINEAR)``, flips with probability 1/2 (``transpose``), and converts as ``to_tensor``
   does (``permute(2, 0, 1).contiguous().float().div(255)``). The best peer, the row the
   ratios are of: webdataset's ``.decode("pil").to_tuple("jpg", "cls").map_tuple(T.Compose(
   [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()]), None)``, run in the
   peers' environment (``--peer-python``, default ``bench/.venv``; torchvision's Python
   transforms), one process per repetition, timed inside it. Target: >= 2x.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
DATA = os.path.join(HERE, "_data", "decode")

import common  # noqa: E402


def _jpeg(rng, w, h, noise):
    from PIL import Image

    base = (rng.random((h // 8 + 2, w // 8 + 2, 3)) * 255).astype(np.uint8)
    img = np.asarray(
        Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32
    )
    img = img + rng.normal(0.0, noise, img.shape).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_shard(name, n, sizes, noise, pool) -> str:
    """One shard of ``n`` samples (jpg + cls) cycling through ``pool`` distinct JPEGs."""
    from tarshards import TarWriter

    path = os.path.join(DATA, f"{name}-{n}.tar")
    if os.path.exists(path):
        return path
    os.makedirs(DATA, exist_ok=True)
    rng = np.random.default_rng(20240501)
    jpgs = [_jpeg(rng, *sizes[i % len(sizes)], noise) for i in range(pool)]
    tmp = path + ".tmp"
    with TarWriter(tmp) as w:
        for i in range(n):
            w.write({"__key__": f"{name}{i:07d}", "jpg": jpgs[i % pool], "cls": i % 1000})
    os.replace(tmp, path)
    return path


def run_sides(sides: dict, repeat: int) -> dict:
    """``{side: fn() -> items}`` -> medians of samples/s (wall and CPU) over interleaved reps."""
    wall = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    names = list(sides)
    for rep in range(repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            n = sides[name]()
            t1, c1 = time.perf_counter(), time.process_time()
            if isinstance(n, dict):  # timed in another process (a peer): its own figures
                if "error" in n:
                    wall[name].append(float("nan"))
                    cpu[name].append(float("nan"))
                    continue
                n, t0, t1, c0, c1 = n["n"], 0.0, n["wall"], 0.0, n["cpu"]
            wall[name].append(n / (t1 - t0))
            cpu[name].append(n / max(c1 - c0, 1e-9))
    return {
        k: {"wall": statistics.median(wall[k]), "cpu": statistics.median(cpu[k])} for k in sides
    }


def run_paired(ref_items: list, ref_fn, sides: dict, repeat: int, chunk: int = 250) -> dict:
    """Each side against the reference, measured in turns of ``chunk`` samples.

    A side is ``make() -> iterator`` (one item per sample; making it, e.g. opening the shard, is
    timed with it). In a pass, ``chunk`` items of the side and then as many of the reference
    (``ref_fn(item)`` over ``ref_items``, a plain loop over a slice of the list, cycling) take
    turns until the side's iterator ends: both see the same moments of the machine's load, and a
    pass's ratio is the reference's time over the side's for the same number of samples. Passes
    go through the sides in turn (the order reversed every other repetition); a side's figures
    are the medians over its passes (samples/s by wall clock and by CPU time, and the ratios),
    the reference's the medians over every pass.
    """
    clock, cpu_clock = time.perf_counter, time.process_time
    islice = itertools.islice
    res: dict = {k: {"wall": [], "cpu": [], "vs_wall": [], "vs_cpu": []} for k in sides}
    ref_wall: list = []
    ref_cpu: list = []
    names = list(sides)
    pos = 0
    total = len(ref_items)
    for rep in range(repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            side_t = side_c = ref_t = ref_c = 0.0
            n = 0
            t0, c0 = clock(), cpu_clock()
            it = iter(sides[name]())
            side_t, side_c = clock() - t0, cpu_clock() - c0
            while True:
                t0, c0 = clock(), cpu_clock()
                k = 0
                for _ in islice(it, chunk):
                    k += 1
                side_t += clock() - t0
                side_c += cpu_clock() - c0
                if k == 0:
                    break
                part = ref_items[pos : pos + k]
                if len(part) < k:
                    part = part + ref_items[: k - len(part)]
                pos = (pos + k) % total
                t0, c0 = clock(), cpu_clock()
                for item in part:
                    ref_fn(item)
                ref_t += clock() - t0
                ref_c += cpu_clock() - c0
                n += k
                if k < chunk:
                    break
            r = res[name]
            r["wall"].append(n / side_t)
            r["cpu"].append(n / max(side_c, 1e-9))
            r["vs_wall"].append(ref_t / side_t)
            r["vs_cpu"].append(ref_c / max(side_c, 1e-9))
            ref_wall.append(n / ref_t)
            ref_cpu.append(n / max(ref_c, 1e-9))
    med = statistics.median
    out = {"reference": {"wall": med(ref_wall), "cpu": med(ref_cpu), "vs_wall": 1.0, "vs_cpu": 1.0}}
    for name, r in res.items():
        out[name] = {f: med(r[f]) for f in ("wall", "cpu", "vs_wall", "vs_cpu")}
        out[name]["range_cpu"] = [min(r["vs_cpu"]), max(r["vs_cpu"])]
    return out


def bench_overhead(quick: bool, repeat: int) -> dict:
    import simplejpeg

    import tarshards
    from tarshards.codecs import images

    images._cjpeg()  # the C decoder's library chosen before any side runs (see decoder_library)
    path = make_shard("small64", 2000 if quick else 4000, [(64, 64)], 4.0, 500)
    # the page cache as one sequential read leaves it, whatever wrote or read the shard before
    # (bench/run.py's methodology: common.warm_cache)
    common.warm_cache([path], fresh=True)
    jpgs = [s["jpg"] for s in tarshards.WebDataset(path)]

    def mode(m):
        return lambda: tarshards.WebDataset(path).decode(m).to_tuple("jpg", "cls")

    sides = {}
    try:
        from tarshards._jpeg import image
    except ImportError:  # not built: no such row
        image = None
    if image is not None:
        sides["tarshards._jpeg decode only (the modes' C path)"] = lambda: (
            image(b, 3, False) for b in jpgs
        )
    for m in ("pil", "rgb8", "torchrgb8"):
        sides[f'.decode("{m}")'] = mode(m)
    for make in sides.values():  # warm-up: imports (torch), probes, the shard in the page cache
        for _ in itertools.islice(make(), 300):
            pass
    res = run_paired(jpgs, simplejpeg.decode_jpeg, sides, repeat)
    res = {"simplejpeg decode only": res.pop("reference"), **res}
    return res


def decoder_library() -> str | None:
    """The libjpeg the C decoder calls (chosen at its first use: tarshards.codecs.images), with its
    libjpeg-turbo version; None where the C decoder is not built."""
    from tarshards.codecs import images

    jd = images.jpeg_decoder()
    if jd["decoder"] != "tarshards._jpeg":
        return None
    return f"{jd['libjpeg']} ({jd['libjpeg_turbo'] or 'version unknown'})"


PEER_SIDE = (
    "best peer: webdataset .decode('pil') + torchvision RandomResizedCrop(224), "
    "RandomHorizontalFlip, ToTensor"
)


def peer_crop(job: dict) -> dict:
    """The peers' idiom (webdataset, litdata and MosaicML users alike: Pillow, then
    torchvision's transforms), run in the peer environment on the same shard."""
    import torch

    torch.set_num_threads(1)
    # torchvision's compiled operators do not load against this torch: their schemas, so that
    # its Python transforms import (see bench_index.py)
    common.torchvision_importable()
    import torchvision
    import webdataset as wds
    from torchvision import transforms as T

    transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])
    ds = (
        wds.WebDataset(job["path"], shardshuffle=False)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, None)
    )
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for x, _cls in itertools.islice(ds, job["limit"]):
        n += 1
    t1, c1 = time.perf_counter(), time.process_time()
    assert tuple(x.shape) == (3, 224, 224) and x.dtype == torch.float32
    return {"n": n, "wall": t1 - t0, "cpu": c1 - c0, "torchvision": torchvision.__version__}


def run_peer(python: str, job: dict) -> dict:
    if not os.path.exists(python):
        return {"error": f"not installed ({python} missing; see bench_index.py)"}
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--peer-job", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


peer_python = os.path.join(HERE, ".venv", "bin", "python")


def bench_crop(quick: bool, repeat: int) -> dict:
    import torch
    from PIL import Image

    import tarshards
    from tarshards.codecs.crop import crop_params

    sizes = [(500, 375), (640, 480), (800, 600), (375, 500)]
    path = make_shard("imagenet", 120 if quick else 300, sizes, 13.0, 60)
    limit = 120 if quick else 300

    reference_rng = random.Random(0)

    def reference_transform(data, rng=reference_rng):
        img = Image.open(io.BytesIO(data)).convert("RGB")
        top, left, h, w = crop_params(rng, img.width, img.height)
        img = img.crop((left, top, left + w, top + h)).resize((224, 224), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        t = torch.from_numpy(np.array(img, copy=True)).view(224, 224, 3)
        return t.permute(2, 0, 1).contiguous().float().div(255)

    def count(ds):
        n = 0
        for x, _cls in itertools.islice(ds, limit):
            n += 1
        assert tuple(x.shape) == (3, 224, 224) and x.dtype == torch.float32
        return n

    peer = PEER_SIDE

    def peer_side():
        return run_peer(peer_python, {"path": path, "limit": limit})

    sides = {
        peer: peer_side,
        "reference: PIL decode, crop, resize, flip, to_tensor": lambda: count(
            tarshards.WebDataset(path).to_tuple("jpg", "cls").map_tuple(reference_transform, None)
        ),
        "random_resized_crop(224)": lambda: count(
            tarshards.WebDataset(path)
            .decode(tarshards.random_resized_crop(224))
            .to_tuple("jpg", "cls")
        ),
        "random_resized_crop(224, fast=True)": lambda: count(
            tarshards.WebDataset(path)
            .decode(tarshards.random_resized_crop(224, fast=True))
            .to_tuple("jpg", "cls")
        ),
    }
    res = run_sides(sides, repeat)
    ref = res[peer] if res[peer]["wall"] == res[peer]["wall"] else res[next(iter(res))]
    for v in res.values():
        v["vs_wall"] = v["wall"] / ref["wall"]
        v["vs_cpu"] = v["cpu"] / ref["cpu"]
    return res


def table(title: str, res: dict) -> str:
    lines = [
        f"### {title}",
        "",
        "| side | samples/s (wall) | samples/s (CPU) | x ref (wall) | x ref (CPU) |",
        "|---|---:|---:|---:|---:|",
    ]
    ranges = any("range_cpu" in v for v in res.values())
    if ranges:
        lines[2] += " passes' x ref (CPU) |"
        lines[3] += "---|"
    for name, v in res.items():
        line = (
            f"| {name} | {v['wall']:.0f} | {v['cpu']:.0f} | {v['vs_wall']:.2f} "
            f"| {v['vs_cpu']:.2f} |"
        )
        if ranges:
            lo, hi = v.get("range_cpu", (1.0, 1.0))
            line += f" {lo:.2f}-{hi:.2f} |"
        lines.append(line)
    return "\n".join(lines)


@contextlib.contextmanager
def one_cpu(pin: bool = True):
    """This process on one CPU (the lowest it may use) while the block runs, where the OS
    lets a process choose (Linux); the CPUs it had afterwards."""
    allowed = os.sched_getaffinity(0) if pin and hasattr(os, "sched_setaffinity") else None
    if not allowed:
        yield
        return
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--only", default="overhead,crop")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--peer-python", default=None, help="the peers' Python (bench/.venv)")
    parser.add_argument("--peer-job", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin the overhead row to one CPU"
    )
    args = parser.parse_args(argv)
    if args.peer_job:
        print(json.dumps(peer_crop(json.loads(args.peer_job))))
        return 0
    if args.peer_python:
        global peer_python
        peer_python = args.peer_python
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    repeat = args.repeat or (3 if args.quick else 5)
    results = {}
    if "overhead" in args.only:
        # passes of one shard are short (a fraction of a second): many of them, cheaply
        with one_cpu(not args.no_pin):
            results["overhead"] = bench_overhead(
                args.quick, args.repeat or (9 if args.quick else 15)
            )
    if "crop" in args.only:
        results["crop"] = bench_crop(args.quick, repeat)
    libjpeg = decoder_library()
    if args.json:
        print(json.dumps({**results, "libjpeg": libjpeg}, indent=2))
        return 0
    print(
        f"(medians of {repeat} interleaved repetitions; {os.cpu_count()} CPUs; "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; the C decoder's libjpeg: {libjpeg})\n"
    )
    if "overhead" in results:
        print(
            table(
                "decode overhead, 64x64 JPEGs (x ref: of simplejpeg's decode-only rate; "
                "target >= 0.9)",
                results["overhead"],
            )
            + "\n"
        )
    if "crop" in results:
        print(
            table(
                "RandomResizedCrop(224) + flip to a float tensor, ImageNet-sized JPEGs "
                "(target >= 2x)",
                results["crop"],
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
