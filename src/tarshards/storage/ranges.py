"""Random access to a shard's bytes, in one place: every reader that reads part of a shard by its
byte offsets (``IndexedDataset``'s ``ds[i]``, the sidecar and view row reader, the media range
file) reads through the classes here.

:func:`open_ranges` ``(url)`` gives a :class:`ShardRanges` whose ``read(start, end)`` returns
exactly bytes ``[start, end)`` of the shard or raises an error naming the shard and the offset:
:class:`LocalRanges` (one descriptor, ``os.pread``; it survives a fork but each process should
open its own), :class:`RemoteRanges` (one ranged request per read, through
:func:`tarshards.storage.open_url`). For a shard compressed as one stream, the *uncompressed*
stream's ranges: :class:`GzipSeekRanges` (a local ``.tgz`` through ``indexed_gzip``'s seek points)
or :func:`unpacked_ranges` (decompressed once into an unlinked temporary file).

A byte range of a shard as a seekable read-only file: what a demuxer reads a tar member through.

:class:`RangeFile` ``(url, offset, size)`` is a file object over bytes ``[offset, offset+size)``
of the file at ``url``. It seeks freely; reads are served from blocks of ``block_size`` bytes
fetched on first use (``os.pread`` for local files, one ranged request per block for
``http(s)://``, ``s3://``, ``gs://`` through :func:`tarshards.storage.open_url`), the last
``blocks`` of them kept. Reads that follow one another (a decoder going forward) fetch ahead:
one block more, then two, four... up to ``max_ahead`` bytes a request; a jump starts over. So a
video demuxer that reads a member's header, its index at the end and then the packets of a
2-second clip fetches about those bytes only, not the member, in few requests.
``bytes_fetched`` and ``requests`` say what it cost.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from typing import Protocol

from ..errors import CompressionError, IntegrityError, StorageError, TarshardsError
from .open import open_url
from .paths import is_local, local_path

__all__ = [
    "GzipSeekRanges",
    "LocalRanges",
    "RangeFile",
    "RemoteRanges",
    "ShardRanges",
    "open_ranges",
    "unpacked_ranges",
]


class ShardRanges(Protocol):
    """Byte ranges of one shard: ``read(start, end)`` is exactly bytes ``[start, end)``."""

    url: str

    def read(self, start: int, end: int) -> bytes: ...

    def close(self) -> None: ...


class LocalRanges:
    """Byte ranges of a local file through one descriptor (``fd``) and ``os.pread``."""

    __slots__ = ("fd", "url")

    def __init__(self, path: str, url: str | None = None):
        self.url = url if url is not None else path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise StorageError("no such shard file", url=self.url) from None

    def read(self, start: int, end: int) -> bytes:
        n = end - start
        data = os.pread(self.fd, n, start)
        if len(data) < n:  # pread may return less (a signal, a huge read): finish the range
            parts = [data]
            got = len(data)
            while got < n:
                more = os.pread(self.fd, n - got, start + got)
                if not more:
                    raise IntegrityError(
                        f"the shard ends before byte {end} (is the index for "
                        "another version of this shard?)",
                        url=self.url,
                        offset=start + got,
                    )
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RemoteRanges:
    """Byte ranges of a remote shard: one ranged request per read."""

    __slots__ = ("storage_options", "url")

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.storage_options = storage_options

    def read(self, start: int, end: int) -> bytes:
        with open_url(
            self.url, offset=start, length=end - start, storage_options=self.storage_options
        ) as f:
            data = f.read()
        if len(data) != end - start:
            raise IntegrityError(
                f"asked for bytes {start}-{end}, got {len(data)} bytes (is the "
                "index for another version of this shard?)",
                url=self.url,
                offset=start,
            )
        return data

    def close(self) -> None:
        pass


def open_ranges(url: str, storage_options: dict | None = None) -> ShardRanges:
    """The byte ranges of the shard at ``url`` (a local path or file URL, or a remote URL)."""
    url = os.fspath(url)
    if is_local(url):
        return LocalRanges(local_path(url), url)
    return RemoteRanges(url, storage_options)


class GzipSeekRanges:
    """Byte ranges of the *uncompressed* stream of a local .tgz (one gzip stream for the whole
    tar), through the seek points ``indexed_gzip`` builds as it goes (a one-time decompression
    up to the farthest point read, then about 1 MiB per seek)."""

    __slots__ = ("f", "url")

    def __init__(self, path: str, url: str):
        import indexed_gzip

        self.f = indexed_gzip.IndexedGzipFile(path, spacing=1 << 20)
        self.url = url

    @staticmethod
    def available() -> bool:
        """Whether ``indexed_gzip`` is installed."""
        try:
            import indexed_gzip  # noqa: F401
        except ImportError:
            return False
        return True

    def read(self, start: int, end: int) -> bytes:
        from .seek import read_exact

        try:
            self.f.seek(start)
            return read_exact(self.f, end - start, self.url, start)
        except TarshardsError:
            raise
        except (OSError, ValueError) as exc:  # indexed_gzip's ZranError (an OSError) and the
            # like, on a damaged or cut stream: the reader's error class, naming the shard
            raise CompressionError(
                f"gzip stream unreadable: {exc}", url=self.url, offset=start
            ) from exc

    def close(self) -> None:
        self.f.close()


def unpacked_ranges(
    source: str, url: str, storage_options: dict | None = None, directory: str | None = None
) -> LocalRanges:
    """Byte ranges of the *uncompressed* stream of a shard compressed as one stream (zstd,
    bzip2, xz, lz4; gzip where ``indexed_gzip`` is missing): the shard decompressed once into a
    file of this process (in ``directory``, else the system's temporary directory), unlinked at
    once (it lasts as long as the descriptor, and nothing is left behind), then read as a plain
    shard. ``source``: where the compressed bytes are (the shard's URL, or its cached copy)."""
    import tempfile

    from ..tario import decompressed_chunks

    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="tarshards-unpacked-", suffix=".tar", dir=directory)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            with open_url(source, storage_options=storage_options) as f:
                chunks = iter(lambda: f.read(1 << 20), b"")
                for piece in decompressed_chunks(chunks, url):
                    out.write(piece)
        return LocalRanges(path, url)
    finally:
        os.close(fd)
        os.unlink(path)


class RangeFile(io.RawIOBase):
    """Bytes ``[offset, offset+size)`` of ``url`` as a seekable binary file (see the module).

    ``block_size``: the bytes fetched per request (a read that spans blocks fetches the missing
    ones in one request); ``blocks``: how many fetched blocks are kept; ``max_ahead``: the most
    bytes read ahead of a forward read. A context manager.
    """

    def __init__(
        self,
        url: str,
        offset: int,
        size: int,
        *,
        storage_options: dict | None = None,
        block_size: int = 32 << 10,
        blocks: int = 64,
        max_ahead: int = 256 << 10,
    ):
        super().__init__()
        if offset < 0 or size < 0:
            raise ValueError(f"bad byte range: offset={offset}, size={size}")
        if block_size < 1 or blocks < 1:
            raise ValueError("block_size and blocks must be >= 1")
        self.url = os.fspath(url)
        self.offset = int(offset)
        self.size = int(size)
        self.storage_options = storage_options
        self.block_size = int(block_size)
        self.max_blocks = int(blocks)
        self.max_ahead = int(max_ahead)
        self._ahead = 0  # blocks fetched ahead of a read that follows the one before
        self._last_end = -1
        self.bytes_fetched = 0
        self.requests = 0
        self._pos = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._ranges: ShardRanges | None = open_ranges(self.url, storage_options)

    # ---- io protocol ---------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            new = pos
        elif whence == 1:
            new = self._pos + pos
        elif whence == 2:
            new = self.size + pos
        else:
            raise ValueError(f"bad whence {whence}")
        if new < 0:
            raise ValueError(f"negative seek position {new}")
        self._pos = new
        return new

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def read(self, n: int | None = -1) -> bytes:
        start = self._pos
        end = self.size if n is None or n < 0 else min(self.size, start + n)
        if end <= start:
            return b""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if start == self._last_end:  # going forward: read ahead, more each time
            self._ahead = min(max(1, 2 * self._ahead), max(1, self.max_ahead // bs))
        else:
            self._ahead = 0
        self._last_end = end
        missing = [b for b in range(first, last + 1) if b not in self._blocks]
        if missing:
            top = min(missing[-1] + self._ahead, (self.size - 1) // bs)
            while top > missing[-1] and top in self._blocks:
                top -= 1
            self._fetch(missing[0], top)
        parts = []
        for b in range(first, last + 1):
            block = self._blocks[b]
            self._blocks.move_to_end(b)
            lo = max(start - b * bs, 0)
            hi = min(end - b * bs, len(block))
            parts.append(block[lo:hi])
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._pos = start + len(data)
        while len(self._blocks) > max(self.max_blocks, last - first + 1 + self._ahead):
            self._blocks.popitem(last=False)
        return data

    def prefetch(self, start: int, end: int) -> None:
        """Fetch bytes ``[start, end)`` (of the range) now, in one request: what a reader that
        knows where it will read next (a clip's packets, from a keyframe table) asks for."""
        start, end = max(start, 0), min(end, self.size)
        if end <= start:
            return
        bs = self.block_size
        blocks = [b for b in range(start // bs, (end - 1) // bs + 1) if b not in self._blocks]
        if blocks:
            self.max_blocks = max(self.max_blocks, len(blocks) + 8)  # kept while it is read
            self._fetch(blocks[0], blocks[-1])

    def _fetch(self, first: int, last: int) -> None:
        """Blocks ``first..last`` in one read of the underlying file."""
        bs = self.block_size
        lo = first * bs
        hi = min((last + 1) * bs, self.size)
        start = self.offset + lo
        n = hi - lo
        if self._ranges is None:
            raise ValueError("read of a closed RangeFile")
        data = self._ranges.read(start, start + n)
        self.requests += 1
        self.bytes_fetched += n
        for b in range(first, last + 1):
            self._blocks[b] = data[(b - first) * bs : (b - first + 1) * bs]

    def close(self) -> None:
        if self._ranges is not None:
            self._ranges.close()
            self._ranges = None
        self._blocks.clear()
        super().close()
