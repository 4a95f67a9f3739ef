"""tarshards vs upstream webdataset 1.0.2 (and ``cat``), side by side in one run.

    .venv/bin/python bench/run.py            # full run (a few minutes), writes bench/RESULTS.md
    .venv/bin/python bench/run.py --quick    # smaller data, one repetition less
    .venv/bin/python bench/run.py --only raw_small,write_small

Every measurement runs in a fresh subprocess (``run.py --child NAME SIDE``), ours and upstream
alternate, and the best of ``--repeat`` runs (5 for the noisy DataLoader row) is kept (the
highest rate; the lowest memory).
The data are synthetic shards made with a fixed seed in ``bench/_data/`` (see ``common.py``);
they are dropped from the page cache and read once before measuring, so every run sees them
page-cached as one sequential read leaves them (``common.warm_cache(fresh=True)``). All children
run with ``torch.set_num_threads(1)``, as DataLoader workers do.

Methodology per row (both sides do the same work on the same files):

1. ``raw_small``: iterate the sample dicts (bytes) of the small shards.
   ``tarshards.WebDataset(urls)`` vs ``webdataset.WebDataset(urls, shardshuffle=False)``.
1b. ``raw_pax``: the same on copies of the small shards with a pax header before every member
   (a float ``mtime``, as webdataset's ``TarWriter`` and ``tarfile.add`` write them), made once
   with ``tarfile`` into ``bench/_data/small-pax*``; info: ours on them vs ours on the ustar ones.
2. ``raw_large``: the same on the 100 KB shards, MB/s, vs ``cat FILES > /dev/null``, and vs
   litdata (``litdata.optimize()`` of the same samples, raw bytes fields, made once into
   ``bench/_data/litdata-*``; then its ``StreamingDataset`` iterated), run in the peers'
   environment ``bench/.venv`` (``--peer-python``; see ``bench_index.py``). litdata hands out
   ``memoryview``s into its chunk; ``litdata:bytes`` copies each into ``bytes`` (values the
   consumer owns, as ours are: the same work), ``litdata`` keeps the views (row 2d, info).
   MB/s counts the tar shards' bytes on every side, so the rows compare the same samples.
   Zero-copy rows (2e-2h): ``ours:views`` is ``WebDataset(urls, copy=False)``: fields are
   read-only memoryviews into the mapped shard, the payload is never touched (like
   ``litdata``'s views); ``ours:views+xxh3``, ``litdata+xxh3`` and ``read+xxh3`` add one pass
   over the payload (``xxhash.xxh3_64_intdigest`` of every field; for ``read+xxh3``, a
   cat-like loop in Python, ``readinto`` of 1 MiB into one reused buffer, ``xxh3_64`` over
   each chunk: every byte of the files, headers included). ``cat`` copies every byte into its
   buffer and touches nothing, a views-only consumer touches only the headers: 2e is not like
   with like; 2f (both touch every payload byte once) is. Every side of rows 2-2h (cat too) makes
   one untimed pass first (a process's first pass pays lazy imports and set-up, ~200 ms).
3. ``write_small``: ``TarWriter.write`` of in-memory small samples (values are bytes) to a file;
   samples/s and the size of the output.
4. ``pil_small``: ``.decode("pil").to_tuple("jpg", "cls")`` on small samples.
5. ``t224_large``: ImageNet-like JPEG (500x375) to a 3x224x224 float tensor in [0, 1].
   Ours: ``.decode("torchrgb", size=(224, 224)).to_tuple("jpg", "cls")`` (JPEG decoded at a
   1/2^k scale no smaller than 224x224, then an antialiased bilinear resize in torch).
   Upstream, two typical pipelines, the faster one is the reference:
   ``torchrgb+interp``: ``.decode("torchrgb")`` then ``F.interpolate(bilinear, antialias=False)``;
   ``pil+resize``: ``.decode("pil")`` then ``PIL resize((224, 224), BILINEAR)`` then to-tensor.
6. ``loader_small``: ``DataLoader(ds, num_workers=2, batch_size=64)`` over
   ``.decode("rgb8").to_tuple("jpg", "cls")`` (PIL -> numpy uint8 + int label) for both sides;
   samples/s counted from the first batch to the end (worker start-up excluded; reported too).
7. ``memory``: a child streams ~1 GB (the large shards repeated) through ``.shuffle(1000)``;
   peak RSS (ru_maxrss) minus the RSS after imports and dataset construction.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

RESULTS = os.path.join(common.HERE, "RESULTS.md")
# hand-written analysis below this line in RESULTS.md survives a re-run
NOTES_MARK = "<!-- notes: kept when run.py rewrites this file -->"

# ---------------------------------------------------------------------------------------------
# child side: one measurement, printed as JSON on the last line of stdout
# ---------------------------------------------------------------------------------------------


def _ours():
    import tarshards

    return tarshards


def _upstream():
    warnings.filterwarnings("ignore")
    import webdataset

    return webdataset


def _dataset(side: str, urls):
    if side == "ours":
        return _ours().WebDataset(urls)
    if side.startswith("ours:views"):
        return _ours().WebDataset(urls, copy=False)
    return _upstream().WebDataset(urls, shardshuffle=False)


def _count(iterable) -> int:
    n = 0
    for _ in iterable:
        n += 1
    return n


def _timed(one_pass, opts) -> dict:
    """``common.timed_passes``, after one untimed pass when ``opts["warmup"]`` (the 100 KB rows:
    a pass there takes ~15-40 ms, and a process's first one ~200 ms more, lazy imports and
    first-use set-up, which would be a third of a --quick measurement)."""
    if opts.get("warmup"):
        one_pass()
    return common.timed_passes(one_pass, opts["min_time"])


def child_raw(side, urls, opts):
    nbytes = common.total_bytes(urls)
    if side.startswith("litdata"):
        return child_raw_litdata(urls, nbytes, opts, owned=side == "litdata:bytes", side=side)
    if side.endswith("+xxh3"):  # one pass over the payload: a hash of every field
        import xxhash

        h = xxhash.xxh3_64_intdigest

        def one_pass():
            n = 0
            for sample in _dataset(side, urls):
                for k, v in sample.items():
                    if k[:2] != "__":
                        h(v)
                n += 1
            return n, nbytes

        return _timed(one_pass, opts)

    def one_pass():
        n = 0
        for sample in _dataset(side, urls):
            n += 1
        return n, nbytes

    return _timed(one_pass, opts)


def _pax_copies(urls) -> list[str]:
    """The shards ``urls`` rewritten by ``tarfile`` in its PAX format with a float ``mtime`` on
    every member, so a pax header before each (as webdataset's ``TarWriter`` writes, stamping
    ``time.time()``); made once, reused while the sources' names and sizes are the same."""
    import tarfile

    tag = os.path.basename(os.path.dirname(urls[0]))
    out = os.path.join(common.DATA, f"{tag}-pax")
    stamp = os.path.join(out, "made.json")
    want = [[os.path.basename(u), os.path.getsize(u)] for u in urls]
    paths = [os.path.join(out, os.path.basename(u)) for u in urls]
    if common.is_made(stamp, want, paths):
        return paths
    os.makedirs(out, exist_ok=True)
    for src, dst in zip(urls, paths):
        with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
            for ti in tin:
                data = tin.extractfile(ti)
                ti.mtime = 1_700_000_000.25
                tout.addfile(ti, data)
    common.mark_made(stamp, want)
    return paths


