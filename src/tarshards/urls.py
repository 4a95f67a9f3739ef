"""Shard specs and opening URLs.

A *spec* names a list of shards: a string with brace ranges (``train-{0000..0147}.tgz``), several
specs joined with ``::``, a glob over local or fsspec paths, a list of any of those, or a text file
listing one URL per line (``@shards.txt`` or a path ending in ``.txt``/``.shards``).

Opening goes through fsspec, so every protocol whose package is installed works (``file:``,
``http(s)://``, ``s3://``, ``gs://``...), ``-`` is stdin/stdout, and ``pipe:CMD`` runs a shell
command, but only when the caller allows it explicitly.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import hashlib
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import BinaryIO, Iterable, Iterator

import braceexpand

try:  # POSIX: a lock on the temporary file tells a running writer from a dead one
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from .errors import MissingDependencyError, PipeNotAllowedError, StorageError, TarshardsError

__all__ = [
    "AtomicOutput",
    "ResumingReader",
    "expand_urls",
    "is_local",
    "local_path",
    "open_url",
    "remove_stale_temporaries",
    "temporary_directory",
    "url_protocol",
]

_INSTALL_HINTS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "http": "http",
    "https": "http",
}
_LIST_SUFFIXES = (".txt", ".shards", ".list")

logger = logging.getLogger(__name__)


def url_protocol(url: str) -> str | None:
    """The protocol of a URL (``"s3"``), ``None`` for local paths, ``"pipe"``, or ``"-"``."""
    if url == "-":
        return "-"
    if url.startswith("pipe:"):
        return "pipe"
    head, sep, _ = url.partition("://")
    if sep and head.isidentifier():
        return head.lower() if head.lower() != "file" else None
    if url.startswith("file:"):
        return None
    return None


def is_local(url: str) -> bool:
    return url_protocol(url) is None


def local_path(url: str) -> str:
    """Filesystem path of a local URL (``file:`` prefixes removed)."""
    if url.startswith("file://"):
        return url[7:]
    if url.startswith("file:"):
        return url[5:]
    return url


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def expand_urls(spec, *, storage_options: dict | None = None) -> list[str]:
    """Expand a shard spec into the list of URLs it names (order kept, no sorting of lists)."""
    if spec is None:
        raise ValueError("no shards given (urls=None)")
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        out = []
        for part in spec.split("::"):
            part = part.strip()
            if not part:
                continue
            out.extend(_expand_one(part, storage_options))
        return out
    if isinstance(spec, Iterable):
        out = []
        for item in spec:
            out.extend(expand_urls(item, storage_options=storage_options))
        return out
    raise TypeError(
        f"a shard spec is a string, a path or a list of them, not {type(spec).__name__}"
    )


def _expand_one(part: str, storage_options) -> list[str]:
    if part == "-":
        return [part]
    if part.startswith("pipe:"):  # as in webdataset: pipe:curl -s http://h/a-{000..009}.tar
        return list(braceexpand.braceexpand(part))
    if part.startswith("@"):
        return _read_list(part[1:], storage_options)
    if (
        part.lower().endswith(_LIST_SUFFIXES)
        and is_local(part)
        and os.path.isfile(local_path(part))
    ):
        return _read_list(part, storage_options)
    urls = list(braceexpand.braceexpand(part))
    out = []
    for url in urls:
        if _has_glob(url):
            out.extend(_glob_url(url, storage_options))
        else:
            out.append(url)
    return out


def _read_list(path: str, storage_options) -> list[str]:
    with open_url(path, storage_options=storage_options) as f:
        text = f.read().decode("utf-8")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.extend(_expand_one(line, storage_options))
    return out


def _glob_url(url: str, storage_options) -> list[str]:
    if is_local(url):
        found = sorted(_glob.glob(local_path(url)))
    else:
        fs, _, _ = _fsspec_resolve(url, storage_options)
        protocol = url_protocol(url)
        found = sorted(f"{protocol}://{p}" if "://" not in p else p for p in fs.glob(url))
    if not found:
        raise FileNotFoundError(f"no shard matches the pattern {url!r}")
    return found


def _fsspec_resolve(url: str, storage_options):
    try:
        import fsspec
    except ImportError:  # pragma: no cover - core dependency
        raise MissingDependencyError("fsspec is required: pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {})) + (fsspec,)
    except ImportError as exc:
        proto = url_protocol(url) or "file"
        extra = _INSTALL_HINTS.get(proto)
        hint = f"pip install 'tarshards[{extra}]'" if extra else str(exc)
        raise MissingDependencyError(
            f"reading {proto}:// URLs needs an extra package: {hint}", url=url
        ) from None
    except ValueError as exc:  # unknown protocol
        raise StorageError(f"cannot open {url!r}: {exc}", url=url) from None


class _PipeStream:
    """The stdout of a shell command; closing it checks the exit status."""

    def __init__(self, cmd: str, mode: str):
        self.cmd = cmd
        if "r" in mode:
            self.proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, bufsize=1 << 20)
            self.stream = self.proc.stdout
        else:
            self.proc = subprocess.Popen(cmd, shell=True, stdin=subprocess.PIPE, bufsize=1 << 20)
            self.stream = self.proc.stdin

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


# Exceptions that are never worth a retry: the object is not there or not ours to read.
_FATAL_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _transient_errors() -> tuple:
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


_EOF = object()


def _read_to_end(read) -> bytes:
    """Everything ``read(n)`` still returns, joined (for ``read()`` / ``read(-1)``)."""
    parts = []
    while True:
        data = read(1 << 22)
        if not data:
            return b"".join(parts)
        parts.append(data)


class _HTTPStream:
    """One streaming GET of ``url`` from byte ``offset`` on, through fsspec's aiohttp session.

    fsspec's own ``HTTPFile`` fetches a file as a series of range requests (one per block) and
    ``HTTPStreamFile`` makes a round trip to the event loop for every read; here a task on
    fsspec's event loop reads the response ahead (at most ``prefetch`` bytes) into a queue that
    :meth:`read` takes from, so network and parsing overlap and a shard costs one request.
    ``size`` is the whole object's size when the server says it (``Content-Range`` or
    ``Content-Length``), else ``None``.
    """

    def __init__(
        self,
        fs,
        url: str,
        offset: int = 0,
        *,
        prefetch: int = 8 << 20,
        timeout: float | None = 60.0,
    ):
        import asyncio

        from fsspec.asyn import sync

        self._sync = sync
        self.loop = fs.loop
        self.url = url
        self.r = None
        self._task = None
        self._queue = queue.SimpleQueue()
        self._pending = b""
        self._done = False
        self._lock = threading.Lock()
        self._inflight = 0
        self._waiting = False
        self._prefetch = prefetch
        session = sync(fs.loop, fs.set_session)
        kwargs = dict(fs.kwargs)
        headers = dict(kwargs.pop("headers", None) or {})
        if offset:
            headers["Range"] = f"bytes={offset}-"
        if timeout is not None and "timeout" not in kwargs:
            import aiohttp

            # a server that stops answering becomes a (retried) error instead of a hang
            kwargs["timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=timeout, sock_read=timeout
            )

        async def start():
            return await session.get(fs.encode_url(url), headers=headers, **kwargs)

        self.r = sync(self.loop, start)
        try:
            self.size = self._check(offset)

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

    def _check(self, offset: int):
        r = self.r
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
            return _read_to_end(self.read)
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


class ResumingReader:
    """A read-only byte stream that survives dropped connections without losing a byte.

    ``open_at(offset)`` returns ``(stream, size)``: a stream positioned at ``offset`` and the whole
    object's size (or ``None``). When a read fails with a connection error, or the stream ends
    before ``size``, the reader closes it, sleeps (``backoff`` doubling up to ``max_backoff``
    seconds), reopens at the offset reached and goes on; each resume is logged on the
    ``tarshards.urls`` logger. ``retries`` bounds the failures in a row that made no progress;
    then :class:`~tarshards.errors.StorageError` names the URL and the offset.
    """

    def __init__(
        self, url: str, open_at, *, retries: int = 5, backoff: float = 0.1, max_backoff: float = 2.0
    ):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = url
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.resumes = 0  # total number of reconnections made
        self._open_at = open_at
        self._transient = _transient_errors()
        self._failures = 0  # failures in a row without progress
        self._stream = None
        self.size = None
        self.pos = 0
        self.closed = False
        self._connect()

    # -- connection handling ----------------------------------------------------------------
    def _connect(self) -> None:
        while True:
            try:
                stream, size = self._open_at(self.pos)
            except TarshardsError:
                raise
            except _FATAL_ERRORS as exc:
                raise StorageError(f"cannot open: {exc}", url=self.url, offset=self.pos) from exc
            except self._transient as exc:
                self._failed(exc, "open")
                continue
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
            return _read_to_end(self.read)
        while True:
            if self._stream is None:
                self._connect()
            try:
                data = self._stream.read(n)
            except TarshardsError:
                raise
            except _FATAL_ERRORS as exc:
                raise StorageError(f"read failed: {exc}", url=self.url, offset=self.pos) from exc
            except self._transient as exc:
                self._failed(exc, "read")
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
            if n == 0 or self.size is None or self.pos >= self.size:
                return b""
            self._failed(EOFError(f"stream ended at {self.pos} of {self.size} bytes"), "read")

    read1 = read

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


class _S3Stream:
    """One streaming ``GetObject`` of an S3 object from byte ``offset`` on (s3fs's client).

    s3fs's own file object reads an object as ranges of ``block_size`` bytes, each a request of
    its own; for a sequential read of a whole shard one request is enough, and each request
    saved is one first-byte latency saved. ``size`` is the object's size.
    """

    def __init__(self, fs, path: str, offset: int = 0, *, chunk: int = 1 << 20):
        from fsspec.asyn import sync

        self._sync = sync
        self._loop = fs.loop
        bucket, key, version = fs.split_path(path)
        kwargs = {"Bucket": bucket, "Key": key}
        if version:
            kwargs["VersionId"] = version
        if offset:
            kwargs["Range"] = f"bytes={offset}-"
        resp = sync(fs.loop, fs._call_s3, "get_object", **kwargs)
        self._body = resp["Body"]
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit():
            self.size = int(total)
        elif resp.get("ContentLength") is not None:
            self.size = offset + int(resp["ContentLength"])
        else:
            self.size = None

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return _read_to_end(self.read)
        if self._body is None:
            return b""
        return self._sync(self._loop, self._body.read, n)

    def close(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with contextlib.suppress(Exception):
                body.close()


def _remote_reader(
    url: str,
    storage_options,
    *,
    block_size: int,
    retries: int,
    backoff: float,
    timeout: float | None = 60.0,
) -> ResumingReader:
    fs, path, _ = _fsspec_resolve(url, storage_options)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "http" in protocols or "https" in protocols:

        def open_at(offset):
            s = _HTTPStream(fs, path, offset, timeout=timeout)
            return s, s.size
    elif "s3" in protocols and hasattr(fs, "_call_s3"):

        def open_at(offset):
            s = _S3Stream(fs, path, offset)
            return s, s.size
    else:

        def open_at(offset):
            f = fs.open(path, "rb", block_size=block_size)
            try:
                if offset:
                    f.seek(offset)
            except BaseException:
                f.close()
                raise
            size = getattr(f, "size", None)
            return f, (int(size) if isinstance(size, int) else None)

    return ResumingReader(url, open_at, retries=retries, backoff=backoff)


@contextlib.contextmanager
def open_url(
    url: str,
    mode: str = "rb",
    *,
    storage_options: dict | None = None,
    allow_pipe: bool = False,
    block_size: int = 8 << 20,
    retries: int = 5,
    retry_backoff: float = 0.1,
    timeout: float | None = 60.0,
) -> Iterator[BinaryIO]:
    """Open a URL as a binary stream (a context manager).

    ``-`` is stdin (or stdout for writing) and is not closed. ``pipe:CMD`` needs
    ``allow_pipe=True``. Other URLs go through fsspec with ``storage_options``. Remote URLs are
    read sequentially (``http(s)``: one streaming GET; object stores: ranges of ``block_size``
    bytes) by a :class:`ResumingReader`, which reconnects at the byte offset reached when a
    connection drops, up to ``retries`` times in a row, sleeping ``retry_backoff`` seconds
    doubling (at most 2 s) in between. An HTTP server silent for ``timeout`` seconds counts as a
    dropped connection.
    """
    if not isinstance(url, str):
        url = os.fspath(url)
    if url == "-":
        yield (sys.stdin.buffer if "r" in mode else sys.stdout.buffer)
        return
    if url.startswith("pipe:"):
        if not allow_pipe:
            raise PipeNotAllowedError(
                "pipe: URLs run shell commands and are off by default; pass allow_pipe=True "
                "(WebDataset(..., allow_pipe=True)) if you trust the shard list",
                url=url,
            )
        p = _PipeStream(url[5:], mode)
        try:
            yield p
        finally:
            p.close()
        return
    if is_local(url):
        path = local_path(url)
        try:
            f = open(path, mode, buffering=0 if "r" in mode else -1)
        except FileNotFoundError:
            raise StorageError("no such shard file", url=url) from None
        except IsADirectoryError:
            raise StorageError("is a directory, not a shard", url=url) from None
        except PermissionError:
            raise StorageError("permission denied", url=url) from None
        with f:
            yield f
        return
    if "r" in mode:
        with _remote_reader(
            url,
            storage_options,
            block_size=block_size,
            retries=retries,
            backoff=retry_backoff,
            timeout=timeout,
        ) as reader:
            yield reader
        return
    fs, path, _ = _fsspec_resolve(url, storage_options)
    try:
        f = fs.open(path, mode, block_size=block_size)
    except OSError as exc:
        raise StorageError(f"cannot open for writing: {exc}", url=url) from exc
    with f:
        yield f


# ---------------------------------------------------------------------------------------------
# atomic output and its temporary files
# ---------------------------------------------------------------------------------------------

# A temporary file is named ``.NAME.PID-HOST-START-RANDOM.tmp`` beside its final name NAME: PID is
# the writing process, HOST a hash of its host name, START the process's start time (clock ticks
# since boot, 0 where unknown: it tells a reused PID apart), RANDOM makes the name unique. The
# writer also holds an exclusive flock on the file while it writes. A temporary is stale, and may
# be removed by anyone, only when nobody holds that lock and its writer is known to be gone: on
# the same host the PID is dead (or belongs to a younger process); from another host (a shared
# file system) the file has not been touched for STALE_AFTER seconds.
_TEMP_SUFFIX = ".tmp"
_TEMP_RE = re.compile(
    r"\.(?P<base>.+)\.(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-(?P<start>\d+)-"
    r"[0-9a-f]{8}\.tmp"
)
STALE_AFTER = 600.0
_UPLOAD_BASE = "tarshards-upload"


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (Linux); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _pid_alive(pid: int, start: int) -> bool:
    if os.name != "posix":
        return True  # no safe liveness probe (os.kill would terminate it): keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    except OSError:
        return True
    if start:
        now = _process_start(pid)
        if now and now != start:
            return False  # the PID was reused by a younger process: the writer is gone
    return True


def _try_lock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False when someone holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks: decide on the other evidence
        return True
    return True


def temporary_name(directory: str, base: str) -> str:
    """A fresh temporary path for the final name ``base`` in ``directory`` (see _TEMP_RE)."""
    pid = os.getpid()
    tag = f"{pid}-{_host_tag()}-{_process_start(pid)}-{uuid.uuid4().hex[:8]}"
    return os.path.join(directory, f".{base}.{tag}{_TEMP_SUFFIX}")


def _create_temporary(directory: str, base: str):
    """Create and lock a new temporary file; returns ``(path, binary writer)``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = temporary_name(directory, base)
        try:
            fd = os.open(path, flags, 0o666)
        except FileExistsError:  # pragma: no cover - 32 random bits
            continue
        break
    try:
        _try_lock(fd)  # held until the file is closed
        return path, os.fdopen(fd, "wb", buffering=1 << 20)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def is_stale_temporary(path: str, *, now: float | None = None) -> bool:
    """Whether ``path`` is a tarshards temporary file whose writer is gone (see above)."""
    m = _TEMP_RE.fullmatch(os.path.basename(path))
    if m is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not _try_lock(fd):
            return False  # its writer is at work
        if m["host"] == _host_tag():
            pid = int(m["pid"])
            return pid != os.getpid() and not _pid_alive(pid, int(m["start"]))
        age = (time.time() if now is None else now) - os.fstat(fd).st_mtime
        return age > STALE_AFTER
    finally:
        os.close(fd)  # releases the lock


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files that writers which died (kill -9, power loss) left in
    ``directory``; never those of a writer still running. Returns the paths removed."""
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not (entry.startswith(".") and entry.endswith(_TEMP_SUFFIX)):
            continue
        path = os.path.join(directory, entry)
        if is_stale_temporary(path):
            try:
                os.unlink(path)
            except OSError:
                continue
            removed.append(path)
            logger.info("removed %s, left by a writer that died", path)
    return removed


def temporary_directory(dest) -> str | None:
    """Where :class:`AtomicOutput` puts the temporary file for ``dest`` (None: no file)."""
    if hasattr(dest, "write"):
        return None
    dest = os.fspath(dest)
    if dest == "-" or dest.startswith("pipe:"):
        return None
    if is_local(dest):
        return os.path.dirname(os.path.abspath(local_path(dest)))
    return tempfile.gettempdir()


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (where the platform allows opening directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicOutput:
    """A destination that appears under its final name only when complete.

    Local paths are written to a temporary name in the same directory (``.NAME.<owner>.tmp``,
    locked while it is written) and, on :meth:`commit`, flushed to disk (fsync), renamed, and the
    directory synced, so a crash or ``kill -9`` at any moment leaves either nothing or the whole
    file under the final name. Opening first removes the stale temporaries that writers which
    died left in that directory (``remove_stale=False`` skips that; see
    :func:`remove_stale_temporaries`). Remote URLs are written to a local temporary file and
    uploaded through fsspec on commit; ``-`` writes to stdout; a file object is written to
    directly. ``pipe:CMD`` (only with ``allow_pipe=True``) writes to the stdin of a shell command
    and checks its exit status on commit: what the command writes is not atomic. :meth:`abort`
    (or an exception in the ``with`` block) removes the temporary file (or kills the command).
    """

    def __init__(
        self,
        dest,
        *,
        storage_options: dict | None = None,
        allow_pipe: bool = False,
        remove_stale: bool = True,
    ):
        self.dest = dest
        self.storage_options = storage_options
        self._tmp = None
        self._owned = False
        self._pipe = None
        self.done = False
        if hasattr(dest, "write"):
            self.stream = dest
            self.name = getattr(dest, "name", "<stream>")
            return
        dest = os.fspath(dest)
        self.name = dest
        if dest == "-":
            self.stream = sys.stdout.buffer
        elif dest.startswith("pipe:"):
            if not allow_pipe:
                raise PipeNotAllowedError(
                    "pipe: outputs run shell commands and are off by default; pass "
                    "allow_pipe=True (TarWriter(..., allow_pipe=True)) if you trust the command",
                    url=dest,
                )
            self._pipe = _PipeStream(dest[5:], "wb")
            self.stream = self._pipe.stream
        else:
            local = is_local(dest)
            base = os.path.basename(local_path(dest)) if local else _UPLOAD_BASE
            if not base:
                raise StorageError("the output is a directory name, not a file name", url=dest)
            d = temporary_directory(dest)
            os.makedirs(d, exist_ok=True)
            if remove_stale:
                remove_stale_temporaries(d)
            self._tmp, self.stream = _create_temporary(d, base)
            self._owned = True

    def commit(self) -> None:
        """Publish the output under its final name (or finish the command / the upload)."""
        if self.done:
            return
        self.done = True
        if self._pipe is not None:
            self._pipe.close()  # StorageError when the command failed
            return
        if not self._owned:
            self.stream.flush()
            return
        try:
            self.stream.flush()
            os.fsync(self.stream.fileno())
        except BaseException:
            self._discard()
            raise
        self.stream.close()  # releases the lock: the data is complete
        if is_local(self.name):
            path = local_path(self.name)
            try:
                os.replace(self._tmp, path)
            except BaseException:
                self._discard()
                raise
            self._tmp = None
            _fsync_directory(os.path.dirname(os.path.abspath(path)))
            return
        fs, path, _ = _fsspec_resolve(self.name, self.storage_options)
        try:
            fs.put_file(self._tmp, path)
        except Exception as exc:
            raise StorageError(f"upload failed: {exc}", url=self.name) from exc
        finally:
            self._discard()

    def _discard(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.close()
        if self._tmp:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None

    def abort(self) -> None:
        """Discard what was written: nothing appears under the final name."""
        if self.done:
            return
        self.done = True
        if self._pipe is not None:
            self._pipe.kill()
        elif self._owned:
            self._discard()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False
