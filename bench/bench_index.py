"""The manifest and index: indexing speed, random access, the cost of recording while writing.

    .venv/bin/python bench/bench_index.py             # the small benchmark shards (common.py)
    .venv/bin/python bench/bench_index.py --quick     # fewer shards, fewer repetitions
    .venv/bin/python bench/bench_index.py --layout large

Three measurements, side by side in one run (best of ``--repeat`` interleaved rounds: each round
runs every contender once, the peers staying up in their own processes between rounds):

1. ``tarshards index`` on plain local shards (page-cached), one process, hashing on (xxh3_64 of
   every file and of every member), as MB/s against ``cat FILES > /dev/null``. Target >= 0.5.
2. 2,000 random ``ds[i]`` on the same local shards (raw samples, no decoding) with
   ``tarshards.IndexedDataset``, ``wids.ShardListDataset`` (``wids==0.1.11``) and MosaicML
   Streaming's ``StreamingDataset`` (``mosaicml-streaming``; the samples converted once to its MDS
   format). Targets: >= 2x wids, >= 1x Streaming. Every reader returns a checksum of the bytes it
   read, so they are compared on the same samples.
3. ``ShardWriter`` samples/s with and without ``manifest=`` (raw bytes fields, ``encoder=False``;
   CPU time of this process, the writes going to page cache), and the same samples as a
   converting user passes them (the class an int, the metadata a dict, the default encoder).
   Target: <= 5% slower. Each row runs in three fresh processes (interleaved rounds in each,
   medians over all their rounds, and each process's own median printed beside them): see
   ``RECORDING_PROCESSES``. The hashing and the index's rows are made by a thread that reads
   the shard back; the writing thread records nothing per sample.
5. With ``--scaling GB``: index building with 2 workers against 1 on about GB gigabytes of the
   shards of section 4, on each place it runs: threads in this process (the default), the
   ``processes`` engine, a Dask ``LocalCluster`` and a local Ray (``engine="dask"``/``"ray"``,
   the cluster started before the clock, as a running cluster is, and alive only for its own
   rows), every round reading every shard (``overwrite=True``). Target: 2 workers >= 1.7x one.
   Each row also prints the CPU time of its best runs (this process and its children), and the
   ratio the shard count allows (15 shards: 8 on one worker, 1.88x). A ``read floor`` row reads
   the same shards' bytes and nothing else (a reused 1 MiB buffer, 1 and 2 threads, each a share
   of the shards): how far reading the page cache scales on the host, the most an engine can.
   Dask and Ray rows are left out where they are not installed. (``--only-scaling``: this
   section alone; one short run: ``bench/bench_index.py --scaling 1 --only-scaling --repeat
   3``; ``--scaling 2.15``: 32 shards, an even split.)
4. With ``--big GB`` (repeatable): ``tarshards index SPEC -o M`` as users run it (the installed
   console script, a brace spec) on about GB gigabytes of plain shards (64 MB each, ~100 kB
   samples of random bytes, made once into ``bench/_data/big-GB``, page-cached), with its default
   parallelism and with ``-p 1``, beside ``cat FILES > /dev/null``; the command's start-up on
   a one-member shard on its own row, and the two runs less that start-up. (Section 1's data is
   40 MB, which cat reads in tens of ms, so there the command's start-up decides the ratio; on
   1 GB it is still about half of the -p 1 run.) ``-p N`` runs threads where the optional
   ``tarshards._xxh3`` is built (hashing without the GIL), else processes.
5. With ``--aligned-gz`` (alone): sample-aligned ``.tgz`` in its layout (one gzip member, a
   full-flush point per sample, entered with a raw inflater) against the layout tarshards wrote
   before (a gzip member per sample, which Python's streaming ``tarfile`` reads only the first of;
   written by ``tarshards.testing.write_member_per_sample_gzip``), on the same samples: the small
   images of the layout, and compressible text (~1.5 kB of JSON captions a sample). Rows: file
   size (target: within 2 %), ``--samples`` random ``ds[i]`` with ``IndexedDataset`` (target: no
   slower), and resume to the first batch (``WebDataset(m, readers=8).shuffle(100).batched(32)``:
   a fresh pipeline loads a state saved mid-epoch and yields its first batch; the sum over three
   cuts; target: no slower). CPU time of the (single-threaded) process, best of interleaved
   rounds. The old layout is also resumed the way tarshards did before the flush-point layout
   came (its compressed shards decompressed from their start, ``seek_points`` off).

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
import statistics
import subprocess
import sys
import tempfile
import time

try:  # POSIX: the writing thread's page faults (section 3)
    import resource
except ImportError:  # pragma: no cover
    resource = None  # type: ignore[assignment]

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


def _serve(ds, job: dict, version: str, fields=lambda got: got) -> None:
    """Warm ``ds`` up, then time one pass over ``job["indices"]`` for each "go" on stdin."""
    for i in job["warm"]:  # open every shard once (each reader reads its shard's index)
        ds[i]
    print(json.dumps({"ready": True, "version": version}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        got = [ds[i] for i in job["indices"]]
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "checksum": _peer_checksum(fields(got))}), flush=True)


def peer_wids(job: dict) -> None:
    import wids

    shards = [{"url": u, "nsamples": n} for u, n in zip(job["urls"], job["counts"])]
    cache = tempfile.mkdtemp(prefix="wids-cache-")
    try:
        ds = wids.ShardListDataset(shards, cache_dir=cache, transformations=[])
        version = wids.__version__ if hasattr(wids, "__version__") else "0.1.11"
        _serve(
            ds,
            job,
            version,
            lambda got: [{k[1:] if k.startswith(".") else k: v for k, v in s.items()} for s in got],
        )
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


def peer_streaming(job: dict) -> None:
    import common

    common.torchvision_importable()
    import streaming
    from streaming import StreamingDataset

    local = _mds_dir(job)
    streaming.base.util.clean_stale_shared_memory()
    ds = StreamingDataset(local=local, batch_size=1, shuffle=False)
    _serve(ds, job, streaming.__version__)


class Peer:
    """A peer in its own process (``bench/.venv``): ``ready`` after its warm-up, then one timed
    pass per :meth:`run`, so that the contenders' passes interleave (a busy moment of a loaded
    machine then hits all of them, not one)."""

    def __init__(self, python: str, name: str, job: dict):
        self.name = name
        self.error: str | None = None
        self.version = ""
        self.proc = None
        if not os.path.exists(python):
            self.error = f"not installed ({python} missing; see this file's docstring)"
            return
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(job, f)
            self.job_path = f.name
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--peer", name, self.job_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        first = self._answer()
        if first is not None:
            self.version = first.get("version", "")

    def _answer(self) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = (self.proc.stderr.read() if self.proc.stderr else "").strip()
            self.error = err.splitlines()[-1] if err else f"exit {self.proc.wait()}"
            self.close()
            return None
        return json.loads(line)

    def run(self) -> dict | None:
        if self.proc is None:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None
            os.unlink(self.job_path)


# ---------------------------------------------------------------------------------------------
# ours
# ---------------------------------------------------------------------------------------------


def _wall(cmd: list[str] | str, env=None) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        cmd,
        shell=isinstance(cmd, str),
        check=True,
        env=env,
        executable="/bin/bash" if isinstance(cmd, str) else None,
    )
    return time.perf_counter() - t0


def _command_env() -> dict:
    """The environment the timed commands run in: this tree's ``src`` first, and byte code
    cached as an installed package has it (``pip install`` compiles it; a
    ``PYTHONDONTWRITEBYTECODE`` set around the benchmark would have every run compile the
    modules from source, about 0.1 s of the start-up)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _tiny_shard(tmp: str) -> str:
    import io
    import tarfile

    path = os.path.join(tmp, "tiny", "tiny-0.tar")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        ti = tarfile.TarInfo("k0.txt")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    return path


