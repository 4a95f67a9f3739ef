"""Reading and writing tar streams, fast.

The reader is a header parser of our own over large buffered reads: it never seeks, so it works on
files, pipes, stdin and network streams alike, and it holds at most one chunk plus the member being
read. It understands ustar, GNU long names/links and pax extended headers, skips everything that is
not a regular file, and detects gzip and zstd compression by the first bytes of the stream.

The writer emits deterministic ustar headers (fixed mtime, owner and mode) and only adds a pax header
where a name or a size does not fit, so equal samples always give byte-identical shards.
"""

from __future__ import annotations

import io
import operator
import struct
import zlib
from zlib import adler32
from typing import BinaryIO, Iterable, Iterator

from .errors import EncodeError, MissingDependencyError, ShardFormatError

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
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_REGULAR = (0x30, 0x00, 0x37)  # '0', '\0', '7' (contiguous file)
_GNU_LONGNAME = 0x4C  # 'L'
_GNU_LONGLINK = 0x4B  # 'K'
_PAX = 0x78  # 'x'
_PAX_GLOBAL = 0x67  # 'g'
_MAX_META = 1 << 20
_OCTAL_WEIGHTS = tuple(8 ** k for k in range(5, -1, -1))  # longest accepted long-name / pax payload
_DRAIN_LIMIT = 1 << 20  # bytes of trailing padding read after the end-of-archive marker


# ---------------------------------------------------------------------------------------------
# byte sources
# ---------------------------------------------------------------------------------------------


def read_chunks(stream: BinaryIO, chunk_size: int = CHUNK_SIZE, *,
                reuse: bool = False) -> Iterator[bytes]:
    """Yield the bytes of ``stream`` in chunks of up to ``chunk_size`` bytes, until EOF.

    With ``reuse=True`` (streams with ``readinto``) every chunk is a memoryview of one buffer that
    the next chunk overwrites: a consumer must copy what it keeps before asking for more. This
    spares a fresh allocation (and its page faults) per chunk.
    """
    readinto = (getattr(stream, "readinto1", None) or getattr(stream, "readinto", None)
                if reuse else None)
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


def decompressed_chunks(chunks: Iterable[bytes], source=None) -> Iterator[bytes]:
    """Detect gzip or zstd by magic bytes and yield the decompressed stream; pass others through."""
    it = iter(chunks)
    first = b""
    for piece in it:  # gather enough bytes to see a magic number
        first += piece
        if len(first) >= 4:
            break
    if not first:
        return
    if first.startswith(_GZIP_MAGIC):
        yield from _gunzip(first, it, source)
    elif first.startswith(_ZSTD_MAGIC):
        yield from _unzstd(first, it, source)
    else:
        yield first
        yield from it


def _gunzip(first: bytes, rest: Iterator[bytes], source) -> Iterator[bytes]:
    # wbits=31: gzip container. Concatenated gzip members (pigz, cat a.gz b.gz) are handled by
    # starting a new decompressor on the data after a finished member, whether that data comes
    # in the same chunk or in a later one; zero padding after the last member is ignored.
    d = zlib.decompressobj(31)
    pending = first
    consumed = 0  # compressed bytes handed to the decompressors so far
    try:
        while True:
            while pending:
                if d.eof:
                    stripped = bytes(pending).lstrip(b"\0")  # may be a reused memoryview
                    consumed += len(pending) - len(stripped)
                    pending = stripped
                    if not pending:
                        break
                    d = zlib.decompressobj(31)
                out = d.decompress(pending, CHUNK_SIZE * 4)
                left = d.unused_data if d.eof else d.unconsumed_tail
                consumed += len(pending) - len(left)
                pending = left
                if out:
                    yield out
            nxt = next(rest, None)
            if nxt is None:
                break
            pending = nxt
        if not d.eof:
            tail = d.flush()
            if tail:
                yield tail
            raise ShardFormatError("gzip stream ends early (truncated .tgz?)", url=source,
                                   offset=consumed)
    except zlib.error as exc:
        raise ShardFormatError(f"corrupt gzip data: {exc}", url=source,
                               offset=consumed) from None


