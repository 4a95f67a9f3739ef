"""Tar header blocks: the ustar, GNU and pax fields the reader understands.

Constants for the block layout and type flags, number and string fields, exact checksums (one
header, or many at once), pax records, member names (long names, pax paths, ustar prefixes) and
the errors for malformed headers. Nothing here reads a stream.
"""

from __future__ import annotations

from zlib import adler32

from ..errors import HeaderError, ShardFormatError

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


def _nts(field: bytes) -> bytes:
    """A NUL-terminated string field."""
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


_OCTAL_DIGITS = frozenset(b"01234567")


def parse_octal(digits: bytes) -> int:
    """The value of octal ``digits``; ValueError unless they are octal digits and nothing else
    (``int(x, 8)`` alone also takes ``1_000``, ``+7``, ``-7`` and ``0o7``, which GNU tar
    rejects as not numeric)."""
    if not digits or not _OCTAL_DIGITS.issuperset(digits):
        raise ValueError(f"not an octal number: {digits!r}")
    return int(digits, 8)


def parse_number(field: bytes) -> int:
    """An octal number field (spaces and NULs around the digits), or GNU base-256 when the high
    bit is set."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        if field[0] & 0x40:  # negative base-256
            value -= 1 << (8 * len(field) - 1)
        return value
    field = _nts(field).strip(b" \0")
    return parse_octal(field) if field else 0


def size_number(hdr: bytes) -> int:
    """A header's size field: eleven octal digits and a NUL read directly, anything else by
    :func:`parse_number`; ValueError when it is not a number."""
    return parse_octal(hdr[124:135].lstrip(b" ")) if hdr[135] == 0 else parse_number(hdr[124:136])


def checksum_ok(hdr: bytes) -> bool:
    """Verify a header checksum exactly: the unsigned byte sum (with the checksum field counted
    as spaces), or the signed sum that some old writers stored (tarfile accepts both)."""
    stored = _nts(hdr[148:156]).strip(b" \0")
    if not stored:
        return False
    try:
        want = parse_octal(stored)
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
# two halves give the exact unsigned sum. A mismatch is decided by :func:`checksum_ok`.
def _header_sum(hdr: bytes) -> int:
    """The unsigned checksum of a header block (the checksum field counted as spaces)."""
    return (adler32(hdr[:256]) & 0xFFFF) + (adler32(hdr[256:]) & 0xFFFF) + 254 - sum(hdr[148:156])


def _chk_value(hdr: bytes) -> int:
    """The stored checksum (an impossible value when the field is not plain octal)."""
    chk = hdr[148:156]
    try:
        return (
            parse_octal(chk[:6].strip(b" "))
            if chk[6] in (0, 32)
            else parse_octal(chk.strip(b" \0"))
        )
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
        if not checksum_ok(headers[i]):
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
        digits = payload[pos:sp]
        if not digits.isdigit():
            raise HeaderError("malformed pax header length", url=source, offset=offset)
        length = int(digits)
        record = payload[sp + 1 : pos + length]
        if pos + length > n or not record.endswith(b"\n") or b"=" not in record:
            raise HeaderError("malformed pax header record", url=source, offset=offset)
        raw_key, _, raw_value = record[:-1].partition(b"=")
        key = raw_key.decode("utf-8", "surrogateescape")
        value = raw_value.decode("utf-8", "surrogateescape")
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


def _bad_header(hdr: bytes, source, offset: int, origin: int = 0) -> ShardFormatError:
    """The error for a header whose checksum does not match (member named when legible)."""
    try:
        name = _nts(hdr[:100]).decode("utf-8")
    except UnicodeDecodeError:
        name = ""
    if offset == origin:
        reason = "not a tar archive: the first header's checksum does not match"
    else:
        reason = "bad tar header checksum (a corrupted header, or data that is not tar)"
    return HeaderError(
        reason, url=source, member=name if name.isprintable() and name else None, offset=offset
    )


def _size_field(hdr: bytes, source, offset) -> int:
    try:
        size = parse_number(hdr[124:136])
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