def child_raw_pax(side, urls, opts):
    return child_raw(side, _pax_copies(urls), opts)


def child_raw_large(side, urls, opts):
    return child_raw(side, urls, {**opts, "warmup": True})


def _litdata_shard(path):
    """The samples of one tar shard (read with tarfile: neither side's reader), for optimize()."""
    import tarfile

    sample: dict = {}
    with tarfile.open(path) as tf:
        for ti in tf:
            key, ext = ti.name.split(".", 1)
            if sample and sample["key"] != key:
                yield sample
                sample = {}
            sample["key"] = key
            f = tf.extractfile(ti)
            sample[ext] = f.read() if f is not None else b""
    if sample:
        yield sample


def _litdata_dir(urls) -> str:
    import shutil

    import litdata

    tag = os.path.basename(os.path.dirname(urls[0]))
    out = os.path.join(common.DATA, f"litdata-{tag}")
    stamp = os.path.join(out, "made.json")
    want = [[os.path.basename(u), os.path.getsize(u)] for u in urls]
    if common.is_made(stamp, want):
        return out
    shutil.rmtree(out, ignore_errors=True)
    litdata.optimize(
        fn=_litdata_shard,
        inputs=list(urls),
        output_dir=out,
        chunk_bytes="64MB",
        num_workers=1,
        verbose=False,
    )
    common.mark_made(stamp, want)
    return out


