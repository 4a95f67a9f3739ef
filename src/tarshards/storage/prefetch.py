"""Reading the next shards of a reader while the current one is parsed.

Remote storage has a first-byte latency per request and often a bandwidth cap per connection, so
a reader that opens shard n+1 only when shard n ends waits for the latency once per shard and
never uses more than one connection's bandwidth. :class:`ShardPrefetcher` keeps a window of
``ahead`` shards beyond the current one open, each filled from a thread of its own into a bounded
buffer:

* connections: at most ``ahead + 1`` open at once (the current shard and those ahead);
* memory: at most ``max_bytes`` buffered over the whole window (each shard's buffer holds at
  most ``max_bytes // (ahead + 1)``, and a filling thread waits while its buffer is full);
* order and errors are kept: a shard's bytes come out in order, and an error met while
  filling (a missing object, a dropped connection past its retries) is raised by ``read`` at the
  point the bytes stop, exactly as reading the shard directly would raise it.

Threads are stopped and their streams closed when the prefetcher is closed (a context
manager), including when the consumer stops early.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator

__all__ = ["PrefetchedStream", "ShardPrefetcher", "given_stream"]

_CHUNK = 1 << 20
_END: Any = object()


class PrefetchedStream:
    """The bytes of one shard as a thread fills them in (``read`` blocks until there are some)."""

    def __init__(
        self, url: str, opener: Callable[[str], ContextManager], limit: int, chunk: int = _CHUNK
    ):
        self.url = url
        self._opener = opener
        self._limit = max(int(limit), chunk)
        self._chunk = chunk
        self._chunks: collections.deque = collections.deque()
        self._buffered = 0
        self._pending = b""
        self._done = False  # the filler has finished (end of data or error)
        self._error: BaseException | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self.nbytes = 0  # bytes handed out so far
        self.open_ns: int | None = None  # how long the opener took (once it has returned)
        self._thread = threading.Thread(
            target=self._fill, name=f"tarshards-prefetch {url}", daemon=True
        )
        self._thread.start()

    # -- the filling thread ---------------------------------------------------------------------
    def _fill(self) -> None:
        cond = self._cond
        try:
            t0 = time.perf_counter_ns()
            with self._opener(self.url) as stream:
                self.open_ns = time.perf_counter_ns() - t0
                read = stream.read
                while True:
                    with cond:
                        while self._buffered >= self._limit and not self._stopped:
                            cond.wait()
                        if self._stopped:
                            return
                    data = read(self._chunk)
                    with cond:
                        if not data:
                            return
                        self._chunks.append(data)
                        self._buffered += len(data)
                        cond.notify_all()
        except BaseException as exc:  # handed to the reader, raised where the bytes stop
            with cond:
                self._error = exc
        finally:
            with cond:
                self._done = True
                cond.notify_all()

    # -- the reader's side ----------------------------------------------------------------------
    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts: list[bytes] = []
            while True:
                data = self.read(1 << 22)
                if not data:
                    return b"".join(parts)
                parts.append(data)
        if not self._pending:
            if n == 0:
                return b""
            cond = self._cond
            with cond:
                while not self._chunks and not self._done:
                    cond.wait()
                if self._chunks:
                    data = self._chunks.popleft()
                    self._buffered -= len(data)
                    cond.notify_all()
                elif self._error is not None:
                    error, self._error = self._error, None
                    raise error
                else:
                    return b""
            self._pending = data
        data = self._pending
        if len(data) <= n:
            self._pending = b""
        else:
            self._pending = data[n:]
            data = data[:n]
        self.nbytes += len(data)
        return data

    read1 = read

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._chunks.clear()
            self._buffered = 0
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class ShardPrefetcher:
    """Open shards ``ahead`` of the one being read (see the module's docstring).

    ``opener(url)`` is a context manager giving a binary stream (``open_url`` or a cache's
    ``open``). Iterate :meth:`streams` over a shard list (finite or not) to get
    ``(url, stream)`` pairs in order; each stream is closed when the next pair is asked for.
    """

    def __init__(
        self,
        opener: Callable[[str], ContextManager],
        *,
        ahead: int = 2,
        max_bytes: int = 256 << 20,
        chunk: int = _CHUNK,
    ):
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.opener = opener
        self.ahead = int(ahead)
        self.max_bytes = int(max_bytes)
        self.chunk = chunk
        self._window: collections.deque[PrefetchedStream] = collections.deque()

    def _start(self, url: str) -> PrefetchedStream:
        limit = self.max_bytes // (self.ahead + 1)
        return PrefetchedStream(url, self.opener, limit, self.chunk)

    def streams(self, urls: Iterable[str]) -> Iterator[tuple[str, PrefetchedStream]]:
        it = iter(urls)
        window = self._window
        try:
            while True:
                while len(window) <= self.ahead:
                    url = next(it, _END)
                    if url is _END:
                        break
                    window.append(self._start(url))
                if not window:
                    return
                current = window[0]
                try:
                    yield current.url, current
                finally:
                    current.close()
                    window.popleft()
        finally:
            self.close()

    def close(self) -> None:
        while self._window:
            self._window.popleft().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


@contextlib.contextmanager
def given_stream(stream) -> Iterator:
    """A context manager handing out an already open stream (its owner closes it)."""
    yield stream
