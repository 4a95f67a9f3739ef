"""Real servers on 127.0.0.1 for the remote-storage tests and benchmarks.

* :class:`HTTPFileServer`: serves a directory over HTTP/1.1 (threads, keep-alive, ``Range``,
  ``HEAD``, ``sendfile``), counts the requests per path and can slow its responses down.
* :class:`CuttingProxy`: a TCP proxy that resets the connection after ``cut_after`` bytes, the
  first ``cuts`` times.
* :func:`start_moto` / :func:`start_gcs`: ``moto`` in server mode (S3) and
  ``gcp-storage-emulator`` (GCS); they return ``None`` when the package is missing.

Importable by path (``importlib``) from tests and from ``bench/`` alike; nothing here is pytest
specific.
"""

from __future__ import annotations

import collections
import http.server
import os
import socket
import socketserver
import struct
import threading
import time


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tarshards-test"

    def log_message(self, format, *args):  # quiet
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body: bool):
        srv = self.server.owner
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = os.path.realpath(os.path.join(srv.root, rel))
        range_header = self.headers.get("Range")
        srv._record(self.command, "/" + rel, range_header)
        if not path.startswith(os.path.realpath(srv.root) + os.sep) or not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        start, end = 0, size  # [start, end)
        status = 200
        if range_header and range_header.startswith("bytes="):
            first, _, last = range_header[6:].partition("-")
            try:
                if first:
                    start = int(first)
                    end = min(size, int(last) + 1) if last else size
                else:  # suffix range
                    start = max(0, size - int(last))
            except ValueError:
                start, end = 0, size
            else:
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        srv._sent("/" + rel, end - start)
        try:
            with open(path, "rb") as f:
                stall_at = srv._take_stall("/" + rel, start, end)
                if stall_at is not None:  # send up to there, then go silent
                    self.connection.sendfile(f, start, stall_at - start)
                    srv._stall_released.wait(srv.stall_for)
                    self.close_connection = True
                    return
                if srv.delay:
                    f.seek(start)
                    left = end - start
                    while left:
                        data = f.read(min(left, srv.chunk))
                        self.wfile.write(data)
                        left -= len(data)
                        time.sleep(srv.delay)
                else:
                    self.connection.sendfile(f, start, end - start)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class _ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class HTTPFileServer:
    """Serve ``root`` on ``http://127.0.0.1:<port>/``; a context manager.

    ``delay``: seconds slept after each ``chunk`` bytes of a body (0: full speed via sendfile).
    ``requests``: the list of ``(method, path, range header)`` received.
    ``stall``: ``{path: offset}``: the first GET of ``path`` whose body crosses ``offset`` sends
    the bytes before it, then nothing for ``stall_for`` seconds (or until the server stops),
    as a hung connection does; later GETs are served whole. ``stalled`` lists the
    ``(path, offset)`` stalls made.
    """

    def __init__(
        self,
        root,
        *,
        delay: float = 0.0,
        chunk: int = 64 << 10,
        stall: dict | None = None,
        stall_for: float = 60.0,
    ):
        self.root = os.fspath(root)
        self.delay = delay
        self.chunk = chunk
        self.stall = dict(stall or {})
        self.stall_for = stall_for
        self.stalled: list[tuple[str, int]] = []
        self._stall_released = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []
        self.sent: dict[str, int] = {}  # path -> body bytes served
        self._lock = threading.Lock()
        self._httpd = _ThreadingServer(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, daemon=True, kwargs={"poll_interval": 0.05}
        )

    def _take_stall(self, path: str, start: int, end: int) -> int | None:
        with self._lock:
            at = self.stall.get(path)
            if at is None or not start < at < end:
                return None
            del self.stall[path]
            self.stalled.append((path, at))
            return at

    def _record(self, method, path, rng):
        with self._lock:
            self.requests.append((method, path, rng))

    def _sent(self, path: str, n: int) -> None:
        with self._lock:
            self.sent[path] = self.sent.get(path, 0) + n

    def bytes_sent(self, path: str | None = None) -> int:
        """Body bytes served (for ``path``, e.g. ``"/a/shard-0000.tar"``)."""
        with self._lock:
            return sum(n for p, n in self.sent.items() if path is None or p == path)

    def gets(self, path: str | None = None) -> int:
        """GET requests received (for ``path``, e.g. ``"/a/shard-0000.tar"``)."""
        with self._lock:
            return sum(1 for m, p, _ in self.requests if m == "GET" and (path is None or p == path))

    def get_counts(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(p for m, p, _ in self.requests if m == "GET")

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.sent.clear()

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stall_released.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class CuttingProxy:
    """A TCP proxy to ``target`` (host, port) that resets connections after ``cut_after`` bytes.

    The first ``cuts`` connections that carry more than their limit from the server to the client
    are reset (RST) at that point; later ones pass through. ``cut_after`` is one limit for all,
    or a list: the i-th connection gets ``cut_after[i]`` (the last one repeats), so ``[50_000, 0]``
    lets one connection make progress and cuts every later one before its first byte.
    ``cut_count`` says how many were cut. ``pause`` seconds pass between sending the bytes up to a
    cut and the reset, so that a client has taken them in before the error reaches it (some
    clients, aiohttp among them, drop what they have buffered once the connection fails).
    """

    def __init__(self, target: tuple[str, int], *, cut_after, cuts: int, pause: float = 0.0):
        self.target = target
        self.pause = pause
        self.cut_after = list(cut_after) if isinstance(cut_after, (list, tuple)) else [cut_after]
        self.cuts_left = cuts
        self.cut_count = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop = True
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            pass
        self._thread.join(2)
        self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _accept(self):
        while True:
            client, _ = self._sock.accept()
            if self._stop:
                client.close()
                return
            with self._lock:
                limit = self.cut_after[min(self.connections, len(self.cut_after) - 1)]
                self.connections += 1
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, limit), daemon=True).start()

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cuts_left > 0:
                self.cuts_left -= 1
                self.cut_count += 1
                return True
            return False

    def _pipe(self, src, dst, limit):
        sent = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if limit is not None and sent + len(data) > limit and self._take_cut():
                    dst.sendall(data[: limit - sent])
                    if self.pause:
                        time.sleep(self.pause)
                    for s in (dst, src):  # reset, as a dropped connection does
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        try:  # wakes the thread blocked in recv on the other direction
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                        s.close()
                    return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def start_moto():
    """moto's S3 in server mode on 127.0.0.1: returns ``(server, endpoint_url)`` or ``None``."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def s3_options(endpoint: str) -> dict:
    return {
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "key": "x",
        "secret": "x",
    }


def make_s3_bucket(endpoint: str, bucket: str) -> None:
    """A plain ``create_bucket`` (no location constraint), which moto's server mode wants."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)


