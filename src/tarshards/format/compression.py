"""The compressions tarshards reads and writes: one table, one frame loop.

Every part of the library that needs to know about compression asks this module: the reader
(:func:`decompressed_chunks`, found by magic bytes), the indexer (the same, with ``on_frame``),
the writer (:func:`open_compressed_writer`, chosen by file suffix) and the cache
(:func:`by_magic`, to tell a shard from an error page).

gzip and zstandard are the library's own (written sample-aligned too); bzip2 and xz (the standard
library's ``bz2``/``lzma``) and lz4 (the optional ``lz4`` package) are read and written as GNU
tar's ``-j``/``-J``/``--lz4`` make them. Formats that hold no tar stream tarshards can read
(lzip, Unix compress, zip, 7z, rar) are named in the error. All are read by the same loop,
:func:`_frames`: a stream may hold several members/frames/streams back to back (``cat a.gz
b.gz``, pigz, pzstd's skippable frames, pbzip2, multi-stream xz), with zero padding after the
last one. A corrupt stream raises :class:`~tarshards.errors.CompressionError` at the
compressed byte offset of the damage, after yielding everything that decompressed before it; a
stream that stops inside a member raises :class:`~tarshards.errors.TruncatedShardError`.
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

from ..errors import CompressionError, MissingDependencyError, TruncatedShardError

__all__ = [
    "COMPRESSIONS",
    "Compression",
    "by_magic",
    "FlushedGzip",
    "by_name",
    "decompressed_chunks",
    "flush_points",
    "gzip_layout",
    "inflated_from",
    "foreign_format",
    "is_compressed_name",
    "not_plain",
    "open_compressed_writer",
]

_OUT_LIMIT = 4 << 20  # most output bytes one gzip step produces (bounds a decompression bomb)
_INFLATE_STEP = 64 << 10  # output bytes per step of inflated_from (what is asked for, no more)
_SALVAGE_STEP = 4096  # compressed bytes per step when salvaging the output before a corruption
_SALVAGE_LIMIT = 64 << 20  # most output salvaged from one failing step


@dataclass(frozen=True)
class Compression:
    """One compression: its ``name``, the ``magics`` its streams may start with (the first is
    the usual one), the file ``suffixes`` that choose it for writing (the first is the canonical
    one), ``reader`` (returns a fresh decoder for one member/frame/stream), ``writer``
    (``(raw, level) -> (stream, close)``) and ``frame`` (``level -> (bytes -> one complete
    member/frame/stream)``, deterministic: sample-aligned writing)."""

    name: str
    magics: tuple[bytes, ...]
    suffixes: tuple[str, ...]
    reader: Callable[[], "_Decoder"]
    writer: Callable[[BinaryIO, int | None], tuple]
    frame: Callable[[int | None], Callable[[bytes], bytes]]

    @property
    def magic(self) -> bytes:
        return self.magics[0]

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
    more = False  # output held back inside the decoder: step(b"") gives more of it

    def step(self, data) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def flush(self) -> bytes:
        return b""


class _GzipDecoder(_Decoder):
    __slots__ = ("_d", "_fed", "_full")

    def __init__(self):
        self._d = zlib.decompressobj(31)  # wbits=31: the gzip container, one member
        self._fed = 0
        self._full = False  # the last step gave all it may: zlib may hold more output

    @property
    def more(self):
        return self._full and not self._d.eof

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
        self._full = len(out) >= _OUT_LIMIT
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
# skippable frames (magic 0x184D2A50..5F, little-endian): pzstd puts one before every frame, and
# seekable-zstd writers a seek table after the last; zstandard reads them as empty frames
_ZSTD_SKIPPABLE = tuple(bytes((0x50 + i, 0x2A, 0x4D, 0x18)) for i in range(16))
# the largest window a frame may ask for: zstd --long=31 (zstandard's default limit is 128 MiB)
_ZSTD_WINDOW_MAX = 1 << 31


class _ZstdDecoder(_Decoder):
    """One zstd frame, handed to zstandard one unit at a time (the frame header, each block, the
    checksum), so that an error loses only the unit it is in."""

    __slots__ = ("_buf", "_checksum", "_d", "_error", "_fed", "_raw", "_state")

    def __init__(self):
        zstandard = _zstandard()
        # one frame; not reusable
        self._d = zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW_MAX).decompressobj()
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


class _StreamDecoder(_Decoder):
    """One bzip2 / xz / lz4 stream, through a decompressor with the API of ``bz2``'s and
    ``lzma``'s (``decompress(data, max_length)``, ``eof``, ``unused_data``, ``needs_input``).

    They take all the input they are given and hold back the output over ``max_length`` (then
    ``more`` is true, and ``step(b"")`` gives the next part). They cannot be copied, so the
    offset of a damage is that of the step's input (where the bad block starts or earlier), and
    the output of the failing step is lost."""

    __slots__ = ("_d", "_errors", "_fed", "_name")

    def __init__(self, d, errors: tuple, name: str):
        self._d = d
        self._errors = errors
        self._name = name
        self._fed = 0

    @property
    def eof(self):
        return self._d.eof

    @property
    def more(self):
        d = self._d
        return not d.eof and not d.needs_input

    def step(self, data):
        d = self._d
        try:
            out = d.decompress(data, _OUT_LIMIT)
        except self._errors as exc:
            raise _Damage(f"corrupt {self._name} data: {exc}", self._fed, b"") from None
        left = (d.unused_data or b"") if d.eof else b""  # lz4's is None at the end of input
        self._fed += len(data) - len(left)
        return out, left


def _bzip2_decoder() -> _Decoder:
    import bz2

    return _StreamDecoder(bz2.BZ2Decompressor(), (OSError, ValueError), "bzip2")


def _xz_decoder() -> _Decoder:
    import lzma

    return _StreamDecoder(lzma.LZMADecompressor(lzma.FORMAT_XZ), (lzma.LZMAError,), "xz")


def _lz4_frame():
    try:
        import lz4.frame
    except ImportError:
        raise MissingDependencyError("lz4 shards need the lz4 package: pip install lz4") from None
    return lz4.frame


def _lz4_decoder() -> _Decoder:
    frame = _lz4_frame()
    return _StreamDecoder(frame.LZ4FrameDecompressor(), (RuntimeError,), "lz4")


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


def _gzip_frame(level: int | None):
    lv = 6 if level is None else level

    def gz(data: bytes) -> bytes:  # no name, mtime 0
        c = zlib.compressobj(lv, zlib.DEFLATED, 31)
        return c.compress(data) + c.flush()

    return gz


# ---------------------------------------------------------------------------------------------
# sample-aligned gzip: one member, a full flush before each sample
# ---------------------------------------------------------------------------------------------

# the gzip header's comment (FCOMMENT) names the layout and its version. (Not an FEXTRA
# subfield: Python 3.11's streaming tarfile reads FEXTRA from the decompressed stream, a bug
# that turns such a header into "invalid compressed data".)
_FLUSH_COMMENT = b"tarshards:flush1\x00"
# gzip header: magic, deflate, FCOMMENT, mtime 0, no extra flags, OS "unknown", the comment
GZIP_FLUSH_HEADER = b"\x1f\x8b\x08\x10\x00\x00\x00\x00\x00\xff" + _FLUSH_COMMENT
# what ends each sample: a full flush (an empty stored block: ..., 00 00 ff ff, byte-aligned,
# the match history dropped) and one more empty stored block (00 00 00 ff ff), so that a flush
# point is told from compressed data by 9 bytes, not 4 (the chance that data holds them: 2^-72)
_FLUSH_MARK = b"\x00\x00\x00\xff\xff"
FLUSH_SIGNATURE = b"\x00\x00\xff\xff" + _FLUSH_MARK


class FlushedGzip:
    """Sample-aligned gzip as one gzip member: ``header`` first, then :meth:`sample` for each
    sample's tar bytes (deflated, then a full flush: the next sample starts a fresh deflate
    block that refers to nothing before it), then :meth:`end` (the last bytes, the final block
    and the trailer). A raw inflater (``zlib.decompressobj(-15)``) started at the offset where
    a sample's bytes begin (a *flush point*) decompresses that sample alone, and every gzip
    reader sees one ordinary gzip stream. The header's comment names the layout
    (:func:`gzip_layout`). Deterministic (mtime 0, no name)."""

    header = GZIP_FLUSH_HEADER

    def __init__(self, level: int | None = None):
        self._c = zlib.compressobj(6 if level is None else level, zlib.DEFLATED, -15)
        self._crc = 0
        self._size = 0

    def sample(self, data) -> bytes:
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)
        c = self._c
        return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH) + _FLUSH_MARK

    def end(self, data=b"") -> bytes:
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)
        c = self._c
        body = c.compress(data) + c.flush(zlib.Z_FINISH)
        return body + struct.pack("<II", self._crc, self._size & 0xFFFFFFFF)


def gzip_layout(head: bytes | memoryview) -> str | None:
    """``"flush"`` where ``head`` (the first bytes of a file) is the gzip header of the
    sample-aligned one-member layout (:class:`FlushedGzip`), else None."""
    return "flush" if bytes(head[: len(GZIP_FLUSH_HEADER)]) == GZIP_FLUSH_HEADER else None


def flush_points(chunks: Iterable[bytes], on_point: Callable[[int], None]) -> Iterator[bytes]:
    """``chunks`` (the compressed bytes of a :class:`FlushedGzip` shard) cut so that each flush
    point ends a piece; ``on_point(offset)`` is called for each (first for the offset where the
    deflate data starts, after the header) when the piece ending there has been consumed, that
    is when the next piece is asked for: a decompressor fed these pieces one by one has then
    handed out everything before the point."""
    sig = FLUSH_SIGNATURE
    keep = len(sig) - 1
    tail = b""  # the last bytes of what was handed on (a signature may span two chunks)
    at = 0  # offset of the next byte handed on
    started = False
    for chunk in chunks:
        data = bytes(chunk)
        if not started:
            started = True
            on_point(len(GZIP_FLUSH_HEADER))
        window = tail + data
        pos = 0  # in data
        search = 0  # in window
        while True:
            hit = window.find(sig, search)
            if hit < 0:
                break
            end = hit + len(sig) - len(tail)  # in data (a signature never lies inside tail)
            if end > pos:
                yield data[pos:end]
                at += end - pos
                pos = end
            on_point(at)
            search = hit + len(sig)
        if pos < len(data):
            yield data[pos:]
            at += len(data) - pos
        tail = window[-keep:]


def inflated_from(chunks: Iterable[bytes], source=None, offset: int = 0, *, bounded: bool = False):
    """The tar bytes from a flush point of a :class:`FlushedGzip` shard: ``chunks`` are the
    file's bytes from there (``offset`` in the file, for errors). Raw deflate, up to the end of
    the deflate stream (the gzip trailer after it is not checked: its CRC covers the whole
    member) or, ``bounded`` (a sample's byte range), to the end of ``chunks``; a stream that
    ends early otherwise raises :class:`~tarshards.errors.TruncatedShardError`."""
    d = zlib.decompressobj(-15)
    fed = 0
    for chunk in chunks:
        data = chunk
        while data:
            try:  # a step's output is small: a resumed read may want only a few samples
                out = d.decompress(data, _INFLATE_STEP)
            except zlib.error as exc:
                raise CompressionError(
                    f"corrupt gzip data: {exc}", url=source, offset=offset + fed
                ) from None
            left = d.unused_data if d.eof else d.unconsumed_tail
            fed += len(data) - len(left)
            if out:
                yield out
            if d.eof:
                return
            data = left
    tail = d.flush()
    if tail:
        yield tail
    if not bounded and not d.eof:
        raise TruncatedShardError(
            "gzip stream ends early (truncated file?)", url=source, offset=offset + fed
        )


def _zstd_frame(level: int | None):
    zstandard = _zstandard()
    return zstandard.ZstdCompressor(
        level=3 if level is None else level, write_content_size=True
    ).compress


def _bz2_frame(level: int | None):
    import bz2

    return functools.partial(bz2.compress, compresslevel=9 if level is None else level)


def _xz_frame(level: int | None):
    import lzma

    return functools.partial(
        lzma.compress, format=lzma.FORMAT_XZ, preset=6 if level is None else level
    )


def _lz4_one_frame(level: int | None):
    return functools.partial(_lz4_frame().compress, compression_level=0 if level is None else level)


def _file_writer(opener, level_name: str, default: int):
    """A writer over a file-object compressor of the standard library's kind (bz2, lzma, lz4)."""

    def writer(raw: BinaryIO, level: int | None):
        f = opener(raw, **{level_name: default if level is None else level})
        return f, f.close  # closes the compressor, not raw

    return writer


def _bz2_open(raw, compresslevel):
    import bz2

    return bz2.BZ2File(raw, "wb", compresslevel=compresslevel)


def _xz_open(raw, preset):
    import lzma

    return lzma.LZMAFile(raw, "wb", format=lzma.FORMAT_XZ, preset=preset)


def _lz4_open(raw, compression_level):
    return _lz4_frame().LZ4FrameFile(raw, "wb", compression_level=compression_level)


GZIP = Compression(
    "gzip", (b"\x1f\x8b",), (".tgz", ".tar.gz", ".gz"), _GzipDecoder, _gzip_writer, _gzip_frame
)
ZSTD = Compression(
    "zstd",
    (_ZSTD_MAGIC, *_ZSTD_SKIPPABLE),
    (".tar.zst", ".tzst", ".zst"),
    _ZstdDecoder,
    _zstd_writer,
    _zstd_frame,
)
BZIP2 = Compression(
    "bzip2",
    (b"BZh",),
    (".tar.bz2", ".tbz2", ".tbz", ".bz2"),
    _bzip2_decoder,
    _file_writer(_bz2_open, "compresslevel", 9),
    _bz2_frame,
)
XZ = Compression(
    "xz",
    (b"\xfd7zXZ\x00",),
    (".tar.xz", ".txz", ".xz"),
    _xz_decoder,
    _file_writer(_xz_open, "preset", 6),
    _xz_frame,
)
LZ4 = Compression(
    "lz4",
    (b"\x04\x22\x4d\x18",),
    (".tar.lz4", ".tlz4", ".lz4"),
    _lz4_decoder,
    _file_writer(_lz4_open, "compression_level", 0),
    _lz4_one_frame,
)
COMPRESSIONS: tuple[Compression, ...] = (GZIP, ZSTD, BZIP2, XZ, LZ4)
# containers and compressions that hold no tar stream tarshards reads: named in the error (only
# where the first block is not a tar header: a member may be called "PK...")
_FOREIGN = (
    (b"LZIP", "lzip", "decompress it (lzip -d) and re-compress with gzip, zstd or xz"),
    (b"\x1f\x9d", "Unix compress (.Z)", "decompress it (gzip -d or uncompress)"),
    (b"\x1f\xa0", "LZH compress", "decompress it"),
    (b"PK\x03\x04", "zip", "a zip archive is not a tar shard: unpack it and tar the files"),
    (b"7z\xbc\xaf\x27\x1c", "7z", "a 7z archive is not a tar shard: unpack it and tar the files"),
    (b"Rar!\x1a\x07", "rar", "a rar archive is not a tar shard: unpack it and tar the files"),
    (b"\x5d\x00\x00", "lzma (legacy .lzma)", "re-compress it as xz, gzip or zstd"),
)
_MAGIC_LEN = max(
    len(m) for m in [*(m for c in COMPRESSIONS for m in c.magics), *(f[0] for f in _FOREIGN)]
)
_ALIASES = {
    "gz": GZIP,
    "gzip": GZIP,
    "tgz": GZIP,
    "zst": ZSTD,
    "zstd": ZSTD,
    "bz2": BZIP2,
    "bzip2": BZIP2,
    "xz": XZ,
    "lz4": LZ4,
}


def by_magic(head: bytes | memoryview) -> Compression | None:
    """The compression whose magic bytes ``head`` starts with, or None (plain data)."""
    head = bytes(head[:_MAGIC_LEN])
    for comp in COMPRESSIONS:
        for magic in comp.magics:
            if head[: len(magic)] == magic:
                return comp
    return None


def _tar_header_ok(block: bytes | memoryview) -> bool:
    """Whether ``block`` (512 bytes) has a valid tar header checksum (unsigned or signed)."""
    if len(block) < 512:
        return False
    try:
        stored = int(bytes(block[148:156]).split(b"\0")[0].strip() or b"-1", 8)
    except ValueError:
        return False
    rest = bytes(block[:148]) + b" " * 8 + bytes(block[156:512])
    return stored in (sum(rest), sum(b - 256 if b > 127 else b for b in rest))


def not_plain(head: bytes | memoryview) -> bool:
    """Whether a stream starting with ``head`` (its first 512 bytes, or all of a shorter one)
    goes through :func:`decompressed_chunks` (compressed, or a format it names in an error)."""
    return by_magic(head) is not None or foreign_format(head) is not None


def foreign_format(head: bytes | memoryview) -> tuple[str, str] | None:
    """``(name, what to do)`` where ``head`` starts like a format tarshards does not read (and
    is not a tar header), else None."""
    for magic, name, advice in _FOREIGN:
        if bytes(head[: len(magic)]) == magic:
            return None if _tar_header_ok(head[:512]) else (name, advice)
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


def decompressed_chunks(
    chunks: Iterable[bytes], source=None, on_frame: Callable[[int, int], None] | None = None
) -> Iterator[bytes]:
    """Detect the compression by magic bytes and yield the decompressed stream; pass plain data
    through. A format tarshards does not read (zip, lzip, ...) raises
    :class:`~tarshards.errors.CompressionError` saying what it is and what to do.

    ``on_frame(compressed offset, decompressed offset)`` is called where each gzip member, zstd
    frame or bzip2/xz/lz4 stream starts (the indexer records them: a sample-aligned shard's
    samples can be read alone). The chunks may be memoryviews of a reused buffer (see
    ``tario.read_chunks(reuse=True)``).
    """
    it = iter(chunks)
    first = b""
    want = _MAGIC_LEN
    for piece in it:  # gather enough bytes to see a magic number
        first += piece
        if len(first) >= want:
            if want < 512 and by_magic(first) is None and foreign_format(first) is not None:
                want = 512  # the first block, to tell a tar header from the foreign format
                continue
            break
    if not first:
        return
    comp = by_magic(first)
    if comp is None:
        foreign = foreign_format(first)
        if foreign is not None:
            name, advice = foreign
            raise CompressionError(
                f"this shard is {name} data, which tarshards does not read: {advice}",
                url=source,
                offset=0,
            )
        yield first
        yield from it
    else:
        yield from _frames(comp, first, it, source, on_frame)


def _frames(
    comp: Compression, first: bytes, rest: Iterator[bytes], source, on_frame=None
) -> Iterator[bytes]:
    """The one frame loop: members/frames/streams back to back, zero padding after the last."""
    d = comp.reader()
    pending = first
    consumed = 0  # compressed bytes handed to the decoders so far
    produced = 0  # decompressed bytes handed out
    member = 0  # offset of the current member/frame in the compressed stream
    if on_frame is not None:
        on_frame(0, 0)
    while True:
        while pending or d.more:
            if d.eof:  # a member/frame ended: zero padding, or the next one
                stripped = bytes(pending).lstrip(b"\0")  # may be a reused memoryview
                consumed += len(pending) - len(stripped)
                pending = stripped
                if not pending:
                    break
                d = comp.reader()
                member = consumed
                if on_frame is not None:
                    on_frame(member, produced)
            try:
                out, left = d.step(pending)
            except _Damage as damage:
                if damage.out:
                    yield damage.out
                raise CompressionError(str(damage), url=source, offset=member + damage.at) from None
            consumed += len(pending) - len(left)
            pending = left
            if out:
                produced += len(out)
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
