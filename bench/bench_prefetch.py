"""Remote prefetch: shards read ahead vs one at a time, behind a proxy that acts far away.

    .venv/bin/python bench/bench_prefetch.py [--shards 16] [--per-shard 100] [--kb 100]
        [--latency 0.03] [--rate 50] [--ahead 1 3 5] [--s3/--no-s3]

Shards of random (incompressible) 100 KiB samples are served on 127.0.0.1 by the test HTTP
server (in a process of its own) and, with ``--s3``, by moto's S3 server; a TCP proxy in a
third process adds ``--latency`` seconds to every request and caps every connection at
``--rate`` MB/s (tests/integration/servers.py ``ThrottlingProxy``). Every sample is read (no
decoding) with ``WebDataset(urls, prefetch=k)``.

Figures: samples/s and MB/s for each ``k``, the ratio to ``k = 0`` (target >= 3x), and the
ratio to what the proxy lets through on the connections used, ``(k + 1) * rate`` (target >=
0.8). Memory is bounded by ``prefetch_bytes`` (printed).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from bench_remote import ChildServer, _servers, make_shards  # noqa: E402

from tarshards import WebDataset  # noqa: E402


class ChildProxy:
    """The throttling proxy in a process of its own."""

    def __init__(self, target, latency, rate):
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        servers = _servers()
        self._proc = ctx.Process(
            target=servers.serve_throttling_proxy, args=(target, latency, rate, child), daemon=True
        )
        self.stats = None

    def __enter__(self):
        self._proc.start()
        self.url = self._conn.recv()
        return self

    def __exit__(self, *exc):
        self._conn.send("stop")
        self.stats = self._conn.recv()
        self._proc.join(10)


def _serve_moto(conn):
    servers = _servers()
    started = servers.start_moto()
    conn.send(None if started is None else started[1])
    if started is not None:
        conn.recv()
        started[0].stop()


class ChildMoto:
    """moto's S3 server in a process of its own (as a real store does not share our GIL)."""

    def __enter__(self):
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_moto, args=(child,), daemon=True)
        self._proc.start()
        self.endpoint = self._conn.recv()
        return self

    def __exit__(self, *exc):
        if self.endpoint is not None:
            self._conn.send("stop")
        self._proc.join(10)


def run(urls, total_bytes, ahead, prefetch_bytes, storage_options=None):
    ds = WebDataset(
        urls,
        shardshuffle=False,
        prefetch=ahead,
        prefetch_bytes=prefetch_bytes,
        storage_options=storage_options,
    )
    t = time.perf_counter()
    n = sum(1 for _ in ds)
    dt = time.perf_counter() - t
    return n, n / dt, total_bytes / dt / 1e6


def table(name, urls, total, args, storage_options=None):
    rate_mbs = args.rate
    print(
        f"{name}: latency {args.latency * 1000:.0f} ms/request, {rate_mbs:.0f} MB/s per "
        f"connection, prefetch_bytes {args.prefetch_mib} MiB"
    )
    base = None
    rows = []
    for ahead in [0] + list(args.ahead):
        runs = [
            run(urls, total, ahead, args.prefetch_mib << 20, storage_options)
            for _ in range(args.repeat)
        ]
        runs.sort(key=lambda r: r[1])
        _n, sps, mbs = runs[len(runs) // 2]  # median
        base = base or sps
        cap = (ahead + 1) * rate_mbs
        rows.append((ahead, sps, mbs, sps / base, mbs / cap))
        print(
            f"  prefetch={ahead}: {sps:8.0f} samples/s {mbs:7.0f} MB/s  "
            f"x{sps / base:4.2f} of no prefetch  {mbs / cap:4.0%} of {cap:.0f} MB/s "
            f"({ahead + 1} connections)"
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--kb", type=int, default=100)
    ap.add_argument("--latency", type=float, default=0.03)
    ap.add_argument("--rate", type=float, default=50.0, help="MB/s per connection")
    ap.add_argument("--ahead", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--prefetch-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-prefetch-")
    try:
        paths = make_shards(root, args.shards, args.per_shard, args.kb)
        total = sum(os.path.getsize(p) for p in paths)
        print(
            f"{args.shards} shards, {total / 1e6:.0f} MB, {args.shards * args.per_shard} "
            f"samples of {args.kb} KiB"
        )
        with ChildServer(root) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            with ChildProxy(("127.0.0.1", port), args.latency, args.rate * 1e6) as proxy:
                urls = [f"{proxy.url}/{os.path.basename(p)}" for p in paths]
                table("HTTP", urls, total, args)
            print(f"  proxy: {proxy.stats[0]} connections, at most {proxy.stats[1]} at once")
        if args.s3:
            servers = _servers()
            with ChildMoto() as moto:
                if moto.endpoint is None:
                    print("S3: moto is not installed; skipped")
                    return
                import fsspec

                servers.make_s3_bucket(moto.endpoint, "bench")
                fs = fsspec.filesystem("s3", **servers.s3_options(moto.endpoint))
                for p in paths:
                    fs.put(p, f"bench/{os.path.basename(p)}")
                port = int(moto.endpoint.rsplit(":", 1)[1])
                with ChildProxy(("127.0.0.1", port), args.latency, args.rate * 1e6) as proxy:
                    options = servers.s3_options(proxy.url)
                    urls = [f"s3://bench/{os.path.basename(p)}" for p in paths]
                    table("S3 (moto)", urls, total, args, options)
                print(f"  proxy: {proxy.stats[0]} connections, at most {proxy.stats[1]} at once")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