def start_gcs(bucket: str):
    """gcp-storage-emulator on 127.0.0.1 with ``bucket``: ``(server, endpoint_url)`` or ``None``.

    gcsfs needs ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` in the environment against the
    emulator (else the first access waits 60 s); the caller sets it.
    """
    try:
        from gcp_storage_emulator.server import create_server
    except ImportError:
        return None
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    server.start()
    port = server._api._httpd.server_address[1]
    return server, f"http://127.0.0.1:{port}"


def gcs_options(endpoint: str) -> dict:
    return {"token": "anon", "endpoint_url": endpoint}


class ThrottlingProxy:
    """A TCP proxy to ``target`` that behaves like a far-away object store.

    Each request (each burst of bytes from the client) waits ``latency`` seconds before it is
    passed on, and each connection's responses are capped at ``rate`` bytes per second.
    ``connections`` counts the connections accepted; ``peak`` the most open at once. It runs
    on an asyncio loop in a thread of its own; benchmarks run it in a process of its own
    (:func:`serve_throttling_proxy`) so that it does not share the reader's interpreter lock.
    """

    def __init__(self, target: tuple[str, int], *, latency: float = 0.03, rate: float = 50e6):
        import asyncio

        self.target = target
        self.latency = latency
        self.rate = rate
        self.connections = 0
        self.open = 0
        self.peak = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = None
        self.url = None

    def _run(self):
        import asyncio

        asyncio.set_event_loop(self._loop)

        async def start():
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            self._server = server
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _handle(self, creader, cwriter):
        import asyncio

        self.connections += 1
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            ureader, uwriter = await asyncio.open_connection(*self.target)
        except OSError:
            cwriter.close()
            self.open -= 1
            return

        async def upstream():  # requests: each one delayed by the latency
            try:
                while True:
                    data = await creader.read(1 << 16)
                    if not data:
                        break
                    await asyncio.sleep(self.latency)
                    uwriter.write(data)
                    await uwriter.drain()
            except OSError:
                pass
            finally:
                uwriter.close()

        async def downstream():  # responses: at most `rate` bytes/s on this connection
            loop = asyncio.get_running_loop()
            start = loop.time()
            sent = 0
            try:
                while True:
                    data = await ureader.read(1 << 16)
                    if not data:
                        break
                    now = loop.time()
                    if now - start > 1.0 and sent < self.rate * (now - start) - self.rate:
                        start, sent = now, 0  # an idle gap is not saved up as credit
                    sent += len(data)
                    ahead = sent / self.rate - (loop.time() - start)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                    cwriter.write(data)
                    await cwriter.drain()
            except OSError:
                pass
            finally:
                cwriter.close()

        try:
            await asyncio.gather(upstream(), downstream())
        finally:
            self.open -= 1

    def start(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self):
        async def close():
            self._server.close()

        import asyncio

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve_throttling_proxy(target, latency, rate, conn):
    """Process entry point: run a :class:`ThrottlingProxy`, send its URL, stop when told,
    then send ``(connections, peak)``."""
    with ThrottlingProxy(tuple(target), latency=latency, rate=rate) as proxy:
        conn.send(proxy.url)
        conn.recv()
        conn.send((proxy.connections, proxy.peak))