def bench_index_vs_cat(paths, tmp: str, repeat: int) -> dict:
    """Best of ``repeat`` interleaved rounds of: cat, ``tarshards index -p 1``, the same command
    on a one-member shard (its start-up: the interpreter and the imports), ``index_url`` in this
    process, and ``tarshards index -p NCPU``."""
    import common

    from tarshards.format.index import index_url

    env = _command_env()
    nbytes = common.total_bytes(paths)
    out = os.path.join(tmp, "index-cli", "manifest.json")
    tiny = _tiny_shard(tmp)
    ncpu = os.cpu_count() or 1

    def command(inputs, workers):
        return [
            sys.executable,
            "-c",
            "from tarshards.cli.main import main; main()",
            "index",
            "-q",
            "--overwrite",  # every round reads every shard (a rerun reuses complete indexes)
            "-p",
            str(workers),
            *inputs,
            "-o",
            out if inputs is paths else os.path.join(tmp, "tiny", "m.json"),
        ]

    best = {k: float("inf") for k in ("cat", "index", "startup", "inproc", "parallel")}
    for _ in range(repeat):
        best["cat"] = min(best["cat"], _wall("cat " + " ".join(paths) + " > /dev/null"))
        best["index"] = min(best["index"], _wall(command(paths, 1), env))
        best["startup"] = min(best["startup"], _wall(command([tiny], 1), env))
        t0 = time.perf_counter()
        for p in paths:
            index_url(p)
        best["inproc"] = min(best["inproc"], time.perf_counter() - t0)
        best["parallel"] = min(best["parallel"], _wall(command(paths, ncpu), env))
    return {
        "bytes": nbytes,
        "cat_s": best["cat"],
        "index_s": best["index"],
        "startup_s": best["startup"],
        "index_parallel_s": best["parallel"],
        "ncpu": ncpu,
        "index_inprocess_s": best["inproc"],
    }