def child_raw_litdata(urls, nbytes, opts, owned: bool, side: str = "litdata"):
    import litdata

    out = _litdata_dir(urls)
    h = None
    if side.endswith("+xxh3"):
        import xxhash

        h = xxhash.xxh3_64_intdigest

    def one_pass():
        n = 0
        if h is not None:  # its memoryviews, and one pass over the payload (as ours:views+xxh3)
            for sample in litdata.StreamingDataset(out):
                for k, v in sample.items():
                    if isinstance(v, (bytes, memoryview)):
                        h(v)
                n += 1
        elif owned:  # values the consumer owns, as ours are: bytes copied out of the chunk
            for sample in litdata.StreamingDataset(out):
                {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}
                n += 1
        else:  # as it comes: memoryviews into litdata's chunk (no copy at all)
            for sample in litdata.StreamingDataset(out):
                n += 1
        return n, nbytes

    res = _timed(one_pass, opts)
    res["version"] = litdata.__version__
    return res


def child_cat(side, urls, opts):
    nbytes = common.total_bytes(urls)
    if side == "read+xxh3":  # cat's work in a Python loop, plus one hash pass over every byte
        import xxhash

        buf = memoryview(bytearray(1 << 20))

        def one_pass():
            for u in urls:
                hasher = xxhash.xxh3_64()
                with open(u, "rb", buffering=0) as f:
                    while True:
                        got = f.readinto(buf)
                        if not got:
                            break
                        hasher.update(buf[:got])
                hasher.intdigest()
            return 0, nbytes

        return _timed(one_pass, opts)

    def one_pass():
        with open(common.null_sink(), "wb") as sink:
            subprocess.run(["cat", *urls], stdout=sink, check=True)
        return 0, nbytes

    return _timed(one_pass, opts)


def child_cat_large(side, urls, opts):
    return child_cat(side, urls, {**opts, "warmup": True})


