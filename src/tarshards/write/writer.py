"""Writing shards: ``TarWriter`` for one tar file, ``ShardWriter`` for a numbered series.

Both write to a temporary name and commit by rename (or upload, for remote URLs) when closed, so
a crash or an exception never leaves a half-written shard under its final name.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Callable, Literal, Sequence, TypeVar, cast

from ..codecs.registry import encode_value
from ..errors import PipeNotAllowedError
from ..format.compression import FlushedGzip, by_name, is_compressed_name, open_compressed_writer
from ..format.names import parse_size
from ..storage import AtomicOutput, remove_stale_temporaries, temporary_directory
from ..tario import BLOCK, TarMemberWriter, header_number, header_size

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from ..format.index import ShardIndex
    from ..format.manifest import Manifest, ManifestRecorder

__all__ = ["ShardInfo", "ShardWriter", "TarWriter", "sample_members", "shard_name"]

logger = logging.getLogger(__name__)

# where TarWriter writes: a path, a URL, "-" (stdout), "pipe:CMD", or a binary file object
Destination = str | os.PathLike[str] | IO[bytes]
# ShardWriter(meta=): {name: fn(sample) -> number}, fn(sample) -> {name: number}, or a list
MetaFunctions = dict[str, Callable[[dict], Any]] | Callable[[dict], Any]
MetaSpec = MetaFunctions | list[MetaFunctions] | tuple[MetaFunctions, ...]
_TW = TypeVar("_TW", bound="TarWriter")  # __enter__ returns the subclass (compat's)
_SW = TypeVar("_SW", bound="ShardWriter")

try:  # optional C accelerator (_speedups, see _c/); _Recorder's lists are the reference
    from .._speedups import Recorder as _CRecorder
    from .._speedups import sample_members as _c_sample_members
except ImportError:  # pragma: no cover - built by default
    _CRecorder = _c_sample_members = None


# bytes written between two requests to the kernel to start writing the shard to the disk
WRITEBACK_EVERY = 8 << 20
_NEVER = float("inf")


def sample_members(sample: dict, encoder: bool = True) -> list[tuple[str, bytes]]:
    """The ``(member name, bytes)`` list a sample dict becomes, sorted by extension."""
    if _c_sample_members is not None:  # the usual samples in one C call (None: decided here)
        members = _c_sample_members(sample, encoder, encode_value)
        if members is not None:
            return members
    return _sample_members_py(sample, encoder)


def _sample_members_py(sample: dict, encoder: bool = True) -> list[tuple[str, bytes]]:
    """:func:`sample_members` in Python: the reference, and every error's message."""
    if not isinstance(sample, dict):
        raise TypeError(f"a sample is a dict, not {type(sample).__name__}")
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ValueError(f"a sample needs a non-empty string '__key__', got {key!r}")
    base = key.rpartition("/")[2]
    if "." in base:
        raise ValueError(
            f"sample key {key!r} contains a dot in its base name; readers would "
            "split the key there. Use another separator"
        )
    if not base or base.startswith("__"):
        raise ValueError(
            f"sample key {key!r} has an empty base name or one starting with "
            "'__'; readers skip such members"
        )
    members = []
    for ext in sorted(sample):
        if ext.startswith("__"):
            continue
        value = sample[ext]
        if value is None:
            continue
        if not ext or "/" in ext:
            raise ValueError(
                f"field {ext!r} of sample {key!r} is not a valid extension "
                "(empty, or contains '/'); readers would not find it"
            )
        if encoder:
            data = encode_value(value, ext)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        elif isinstance(value, str):
            data = value.encode("utf-8")
        else:
            raise TypeError(
                f"field {ext!r} of sample {key!r} is a {type(value).__name__}; "
                "with encoder=False every field must be bytes or str"
            )
        members.append((f"{key}.{ext}", data))
    if not members:
        raise ValueError(f"sample {key!r} has no fields to write")
    return members


