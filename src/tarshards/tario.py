"""Reading and writing tar streams, fast.

The reader is a header parser of our own over large buffered reads: it never seeks, so it works on
files, pipes, stdin and network streams alike, and it holds at most one chunk plus the member being
read. It understands ustar, GNU long names/links, GNU sparse members (old GNU and pax 0.0, 0.1 and
1.0: rebuilt with their holes as zeros) and pax extended and global headers, skips everything that
is not a regular file, and detects gzip and zstd compression by the first bytes of the stream
(:mod:`tarshards.compression`).

What the reader accepts and refuses (the same at every read size, in C and in Python):

* a stream that stops on a block boundary after a complete member, without the end-of-archive
  marker, is accepted (as tar and tarfile do); a stream cut anywhere else (inside a header, inside
  a member's data, or inside the zero padding after the last member's data) raises
  :class:`~tarshards.errors.TruncatedShardError` once every complete member has been yielded;
* a 0-byte shard is not a tar archive (:class:`~tarshards.errors.TruncatedShardError`);
* a lone zero block followed by more headers does not end the archive: a
  :class:`~tarshards.errors.TarshardsWarning` says so and the reader goes on (GNU tar's
  ``--ignore-zeros``), so the members after it are not lost; two zero blocks end the archive;
* a declared size is never allocated before its bytes have arrived, so a header that claims a
  terabyte costs no more memory than the bytes that are really there.

The writer emits deterministic ustar headers (fixed mtime, owner and mode) and only adds a pax header
where a name or a size does not fit, so equal samples always give byte-identical shards.
"""

from __future__ import annotations

import io
import operator
import struct
import warnings
from zlib import adler32
from typing import BinaryIO, Iterable, Iterator

from .compression import by_magic, decompressed_chunks
from .compression import is_compressed_name, open_compressed_writer  # noqa: F401 (re-exported)
from .errors import (
    EncodeError,
    HeaderError,
    ShardFormatError,
    TarshardsWarning,
    TruncatedShardError,
)

try:  # optional C accelerator (see _speedups.c); the Python code below is the reference
    from ._speedups import scan_members as _scan_members
    from ._speedups import ustar_parts as _ustar_parts
except ImportError:  # pragma: no cover - built by default; pure Python works the same
    _scan_members = _ustar_parts = None

__all__ = [
    "CHUNK_SIZE",
    "TarMemberWriter",
    "decompressed_chunks",
    "iter_tar",
    "iter_tar_batches",
    "open_tar_bytes",
    "tar_byte_source",
    "read_chunks",
    "tar_header",
]

BLOCK = 512
CHUNK_SIZE = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (0x30, 0x00, 0x37)  # '0', '\0', '7' (contiguous file)
_GNU_SPARSE = 0x53  # 'S'
_GNU_LONGNAME = 0x4C  # 'L'
_GNU_LONGLINK = 0x4B  # 'K'
_PAX = 0x78  # 'x'
_PAX_GLOBAL = 0x67  # 'g'
_META = (_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL)
_NO_DATA = (0x31, 0x32, 0x33, 0x34, 0x35, 0x36)  # links, devices, directories, fifos
_MAX_META = 1 << 20  # longest accepted long-name / pax payload
_MAX_SPARSE = 1 << 30  # largest real size a sparse member may be rebuilt to
_OCTAL_WEIGHTS = tuple(8**k for k in range(5, -1, -1))
_DRAIN_LIMIT = 1 << 20  # bytes of trailing padding read after the end-of-archive marker
# pax keys that change how a member is read: while a global header sets one of them, every
# member goes through the general path
_PAX_READ_KEYS = frozenset(("path", "size"))
_SPARSE_KEYS = frozenset(
    (
        "GNU.sparse.map",
        "GNU.sparse.size",
        "GNU.sparse.major",
        "GNU.sparse.minor",
        "GNU.sparse.realsize",
        "GNU.sparse.offset",
        "GNU.sparse.numbytes",
        "GNU.sparse.numblocks",
    )
)
_SPARSE00 = ("GNU.sparse.offset", "GNU.sparse.numbytes")  # repeated records: kept as lists


# ---------------------------------------------------------------------------------------------
# byte sources
# ---------------------------------------------------------------------------------------------


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
            yield view[:n]
    read = getattr(stream, "read1", None) or stream.read
    while True:
        data = read(chunk_size)
        if not data:
            return
        yield data


# ---------------------------------------------------------------------------------------------
# header parsing
# ---------------------------------------------------------------------------------------------


