"""Loader efficiency: two workers against one process and against the machine's ceiling, and the
peers' loaders on the same samples.

    .venv/bin/python bench/bench_loader.py [--quick] [--repeat 3] [--no-peers]

On the small shards of ``common.py`` (96x96 JPEGs, ~4 KB), every row decodes each JPEG to an
HxWx3 uint8 array and hands out batches of 64 (images and labels):

* ``single``: ``WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls").batched(64)`` iterated
  in one process (the reference the loader rows are divided by);
* ``ceiling``: two ``single`` runs at once, each over half of the shards, started together; the
  samples of both over the time from the first batch to the last one. Two loader workers can at
  best do what two independent processes do, so ``WebLoader / ceiling`` is what the loader
  itself keeps (the rest, ``ceiling / single``, is what the machine gives a second process:
  on two hyperthreads of a shared host that is far from 2x);
* ``webloader_shm``: ``WebLoader(that pipeline, batch_size=None, num_workers=2)``, batches
  through the shared-memory transport (the default);
* ``webloader_plain``: the same with ``transport=None`` (DataLoader's own path);
* ``dataloader_bs64``: ``torch.utils.data.DataLoader(unbatched pipeline, batch_size=64,
  num_workers=2)`` (batching in the loader, as many users write it);
* the peers, in their own environment (``--peer-python``, default ``bench/.venv``; see
  ``bench_index.py`` for how it is made), each with 2 workers and batches of 64:
  ``wds_rgb8``: webdataset 1.0.2 ``wds.WebDataset(urls).decode("rgb8").to_tuple("jpg",
  "cls").batched(64)`` in ``wds.WebLoader(num_workers=2, batch_size=None)`` (its decoder:
  PIL); ``wds``: the same pipeline decoding with ``.map_tuple(decode, int)``; ``litdata``:
  the samples ``optimize()``d once, ``StreamingDataset`` + ``StreamingDataLoader``;
  ``streaming``: MosaicML Streaming, the samples written once by ``MDSWriter``,
  ``StreamingDataset`` + ``DataLoader``; ``wids``: ``ShardListDataset`` + ``ChunkedSampler`` +
  ``DataLoader``. Those four decode with simplejpeg (``--peer-decoder``), the decoder
  tarshards' ``rgb8`` uses, so that the loaders are compared and not the JPEG decoders.

Every row reads the same list of shards, each of them ``--passes`` times in a row (default 3:
60,000 samples, a few seconds per row; one pass of 20,000 is over in under a second with two
workers, and the ramp-up and uneven finish of the workers then weigh on the rate more than in
any real epoch). Each row runs in fresh processes, rows alternate within each repetition, and
the median of ``--repeat`` runs is kept. Samples/s are counted from the first batch (start-up
excluded, shown apart). "CPU ms/sample" is the CPU time of all the row's processes (the main one
and its workers, from ``iter()`` to the workers' exit) per sample: on a machine shared with
other jobs it is steadier than samples/s and says what the loader costs on top of the decoding
(it grows when two processes share the two hyperthreads of a core, so compare it with
``ceiling``'s). Every row reports its sample count and the sum of its labels: the same for all
rows (every sample once). Targets (issue 15): ``webloader_shm`` >= 1.6x ``single`` and >= 2x the
best peer.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_VENV = os.path.join(HERE, ".venv", "bin", "python")
BATCH = 64
WORKERS = 2

OURS = ["single", "ceiling", "webloader_shm", "webloader_plain", "dataloader_bs64"]
PEERS = ["wds_rgb8", "wds", "litdata", "streaming", "wids"]


def _measure(source, barrier=None) -> dict:
    """Iterate ``source`` (batches of (images, labels)); rate from the first batch on."""
    import resource

    def cpu() -> float:  # this process and its joined children (the loader's workers)
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    if barrier is not None:
        barrier()
    c0 = cpu()
    t0 = time.perf_counter()
    it = iter(source)
    first = next(it)
    t1 = time.perf_counter()
    first_wall = time.time()
    n = 0
    labels = int(sum(int(v) for v in first[1]))
    count = len(first[1])
    for x, y in it:
        n += len(y)
        labels += int(y.sum())
        if x.dtype.itemsize != 1 or x.shape[1:] != (96, 96, 3):
            raise SystemExit(f"unexpected batch {x.dtype} {tuple(x.shape)}")
    t2 = time.perf_counter()
    del it, first
    gc.collect()  # the workers exit (and are joined) with their iterator
    return {
        "cpu_s": cpu() - c0,
        "rate": n / (t2 - t1),
        "startup_s": t1 - t0,
        "items": n + count,
        "label_sum": labels,
        "counted": n,
        "first_wall": first_wall,
        "end_wall": first_wall + (t2 - t1),
    }


def _stdin_barrier():
    print("ready", flush=True)
    sys.stdin.readline()


# ---------------------------------------------------------------------------------------------
# ours (run with tarshards on the path)
# ---------------------------------------------------------------------------------------------


def child(row: str, quick: bool, part: str | None, passes: int = 1) -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    import common
    import torch

    from tarshards import WebDataset, WebLoader

    torch.set_num_threads(1)
    urls = common.make_dataset("small", quick=quick) * passes
    barrier = None
    if part is not None:  # one half of the ceiling row
        i, k = (int(v) for v in part.split("/"))
        urls = urls[i::k]
        barrier = _stdin_barrier

    def batched():
        return WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls").batched(BATCH)

    if row == "single":
        source = batched()
    elif row == "webloader_shm":
        source = WebLoader(batched(), batch_size=None, num_workers=WORKERS)
    elif row == "webloader_plain":
        source = WebLoader(batched(), batch_size=None, num_workers=WORKERS, transport=None)
    elif row == "dataloader_bs64":
        ds = WebDataset(urls).decode("rgb8").to_tuple("jpg", "cls")
        source = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        raise SystemExit(f"unknown row {row}")
    return _measure(source, barrier)


def run_ceiling(quick: bool, passes: int = 1) -> dict:
    """Two ``single`` halves at once; total samples over the span of both."""
    cmd = [sys.executable, __file__, "--child", "single", "--passes", str(passes)]
    cmd += ["--quick"] if quick else []
    procs = [
        subprocess.Popen(
            cmd + ["--part", f"{i}/2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"ceiling child failed: {line} {p.stderr.read()}")
    for p in procs:  # both start together
        p.stdin.write("go\n")
        p.stdin.flush()
    halves = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"ceiling child failed: {err}")
        halves.append(json.loads(out.strip().splitlines()[-1]))
    span = max(h["end_wall"] for h in halves) - min(h["first_wall"] for h in halves)
    counted = sum(h["counted"] for h in halves)
    return {
        "rate": counted / span,
        "startup_s": max(h["startup_s"] for h in halves),
        "items": sum(h["items"] for h in halves),
        "label_sum": sum(h["label_sum"] for h in halves),
        "cpu_s": sum(h["cpu_s"] for h in halves),
        "halves": [h["rate"] for h in halves],
    }


# ---------------------------------------------------------------------------------------------
# the peers (run in the peer environment; nothing of tarshards is imported there)
# ---------------------------------------------------------------------------------------------


def _decoder(name: str):
    import numpy as np

    if name == "simplejpeg":
        import simplejpeg

        def decode(data):
            return simplejpeg.decode_jpeg(bytes(data), colorspace="RGB")

    elif name == "pil":
        from PIL import Image

        def decode(data):
            return np.asarray(Image.open(io.BytesIO(bytes(data))).convert("RGB"))

    else:
        raise SystemExit(f"unknown decoder {name}")
    return decode


def _tar_samples(url: str):
    """(jpg bytes, label) of each sample of a shard, with the standard library."""
    import tarfile

    with tarfile.open(url) as tf:
        key, fields = None, {}
        for m in tf:
            if not m.isfile():
                continue
            k, _, ext = m.name.partition(".")
            if k != key and fields:
                yield fields["jpg"], int(fields["cls"])
                fields = {}
            key = k
            fields[ext] = tf.extractfile(m).read()
        if fields:
            yield fields["jpg"], int(fields["cls"])


def _converted(out: str, urls: list[str], write) -> str:
    """``write(out)`` once for these shards (kept in bench/_data, redone when they change)."""
    import shutil

    stamp = os.path.join(out, "source.json")
    source = {"urls": urls, "sizes": [os.path.getsize(u) for u in urls]}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == source:
                return out
    shutil.rmtree(out, ignore_errors=True)
    write(out)
    with open(stamp, "w") as f:
        json.dump(source, f)
    return out


def _litdata_samples(url: str):
    for jpg, label in _tar_samples(url):
        yield {"jpg": jpg, "cls": label}


def _write_litdata(urls):
    def write(out):
        from litdata import optimize

        optimize(
            fn=_litdata_samples,
            inputs=list(urls),
            output_dir=out,
            chunk_bytes="64MB",
            num_workers=1,
            reorder_files=False,
            verbose=False,
        )

    return write


def _write_mds(urls):
    def write(out):
        from streaming import MDSWriter

        with MDSWriter(
            out=out, columns={"jpg": "bytes", "cls": "int"}, compression=None, size_limit=1 << 26
        ) as w:
            for url in urls:
                for jpg, label in _tar_samples(url):
                    w.write({"jpg": jpg, "cls": label})

    return write


class _LitTransform:  # litdata pickles the dataset's transform: a module-level class
    def __init__(self, decoder: str):
        self.decoder = decoder
        self._decode = None

    def __call__(self, sample):
        if self._decode is None:
            self._decode = _decoder(self.decoder)
        return self._decode(sample["jpg"]), sample["cls"]

    def __getstate__(self):
        return {"decoder": self.decoder, "_decode": None}


def peer(row: str, job: dict) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    urls = job["urls"]
    decode = _decoder(job["decoder"])
    version = "?"
    if row in ("wds_rgb8", "wds"):
        import webdataset as wds

        version = wds.__version__
        ds = wds.WebDataset(urls, shardshuffle=False)
        if row == "wds_rgb8":
            ds = ds.decode("rgb8").to_tuple("jpg", "cls")
        else:
            ds = ds.to_tuple("jpg", "cls").map_tuple(decode, lambda b: int(b))
        ds = ds.batched(BATCH)
        loader = wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)
    elif row == "litdata":
        import litdata
        from litdata import StreamingDataLoader, StreamingDataset

        version = litdata.__version__
        local = _converted(job["data"] + "/litdata-loader", urls, _write_litdata(urls))

        ds = StreamingDataset(local, shuffle=False, transform=_LitTransform(job["decoder"]))
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    elif row == "streaming":
        import common

        common.torchvision_importable()
        import streaming
        from streaming import StreamingDataset

        version = streaming.__version__
        local = _converted(job["data"] + "/mds-loader", urls, _write_mds(urls))
        streaming.base.util.clean_stale_shared_memory()

        class Decoded(StreamingDataset):
            def __getitem__(self, i):
                s = super().__getitem__(i)
                return decode(s["jpg"]), s["cls"]

        ds = Decoded(local=local, batch_size=BATCH, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    elif row == "wids":
        import wids

        version = "0.1.11"
        counts = job["counts"]
        shards = [{"url": u, "nsamples": n} for u, n in zip(urls, counts)]

        def transform(sample):
            return decode(sample[".jpg"].getvalue()), int(sample[".cls"].getvalue())

        ds = wids.ShardListDataset(shards, transformations=[transform])
        sampler = wids.ChunkedSampler(ds, chunksize=1000, shuffle=False)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=BATCH, num_workers=WORKERS, sampler=sampler
        )
    else:
        raise SystemExit(f"unknown peer {row}")

    class AsArrays:  # the checks of _measure want arrays; tensors are converted for free
        def __iter__(self):
            for x, y in loader:
                yield np.asarray(x), np.asarray(y)

    result = _measure(AsArrays())
    result["version"] = version
    return result


def run_peer(python: str, row: str, job: dict, timeout: float = 900) -> dict:
    if not os.path.exists(python):
        return {"error": f"not installed ({python} missing; see bench_index.py)"}
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--peer", row, json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--passes",
        type=int,
        default=3,
        help="each row reads the shards this many times in a row (one stream): the rate of a "
        "long epoch rather than of the first second (2 workers ramp up and finish unevenly)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", default=None, help="comma-separated rows (default: all)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--peer-python", default=PEER_VENV)
    ap.add_argument("--peer-decoder", default="simplejpeg", choices=["simplejpeg", "pil"])
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.part, args.passes)))
        return
    if args.peer:
        print(json.dumps(peer(args.peer[0], json.loads(args.peer[1]))))
        return
    sys.path.insert(0, HERE)
    import common

    urls = common.make_dataset("small", quick=args.quick)  # once, before any timing
    common.warm_cache(urls)
    lay = common.layout("small", args.quick)
    rows = OURS + ([] if args.no_peers else PEERS)
    if args.rows:
        rows = [r for r in args.rows.split(",") if r]
    job = {  # the peers convert and read the same list of shards (each one `passes` times)
        "urls": urls * args.passes,
        "counts": [lay["per_shard"]] * len(urls) * args.passes,
        "decoder": args.peer_decoder,
        "data": os.path.join(common.DATA, "small-q" if args.quick else "small")
        + f"-conv{'' if args.passes == 1 else args.passes}",
    }
    os.makedirs(job["data"], exist_ok=True)
    runs: dict[str, list] = {r: [] for r in rows}
    t_start = time.time()
    for _ in range(args.repeat):
        for row in rows:
            if row == "ceiling":
                runs[row].append(run_ceiling(args.quick, args.passes))
            elif row in PEERS:
                runs[row].append(run_peer(args.peer_python, row, job))
            else:
                cmd = [sys.executable, __file__, "--child", row, "--passes", str(args.passes)]
                out = subprocess.run(
                    cmd + (["--quick"] if args.quick else []),
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[row].append(json.loads(out.stdout.strip().splitlines()[-1]))
    report(runs, args, time.time() - t_start, common.machine_info())


def report(runs: dict, args, seconds: float, machine: dict) -> None:
    med = {}
    for row, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if ok:
            med[row] = {
                "rate": statistics.median(r["rate"] for r in ok),
                "startup_s": statistics.median(r["startup_s"] for r in ok),
                "cpu_ms": statistics.median(1e3 * r["cpu_s"] / r["items"] for r in ok),
                "items": ok[0]["items"],
                "label_sum": ok[0]["label_sum"],
                "version": ok[0].get("version", ""),
            }
    ref = med.get("single")
    print(
        f"# bench_loader (small 96x96 JPEGs{', quick' if args.quick else ''}; batches of "
        f"{BATCH}, {WORKERS} workers; {args.passes} pass(es) over the shards; median of "
        f"{args.repeat}; {machine.get('cpu', '')}, "
        f"nproc={machine.get('nproc')}; load average {os.getloadavg()[0]:.1f}; {seconds:.0f} s)"
    )
    print(
        f"{'row':<18} {'samples/s':>10} {'x single':>9} {'x ceiling':>10}  start-up  "
        "CPU ms/sample  samples"
    )
    ceiling = med.get("ceiling")
    items = ref["items"] if ref else None
    labels = ref["label_sum"] if ref else None
    for row, rs in runs.items():
        if row not in med:
            print(f"{row:<18} {rs[0]['error'] if rs else 'no run'}")
            continue
        m = med[row]
        xs = f"{m['rate'] / ref['rate']:9.2f}" if ref else f"{'':9}"
        xc = f"{m['rate'] / ceiling['rate']:10.2f}" if ceiling else f"{'':10}"
        same = ""
        if items is not None and (m["items"], m["label_sum"]) != (items, labels):
            same = f"  DIFFERENT samples ({m['items']} items, label sum {m['label_sum']})"
        name = row + (f" {m['version']}" if m["version"] else "")
        print(
            f"{name:<18} {m['rate']:10,.0f} {xs} {xc}  {m['startup_s']:6.2f}s  "
            f"{m['cpu_ms']:13.3f}  {m['items']}{same}"
        )
    ours = med.get("webloader_shm")
    peers = {r: med[r] for r in PEERS if r in med}
    if ours and peers:
        best = max(peers, key=lambda r: peers[r]["rate"])
        ratios = ", ".join(f"{r} {ours['rate'] / p['rate']:.2f}x" for r, p in peers.items())
        print(f"webloader_shm / peer: {ratios}; best peer {best}: target >= 2x")
    if ours and ref:
        print(f"webloader_shm / single: {ours['rate'] / ref['rate']:.2f}x (target >= 1.6x)")
    if ours and ceiling:
        print(
            f"webloader_shm / ceiling: {ours['rate'] / ceiling['rate']:.2f} "
            f"(ceiling / single: {ceiling['rate'] / ref['rate']:.2f}x)"
            if ref
            else ""
        )
    if ours and ref:
        print(
            f"CPU per sample, all processes: webloader_shm {ours['cpu_ms'] / ref['cpu_ms']:.2f}x "
            f"single" + (f", ceiling {ceiling['cpu_ms'] / ref['cpu_ms']:.2f}x" if ceiling else "")
        )
    print("(figures from a loaded, shared machine are noisy; compare ratios within one run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "runs": runs, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
