"""The compressions tarshards reads and writes: one table, one frame loop.

Every part of the library that needs to know about gzip or zstd asks this module: the reader
(:func:`decompressed_chunks`, found by magic bytes), the writer (:func:`open_compressed_writer`,
chosen by file suffix) and the cache (:func:`by_magic`, to tell a shard from an error page).

Both compressions are read by the same loop, :func:`_frames`: a stream may hold several
members/frames back to back (``cat a.gz b.gz``, pigz, multi-frame zstd), with zero padding after
the last one. A corrupt stream raises :class:`~tarshards.errors.CompressionError` at the
compressed byte offset of the damage, after yielding everything that decompressed before it; a
stream that stops inside a member raises :class:`~tarshards.errors.TruncatedShardError`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

from .errors import CompressionError, MissingDependencyError, TruncatedShardError

__all__ = [
    "COMPRESSIONS",
    "Compression",
    "by_magic",
    "by_name",
    "decompressed_chunks",
    "is_compressed_name",
    "open_compressed_writer",
]

_OUT_LIMIT = 4 << 20  # most output bytes one gzip step produces (bounds a decompression bomb)
_SALVAGE_STEP = 4096  # compressed bytes per step when salvaging the output before a corruption
_SALVAGE_LIMIT = 64 << 20  # most output salvaged from one failing step


@dataclass(frozen=True)
class Compression:
    """One compression: its ``name``, the ``magic`` bytes its streams start with, the file
    ``suffixes`` that choose it for writing (the first is the canonical one), ``reader`` (returns
    a fresh decoder for one member/frame) and ``writer`` (``(raw, level) -> (stream, close)``)."""

    name: str
    magic: bytes
    suffixes: tuple[str, ...]
    reader: Callable[[], "_Decoder"]
    writer: Callable[[BinaryIO, int | None], tuple]

    @property
    def suffix(self) -> str:
        return self.suffixes[0]


# ---------------------------------------------------------------------------------------------
# decoders: one member (gzip) or frame (zstd) each, behind the same four operations
# ---------------------------------------------------------------------------------------------


class _Damage(Exception):
    """Raised by a decoder at corrupt input: ``at`` is the offset of the damage in the member or
    frame, ``out`` what decoded before it (handed out before the error)."""

    def __init__(self, message: str, at: int, out: bytes):
        super().__init__(message)
        self.at = at
        self.out = out


class _Decoder:
    """What the frame loop needs of a decompressor (one member or frame).

    ``step(data) -> (output, input left over after the member/frame)``; raises :class:`_Damage`
    at corrupt input, after decoding everything before the damage (so that what is handed out,
    and the offset reported, do not depend on how the input was cut into chunks).
    """

    eof = False

    def step(self, data) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def flush(self) -> bytes:
        return b""


class _GzipDecoder(_Decoder):
    __slots__ = ("_d", "_fed")

    def __init__(self):
        self._d = zlib.decompressobj(31)  # wbits=31: the gzip container, one member
        self._fed = 0

    def step(self, data):
        d = self._d
        saved = d.copy()  # to replay the input after an error (a copy of the inflate state)
        try:
            out = d.decompress(data, _OUT_LIMIT)
        except zlib.error as exc:
            out, bad = _replay(saved, bytes(data))
            raise _Damage(f"corrupt gzip data: {exc}", self._fed + bad, out) from None
        left = d.unused_data if d.eof else d.unconsumed_tail
        self._fed += len(data) - len(left)
        return out, left

    @property
    def eof(self):
        return self._d.eof

    def flush(self):
        return self._d.flush()


def _replay(d, data: bytes) -> tuple[bytes, int]:
    """Feed ``data`` again to ``d`` (the state before the failing step): the output up to the
    damage, and the index of the byte at which it shows. Whole steps first, then a bisection of
    the failing step for its longest prefix that decodes (an error never goes away with more
    input, and zlib hands out all it can decode, so the result does not depend on the steps)."""
    outs: list[bytes] = []
    pos = 0
    total = 0
    while True:
        if pos >= len(data) or total >= _SALVAGE_LIMIT:
            return b"".join(outs), pos
        piece = data[pos : pos + _SALVAGE_STEP]
        saved = d.copy()
        try:
            out = d.decompress(piece)
        except zlib.error:
            d = saved
            break
        outs.append(out)
        total += len(out)
        pos += len(piece)
        if d.eof:  # pragma: no cover - zlib stops at the end of a member
            return b"".join(outs), pos
    good, bad, best = 0, len(piece), b""  # piece[:good] decodes, piece[:bad] does not
    while bad - good > 1:
        mid = (good + bad) // 2
        probe = d.copy()
        try:
            out = probe.decompress(piece[:mid])
        except zlib.error:
            bad = mid
        else:
            good, best = mid, out
    outs.append(best)
    return b"".join(outs), pos + good


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _ZstdDecoder(_Decoder):
    """One zstd frame, handed to zstandard one unit at a time (the frame header, each block, the
    checksum), so that an error loses only the unit it is in."""

    __slots__ = ("_d", "_error", "_buf", "_fed", "_state", "_checksum", "_raw")

    def __init__(self):
        zstandard = _zstandard()
        self._d = zstandard.ZstdDecompressor().decompressobj()  # one frame; not reusable
        self._error = zstandard.ZstdError
        self._buf = b""  # input held back: an incomplete unit
        self._fed = 0  # bytes of this frame handed to zstandard
        self._state = 0  # 0: frame header, 1: a block, 2: the checksum, 3: the frame is done
        self._checksum = False
        self._raw = False  # a frame we cannot cut into units: handed over as it comes

    @property
    def eof(self):
        return self._d.eof

    def _unit(self, buf, pos: int) -> tuple[int, int]:
        """Length and following state of the unit at ``buf[pos:]``; (0, _) if not known yet."""
        avail = len(buf) - pos
        state = self._state
        if state == 0:
            if avail < 5:
                return 0, 0
            if buf[pos : pos + 4] != _ZSTD_MAGIC:
                self._raw = True  # a skippable frame or garbage: zstandard decides
                return avail, 3
            fhd = buf[pos + 4]
            single = (fhd >> 5) & 1
            self._checksum = bool(fhd & 4)
            return (
                5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
            ), 1
        if state == 1:
            if avail < 3:
                return 0, 1
            head = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16
            size = 1 if (head >> 1) & 3 == 1 else head >> 3  # an RLE block holds one byte
            return 3 + size, ((2 if self._checksum else 3) if head & 1 else 1)
        if state == 2:
            return 4, 3
        return avail, 3  # the frame should be done: zstandard decides

    def step(self, data):
        buf = self._buf + bytes(data) if self._buf else data
        pos = 0
        outs = []
        total = 0
        d = self._d
        while not d.eof:
            if total >= _OUT_LIMIT:  # enough for one step: the rest is handed back
                self._buf = b""
                return b"".join(outs), bytes(buf[pos:])
            if self._raw:
                n, state = len(buf) - pos, 3
            else:
                n, state = self._unit(buf, pos)
            if not n or pos + n > len(buf):
                break
            try:
                out = d.decompress(buf[pos : pos + n])
            except self._error as exc:
                raise _Damage(f"corrupt zstd data: {exc}", self._fed, b"".join(outs)) from None
            outs.append(out)
            total += len(out)
            pos += n
            self._state = state
            if d.eof:
                unused = d.unused_data
                self._fed += n - len(unused)
                self._buf = b""
                return b"".join(outs), unused + bytes(buf[pos:])
            self._fed += n
        self._buf = bytes(buf[pos:])
        return b"".join(outs), b""


def _zstandard():
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is a core dependency
        raise MissingDependencyError(
            "zstd shards need the zstandard package: pip install zstandard"
        ) from None
    return zstandard


# ---------------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------------


def _gzip_writer(raw: BinaryIO, level: int | None):
    import gzip

    # filename="": no file name in the gzip header (it would be the random temporary name)
    gz = gzip.GzipFile(
        filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=6 if level is None else level
    )
    return gz, gz.close


def _zstd_writer(raw: BinaryIO, level: int | None):
    zstandard = _zstandard()
    cctx = zstandard.ZstdCompressor(level=3 if level is None else level)
    zw = cctx.stream_writer(raw, closefd=False)

    def close():
        zw.flush(zstandard.FLUSH_FRAME)
        zw.close()

    return zw, close


GZIP = Compression("gzip", b"\x1f\x8b", (".tgz", ".tar.gz", ".gz"), _GzipDecoder, _gzip_writer)
ZSTD = Compression("zstd", _ZSTD_MAGIC, (".tar.zst", ".tzst", ".zst"), _ZstdDecoder, _zstd_writer)
COMPRESSIONS: tuple[Compression, ...] = (GZIP, ZSTD)
_MAGIC_LEN = max(len(c.magic) for c in COMPRESSIONS)
_ALIASES = {"gz": GZIP, "gzip": GZIP, "tgz": GZIP, "zst": ZSTD, "zstd": ZSTD}


def by_magic(head: bytes) -> Compression | None:
    """The compression whose magic bytes ``head`` starts with, or None (plain data)."""
    for comp in COMPRESSIONS:
        if head[: len(comp.magic)] == comp.magic:
            return comp
    return None


def by_name(name) -> Compression | None:
    """The compression a file name's suffix (or a name such as ``"gz"``/``"zstd"``) asks for."""
    text = str(name).lower()
    if text in _ALIASES:
        return _ALIASES[text]
    for comp in COMPRESSIONS:
        if text.endswith(comp.suffixes):
            return comp
    return None


