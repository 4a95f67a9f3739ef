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


class _Decoder:
    """What the frame loop needs of a decompressor (one member or frame)."""

    name = ""
    error: type = Exception

    def step(self, data) -> tuple[bytes, bytes]:
        """Decompress some of ``data``: ``(output, input left over)``; raises ``error``."""
        raise NotImplementedError

    @property
    def eof(self) -> bool:
        raise NotImplementedError

    def snapshot(self):
        """A copy of the state (to replay input after an error), or None when impossible."""
        return None

    def flush(self) -> bytes:
        return b""


class _GzipDecoder(_Decoder):
    name = "gzip"
    error = zlib.error
    __slots__ = ("_d",)

    def __init__(self, d=None):
        self._d = zlib.decompressobj(31) if d is None else d  # wbits=31: the gzip container

    def step(self, data, limit: int = _OUT_LIMIT):
        d = self._d
        out = d.decompress(data, limit)
        return out, (d.unused_data if d.eof else d.unconsumed_tail)

    @property
    def eof(self):
        return self._d.eof

    def snapshot(self):
        return _GzipDecoder(self._d.copy())

    def flush(self):
        return self._d.flush()


class _ZstdDecoder(_Decoder):
    name = "zstd"
    __slots__ = ("_d",)

    def __init__(self):
        zstandard = _zstandard()
        self._d = zstandard.ZstdDecompressor().decompressobj()  # one frame; not reusable

    @property
    def error(self):
        return _zstandard().ZstdError

    def step(self, data, limit: int = 0):
        d = self._d
        out = d.decompress(data)
        return out, (d.unused_data if d.eof else b"")

    @property
    def eof(self):
        return self._d.eof


def _zstandard():
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is a core dependency
        raise MissingDependencyError(
            "zstd shards need the zstandard package: pip install zstandard") from None
    return zstandard


# ---------------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------------


def _gzip_writer(raw: BinaryIO, level: int | None):
    import gzip

    # filename="": no file name in the gzip header (it would be the random temporary name)
    gz = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0,
                       compresslevel=6 if level is None else level)
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
ZSTD = Compression("zstd", b"\x28\xb5\x2f\xfd", (".tar.zst", ".tzst", ".zst"), _ZstdDecoder,
                   _zstd_writer)
COMPRESSIONS: tuple[Compression, ...] = (GZIP, ZSTD)
_MAGIC_LEN = max(len(c.magic) for c in COMPRESSIONS)
_ALIASES = {"gz": GZIP, "gzip": GZIP, "tgz": GZIP, "zst": ZSTD, "zstd": ZSTD}


def by_magic(head: bytes) -> Compression | None:
    """The compression whose magic bytes ``head`` starts with, or None (plain data)."""
    for comp in COMPRESSIONS:
        if head[:len(comp.magic)] == comp.magic:
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
    while True:
        while pending:
            if d.eof:  # a member/frame ended: zero padding, or the next one
                stripped = bytes(pending).lstrip(b"\0")  # may be a reused memoryview
                consumed += len(pending) - len(stripped)
                pending = stripped
                if not pending:
                    break
                d = comp.reader()
            saved = d.snapshot()
            try:
                out, left = d.step(pending)
            except d.error as exc:
                bad = 0
                if saved is not None:  # replay the input to keep what decoded before the damage
                    bad = yield from _salvage(saved, pending)
                raise CompressionError(f"corrupt {comp.name} data: {exc}", url=source,
                                       offset=consumed + bad) from None
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
        raise TruncatedShardError(f"{comp.name} stream ends early (truncated file?)", url=source,
                                  offset=consumed)


def _salvage(d: _Decoder, data) -> Iterator[bytes]:
    """Feed ``data`` again to ``d`` (a snapshot from before the failing step), in small steps and
    then byte by byte, yielding the output up to the damage; returns the damaged byte's index."""
    data = bytes(data)
    pos = 0
    for step in (_SALVAGE_STEP, 1):
        while pos < len(data):
            piece = data[pos:pos + step]
            saved = d.snapshot()
            try:
                out, left = d.step(piece, 0)
            except d.error:
                d = saved
                break  # retry this piece in smaller steps
            if out:
                yield out
            pos += len(piece) - len(left)
            if d.eof:  # this member ended cleanly: the damage is in the next one
                return pos
    return pos