def _load_samples(urls, limit):
    import tarshards

    out = []
    for s in itertools.islice(tarshards.WebDataset(urls), limit):
        out.append({k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")})
    return out


def child_write(side, urls, opts):
    samples = _load_samples(urls, opts["write_limit"])
    outdir = os.path.join(common.DATA, "out")
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, f"write-{side}-{os.getpid()}.tar")
    writer_cls = _ours().TarWriter if side == "ours" else _upstream().TarWriter
    size = 0

    def one_pass():
        nonlocal size
        with writer_cls(path) as w:
            write = w.write
            for s in samples:
                write(s)
        size = os.path.getsize(path)
        return len(samples), size

    try:
        res = common.timed_passes(one_pass, opts["min_time"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    res["output_bytes"] = size
    res["input_bytes"] = sum(len(v) for s in samples for k, v in s.items() if k != "__key__")
    return res


def child_pil(side, urls, opts):
    limit = opts["pil_limit"]

    def one_pass():
        ds = _dataset(side, urls).decode("pil").to_tuple("jpg", "cls")
        n = 0
        for img, cls in itertools.islice(ds, limit):
            n += 1
        return n, 0

    return common.timed_passes(one_pass, opts["min_time"])


def _t224_pipeline(side, urls):
    import numpy as np
    import torch

    if side == "ours":
        return _ours().WebDataset(urls).decode("torchrgb", size=(224, 224)).to_tuple("jpg", "cls")
    wds = _upstream()
    if side == "upstream:torchrgb+interp":
        import torch.nn.functional as F

        def resize(t):
            return F.interpolate(
                t[None], size=(224, 224), mode="bilinear", align_corners=False, antialias=False
            )[0]

        return (
            wds.WebDataset(urls, shardshuffle=False)
            .decode("torchrgb")
            .to_tuple("jpg", "cls")
            .map_tuple(resize, None)
        )
    if side == "upstream:pil+resize":
        from PIL import Image

        def to_tensor(img):
            img = img.resize((224, 224), Image.Resampling.BILINEAR)
            arr = np.asarray(img)
            return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255)

        return (
            wds.WebDataset(urls, shardshuffle=False)
            .decode("pil")
            .to_tuple("jpg", "cls")
            .map_tuple(to_tensor, None)
        )
    raise ValueError(side)


def child_t224(side, urls, opts):
    limit = opts["t224_limit"]
    shape = None

    def one_pass():
        nonlocal shape
        n = 0
        for x, cls in itertools.islice(_t224_pipeline(side, urls), limit):
            n += 1
        shape = [list(x.shape), str(x.dtype), round(float(x.min()), 3), round(float(x.max()), 3)]
        return n, 0

    res = common.timed_passes(one_pass, opts["min_time"])
    res["last"] = shape
    return res


def child_loader(side, urls, opts):
    import torch

    ds = _dataset(side, urls).decode("rgb8").to_tuple("jpg", "cls")
    loader = torch.utils.data.DataLoader(ds, num_workers=2, batch_size=64)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    n = 0
    for x, y in it:
        n += len(y)
    t2 = time.perf_counter()
    return {
        "items": n,
        "bytes": 0,
        "seconds": t2 - t1,
        "passes": 1,
        "startup_s": t1 - t0,
        "total_items": n + len(first[1]),
        "total_s": t2 - t0,
        "batch": [list(first[0].shape), str(first[0].dtype)],
    }


def child_memory(side, urls, opts):
    import gc

    import torch  # noqa: F401  (both sides' typical environment; part of the baseline)

    target = opts["memory_bytes"]
    size = common.total_bytes(urls)
    reps = max(1, -(-target // size))
    all_urls = list(urls) * reps
    ds = _dataset(side, all_urls).shuffle(1000)
    gc.collect()
    base = common.rss_bytes()
    base_peak = common.peak_rss_bytes()
    n = 0
    nbytes = 0
    peak_sampled = base
    t0 = time.perf_counter()
    for sample in ds:
        n += 1
        nbytes += len(sample["jpg"])
        if n % 500 == 0:
            peak_sampled = max(peak_sampled, common.rss_bytes())
    elapsed = time.perf_counter() - t0
    peak = common.peak_rss_bytes()
    return {
        "items": n,
        "bytes": size * reps,
        "seconds": elapsed,
        "passes": 1,
        "baseline_rss": base,
        "peak_rss": peak,
        "baseline_peak_rss": base_peak,
        "above_baseline": peak - base,
        "sampled_above_baseline": peak_sampled - base,
    }


CHILDREN = {
    "raw_small": (child_raw, "small"),
    "raw_pax": (child_raw_pax, "small"),
    "raw_large": (child_raw_large, "large"),
    "cat_large": (child_cat_large, "large"),
    "write_small": (child_write, "small"),
    "pil_small": (child_pil, "small"),
    "t224_large": (child_t224, "large"),
    "loader_small": (child_loader, "small"),
    "memory": (child_memory, "large"),
}


def run_child(name: str, side: str, quick: bool) -> dict:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    fn, data = CHILDREN[name]
    urls = common.make_dataset(data, quick)
    return fn(side, urls, options(quick))


def options(quick: bool) -> dict:
    if quick:
        return {
            "min_time": 0.5,
            "write_limit": 3000,
            "pil_limit": 1500,
            "t224_limit": 150,
            "memory_bytes": 400_000_000,
        }
    return {
        "min_time": 1.0,
        "write_limit": 5000,
        "pil_limit": 4000,
        "t224_limit": 400,
        "memory_bytes": 1_000_000_000,
    }


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------

# benchmark -> the sides it compares (first is ours)
PLAN = {
    "raw_small": ["ours", "upstream"],
    "raw_pax": ["ours", "upstream"],
    "raw_large": [
        "ours",
        "ours:views",
        "ours:views+xxh3",
        "upstream",
        "litdata:bytes",
        "litdata",
        "litdata+xxh3",
    ],
    "cat_large": ["cat", "read+xxh3"],
    "write_small": ["ours", "upstream"],
    "pil_small": ["ours", "upstream"],
    "t224_large": ["ours", "upstream:torchrgb+interp", "upstream:pil+resize"],
    "loader_small": ["ours", "upstream"],
    "memory": ["ours", "upstream"],
}


PEERS = {"python": os.path.join(common.HERE, ".venv", "bin", "python")}  # --peer-python
# run in the peers' environment (no tarshards imported there)
PEER_SIDES = ("litdata", "litdata:bytes", "litdata+xxh3")


def spawn(name: str, side: str, quick: bool) -> dict:
    python, env = sys.executable, None
    if side in PEER_SIDES:
        python = PEERS["python"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [python, os.path.abspath(__file__), "--child", name, side]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}/{side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rate(r: dict) -> float:
    return r["items"] / r["seconds"]


def mbps(r: dict) -> float:
    return r["bytes"] / r["seconds"] / 1e6


def measure(names, repeat: int, quick: bool) -> dict:
    results: dict = {}
    for name in names:
        sides = PLAN[name]
        if not os.path.exists(PEERS["python"]):
            missing = [s for s in sides if s in PEER_SIDES]
            if missing:
                print(
                    f"  {name}: {', '.join(missing)} not installed ({PEERS['python']})",
                    file=sys.stderr,
                )
            sides = [s for s in sides if s not in PEER_SIDES]
        runs = {s: [] for s in sides}
        # the DataLoader row (3 processes on 2 cores) is the noisiest: give it more tries
        for rep in range(max(repeat, 5) if name == "loader_small" and repeat > 1 else repeat):
            order = sides if rep % 2 == 0 else list(reversed(sides))
            for side in order:
                runs[side].append(spawn(name, side, quick))
        best = {}
        for side, rs in runs.items():
            if name == "memory":
                best[side] = min(rs, key=lambda r: r["above_baseline"])
            else:
                best[side] = max(
                    rs,
                    key=lambda r: (
                        r["items"] / r["seconds"] if r["items"] else r["bytes"] / r["seconds"]
                    ),
                )
            best[side]["all"] = [round(rate(r) if r["items"] else mbps(r), 1) for r in rs]
        results[name] = best
        print(
            f"  {name}: " + ", ".join(f"{s}={best[s]['all']}" for s in sides),
            file=sys.stderr,
            flush=True,
        )
    return results


def _fmt(x: float, unit: str) -> str:
    if x >= 100:
        return f"{x:,.0f} {unit}"
    return f"{x:,.1f} {unit}"


def table(res: dict) -> tuple[list[list[str]], bool]:
    rows = []
    ok_all = True

    def row(metric, ours, ref, ratio, target, ok):
        nonlocal ok_all
        ok_all = ok_all and ok
        rows.append([metric, ours, ref, f"{ratio:.2f}x", target, "pass" if ok else "FAIL"])

    if "raw_small" in res:
        o, u = res["raw_small"]["ours"], res["raw_small"]["upstream"]
        r = rate(o) / rate(u)
        row(
            "1. raw iteration, small samples (samples/s)",
            f"{_fmt(rate(o), 'samples/s')} ({_fmt(mbps(o), 'MB/s')})",
            f"{_fmt(rate(u), 'samples/s')} ({_fmt(mbps(u), 'MB/s')})",
            r,
            ">= 20x",
            r >= 20,
        )
    if "raw_pax" in res:
        o, u = res["raw_pax"]["ours"], res["raw_pax"]["upstream"]
        r = rate(o) / rate(u)
        same = ""
        if "raw_small" in res:
            same = f"; {rate(o) / rate(res['raw_small']['ours']):.2f}x of ours on ustar shards"
        rows.append(
            [
                "1b. raw iteration, small samples, a pax header per member (as webdataset's "
                "TarWriter writes) (samples/s)",
                f"{_fmt(rate(o), 'samples/s')}{same}",
                _fmt(rate(u), "samples/s"),
                f"{r:.2f}x",
                "(info)",
                "",
            ]
        )
    if "raw_large" in res and "cat_large" in res:
        o, c = res["raw_large"]["ours"], res["cat_large"]["cat"]
        r = mbps(o) / mbps(c)
        row(
            "2. raw iteration, 100 KB samples (MB/s) vs cat",
            _fmt(mbps(o), "MB/s"),
            f"cat: {_fmt(mbps(c), 'MB/s')}",
            r,
            ">= 0.85x of cat",
            r >= 0.85,
        )
    if "raw_large" in res:
        o, u = res["raw_large"]["ours"], res["raw_large"]["upstream"]
        r = mbps(o) / mbps(u)
        rows.append(
            [
                "2b. raw iteration, 100 KB samples (MB/s) vs upstream",
                f"{_fmt(mbps(o), 'MB/s')} ({_fmt(rate(o), 'samples/s')})",
                f"{_fmt(mbps(u), 'MB/s')} ({_fmt(rate(u), 'samples/s')})",
                f"{r:.2f}x",
                "(info)",
                "",
            ]
        )
    if "raw_large" in res and "litdata:bytes" in res["raw_large"]:
        o, li = res["raw_large"]["ours"], res["raw_large"]["litdata:bytes"]
        r = mbps(o) / mbps(li)
        row(
            "2c. raw iteration, 100 KB samples (MB/s) vs litdata, bytes values",
            f"{_fmt(mbps(o), 'MB/s')} ({_fmt(rate(o), 'samples/s')})",
            f"litdata {li.get('version', '?')}: {_fmt(mbps(li), 'MB/s')} "
            f"({_fmt(rate(li), 'samples/s')})",
            r,
            ">= 1.2x",
            r >= 1.2,
        )
    if "raw_large" in res and "litdata" in res["raw_large"]:
        o, li = res["raw_large"]["ours"], res["raw_large"]["litdata"]
        r = mbps(o) / mbps(li)
        rows.append(
            [
                "2d. the same vs litdata's memoryviews into its chunks (no copy; not owned)",
                _fmt(mbps(o), "MB/s"),
                f"litdata: {_fmt(mbps(li), 'MB/s')}",
                f"{r:.2f}x",
                "(info)",
                "",
            ]
        )
    # zero-copy rows: (metric, ours, (benchmark, side) of the reference, target ratio or None)
    zero_copy = [
        (
            "2e. zero-copy (copy=False), views only, 100 KB (MB/s) vs cat (not like with like: "
            "cat copies every byte, views touch only headers)",
            "ours:views",
            ("cat_large", "cat"),
            0.85,
        ),
        (
            "2f. zero-copy + one xxh3 pass over each field (MB/s) vs a cat-like read loop + "
            "xxh3 over every byte",
            "ours:views+xxh3",
            ("cat_large", "read+xxh3"),
            0.85,
        ),
        (
            "2g. zero-copy views vs litdata's memoryviews (like with like, MB/s)",
            "ours:views",
            ("raw_large", "litdata"),
            1.2,
        ),
        (
            "2h. views + one xxh3 pass over each field: ours vs litdata (MB/s)",
            "ours:views+xxh3",
            ("raw_large", "litdata+xxh3"),
            None,
        ),
    ]
    for metric, side, (bench, ref_side), target in zero_copy:
        o, ref = res.get("raw_large", {}).get(side), res.get(bench, {}).get(ref_side)
        if o is None or ref is None:
            continue
        r = mbps(o) / mbps(ref)
        ours_cell = f"{_fmt(mbps(o), 'MB/s')} ({_fmt(rate(o), 'samples/s')})"
        ref_cell = f"{ref_side}: {_fmt(mbps(ref), 'MB/s')}"
        if target is None:
            rows.append([metric, ours_cell, ref_cell, f"{r:.2f}x", "(info)", ""])
        else:
            row(metric, ours_cell, ref_cell, r, f">= {target}x", r >= target)
    if "write_small" in res:
        o, u = res["write_small"]["ours"], res["write_small"]["upstream"]
        r = rate(o) / rate(u)
        row(
            "3. TarWriter, small samples as bytes (samples/s)",
            _fmt(rate(o), "samples/s"),
            _fmt(rate(u), "samples/s"),
            r,
            ">= 10x",
            r >= 10,
        )
        r = o["output_bytes"] / u["output_bytes"]
        row(
            "3b. TarWriter output size, same samples (bytes)",
            f"{o['output_bytes']:,} B",
            f"{u['output_bytes']:,} B",
            r,
            "<= 0.6x",
            r <= 0.6,
        )
    if "pil_small" in res:
        o, u = res["pil_small"]["ours"], res["pil_small"]["upstream"]
        r = rate(o) / rate(u)
        row(
            '4. .decode("pil").to_tuple("jpg","cls"), small (samples/s)',
            _fmt(rate(o), "samples/s"),
            _fmt(rate(u), "samples/s"),
            r,
            ">= 4x",
            r >= 4,
        )
    if "t224_large" in res:
        o = res["t224_large"]["ours"]
        ups = {s: v for s, v in res["t224_large"].items() if s != "ours"}
        best_side = max(ups, key=lambda s: rate(ups[s]))
        u = ups[best_side]
        r = rate(o) / rate(u)
        others = "; ".join(f"{s.split(':')[1]}: {_fmt(rate(v), '/s')}" for s, v in ups.items())
        row(
            "5. ImageNet-like JPEG -> 224x224 float tensor (samples/s)",
            _fmt(rate(o), "samples/s"),
            f"{_fmt(rate(u), 'samples/s')} (best of {others})",
            r,
            ">= 1.5x",
            r >= 1.5,
        )
    if "loader_small" in res:
        o, u = res["loader_small"]["ours"], res["loader_small"]["upstream"]
        r = rate(o) / rate(u)
        tot = (o["total_items"] / o["total_s"]) / (u["total_items"] / u["total_s"])

        def with_startup(x):
            return (
                f"{_fmt(rate(x), 'samples/s')} "
                f"(incl. start-up {_fmt(x['total_items'] / x['total_s'], '/s')})"
            )

        row(
            "6. DataLoader(num_workers=2, batch_size=64), rgb8 small (samples/s)",
            with_startup(o),
            with_startup(u),
            r,
            f">= 3x (incl. start-up: {tot:.2f}x)",
            r >= 3,
        )
    if "memory" in res:
        o, u = res["memory"]["ours"], res["memory"]["upstream"]
        mo, mu = o["above_baseline"] / 2**20, u["above_baseline"] / 2**20
        row(
            f"7. peak RSS above baseline, {o['bytes'] / 1e9:.1f} GB through shuffle(1000)",
            f"{mo:.0f} MiB",
            f"{mu:.0f} MiB",
            mo / mu if mu else 0.0,
            "< 150 MiB",
            mo < 150,
        )
    return rows, ok_all


def markdown(rows) -> str:
    head = ["metric", "ours", "upstream / cat", "ratio (ours/ref)", "target", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_results(text_table: str, res: dict, info: dict, args, runtime: float) -> None:
    v = info["versions"]
    small = common.layout("small", args.quick)
    large = common.layout("large", args.quick)
    doc = [
        "# Benchmark results: tarshards vs webdataset 1.0.2",
        "",
        f"Measured {info['date']} by `bench/run.py{' --quick' if args.quick else ''}` "
        f"(best of {args.repeat}, of {max(args.repeat, 5) if args.repeat > 1 else 1} for the "
        "DataLoader row; each run in a fresh process, ours and upstream alternating; "
        f"{runtime:.0f} s in all).",
        "",
        f"Machine: {info.get('cpu', '?')}, nproc={info['nproc']}, Python {info['python']}, "
        f"{info['platform']}.  Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        f"Data (synthetic, fixed seed, page-cached): small = {small['shards']} shards x "
        f"{small['per_shard']} samples of {small['size'][0]}x{small['size'][1]} JPEG (~4 KB) + cls "
        f"+ json; large = {large['shards']} shards x {large['per_shard']} samples of "
        f"{large['size'][0]}x{large['size'][1]} JPEG (~100 KB) + cls. All children run with "
        "`torch.set_num_threads(1)`.",
        "",
        text_table,
        "",
        "How each row is measured: see the docstring of `bench/run.py`. Row 5 compares with the "
        'faster of two typical upstream pipelines (`.decode("torchrgb")` + '
        '`F.interpolate(bilinear)`, or `.decode("pil")` + `PIL.resize(BILINEAR)` + to-tensor); '
        "ours uses reduced-size JPEG decoding (libjpeg-turbo 1/2^k scaling through simplejpeg, "
        "then an antialiased bilinear resize on uint8 in torch to exactly 224x224). Row 6 counts "
        "samples from the first batch on (worker start-up excluded); the rate including start-up "
        "is shown in brackets. Row 7: ru_maxrss minus the RSS after imports and dataset "
        "construction (torch imported in both).",
        "",
        "<details><summary>raw figures</summary>",
        "",
        "```json",
        json.dumps(res, indent=1, default=str),
        "```",
        "</details>",
        "",
    ]
    notes = ""
    try:
        with open(RESULTS) as f:
            old = f.read()
        if NOTES_MARK in old:
            notes = old[old.index(NOTES_MARK) :]
    except OSError:
        pass
    with open(RESULTS, "w") as f:
        f.write("\n".join(doc))
        f.write(notes or NOTES_MARK + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller data, 2 repetitions")
    p.add_argument("--repeat", type=int, default=None, help="runs per side (best kept; default 3)")
    p.add_argument("--only", default=None, help="comma-separated benchmarks: " + ",".join(PLAN))
    p.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS.md")
    p.add_argument(
        "--peer-python",
        default=PEERS["python"],
        help="the peers' Python (litdata), default bench/.venv/bin/python",
    )
    p.add_argument("--child", nargs=2, metavar=("NAME", "SIDE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    PEERS["python"] = args.peer_python
    if args.child:
        res = run_child(args.child[0], args.child[1], args.quick)
        print(json.dumps(res))
        return 0
    if args.repeat is None:
        args.repeat = 2 if args.quick else 3
    names = list(PLAN) if args.only is None else [n.strip() for n in args.only.split(",")]
    for n in names:
        if n not in PLAN:
            p.error(f"unknown benchmark {n!r}; choose from {', '.join(PLAN)}")
    if "raw_large" in names and "cat_large" not in names:
        names.insert(names.index("raw_large") + 1, "cat_large")
    t0 = time.time()
    paths = common.make_dataset("small", args.quick) + common.make_dataset("large", args.quick)
    # the peers' copies of the data too (made by their first run; from then on reused)
    peers = sorted(
        os.path.join(d, f)
        for d in glob.glob(os.path.join(common.DATA, "litdata-*"))
        for f in os.listdir(d)
        if os.path.isfile(os.path.join(d, f))
    )
    common.warm_cache(paths + peers, fresh=True)
    for lay in ("small", "large"):
        ps = common.make_dataset(lay, args.quick)
        print(f"{lay}: {len(ps)} shards, {common.total_bytes(ps) / 1e6:.0f} MB", file=sys.stderr)
    res = measure(names, args.repeat, args.quick)
    rows, _ok = table(res)
    text = markdown(rows)
    print(text)
    if not args.no_write:
        write_results(text, res, common.machine_info(), args, time.time() - t0)
        print(f"\nwritten to {os.path.relpath(RESULTS)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
