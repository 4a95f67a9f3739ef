"""The per-shard index: where each sample and member of a shard is, and a checksum per member.

A :class:`ShardIndex` is made while a shard is written (:class:`IndexBuilder`, fed by
:class:`tarshards.write.writer.TarWriter`) or by one sequential read of an existing shard
(:func:`index_stream`). It is stored as a small binary sidecar (``.tsidx``, see
``docs/format.md``): a JSON header followed by little-endian numpy arrays, read with
``numpy.frombuffer`` (no pickle).

Offsets: ``tar_offsets[i]`` is where sample ``i``'s first header starts in the (uncompressed) tar
stream; ``sample_offsets[i]``/``sample_ends[i]`` are the bytes of the *file* to read for sample
``i`` alone. For plain tar shards the two are the same. For sample-aligned compressed shards
``sample_offsets`` are where each sample's compressed bytes start and ``seekable`` is true;
``entry`` says how to start reading there: ``"member"`` (a gzip member, zstd frame or lz4 frame
of its own: ``TarWriter(..., aligned=True)`` writes zstd and lz4 so, and gzip so before version
2 of the index format) or ``"deflate"`` (a full-flush point inside the one gzip member that
``aligned=True`` writes now, :class:`tarshards.format.compression.FlushedGzip`: a raw inflater
starts
there; index format version 2, which older tarshards refuse by its number). A foreign compressed
shard (one stream for the whole tar) is indexed too (counts, keys, uncompressed offsets), but it
is not ``seekable``: random access to it needs a re-write or decompression from the start.
"""

from __future__ import annotations

import array
import itertools
import json
import operator
import os
import struct
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Callable,
    ContextManager,
    Iterable,
    Iterator,
    Literal,
    Mapping,
    NoReturn,
    Sequence,
    cast,
    overload,
)

if TYPE_CHECKING:
    import numpy.typing as npt

    from ..storage import AtomicOutput

from .._lazy import LazyModule
from ..errors import IntegrityError
from .compression import (
    GZIP,
    by_magic,
    decompressed_chunks,
    flush_points,
    gzip_layout,
    not_plain,
)
from .hashing import (
    DEFAULT_HASH,
    MEMBER_HASH,
    file_hasher,
    member_checksum_c,
    member_checksum_fn,
)

__all__ = [
    "DEFAULT_HASH",
    "INDEX_SUFFIX",
    "IndexBuilder",
    "ShardIndex",
    "index_header",
    "index_stream",
    "index_url",
]

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")  # imported when an array is first asked for

INDEX_MAGIC = b"TSIDX\x00\r\n"
INDEX_VERSION = 1
# version 2: the same file, for an index whose ``entry`` is "deflate" (a reader that does not
# know raw-deflate entry points must not take its offsets for gzip members)
INDEX_VERSIONS = (1, 2)
ENTRIES = ("member", "deflate")
INDEX_SUFFIX = ".tsidx"
BLOCK = 512
_CHUNK = 1 << 20

# ---------------------------------------------------------------------------------------------
# the index value
# ---------------------------------------------------------------------------------------------

_ARRAYS = (  # name, dtype, per ("samples" | "members" | "samples+1" | "keys")
    ("sample_offsets", "<i8", "samples"),
    ("sample_ends", "<i8", "samples"),
    ("tar_offsets", "<i8", "samples"),
    ("sample_flags", "u1", "samples"),
    ("key_offsets", "<i8", "samples+1"),
    ("member_sample", "<u4", "members"),
    ("member_ext", "<u2", "members"),
    ("member_offsets", "<i8", "members"),
    ("member_data_offsets", "<i8", "members"),
    ("member_sizes", "<i8", "members"),
    ("member_checksums", "<u8", "members"),
    ("key_blob", "u1", "keys"),
)
_ARRAY_NAMES = frozenset(name for name, _, _ in _ARRAYS)
_ARRAY_SPEC = {name: (dtype, per) for name, dtype, per in _ARRAYS}
_ITEMSIZE = {"<i8": 8, "<u8": 8, "<u4": 4, "<u2": 2, "u1": 1}
_HEAD = struct.Struct("<II")  # after the magic bytes: format version, JSON header's length
FLAG_DOT_SLASH = 1  # the sample's member names start with "./" (as tar -C DIR . writes them)
# the sample holds a member whose stored bytes are not its content (a GNU sparse member: a map
# and the stored chunks); its size and checksum are those of the content, and a random read
# parses the sample's bytes with the tar reader instead of slicing them
FLAG_REBUILT = 2
# a member of the sample takes its size from a pax global header's size= record, not from its
# own header's size field (which random access then does not compare with the index)
FLAG_GLOBAL_SIZE = 4


