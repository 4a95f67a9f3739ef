"""Remote reading speed: a local HTTP server vs local disk, and a second epoch through the cache.

    .venv/bin/python bench/bench_remote.py [--shards 8] [--per-shard 400] [--kb 100]

Writes shards of random (incompressible) payloads to a temp dir, serves them on 127.0.0.1 with
the test server (tests/integration/servers.py: threads, sendfile; in a process of its own, as a
real server would be, unless ``--in-process-server``) and reads every sample
(no decoding) with ``WebDataset``:

1. local disk (warm page cache)
2. HTTP (one streaming GET per shard)
3. HTTP through ``cache_dir``: first epoch (fills the cache), second epoch (reads the cache)
4. fsspec's own HTTP file (range requests of ``block_size``), for comparison

Targets: HTTP >= 50% of local disk MB/s; the second cached epoch at local-disk speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from tarshards import TarWriter, WebDataset  # noqa: E402
from tarshards.pipeline.dataset import iter_samples  # noqa: E402


def _servers():
    path = os.path.join(HERE, "..", "tests", "integration", "servers.py")
    spec = importlib.util.spec_from_file_location("tarshards_test_servers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _serve(root, conn):
    """Child process: serve ``root`` until told to stop, then report the GET count."""
    servers = _servers()
    with servers.HTTPFileServer(root) as srv:
        conn.send(srv.url)
        conn.recv()
        conn.send(srv.gets())


class ChildServer:
    """The test HTTP server in a process of its own (as a real server is: it does not share
    the reader's interpreter lock). ``.url``; ``.gets()`` once stopped."""

    def __init__(self, root):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(root, child), daemon=True)
        self._gets = None

    def __enter__(self):
        self._proc.start()
        self.url = self._conn.recv()
        return self

    def stop(self):
        if self._gets is None:
            self._conn.send("stop")
            self._gets = self._conn.recv()
            self._proc.join(10)

    def gets(self):
        self.stop()
        return self._gets

    def __exit__(self, *exc):
        self.stop()


def make_shards(root, nshards, per_shard, kb):
    rng = np.random.default_rng(0)
    paths = []
    for s in range(nshards):
        p = os.path.join(root, f"shard-{s:04d}.tar")
        with TarWriter(p) as w:
            for i in range(per_shard):
                w.write(
                    {
                        "__key__": f"s{s:04d}_{i:06d}",
                        "bin": rng.bytes(kb * 1024),
                        "cls": str(i % 10).encode(),
                    }
                )
        paths.append(p)
    return paths


def timed(samples, nbytes):
    t = time.perf_counter()
    n = 0
    for s in samples:
        n += 1
    dt = time.perf_counter() - t
    return n, nbytes / dt / 1e6, dt


def fsspec_ranges(urls, block_size):
    """Samples read through fsspec's HTTPFile (range requests), for comparison."""
    import fsspec

    def opener(url):
        return fsspec.open(url, "rb", block_size=block_size)

    return iter_samples(urls, opener=opener)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=400)
    ap.add_argument("--kb", type=int, default=100, help="payload per sample (KiB)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    ap.add_argument(
        "--in-process-server",
        action="store_true",
        help="run the HTTP server in this process (shares the reader's GIL)",
    )
    args = ap.parse_args()
    servers = _servers()
    root = tempfile.mkdtemp(prefix="bench-remote-")
    try:
        paths = make_shards(root, args.shards, args.per_shard, args.kb)
        total = sum(os.path.getsize(p) for p in paths)
        print(
            f"{args.shards} shards, {total / 1e6:.0f} MB, {args.shards * args.per_shard} "
            f"samples of {args.kb} KiB"
        )
        results = {}

        def best(name, make):
            runs = [timed(make(), total) for _ in range(args.repeat)]
            n, mbs, dt = max(runs, key=lambda r: r[1])
            results[name] = mbs
            print(f"  {name:<34} {mbs:8.0f} MB/s  ({n} samples, best {dt:.2f}s)")

        best("local disk", lambda: WebDataset(paths, shardshuffle=False))
        server = servers.HTTPFileServer if args.in_process_server else ChildServer
        print(f"  server: {'in this process' if args.in_process_server else 'own process'}")
        with server(root) as srv:
            urls = [f"{srv.url}/{os.path.basename(p)}" for p in paths]
            best("http (streaming GET)", lambda: WebDataset(urls, shardshuffle=False))
            best("http (fsspec ranges, 5 MiB blocks)", lambda: fsspec_ranges(urls, 5 << 20))
            cache = os.path.join(root, "cache")
            for epoch in (1, 2):
                r = timed(WebDataset(urls, shardshuffle=False, cache_dir=cache), total)
                results[f"cache epoch {epoch}"] = r[1]
                print(
                    f"  {'http + cache, epoch ' + str(epoch):<34} {r[1]:8.0f} MB/s  "
                    f"({r[0]} samples, {r[2]:.2f}s)"
                )
            best("local disk (again)", lambda: WebDataset(paths, shardshuffle=False))
            best(
                "http + cache, later epochs",
                lambda: WebDataset(urls, shardshuffle=False, cache_dir=cache),
            )
            print(f"  GET requests to the server: {srv.gets()}")
        disk = results["local disk"]
        print(f"http / disk: {results['http (streaming GET)'] / disk:.0%} (target >= 50%)")
        print(
            f"cached epoch / disk: {results['http + cache, later epochs'] / disk:.0%} "
            "(target ~100%)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