def _nts(field: bytes) -> bytes:
    """A NUL-terminated string field."""
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def _number(field: bytes) -> int:
    """An octal number field, or GNU base-256 when the high bit is set."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        if field[0] & 0x40:  # negative base-256
            value -= 1 << (8 * len(field) - 1)
        return value
    field = _nts(field).strip(b" \0")
    return int(field, 8) if field else 0


def _checksum_ok(hdr: bytes) -> bool:
    """Verify a header checksum exactly: the unsigned byte sum (with the checksum field counted
    as spaces), or the signed sum that some old writers stored (tarfile accepts both)."""
    stored = _nts(hdr[148:156]).strip(b" \0")
    if not stored:
        return False
    try:
        want = int(stored, 8)
    except ValueError:
        return False
    unsigned = sum(hdr) - sum(hdr[148:156]) + 256
    if unsigned == want:
        return True
    signed = unsigned - 256 * (
        sum(1 for b in hdr if b > 127) - sum(1 for b in hdr[148:156] if b > 127)
    )
    return signed == want


# The general path checks header checksums at C speed: the low half of Adler-32 is
# ``1 + sum(bytes) mod 65521``, and the byte sum of a half block (256 bytes) is below 65521, so the
# two halves give the exact unsigned sum. A mismatch is decided by :func:`_checksum_ok`.
def _header_sum(hdr: bytes) -> int:
    """The unsigned checksum of a header block (the checksum field counted as spaces)."""
    return (adler32(hdr[:256]) & 0xFFFF) + (adler32(hdr[256:]) & 0xFFFF) + 254 - sum(hdr[148:156])


def _chk_value(hdr: bytes) -> int:
    """The stored checksum (an impossible value when the field is not plain octal)."""
    chk = hdr[148:156]
    try:
        return int(chk[:6], 8) if chk[6] in (0, 32) else int(chk.strip(b" \0"), 8)
    except ValueError:
        return -1


def _first_bad_header(headers: list) -> int:
    """Index of the first header whose checksum is wrong, or -1 (all headers checked at once)."""
    import numpy as np

    rows = np.frombuffer(b"".join(headers), np.uint8).reshape(len(headers), BLOCK)
    field = rows[:, 148:156]
    digits = field[:, :6].astype(np.int64) - 48
    stored = digits @ _OCTAL_WEIGHTS
    sums = rows.sum(axis=1, dtype=np.int64) - field.sum(axis=1, dtype=np.int64) + 256
    ok = (
        (sums == stored)
        & (digits >= 0).all(axis=1)
        & (digits < 8).all(axis=1)
        & ((field[:, 6] == 0) | (field[:, 6] == 32))
    )
    if ok.all():
        return -1
    for i in np.flatnonzero(~ok):  # unusual formatting of the field: decide exactly
        if not _checksum_ok(headers[i]):
            return int(i)
    return -1


def _parse_pax(payload: bytes, source, offset) -> dict:
    """Parse pax records ``"%d %s=%s\\n"`` into a dict of str -> str (an empty value is kept: it
    deletes the key when merged). GNU sparse 0.0 offsets/numbytes repeat: kept as lists."""
    out: dict = {}
    pos = 0
    n = len(payload)
    while pos < n:
        if payload[pos] == 0:
            break
        sp = payload.find(b" ", pos, pos + 21)
        if sp < 0:
            raise HeaderError("malformed pax header record", url=source, offset=offset)
        length = payload[pos:sp]
        if not length.isdigit():
            raise HeaderError("malformed pax header length", url=source, offset=offset)
        length = int(length)
        record = payload[sp + 1 : pos + length]
        if pos + length > n or not record.endswith(b"\n") or b"=" not in record:
            raise HeaderError("malformed pax header record", url=source, offset=offset)
        key, _, value = record[:-1].partition(b"=")
        key = key.decode("utf-8", "surrogateescape")
        value = value.decode("utf-8", "surrogateescape")
        if key in _SPARSE00:
            out.setdefault(key, []).append(value)
        else:  # GNU.sparse.name is the real path of a sparse member (the later record wins)
            out["path" if key == "GNU.sparse.name" else key] = value
        pos += length
    return out


def _merge_pax(base: dict, records: dict, keep: dict | None = None) -> dict:
    """``base`` updated by ``records`` (an empty value deletes the key, as POSIX says); keys of
    ``keep`` (the records of an earlier extended header for the same member) win."""
    out = dict(base)
    for key, value in records.items():
        if keep is not None and key in keep:
            continue
        if value == "":
            out.pop(key, None)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------


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

    def __init__(self, stream: BinaryIO, first: bytes = b""):
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


def iter_tar(
    chunks: Iterable[bytes], source=None, *, verify: bool = True, drain: bool = True
) -> Iterator[tuple[str, bytes, int]]:
    """Yield ``(name, data, offset)`` for each regular member of a tar byte stream.

    ``chunks`` is an iterable of bytes (see :func:`read_chunks` and :func:`decompressed_chunks`).
    ``offset`` is the position of the member's first header block in the uncompressed stream.
    Directories, links, devices and other non-regular members are skipped; GNU sparse members
    are rebuilt. The stream ends at the end-of-archive marker (or at EOF on a block boundary).
    ``verify`` checks header checksums. A truncated or malformed stream raises a
    :class:`ShardFormatError` (:class:`TruncatedShardError`, :class:`HeaderError`,
    :class:`CompressionError`) naming ``source``, the member and the byte offset, after every
    complete member before the damage has been yielded.
    """
    for batch in iter_tar_batches(chunks, source, verify=verify, drain=drain):
        yield from batch


def iter_tar_batches(
    chunks: Iterable[bytes],
    source=None,
    *,
    verify: bool = True,
    drain: bool = True,
    accelerate: bool = True,
) -> Iterator[list[tuple[str, bytes, int]]]:
    """Like :func:`iter_tar`, but yields the members in lists (one list per buffer's worth).

    This is the reader's hot path. Plain ustar members that lie wholly inside the current buffer
    are parsed in a tight loop and their header checksums verified together (vectorised) before
    any of them is handed out; everything else (extended headers, links, members that span
    buffers, the end of the archive) goes through the general path one header at a time.
    With ``accelerate`` (default) the fast loop runs in C when the extension is built.
    """
    b = _Buffer(chunks)
    long_name = None  # a GNU long name for the member being assembled
    long_first = False  # the long name came before the member's pax header (it wins)
    pax: dict | None = None  # the pax keys for the member being assembled (globals included)
    global_pax: dict = {}
    global_read = False  # the global keys change how members are read: no fast path
    start = None  # offset of the first header of the member being assembled
    last = None  # the member read or skipped last (for the error when the stream is cut after it)
    fill = b.fill
    buf = b.buf
    pos = 0
    end = 0
    base = 0
    regular = _REGULAR
    zero = _ZERO_BLOCK
    scan = _scan_members if accelerate else None
    while True:
        if start is None and not global_read and end - pos >= BLOCK:
            if scan is not None:
                batch, pos = scan(buf, pos, base, end)  # stops where the general path decides
                if batch:
                    last = batch
                    yield batch
            else:  # the same fast path in Python: plain members wholly inside the buffer
                batch = []
                headers = []
                while end - pos >= BLOCK:
                    hdr = buf[pos : pos + BLOCK]
                    if hdr[156] != 0x30 or hdr[135] or hdr[345]:
                        break  # not a plain regular member with a canonical size field
                    try:
                        size = int(hdr[124:135], 8)
                    except ValueError:
                        break
                    if size < 0 or end - pos - BLOCK < size:
                        break
                    nul = hdr.find(0, 0, 100)
                    name = (hdr[:nul] if nul >= 0 else hdr[:100]).decode("utf-8", "surrogateescape")
                    batch.append((name, bytes(buf[pos + BLOCK : pos + BLOCK + size]), base + pos))
                    headers.append(hdr)
                    pos += BLOCK + ((size + 511) & ~511)
                if batch:
                    bad = _first_bad_header(headers) if verify else -1
                    if bad >= 0:
                        if bad:
                            yield batch[:bad]
                        raise _bad_header(headers[bad], source, batch[bad][2])
                    last = batch
                    yield batch
                    continue
        if end - pos < BLOCK:
            b.pos = pos
            if not fill(BLOCK):
                _at_eof(b, source, start, long_name, pax, last)  # raises unless a clean end
                return
            pos = b.pos
            end = b.end
            base = b.base
        hdr = bytes(buf[pos : pos + BLOCK])
        if hdr == zero:
            if start is not None:
                raise HeaderError(
                    "an extended header is followed by the end-of-archive marker "
                    "instead of its member",
                    url=source,
                    member=_pending_name(long_name, pax),
                    offset=start,
                )
            b.pos = pos + BLOCK
            if _archive_ends(b, source, drain):
                return
            pos = b.pos
            end = b.end
            base = b.base
            continue
        if verify and _header_sum(hdr) != _chk_value(hdr) and not _checksum_ok(hdr):
            raise _bad_header(hdr, source, base + pos)
        try:
            size = int(hdr[124:135], 8) if hdr[135] == 0 else _number(hdr[124:136])
        except ValueError:
            size = _size_field(hdr, source, base + pos)
        if size < 0:
            size = _size_field(hdr, source, base + pos)
        typeflag = hdr[156]
        fresh = start is None  # this header starts a member (no extended header before it)
        if fresh:
            start = base + pos
        pos += BLOCK
        meta = pax if pax is not None else (global_pax if global_read else None)
        if meta is not None and "size" in meta and typeflag not in _META:
            size = _pax_size(meta, source, start)  # (not for the extended headers themselves)
        padded = (size + 511) & ~511
        if typeflag in regular or typeflag == _GNU_SPARSE:
            name = _member_name(
                hdr, long_name if long_first or meta is None or "path" not in meta else None, meta
            )
            if not typeflag and name[-1:] == "/":  # pre-POSIX directory (typeflag NUL)
                last = (name, start, base + pos + size)
                pos += padded
                long_name = pax = start = None
                long_first = False
                continue
            if typeflag == _GNU_SPARSE:
                if meta is not None and not _SPARSE_KEYS.isdisjoint(meta):
                    raise HeaderError(
                        "an old-GNU sparse member with pax GNU.sparse records "
                        "(contradictory sparse maps)",
                        url=source,
                        member=name,
                        offset=start,
                    )
                b.pos = pos
                chunks_map, realsize = _old_gnu_sparse_map(hdr, b, source, name, start)
                pos = b.pos
                end = b.end
                base = b.base
            if end - pos >= size:
                data = bytes(buf[pos : pos + size])
                pos += padded
            else:
                b.pos = pos
                data = _read_data(b, size, padded, source, name, start)
                pos = b.pos
                end = b.end
                base = b.base
            if typeflag == _GNU_SPARSE:
                data = _unsparse(data, chunks_map, realsize, source, name, start)
            elif meta is not None and not _SPARSE_KEYS.isdisjoint(meta):
                data = _pax_unsparse(data, meta, source, name, start)
            last = (name, start, None)
            yield [(name, data, start)]
            long_name = pax = start = None
            long_first = False
            continue
        # metadata and non-regular members
        if typeflag in _META:
            if size > _MAX_META:
                raise HeaderError("implausibly large extended header", url=source, offset=start)
            if end - pos >= size:
                payload = bytes(buf[pos : pos + size])
                pos += padded
            else:
                b.pos = pos
                payload = _read_data(b, size, padded, source, None, start)
                pos = b.pos
                end = b.end
                base = b.base
            if typeflag == _GNU_LONGNAME:
                if long_name is None:  # the first of several long names wins (as in tarfile)
                    long_name = _nts(payload).decode("utf-8", "surrogateescape")
                    long_first = pax is None or "path" not in pax  # the outer name wins
            elif typeflag == _PAX:
                records = _parse_pax(payload, source, start)
                if pax is None:
                    pax = _merge_pax(global_pax, records)
                else:  # a second pax header for one member: the first one's keys win
                    if not (_SPARSE_KEYS.isdisjoint(pax) or _SPARSE_KEYS.isdisjoint(records)):
                        raise HeaderError(
                            "two pax headers with GNU.sparse records for one "
                            "member (contradictory sparse maps)",
                            url=source,
                            member=_pending_name(long_name, pax),
                            offset=start,
                        )
                    pax = _merge_pax(pax, records, pax)
            elif typeflag == _PAX_GLOBAL:
                records = _parse_pax(payload, source, start)
                if not _SPARSE_KEYS.isdisjoint(records):
                    raise HeaderError(
                        "GNU.sparse records in a pax global header (a sparse map "
                        "belongs to one member)",
                        url=source,
                        offset=start,
                    )
                global_pax = _merge_pax(global_pax, records)
                global_read = not _PAX_READ_KEYS.isdisjoint(global_pax)
                if fresh:  # a global header is no member's first header
                    last = (None, start, None)
                    start = None
            continue  # long link names are irrelevant: links are skipped
        # directories, links, devices, fifos: no data; other types: skip their data
        if typeflag not in _NO_DATA:
            last = (_member_name(hdr, long_name, meta), start, base + pos + size)
            pos += padded
        long_name = pax = start = None
        long_first = False


def _member_name(hdr: bytes, long_name, meta) -> str:
    """The name of a member: its long name, else its pax path, else the header's name field
    (with the ustar prefix; GNU headers keep atime there and have none)."""
    if long_name is not None:
        return long_name
    if meta is not None:
        path = meta.get("path")
        if path:
            path = path.rstrip("/")
            if path:
                return path
    nul = hdr.find(0, 0, 100)
    raw = hdr[:nul] if nul >= 0 else hdr[:100]
    if hdr[345] != 0 and hdr[257:263] == b"ustar\0":  # POSIX only
        raw = _nts(hdr[345:500]) + b"/" + raw
    return raw.decode("utf-8", "surrogateescape")


def _pending_name(long_name, pax):
    if long_name is not None:
        return long_name
    return pax.get("path") if pax is not None else None


def _archive_ends(b: _Buffer, source, drain: bool) -> bool:
    """``b.pos`` is just past a zero block: True if the archive ends here (a second zero block or
    the end of the stream), False for a lone zero block followed by more headers (a warning)."""
    at = b.offset() - BLOCK
    if not b.fill(BLOCK):
        if bytes(b.buf[b.pos : b.end]).strip(b"\0"):
            raise TruncatedShardError(
                "truncated tar stream: a zero block, then an incomplete header block",
                url=source,
                offset=at + BLOCK,
            )
        return True
    if b.buf[b.pos : b.pos + BLOCK] == _ZERO_BLOCK:
        b.pos += BLOCK
        if drain:
            b.drain(_DRAIN_LIMIT)
        return True
    warnings.warn(
        TarshardsWarning(
            f"a lone zero block at offset {at} of {source or 'a tar stream'}, and more headers after "
            f"it: reading on (as tar --ignore-zeros does)"
        ),
        stacklevel=4,
    )
    return False


def _at_eof(b: _Buffer, source, start, long_name, pax, last) -> None:
    """The stream ended where a header should start: raise unless that is a clean end."""
    if start is not None or b.end > b.pos:
        _eof_in_header(b, source, start, long_name, pax)
    if b.pos > b.end:  # the stream ends inside the data or padding of the last member
        if isinstance(last, list):  # a batch of plain members
            name, data, offset = last[-1]
            data_end = None
        else:
            name, offset, data_end = last
        stream_end = b.base + b.end
        if data_end is None or stream_end >= data_end:
            where = "inside the zero padding after the data of the last member"
        else:
            where = f"{data_end - stream_end} bytes short of the end of a skipped member's data"
        raise TruncatedShardError(
            f"truncated tar stream: it ends {where} (after {stream_end} bytes, without the "
            "end-of-archive marker)",
            url=source,
            member=name,
            offset=offset,
        )
    if b.base == 0:
        raise TruncatedShardError("empty shard: 0 bytes, not a tar archive", url=source, offset=0)


def _eof_in_header(b: _Buffer, source, start, long_name, pax) -> None:
    """Raise the error for a stream that ends inside a header (or after extended headers)."""
    left = max(0, b.end - b.pos)
    offset = b.offset() if start is None else start
    if offset == 0 and left:
        raise TruncatedShardError(
            f"not a tar archive: the stream holds only {left} bytes, less than one "
            f"{BLOCK}-byte tar header",
            url=source,
            offset=0,
        )
    what = "incomplete header block" if left else "extended header without its member"
    raise TruncatedShardError(
        f"truncated tar stream: {what}",
        url=source,
        member=_pending_name(long_name, pax),
        offset=offset,
    )


def _bad_header(hdr: bytes, source, offset: int) -> ShardFormatError:
    """The error for a header whose checksum does not match (member named when legible)."""
    try:
        name = _nts(hdr[:100]).decode("utf-8")
    except UnicodeDecodeError:
        name = ""
    if offset == 0:
        reason = "not a tar archive: the first header's checksum does not match"
    else:
        reason = "bad tar header checksum (a corrupted header, or data that is not tar)"
    return HeaderError(
        reason, url=source, member=name if name.isprintable() and name else None, offset=offset
    )


def _size_field(hdr: bytes, source, offset) -> int:
    try:
        size = _number(hdr[124:136])
        if size >= 0:
            return size
    except ValueError:
        pass
    raise HeaderError(
        "bad size field in tar header",
        url=source,
        member=_nts(hdr[:100]).decode("utf-8", "replace"),
        offset=offset,
    )


def _decimal(value, what: str, source, offset, name=None) -> int:
    """A non-negative decimal number from a pax value (digits only)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    raise HeaderError(f"bad {what} {value!r} in pax header", url=source, member=name, offset=offset)


def _pax_size(pax: dict, source, offset) -> int:
    return _decimal(pax["size"], "size", source, offset)


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


# ---------------------------------------------------------------------------------------------
# GNU sparse members: the stored chunks and a map of where they go; holes are zeros
# ---------------------------------------------------------------------------------------------


def _sparse_entries(block: bytes, first: int, count: int, source, name, start) -> list:
    out = []
    for i in range(count):
        at = first + 24 * i
        try:
            offset = _number(block[at : at + 12])
            numbytes = _number(block[at + 12 : at + 24])
        except ValueError:
            raise HeaderError(
                "bad GNU sparse map entry", url=source, member=name, offset=start
            ) from None
        out.append((offset, numbytes))
    return out


def _old_gnu_sparse_map(hdr: bytes, b: _Buffer, source, name, start):
    """The map of an old-GNU sparse member ('S'): four entries in the header, 21 in each
    extension block that follows it (``b.pos`` moves past those)."""
    chunks = _sparse_entries(hdr, 386, 4, source, name, start)
    try:
        realsize = _number(hdr[483:495])
    except ValueError:
        raise HeaderError(
            "bad GNU sparse real size", url=source, member=name, offset=start
        ) from None
    extended = hdr[482]
    while extended:
        block = _read_data(b, BLOCK, BLOCK, source, name, start)
        chunks.extend(_sparse_entries(block, 0, 21, source, name, start))
        extended = block[504]
    return chunks, realsize


def _pax_unsparse(data: bytes, meta: dict, source, name, start) -> bytes:
    """Rebuild a pax GNU sparse member (formats 0.0, 0.1 and 1.0)."""
    if "GNU.sparse.map" in meta:  # 0.1: "offset,size,offset,size..."
        fields = meta["GNU.sparse.map"].split(",") if meta["GNU.sparse.map"] else []
        nums = [_decimal(f, "GNU sparse map", source, start, name) for f in fields]
        if len(nums) % 2:
            raise HeaderError(
                "GNU sparse map with an odd count", url=source, member=name, offset=start
            )
        realsize = _decimal(meta.get("GNU.sparse.size"), "GNU.sparse.size", source, start, name)
        chunks = list(zip(nums[::2], nums[1::2]))
    elif "GNU.sparse.size" in meta:  # 0.0: repeated offset/numbytes records
        offsets = meta.get("GNU.sparse.offset", [])
        sizes = meta.get("GNU.sparse.numbytes", [])
        if (
            not isinstance(offsets, list)
            or not isinstance(sizes, list)
            or len(offsets) != len(sizes)
        ):
            raise HeaderError(
                "GNU sparse 0.0 map: offsets and sizes do not pair up",
                url=source,
                member=name,
                offset=start,
            )
        realsize = _decimal(meta["GNU.sparse.size"], "GNU.sparse.size", source, start, name)
        chunks = [
            (
                _decimal(o, "GNU sparse offset", source, start, name),
                _decimal(n, "GNU sparse size", source, start, name),
            )
            for o, n in zip(offsets, sizes)
        ]
    elif meta.get("GNU.sparse.major") == "1" and meta.get("GNU.sparse.minor") == "0":
        realsize = _decimal(
            meta.get("GNU.sparse.realsize"), "GNU.sparse.realsize", source, start, name
        )
        chunks, skip = _sparse10_map(data, source, name, start)
        data = data[skip:]
    else:
        raise HeaderError(
            f"unsupported GNU sparse format {meta.get('GNU.sparse.major')}."
            f"{meta.get('GNU.sparse.minor')}",
            url=source,
            member=name,
            offset=start,
        )
    return _unsparse(data, chunks, realsize, source, name, start)


def _sparse10_map(data: bytes, source, name, start):
    """The map at the start of a pax 1.0 sparse member's data: a count, then offset/size pairs,
    one decimal number a line, padded to a block. Returns the pairs and the map's length."""
    nums: list[int] = []
    count = -1
    pos = 0
    while count < 0 or len(nums) < 2 * count:
        nl = data.find(b"\n", pos, pos + 21)
        field = data[pos:nl]
        if nl < 0 or not field.isdigit():
            raise HeaderError("bad GNU sparse 1.0 map", url=source, member=name, offset=start)
        if count < 0:
            count = int(field)
            if 4 * count > len(data):
                raise HeaderError(
                    "GNU sparse 1.0 map longer than the member",
                    url=source,
                    member=name,
                    offset=start,
                )
        else:
            nums.append(int(field))
        pos = nl + 1
    return list(zip(nums[::2], nums[1::2])), (pos + 511) & ~511


def _unsparse(data: bytes, chunks: list, realsize: int, source, name, start) -> bytes:
    """Place the stored ``data`` chunks at their offsets in ``realsize`` zero bytes."""
    if realsize > _MAX_SPARSE:
        raise HeaderError(
            f"sparse member of {realsize} bytes: more than the {_MAX_SPARSE} this "
            "reader rebuilds in memory",
            url=source,
            member=name,
            offset=start,
        )
    out = bytearray(realsize)
    done = 0  # end of the last chunk in the file
    taken = 0  # stored bytes used
    for offset, numbytes in chunks:
        if not numbytes:
            continue
        if offset < done or offset + numbytes > realsize or taken + numbytes > len(data):
            raise HeaderError(
                "inconsistent GNU sparse map (chunks out of order, beyond the "
                "file or the stored data)",
                url=source,
                member=name,
                offset=start,
            )
        out[offset : offset + numbytes] = data[taken : taken + numbytes]
        taken += numbytes
        done = offset + numbytes
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# the writer side
# ---------------------------------------------------------------------------------------------

_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")
DEFAULT_MTIME = 0
DEFAULT_MODE = 0o444


_MAX_MTIME = 8**11  # 11 octal digits: seconds before the year 2242
_MAX_MODE = 8**7
_MAX_SIZE = 8**11  # larger members get a pax size record


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def header_number(value, limit: int, what: str) -> int:
    """``value`` as an int that fits a tar header field below ``limit``; else :class:`EncodeError`.

    Floats are truncated to whole seconds as ``tarfile`` does; a value that does not fit is never
    cut short (a millisecond timestamp would become a wrong date, or an unreadable header).
    """
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        value = int(value)
    try:
        number = operator.index(value)
    except TypeError:
        raise EncodeError(
            f"{what} must be an integer, not {type(value).__name__} {value!r}"
        ) from None
    if 0 <= number < limit:
        return number
    hint = (
        "; it looks like milliseconds or nanoseconds: pass seconds"
        if what == "mtime" and number >= 10**11
        else ""
    )
    raise EncodeError(
        f"{what}={number} does not fit a tar header field (0 <= {what} < {limit}){hint}"
    )


def _name_bytes(name: str) -> bytes:
    if "\0" in name:
        raise EncodeError(
            f"member name {name!r} contains a NUL character; tar readers would cut it there"
        )
    if not name:
        raise EncodeError("empty member name")
    try:
        return name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exn:
        raise EncodeError(f"member name {name!r} cannot be encoded: {exn.reason}") from None


def _pax_record(key: str, value) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    body = b" " + key.encode("ascii") + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def _is_plain(name: str, size: int) -> bool:
    """A member whose name and size fit one ustar header block as they are."""
    return len(name) <= 100 and size < _MAX_SIZE and name.isascii() and "\0" not in name


def tar_header(
    name: str,
    size: int,
    *,
    mtime: int = DEFAULT_MTIME,
    mode: int = DEFAULT_MODE,
    typeflag: bytes = b"0",
) -> bytes:
    """Header block(s) for a regular member: plain ustar, with a pax header only when needed.

    The result is a whole number of 512-byte blocks: one ustar block, preceded by a pax header
    and its records when the name is not ASCII or too long, or the size needs more than 11 octal
    digits. ``mtime`` and ``mode`` must fit their fields (:class:`EncodeError` otherwise).
    """
    mtime = header_number(mtime, _MAX_MTIME, "mtime")
    mode = header_number(mode, _MAX_MODE, "mode")
    if size < 0:
        raise EncodeError(f"negative member size {size}")
    raw = _name_bytes(name)
    pax = []
    prefix = b""
    binary = not _is_utf8(raw)
    if len(raw) > 100:
        # split into prefix/name at a slash if that fits, otherwise a pax path record
        cut = raw.rfind(b"/", 0, 156)
        if 0 < cut and len(raw) - cut - 1 <= 100 and cut <= 155:
            prefix, raw = raw[:cut], raw[cut + 1 :]
        else:
            pax.append(_pax_record("path", name))
            raw = raw[:100]
    if not name.isascii() and not pax and not binary:
        pax.append(_pax_record("path", name))
    if binary and pax:  # not UTF-8 (bytes read with surrogateescape): say so, as POSIX asks
        pax.insert(0, _pax_record("hdrcharset", "BINARY"))
    size_field = _octal(size, 12) if size < _MAX_SIZE else _octal(0, 12)
    if size >= _MAX_SIZE:
        pax.append(_pax_record("size", str(size)))
    out = b""
    if pax:
        payload = b"".join(pax)
        out += tar_header("././@PaxHeader", len(payload), mtime=mtime, mode=mode, typeflag=b"x")
        out += payload + bytes(-len(payload) % BLOCK)
    fields = [
        raw,
        _octal(mode, 8),
        _octal(0, 8),
        _octal(0, 8),
        size_field,
        _octal(mtime, 12),
        b"        ",
        typeflag,
        b"",
        b"ustar\0",
        b"00",
        b"",
        b"",
        _octal(0, 8),
        _octal(0, 8),
        prefix,
    ]
    hdr = bytearray(_HEADER.pack(*fields))
    chk = sum(hdr)
    hdr[148:156] = b"%06o\0 " % chk
    return out + bytes(hdr)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def header_size(name: str, size: int) -> int:
    """Bytes of header blocks :func:`tar_header` writes for a member (512 unless pax is needed)."""
    if _is_plain(name, size):
        return BLOCK
    return len(tar_header(name, size))


class _HeaderTemplate:
    """The fixed parts of our ustar headers, so a plain header costs a join and two sums."""

    __slots__ = ("mid", "mtime", "tail", "const")

    def __init__(self, mtime: int, mode: int):
        self.mid = _octal(header_number(mode, _MAX_MODE, "mode"), 8) + _octal(0, 8) + _octal(0, 8)
        self.mtime = _octal(header_number(mtime, _MAX_MTIME, "mtime"), 12)
        self.tail = (
            b"0" + bytes(100) + b"ustar\0" + b"00" + bytes(64) + _octal(0, 8) * 2 + bytes(155 + 12)
        )
        self.const = sum(self.mid) + sum(self.mtime) + sum(self.tail) + 8 * 32

    def header(self, raw: bytes, size: int) -> bytes:
        """The ustar block of a plain member (``raw`` ASCII, at most 100 bytes; size < 8**11)."""
        size_field = b"%011o\0" % size
        chk = self.const + sum(raw) + sum(size_field)
        return b"".join(
            (
                raw,
                bytes(100 - len(raw)),
                self.mid,
                size_field,
                self.mtime,
                b"%06o\0 " % chk,
                self.tail,
            )
        )


class TarMemberWriter:
    """Write regular members to a binary stream as a tar archive (no compression here)."""

    def __init__(self, stream: BinaryIO, *, mtime: int = DEFAULT_MTIME, mode: int = DEFAULT_MODE):
        self.stream = stream
        self._mtime = header_number(mtime, _MAX_MTIME, "mtime")  # EncodeError if it does not fit
        self._mode = header_number(mode, _MAX_MODE, "mode")
        self.bytes_written = 0
        self._template = _HeaderTemplate(self._mtime, self._mode)
        if isinstance(stream, (io.BufferedWriter, io.BytesIO, io.FileIO)):
            self._writelines = stream.writelines
        else:  # e.g. zstandard's writer has no writelines
            write = stream.write

            def writelines(parts):
                for part in parts:
                    write(part)

            self._writelines = writelines

    @property
    def mtime(self) -> int:
        return self._mtime

    @property
    def mode(self) -> int:
        return self._mode

    def add(self, name: str, data: bytes) -> int:
        """Append one member; returns the number of bytes written."""
        return self.add_all(((name, data),))

    def add_all(self, members, accelerate: bool = True) -> int:
        """Append ``(name, data)`` members with one write; returns the number of bytes written."""
        if not isinstance(members, (list, tuple)):
            members = list(members)
        parts = []
        n = 0
        start = 0
        fast = _ustar_parts if accelerate else None
        while True:
            if fast is not None:
                added, stop = fast(parts, members, start, self.mtime, self.mode)
                n += added
                if stop < 0:
                    break
                members = members[stop:]  # the Python path writes members[stop] (and on)
            n += self._add_python(parts, members[:1] if fast is not None else members)
            if fast is None or len(members) == 1:
                break
            start = 1
        self._writelines(parts)
        self.bytes_written += n
        return n

    def _add_python(self, parts: list, members) -> int:
        append = parts.append
        n = 0
        template = self._template
        for name, data in members:
            size = len(data)
            if _is_plain(name, size):
                hdr = template.header(name.encode("ascii"), size)
            else:
                hdr = tar_header(name, size, mtime=self.mtime, mode=self.mode)
            pad = -size % BLOCK
            append(hdr)
            append(data)
            if pad:
                append(_ZERO_BLOCK[:pad])
            n += len(hdr) + size + pad
        return n

    def finish(self) -> None:
        """Write the end-of-archive marker (two zero blocks)."""
        self.stream.write(_ZERO_BLOCK * 2)
        self.bytes_written += 2 * BLOCK


def open_tar_bytes(stream: BinaryIO, source=None, chunk_size: int = CHUNK_SIZE):
    """Members ``(name, data, offset)`` of a possibly compressed tar byte stream."""
    return iter_tar(tar_byte_source(stream, source, chunk_size), source)