def make_big(gb: float) -> list[str]:
    """About ``gb`` GB of plain ustar shards of 64 MB (tarfile, neutral), made once."""
    import io
    import tarfile

    import common
    import numpy as np

    shard_bytes = 64 << 20
    count = max(1, round(gb * 1e9 / shard_bytes))
    outdir = os.path.join(common.DATA, f"big-{gb:g}")
    paths = [os.path.join(outdir, f"big-{i:04d}.tar") for i in range(count)]
    stamp = os.path.join(outdir, "done.json")
    if os.path.exists(stamp) and all(os.path.exists(p) for p in paths):
        return paths
    shutil.rmtree(outdir, ignore_errors=True)
    os.makedirs(outdir)
    rng = np.random.default_rng(common.SEED)
    blob = rng.integers(0, 256, 1 << 21, dtype=np.uint8).tobytes()  # slices of it: the data
    k = 0
    for path in paths:
        with tarfile.open(path + ".tmp", "w", format=tarfile.USTAR_FORMAT) as tf:
            while tf.fileobj.tell() < shard_bytes:
                size = int(rng.integers(10_000, 190_000))
                at = int(rng.integers(0, len(blob) - size))
                for ext, data in (("cls", str(k % 1000).encode()), ("jpg", blob[at : at + size])):
                    ti = tarfile.TarInfo(f"big_{k:08d}.{ext}")
                    ti.size = len(data)
                    ti.mtime = 1_700_000_000
                    tf.addfile(ti, io.BytesIO(data))
                k += 1
        os.replace(path + ".tmp", path)
    with open(stamp, "w") as f:
        json.dump({"gb": gb, "shards": count, "samples": k}, f)
    return paths


def bench_index_big(paths, tmp: str, repeat: int) -> dict:
    """Best of ``repeat`` interleaved rounds of: cat, ``tarshards index SPEC -o M`` (default
    parallelism), the same with ``-p 1``, and the command on a one-member shard (start-up)."""
    import common

    env = _command_env()
    script = os.path.join(os.path.dirname(sys.executable), "tarshards")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "tarshards.cli.main"]
    folder = os.path.dirname(paths[0])
    spec = os.path.join(folder, f"big-{{0000..{len(paths) - 1:04d}}}.tar")
    out = os.path.join(tmp, "big-index", "manifest.json")  # the indexes go to _index/ there
    tiny = _tiny_shard(tmp)
    tiny_out = os.path.join(tmp, "tiny", "m.json")
    best = {k: float("inf") for k in ("cat", "default", "p1", "startup")}
    for _ in range(repeat):
        best["cat"] = min(best["cat"], _wall("cat " + " ".join(paths) + " > /dev/null"))
        index = [*cmd, "index", "-q", "--overwrite"]  # read every shard, every round
        best["default"] = min(best["default"], _wall([*index, spec, "-o", out], env))
        best["p1"] = min(best["p1"], _wall([*index, "-p", "1", spec, "-o", out], env))
        best["startup"] = min(
            best["startup"], _wall([*index, "-p", "1", tiny, "-o", tiny_out], env)
        )
    return {"bytes": common.total_bytes(paths), "shards": len(paths), **best}