def is_compressed_name(name) -> bool:
    """Whether a file name's suffix asks for compression (``.tgz``, ``.tar.zst``...)."""
    text = str(name).lower()
    return any(text.endswith(comp.suffixes) for comp in COMPRESSIONS)


def open_compressed_writer(raw: BinaryIO, name, level: int | None = None):
    """Wrap ``raw`` in a compressor chosen by the suffix of ``name`` (.tgz, .tar.gz, .tar.zst).

    Returns ``(stream, closer)`` where ``closer()`` flushes the compressor without closing ``raw``.
    """
    lower = str(name).lower()
    for comp in COMPRESSIONS:
        if lower.endswith(comp.suffixes):
            return comp.writer(raw, level)
    return raw, (lambda: None)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def decompressed_chunks(chunks: Iterable[bytes], source=None) -> Iterator[bytes]:
    """Detect gzip or zstd by magic bytes and yield the decompressed stream; pass others through.

    The chunks may be memoryviews of a reused buffer (see ``tario.read_chunks(reuse=True)``).
    """
    it = iter(chunks)
    first = b""
    for piece in it:  # gather enough bytes to see a magic number
        first += piece
        if len(first) >= _MAGIC_LEN:
            break
    if not first:
        return
    comp = by_magic(first)
    if comp is None:
        yield first
        yield from it
    else:
        yield from _frames(comp, first, it, source)


def _frames(comp: Compression, first: bytes, rest: Iterator[bytes], source) -> Iterator[bytes]:
    """The one frame loop: members/frames back to back, zero padding after the last one."""
    d = comp.reader()
    pending = first
    consumed = 0  # compressed bytes handed to the decoders so far
    member = 0  # offset of the current member/frame in the compressed stream
    while True:
        while pending:
            if d.eof:  # a member/frame ended: zero padding, or the next one
                stripped = bytes(pending).lstrip(b"\0")  # may be a reused memoryview
                consumed += len(pending) - len(stripped)
                pending = stripped
                if not pending:
                    break
                d = comp.reader()
                member = consumed
            try:
                out, left = d.step(pending)
            except _Damage as damage:
                if damage.out:
                    yield damage.out
                raise CompressionError(str(damage), url=source, offset=member + damage.at) from None
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
        raise TruncatedShardError(
            f"{comp.name} stream ends early (truncated file?)", url=source, offset=consumed
        )
