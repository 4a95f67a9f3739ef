"""One streaming GET of an HTTP(S) object from a byte offset on (the stream under a
:class:`~tarshards.storage.retry.ResumingReader` for ``http(s)://`` URLs)."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from ..errors import StorageError
from .retry import read_to_end

__all__ = ["HTTPStream"]

_EOF: Any = object()


class HTTPStream:
    """One streaming GET of ``url`` from byte ``offset`` on, through fsspec's aiohttp session.

    fsspec's own ``HTTPFile`` fetches a file as a series of range requests (one per block) and
    ``HTTPStreamFile`` makes a round trip to the event loop for every read; here a task on
    fsspec's event loop reads the response ahead (at most ``prefetch`` bytes) into a queue that
    :meth:`read` takes from, so network and parsing overlap and a shard costs one request.
    ``stop`` asks for the bytes before it only; a range of at most ``prefetch`` bytes (one
    sample, for random access) is fetched whole in one round trip to the event loop.
    ``size`` is the whole object's size when the server says it (``Content-Range`` or
    ``Content-Length``), else ``None``.
    """

    def __init__(
        self,
        fs,
        url: str,
        offset: int = 0,
        *,
        stop: int | None = None,
        prefetch: int = 8 << 20,
        timeout: float | None = 60.0,
    ):
        import asyncio

        from fsspec.asyn import sync

        self._sync = sync
        self.loop = fs.loop
        self.url = url
        self.r: Any = None
        self._task: Any = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = b""
        self._done = False
        self._lock = threading.Lock()
        self._inflight = 0
        self._waiting = False
        self._prefetch = prefetch
        session = sync(fs.loop, fs.set_session)
        kwargs = dict(fs.kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        if offset or stop is not None:
            headers["Range"] = f"bytes={offset}-{'' if stop is None else max(stop - 1, offset)}"
        if timeout is not None and "timeout" not in kwargs:
            import aiohttp

            # a server that stops answering becomes a (retried) error instead of a hang
            kwargs["timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=timeout, sock_read=timeout
            )
        target = fs.encode_url(url)

        if stop is not None and stop - offset <= prefetch:

            async def fetch():
                r = await session.get(target, headers=headers, **kwargs)
                try:
                    size = self._check(r, offset)
                    data = await r.read()
                finally:
                    r.release()
                if r.status == 200:  # the server ignored the Range header
                    data = data[offset:stop]
                return size, data

            self.size, self._pending = sync(self.loop, fetch)
            self._done = True
            return

        async def start():
            return await session.get(target, headers=headers, **kwargs)

        self.r = sync(self.loop, start)
        try:
            self.size = self._check(self.r, offset)

            async def start_pump():
                self._room = asyncio.Event()
                return asyncio.ensure_future(self._pump())

            self._task = sync(self.loop, start_pump)
            skip = offset if (offset and self.r.status == 200) else 0
            while skip:  # the server ignored the Range header: drop what we already have
                data = self.read(min(skip, 1 << 20))
                if not data:
                    raise EOFError(f"the response ended before byte {offset}")
                skip -= len(data)
        except BaseException:
            self.close()
            raise

    def _check(self, r, offset: int) -> int | None:
        status = r.status
        if status == 404 or status == 410:
            raise FileNotFoundError(f"HTTP {status}: {self.url}")
        if status in (401, 403):
            raise PermissionError(f"HTTP {status}: {self.url}")
        if status == 429 or status >= 500:
            raise ConnectionError(f"HTTP {status} from the server")
        if status == 416:
            raise StorageError(
                f"HTTP 416: range from byte {offset} not satisfiable", url=self.url, offset=offset
            )
        if status >= 400 or status not in (200, 206):
            raise StorageError(f"HTTP {status} {r.reason}", url=self.url, offset=offset)
        if r.headers.get("Content-Encoding", "identity") not in ("identity", ""):
            return None  # the length on the wire is not the length we read
        if status == 206:
            total = r.headers.get("Content-Range", "").rpartition("/")[2]
            return int(total) if total.isdigit() else None
        length = r.headers.get("Content-Length", "")
        return int(length) if length.isdigit() else None

    async def _pump(self):
        """On the event loop: move the body into the queue, at most ``prefetch`` bytes ahead."""
        import asyncio

        content = self.r.content
        put = self._queue.put
        try:
            while True:
                data = await content.read(1 << 20)
                if not data:
                    put(_EOF)
                    return
                with self._lock:
                    self._inflight += len(data)
                    full = self._waiting = self._inflight >= self._prefetch
                if full:
                    self._room.clear()
                put(data)
                if full:
                    await self._room.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # aiohttp refuses to hand out what it had buffered once the connection failed;
            # pass those bytes on too (they are good), then the error
            salvage = getattr(content, "_read_nowait", None)
            with contextlib.suppress(Exception):
                data = salvage(-1) if salvage is not None else b""
                if data:
                    put(data)
            put(exc)

    def _taken(self, n: int) -> None:
        with self._lock:
            self._inflight -= n
            wake = self._waiting and self._inflight < self._prefetch // 2
            if wake:
                self._waiting = False
        if wake:
            self.loop.call_soon_threadsafe(self._room.set)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return read_to_end(self.read)
        if not self._pending:
            if self._done or n == 0:
                return b""
            item = self._queue.get()
            if item is _EOF:
                self._done = True
                return b""
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._taken(len(item))
            self._pending = item
        data = self._pending
        if len(data) <= n:
            self._pending = b""
            return data
        self._pending = data[n:]
        return data[:n]

    def close(self) -> None:
        r, self.r = self.r, None
        task, self._task = self._task, None
        self._done = True
        if r is not None:

            async def close():
                if task is not None:
                    task.cancel()
                r.close()  # drops the connection (never drains the rest of the body)

            with contextlib.suppress(Exception):
                self._sync(self.loop, close, timeout=5)
