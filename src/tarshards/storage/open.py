"""``open_url``: every URL tarshards reads or writes is opened here.

Opening goes through fsspec, so every protocol whose package is installed works (``file:``,
``http(s)://``, ``s3://``, ``gs://``...), ``-`` is stdin/stdout, and ``pipe:CMD`` runs a shell
command, but only when the caller allows it explicitly. A read may start at a byte ``offset``
and stop after ``length`` bytes: local files seek, HTTP and S3 ask for that range, other fsspec
file systems read it as one range (random access, resumed reads).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import IO, TYPE_CHECKING, BinaryIO, Iterator, cast

from ..errors import PipeNotAllowedError, ShardNotFoundError, StorageError
from ..types import ReadOptions
from .paths import filesystem, is_local, local_path
from .retry import ResumingReader, read_to_end

if TYPE_CHECKING:  # (the counters' module is imported by loaders that count)
    from ..stats import Counters

__all__ = ["PipeStream", "open_url"]


class PipeStream:
    """The stdout of a shell command; closing it checks the exit status."""

    def __init__(self, cmd: str, mode: str):
        import subprocess  # here: a few ms of every command's start-up otherwise

        self.cmd = cmd
        self.stream: IO[bytes]
        if "r" in mode:
            self.proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, bufsize=1 << 20)
            self.stream = cast(IO[bytes], self.proc.stdout)
        else:
            self.proc = subprocess.Popen(cmd, shell=True, stdin=subprocess.PIPE, bufsize=1 << 20)
            self.stream = cast(IO[bytes], self.proc.stdin)

    def read(self, n=-1):
        return self.stream.read(n)

    def write(self, data):
        return self.stream.write(data)

    def flush(self):
        self.stream.flush()

    def kill(self):
        """Stop the command without letting it finish (an aborted write)."""
        with contextlib.suppress(OSError):
            self.proc.kill()  # first, so that it cannot finish its output on our EOF
        with contextlib.suppress(OSError, ValueError):
            self.stream.close()
        self.proc.wait()

    def close(self):
        self.stream.close()
        rc = self.proc.wait()
        if rc not in (0, -13, 141):  # SIGPIPE when we stop reading early is fine
            raise StorageError(
                f"pipe command exited with status {rc}: {self.cmd}", url=f"pipe:{self.cmd}"
            )


class _Bounded:
    """At most ``length`` bytes of a stream (``open_url(..., length=)`` on a local file or a
    pipe): reads stop there."""

    def __init__(self, stream, length: int):
        self._stream = stream
        self._left = length

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return read_to_end(self.read)
        data = self._stream.read(min(n, self._left)) if self._left > 0 else b""
        self._left -= len(data)
        return data

    read1 = read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _skip(stream, n: int, url: str) -> None:
    """Read and drop the first ``n`` bytes of a stream that cannot seek (stdin, a pipe)."""
    while n > 0:
        data = stream.read(min(n, 1 << 20))
        if not data:
            raise StorageError(f"the stream ended {n} bytes before the offset", url=url)
        n -= len(data)


def _remote_reader(
    url: str,
    storage_options,
    *,
    offset: int,
    stop: int | None,
    block_size: int,
    retries: int,
    backoff: float,
    timeout: float | None,
    stats=None,
) -> ResumingReader:
    fs, path = filesystem(url, storage_options)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "http" in protocols or "https" in protocols:
        from .http import HTTPStream  # here: opening local files does not load the streams

        def open_at(start):
            s = HTTPStream(fs, path, start, stop=stop, timeout=timeout)
            return s, s.size
    elif "s3" in protocols and hasattr(fs, "_call_s3"):
        from .s3 import S3Stream

        # s3fs has its own timeouts: a watchdog's (given with stats) is added to them
        s3_timeout = timeout if stats is not None and stats.watchdog is not None else None

        def open_at(start):
            s = S3Stream(fs, path, start, stop=stop, timeout=s3_timeout)
            return s, s.size
    elif stop is not None:  # a byte range (random access): one request for it

        def open_at(start):
            return io.BytesIO(fs.cat_file(path, start=start, end=stop)), None
    else:

        def open_at(start):
            f = fs.open(path, "rb", block_size=block_size)
            try:
                if start:
                    f.seek(start)
            except BaseException:
                f.close()
                raise
            size = getattr(f, "size", None)
            return f, (int(size) if isinstance(size, int) else None)

    return ResumingReader(
        url, open_at, retries=retries, backoff=backoff, start=offset, stop=stop, stats=stats
    )


def _options(options, storage_options, allow_pipe: bool, retries: int):
    """The reading options: ``options`` (a :class:`ReadOptions`) or the loose keywords."""
    if options is None:
        return storage_options, allow_pipe, retries
    if storage_options is not None or allow_pipe or retries != 5:
        raise TypeError("pass either options= or storage_options=/allow_pipe=/retries=")
    return options.storage_options, options.allow_pipe, options.retries


@contextlib.contextmanager
def open_url(
    url: str,
    mode: str = "rb",
    *,
    offset: int = 0,
    length: int | None = None,
    options: ReadOptions | None = None,
    storage_options: dict | None = None,
    allow_pipe: bool = False,
    block_size: int = 8 << 20,
    retries: int = 5,
    retry_backoff: float = 0.1,
    timeout: float | None = 60.0,
    stats: Counters | None = None,
) -> Iterator[BinaryIO]:
    """Open a URL as a binary stream (a context manager).

    ``-`` is stdin (or stdout for writing) and is not closed. ``pipe:CMD`` needs
    ``allow_pipe=True``. Other URLs go through fsspec with ``storage_options``. Remote URLs are
    read sequentially (``http(s)``: one streaming GET; object stores: ranges of ``block_size``
    bytes) by a :class:`ResumingReader`, which reconnects at the byte offset reached when a
    connection drops, up to ``retries`` times in a row, sleeping ``retry_backoff`` seconds
    doubling (at most 2 s) in between. An HTTP server silent for ``timeout`` seconds counts as a
    dropped connection.

    Reading starts at byte ``offset`` (a local file seeks; HTTP and S3 ask for a range; a stream
    that cannot seek, stdin or a pipe, drops the bytes before it) and, with ``length``, ends
    after that many bytes (a remote read then asks for that range only). ``options``, a
    :class:`~tarshards.types.ReadOptions`, gives ``storage_options``, ``allow_pipe`` and
    ``retries`` in one value. ``stats`` (:class:`~tarshards.stats.Counters`) counts a remote
    read's retries (a timeout under a watchdog is reported as a stall).
    """
    if not isinstance(url, str):
        url = os.fspath(url)
    storage_options, allow_pipe, retries = _options(options, storage_options, allow_pipe, retries)
    reading = "r" in mode
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"bad byte range: offset={offset}, length={length}")
    if not reading and (offset or length is not None):
        raise ValueError("offset= and length= are for reading")
    if url == "-" or url.startswith("pipe:"):
        with _open_stream(url, mode, allow_pipe) as s:
            if offset:
                _skip(s, offset, url)
            yield s if length is None else _Bounded(s, length)  # type: ignore[misc]
        return
    if is_local(url):
        with _open_local(url, mode) as f:
            if offset:
                f.seek(offset)
            yield f if length is None else _Bounded(f, length)  # type: ignore[misc]
        return
    if reading:
        if length == 0:
            yield io.BytesIO(b"")
            return
        with _remote_reader(
            url,
            storage_options,
            offset=offset,
            stop=None if length is None else offset + length,
            block_size=block_size,
            retries=retries,
            backoff=retry_backoff,
            timeout=timeout,
            stats=stats,
        ) as reader:
            yield reader
        return
    fs, path = filesystem(url, storage_options)
    try:
        f = fs.open(path, mode, block_size=block_size)
    except OSError as exc:
        raise StorageError(f"cannot open for writing: {exc}", url=url) from exc
    with f:
        yield f


@contextlib.contextmanager
def _open_stream(url: str, mode: str, allow_pipe: bool) -> Iterator:
    """stdin/stdout (never closed), or a shell command's (``pipe:CMD``, with ``allow_pipe``)."""
    if url == "-":
        yield (sys.stdin.buffer if "r" in mode else sys.stdout.buffer)
        return
    if not allow_pipe:
        raise PipeNotAllowedError(
            "pipe: URLs run shell commands and are off by default; pass allow_pipe=True "
            "(WebDataset(..., allow_pipe=True)) if you trust the shard list",
            url=url,
        )
    p = PipeStream(url[5:], mode)
    try:
        yield p
    finally:
        p.close()


@contextlib.contextmanager
def _open_local(url: str, mode: str) -> Iterator:
    path = local_path(url)
    try:
        f = open(path, mode, buffering=0 if "r" in mode else -1)
    except FileNotFoundError:
        raise ShardNotFoundError("no such shard file", url=url) from None
    except IsADirectoryError:
        raise StorageError("is a directory, not a shard", url=url) from None
    except PermissionError:
        raise StorageError("permission denied", url=url) from None
    with f:
        yield f
