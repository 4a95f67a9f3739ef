"""A local cache of remote shards, shared safely by several processes.

``ShardCache(cache_dir, max_bytes=...)`` keeps whole remote shards on local disk. Its
:meth:`~ShardCache.open` is what ``WebDataset(cache_dir=...)`` uses to open shards:

* a shard already in the cache is opened from disk (and marked as recently used);
* otherwise one process takes the shard's lock (``fcntl.flock``), streams the shard from its URL
  and *tees* it: the caller gets the bytes as they arrive while they are written to
  ``NAME.part``; when the stream has been read to its end, the file is checked (size equal to the
  remote size, tar/gzip/zstd magic) and renamed to its final name;
* other processes that want the same shard meanwhile wait for the lock and then read the finished
  file, so each shard is downloaded once;
* beyond ``max_bytes``, the least recently used shards are removed.

A reader that stops before the end of a shard (an error, or a consumer that stops early) leaves
no file behind; the next reader downloads the shard again. Local paths are not cached.
Cache file names are ``<hash of the full URL>-<base name>``, so data sets whose files have the
same names do not collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
from typing import TYPE_CHECKING, BinaryIO, Iterator, cast

from ..errors import IntegrityError, StorageError
from ..format.compression import by_magic
from ..format.names import parse_size
from .open import open_url
from .paths import is_local

if TYPE_CHECKING:  # (the counters' module is imported by loaders that count)
    from ..stats import Counters

__all__ = ["ShardCache"]

logger = logging.getLogger(__name__)

_LOCK_DIR = ".locks"
_PART = ".part"
_Reopen = -1  # _acquire: the shard appeared while waiting; open it without the lock


def cache_name(url: str) -> str:
    """The file name of ``url`` in a cache: a hash of the whole URL, then the base name."""
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    base = url.split("?", 1)[0].split("#", 1)[0].rstrip("/").rpartition("/")[2]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base)[-100:].lstrip(".")
    return f"{digest}-{base}" if base else digest


def looks_like_shard(head: bytes) -> bool:
    """Whether the first bytes of a file are those of a tar, gzip or zstd stream."""
    if by_magic(head) is not None:
        return True
    if len(head) < 512:
        return False
    if head[257:262] == b"ustar":
        return True
    block = head[:512]
    if not block.strip(b"\0"):
        return True  # an empty archive
    try:  # a pre-POSIX (v7) header: the checksum must agree
        stored = int(block[148:156].replace(b"\0", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    return stored == sum(block[:148]) + 8 * 32 + sum(block[156:])


class _TeeReader:
    """Reads from ``src`` and writes everything read to ``sink``."""

    def __init__(self, src, sink: BinaryIO, hasher=None):
        self.src = src
        self.sink = sink
        self.hasher = hasher
        self.nbytes = 0
        self.head = b""
        self.eof = False

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        if data:
            self.sink.write(data)
            if self.hasher is not None:
                self.hasher.update(data)
            if len(self.head) < 512:
                self.head += data[: 512 - len(self.head)]
            self.nbytes += len(data)
        elif n != 0:
            self.eof = True
        return data

    read1 = read

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while not self.eof:
            self.read(1 << 20)


class ShardCache:
    """Whole remote shards kept in ``cache_dir``; safe for several processes at once.

    ``max_bytes``: the size limit (bytes, or a string like ``"20GB"``; ``None``: no limit); the
    least recently used shards are removed beyond it (the one just added is always kept).
    ``storage_options``, ``retries``: passed on to :func:`tarshards.storage.open_url`.
    ``lock_timeout``: seconds to wait for another process downloading the same shard before
    reading it directly without the cache (``None``: wait as long as it takes).
    ``manifest``: a :class:`~tarshards.format.manifest.Manifest`; a download of one of its shards is
    kept only when its size and hash are the manifest's (else :class:`IntegrityError`).
    """

    def __init__(
        self,
        cache_dir,
        max_bytes=None,
        storage_options: dict | None = None,
        *,
        retries: int = 5,
        allow_pipe: bool = False,
        lock_timeout: float | None = None,
        manifest=None,
    ):
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.max_bytes = None if max_bytes is None else parse_size(max_bytes)
        self.storage_options = storage_options
        self.retries = retries
        self.allow_pipe = allow_pipe
        self.lock_timeout = lock_timeout
        self.downloads = 0  # shards this object downloaded (this process)
        # url -> record with .nbytes and .hash (duck-typed: this layer does not import manifest)
        self.expected = manifest.records_by_url() if manifest is not None else {}
        os.makedirs(os.path.join(self.cache_dir, _LOCK_DIR), exist_ok=True)

    def __repr__(self):
        return f"ShardCache({self.cache_dir!r}, max_bytes={self.max_bytes})"

    # ---- names -----------------------------------------------------------------------------
    def path_for(self, url: str) -> str:
        """Where ``url`` is (or would be) cached."""
        return os.path.join(self.cache_dir, cache_name(url))

    def local_path(self, url: str) -> str:
        """The file that holds ``url``'s bytes when read through this cache: its cached copy,
        or the local file itself (local files are read in place, never copied)."""
        url = os.fspath(url)
        return self.path_for(url) if self._is_cacheable(url) else url

    def _lock_path(self, path: str) -> str:
        return os.path.join(self.cache_dir, _LOCK_DIR, os.path.basename(path) + ".lock")

    def _is_cacheable(self, url: str) -> bool:
        return not (is_local(url) or url == "-" or url.startswith("pipe:"))

    # ---- opening ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def open(self, url, *, stats: Counters | None = None) -> Iterator[BinaryIO]:
        """Open ``url`` through the cache: a context manager giving a binary stream.
        ``stats`` (a loader's :class:`~tarshards.stats.Counters`) counts the hit or miss."""
        url = os.fspath(url)
        if not self._is_cacheable(url):
            with open_url(
                url, storage_options=self.storage_options, allow_pipe=self.allow_pipe
            ) as f:
                yield f
            return
        path = self.path_for(url)
        while True:
            f = self._open_cached(path)
            if f is not None:
                if stats is not None:
                    stats.cache(True)
                with f:
                    yield f
                return
            lock = self._acquire(path, url)
            if lock == _Reopen:
                continue
            if lock is None:  # waited too long: read it directly, without caching
                logger.warning(
                    "waited %.0fs for another process caching %s; reading it directly",
                    self.lock_timeout,
                    url,
                )
                with open_url(url, storage_options=self.storage_options, retries=self.retries) as f:
                    yield f
                return
            try:
                if os.path.exists(path):  # someone else finished it while we waited
                    continue
                if stats is not None:
                    stats.cache(False)
                with self._fill(url, path) as f:
                    yield f
                return
            finally:
                os.close(lock)

    def fetch(self, url: str) -> str:
        """Make sure ``url`` is in the cache (downloading it if needed); returns its local path."""
        url = os.fspath(url)
        if not self._is_cacheable(url):
            raise ValueError(f"{url!r} is not a remote URL; it is not cached")
        with self.open(url) as f:
            while f.read(1 << 20):
                pass
        path = self.path_for(url)
        if not os.path.exists(path):
            raise StorageError("the shard could not be stored in the cache", url=url)
        return path

    def _open_cached(self, path: str):
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path, ns=(time.time_ns(), time.time_ns()))  # recently used
        return f

    def _acquire(self, path: str, url: str):
        """The shard's lock (an fd), waiting for a process that holds it; None on timeout."""
        fd = os.open(self._lock_path(path), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                pass
            logger.debug("waiting for another process caching %s", url)
            if self.lock_timeout is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
                return fd
            deadline = time.monotonic() + self.lock_timeout
            while time.monotonic() < deadline:
                time.sleep(0.05)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    if os.path.exists(path):  # done: no need for the lock to read it
                        os.close(fd)
                        return _Reopen
            os.close(fd)
            return None
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    @contextlib.contextmanager
    def _fill(self, url: str, path: str) -> Iterator[BinaryIO]:
        """Stream ``url`` to the caller while writing it to ``path`` (we hold the lock)."""
        tmp = path + _PART
        record = self.expected.get(url)
        hasher = None
        if record is not None and record.hash:
            from ..format.hashing import file_hasher, split_hash

            algorithm = split_hash(record.hash)[0]
            hasher = file_hasher(algorithm)
        with open_url(url, storage_options=self.storage_options, retries=self.retries) as src:
            with open(tmp, "wb") as sink:
                tee = _TeeReader(src, sink, hasher)
                try:
                    yield cast(BinaryIO, tee)
                except BaseException:
                    sink.close()
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                try:
                    tee.drain()  # the tar reader may stop at the end-of-archive blocks
                    sink.flush()
                    os.fsync(sink.fileno())
                except Exception as exc:
                    logger.warning("could not finish caching %s: %s", url, exc)
                    sink.close()
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    return
            size = getattr(src, "size", None)
            problem = None
            if size is not None and tee.nbytes != size:
                problem = f"got {tee.nbytes} bytes, the server said {size}"
            elif not looks_like_shard(tee.head):
                problem = "not a tar, gzip or zstd file"
            if problem is not None:
                logger.warning("not caching %s: %s", url, problem)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                return
            if record is not None:
                bad = None
                if record.nbytes is not None and tee.nbytes != record.nbytes:
                    bad = f"{tee.nbytes} bytes, the manifest says {record.nbytes}"
                elif hasher is not None and f"{algorithm}:{hasher.hexdigest()}" != record.hash:
                    bad = f"hash {algorithm}:{hasher.hexdigest()}, the manifest says {record.hash}"
                if bad is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise IntegrityError(
                        f"the download does not match the manifest ({bad}); it was not cached",
                        url=url,
                    )
            # its last use now, on the clock the hits use (os.utime, below): the file system's
            # own write time comes from a coarser clock, up to a tick behind, which made a
            # shard fetched just after another's hit look older than it, and evicted first
            now = time.time_ns()
            with contextlib.suppress(OSError):
                os.utime(tmp, ns=(now, now))
            os.replace(tmp, path)
            self.downloads += 1
            logger.debug("cached %s (%d bytes) as %s", url, tee.nbytes, path)
        if self.max_bytes is not None:
            self.evict(keep=path)

    # ---- eviction --------------------------------------------------------------------------
    def entries(self) -> list[tuple[str, int, int]]:
        """``(path, size, last use in ns)`` of each cached shard, least recently used first."""
        out = []
        with os.scandir(self.cache_dir) as it:
            for e in it:
                if e.name.startswith(".") or e.name.endswith(_PART):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.is_file():
                    out.append((e.path, st.st_size, st.st_mtime_ns))
        out.sort(key=lambda t: (t[2], t[0]))
        return out

    def size(self) -> int:
        """Bytes held by the cached shards."""
        return sum(s for _, s, _ in self.entries())

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used shards until the cache fits ``max_bytes``; returns them."""
        if self.max_bytes is None:
            return []
        fd = os.open(
            os.path.join(self.cache_dir, _LOCK_DIR, "evict.lock"), os.O_RDWR | os.O_CREAT, 0o666
        )
        removed = []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries = self.entries()
            total = sum(s for _, s, _ in entries)
            for path, size, _ in entries:
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # readers that have it open keep reading it
                    removed.append(path)
                total -= size
        finally:
            os.close(fd)
        for path in removed:
            logger.debug("evicted %s from the cache", path)
        return removed

    def clear(self) -> None:
        """Remove every cached shard."""
        for path, _, _ in self.entries():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