def _members_size_py(members, header_size=header_size) -> int:
    """The bytes a write of ``members`` takes in the tar stream (headers, data, padding)."""
    return sum(header_size(n, len(d)) + len(d) + (-len(d) % BLOCK) for n, d in members)


try:  # the same in C (one call per write instead of a few per member)
    from .._speedups import members_size as _members_size
except ImportError:  # pragma: no cover - built by default
    _members_size = _members_size_py


class TarWriter:
    """Write sample dicts to one tar shard.

    ``dest`` is a path, a URL (``s3://...``, through fsspec), ``-`` (stdout), a binary file
    object, or ``pipe:CMD`` (the tar stream goes to the stdin of a shell command; only with
    ``allow_pipe=True``, and not atomic: the command writes what it writes). Each sample needs
    ``__key__``; other fields starting with ``__`` are not written.
    bytes and str are written as they are; other values are encoded by extension (PIL image or
    ndarray -> image formats, int -> cls, dict -> json, ndarray -> npy...) unless
    ``encoder=False``. Members are sorted by extension within a sample; headers are deterministic
    (``mtime``, mode 0444, owner 0), so equal samples give byte-identical shards. Compression is
    chosen by suffix (``.tgz``, ``.tar.gz``, ``.tar.zst``; not for ``pipe:``, where the command
    decides) or by ``compress="gz"|"zst"|"bz2"|"xz"|"lz4"|None`` (``.tar.bz2``, ``.tar.xz``,
    ``.tar.lz4`` by suffix too; lz4 needs the ``lz4`` package). An ``mtime`` that does not fit
    a tar header (negative, or in milliseconds) raises :class:`~tarshards.errors.EncodeError`.

    A local shard is written to a temporary file beside it and appears under its final name only
    when complete (flushed to disk first); opening also removes temporaries that writers killed
    earlier left in that directory (``remove_stale=False`` skips that).
    """

    def __init__(
        self,
        dest: Destination,
        *,
        encoder: bool = True,
        compress: str | bool | None = None,
        mtime: int = 0,
        storage_options: dict | None = None,
        level: int | None = None,
        allow_pipe: bool = False,
        remove_stale: bool = True,
        index: bool | str = False,
        aligned: bool = False,
        hash: str | None = None,
    ):
        self.dest = dest
        self.encoder = encoder
        if compress in (None, False):
            suffix = None
        else:
            chosen = by_name("gz" if compress is True else compress)
            if chosen is None or not isinstance(compress, (str, bool)):
                raise ValueError(
                    f"compress must be None, 'gz', 'zst', 'bz2', 'xz' or 'lz4', not {compress!r}"
                )
            suffix = chosen.suffix
        mtime = header_number(mtime, 8**11, "mtime")  # before anything is created
        self._out = AtomicOutput(
            dest, storage_options=storage_options, allow_pipe=allow_pipe, remove_stale=remove_stale
        )
        self.name = self._out.name
        self.index: ShardIndex | None = None  # the ShardIndex, after close() when recording
        self._recorder: _Recorder | None = None
        try:
            if suffix is None:
                named = (
                    isinstance(self.name, str)
                    and compress is None
                    and not self.name.startswith("pipe:")
                )
                suffix = self.name if named else ""
            self.compressed = is_compressed_name(suffix)
            if index or aligned:
                # the recorder gives the stream to write into and the sink for each sample's
                # tar bytes, and is told each write (write_members): the one interface
                rec = self._recorder = _Recorder(self._out, suffix, level, aligned, hash, index)
                self._stream, self._close_compressor = rec.stream, rec.close_compressor
                self._tar = TarMemberWriter(self._stream, mtime=mtime, writelines=rec.writelines())
                rec.attach(self._tar)
            else:
                self._stream, self._close_compressor = open_compressed_writer(
                    self._out.stream, suffix, level
                )
                self._tar = TarMemberWriter(self._stream, mtime=mtime)
        except BaseException:
            self._out.abort()
            raise
        self.count = 0
        self.closed = False
        # every WRITEBACK_EVERY bytes the kernel is asked to start writing the file out (see
        # AtomicOutput.start_writeback): the fsync at commit then finds little left to write
        self._writeback_at = WRITEBACK_EVERY if self._out.can_write_back else _NEVER

    @property
    def size(self) -> int:
        """Uncompressed bytes written so far."""
        return self._tar.bytes_written

    def encode(self, sample: dict) -> list[tuple[str, bytes]]:
        """The ``(member name, bytes)`` list one sample becomes."""
        return sample_members(sample, encoder=self.encoder)

    def write(self, sample: dict) -> int:
        """Write one sample; returns the uncompressed bytes it took."""
        return self.write_members(self.encode(sample), key=sample["__key__"])

    def write_members(self, members: list[tuple[str, bytes]], key: str | None = None) -> int:
        """Write one sample's ``(name, bytes)`` members (``key``: its key, when the names are
        ``KEY.EXT`` as :func:`sample_members` makes them)."""
        if self.closed:
            raise ValueError(f"write to a closed TarWriter ({self.name})")
        rec = self._recorder
        if rec is None or rec.read_back:  # nothing recorded here (or the read-back thread does)
            n = self._tar.add_all(members)
        elif (
            key is not None
            and (fast := rec.fast) is not None
            and (recorded := self._tar.add_recorded(members, fast, key)) is not None
        ):
            n = recorded  # the recorder's hot path: written and recorded in one C call
        elif rec.fast is None:  # its general path (and aligned frames): before the write
            rec.before_sample(members, key)
            n = self._tar.add_all(members)
            if rec.aligned:
                rec.after_sample()
        else:  # the write, then record (else the general path)
            n = self._tar.add_all(members)
            if key is None or not rec.fast.record(members, key):
                rec.before_sample(members, key)
        self.count += 1
        if self._tar.bytes_written >= self._writeback_at:
            self._writeback_at = self._tar.bytes_written + WRITEBACK_EVERY
            self._out.start_writeback()
        return n

    def close(self) -> None:
        """Finish the archive and commit it under its final name."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._recorder is not None:
                self._recorder.before_sample(())
            self._tar.finish()
            if self._recorder is not None:
                self._recorder.after_sample()
            self._close_compressor()
        except BaseException:
            if self._recorder is not None:
                self._recorder.close()
            self._out.abort()
            raise
        if self._recorder is None:
            self._out.commit()
            return
        try:
            self._out.commit()
            self.index = self._recorder.finish(self.name if isinstance(self.name, str) else None)
        finally:
            self._recorder.close()  # the hashing thread ends with the shard, whatever happened

    def abort(self) -> None:
        """Discard the shard (nothing appears under the final name)."""
        if not self.closed:
            self.closed = True
            if self._recorder is not None:
                self._recorder.close()
            self._out.abort()

    def __enter__(self: _TW) -> _TW:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


class _Recorder:
    """What ``TarWriter(index=...)`` / ``aligned=True`` adds: the index of what is written (member
    offsets and checksums, the file's hash), and sample-aligned compression, so that a sample
    decompresses alone: gzip as one member with a full flush before each sample
    (:class:`~tarshards.format.compression.FlushedGzip`; every gzip reader sees one ordinary
    stream), zstd and lz4 as a frame per sample (read across frames by zstd, zstandard's
    ``read_across_frames=True``, lz4). bzip2 and xz are written as one stream even when
    ``aligned``: Python's ``tarfile`` reads only the first stream of those, and would lose the
    rest without a word.

    The hot path is one C call per write (``_speedups.tar_sample`` with the shard's
    ``_speedups.Recorder``, ``fast``; ``Recorder.record`` where a write was made apart):
    it lays out the index's rows as it goes (per member: sample number, extension code, header
    and data offsets, size, checksum; per sample: offset and end; the key appended to ``keys``
    when a new sample starts), so closing the shard only copies them out. Writes the C path does
    not take (names that are not ``KEY.EXT``, no C extension) are kept as lists (name, size,
    checksum).

    Reading back (``read_back``): where the output is a temporary file (local or to be
    uploaded) and both hashes are xxh3_64 (the defaults), a thread reads the shard back as it is
    written (``hashing.background_hasher``) and hashes it there; for a plain shard it also makes
    the index's rows from the headers it reads, naming members as the reader does, so the
    writing thread neither hashes nor records anything per sample (``finish`` takes the rows).
    Elsewhere (compressed, aligned, or a stream) the rows are recorded as above; a plain shard is
    hashed on its way into the output's buffer (``Xxh3.tee``: each part hashed, then written), a
    compressed one as its compressed bytes leave (by the thread, where there is one), and the
    member checksums are computed in C on each bytes value as given."""

    def __init__(
        self,
        out: AtomicOutput,
        suffix: str,
        level: int | None,
        aligned: bool,
        hash: str | None,
        index: bool | str | os.PathLike[str],
    ):
        from ..format.hashing import (
            DEFAULT_HASH,
            MEMBER_HASH,
            background_hasher,
            file_hasher,
            member_checksum_c,
            member_checksum_fn,
        )

        self.out = out
        self.tar: TarMemberWriter | None = None  # the member writer (attach), for its offsets
        self._codes: dict = {}
        self.save_to = index if isinstance(index, str) or hasattr(index, "__fspath__") else None
        self.algorithm = hash or DEFAULT_HASH
        self.member_hash = MEMBER_HASH
        self.csum = member_checksum_fn(MEMBER_HASH)
        self.names: list = []
        self.sizes: list = []
        self.sums: list = []
        self.keys: list | None = []  # the samples' keys (None once a write came without one)
        self.counts: list = []  # the general path's: members per entry of keys
        self.frames: list = []  # (file offset, tar offset) of each sample's frame (aligned)
        self.nbytes = 0
        self.raw = out.stream
        comp = by_name(suffix) if suffix else None
        self.compression = "none" if comp is None else comp.name
        self.aligned = aligned and self.compression in _ALIGNABLE
        self._flushed = FlushedGzip(level) if self.aligned and self.compression == "gzip" else None
        # a thread that reads the shard back from its temporary file as it is written
        # (hashing.background_hasher; None: hashed and recorded here, inline): the file hash,
        # and for a plain shard the member checksums and the index's columns too
        tmp = out.temporary_path
        plain = self.compression == "none"
        self.background = (
            None
            if tmp is None or self.aligned
            else background_hasher(tmp, self.algorithm, MEMBER_HASH, members=plain, index=plain)
        )
        # the thread makes the index's rows too: nothing is recorded on the writing thread
        self.read_back = self.background is not None and plain
        # the file hash object (the thread's digest is taken at close where there is one)
        self.hasher = file_hasher(self.algorithm) if self.background is None else _NO_HASH
        # the fast path (None: the lists below, the general path); `record` is what
        # TarWriter.write_members calls after each write (not in aligned mode, where
        # before_sample marks the frames before the write)
        self._fast = (
            None
            if _CRecorder is None or self.read_back
            else _CRecorder(self.keys, self._codes, member_checksum_c(MEMBER_HASH), header_size)
        )
        # the hot path's recorder, which TarWriter.write_members hands tar_sample (None: none,
        # as in aligned mode, where before_sample records ahead of each frame)
        self.fast = None if self.aligned else self._fast
        self._parts: list[ReadableBuffer] = []  # aligned mode: one sample's tar bytes
        self._compress: Callable[[bytes], bytes]  # aligned mode: one sample's tar bytes
        # the stream TarWriter writes into, and what closes it (TarWriter takes both)
        self.stream: Any
        self.close_compressor: Callable[[], None]
        if self._flushed is not None:
            self._compress = self._flushed.sample
            self.stream, self.close_compressor = self, self._end_flushed
            self.write_raw(self._flushed.header)
        elif self.aligned:
            assert comp is not None  # aligned: a compression of _ALIGNABLE
            self._compress = comp.frame(level)
            self.stream, self.close_compressor = self, (lambda: None)
        elif self.compression != "none":
            # cast: a raw binary stream (the compressors only write and flush it)
            self.stream, self.close_compressor = open_compressed_writer(
                cast(BinaryIO, _HashingSink(self)), suffix, level
            )
        else:  # hashed sample by sample on the way into the output's buffer (writelines)
            self.stream, self.close_compressor = _HashingSink(self), (lambda: None)

    def writelines(self) -> Callable[[list], object] | None:
        """The sink for each sample's tar bytes that the member writer should use (None: its
        stream's own): aligned, the sample's frame; plain, the output's buffer, hashed on the way
        (or not, where the read-back thread hashes the file)."""
        if self.aligned:
            return self._parts.extend
        if self.compression != "none":
            return None
        bufferable = isinstance(self.raw, (io.BufferedWriter, io.BytesIO, io.FileIO))
        if self.background is not None and bufferable:
            return self.raw.writelines  # the thread hashes what is written
        tee = getattr(self.hasher, "tee", None)
        if tee is not None and bufferable:
            return tee(self.raw.writelines)  # hash each part, then write them
        # one sample's parts: joined (in cache), hashed once (measured: one join and one
        # write beat hashing and writing the parts one by one from Python)
        raw_write = self.raw.write
        update = self.hasher.update
        join = b"".join

        def writelines(parts):
            data = join(parts)
            update(data)
            raw_write(data)

        return writelines

    def attach(self, tar: TarMemberWriter) -> None:
        """The member writer whose output this records (its ``bytes_written``: tar offsets)."""
        self.tar = tar

    def write(self, data: bytes) -> int:  # aligned mode: TarMemberWriter.finish() writes here
        self._parts.append(data)
        return len(data)

    def _end_flushed(self) -> None:
        self.write_raw(self._flushed.end())  # type: ignore[union-attr]

    def write_raw(self, data: bytes) -> None:
        self.hasher.update(data)
        self.nbytes += len(data)
        self.raw.write(data)

    def before_sample(self, members: Sequence[tuple[str, bytes]], key: str | None = None) -> None:
        """The general path of a write (and the frames of aligned mode); TarWriter tried
        ``fast`` (or its ``record``) first where there is one."""
        if self.aligned:
            assert self.tar is not None  # attached before the first write
            self.frames.append((self.nbytes, self.tar.bytes_written))
        if not members:
            return
        if self._fast is not None:
            if key is not None and self._fast.record(members, key):
                return
            self._to_lists(self._fast)
        names, datas = zip(*members)
        self.names += names
        self.sizes += map(len, datas)
        self.sums += map(self.csum, datas)
        if self.keys is not None:
            if key is None:
                self.keys = None
            else:
                self.keys.append(key)
                self.counts.append(len(members))

    def _to_lists(self, fast: Any) -> None:
        """Leave the fast path (``fast``: its C recorder): the packed records so far become the
        general path's lists."""
        import numpy as np

        from ..format.index import MEMBER_DTYPE

        rows = np.frombuffer(fast.members, MEMBER_DTYPE)
        self._fast = self.fast = None
        exts = list(self._codes)
        keys = self.keys or []
        self.names = [
            f"{keys[s]}.{exts[c]}" for s, c in zip(rows["sample"].tolist(), rows["ext"].tolist())
        ]
        self.sizes = rows["size"].tolist()
        self.sums = rows["checksum"].tolist()
        self.counts = np.bincount(rows["sample"], minlength=len(keys)).tolist()

    def close(self) -> None:
        """Stop the hashing thread (idempotent; finish() and the writer's abort() call it)."""
        if self.background is not None:
            self.background.close()

    def after_sample(self) -> None:
        if self.aligned and self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            self.write_raw(self._compress(data))

    def finish(self, url: str | None) -> ShardIndex:
        """The shard's index (the output committed under ``url``), saved where asked."""
        from ..format.index import IndexBuilder, index_from_columns

        if self.compression == "none":
            assert self.tar is not None
            self.nbytes = self.tar.bytes_written
        try:
            if self.background is None:
                digest = self.hasher.hexdigest()
            elif self.read_back:  # the thread's index columns (the file complete)
                digest, *columns, exts = self.background.finish(self.nbytes)
            else:
                digest = self.background.finish(self.nbytes)[0]
        finally:
            self.close()
        fields: dict[str, Any] = dict(
            nbytes=self.nbytes,
            hash=f"{self.algorithm}:{digest}",
            compression=self.compression,
            url=url,
        )
        if self.read_back:
            named = dict(zip(_READ_BACK_COLUMNS, columns))
            named["tar_offsets"] = named["sample_offsets"]
            index = index_from_columns(
                named, tuple(exts), member_hash=self.member_hash, last_dot=False, **fields
            )
            self._save(index)
            return index
        builder = IndexBuilder(
            member_hash=self.member_hash, ext_codes=self._codes if self._fast is not None else None
        )
        if self._flushed is not None:
            builder.entry = "deflate"
        for file_offset, tar_offset in self.frames:
            builder.frame(file_offset, tar_offset)
        if self._fast is not None:
            fast = self._fast
            assert self.keys is not None  # None only on the general path (self._fast is None)
            builder.add_rows(self.keys, fast.samples, fast.members, fast.key_blob, fast.key_offsets)
        else:
            builder.add_written(
                self.names, self.sizes, self.sums, keys=self.keys, counts=self.counts
            )
        index = builder.build(**fields)
        self.names = self.sizes = self.sums = self.frames = []
        self._fast = self.fast = None
        self._save(index)
        return index

    def _save(self, index: ShardIndex) -> None:
        if self.save_to is not None:
            index.save(self.save_to, storage_options=self.out.storage_options)


