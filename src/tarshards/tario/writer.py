"""The member writer: deterministic ustar headers (pax only where a name or size needs it).

Fixed mtime, owner and mode by default, so equal samples always give byte-identical shards; a
value that does not fit its header field is an :class:`~tarshards.errors.EncodeError`, never a
truncated field.
"""

from __future__ import annotations

import io
import operator
import struct
from typing import BinaryIO, Callable

from ..errors import EncodeError
from .headers import _ZERO_BLOCK, BLOCK

try:  # optional C accelerator (_speedups, see _c/); the Python code below is the reference
    from .._speedups import tar_sample as _tar_sample
    from .._speedups import ustar_parts as _ustar_parts
except ImportError:  # pragma: no cover - built by default; pure Python works the same
    _ustar_parts = _tar_sample = None

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


# a write of at most this many bytes is joined into one piece first (measured on a 1 MiB
# buffered file, a 6.6 kB sample of 9 parts: 4.1 us joined, 5.5 us as writelines); larger ones
# go part by part, so that big members are not copied once more
_JOIN_MAX = 64 << 10


class _HeaderTemplate:
    """The fixed parts of our ustar headers, so a plain header costs a join and two sums."""

    __slots__ = ("const", "mid", "mtime", "tail")

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

    def __init__(
        self,
        stream: BinaryIO,
        *,
        mtime: int = DEFAULT_MTIME,
        mode: int = DEFAULT_MODE,
        writelines: Callable[[list], object] | None = None,
    ):
        """``writelines``: where each member's parts (header, data, padding) go, in one call per
        member or sample, instead of ``stream`` (a recorder that hashes or frames what is
        written hands its own sink here; see :class:`tarshards.write.writer.TarWriter`)."""
        self.stream = stream
        self._mtime = header_number(mtime, _MAX_MTIME, "mtime")  # EncodeError if it does not fit
        self._mode = header_number(mode, _MAX_MODE, "mode")
        self.bytes_written = 0
        self._template = _HeaderTemplate(self._mtime, self._mode)
        if writelines is not None:
            self._writelines = writelines
        elif isinstance(stream, (io.BufferedWriter, io.BytesIO, io.FileIO)):
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
        if accelerate and _tar_sample is not None:  # plain members: built in one buffer, in C
            data = _tar_sample(members, self._mtime, self._mode, _JOIN_MAX)
            if data is not None:
                self._writelines([data])
                self.bytes_written += len(data)
                return len(data)
        parts: list = []
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
        if n <= _JOIN_MAX and len(parts) > 1:  # one copy and one write beat a write per part
            parts = [b"".join(parts)]
        self._writelines(parts)
        self.bytes_written += n
        return n

    def add_recorded(self, members, recorder, key: str) -> int | None:
        """:meth:`add_all`'s fast path, the write also recorded by ``recorder`` (a
        ``tarshards._speedups.Recorder``, in the same C call); None, having written and
        recorded nothing, where that path does not take the write (:meth:`add_all` and the
        recorder's own ``record`` then do)."""
        if _tar_sample is None or not isinstance(members, (list, tuple)):
            return None
        data = _tar_sample(members, self._mtime, self._mode, _JOIN_MAX, recorder, key)
        if data is None:
            return None
        self._writelines([data])
        self.bytes_written += len(data)
        return len(data)

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
