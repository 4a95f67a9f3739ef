"""The one retry ladder of tarshards: a read-only stream that reconnects where it stopped.

Every remote read (the HTTP stream, S3's streaming ``GetObject``, fsspec's files, ranged reads
for random access) goes through :class:`ResumingReader`, so each failure is classified once:

* a :class:`~tarshards.errors.TarshardsError` passes through as it is;
* "the object is not there or not ours" (:data:`FATAL_ERRORS`) becomes a
  :class:`~tarshards.errors.StorageError` at once, never retried (a missing object a
  :class:`~tarshards.errors.ShardNotFoundError`, also a ``FileNotFoundError``);
* a connection failure (:func:`transient_errors`) or a stream that ends before the object's
  size is retried at the byte offset reached, after a doubling back-off.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ShardNotFoundError, StorageError, TarshardsError

if TYPE_CHECKING:  # (the counters' module is imported by loaders that count)
    from ..stats import Counters

__all__ = ["FATAL_ERRORS", "ResumingReader", "read_to_end", "transient_errors"]

logger = logging.getLogger(__name__)

# Exceptions that are never worth a retry: the object is not there or not ours to read.
FATAL_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)

_RETRY: Any = object()  # _attempt: the call failed and was counted; try again


def transient_errors() -> tuple:
    """Exception types that mean "the connection failed; trying again may work"."""
    import asyncio

    types: list = [OSError, EOFError, TimeoutError, asyncio.TimeoutError, ConnectionError]
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - http extra not installed
        pass
    else:
        types.append(aiohttp.ClientError)
    try:
        import fsspec.exceptions
    except ImportError:  # pragma: no cover
        pass
    else:
        types.append(fsspec.exceptions.FSTimeoutError)
    return tuple(types)


def read_to_end(read: Callable[[int], bytes]) -> bytes:
    """Everything ``read(n)`` still returns, joined (for ``read()`` / ``read(-1)``)."""
    parts: list[bytes] = []
    while True:
        data = read(1 << 22)
        if not data:
            return b"".join(parts)
        parts.append(data)


class ResumingReader:
    """A read-only byte stream that survives dropped connections without losing a byte.

    ``open_at(offset)`` returns ``(stream, size)``: a stream positioned at ``offset`` and the whole
    object's size (or ``None``). When a read fails with a connection error, or the stream ends
    before ``size``, the reader closes it, sleeps (``backoff`` doubling up to ``max_backoff``
    seconds), reopens at the offset reached and goes on; each resume is logged on the
    ``tarshards.storage.retry`` logger. ``retries`` bounds the failures in a row that made no
    progress; then :class:`~tarshards.errors.StorageError` names the URL and the offset.

    ``start`` is the first byte read (``open_at(start)`` opens it); ``stop``, when given, the
    byte where the stream ends (reads never go past it; ``open_at`` may then ask for that range
    only). ``stats``: a loader's :class:`~tarshards.stats.Counters`, told of each retry.
    """

    def __init__(
        self,
        url: str,
        open_at,
        *,
        retries: int = 5,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
        start: int = 0,
        stop: int | None = None,
        stats: Counters | None = None,
    ):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"bad byte range {start}:{stop}")
        self.url = url
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.resumes = 0  # total number of reconnections made
        self.stats = stats  # a loader's counters: retries (and stalls) are told there
        self._open_at = open_at
        self._transient = transient_errors()
        self._failures = 0  # failures in a row without progress
        self._stream: Any = None
        self.size: int | None = None
        self.pos = int(start)
        self.stop = stop
        self.closed = False
        self._connect()

    # -- the ladder ---------------------------------------------------------------------------
    def _attempt(self, fn: Callable, arg, what: str, fatal: str):
        """``fn(arg)``, with its failure classified (see the module docstring): a transient one
        is counted and slept on, and gives ``_RETRY``."""
        try:
            return fn(arg)
        except TarshardsError:
            raise
        except FATAL_ERRORS as exc:
            error = ShardNotFoundError if isinstance(exc, FileNotFoundError) else StorageError
            raise error(f"{fatal}: {exc}", url=self.url, offset=self.pos) from exc
        except self._transient as exc:
            self._failed(exc, what)
            return _RETRY

    def _connect(self) -> None:
        while True:
            opened = self._attempt(self._open_at, self.pos, "open", "cannot open")
            if opened is _RETRY:
                continue
            stream, size = opened
            self._stream = stream
            if size is not None:
                if self.size is not None and size != self.size:
                    stream.close()
                    raise StorageError(
                        f"the object changed size while being read ({self.size} then {size} bytes)",
                        url=self.url,
                        offset=self.pos,
                    )
                self.size = size
            return

    def _failed(self, exc: BaseException, what: str) -> None:
        self._failures += 1
        if self._stream is not None:
            with contextlib.suppress(Exception):
                self._stream.close()
            self._stream = None
        if self.stats is not None:  # may raise StallError (on_stall="raise")
            self.stats.retried(self.url, self.pos, exc)
        if self._failures > self.retries:
            raise StorageError(
                f"{what} failed after {self.retries} retries: {type(exc).__name__}: {exc}",
                url=self.url,
                offset=self.pos,
            ) from exc
        delay = min(self.max_backoff, self.backoff * (2 ** (self._failures - 1)))
        self.resumes += 1
        logger.warning(
            "%s of %s failed at offset %d (%s: %s); resuming there in %.2fs (retry %d of %d)",
            what,
            self.url,
            self.pos,
            type(exc).__name__,
            exc,
            delay,
            self._failures,
            self.retries,
        )
        if delay > 0:
            time.sleep(delay)

    # -- the stream interface -----------------------------------------------------------------
    def read(self, n: int = -1) -> bytes:
        if self.closed:
            raise ValueError("read from a closed stream")
        if n is None or n < 0:
            return read_to_end(self.read)
        if self.stop is not None:
            n = min(n, self.stop - self.pos)
            if n <= 0:
                return b""
        while True:
            if self._stream is None:
                self._connect()
            data = self._attempt(self._stream.read, n, "read", "read failed")
            if data is _RETRY:
                continue
            if data:
                self.pos += len(data)
                self._failures = 0
                if self.size is not None and self.pos > self.size:
                    raise StorageError(
                        f"read past the object's size of {self.size} bytes",
                        url=self.url,
                        offset=self.pos,
                    )
                return data
            end = self.size if self.stop is None or self.size is None else min(self.size, self.stop)
            if n == 0 or end is None or self.pos >= end:
                return b""
            self._failed(EOFError(f"stream ended at {self.pos} of {end} bytes"), "read")

    read1 = read

    def readinto(self, view) -> int:
        """Read into a writable buffer (the reader's buffer); the bytes read, 0 at the end."""
        data = self.read(len(view))
        n = len(data)
        view[:n] = data
        return n

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