# what Background(index=True).finish() returns between the hash and the extensions, in order
_READ_BACK_COLUMNS = (
    "sample_offsets",
    "sample_ends",
    "sample_flags",
    "key_offsets",
    "member_sample",
    "member_ext",
    "member_offsets",
    "member_data_offsets",
    "member_sizes",
    "member_checksums",
    "key_blob",
)


class _NoHash:
    """The file hash object while the thread hashes the file (its digest comes from there)."""

    @staticmethod
    def update(data: object) -> None:
        pass

    @staticmethod
    def hexdigest() -> str:  # never called: the file's digest is the thread's
        raise RuntimeError("the file is hashed by the read-back thread")


_NO_HASH = _NoHash()


class _HashingSink(io.RawIOBase):
    """The raw output under a buffer or compressor: hashes and counts the bytes written."""

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]  # bytes-like, as RawIOBase
        n = len(data)
        self.rec.write_raw(data)
        return n

    def flush(self) -> None:
        raw = self.rec.raw
        if not getattr(raw, "closed", False):
            raw.flush()


def meta_functions(meta) -> list:
    """``ShardWriter(meta=...)`` as ``[(name or None, fn)]``: a dict ``{name: fn(sample)}``, a
    function ``fn(sample) -> {name: value}`` (``tarshards.media_meta()``), or a list of them."""
    if meta is None:
        return []
    items = meta if isinstance(meta, (list, tuple)) else [meta]
    out: list = []
    for m in items:
        if isinstance(m, dict):
            for name, fn in m.items():
                if not isinstance(name, str) or not callable(fn):
                    raise TypeError(f"meta= maps column names to functions, got {name!r}: {fn!r}")
                out.append((name, fn))
        elif callable(m):
            out.append((None, m))
        else:
            raise TypeError(f"meta= takes a dict of functions or a function, not {m!r}")
    return out


