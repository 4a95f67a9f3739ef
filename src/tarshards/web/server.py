"""The browser's HTTP server: the standard library's ``ThreadingHTTPServer``, read-only.

Routes (``GET`` and ``HEAD``; every other method is answered 405)::

    /                      the grid of samples: ?page=N (from 0) &size=M
    /sample/I              sample I: every field, its size, offsets and checksum
    /goto?i=I              redirects to /sample/I
    /search?q=PREFIX       the samples whose key starts with PREFIX (&page=N)
    /stats                 statistics: from the index, and from a sample of decoded data
    /thumb/I/FIELD         an image field as a JPEG thumbnail (?size=PIXELS, 16..1024)
    /poster/I/FIELD        a video field's poster frame (its middle frame) as a JPEG (?size=)
    /static/NAME           the packaged assets (style.css, favicon.svg), by name only
    /api/info              the data set: samples, shards, fingerprint
    /api/sample/I          sample I as JSON (key, fields with sizes and checksums, shard, offset)
    /api/sample/I/FIELD    the field's raw bytes: audio and video with their media type, inline,
                           and byte ranges (``Range: bytes=A-B``: 206) so a player can seek;
                           other fields as a download
    /api/page?page=N&size=M, /api/search?q=PREFIX&start=S&limit=L, /api/stats

Safety: no request reaches the file system (the assets are read from the package by a fixed
table of names); a path with a ``.``/``..`` segment, a backslash or a NUL, encoded or not (up to
three times), is answered 400. Every answer carries a strict Content-Security-Policy (no scripts,
styles, images and media from this server only, no framing), ``nosniff`` and no referrer. Bound to a
loopback address it answers only requests whose ``Host`` names it (a page elsewhere cannot reach it
through DNS rebinding). Bad input (a sample out of range, an unknown field, a bad number) gets a
4xx with a one-line reason: plain text, or ``{"error": ...}`` under ``/api/``.
"""

from __future__ import annotations

import collections
import http.server
import ipaddress
import json
import socket
import threading
import time
import urllib.parse
import warnings
from importlib import resources
from typing import Any, Callable

from ..errors import MissingDependencyError, TarshardsError, TarshardsWarning
from . import pages
from .data import BadRequest, BrowseData, field_kind, media_type, thumbnail

__all__ = ["BrowseServer", "CSP", "is_loopback", "serve"]

CSP = (
    "default-src 'none'; img-src 'self'; media-src 'self'; style-src 'self'; "
    "form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
)
ASSETS = {  # the packaged files served under /static/, by name (nothing else is)
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
HTML = "text/html; charset=utf-8"
JSON = "application/json"
MAX_PAGE_SIZE = 500
THUMB_SIZE = 192
THUMB_CACHE = 4096  # thumbnails kept (LRU)
RANGE_CHUNK = 8 << 20  # the most bytes one open range (``bytes=A-``) of a field is answered


class _Answer(Exception):
    """An answer other than 200 (raised anywhere in a route)."""

    def __init__(self, status: int, reason: str, headers: tuple = ()):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address to bind) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_path(raw: str) -> None:
    """400 for a path that tries to climb: ``.``/``..`` segments, backslashes, NULs, encoded
    up to three times."""
    text = raw
    for _ in range(4):
        if "\\" in text or "\x00" in text or any(s in (".", "..") for s in text.split("/")):
            raise _Answer(400, "path not allowed (no '.', '..', backslash or NUL segments)")
        decoded = urllib.parse.unquote(text)
        if decoded == text:
            return
        text = decoded
    raise _Answer(400, "path not allowed (percent-encoded more than three times)")