def _unzstd(first: bytes, rest: Iterator[bytes], source) -> Iterator[bytes]:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is a core dependency
        raise MissingDependencyError(
            "reading .tar.zst shards needs the zstandard package: pip install zstandard",
            url=source) from None
    # a zstd decompressobj reads one frame and cannot be reused: a new one for each frame
    new = zstandard.ZstdDecompressor().decompressobj
    d = new()
    pending = first
    consumed = 0
    try:
        while True:
            while pending:
                if d.eof:
                    stripped = bytes(pending).lstrip(b"\0")  # may be a reused memoryview
                    consumed += len(pending) - len(stripped)
                    pending = stripped
                    if not pending:
                        break
                    d = new()
                out = d.decompress(pending)
                left = d.unused_data if d.eof else b""
                consumed += len(pending) - len(left)
                pending = left
                if out:
                    yield out
            nxt = next(rest, None)
            if nxt is None:
                break
            pending = nxt
        if not d.eof:
            raise ShardFormatError("zstd stream ends early (truncated .tar.zst?)", url=source,
                                   offset=consumed)
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"corrupt zstd data: {exc}", url=source, offset=consumed) from None


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
    """Verify a header checksum (exact; the fast path uses :func:`_checksum_fast`)."""
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
    # some old writers summed signed chars
    signed = unsigned - 2 * sum(1 for b in hdr if b > 127) + 2 * sum(
        1 for b in hdr[148:156] if b > 127)
    return signed == want


# The reader checks header checksums at C speed: the low half of Adler-32 is
# ``1 + sum(bytes) mod 65521`` and a header's byte sum is below 2 * 65521, so comparing modulo
# 65521 only confuses sums exactly 65521 apart. Any mismatch is decided by the exact check.
def _chk_value(hdr: bytes) -> int:
    """The stored checksum (an impossible value when the field is not octal)."""
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
    ok = (sums == stored) & (digits >= 0).all(axis=1) & (digits < 8).all(axis=1) & (
        (field[:, 6] == 0) | (field[:, 6] == 32))
    if ok.all():
        return -1
    for i in np.flatnonzero(~ok):  # unusual formatting of the field: decide exactly
        if not _checksum_ok(headers[i]):
            return int(i)
    return -1


