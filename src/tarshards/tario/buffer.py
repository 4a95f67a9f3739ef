"""Byte sources for the reader: chunked reads, the reader's buffer, plain and compressed input.

:class:`_Buffer` is a window over the input with absolute stream offsets; the reader parses
headers straight out of it. A plain (uncompressed) stream is read with ``readinto`` into the
buffer; gzip and zstd are decompressed chunk by chunk (:mod:`tarshards.compression`).
"""

from __future__ import annotations

from typing import Any, BinaryIO, Iterator, cast

from ..compression import by_magic, decompressed_chunks
from ..errors import TruncatedShardError
from .headers import CHUNK_SIZE


def read_chunks(
    stream: BinaryIO, chunk_size: int = CHUNK_SIZE, *, reuse: bool = False
) -> Iterator[bytes]:
    """Yield the bytes of ``stream`` in chunks of up to ``chunk_size`` bytes, until EOF.

    With ``reuse=True`` (streams with ``readinto``) every chunk is a memoryview of one buffer that
    the next chunk overwrites: a consumer must copy what it keeps before asking for more. This
    spares a fresh allocation (and its page faults) per chunk.
    """
    readinto = (
        getattr(stream, "readinto1", None) or getattr(stream, "readinto", None) if reuse else None
    )
    if readinto is not None:
        view = memoryview(bytearray(chunk_size))
        while True:
            n = readinto(view)
            if not n:
                return
            yield cast(bytes, view[:n])  # a memoryview: bytes-like, and valid until the next
    read = getattr(stream, "read1", None) or stream.read
    while True:
        data = read(chunk_size)
        if not data:
            return
        yield data


class _Buffer:
    """A window over the input with absolute stream offsets.

    ``buf`` is a reused bytearray; the unread input is ``buf[pos:end]`` (the array itself may be
    longer). ``pos`` may lie beyond ``end``: the data (or padding) of a member still to be skipped.
    The input is a binary stream with ``readinto`` (read straight into ``buf``: one copy from the
    kernel) or an iterable of byte chunks (copied in). Data handed out must be copied out as
    ``bytes``. The buffer grows by at most its own size per read, so a size declared in a header
    is never allocated before its bytes exist.
    """

    __slots__ = ("it", "readinto", "buf", "pos", "end", "base")

    def __init__(self, source):
        self.readinto = getattr(source, "readinto", None)
        self.it = None if self.readinto is not None else iter(source)
        self.buf = bytearray()
        self.pos = 0
        self.end = 0
        self.base = 0  # stream offset of buf[0]

    def _more(self, room: int) -> int:
        """Append up to ``room`` (or one chunk's worth of) bytes at ``end``; 0 at EOF."""
        buf, end = self.buf, self.end
        if self.readinto is not None:
            if len(buf) - end < room:
                buf.extend(bytes(end + room - len(buf)))
            view = memoryview(buf)
            try:
                got = self.readinto(view[end:]) or 0
            finally:
                view.release()
        else:
            chunk = next(self.it, None)
            if chunk is None:
                return 0
            got = len(chunk)
            if len(buf) - end < got:
                buf.extend(bytes(end + got - len(buf)))
            buf[end : end + got] = chunk
        self.end = end + got
        return got

    def fill(self, n: int) -> bool:
        """Make at least ``n`` bytes available at ``pos``; False at EOF before that.

        When a skip ran past the end of the stream, ``pos > end`` afterwards (and ``base`` is the
        length of the stream): the caller can tell a cut inside a member from a clean end.
        """
        pos, end = self.pos, self.end
        if end - pos >= n:
            return True
        if pos > end:  # a skip ran past the buffer: read and discard input
            skip = pos - end
            self.base += end
            self.pos = self.end = 0
            while skip:
                got = self._more(CHUNK_SIZE)
                if not got:
                    self.pos = skip  # beyond end: the stream ends inside the skipped bytes
                    return False
                if got <= skip:
                    skip -= got
                    self.base += got
                    self.end = 0
                else:
                    self.pos = skip
                    skip = 0
            pos, end = self.pos, self.end
            if end - pos >= n:
                return True
        if pos:  # move the unread tail to the front
            buf = self.buf
            buf[: end - pos] = buf[pos:end]
            self.base += pos
            self.pos = 0
            self.end = end - pos
        while self.end < n:
            # ask for at least a chunk, and for at most as much as is already there
            if not self._more(max(CHUNK_SIZE, min(n - self.end, self.end))):
                return False
        return True

    def drain(self, limit: int) -> None:
        """Read and discard what follows, up to ``limit`` bytes (or the end of the stream).

        This lets the decompression layer check its end (a gzip trailer, a truncated frame)
        after the end-of-archive marker. Whether it is reached depends only on how many bytes
        follow the marker, never on how the input was cut into chunks.
        """
        total = max(0, self.end - self.pos)
        while total <= limit:
            self.pos = self.end = 0
            got = self._more(CHUNK_SIZE)
            if not got:
                return
            total += got

    def offset(self) -> int:
        return self.base + self.pos


class PlainStream:
    """The input of a plain (uncompressed) tar stream, read with ``readinto`` straight into the
    reader's buffer. ``first`` is what was already read to sniff for compression."""

    def __init__(self, stream: Any, first: bytes = b""):
        self._first = memoryview(first)
        self._readinto = getattr(stream, "readinto1", None) or stream.readinto

    def readinto(self, view) -> int:
        if self._first:
            n = min(len(view), len(self._first))
            view[:n] = self._first[:n]
            self._first = self._first[n:]
            return n
        return self._readinto(view) or 0


def tar_byte_source(stream: BinaryIO, source=None, chunk_size: int = CHUNK_SIZE):
    """What :func:`iter_tar_batches` reads from ``stream``: gzip and zstd (found by their magic
    bytes) are decompressed chunk by chunk; a plain tar is read straight into the buffer."""
    if getattr(stream, "readinto", None) is None:
        return decompressed_chunks(read_chunks(stream, chunk_size), source)
    first = b""
    while len(first) < 4:
        piece = (getattr(stream, "read1", None) or stream.read)(chunk_size)
        if not piece:
            break
        first += piece
    if by_magic(first) is not None:
        return decompressed_chunks(_chain_chunks(first, read_chunks(stream, chunk_size)), source)
    return PlainStream(stream, first)


def _chain_chunks(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _read_data(b: _Buffer, size: int, padded: int, source, name, start) -> bytes:
    """The ``size`` data bytes at ``b.pos`` (then skip the padding, which may lie beyond the end
    of the stream: the next read sees that)."""
    if not b.fill(size):
        raise TruncatedShardError(
            f"truncated tar stream: member needs {size} bytes, stream ended after "
            f"{max(0, b.end - b.pos)}",
            url=source,
            member=name,
            offset=start,
        )
    data = bytes(b.buf[b.pos : b.pos + size])
    b.pos += padded
    return data