def _int_param(query: dict, name: str, default: int, lo: int, hi: int) -> int:
    text = query.get(name)
    if text is None or text == "":
        return default
    text = text.strip()
    if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 18:
        raise BadRequest(f"bad {name} {text[:40]!r} (an integer)")
    value = int(text)
    if not lo <= value <= hi:
        raise BadRequest(f"{name} {value} out of range ({lo}..{hi})")
    return value


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``(start, end)`` (end exclusive) of a ``Range: bytes=...`` header over ``size`` bytes;
    None where the header is to be ignored (another unit, several ranges, a malformed one: the
    whole answer is sent, as RFC 9110 allows); 416 where the range is not satisfiable."""
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    first, last = first.strip(), last.strip()
    if not dash or not (first or last) or not (first + last).isdigit() or len(first + last) > 36:
        return None
    unsatisfiable = _Answer(
        416,
        f"range {spec.strip()[:60]} not satisfiable ({size} bytes)",
        (("Content-Range", f"bytes */{size}"),),
    )
    if not first:  # the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - n), size
    start = int(first)
    end = size if not last else int(last) + 1
    if last and end <= start:
        return None  # invalid (last < first): ignored
    if start >= size:
        raise unsatisfiable
    return start, min(end, size)


class BrowseApp:
    """Requests to answers: ``answer(path, query) -> (status, content type, body, headers)``
    (no sockets here; :class:`BrowseServer` serves it)."""

    def __init__(self, data: BrowseData, *, page_size: int = 48):
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be 1..{MAX_PAGE_SIZE}, got {page_size}")
        self.data = data
        self.page_size = page_size
        self._thumbs: collections.OrderedDict = collections.OrderedDict()
        self._thumb_lock = threading.Lock()
        self._assets: dict[str, bytes] = {}

    def answer(
        self, raw_path: str, raw_query: str, request_headers=None
    ) -> tuple[int, str, bytes, tuple]:
        """``request_headers`` (a mapping, optional): the request's, for ``Range`` and
        ``If-Range`` on the raw-field route."""
        _check_path(raw_path)
        if not raw_path.startswith("/"):
            raise _Answer(400, "the request target must be a path")
        parts = [urllib.parse.unquote(p) for p in raw_path.split("/")[1:]]
        query = {
            k: v[0] for k, v in urllib.parse.parse_qs(raw_query, keep_blank_values=True).items()
        }
        head, rest = parts[0], parts[1:]
        if head == "api":
            return self._api(rest, query, request_headers or {})
        if head == "" and not rest:
            size = _int_param(query, "size", self.page_size, 1, MAX_PAGE_SIZE)
            return self._html(pages.grid_page(self.data, query.get("page", "0") or "0", size))
        if head == "sample" and len(rest) == 1:
            return self._html(pages.sample_page(self.data, rest[0], self.page_size))
        if head == "goto" and not rest:
            i = self.data.check_index(query.get("i", ""))
            raise _Answer(303, f"see /sample/{i}", (("Location", f"/sample/{i}"),))
        if head == "search" and not rest:
            size = _int_param(query, "size", self.page_size, 1, MAX_PAGE_SIZE)
            page = query.get("page", "0") or "0"
            return self._html(pages.search_page(self.data, query.get("q", ""), page, size))
        if head == "stats" and not rest:
            return self._html(pages.stats_page(self.data))
        if head == "thumb" and len(rest) == 2:
            size = _int_param(query, "size", THUMB_SIZE, 16, 1024)
            return self._thumb(rest[0], rest[1], size)
        if head == "poster" and len(rest) == 2:
            size = _int_param(query, "size", THUMB_SIZE, 16, 1024)
            return self._poster(rest[0], rest[1], size)
        if head == "static" and len(rest) == 1:
            return self._asset(rest[0])
        raise _Answer(404, f"no such page: {raw_path[:100]}")

    # ---- pages -------------------------------------------------------------------------------
    @staticmethod
    def _html(text: str) -> tuple[int, str, bytes, tuple]:
        return 200, HTML, text.encode("utf-8"), (("Cache-Control", "no-store"),)

    def _thumb(self, i: str, name: str, size: int) -> tuple[int, str, bytes, tuple]:
        info = self.data.info(i)
        info.field(name)
        if field_kind(name) != "image":
            raise BadRequest(f"field {name!r} of sample {info.index} is not an image")
        cache_key = (info.index, name, size)
        with self._thumb_lock:
            body = self._thumbs.get(cache_key)
            if body is not None:
                self._thumbs.move_to_end(cache_key)
        if body is None:
            data = self.data.field_bytes(info.index, name, info)
            try:
                body = thumbnail(data, size)
            except ValueError as exc:
                raise _Answer(422, f"field {name!r} of sample {info.index}: {exc}") from None
            with self._thumb_lock:
                self._thumbs[cache_key] = body
                while len(self._thumbs) > THUMB_CACHE:
                    self._thumbs.popitem(last=False)
        return 200, "image/jpeg", body, (("Cache-Control", "private, max-age=600"),)

    def _poster(self, i: str, name: str, size: int) -> tuple[int, str, bytes, tuple]:
        info = self.data.info(i)
        info.field(name)
        if field_kind(name) != "video":
            raise BadRequest(f"field {name!r} of sample {info.index} is not a video")
        cache_key = (info.index, name, size, "poster")
        with self._thumb_lock:
            body = self._thumbs.get(cache_key)
            if body is not None:
                self._thumbs.move_to_end(cache_key)
        if body is None:
            try:
                body = self.data.poster(info.index, name, size, info)
            except MissingDependencyError as exc:
                raise _Answer(501, str(exc)) from None
            except ValueError as exc:
                raise _Answer(422, f"field {name!r} of sample {info.index}: {exc}") from None
            with self._thumb_lock:
                self._thumbs[cache_key] = body
                while len(self._thumbs) > THUMB_CACHE:
                    self._thumbs.popitem(last=False)
        return 200, "image/jpeg", body, (("Cache-Control", "private, max-age=600"),)

    def _raw_field(self, i: str, name: str, req) -> tuple[int, str, bytes, tuple]:
        """The field's bytes: audio and video inline with their media type and byte ranges
        (206), the others as a download (``application/octet-stream``)."""
        data = self.data
        info = data.info(i)
        f = info.field(name)
        filename = "".join(c if c.isalnum() or c in "._-" else "_" for c in f.member)[-200:]
        ctype = media_type(f.name)
        etag = f'"{f.checksum.replace(":", "-")}"'
        headers: tuple = (
            (
                "Content-Disposition",
                f'{"inline" if ctype else "attachment"}; filename="{filename}"',
            ),
            ("Cache-Control", "no-cache"),
            ("Accept-Ranges", "bytes"),
            ("ETag", etag),
        )
        ctype = ctype or "application/octet-stream"
        wanted = req.get("Range")
        if_range = req.get("If-Range")
        span = None
        if wanted is not None and (if_range is None or if_range.strip() == etag):
            span = parse_range(wanted, f.size)
        if span is None:
            return 200, ctype, data.field_bytes(info.index, f.name, info), headers
        start, end = span
        if end - start > RANGE_CHUNK and wanted.strip().endswith("-"):
            end = start + RANGE_CHUNK  # an open range of a large field: a part (the player asks on)
        body = data.field_range(info.index, f.name, start, end, info)
        return 206, ctype, body, (*headers, ("Content-Range", f"bytes {start}-{end - 1}/{f.size}"))

    def _asset(self, name: str) -> tuple[int, str, bytes, tuple]:
        ctype = ASSETS.get(name)
        if ctype is None:
            raise _Answer(404, f"no such asset: {name[:100]}")
        body = self._assets.get(name)
        if body is None:
            body = resources.files(__package__).joinpath("static").joinpath(name).read_bytes()
            self._assets[name] = body
        return 200, ctype, body, (("Cache-Control", "max-age=3600"),)

    # ---- the JSON API ------------------------------------------------------------------------
    def _api(self, rest: list[str], query: dict, request_headers) -> tuple[int, str, bytes, tuple]:
        data = self.data
        obj: Any
        if rest == ["info"]:
            obj = {
                "samples": len(data),
                "shards": data.num_shards,
                "shard_urls": data.urls,
                "fingerprint": (data.manifest if data.view is None else data.view).fingerprint,
                "view": data.view is not None,
                "spec": str(data.spec),
                "page_size": self.page_size,
            }
        elif len(rest) == 2 and rest[0] == "sample":
            obj = data.info(rest[1]).to_json()
        elif len(rest) == 3 and rest[0] == "sample":
            return self._raw_field(rest[1], rest[2], request_headers)
        elif rest == ["page"]:
            size = _int_param(query, "size", self.page_size, 1, MAX_PAGE_SIZE)
            page, pages_, indices = data.page(query.get("page", "0") or "0", size)
            obj = {
                "page": page,
                "pages": pages_,
                "size": size,
                "samples": [data.info(i).to_json() for i in indices],
            }
        elif rest == ["search"]:
            start = _int_param(query, "start", 0, 0, 1 << 62)
            limit = _int_param(query, "limit", self.page_size, 1, MAX_PAGE_SIZE)
            prefix = query.get("q", "")
            total, found = data.search(prefix, start=start, limit=limit)
            obj = {
                "query": prefix,
                "total": total,
                "start": start,
                "indices": found,
                "keys": [data.info(i).key for i in found],
            }
        elif rest == ["stats"]:
            obj = {"index": data.index_stats(), "data": data.data_stats()}
        else:
            raise _Answer(404, "no such API endpoint: /api/" + "/".join(rest)[:100])
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        return 200, JSON, body, (("Cache-Control", "no-store"),)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tarshards-browse"
    sys_version = ""
    timeout = 60  # an idle keep-alive connection is closed after this
    # headers and body leave in one send (unbuffered, they were two: with Nagle's algorithm and
    # the client's delayed ACK, 40 ms a response), and without waiting for ACKs
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    server: "_HTTPServer"

    def do_GET(self) -> None:
        self._handle(body=True)

    def do_HEAD(self) -> None:
        self._handle(body=False)

    def __getattr__(self, name: str) -> Callable[[], None]:
        if name.startswith("do_"):  # any other method: read-only server
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self.close_connection = True  # a request body, if any, is not read
        self._send(
            405,
            "text/plain; charset=utf-8",
            f"method {self.command} not allowed: this server is read-only (GET, HEAD)\n".encode(),
            (("Allow", "GET, HEAD"), ("Connection", "close")),
            body=True,
        )

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """The base class's errors (a malformed request line, a header too long) in the same
        one-line form, with the same headers."""
        self.close_connection = True
        text = (message or self.responses.get(code, ("error",))[0]).splitlines()[0]
        self._send(
            code,
            "text/plain; charset=utf-8",
            f"{text}\n".encode(),
            (("Connection", "close"),),
            body=self.command != "HEAD",
        )

    def _handle(self, body: bool) -> None:
        app = self.server.app
        raw_path, _, raw_query = self.path.partition("?")
        api = raw_path.startswith("/api/")
        t0 = time.perf_counter()
        try:
            self._check_host()
            status, ctype, payload, headers = app.answer(raw_path, raw_query, self.headers)
        except _Answer as a:
            status, ctype, payload, headers = self._error(a.status, a.reason, api, a.headers)
        except BadRequest as exc:
            status, ctype, payload, headers = self._error(exc.status, str(exc), api)
        except TarshardsError as exc:  # the data could not be read: the server's side
            status, ctype, payload, headers = self._error(500, str(exc), api)
        except Exception as exc:  # a bug: one line, not a traceback, to the client
            self.log_error("error answering %s: %r", self.path, exc)
            status, ctype, payload, headers = self._error(
                500, f"internal error: {type(exc).__name__}", api
            )
        # the time the answer took, shown by the browser's developer tools (Server-Timing)
        timing = ("Server-Timing", f"app;dur={(time.perf_counter() - t0) * 1000:.1f}")
        self._send(status, ctype, payload, (*headers, timing), body)

    def _check_host(self) -> None:
        allowed = self.server.allowed_hosts
        if allowed is not None and self.headers.get("Host", "").lower() not in allowed:
            raise _Answer(
                400,
                "unexpected Host header: open this server by its own address "
                f"({self.server.owner.url})",
            )

    @staticmethod
    def _error(status: int, reason: str, api: bool, headers: tuple = ()):
        reason = " ".join(reason.split())[:500]  # one line
        if api:
            return status, JSON, json.dumps({"error": reason}).encode() + b"\n", headers
        return status, "text/plain; charset=utf-8", (reason + "\n").encode(), headers

    def _send(self, status: int, ctype: str, payload: bytes, headers: tuple, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in SECURITY_HEADERS + tuple(headers):
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, fmt: str, *args) -> None:
        log = self.server.owner.log
        if log is not None:
            log(f"{self.address_string()} {fmt % args}")


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    app: BrowseApp
    owner: "BrowseServer"
    allowed_hosts: frozenset | None


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class BrowseServer:
    """The running browser: ``url``, ``close()``, a context manager.

    Made by :func:`serve` (which also starts it in a background thread); ``serve_forever()``
    serves in the calling thread instead (the ``tarshards browse`` command).
    """

    def __init__(
        self,
        data: BrowseData,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        page_size: int = 48,
        log: Callable[[str], None] | None = None,
        close_data: bool = True,
    ):
        self.data = data
        self.app = BrowseApp(data, page_size=page_size)
        self.log = log
        self._close_data = close_data
        cls = _HTTPServer6 if ":" in host.strip("[]") else _HTTPServer
        self._httpd = cls((host.strip("[]"), port), _Handler)
        self._httpd.app = self.app
        self._httpd.owner = self
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self.loopback = is_loopback(host)
        shown = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        shown = f"[{shown.strip('[]')}]" if ":" in shown else shown
        self.url = f"http://{shown}:{self.port}/"
        if self.loopback:
            bare = host.strip("[]")
            names = {"localhost", "127.0.0.1", "[::1]", f"[{bare}]" if ":" in bare else bare}
            self._httpd.allowed_hosts = frozenset(f"{n}:{self.port}" for n in names)
        else:
            self._httpd.allowed_hosts = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> "BrowseServer":
        """Serve in a background (daemon) thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                name="tarshards-browse",
                daemon=True,
            )
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`close` (from another thread) or KeyboardInterrupt."""
        self._httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        """Stop serving, close the socket and the data set (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()
        if self._close_data:
            self.data.close()

    def __enter__(self) -> "BrowseServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BrowseServer({self.url}, {len(self.data)} samples)"


def serve(
    spec,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    page_size: int = 48,
    storage_options: dict | None = None,
    index_dir=None,
    seed: int = 0,
    stats_samples: int = 256,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    start: bool = True,
) -> BrowseServer:
    """Browse ``spec`` (a manifest, or a shard spec, local or remote) in a web browser: a
    :class:`BrowseServer` on ``host:port`` (``port=0``: any free port), serving in a background
    thread (``start=False``: not yet); open its ``url``, and ``close()`` it (or use it as a
    context manager). Shards without an index are indexed first (see
    :class:`~tarshards.web.data.BrowseData`). A ``host`` other than a loopback address makes the
    data set readable by every machine that reaches this one: a warning says so."""
    if not is_loopback(host):
        warnings.warn(
            TarshardsWarning(
                f"binding {host}, not a loopback address: every machine that reaches this one "
                "can read the data set through the browser"
            ),
            stacklevel=2,
        )
    data = BrowseData(
        spec,
        storage_options=storage_options,
        index_dir=index_dir,
        seed=seed,
        stats_samples=stats_samples,
        progress=progress,
    )
    try:
        server = BrowseServer(data, host=host, port=port, page_size=page_size, log=log)
    except BaseException:
        data.close()
        raise
    return server.start() if start else server