def bench_scaling(paths, tmp: str, repeat: int) -> dict:
    """Seconds (best of ``repeat`` interleaved rounds) of ``build_manifest(overwrite=True)`` with
    1 and 2 workers, per engine, and the CPU seconds of the run that was best (this process's
    and its children's: what a worker costs beyond its shards). Threads and processes run with
    no cluster alive; each cluster is started before the clock and runs only its own rows (an
    idle ``LocalCluster`` costs ~0.1 CPU, its scheduler's event loop a thread of this process
    that takes the GIL: it was measured beside the threads rows before)."""
    import resource

    from tarshards.format.manifest import build_manifest

    out = os.path.join(tmp, "scaling", "manifest.json")  # the indexes go to _index/ there

    def cpu() -> float:
        me, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def timed(**kw) -> tuple[float, float]:
        c0, t0 = cpu(), time.perf_counter()
        build_manifest(paths, out, overwrite=True, **kw)
        return time.perf_counter() - t0, cpu() - c0

    import common

    rows: dict = {"bytes": common.total_bytes(paths), "shards": len(paths)}
    best: dict = {}

    def rounds(runs: dict) -> None:
        for run in runs.values():
            run(1)  # warm: the engine's first start-up, the index files' pages
        for key in [(n, w) for n in runs for w in (1, 2)]:
            best[key] = (float("inf"), 0.0)
        for _ in range(repeat):
            for name, run in runs.items():
                for w in (1, 2):
                    got = run(w)
                    if got[0] < best[name, w][0]:
                        best[name, w] = got

    def floor(w: int) -> tuple[float, float]:
        """The shards read into a reused 1 MiB buffer, no parsing, no hashing, by ``w``
        threads (each a share of the shards, as the engines split them): how far reading the
        page cache alone scales on this host, the most any engine can."""
        import threading

        def read(part: list) -> None:
            buf = bytearray(1 << 20)
            for path in part:
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass

        c0, t0 = cpu(), time.perf_counter()
        threads = [threading.Thread(target=read, args=(paths[i::w],)) for i in range(w)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, cpu() - c0

    rounds(
        {
            "threads": lambda w: timed(workers=w),
            "processes": lambda w: timed(engine="processes", workers=w),
            "read floor": floor,
        }
    )
    try:
        import distributed
    except ImportError:
        distributed = None
    if distributed is not None:
        import contextlib

        with contextlib.ExitStack() as stack:
            clients = {}
            for w in (1, 2):
                cluster = stack.enter_context(
                    distributed.LocalCluster(
                        n_workers=w,
                        threads_per_worker=1,
                        host="127.0.0.1",
                        dashboard_address=None,
                        silence_logs=50,
                        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                    )
                )
                clients[w] = stack.enter_context(distributed.Client(cluster))
            rounds({"dask": lambda w: timed(engine="dask", client=clients[w])})
    try:  # Ray: a cluster of 1 CPU, then one of 2 (a Ray task takes one CPU)
        import logging

        import ray

        from tarshards.parallel.engines import local_ray_env

        for w in (1, 2):
            ray.init(
                address="local",
                num_cpus=w,
                include_dashboard=False,
                logging_level=logging.ERROR,
                runtime_env=local_ray_env(),
            )
            try:
                timed(engine="ray")
                best["ray", w] = min(timed(engine="ray") for _ in range(repeat))
            finally:
                ray.shutdown()
    except ImportError:
        pass
    rows["seconds"] = {f"{n}/{w}": v[0] for (n, w), v in best.items()}
    rows["cpu"] = {f"{n}/{w}": v[1] for (n, w), v in best.items()}
    return rows


def report_scaling(r: dict) -> None:
    mb = r["bytes"] / 1e6
    print(f"\n5. index building, 2 workers vs 1, on {mb:.0f} MB ({r['shards']} shards, page cache)")
    secs, cpus = r["seconds"], r.get("cpu", {})
    for name in dict.fromkeys(k.split("/")[0] for k in secs):
        one, two = secs[f"{name}/1"], secs[f"{name}/2"]
        line = (
            f"   {name:<10s} 1 worker {mb / one:7.0f} MB/s   2 workers {mb / two:7.0f} MB/s   "
            f"{one / two:.2f}x (target >= 1.7)"
        )
        if name == "read floor":
            line += "   (the shards' bytes read, nothing else: the most reading scales here)"
        elif name != "ray":  # (Ray's workers are not this process's children)
            c1, c2 = cpus[f"{name}/1"], cpus[f"{name}/2"]
            line += f"   CPU {c1 * 1e3:.0f} / {c2 * 1e3:.0f} ms"
        print(line)
    per = -(-r["shards"] // 2)
    print(
        f"   ({os.cpu_count()} CPUs; hashing: {_hashing_note()}; CPU: this process and its "
        f"children, 1 / 2 workers; {r['shards']} shards: at most {r['shards'] / per:.2f}x with "
        f"{per} on the busier worker)"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None:
        print(f"   (load average {load:.2f} at the end of the run)")


def bench_random(manifest, job: dict, peers: list, repeat: int) -> dict:
    """Best of ``repeat`` interleaved rounds: one pass of ours, then one of each peer."""
    from tarshards.read.indexed import IndexedDataset

    ds = IndexedDataset(manifest)
    for i in job["warm"]:
        ds[i]
    indices = job["indices"]
    ours = {"seconds": float("inf")}
    theirs: dict = {p.name: {"seconds": float("inf")} for p in peers}
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = [ds[i] for i in indices]
        ours["seconds"] = min(ours["seconds"], time.perf_counter() - t0)
        ours["checksum"] = _peer_checksum(got)
        del got
        for p in peers:
            r = p.run()
            if r is not None:
                theirs[p.name]["seconds"] = min(theirs[p.name]["seconds"], r["seconds"])
                theirs[p.name]["checksum"] = r["checksum"]
    ds.close()
    for p in peers:
        if p.error is not None:
            theirs[p.name] = {"error": p.error}
        else:
            theirs[p.name]["version"] = p.version
    return {"tarshards": ours, **theirs}


def as_values(samples) -> list[dict]:
    """The samples as a converting user hands them to ShardWriter: the class as an int, the
    metadata as a dict (encoded again by the default encoder), the image as its bytes."""
    out = []
    for s in samples:
        v = dict(s)
        if "cls" in v:
            v["cls"] = int(bytes(v["cls"]))
        if "json" in v:
            v["json"] = json.loads(bytes(v["json"]))
        out.append(v)
    return out


def bench_recording(samples, tmp: str, repeat: int, encoder: bool = False) -> dict:
    """ShardWriter over ``samples`` (4 shards) without and with ``manifest=``, interleaved.

    Three clocks per run: wall time from the first write to the return of ``close()`` (the
    rate a user sees: the target's), the writing thread's CPU time (``thread_time``: what
    recording costs the thread that writes) and the process's (``process_time``: every thread,
    the hashing thread and the index saver included: what it costs the machine). Medians of the
    rounds (wall times on a shared disk vary from round to round: each run ends with fsyncs).
    Also the writing thread's minor page faults per run: on a VM each can be a trip to the
    hypervisor, and where recording made the writer touch fresh memory, its cost followed the
    machine's state (3 % one hour, 10 % the next)."""
    from tarshards import ShardWriter

    def faults() -> int:  # the writing thread's minor page faults (0 where not counted)
        who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
        return 0 if who is None else resource.getrusage(who).ru_minflt

    def once(manifest: bool) -> tuple:
        d = tempfile.mkdtemp(dir=tmp)
        f0 = faults()
        w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        with ShardWriter(
            os.path.join(d, "rec-%05d.tar"),
            maxcount=max(1, len(samples) // 4),
            encoder=encoder,
            manifest=os.path.join(d, "m.json") if manifest else None,
        ) as w:
            for s in samples:
                w.write(s)
        times = (
            time.perf_counter() - w0,
            time.thread_time() - t0,
            time.process_time() - p0,
            faults() - f0,
        )
        shutil.rmtree(d)
        return times

    plain, recorded = [], []
    for _ in range(repeat):  # interleaved, so that a busy moment hits both
        plain.append(once(False))
        recorded.append(once(True))
    return {"samples": len(samples), "plain": plain, "manifest": recorded}


def pooled_recording(runs: list) -> dict:
    """Medians over the rounds of every process (``runs``: what bench_recording returned in
    each), and each process's own wall-clock ratio."""
    out = {"samples": runs[0]["samples"], "processes": len(runs)}
    for i, clock in enumerate(("wall", "thread", "process")):
        for kind in ("plain", "manifest"):
            out[f"{kind}_{clock}_s"] = statistics.median(t[i] for r in runs for t in r[kind])
    for kind in ("plain", "manifest"):
        out[f"{kind}_thread_faults"] = statistics.median(
            t[3]
            for r in runs
            for t in r[kind][1:]  # each process's first run: its warm-up
        )
    out["per_process"] = [
        statistics.median(t[0] for t in r["manifest"]) / statistics.median(t[0] for t in r["plain"])
        for r in runs
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shards, fewer repetitions")
    ap.add_argument("--layout", default="small", choices=["small", "large"])
    ap.add_argument("--samples", type=int, default=2000, help="random accesses")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--peer-python", default=PEER_VENV)
    ap.add_argument(
        "--big",
        type=float,
        action="append",
        default=[],
        metavar="GB",
        help="also section 4 on GB of shards (repeat it for several sizes: --big 1 --big 4)",
    )
    ap.add_argument("--only-big", action="store_true", help="section 4 alone (with --big)")
    ap.add_argument("--scaling", type=float, default=None, metavar="GB", help="section 5 on GB")
    ap.add_argument("--only-scaling", action="store_true", help="section 5 alone")
    ap.add_argument("--only-recording", action="store_true", help="section 3 alone")
    ap.add_argument(
        "--aligned-gz", action="store_true", help="section 5 alone: aligned .tgz, new vs old"
    )
    ap.add_argument("--peer", nargs=2, metavar=("NAME", "JOB"), help=argparse.SUPPRESS)
    ap.add_argument("--recording-child", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.recording_child:
        recording_child(args.recording_child, args.layout, args.repeat, args.tmp, args.quick)
        return
    if args.peer:
        name, path = args.peer
        with open(path) as f:
            job = json.load(f)
        {"wids": peer_wids, "streaming": peer_streaming}[name](job)
        return

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import common
    import numpy as np

    from tarshards.format.manifest import build_manifest

    repeat = args.repeat or (2 if args.quick else 5)
    paths = common.make_dataset(args.layout, quick=args.quick)
    common.warm_cache(paths)
    tmp = tempfile.mkdtemp(
        prefix="bench-index-",
        dir=os.environ.get("BENCH_TMP") or ("/dev/shm" if os.path.isdir("/dev/shm") else None),
    )
    results: dict = {"machine": common.machine_info(), "layout": args.layout, "quick": args.quick}
    try:
        if args.scaling:
            big = make_big(args.scaling)
            common.warm_cache(big)
            results["scaling"] = bench_scaling(big, tmp, repeat)
            report_scaling(results["scaling"])
            if args.only_scaling:
                return
        results["big"] = []
        for gb in args.big:
            big = make_big(gb)
            common.warm_cache(big)
            results["big"].append(bench_index_big(big, tmp, repeat))
        if args.only_big:
            for b in results["big"]:
                report_big(b)
            return
        if args.aligned_gz:
            report_aligned_gz(bench_aligned_gz(paths, tmp, repeat, args.samples, args.quick))
            return
        if args.only_recording:
            bench_recording_rows(results, args.layout, tmp, repeat, args.quick)
            report(results, args.samples)
            return
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
        job = {
            "urls": manifest.shard_urls(),
            "counts": [r.samples for r in manifest.shards],
            "indices": indices,
            "warm": warm,
            "mds_dir": os.path.join(
                common.DATA, f"mds-{args.layout}{'-quick' if args.quick else ''}"
            ),
        }
        peers = [Peer(args.peer_python, name, job) for name in ("wids", "streaming")]
        try:
            results["random"] = bench_random(manifest, job, peers, max(repeat, 3))
        finally:
            for p in peers:
                p.close()
        # 3. recording overhead
        bench_recording_rows(results, args.layout, tmp, repeat, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, args.samples)


# ---------------------------------------------------------------------------------------------
# 5. sample-aligned .tgz: one gzip member with flush points, against a gzip member per sample
# ---------------------------------------------------------------------------------------------


def _text_samples(n: int) -> list[dict]:
    import random

    rng = random.Random(5)
    words = [
        "a", "photo", "of", "the", "small", "red", "dog", "on", "grass", "near", "house",
        "with", "blue", "sky", "and", "trees", "in", "background", "city", "street", "at",
        "night", "people", "walking", "car", "parked", "beside", "river", "mountain", "snow",
    ]  # fmt: skip
    out = []
    for i in range(n):
        caps = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) for _ in range(6)]
        meta = {"id": i, "captions": caps, "source": "synthetic", "lang": "en"}
        out.append(
            {
                "__key__": f"t{i:08d}",
                "json": json.dumps(meta).encode(),
                "txt": caps[0].encode(),
            }
        )
    return out


def _aligned_sets(name: str, samples: list, per_shard: int, tmp: str) -> dict:
    from tarshards import ShardWriter
    from tarshards.format.manifest import build_manifest
    from tarshards.testing import write_member_per_sample_gzip

    new_dir = os.path.join(tmp, f"{name}-new")
    old_dir = os.path.join(tmp, f"{name}-old")
    os.makedirs(old_dir)
    with ShardWriter(
        os.path.join(new_dir, "part-%04d.tgz"),
        maxcount=per_shard,
        encoder=False,
        aligned=True,
        manifest=os.path.join(new_dir, "m.json"),
    ) as w:
        for sample in samples:
            w.write(sample)
    old_urls = []
    for j in range(0, len(samples), per_shard):
        path = os.path.join(old_dir, f"part-{j // per_shard:04d}.tgz")
        write_member_per_sample_gzip(path, samples[j : j + per_shard])
        old_urls.append(path)
    build_manifest(old_urls, os.path.join(old_dir, "m.json"), workers=1)
    return {
        "new": os.path.join(new_dir, "m.json"),
        "old": os.path.join(old_dir, "m.json"),
        "new_bytes": sum(os.path.getsize(i.url) for i in w.shards),
        "old_bytes": sum(os.path.getsize(u) for u in old_urls),
    }


def _resume_states(manifest: str, cuts: list[float]) -> tuple[list, object]:
    from tarshards import WebDataset

    def make():
        return WebDataset(manifest, shardshuffle=True, seed=1, readers=8).shuffle(100).batched(32)

    run = make()
    total = len(run)
    steps = sorted({max(1, int(total * c)) for c in cuts})
    states = []
    it = iter(run)
    for i, _ in enumerate(it, 1):
        if i in steps:
            states.append(run.state_dict())
        if i >= steps[-1]:
            break
    del it
    return states, make


def _first_batch_s(make, states) -> float:
    t0 = time.process_time()  # CPU time: one thread, and less noise from a shared machine
    for state in states:
        fresh = make()
        fresh.load_state_dict(state)
        next(iter(fresh))
    return time.process_time() - t0


def bench_aligned_gz(paths, tmp: str, repeat: int, nrandom: int, quick: bool) -> dict:
    import numpy as np

    from tarshards import IndexedDataset
    from tarshards.pipeline.dataset import iter_samples
    from tarshards.plan.epoch import ShardTable

    n = 6000 if quick else 20000
    per_shard = 1500 if quick else 2500
    images = []
    for s in iter_samples(paths):
        images.append({k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"})
        if len(images) >= n:
            break
    out: dict = {"rows": []}
    for name, samples in (("images", images), ("text", _text_samples(n))):
        sets = _aligned_sets(name, samples, per_shard, tmp)
        total = len(samples)
        indices = np.random.default_rng(11).integers(0, total, nrandom).tolist()
        datasets = {k: IndexedDataset(sets[k]) for k in ("new", "old")}
        for ds in datasets.values():  # open every shard once, check they agree
            for j in range(0, total, per_shard):
                ds[j]
        assert all(
            datasets["new"][i]["__key__"] == datasets["old"][i]["__key__"] for i in indices[:50]
        )
        states = {}
        makers = {}
        for k in ("new", "old"):
            states[k], makers[k] = _resume_states(sets[k], [0.3, 0.55, 0.8])
        times: dict = {"ds_new": [], "ds_old": [], "res_new": [], "res_old": [], "res_main": []}
        real_points = ShardTable.seek_points
        for _ in range(repeat):
            for k in ("new", "old"):
                ds = datasets[k]
                t0 = time.process_time()
                for i in indices:
                    ds[i]
                times[f"ds_{k}"].append(time.process_time() - t0)
            times["res_new"].append(_first_batch_s(makers["new"], states["new"]))
            times["res_old"].append(_first_batch_s(makers["old"], states["old"]))
            ShardTable.seek_points = lambda self, shard: None  # type: ignore[method-assign]
            try:  # the old layout as tarshards resumed it before: from each shard's start
                times["res_main"].append(_first_batch_s(makers["old"], states["old"]))
            finally:
                ShardTable.seek_points = real_points  # type: ignore[method-assign]
        row = {"name": name, "samples": total, "nrandom": nrandom, "cuts": len(states["new"])}
        row.update({k: min(v) for k, v in times.items()})
        row.update(new_bytes=sets["new_bytes"], old_bytes=sets["old_bytes"])
        out["rows"].append(row)
    return out


def report_aligned_gz(r: dict) -> None:
    print(
        "\n5. sample-aligned .tgz: one gzip member with flush points (new) vs a member per sample"
    )
    print("   (old); CPU time, best of interleaved rounds, same process, same samples")
    for row in r["rows"]:
        size = row["new_bytes"] / row["old_bytes"]
        per = 1e6 / row["nrandom"]
        print(f"   {row['name']} ({row['samples']} samples)")
        print(
            f"     file size             new {row['new_bytes'] / 1e6:8.2f} MB   old "
            f"{row['old_bytes'] / 1e6:8.2f} MB   new/old {size:.4f} (target within 2 %)"
        )
        print(
            f"     ds[i] (x{row['nrandom']})         new {row['ds_new'] * per:8.1f} us   old "
            f"{row['ds_old'] * per:8.1f} us   old/new {row['ds_old'] / row['ds_new']:.2f}x "
            "(target >= 1)"
        )
        print(
            f"     resume, first batch   new {row['res_new'] * 1e3:8.1f} ms   old "
            f"{row['res_old'] * 1e3:8.1f} ms   old/new {row['res_old'] / row['res_new']:.2f}x "
            f"(sum of {row['cuts']} cuts; target >= 1)"
        )
        print(
            f"     old, from shard start {row['res_main'] * 1e3:8.1f} ms   (before: no seek in "
            f"compressed shards)   {row['res_main'] / row['res_new']:.2f}x new"
        )


# Section 3 runs in this many fresh processes per row, their rounds pooled: on the 2-core VM of
# bench/RESULTS.md a process now and then runs every recorded round 10-15 % slower than its plain
# rounds for its whole life while the next one does not (perf: the writing thread's page
# allocations, whose pages the hypervisor had taken back, cost more), so one process's median
# says more about that process than about recording.
RECORDING_PROCESSES = 3


def recording_samples(paths, quick: bool, values: bool) -> list:
    from tarshards.pipeline.dataset import iter_samples

    n = 8000 if quick else 20000
    samples = []
    for s in iter_samples(paths):
        samples.append({k: v for k, v in s.items() if k != "__url__"})
        if len(samples) >= n:
            break
    return as_values(samples) if values else samples


def bench_recording_rows(results: dict, layout: str, tmp: str, repeat: int, quick: bool) -> None:
    runs: dict = {"recording": [], "recording_values": []}
    for _ in range(RECORDING_PROCESSES):
        for key in runs:  # the rows alternate, each in a process of its own
            cmd = [sys.executable, os.path.abspath(__file__), "--recording-child", key]
            cmd += ["--repeat", str(2 * repeat + 3), "--tmp", tmp, "--layout", layout]
            cmd += ["--quick"] if quick else []
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[key].append(json.loads(done.stdout.splitlines()[-1]))
    for key, got in runs.items():
        results[key] = pooled_recording(got)


def recording_child(kind: str, layout: str, repeat: int, tmp: str, quick: bool) -> None:
    """One process's interleaved rounds of a section-3 row, as JSON on stdout."""
    import common

    paths = common.make_dataset(layout, quick=quick)
    samples = recording_samples(paths, quick, values=kind == "recording_values")
    out = bench_recording(samples, tmp, repeat, encoder=kind == "recording_values")
    print(json.dumps(out))


def report(r: dict, nrandom: int) -> None:
    print(
        f"# bench_index ({r['layout']}{', quick' if r['quick'] else ''}; "
        f"{r['machine'].get('cpu', '')}; load average {os.getloadavg()[0]:.1f})"
    )
    if "index" in r:
        report_index(r, nrandom)
    report_recording(r)
    for big in r.get("big", []):
        report_big(big)
    print("\n(interleaved rounds; figures from a loaded machine are noisy, ratios matter)")


def report_index(r: dict, nrandom: int) -> None:
    i = r["index"]
    mb = i["bytes"] / 1e6
    cat, ix, par = mb / i["cat_s"], mb / i["index_s"], mb / i["index_parallel_s"]
    print(f"\n1. indexing {mb:.0f} MB of plain shards (page cache), hashing on")
    print(f"   cat FILES > /dev/null            {cat:8.0f} MB/s")
    print(
        f"   tarshards index -p 1             {ix:8.0f} MB/s   {ix / cat:.2f}x cat (target >= 0.5)"
    )
    print(
        f"   tarshards index -p {i['ncpu']:<2d}            {par:8.0f} MB/s   {par / cat:.2f}x cat"
    )
    print(
        f"   start-up of the command          {i['startup_s'] * 1e3:8.0f} ms     "
        "(tarshards index -p 1 on a one-member shard)"
    )
    work = i["index_s"] - i["startup_s"]
    if work > 0.1 * i["index_s"]:  # else the start-up's noise is larger than the work
        net = mb / work
        print(f"   tarshards index -p 1, less start-up {net:5.0f} MB/s   {net / cat:.2f}x cat")
    else:
        print("   tarshards index -p 1, less start-up    n/a (the start-up varies more than that)")
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


def report_recording(r: dict) -> None:
    for key, label in (
        ("recording", "raw bytes fields, encoder=False"),
        ("recording_values", "values: cls an int, json a dict, encoder on"),
    ):
        rec = r.get(key)
        if rec is None:
            continue
        n = rec["samples"]
        print(
            f"\n3. ShardWriter, {n} samples in 4 shards, {label} (medians of the rounds of "
            f"{rec['processes']} processes)"
        )
        for clock, what in (
            ("wall", "samples/s, wall clock (close() included)"),
            ("thread", "samples per CPU s of the writing thread"),
            ("process", "samples per CPU s of the process (all threads)"),
        ):
            a, b = n / rec[f"plain_{clock}_s"], n / rec[f"manifest_{clock}_s"]
            target = " (target <= 5%)" if clock == "wall" else ""
            print(
                f"   {what:<48s} {a:8.0f} without, {b:8.0f} with manifest=PATH: "
                f"{100 * (a / b - 1):.1f}% slower{target}"
            )
        each = ", ".join(f"{100 * (x - 1):.1f}%" for x in rec["per_process"])
        print(f"   each process's own median (wall clock): {each}")
        print(
            f"   page faults of the writing thread, a run       {rec['plain_thread_faults']:8.0f} "
            f"without, {rec['manifest_thread_faults']:8.0f} with manifest=PATH"
        )


def report_big(b: dict) -> None:
    mb = b["bytes"] / 1e6
    cat = mb / b["cat"]
    ncpu = os.cpu_count() or 1
    print(f"\n4. tarshards index SPEC -o M on {mb:.0f} MB ({b['shards']} plain shards, page cache)")
    print(f"   cat FILES > /dev/null            {cat:8.0f} MB/s")
    from tarshards.format.hashing import HASHING_RELEASES_GIL

    default = f"-p {min(ncpu, b['shards'])}" if HASHING_RELEASES_GIL else "-p 1"
    for key, label in (("default", f"(default: {default})"), ("p1", "-p 1")):
        v = mb / b[key]
        print(f"   tarshards index {label:<16s} {v:8.0f} MB/s   {v / cat:.2f}x cat (target >= 0.5)")
    print(
        f"   start-up of the command          {b['startup'] * 1e3:8.0f} ms     "
        "(tarshards index -p 1 on a one-member shard)"
    )
    for key, label in (("default", "default"), ("p1", "-p 1")):
        work = b[key] - b["startup"]
        if work > 0.1 * b[key]:  # else the start-up's noise is larger than the work
            v = mb / work
            print(f"   {label + ', less start-up':<32s} {v:8.0f} MB/s   {v / cat:.2f}x cat")
    print(f"   (hashing: {_hashing_note()})")


def _hashing_note() -> str:
    from tarshards.format import hashing

    if hashing.HASHING_RELEASES_GIL:
        return "tarshards._xxh3 over libxxhash, without the GIL; -p N runs threads"
    return "the xxhash package (holds the GIL); -p N runs processes"


if __name__ == "__main__":
    main()