def _parse_pax(payload: bytes, source, offset) -> dict:
    """Parse pax records ``"%d %s=%s\\n"`` into a dict of str -> str."""
    out = {}
    pos = 0
    n = len(payload)
    while pos < n:
        if payload[pos] == 0:
            break
        sp = payload.find(b" ", pos)
        if sp < 0:
            raise ShardFormatError("malformed pax header record", url=source, offset=offset)
        try:
            length = int(payload[pos:sp])
        except ValueError:
            raise ShardFormatError("malformed pax header length", url=source,
                                   offset=offset) from None
        record = payload[sp + 1: pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise ShardFormatError("malformed pax header record", url=source, offset=offset)
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------


class _Buffer:
    """A window over the input with absolute stream offsets.

    ``buf`` is a reused bytearray; the unread input is ``buf[pos:end]`` (the array itself may be
    longer). The input is a binary stream with ``readinto`` (read straight into ``buf``: one
    copy from the kernel) or an iterable of byte chunks (copied in). Data handed out must be
    copied out as ``bytes``.
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
            buf[end:end + got] = chunk
        self.end = end + got
        return got

    def fill(self, n: int) -> bool:
        """Make at least ``n`` bytes available at ``pos``; False at EOF before that."""
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
                    return n <= 0
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
            buf[:end - pos] = buf[pos:end]
            self.base += pos
            self.pos = 0
            self.end = end - pos
        while self.end < n:
            if not self._more(max(CHUNK_SIZE, n - self.end)):
                return False
        return True

    def drain(self, limit: int) -> None:
        """Read up to ``limit`` bytes of what follows, stopping at the first non-zero data."""
        total = 0
        while total <= limit:
            self.pos = self.end = 0
            got = self._more(CHUNK_SIZE)
            if not got or bytes(self.buf[:got]).strip(b"\0"):
                return
            total += got

    def offset(self) -> int:
        return self.base + self.pos


class PlainStream:
    """The input of a plain (uncompressed) tar stream, read with ``readinto`` straight into the
    reader's buffer. ``first`` is what was already read to sniff for compression."""

    def __init__(self, stream: BinaryIO, first: bytes = b""):
        self._first = memoryview(first)
        self._readinto = (getattr(stream, "readinto1", None) or stream.readinto)

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
    if first.startswith((_GZIP_MAGIC, _ZSTD_MAGIC)):
        return decompressed_chunks(_chain_chunks(first, read_chunks(stream, chunk_size)), source)
    return PlainStream(stream, first)


def _chain_chunks(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def iter_tar(chunks: Iterable[bytes], source=None, *, verify: bool = True,
             drain: bool = True) -> Iterator[tuple[str, bytes, int]]:
    """Yield ``(name, data, offset)`` for each regular member of a tar byte stream.

    ``chunks`` is an iterable of bytes (see :func:`read_chunks` and :func:`decompressed_chunks`).
    ``offset`` is the position of the member's first header block in the uncompressed stream.
    Directories, links, devices and other non-regular members are skipped. The stream ends at the
    end-of-archive marker (or at EOF on a block boundary). ``verify`` checks header checksums.
    A truncated or malformed stream raises :class:`ShardFormatError` naming ``source``, the member
    and the byte offset.
    """
    for batch in iter_tar_batches(chunks, source, verify=verify, drain=drain):
        yield from batch


def iter_tar_batches(chunks: Iterable[bytes], source=None, *, verify: bool = True,
                     drain: bool = True,
                     accelerate: bool = True) -> Iterator[list[tuple[str, bytes, int]]]:
    """Like :func:`iter_tar`, but yields the members in lists (one list per buffer's worth).

    This is the reader's hot path. Plain ustar members that lie wholly inside the current buffer
    are parsed in a tight loop and their header checksums verified together (vectorised) before
    any of them is handed out; everything else (extended headers, links, members that span
    buffers, the end of the archive) goes through the general path one header at a time.
    With ``accelerate`` (default) the fast loop runs in C when the extension is built.
    """
    b = _Buffer(chunks)
    long_name = None
    pax: dict | None = None
    global_pax: dict = {}
    start = None  # offset of the first header of the member being assembled
    fill = b.fill
    buf = b.buf
    pos = 0
    end = 0
    base = 0
    regular = _REGULAR
    zero = _ZERO_BLOCK
    scan = _scan_members if accelerate else None
    while True:
        if scan is not None and pax is None and long_name is None and end - pos >= BLOCK:
            batch, pos = scan(buf, pos, base, end)  # stops where the general path must decide
            if batch:
                yield batch
        elif pax is None and long_name is None and end - pos >= BLOCK:
            # fast path: plain members wholly inside the buffer
            batch = []
            headers = []
            n = end
            while n - pos >= BLOCK:
                hdr = buf[pos:pos + BLOCK]
                if hdr[156] != 0x30 or hdr[135] or hdr[345]:
                    break  # not a plain regular member with a canonical size field
                try:
                    size = int(hdr[124:135], 8)
                except ValueError:
                    break
                if size < 0 or n - pos - BLOCK < size:
                    break
                end = hdr.find(0, 0, 100)
                name = (hdr[:end] if end >= 0 else hdr[:100]).decode("utf-8", "surrogateescape")
                batch.append((name, bytes(buf[pos + BLOCK:pos + BLOCK + size]), base + pos))
                headers.append(hdr)
                pos += BLOCK + ((size + 511) & ~511)
            if batch:
                bad = _first_bad_header(headers) if verify else -1
                if bad >= 0:
                    if bad:
                        yield batch[:bad]
                    raise _bad_header(headers[bad], source, batch[bad][2])
                yield batch
                continue
        if end - pos < BLOCK:
            b.pos = pos
            if not fill(BLOCK):
                if b.end > b.pos or start is not None:
                    _eof_in_header(b, source, start, long_name, pax)
                return  # clean EOF at a block boundary without an end-of-archive marker
            pos = b.pos
            end = b.end
            base = b.base
        hdr = bytes(buf[pos:pos + BLOCK])
        if hdr == zero:
            b.pos = pos + BLOCK
            if drain:
                b.drain(_DRAIN_LIMIT)
            return
        if verify and (
                (adler32(hdr) & 0xFFFF) + 255 - sum(hdr[148:156]) - _chk_value(hdr)) % 65521 \
                and not _checksum_ok(hdr):
            raise _bad_header(hdr, source, base + pos)
        try:
            size = int(hdr[124:135], 8) if hdr[135] == 0 else _number(hdr[124:136])
        except ValueError:
            size = _size_field(hdr, source, base + pos)
        if size < 0:
            size = _size_field(hdr, source, base + pos)
        typeflag = hdr[156]
        if start is None:
            start = base + pos
        pos += BLOCK
        if pax is not None and "size" in pax:
            size = _pax_size(pax, source, start)
        padded = (size + 511) & ~511
        if typeflag in regular:
            if pax is not None and "path" in pax:
                name = pax["path"]
            elif long_name is not None:
                name = long_name
            else:
                end = hdr.find(0, 0, 100)
                raw = hdr[:end] if end >= 0 else hdr[:100]
                if hdr[345] != 0 and hdr[257:263] == b"ustar\0":  # POSIX only: GNU keeps atime here
                    raw = _nts(hdr[345:500]) + b"/" + raw
                name = raw.decode("utf-8", "surrogateescape")
            if not typeflag and name[-1:] == "/":  # pre-POSIX directory (typeflag NUL)
                pos += padded
                long_name = pax = start = None
                continue
            if end - pos >= size:
                data = bytes(buf[pos:pos + size])
                pos += padded
            else:
                b.pos = pos
                data = _read_data(b, size, padded, source, name, start)
                pos = b.pos
                end = b.end
                base = b.base
            yield [(name, data, start)]
            if pax is not None or long_name is not None:
                long_name = None
                pax = None
            start = None
            continue
        # metadata and non-regular members
        if typeflag in (_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL):
            if size > _MAX_META:
                raise ShardFormatError("implausibly large extended header", url=source,
                                       offset=start)
            b.pos = pos
            payload = _read_data(b, size, padded, source, None, start)
            pos = b.pos
            end = b.end
            base = b.base
            if typeflag == _GNU_LONGNAME:
                long_name = _nts(payload).decode("utf-8", "surrogateescape")
            elif typeflag == _PAX:
                pax = dict(global_pax)
                pax.update(_parse_pax(payload, source, start))
            elif typeflag == _PAX_GLOBAL:
                global_pax.update(_parse_pax(payload, source, start))
                start = None
            continue  # long link names are irrelevant: links are skipped
        # directories, links, devices, fifos: no data; other types (sparse...): skip their data
        if typeflag not in (0x31, 0x32, 0x33, 0x34, 0x35, 0x36):
            pos += padded
        long_name = None
        pax = None
        start = None


def _eof_in_header(b: _Buffer, source, start, long_name, pax) -> None:
    """Raise the error for a stream that ends inside a header (or after extended headers)."""
    left = b.end - b.pos
    offset = b.offset() if start is None else start
    if offset == 0 and left:
        raise ShardFormatError(
            f"not a tar archive: the stream holds only {left} bytes, less than one "
            f"{BLOCK}-byte tar header", url=source, offset=0)
    member = pax.get("path") if pax is not None and "path" in pax else long_name
    what = "incomplete header block" if left else "extended header without its member"
    raise ShardFormatError(f"truncated tar stream: {what}", url=source, member=member,
                           offset=offset)


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
    return ShardFormatError(reason, url=source, member=name if name.isprintable() and name
                            else None, offset=offset)


def _size_field(hdr: bytes, source, offset) -> int:
    try:
        size = _number(hdr[124:136])
        if size >= 0:
            return size
    except ValueError:
        pass
    raise ShardFormatError("bad size field in tar header", url=source,
                           member=_nts(hdr[:100]).decode("utf-8", "replace"), offset=offset)


def _pax_size(pax: dict, source, offset) -> int:
    try:
        size = int(pax["size"])
    except ValueError:
        size = -1
    if size < 0:
        raise ShardFormatError(f"bad size {pax['size']!r} in pax header", url=source,
                               offset=offset)
    return size


def _read_data(b: _Buffer, size: int, padded: int, source, name, start) -> bytes:
    if not b.fill(padded):
        if b.fill(size) if size != padded else False:
            # data complete but the final block padding is missing: accept, as GNU tar does not
            data = bytes(b.buf[b.pos:b.pos + size])
            b.pos += size
            return data
        raise ShardFormatError(
            f"truncated tar stream: member needs {size} bytes, stream ended after "
            f"{b.end - b.pos}", url=source, member=name, offset=start)
    data = bytes(b.buf[b.pos:b.pos + size])
    b.pos += padded
    return data


# ---------------------------------------------------------------------------------------------
# the writer side
# ---------------------------------------------------------------------------------------------

_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")
DEFAULT_MTIME = 0
DEFAULT_MODE = 0o444


_MAX_MTIME = 8 ** 11  # 11 octal digits: seconds before the year 2242
_MAX_MODE = 8 ** 7
_MAX_SIZE = 8 ** 11  # larger members get a pax size record


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
        raise EncodeError(f"{what} must be an integer, not {type(value).__name__} "
                          f"{value!r}") from None
    if 0 <= number < limit:
        return number
    hint = ("; it looks like milliseconds or nanoseconds: pass seconds"
            if what == "mtime" and number >= 10 ** 11 else "")
    raise EncodeError(f"{what}={number} does not fit a tar header field (0 <= {what} < "
                      f"{limit}){hint}")


def _name_bytes(name: str) -> bytes:
    if "\0" in name:
        raise EncodeError(f"member name {name!r} contains a NUL character; tar readers would "
                          "cut it there")
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


def tar_header(name: str, size: int, *, mtime: int = DEFAULT_MTIME, mode: int = DEFAULT_MODE,
               typeflag: bytes = b"0") -> bytes:
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
            prefix, raw = raw[:cut], raw[cut + 1:]
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
        raw, _octal(mode, 8), _octal(0, 8), _octal(0, 8), size_field, _octal(mtime, 12),
        b"        ", typeflag, b"", b"ustar\0", b"00", b"", b"", _octal(0, 8), _octal(0, 8), prefix,
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
        self.tail = (b"0" + bytes(100) + b"ustar\0" + b"00" + bytes(64) + _octal(0, 8) * 2
                     + bytes(155 + 12))
        self.const = sum(self.mid) + sum(self.mtime) + sum(self.tail) + 8 * 32

    def header(self, raw: bytes, size: int) -> bytes:
        """The ustar block of a plain member (``raw`` ASCII, at most 100 bytes; size < 8**11)."""
        size_field = b"%011o\0" % size
        chk = self.const + sum(raw) + sum(size_field)
        return b"".join((raw, bytes(100 - len(raw)), self.mid, size_field, self.mtime,
                         b"%06o\0 " % chk, self.tail))


class TarMemberWriter:
    """Write regular members to a binary stream as a tar archive (no compression here)."""

    def __init__(self, stream: BinaryIO, *, mtime: int = DEFAULT_MTIME,
                 mode: int = DEFAULT_MODE):
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


def open_compressed_writer(raw: BinaryIO, name: str, level: int | None = None):
    """Wrap ``raw`` in a compressor chosen by the suffix of ``name`` (.tgz, .tar.gz, .tar.zst).

    Returns ``(stream, closer)`` where ``closer()`` flushes the compressor without closing ``raw``.
    """
    lower = str(name).lower()
    if lower.endswith((".tgz", ".tar.gz", ".gz")):
        import gzip

        # filename="": no file name in the gzip header (it would be the random temporary name)
        gz = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0,
                           compresslevel=6 if level is None else level)
        return gz, gz.close
    if lower.endswith((".tar.zst", ".tzst", ".zst")):
        import zstandard

        cctx = zstandard.ZstdCompressor(level=3 if level is None else level)
        zw = cctx.stream_writer(raw, closefd=False)

        def close():
            zw.flush(zstandard.FLUSH_FRAME)
            zw.close()

        return zw, close
    return raw, (lambda: None)


def is_compressed_name(name: str) -> bool:
    return str(name).lower().endswith((".tgz", ".tar.gz", ".gz", ".tar.zst", ".tzst", ".zst"))


def open_tar_bytes(stream: BinaryIO, source=None, chunk_size: int = CHUNK_SIZE):
    """Members ``(name, data, offset)`` of a possibly compressed tar byte stream."""
    return iter_tar(tar_byte_source(stream, source, chunk_size), source)