class ShardIndex:
    """Where each sample and member of one shard is (see the module docstring for offsets).

    Per sample: ``keys``, ``sample_offsets``/``sample_ends`` (file byte range), ``tar_offsets``.
    Per member: ``member_sample`` (its sample number), ``member_ext`` (code into ``extensions``,
    the extensions as written, case kept), ``member_offsets`` (first header),
    ``member_data_offsets``, ``member_sizes``, ``member_checksums`` (``member_hash`` of the
    data). Offsets of members are in the uncompressed tar stream. ``nbytes``/``hash``: the
    shard file's size and hash.

    Immutable. The arrays are numpy arrays; an index read from a file or built from a sequential
    read holds them as little-endian bytes until one is first asked for (numpy is imported
    then), so that counting, hashing and saving indexes (``tarshards index``) never import it.
    """

    sample_offsets: np.ndarray
    sample_ends: np.ndarray
    tar_offsets: np.ndarray
    sample_flags: np.ndarray
    key_offsets: np.ndarray
    key_blob: np.ndarray
    member_sample: np.ndarray
    member_ext: np.ndarray
    member_offsets: np.ndarray
    member_data_offsets: np.ndarray
    member_sizes: np.ndarray
    member_checksums: np.ndarray
    # the fields (set through __dict__: the index is immutable)
    extensions: tuple[str, ...]
    compression: str
    seekable: bool
    entry: str
    member_hash: str
    nbytes: int
    hash: str | None
    last_dot: bool
    url: str | None
    _raw: dict[str, tuple[Any, int]]  # name -> (buffer, offset) of arrays not read yet
    _counts: dict[str, int]

    def __init__(
        self,
        *,
        extensions: Sequence[str] = (),
        compression: str = "none",  # "none", "gzip" or "zstd"
        seekable: bool = True,  # sample_offsets are offsets one can start reading the file at
        entry: str = "member",  # how: a member/frame starts there, or "deflate" (raw inflate)
        member_hash: str = MEMBER_HASH,
        nbytes: int = 0,
        hash: str | None = None,
        last_dot: bool = False,
        url: str | None = None,
        meta: dict | None = None,
        **arrays,
    ):
        if arrays.keys() != _ARRAY_NAMES:
            wrong = sorted(arrays.keys() ^ _ARRAY_NAMES)
            raise TypeError(f"ShardIndex: missing or unknown arrays: {', '.join(wrong)}")
        self._init(
            arrays,
            {},
            {
                "samples": len(arrays["sample_offsets"]),
                "members": len(arrays["member_sample"]),
                "keys": len(arrays["key_blob"]),
            },
            extensions=tuple(extensions),
            compression=compression,
            seekable=bool(seekable),
            entry=_entry(entry),
            member_hash=member_hash,
            nbytes=int(nbytes),
            hash=hash,
            last_dot=bool(last_dot),
            url=url,
        )
        if meta:
            self.__dict__["_meta_arrays"] = _meta_columns(meta, self.num_samples)

    def _init(self, arrays: dict, raw: dict, counts: dict, **fields) -> None:
        d = self.__dict__
        d.update(arrays)
        d["entry"] = "member"
        d.update(fields)
        d["_raw"] = raw  # name -> (buffer, offset): the array's little-endian bytes, not read yet
        d["_counts"] = counts  # "samples", "members", "keys"

    @classmethod
    def _from_raw(cls, raw: dict, counts: dict, **fields) -> "ShardIndex":
        """An index whose arrays are ``raw[name] = (buffer, offset)``: each array's bytes, as
        the index file stores them (little-endian, of ``_ARRAYS``' dtype and count), at
        ``offset`` of ``buffer``."""
        self = cls.__new__(cls)
        self._init({}, raw, counts, **fields)
        return self

    def __getattr__(self, name: str) -> np.ndarray:  # the arrays, made on first use
        raw = self.__dict__.get("_raw")
        if raw is None or name not in raw:
            raise AttributeError(f"'ShardIndex' object has no attribute {name!r}")
        buffer, offset = raw[name]
        dtype, per = _ARRAY_SPEC[name]
        array = np.frombuffer(buffer, dtype, self._count(per), offset)
        self.__dict__[name] = array
        return array

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"ShardIndex is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"ShardIndex is immutable: cannot set {name!r}")

    def __reduce__(
        self,
    ) -> tuple[
        Any, tuple[bytes, str | None]
    ]:  # pickled as its index file (processes, DataLoader workers)
        return (_from_bytes, (bytes(self.to_bytes()), self.url))

    def _count(self, per: str) -> int:
        if per == "samples+1":
            return self._counts["samples"] + 1
        return self._counts[per]

    def _cache(self, name: str, value) -> None:
        self.__dict__[name] = value

    # ---- derived -----------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self._counts["samples"]

    def __len__(self) -> int:
        return self.num_samples

    @property
    def keys(self) -> list[str]:
        """The sample keys (as the reader gives them in ``__key__``)."""
        cached = self.__dict__.get("_keys")
        if cached is None:
            raw = bytes(self._array_bytes("key_blob"))
            blob = raw.decode("utf-8", "surrogateescape")
            # offsets are in bytes: decode per key when any key is not ASCII (read as the file
            # stores them: numpy not needed)
            offs = memoryview(self._array_bytes("key_offsets")).cast("q").tolist()
            if len(blob) == len(raw):
                cached = [blob[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]
            else:
                cached = [
                    raw[offs[i] : offs[i + 1]].decode("utf-8", "surrogateescape")
                    for i in range(len(offs) - 1)
                ]
            self._cache("_keys", cached)
        return cached

    @property
    def member_starts(self) -> np.ndarray:
        """``member_starts[i]:member_starts[i+1]`` are the members of sample ``i``."""
        cached = self.__dict__.get("_member_starts")
        if cached is None:
            cached = np.searchsorted(self.member_sample, np.arange(self.num_samples + 1))
            self._cache("_member_starts", cached)
        return cached

    @property
    def meta(self) -> dict[str, np.ndarray]:
        """The per-sample numeric metadata columns stored with the index (``{"tokens": array,
        "jpg.width": array...}``, float64, one value per sample, NaN where a sample has none);
        ``{}`` for an index without them."""
        cached = self.__dict__.get("_meta_arrays")
        if cached is None:
            n = self.num_samples
            raw = self.__dict__.get("_meta_raw") or {}
            cached = {name: np.frombuffer(buf, "<f8", n, off) for name, (buf, off) in raw.items()}
            self._cache("_meta_arrays", cached)
        return cached

    def with_meta(self, columns: Mapping[str, npt.ArrayLike]) -> "ShardIndex":
        """A copy of this index with the metadata ``columns`` added (or replaced): name ->
        one number per sample (NaN: none)."""
        merged = dict(self.meta)
        merged.update(_meta_columns(columns, self.num_samples))
        return self._copy({k: merged[k] for k in sorted(merged)}, self.keyframe_table)

    @property
    def keyframe_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The keyframes of the video members, where ``tarshards index --keyframes`` recorded
        them: ``(member, time, position)``, three numpy arrays (member number, presentation
        time in seconds, byte position in the member; sorted by member, then time), or None."""
        d = self.__dict__
        if "_kf" not in d:
            raw = d.get("_kf_raw")
            kf = None
            if raw is not None:
                buf, pos, n = raw
                kf = (
                    np.frombuffer(buf, "<i8", n, pos),
                    np.frombuffer(buf, "<f8", n, pos + 8 * n),
                    np.frombuffer(buf, "<i8", n, pos + 16 * n),
                )
            self._cache("_kf", kf)
        return d["_kf"]

    def member_keyframes(self, m: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(times, positions)`` of member ``m``'s keyframes, or None (none recorded)."""
        kf = self.keyframe_table
        if kf is None:
            return None
        members = kf[0]
        lo, hi = np.searchsorted(members, [m, m + 1])
        if lo == hi:
            return None
        return kf[1][lo:hi], kf[2][lo:hi]

    def with_keyframes(
        self, members: npt.ArrayLike, times: npt.ArrayLike, positions: npt.ArrayLike
    ) -> "ShardIndex":
        """A copy of this index with the keyframe table ``(members, times, positions)``
        (see :attr:`keyframe_table`; replaces the one it had)."""
        m = np.asarray(members, np.int64).reshape(-1)
        t = np.asarray(times, np.float64).reshape(-1)
        p = np.asarray(positions, np.int64).reshape(-1)
        if not len(m) == len(t) == len(p):
            raise ValueError("keyframe members, times and positions differ in length")
        order = np.lexsort((t, m))
        return self._copy(dict(self.meta), (m[order], t[order], p[order]))

    def _copy(
        self,
        meta: dict[str, np.ndarray],
        keyframes: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    ) -> "ShardIndex":
        new = ShardIndex.from_bytes(bytes(self._index_bytes(meta=False)), url=self.url)
        new.__dict__["_meta_arrays"] = meta
        new.__dict__["_kf"] = keyframes
        return new

    def member_names(self, i: int) -> list[str]:
        """The member names of sample ``i`` as they are in the tar."""
        starts = self.member_starts
        key = self.keys[i]
        prefix = "./" if self.sample_flags[i] & FLAG_DOT_SLASH else ""
        return [
            f"{prefix}{key}.{self.extensions[e]}"
            for e in self.member_ext[starts[i] : starts[i + 1]].tolist()
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardIndex):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    __hash__ = None  # type: ignore[assignment]  # equal by content, mutable arrays: unhashable

    def __repr__(self) -> str:
        return (
            f"ShardIndex({self.num_samples} samples, {self._counts['members']} members, "
            f"compression={self.compression!r}, seekable={self.seekable}, "
            f"url={self.url!r})"
        )

    # ---- serialisation -----------------------------------------------------------------------
    def _meta(self, meta: bool = True) -> dict:
        head = {
            "format": "tarshards.index",
            "version": self._version,
            "samples": self.num_samples,
            "members": self._counts["members"],
            "key_bytes": self._counts["keys"],
            "extensions": list(self.extensions),
            "compression": self.compression,
            "seekable": bool(self.seekable),
            "member_hash": self.member_hash,
            "nbytes": int(self.nbytes),
            "hash": self.hash,
            "last_dot": bool(self.last_dot),
            "arrays": [[name, dtype] for name, dtype, _ in _ARRAYS],
        }
        if self.entry != "member":
            head["entry"] = self.entry
        names = self._meta_names() if meta else []
        if names:  # only then: an index without metadata has the bytes it always had
            head["meta"] = names
        kf = self.keyframe_table if meta else None
        if kf is not None:
            head["keyframes"] = len(kf[0])
        return head

    @property
    def _version(self) -> int:
        return 2 if self.entry == "deflate" else INDEX_VERSION

    def _meta_names(self) -> list[str]:
        arrays = self.__dict__.get("_meta_arrays")
        if arrays is not None:
            return list(arrays)
        return list(self.__dict__.get("_meta_raw") or ())

    def to_bytes(self) -> bytes:
        """The index file's bytes (deterministic: equal indexes give equal bytes)."""
        return b"".join(self._parts())

    def _index_bytes(self, meta: bool = True) -> bytes:
        return b"".join(self._parts(meta))

    def _parts(self, with_meta: bool = True) -> list[bytes | memoryview]:
        """The index file as a list of buffers (the arrays as they are, where no conversion
        is needed: no copy)."""
        meta = json.dumps(self._meta(with_meta), sort_keys=True, separators=(",", ":")).encode()
        meta += b" " * (-len(meta) % 8)
        parts: list[bytes | memoryview] = [INDEX_MAGIC, _HEAD.pack(self._version, len(meta)), meta]
        for name, _, _ in _ARRAYS:
            data = self._array_bytes(name)
            parts.append(data)
            if -len(data) % 8:
                parts.append(bytes(-len(data) % 8))
        if with_meta:  # the metadata columns after the arrays (readers before them stop there)
            for name in self._meta_names():
                parts.append(np.ascontiguousarray(self.meta[name], dtype="<f8").tobytes())
            kf = self.keyframe_table
            if kf is not None:  # then the keyframe table: members, times, positions
                for a, dtype in zip(kf, ("<i8", "<f8", "<i8")):
                    parts.append(np.ascontiguousarray(a, dtype=dtype).tobytes())
        return parts

    def _array_bytes(self, name: str) -> memoryview | bytes:
        """Array ``name``'s bytes as the index file stores them (little-endian, its dtype): the
        raw buffer where it was not read yet, no copy where no conversion is needed."""
        dtype, per = _ARRAY_SPEC[name]
        if name not in self.__dict__:
            buffer, offset = self._raw[name]
            size = _ITEMSIZE[dtype] * self._count(per)
            return memoryview(buffer).cast("B")[offset : offset + size]
        data = np.ascontiguousarray(self.__dict__[name], dtype=dtype)
        return data.data.cast("B") if data.ndim else data.tobytes()

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, url: str | None = None
    ) -> "ShardIndex":
        """Parse an index file's bytes (raises :class:`IntegrityError` when malformed); the
        arrays are views of ``data``, made when first asked for."""
        data = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        if bytes(data[:8]) != INDEX_MAGIC:
            raise IntegrityError("not a tarshards index (bad magic bytes)", url=url, offset=0)
        if len(data) < 16:
            raise IntegrityError("index file is truncated", url=url, offset=len(data))
        version, meta_len = _HEAD.unpack_from(data, 8)
        if version not in INDEX_VERSIONS:
            raise IntegrityError(
                f"index format version {version} is not supported (this "
                f"tarshards reads versions {', '.join(map(str, INDEX_VERSIONS))})",
                url=url,
            )
        try:
            meta = json.loads(bytes(data[16 : 16 + meta_len]))
            counts = {
                "samples": int(meta["samples"]),
                "members": int(meta["members"]),
                "keys": int(meta["key_bytes"]),
            }
        except (ValueError, KeyError, TypeError):
            raise IntegrityError("corrupt index header", url=url, offset=16) from None
        if min(counts.values()) < 0:
            raise IntegrityError("corrupt index header (negative count)", url=url, offset=16)
        pos = 16 + meta_len
        raw = {}
        for name, dtype, per in _ARRAYS:
            n = counts[per] if per != "samples+1" else counts["samples"] + 1
            size = _ITEMSIZE[dtype] * n
            if pos + size > len(data):
                raise IntegrityError("index file is truncated", url=url, offset=pos)
            raw[name] = (data, pos)
            pos += size + (-size % 8)
        meta_raw = {}
        names = meta.get("meta") or []
        for name in names:
            size = 8 * counts["samples"]
            if not isinstance(name, str) or pos + size > len(data):
                raise IntegrityError("index file is truncated", url=url, offset=pos)
            meta_raw[name] = (data, pos)
            pos += size
        kf_raw = None
        if meta.get("keyframes"):
            n = int(meta["keyframes"])
            if n < 0 or pos + 24 * n > len(data):
                raise IntegrityError("index file is truncated", url=url, offset=pos)
            kf_raw = (data, pos, n)
        index = cls._from_raw(
            raw,
            counts,
            extensions=tuple(meta["extensions"]),
            compression=meta["compression"],
            seekable=bool(meta["seekable"]),
            entry=_entry(meta.get("entry", "member"), url),
            member_hash=meta["member_hash"],
            nbytes=int(meta["nbytes"]),
            hash=meta["hash"],
            last_dot=bool(meta.get("last_dot", False)),
            url=url,
        )
        if meta_raw:
            index.__dict__["_meta_raw"] = meta_raw
        if kf_raw is not None:
            index.__dict__["_kf_raw"] = kf_raw
        return index

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict | None = None,
        remove_stale: bool = True,
    ) -> None:
        """Write the index to ``path`` (a path or URL), atomically (``remove_stale``: as
        :class:`tarshards.storage.AtomicOutput`'s; a writer of many indexes into one directory
        sweeps it once and passes ``False``)."""
        from ..storage import AtomicOutput

        with AtomicOutput(path, storage_options=storage_options, remove_stale=remove_stale) as out:
            out.stream.writelines(self._parts())  # large parts written without the GIL

    def start_save(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict | None = None,
        remove_stale: bool = True,
    ) -> AtomicOutput:
        """Begin :meth:`save`: the file is written by a thread of its own where it can be
        (:meth:`tarshards.storage.AtomicOutput.write_behind`); returns the output, which
        appears under ``path`` when the caller calls its ``commit()`` (or is discarded by
        ``abort()``). The index must not change meanwhile (its arrays are written as they are)."""
        from ..storage import AtomicOutput

        # unbuffered: the parts go to the file as they are (a 1 MB buffer for each pending save
        # left the writer's heap fragmented: its next shard's buffer took fresh pages, about 250
        # page faults a shard on the writing thread)
        out = AtomicOutput(
            path, storage_options=storage_options, remove_stale=remove_stale, buffering=0
        )
        try:
            out.write_behind(self._parts())
        except BaseException:
            out.abort()
            raise
        return out

    @classmethod
    def load(
        cls, url: str | os.PathLike[str], *, storage_options: dict | None = None
    ) -> "ShardIndex":
        """Read an index file from a path or URL."""
        import os

        from ..storage import open_url

        url = os.fspath(url)
        with open_url(url, storage_options=storage_options) as f:
            data = f.read()
        return cls.from_bytes(data, url=url)

    # ---- conversions -------------------------------------------------------------------------
    def to_dali(self) -> str:
        """The index as DALI's ``wds2idx`` writes it (version ``v1.2``: one line per sample,
        ``ext data_offset size name`` per member). Only for uncompressed shards."""
        if self.compression != "none":
            raise ValueError("DALI's webdataset reader indexes uncompressed tar files only")
        lines = [f"v1.2 {self.num_samples}"]
        starts = self.member_starts.tolist()
        exts = [e.lower() for e in self.extensions]
        data_offsets = self.member_data_offsets.tolist()
        sizes = self.member_sizes.tolist()
        codes = self.member_ext.tolist()
        for i in range(self.num_samples):
            names = self.member_names(i)
            parts = []
            for j, name in zip(range(starts[i], starts[i + 1]), names):
                parts.append(f"{exts[codes[j]]} {data_offsets[j]} {sizes[j]} {name}")
            lines.append(" ".join(parts))
        return "\n".join(lines) + "\n"

    def save_dali(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dali` to ``path`` (DALI's ``index_paths=``)."""
        from ..storage import AtomicOutput

        with AtomicOutput(path) as out:
            out.stream.write(self.to_dali().encode("utf-8"))

    def checksum_fn(self) -> Callable[[Any], int]:
        """The member checksum of this index (``member_hash``): bytes-like -> int."""
        return member_checksum_fn(self.member_hash)

    def check_sample(self, sample: Mapping[str, Any], j: int, url: str | None = None) -> None:
        """Each field of ``sample`` (sample ``j`` of the shard, fields as read: extension
        lower-cased -> bytes) against the member checksums of this index: an
        :class:`~tarshards.errors.IntegrityError` naming the member and its offset where one
        differs or is missing (what ``verify=True`` checks of a view's samples)."""
        starts = self.member_starts
        csum = self.checksum_fn()
        exts = self.extensions
        for m in range(int(starts[j]), int(starts[j + 1])):
            data = sample.get(exts[int(self.member_ext[m])].lower())
            if data is None or csum(data) != int(self.member_checksums[m]):
                raise IntegrityError(
                    "member checksum does not match the index",
                    url=url,
                    member=self.member_names(j)[m - int(starts[j])],
                    offset=int(self.member_offsets[m]),
                )


# ---------------------------------------------------------------------------------------------
# building an index: one member at a time (the writer) or from a sequential read
# ---------------------------------------------------------------------------------------------


_SAMPLE_REC = struct.Struct("<qqq")  # per sample: tar offset, end, flags
_SAMPLE_END = struct.Struct("<q")
_MEMBER_REC = struct.Struct("<qqqqqQ")  # sample, ext code, header/data offset, size, checksum
_MEMBER_FIELDS = ("sample", "ext", "offset", "data", "size", "checksum")  # 64-bit each


def _meta_columns(columns: Mapping[str, npt.ArrayLike], n: int) -> dict[str, np.ndarray]:
    """``columns`` as float64 arrays of ``n`` values each (a ``ValueError`` otherwise)."""
    out = {}
    for name, values in columns.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise ValueError(f"a metadata column's name is a non-empty string, got {name!r}")
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
        if len(arr) != n:
            raise ValueError(f"metadata column {name!r} has {len(arr)} values for {n} samples")
        out[name] = arr
    return out


def _member_dtype() -> np.dtype:
    """The member records as a numpy structured dtype (``index.MEMBER_DTYPE``)."""
    return np.dtype([(name, "<u8" if name == "checksum" else "<i8") for name in _MEMBER_FIELDS])


def __getattr__(
    name: str,
) -> np.dtype:  # MEMBER_DTYPE made on first use: numpy is not imported before
    if name == "MEMBER_DTYPE":
        return _member_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:  # optional C accelerator (_speedups, see _c/); IndexBuilder.add is the reference, and
    # without it indexes are built with numpy
    from .._speedups import index_columns as _index_columns
    from .._speedups import index_members as _index_members
except ImportError:  # pragma: no cover - built by default
    _index_members = _index_columns = None


class IndexBuilder:
    """Collects members as they are written or read, and makes the :class:`ShardIndex`.

    ``add(name, header_offset, data_offset, size, checksum)`` takes members in tar order (offsets
    in the uncompressed stream); members the reader skips (no extension, ``__`` names) are
    ignored, and consecutive members with the same key form a sample, as in
    :func:`tarshards.format.names.group_samples`. ``frame(file_offset, tar_offset)`` records the
    start of a gzip member / zstd frame for compressed shards.

    The records are packed as they come (``_samples``: tar offset, end and flags per sample;
    ``_members``: six 64-bit values per member, see ``MEMBER_DTYPE``), so the C scanner
    (``_speedups.index_members``) appends to the same records as :meth:`add`, and
    :meth:`build` makes the index's arrays in bulk.
    """

    def __init__(
        self,
        *,
        member_hash: str = MEMBER_HASH,
        last_dot: bool = False,
        ext_codes: dict[str, int] | None = None,
    ):
        """``ext_codes``: the extension codes the rows given to :meth:`add_rows` use (the
        writer's recorder numbers extensions as it writes; the builder takes its table)."""
        self.member_hash = member_hash
        self.checksum = member_checksum_fn(member_hash)  # bytes-like -> int, one member's data
        self._checksum_fn = self.checksum
        self._c_checksum = member_checksum_c(member_hash)  # the same, for index_members
        self.last_dot = last_dot
        self._key: str | None = None
        self._keys: list[str] = []
        self._samples = bytearray()
        self._members = bytearray()
        # the records as arrays where they came in bulk (_add_grouped): (samples, members), the
        # members a structured array of MEMBER_DTYPE's fields; packed again before more come
        self._grouped: tuple | None = None
        self._ext_codes: dict[str, int] = ext_codes if ext_codes is not None else {}
        self._frames_file: list[int] = []
        self._frames_tar: list[int] = []
        self._key_rows: tuple | None = None  # (UTF-8 keys back to back, offsets): add_rows'
        # how a reader starts at a frame: "member" (a gzip member/zstd frame), or "deflate" (a
        # flush point of a FlushedGzip shard: a raw inflater)
        self.entry = "member"

    @property
    def count(self) -> int:
        return len(self._keys)

    def frame(self, file_offset: int, tar_offset: int) -> None:
        self._frames_file.append(file_offset)
        self._frames_tar.append(tar_offset)

    def add(
        self,
        name: str,
        header_offset: int,
        data_offset: int,
        size: int,
        checksum: int,
        stored: int | None = None,
    ) -> None:
        """Record a member; ``stored``: its bytes in the archive where they are not its
        ``size`` bytes of content (a sparse member, :data:`FLAG_REBUILT`)."""
        if self._grouped is not None:
            self._pack_grouped()
        dot_slash = name.startswith("./")
        if dot_slash:
            name = name[2:]
        slash = name.rfind("/") + 1
        if name.startswith("__", slash):
            return
        dot = name.rfind(".", slash) if self.last_dot else name.find(".", slash)
        if dot <= slash or dot == len(name) - 1:
            return
        key = name[:dot]
        ext = name[dot + 1 :]
        n = size if stored is None else stored
        end = data_offset + n + (-n % BLOCK)
        if key != self._key:
            self._key = key
            self._keys.append(key)
            self._samples += _SAMPLE_REC.pack(
                header_offset, end, FLAG_DOT_SLASH if dot_slash else 0
            )
        else:
            _SAMPLE_END.pack_into(self._samples, len(self._samples) - 16, end)
        if stored is not None:
            flags = _SAMPLE_END.unpack_from(self._samples, len(self._samples) - 8)[0]
            _SAMPLE_END.pack_into(self._samples, len(self._samples) - 8, flags | FLAG_REBUILT)
        code = self._ext_codes.get(ext)
        if code is None:
            code = self._ext_codes[ext] = len(self._ext_codes)
        self._members += _MEMBER_REC.pack(
            len(self._keys) - 1, code, header_offset, data_offset, size, checksum
        )

    def flag(self, bit: int) -> None:
        """Set ``bit`` in the flags of the sample being recorded."""
        flags = _SAMPLE_END.unpack_from(self._samples, len(self._samples) - 8)[0]
        _SAMPLE_END.pack_into(self._samples, len(self._samples) - 8, flags | bit)

    def check_fields(self, url: str | None) -> None:
        """Raise the reader's :class:`~tarshards.errors.DuplicateFieldError` where a sample repeats
        an extension (compared lower-cased, as the reader keys fields): a sequential read stops
        there, so the index must not list the sample (ds[i] would hand out one of the two). One
        pass over the packed member records; no numpy."""
        if self._grouped is not None or not self._members:
            return
        rec = memoryview(self._members).cast("q")
        samples, codes = rec[0::6].tolist(), rec[1::6].tolist()
        names = list(self._ext_codes)
        if any(not e.islower() for e in names if any(c.isalpha() for c in e)):
            first = {e: i for i, e in reversed(list(enumerate(e.lower() for e in names)))}
            low = [first[e.lower()] for e in names]
            codes = [low[c] for c in codes]
        pairs = list(zip(samples, codes))
        if len(set(pairs)) == len(pairs):
            return
        seen: dict = {}
        for m, pair in enumerate(pairs):
            if pair in seen:
                from ..errors import DuplicateFieldError

                key = self._keys[pair[0]]
                ext = names[rec[6 * m + 1]]
                raise DuplicateFieldError(
                    f"repeated extension {ext.lower()!r} in sample {key!r}: members "
                    f"{key + '.' + names[rec[6 * seen[pair] + 1]]!r} and {key + '.' + ext!r}",
                    url=url,
                    member=f"{key}.{ext}",
                    offset=rec[6 * m + 2],
                )
            seen[pair] = m

    def scan(self, buf: bytearray, pos: int, base: int, end: int) -> int:
        """:meth:`add` every plain member of a run lying wholly in ``buf[pos:end]`` (``base``:
        the stream offset of ``buf[0]``), in C, which calls :meth:`checksum` on a memoryview of
        each member's data (no copy); returns where it stopped (``pos`` when the C scanner is
        missing)."""
        if _index_members is None:
            return pos
        if self._grouped is not None:
            self._pack_grouped()
        pos, self._key = _index_members(
            buf,
            pos,
            base,
            end,
            self.last_dot,
            self._ext_codes,
            self._keys,
            self._samples,
            self._members,
            self._key,
            self._c_checksum if self.checksum is self._checksum_fn else self.checksum,
        )
        return pos

    def add_written(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        checksums: Sequence[int],
        start: int = 0,
        keys: Sequence[str] | None = None,
        counts: Sequence[int] | None = None,
    ) -> None:
        """Record members written back to back from tar offset ``start`` by our writer (its
        headers: 512 bytes, or pax records for long / non-ASCII names and huge sizes).
        ``keys``/``counts``: the key and member count of each write (faster grouping)."""
        from ..tario import header_size

        n = len(names)
        if not n:
            return
        size = np.asarray(sizes, np.int64)
        hsize = np.full(n, BLOCK, np.int64)
        if max(map(len, names)) <= 100 and "".join(names).isascii():  # C loops: the usual case
            special = []
        else:
            special = [j for j, name in enumerate(names) if len(name) > 100 or not name.isascii()]
        special += np.flatnonzero(size >= 8**11).tolist()
        for j in special:
            hsize[j] = header_size(names[j], int(size[j]))
        offsets, data_offsets, total = _layout(hsize, size, start)
        if keys is not None and counts is not None and self._fast_ok(keys, counts, n):
            klen = np.repeat(np.fromiter(map(len, keys), np.int64, len(keys)) + 1, counts)
            # cast: a str's slice is a str (operator.getitem's stub says Sequence[str])
            exts = cast(
                "list[str]",
                list(
                    map(operator.getitem, names, map(slice, klen.tolist(), itertools.repeat(None)))
                ),
            )
            codes = self._ext_codes  # numbered in order of first appearance, as add() does
            for e in dict.fromkeys(exts):
                codes.setdefault(e, len(codes))
            ext_codes = np.fromiter(map(codes.__getitem__, exts), np.int64, n)
            self._add_keyed(keys, counts, ext_codes, offsets, data_offsets, size, total, checksums)
            return
        add = self.add
        for name, off, doff, sz, cs in zip(
            names, offsets.tolist(), data_offsets.tolist(), size.tolist(), checksums
        ):
            add(name, off, doff, sz, cs)

    def add_rows(
        self,
        keys: list[str],
        samples: bytearray,
        members: bytearray,
        key_blob: bytearray,
        key_offsets: bytearray,
    ) -> None:
        """Take the rows :class:`tarshards._speedups.Recorder` laid out while writing, as they
        are (bytearrays the builder then owns: ``samples`` and ``members`` as this builder packs
        them, the keys' UTF-8 bytes back to back and where each starts; ``keys``: the samples'
        keys), as this builder's first records."""
        if self._keys or self._grouped is not None:  # pragma: no cover - the writer's use
            raise ValueError("add_rows: the builder already holds records")
        self._samples = samples
        self._members = members
        self._keys = keys
        self._key = keys[-1] if keys else None
        self._key_rows = (key_blob, key_offsets)

    def _fast_ok(self, keys, counts, n) -> bool:
        """Whether the writes' keys and counts cover the members as _add_keyed needs."""
        return (
            not self._keys
            and sum(counts) == n
            and len(keys) == len(counts)
            and all(counts)
            and not any(map(operator.methodcaller("startswith", "./"), keys))
        )

    def _add_keyed(self, keys, counts, ext_codes, offsets, data_offsets, size, total, checksums):
        """The writer's members, its sample keys known: names are ``KEY.EXT`` (as
        :func:`tarshards.write.writer.sample_members` makes them); consecutive equal keys form one
        sample, as the reader groups them."""
        new_list = [True]
        new_list += map(operator.ne, keys[1:], keys[:-1])
        sample_of_write = np.cumsum(np.array(new_list, bool)) - 1
        self._add_grouped(
            list(itertools.compress(keys, new_list)),
            np.repeat(sample_of_write, np.asarray(counts, np.int64)),
            ext_codes,
            offsets,
            data_offsets,
            size,
            total,
            checksums,
        )

    def _add_grouped(self, keys, sample, ext_codes, offsets, data_offsets, size, total, checksums):
        """The records of members written back to back, ``sample[j]``: the number of member
        ``j``'s sample in ``keys`` (the samples' keys; non-decreasing, each sample's members
        together)."""
        n = len(size)
        starts = np.flatnonzero(np.diff(sample, prepend=-1))  # each sample's first member
        lasts = np.empty(len(starts), np.int64)  # and its last
        lasts[:-1] = starts[1:] - 1
        lasts[-1] = n - 1
        samples = np.zeros((len(starts), 3), np.int64)
        samples[:, 0] = offsets[starts]
        samples[:, 1] = offsets[lasts] + total[lasts]
        members = {
            "sample": sample,
            "ext": ext_codes,
            "offset": offsets,
            "data": data_offsets,
            "size": size,
            "checksum": np.array(checksums, np.uint64),  # a copy: contiguous, and our own
        }
        self._grouped = (samples, members)
        self._keys = list(keys)
        self._key = self._keys[-1]

    def _pack_grouped(self) -> None:
        """The bulk records (``_grouped``) packed as :meth:`add` and the C scanner append."""
        samples, columns = self._grouped  # type: ignore[misc]
        packed = np.empty(len(columns["size"]), _member_dtype())
        for name, values in columns.items():
            packed[name] = values
        self._samples = bytearray(samples.astype("<i8").tobytes())
        self._members = bytearray(packed.tobytes())
        self._grouped = None

    def build(
        self, *, nbytes: int, hash: str | None, compression: str = "none", url: str | None = None
    ) -> ShardIndex:
        fields: dict[str, Any] = dict(
            compression=compression,
            member_hash=self.member_hash,
            nbytes=int(nbytes),
            hash=hash,
            last_dot=self.last_dot,
            url=url,
        )
        if self._grouped is None and compression == "none" and _index_columns is not None:
            return self._build_raw(fields)  # in C, without numpy (tarshards index imports none)
        if self._grouped is not None:  # fresh arrays: the members' taken as they are
            srec, mrec = self._grouped
            tar_offsets, ends = srec[:, 0].copy(), srec[:, 1].copy()
            copy = _as_is
        else:  # views of the packed records: copied out
            srec = np.frombuffer(self._samples, "<i8").reshape(-1, 3)
            mrec = np.frombuffer(self._members, _member_dtype())
            tar_offsets = srec[:, 0].copy()
            ends = srec[:, 1].copy()
            copy = np.copy
        seekable = True
        entry = "member"
        if compression == "none":
            sample_offsets, sample_ends = tar_offsets, ends
        else:
            ftar = np.array(self._frames_tar, np.int64)
            ffile = np.array(self._frames_file, np.int64)
            at = np.searchsorted(ftar, tar_offsets)
            hit = at < len(ftar)
            seekable = (
                bool(len(ftar))
                and bool(np.all(hit))
                and bool(np.all(ftar[np.minimum(at, len(ftar) - 1)] == tar_offsets))
            )
            if seekable:
                entry = self.entry
                sample_offsets = ffile[at]
                after = np.searchsorted(ftar, ends)  # first frame starting at/after the end
                sample_ends = np.where(
                    after < len(ffile), ffile[np.minimum(after, len(ffile) - 1)], nbytes
                )
            else:  # offsets into the decompressed stream: not a place to start reading the file
                sample_offsets, sample_ends = tar_offsets, ends
        if self._key_rows is not None and len(self._key_rows[1]) == 8 * (len(self._keys) + 1):
            key_blob = self._key_rows[0]
            key_offsets = np.frombuffer(self._key_rows[1], "<i8")
        else:
            key_blob, key_offsets = _key_arrays(self._keys)
        return ShardIndex(
            sample_offsets=np.asarray(sample_offsets, np.int64),
            sample_ends=np.asarray(sample_ends, np.int64),
            tar_offsets=tar_offsets,
            sample_flags=srec[:, 2].astype(np.uint8),
            key_offsets=key_offsets,
            key_blob=np.frombuffer(key_blob, np.uint8),
            member_sample=mrec["sample"].astype(np.uint32),
            member_ext=mrec["ext"].astype(np.uint16),
            member_offsets=copy(mrec["offset"]),
            member_data_offsets=copy(mrec["data"]),
            member_sizes=copy(mrec["size"]),
            member_checksums=copy(mrec["checksum"]),
            extensions=tuple(self._ext_codes),
            seekable=seekable,
            entry=entry,
            **fields,
        )

    def _build_raw(self, fields: dict) -> ShardIndex:
        """:meth:`build` of a plain shard's packed records: the columns cut out of them in one C
        pass (``_speedups.index_columns``), kept as the index file's bytes (the same index, byte
        for byte, as the numpy build; numpy is not imported)."""
        (
            tar_offsets,
            ends,
            sample_flags,
            member_sample,
            member_ext,
            member_offsets,
            member_data_offsets,
            member_sizes,
            member_checksums,
        ) = _index_columns(self._samples, self._members)
        n_samples = len(self._keys)
        if self._key_rows is not None and len(self._key_rows[1]) == 8 * (n_samples + 1):
            key_blob, key_offsets = self._key_rows
        else:
            key_blob, offsets = _key_rows(self._keys)
            key_offsets = array.array("q", offsets)  # little-endian: the C module's hosts
        columns = {
            "sample_offsets": tar_offsets,
            "sample_ends": ends,
            "tar_offsets": tar_offsets,
            "sample_flags": sample_flags,
            "key_offsets": key_offsets,
            "member_sample": member_sample,
            "member_ext": member_ext,
            "member_offsets": member_offsets,
            "member_data_offsets": member_data_offsets,
            "member_sizes": member_sizes,
            "member_checksums": member_checksums,
            "key_blob": key_blob,
        }
        return index_from_columns(columns, tuple(self._ext_codes), **fields)


def index_from_columns(
    columns: Mapping[str, Any], extensions: tuple[str, ...], **fields: Any
) -> ShardIndex:
    """A plain shard's index from its columns as the index file stores them (``_ARRAYS``' names
    and dtypes, little-endian bytes-like objects, taken without a copy): the writer's read-back
    thread (:class:`tarshards._xxh3.Background`) and the builder's C path make them so.
    ``fields``: ``nbytes``, ``hash``, ``compression``, ``member_hash``, ``last_dot``, ``url``."""
    counts = {
        "samples": len(columns["sample_flags"]),
        "members": len(columns["member_sizes"]) // 8,
        "keys": len(columns["key_blob"]),
    }
    return ShardIndex._from_raw(
        {name: (data, 0) for name, data in columns.items()},
        counts,
        extensions=extensions,
        seekable=True,
        **fields,
    )


def _entry(entry: str, url: str | None = None) -> str:
    if entry not in ENTRIES:
        raise IntegrityError(f"unknown index entry kind {entry!r}", url=url, offset=16)
    return entry


def index_header(url: str | os.PathLike[str], *, storage_options: dict | None = None) -> dict:
    """The JSON header of the index file at ``url`` (``samples``, ``nbytes``, ``hash``,
    ``member_hash``, ``last_dot``...), read without its arrays; raises :class:`IntegrityError`
    when the file is not an index or its length is not what the header says (a file cut short)."""
    import os

    from ..storage import open_url

    url = os.fspath(url)
    with open_url(url, storage_options=storage_options) as f:
        head = f.read(16)
        if head[:8] != INDEX_MAGIC:
            raise IntegrityError("not a tarshards index (bad magic bytes)", url=url, offset=0)
        if len(head) < 16:
            raise IntegrityError("index file is truncated", url=url, offset=len(head))
        version, meta_len = _HEAD.unpack_from(head, 8)
        if version not in INDEX_VERSIONS:
            raise IntegrityError(f"index format version {version} is not supported", url=url)
        raw = f.read(meta_len)
        size = f.seek(0, 2)
    try:
        meta = json.loads(raw)
        counts = {
            "samples": int(meta["samples"]),
            "members": int(meta["members"]),
            "keys": int(meta["key_bytes"]),
        }
    except (ValueError, KeyError, TypeError):
        raise IntegrityError("corrupt index header", url=url, offset=16) from None
    expected = 16 + meta_len
    for _, dtype, per in _ARRAYS:
        n = counts["samples"] + 1 if per == "samples+1" else counts[per]
        expected += _ITEMSIZE[dtype] * n + (-_ITEMSIZE[dtype] * n % 8)
    try:  # the metadata columns (float64, one a sample) and the keyframe table (24 bytes each)
        expected += 8 * counts["samples"] * len(meta.get("meta") or ())
        expected += 24 * int(meta.get("keyframes") or 0)
    except (TypeError, ValueError):
        raise IntegrityError("corrupt index header", url=url, offset=16) from None
    if size != expected:
        raise IntegrityError(
            f"index file is {size} bytes, its header says {expected}", url=url, offset=size
        )
    return meta


def _from_bytes(data: bytes, url: str | None) -> ShardIndex:
    return ShardIndex.from_bytes(data, url=url)


def _as_is(a: np.ndarray) -> np.ndarray:
    return a


def _key_rows(keys: list[str]) -> tuple[bytes, list[int]]:
    """The keys' UTF-8 bytes (surrogateescape) back to back, and where each starts (and the
    end), a list."""
    joined = "".join(keys)
    if joined.isascii():  # one encode for all keys
        key_blob = joined.encode("ascii")
        lengths = map(len, keys)
    else:
        raw_keys = [k.encode("utf-8", "surrogateescape") for k in keys]
        key_blob = b"".join(raw_keys)
        lengths = map(len, raw_keys)
    return key_blob, list(itertools.accumulate(lengths, initial=0))


def _key_arrays(keys: list[str]) -> tuple[bytes, np.ndarray]:
    """:func:`_key_rows`, the offsets a numpy array."""
    key_blob, offsets = _key_rows(keys)
    return key_blob, np.array(offsets, np.int64)


def _layout(
    hsize: np.ndarray, size: np.ndarray, start: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Header offsets, data offsets and padded lengths of members written back to back."""
    total = hsize + size + (-size % BLOCK)
    offsets = np.empty(len(size), np.int64)
    offsets[0] = start
    np.cumsum(total[:-1], out=offsets[1:])
    offsets[1:] += start
    return offsets, offsets + hsize, total


# ---------------------------------------------------------------------------------------------
# indexing an existing shard: one sequential read, hashing as it goes
# ---------------------------------------------------------------------------------------------


class _ChunkReader:
    """Reads the file into one reused buffer (``readinto``; ``read`` where a stream has none),
    hashing and counting every byte once, as it arrives (while it is in cache).

    :meth:`scan_plain` is the plain tar path: the C loop (``IndexBuilder.scan``) indexes and
    checksums the members lying wholly in the buffer, the tail (a member cut by the buffer's end)
    moves to the front and the buffer is filled up again, so that members never straddle two
    reads; it stops at the first thing the C loop does not take (an extended header, a member
    larger than the buffer, the end of the archive), and :meth:`rest` hands the bytes from there
    on to the general (Python) walk."""

    def __init__(self, stream: BinaryIO, hasher, chunk_size: int = _CHUNK):
        self.stream = stream
        self.update = hasher.update
        self.nbytes = 0
        self.buf = bytearray(max(chunk_size, 2 * BLOCK))
        self.view = memoryview(self.buf)
        self.have = 0  # bytes of the file in buf
        self.base = 0  # file offset of buf[0]
        self.eof = False
        readinto = getattr(stream, "readinto", None)
        if readinto is None:
            read = getattr(stream, "read1", None) or stream.read

            def readinto(view: memoryview) -> int:
                data = read(len(view))
                view[: len(data)] = data
                return len(data)

        self.readinto_raw = readinto

    def fill(self) -> None:
        """Read until the buffer is full or the file ends."""
        view = self.view
        size = len(view)
        readinto = self.readinto_raw
        have = self.have
        while have < size:
            n = readinto(view[have:])
            if not n:
                self.eof = True
                break
            self.update(view[have : have + n])
            have += n
            self.nbytes += n
        self.have = have

    def head(self) -> memoryview:
        """The first buffer's worth of the file."""
        self.fill()
        return self.view[: self.have]

    def scan_plain(self, builder: IndexBuilder) -> None:
        view = self.view
        while True:
            pos = builder.scan(self.buf, 0, self.base, self.have)
            if pos == 0:
                return
            rest = self.have - pos  # the cut member (or less) to the front, then read on
            view[:rest] = view[pos : self.have]
            self.base += pos
            self.have = rest
            if self.eof:
                return
            self.fill()

    def take_head(self) -> bytes:
        """What is in the buffer (a copy); :meth:`rest` then starts after it."""
        head = bytes(self.view[: self.have])
        self.base += self.have
        self.have = 0
        return head

    @overload
    def rest(self, fresh: Literal[True]) -> Iterator[bytes]: ...
    @overload
    def rest(self, fresh: bool = ...) -> Iterator[bytes | memoryview]: ...
    def rest(self, fresh: bool = False) -> Iterator[bytes | memoryview]:
        """The file from ``base`` on, in chunks (the first: what is in the buffer, copied; then
        views of the refilled buffer, which the consumer must copy what it keeps of before it
        asks for the next one, or with ``fresh``, a copy of each)."""
        if self.have:
            yield self.take_head()
        view = self.view
        readinto = self.readinto_raw
        update = self.update
        while not self.eof:
            n = readinto(view)
            if not n:
                self.eof = True
                return
            update(view[:n])
            self.nbytes += n
            self.base += n
            yield bytes(view[:n]) if fresh else view[:n]

    def readinto(self, view: memoryview) -> int:
        """The file from ``base`` on as a stream (what is in the buffer first), for a reader that
        reads straight into its own buffer: hashed and counted as it goes, one copy."""
        if self.have:
            n = min(self.have, len(view))
            view[:n] = self.view[:n]
            self.view[: self.have - n] = self.view[n : self.have]
            self.have -= n
            self.base += n
            return n
        if self.eof:
            return 0
        n = self.readinto_raw(view)
        if not n:
            self.eof = True
            return 0
        self.update(view[:n])
        self.nbytes += n
        self.base += n
        return n

    def drain(self) -> None:
        """Read (and hash) what is left of the file."""
        for _ in self.rest():
            pass


def _read_members(
    chunks: Iterable[bytes] | _ChunkReader, offset: int, builder: IndexBuilder, url: str | None
) -> None:
    """Record the members of the tar stream ``chunks`` (from tar offset ``offset`` on) as the
    reader reads them: the reader's own parser decides what a member is, its name, its bytes
    (sparse members rebuilt), and where the archive ends, so that the index lists exactly what
    a sequential read yields (its layout side channel gives where each member's data lies)."""
    from ..tario.reader import iter_tar_batches

    checksum = builder.checksum
    add = builder.add
    layout: list = []
    # cast: the reader takes a stream with readinto() as well as chunks (tario.buffer)
    for batch in iter_tar_batches(
        cast("Iterable[bytes]", chunks),
        url,
        offset=offset,
        drain=False,
        _layout=layout,
        _index_scan=builder.scan,
    ):
        for name, data, first in batch:
            if layout and layout[0][0] == first:  # from the general path
                _, data_at, stored, rebuilt = layout.pop(0)
                sparse = rebuilt is True
                add(name, first, data_at, len(data), checksum(data), stored if sparse else None)
                if rebuilt == "global" and builder.count:
                    builder.flag(FLAG_GLOBAL_SIZE)
            else:  # a fast-path member: one ustar header, then its data
                add(name, first, first + BLOCK, len(data), checksum(data))


def index_stream(
    stream: BinaryIO,
    url: str | None = None,
    *,
    hash: str = DEFAULT_HASH,
    member_hash: str = MEMBER_HASH,
    last_dot: bool = False,
    chunk_size: int = _CHUNK,
) -> ShardIndex:
    """Index a shard by reading ``stream`` once from its start to its end.

    The whole file is hashed (``hash``) and each member's data (``member_hash``); compressed
    shards (gzip, zstd, bzip2, xz, lz4) are decompressed by the reader's frame loop, and the
    start of each gzip member / zstd frame / stream is recorded, so a sample-aligned compressed
    shard comes out ``seekable``. Damage raises the reader's errors, at the reader's offsets.
    """
    hasher = file_hasher(hash)
    reader = _ChunkReader(stream, hasher, chunk_size)
    head = reader.head()
    builder = IndexBuilder(member_hash=member_hash, last_dot=last_dot)
    comp = by_magic(head)
    compression = "none" if comp is None else comp.name
    if not not_plain(head):
        reader.scan_plain(builder)  # the C loop, as far as it goes
        _read_members(reader, reader.base, builder, url)  # read as a stream (readinto)
    elif comp is GZIP and gzip_layout(head) == "flush":  # one member, a flush point per sample
        data = _flush_points_indexed(reader.rest(fresh=True), url, builder)
        _read_members(data, 0, builder, url)
        for _ in data:
            pass
    else:  # the reader's own frame loop (and errors, a format it does not read among them),
        # recording where each frame starts
        data = decompressed_chunks(reader.rest(fresh=True), url, on_frame=builder.frame)
        _read_members(data, 0, builder, url)
        for _ in data:  # the rest of the file (zero padding, trailing frames) is hashed too
            pass
    reader.drain()
    builder.check_fields(url)
    return builder.build(
        nbytes=reader.nbytes, hash=f"{hash}:{hasher.hexdigest()}", compression=compression, url=url
    )


def _flush_points_indexed(
    chunks: Iterable[bytes], url: str | None, builder: IndexBuilder
) -> Iterator[bytes]:
    """The tar stream of a :class:`~tarshards.format.compression.FlushedGzip` shard, recording each
    flush point as a frame (``builder.frame``: its file offset, and the tar bytes handed out
    before it, which the decompressor has all given when the next piece is asked for)."""
    produced = [0]
    builder.entry = "deflate"

    def point(at: int) -> None:
        builder.frame(at, produced[0])

    for out in decompressed_chunks(flush_points(chunks, point), url):
        produced[0] += len(out)
        yield out


def index_url(
    url: str,
    *,
    storage_options: dict | None = None,
    hash: str = DEFAULT_HASH,
    member_hash: str = MEMBER_HASH,
    last_dot: bool = False,
    opener: Callable[[str], ContextManager[BinaryIO]] | None = None,
) -> ShardIndex:
    """:func:`index_stream` of the shard at ``url`` (any URL :func:`open_url` opens)."""
    import os

    from ..errors import StorageError, TarshardsError
    from ..storage import open_url

    url = os.fspath(url)
    try:
        with (
            opener(url) if opener is not None else open_url(url, storage_options=storage_options)
        ) as f:
            return index_stream(f, url, hash=hash, member_hash=member_hash, last_dot=last_dot)
    except TarshardsError as exc:
        raise exc.with_context(url=url) from None
    except OSError as exc:
        raise StorageError(f"read failed: {exc}", url=url) from exc
