"""Byte sources for the reader: chunked reads, the reader's buffer, plain and compressed input.

:class:`_Buffer` is a window over the input with absolute stream offsets; the reader parses
headers straight out of it. A plain (uncompressed) stream is read with ``readinto`` into the
buffer; gzip and zstd are decompressed chunk by chunk (:mod:`tarshards.format.compression`).

A local plain file (an ``open(path, "rb")`` file object, buffered or not) is memory-mapped
instead (:class:`MappedFile`, read through :class:`_MappedBuffer`): the reader parses the map in
place and each member's bytes are copied once, from the page cache into the ``bytes`` value it
hands out, with no read buffer in between; or, zero-copy (``iter_tar(..., copy=False)``), not at
all: members are read-only ``memoryview`` slices of the map. Pages behind the reader are
released as it goes (``MADV_DONTNEED``), so the resident memory stays that of a window, not of
the file; a view of a released page stays valid (a read-only file mapping faults the page back
in from the page cache).
"""

from __future__ import annotations

import io
import mmap
import os
import stat
from typing import Any, BinaryIO, Iterator, cast

from ..errors import TruncatedShardError
from ..format.compression import decompressed_chunks, not_plain
from .headers import BLOCK, CHUNK_SIZE


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

    ``size`` is how much it asks of the input at a time (and so about how large it grows): a
    reader among many (the planned pipeline's virtual readers) passes a small one.
    """

    __slots__ = ("base", "buf", "end", "it", "origin", "pos", "readinto", "size")

    mapped = False  # the whole input is in ``buf`` (see _MappedBuffer)

    def __init__(self, source, origin: int = 0, size: int = CHUNK_SIZE):
        self.readinto = getattr(source, "readinto", None)
        self.it: Any = None if self.readinto is not None else iter(source)
        self.buf: Any = bytearray()
        self.pos = 0
        self.end = 0
        self.base = origin  # stream offset of buf[0]
        self.origin = origin  # stream offset of the first byte read
        self.size = size

    def _more(self, room: int) -> int:
        """Append up to ``room`` (or one chunk's worth of) bytes at ``end``; 0 at EOF."""
        buf, end = self.buf, self.end
        if self.readinto is not None:
            if len(buf) - end < room:
                buf.extend(bytes(end + room - len(buf)))
            view = memoryview(buf)
            part = view[end:]
            try:
                got = self.readinto(part) or 0
            finally:
                # both released here: a reference to the slice that outlives the call (a frame
                # kept by a logged exception's traceback, say) must not keep buf from growing
                part.release()
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
                got = self._more(self.size)
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
            if not self._more(max(self.size, min(n - self.end, self.end))):
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
            got = self._more(self.size)
            if not got:
                return
            total += got

    def offset(self) -> int:
        return self.base + self.pos

    def release(self, pos: int) -> None:
        """Nothing before ``pos`` is read again (a mapped buffer gives those pages back)."""

    def close(self) -> None:
        """Let go of the input (a mapped buffer unmaps the file)."""


# pages of a mapped file given back to the kernel once the reader is this far past them (they
# count in the process's RSS until then: 8 MiB measured 6 MiB more peak RSS in bench/run.py's
# memory row than 2 MiB, at the same speed for copies)
_RELEASE = 2 << 20
# a mapped file read with copies (``bytes`` members) is parsed at most this many bytes at a
# time: a batch's fresh ``bytes`` then fit in the CPU's L2 cache with the previous batch's,
# which the consumer has freed by the time the next is copied, so each copy writes to memory
# still hot from the last (a window of 1 MiB of 100 KB members wrote to cold memory: ~20% of
# the raw rate). Zero-copy views copy nothing and keep the header window (``size``).
COPY_WINDOW = 256 << 10
# a batch of members read straight into their bytes (DirectFile) holds about this many bytes
# of them past what the buffer held: DIRECT_WINDOW in _c/members.c, which the scan uses (each
# batch costs ~1.3 us of Python; see there)
DIRECT_WINDOW = 1 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


class MappedFile:
    """A local plain tar file, memory-mapped, from the position its file object was at.

    Made by :func:`tar_byte_source`; :func:`iter_tar_batches` reads the map in place. It is a
    readable stream too (``readinto``), for a consumer that treats it as one. The map is closed
    when the reader finishes (or :meth:`close`); the file object stays the caller's. While
    memoryviews of the map are alive (zero-copy members), :meth:`close` only drops this
    object's reference: the last view to go unmaps it (``mmap.close`` would raise).

    ``stop``: the reader sees the end of the input there (a byte range of the file).
    :meth:`part` gives such a range of the same map, which it does not close (the whole
    file's object does).
    """

    def __init__(self, mapping: mmap.mmap, start: int, stop: int | None = None):
        self.map = mapping
        self.start = start
        self.stop = len(mapping) if stop is None else min(stop, len(mapping))
        self._pos = start
        self._owner = True
        self._released = start & ~(mmap.PAGESIZE - 1)  # nothing before the start is read

    def part(self, start: int, stop: int | None = None) -> MappedFile:
        """Bytes ``start:stop`` of the same map, read as a file of their own (closing it leaves
        the map open)."""
        part = MappedFile(self.map, start, self.stop if stop is None else min(stop, self.stop))
        part._owner = False
        return part

    def release(self, pos: int) -> None:
        """Nothing before ``pos`` is read again: its pages are given back to the kernel
        (``MADV_DONTNEED``) each time ``_RELEASE`` bytes of them have accumulated."""
        upto = min(pos, self.stop) & ~(mmap.PAGESIZE - 1)
        if _DONTNEED is not None and upto - self._released >= _RELEASE:
            start = self._released
            self._released = upto
            try:
                self.map.madvise(_DONTNEED, start, upto - start)
            except (OSError, ValueError):  # pragma: no cover - an advice, never an error
                pass

    def readinto(self, view) -> int:
        n = min(len(view), self.stop - self._pos)
        if n <= 0:
            return 0
        view[:n] = self.map[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        if not self._owner:  # a part: the whole file's object closes the map
            return
        try:
            self.map.close()
        except BufferError:  # views of it are alive: the last one to go unmaps it
            pass

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _MappedBuffer(_Buffer):
    """The reader's buffer over a :class:`MappedFile`: ``buf`` is the map, ``end`` the file's stop.

    Nothing is ever read or moved: :meth:`fill` only says whether the bytes are there; ``size``
    is the window of headers the reader parses at a time (when it copies members out, at most
    :data:`COPY_WINDOW`).
    """

    __slots__ = ("file",)

    mapped = True

    def __init__(self, file: MappedFile, origin: int = 0, size: int = CHUNK_SIZE):
        self.file = file
        self.readinto = None
        self.it = None
        self.buf = file.map
        self.pos = file.start
        self.end = file.stop
        self.base = origin - file.start
        self.origin = origin
        self.size = size

    def fill(self, n: int) -> bool:
        return self.end - self.pos >= n

    def drain(self, limit: int) -> None:
        pass  # a plain file: nothing after the end-of-archive marker needs reading

    def release(self, pos: int) -> None:
        self.file.release(pos)

    @property
    def released(self) -> int:
        """Where the pages given back end (those before it are no longer mapped in)."""
        return self.file._released

    def close(self) -> None:
        self.file.close()


def map_local(stream, length: int = -1) -> MappedFile | None:
    """A :class:`MappedFile` of ``stream`` when it is a local regular file holding a plain tar
    from its current position on; else ``None`` (nothing read, the position unchanged).
    ``length >= 0``: the input ends that many bytes after the position (a byte range)."""
    if type(stream) not in (io.FileIO, io.BufferedReader) or not stream.readable():
        return None
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        start = stream.tell()
        if start >= st.st_size:
            return None
        if length == 0:
            return None
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # a file system without mmap, a pipe that says it is a file
        return None
    if len(mapping) <= start or not_plain(mapping[start : start + BLOCK]):
        mapping.close()  # compressed: read as a stream (decompressed chunk by chunk)
        return None
    return MappedFile(mapping, start, start + length if length >= 0 else None)


class DirectFile:
    """A local plain tar file read with ``pread`` from its own offset (the file object's position
    is left alone), for :func:`iter_tar_batches`: the C scan reads the rest of a member that the
    buffer cuts straight into the member's ``bytes`` (``fd``, ``pos``: the file offset after
    what the buffer holds; ``stop``: where the input ends). No map: no page faults, whatever
    folios the page cache holds the file in."""

    def __init__(self, stream, start: int, stop: int):
        self.stream = stream  # kept open while the reader reads it
        self.fd = stream.fileno()
        self.pos = start
        self.stop = stop

    def readinto(self, view) -> int:
        n = min(len(view), self.stop - self.pos)
        if n <= 0:
            return 0
        got = os.preadv(self.fd, [view[:n]] if n < len(view) else [view], self.pos)
        self.pos += got
        return got

    # a member the buffer cuts with at least this much still to read is read straight into its
    # bytes; less is left to the buffer's next fill (a syscall costs more than a short copy)
    min_read = 16 << 10

    def state(self) -> tuple:
        """``(fd, pos, stop, min_read)``, as the C scan takes them."""
        return self.fd, self.pos, self.stop, self.min_read

    def close(self) -> None:
        pass  # the file object is the caller's


def direct_local(stream, length: int = -1) -> DirectFile | None:
    """A :class:`DirectFile` of ``stream`` when it is a local regular file holding a plain tar
    from its current position on; else ``None`` (nothing read, the position unchanged)."""
    if type(stream) not in (io.FileIO, io.BufferedReader) or not stream.readable():
        return None
    if not hasattr(os, "preadv"):
        return None
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or length == 0:
            return None
        start = stream.tell()
        stop = st.st_size if length < 0 else min(st.st_size, start + length)
        if start >= stop:
            return None
        head = os.pread(fd, BLOCK, start)
    except (OSError, ValueError):
        return None
    if not_plain(head):
        return None  # compressed: read as a stream (decompressed chunk by chunk)
    return DirectFile(stream, start, stop)


_PRIME = 4 << 20
_primed = False


def _prime_heap() -> None:
    """Once a process: allocate and free one block of :data:`_PRIME` bytes (``calloc``: mapped
    and unmapped, its pages never touched).

    glibc's ``malloc`` gives the top of its heap back to the kernel whenever more than its trim
    threshold (128 KiB until the process frees a block larger than that which was
    memory-mapped, then twice that block) lies free there. Members of ~100 KB, each a ``bytes``
    the consumer frees before the next batch is read, then grow and trim the heap over and
    over, and every grown page is a page fault and a zeroed page: measured over 50 MB shards
    of 100 KB samples, 5,000-15,000 faults a 406 MB pass, 1.4-2x the time of the pass.
    Freeing one mapped block of 4 MiB raises the thresholds (to 4 and 8 MiB: ``malloc`` does it
    itself when a program frees such a block, which most programs do early), after which the
    freed members' memory is reused, not given back (0 faults a pass). Where ``mallopt`` set
    the thresholds, or another allocator is in use, this is one allocation freed: no effect."""
    global _primed
    if not _primed:
        _primed = True
        block = bytes(_PRIME)  # calloc: a fresh map, not written
        del block


class _DirectBuffer(_Buffer):
    """The reader's buffer over a :class:`DirectFile` (``file``: for the scan's direct reads)."""

    __slots__ = ("file",)

    def __init__(self, file: DirectFile, origin: int = 0, size: int = CHUNK_SIZE):
        super().__init__(file, origin, size)
        self.file = file


def reader_buffer(source, origin: int = 0, size: int = CHUNK_SIZE) -> _Buffer:
    """The reader's buffer over what :func:`tar_byte_source` gave (or any iterable of chunks),
    reading (or, over a map, parsing) ``size`` bytes at a time."""
    _prime_heap()  # (the members it copies out come from malloc's heap: see there)
    if isinstance(source, MappedFile):
        return _MappedBuffer(source, origin, size)
    if isinstance(source, DirectFile):
        return _DirectBuffer(source, origin, size)
    return _Buffer(source, origin, size)


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


def tar_byte_source(
    stream: BinaryIO,
    source=None,
    chunk_size: int = CHUNK_SIZE,
    *,
    mapped: bool = True,
    direct: bool = False,
):
    """What :func:`iter_tar_batches` reads from ``stream``: gzip and zstd (found by their magic
    bytes) are decompressed chunk by chunk; a plain tar is read straight into the buffer, and a
    local plain file (``open(path, "rb")``) is memory-mapped (:class:`MappedFile`) unless
    ``mapped=False``. A mapped file must not be truncated while it is read (as with any map,
    touching pages past a new end kills the process with SIGBUS); the writers here never do
    that (they write to a temporary name and rename).

    ``direct=True`` (for readers that copy members out: the sample readers pass it unless
    ``copy=False``): a local plain file is read with ``pread`` instead (:class:`DirectFile`):
    the reader's buffer takes headers and small members, and a large member that the buffer
    cuts is read straight into its ``bytes`` (one copy from the page cache, no page faults).
    Measured (``bench/bench_reads.py``) it reads 100 KB samples faster than the map in every
    page-cache state (the map's cost is its page faults, one per folio or per 64 KB, so it
    depends on how the pages came into the cache), and 4.5 KB samples too. A map serves
    zero-copy views (``copy=False``)."""
    if direct:
        by_pread = direct_local(stream)
        if by_pread is not None:
            return by_pread
    if mapped:
        file = map_local(stream)
        if file is not None:
            return file
    if getattr(stream, "readinto", None) is None:
        return decompressed_chunks(read_chunks(stream, chunk_size), source)
    first = b""
    while len(first) < BLOCK:  # enough to tell a tar header from a compression or a zip
        piece = (getattr(stream, "read1", None) or stream.read)(chunk_size)
        if not piece:
            break
        first += piece
    if not_plain(first):
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