def meta_row(meta: list, sample: dict) -> dict:
    """The metadata of one sample: each function of ``meta`` (as :func:`meta_functions` gives
    them) applied to it; ``None`` (from a named function, or as a value in a returned dict) is
    no value."""
    row: dict = {}
    for name, fn in meta:
        got = fn(sample)
        if name is None:
            row.update((k, v) for k, v in got.items() if v is not None)
        elif got is not None:
            row[name] = got
    return row


def meta_table(rows: list[dict]) -> dict:
    """Per-sample dicts -> columns (NaN where a sample has no value)."""
    names: dict[str, None] = {}
    for r in rows:
        names.update(dict.fromkeys(r))
    nan = float("nan")
    return {name: [float(r.get(name, nan)) for r in rows] for name in names}


def shard_name(pattern: str, index: int) -> str:
    """Fill a shard pattern: printf style (``out-%06d.tar``) or ``{shard:06d}`` / ``{}``."""
    if "%" in pattern:
        return pattern % index
    if "{" in pattern:
        return pattern.format(index, shard=index)
    raise ValueError(
        f"shard pattern {pattern!r} has no place for the shard number "
        "(use out-%06d.tar or out-{shard:06d}.tar)"
    )


@dataclass
class ShardInfo:
    """One shard written by :class:`ShardWriter`."""

    url: str
    count: int
    size: int
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class ShardWriter:
    """Write samples to a numbered series of shards, starting a new one by count or size.

    A new shard starts before a sample would take the current one past ``maxcount`` samples or
    ``maxsize`` (uncompressed) bytes (a number or a size string such as ``"1GB"`` or
    ``"512MiB"``, as :func:`tarshards.format.names.parse_size` reads it); a single sample larger
    than ``maxsize`` gets a shard of its own. Each shard is committed atomically when complete;
    ``shards`` lists what was written and ``post(url)`` is called after each commit (with
    ``manifest=``, once the shard's index file is saved).

    ``meta=`` (with ``manifest=``): per-sample numeric metadata columns stored with each
    shard's index (:meth:`tarshards.Manifest.meta` reads them): ``{"tokens": fn}``, one column
    per function of the sample (``None``: no value, NaN), or a function returning ``{name:
    value}`` such as :func:`tarshards.media_meta`, or a list of these.
    """

    def __init__(
        self,
        pattern: str,
        maxcount: int = 100_000,
        maxsize: int | float | str = 3e9,
        *,
        start_shard: int = 0,
        verbose: int = 0,
        post: Callable[[str], object] | None = None,
        storage_options: dict | None = None,
        manifest: str | os.PathLike[str] | None = None,
        meta: MetaSpec | None = None,
        **tarwriter_options: Any,
    ):
        if maxcount is None or maxcount < 1:
            raise ValueError(f"maxcount must be >= 1, got {maxcount!r}")
        if maxsize is None:
            raise ValueError("maxsize must be > 0, got None")
        maxsize = parse_size(maxsize, positive=True)  # bytes, or a string like "1GB" / "512MiB"
        first = shard_name(pattern, start_shard)  # validate early
        if first.startswith("pipe:") and not tarwriter_options.get("allow_pipe", False):
            raise PipeNotAllowedError(
                "pipe: outputs run shell commands and are off by default; pass "
                "allow_pipe=True (ShardWriter(..., allow_pipe=True)) if you trust the command",
                url=first,
            )
        self.pattern = pattern
        self.maxcount = int(maxcount)
        self.maxsize = maxsize
        self.shard = start_shard
        self.verbose = verbose
        self.post = post
        self.storage_options = storage_options
        self.tarwriter_options = tarwriter_options
        self.manifest: Manifest | None = None  # after close() with manifest=PATH
        self._manifest: ManifestRecorder | None = None
        if manifest is not None:  # record each shard's index and write the manifest at close
            from ..format.manifest import ManifestRecorder

            self._manifest = ManifestRecorder(manifest, storage_options=storage_options)
            self.tarwriter_options = dict(tarwriter_options, index=True)
        # per-sample metadata columns for the index: {name: fn(sample) -> number}, or
        # fn(sample) -> {name: number}, or a list of them
        self._meta = meta_functions(meta)
        if self._meta and manifest is None:
            raise ValueError("meta= is stored with the shards' indexes: pass manifest= too")
        self._meta_rows: list[dict] = []
        self.shards: list[ShardInfo] = []
        self._writer: TarWriter | None = None
        self._started = 0.0
        self._swept: set[str] = set()  # directories cleared of stale temporaries
        self.total = 0

    @property
    def fname(self) -> str | None:
        """Name of the shard being written (None between shards)."""
        return self._writer.name if self._writer is not None else None

    def _open_next(self) -> None:
        name = shard_name(self.pattern, self.shard)
        self.shard += 1
        if self.verbose:
            print(f"# writing {name}", file=sys.stderr)
        tmpdir = temporary_directory(name)
        if tmpdir is not None and tmpdir not in self._swept:  # once per directory, not per shard
            remove_stale_temporaries(tmpdir)
            self._swept.add(tmpdir)
        options = {**self.tarwriter_options, "remove_stale": False}
        self._writer = TarWriter(name, storage_options=self.storage_options, **options)
        self._started = time.monotonic()

    def _finish_current(self) -> None:
        w = self._writer
        if w is None:
            return
        self._writer = None
        w.close()
        info = ShardInfo(w.name, w.count, w.size, time.monotonic() - self._started)
        rows, self._meta_rows = self._meta_rows, []
        if w.index is not None and self._meta:
            w.index = w.index.with_meta(meta_table(rows))
        if w.index is not None:
            info.extra["hash"] = w.index.hash
            info.extra["nbytes"] = w.index.nbytes
            if self._manifest is not None:  # its index file written behind (ManifestRecorder)
                self._manifest.add(w.name, w.index)
        self.shards.append(info)
        if self.post is not None:
            if self._manifest is not None:
                self._manifest.flush()  # post sees the shard's index under its name
            self.post(w.name)

    def write(self, sample: dict) -> int:
        """Write one sample, rotating shards as needed; returns its uncompressed size."""
        w = self._writer
        members = sample_members(sample, self.tarwriter_options.get("encoder", True))
        size = _members_size(members, header_size)
        if (
            w is not None
            and w.count > 0
            and (w.count + 1 > self.maxcount or w.size + size + 2 * BLOCK > self.maxsize)
        ):
            self._finish_current()
        if self._writer is None:
            self._open_next()
            assert self._writer is not None  # made by _open_next (or a subclass's)
        self.total += 1
        if self._meta:
            self._meta_rows.append(meta_row(self._meta, sample))
        return self._writer.write_members(members, sample["__key__"])

    def close(self) -> None:
        """Commit the last shard (and write the manifest, with ``manifest=``)."""
        self._finish_current()
        self.save_manifest()

    def save_manifest(self) -> Manifest | None:
        """Write the manifest of the shards committed so far (with ``manifest=``); returns it."""
        if self._manifest is not None:
            self.manifest = self._manifest.save()
        return self.manifest

    def abort(self) -> None:
        """Discard the shard being written (the shards committed before it stay, with their
        indexes; the manifest is not written)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        if self._manifest is not None:
            try:
                self._manifest.flush()  # the committed shards' indexes
            except Exception as exc:  # not raised over what made the caller abort
                logger.warning("an index of a committed shard was not saved: %s", exc)

    def __enter__(self: _SW) -> _SW:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


# the compressions aligned=True writes sample-aligned (bzip2 and xz: one stream, see _Recorder)
_ALIGNABLE = ("gzip", "zstd", "lz4")
