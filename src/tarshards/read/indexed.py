"""Random access to a data set through its manifest: ``ds[i]`` reads sample ``i`` alone.

:class:`IndexedDataset` is a map-style dataset (``len(ds)``, ``ds[i]``): sample ``i`` in
manifest order (shard by shard, in tar order). Each access reads only that sample's bytes, found
in the shard's index: ``os.pread`` for local shards, one ranged request for ``http(s)://``,
``s3://``, ``gs://`` (through fsspec), or a local read after the shard cache has fetched the
whole shard (``cache_dir=``). With torch installed, ``tarshards.IndexedDataset`` is also a
``torch.utils.data.Dataset`` (see :mod:`tarshards.torch`), so ``DataLoader(shuffle=True,
num_workers=N)`` and ``DistributedSampler`` work on it as on any map-style dataset.

Open files and network clients are per process: they are dropped when the dataset is pickled
into DataLoader workers and opened again there on first use.
"""

from __future__ import annotations

import bisect
import operator
import os
import random
from typing import Any, Callable

import numpy as np

from ..errors import (
    IntegrityError,
    ShardFormatError,
    TarshardsError,
    TarshardsWarning,
)
from ..format.compression import inflated_from
from ..format.index import FLAG_GLOBAL_SIZE, FLAG_REBUILT
from ..format.manifest import Manifest, as_manifest
from ..format.names import split_name
from ..pipeline import stages as _stages
from ..storage import is_local, local_path
from ..storage.ranges import (
    GzipSeekRanges,
    LocalRanges,
    RemoteRanges,
    unpacked_ranges,
)
from ..tario import BLOCK, decompressed_chunks, iter_tar
from ..tario.headers import checksum_ok, parse_number, parse_octal, size_number

__all__ = ["IndexedDataset"]

try:  # optional C accelerator (_speedups, see _c/); _check_header is the reference
    from .._speedups import header_ok as _header_ok
    from .._speedups import read_sample as _read_sample
except ImportError:  # pragma: no cover - built by default
    _header_ok = _read_sample = None


def _unpacked_copy(source: str, url: str, storage_options, directory) -> LocalRanges:
    """The uncompressed stream of a shard compressed as one stream, decompressed once
    (:func:`tarshards.storage.ranges.unpacked_ranges`), with a warning that says how to avoid
    it."""
    import warnings

    warnings.warn(
        TarshardsWarning(
            f"{url}: this shard is compressed as one stream, so a sample cannot be read alone; "
            "decompressing the whole shard once, into a temporary file of this process, to "
            "read its samples at random (re-write it with sample-aligned compression, "
            "tarsplit --aligned or ShardWriter(..., aligned=True), or uncompressed, to "
            "avoid this)"
        ),
        stacklevel=5,  # the caller's ds[i]
    )
    return unpacked_ranges(source, url, storage_options, directory)


class IndexedDataset:
    """Map-style access to the samples of a manifest (see the module docstring).

    ``manifest``: a :class:`~tarshards.format.manifest.Manifest` or its path/URL.
    ``decode``: as ``WebDataset(decoder=...)``: an image mode (``"pil"``, ``"rgb8"``...), a
    function ``f(ext, data)``, or a list of them; ``None`` (default) gives raw sample dicts, equal
    to those of a sequential read (``__key__``, ``__url__``, fields as bytes).
    With a media decoder among them (:func:`tarshards.video`, :func:`tarshards.audio`), its
    fields are decoded from their byte ranges of the shard (:func:`tarshards.read_media`: the
    demuxer fetches the container's header and index and the clip's packets, not the member),
    the other fields read as bytes; a random clip is drawn afresh at each access.
    ``transform``: a function applied to each (decoded) sample.
    ``verify``: check each member's checksum against the index (``IntegrityError`` naming the
    shard, member and offset).
    ``cache_dir``/``cache_size``: fetch remote shards whole into a :class:`ShardCache` and read
    them locally (a download is verified against the manifest before it is kept).
    ``fields=[...]``: only these fields (see ``WebDataset(fields=)``): only the column groups
    holding them are read, the base shards only when a field is not in a group. A manifest with
    column groups (:func:`tarshards.add_columns`) or a join (:func:`tarshards.join`) gives its
    rows merged (``cache_dir`` and media decoders then read as plain fields).
    """

    def __init__(
        self,
        manifest,
        *,
        decode: Any = None,
        transform: Callable | None = None,
        verify: bool = False,
        storage_options: dict | None = None,
        cache_dir=None,
        cache_size=None,
        decode_size=None,
        allow_unsafe: bool = False,
        fields=None,
    ):
        from ..format.selection import View, as_record

        record = as_record(manifest, storage_options)
        #: a view given as the manifest: ``ds[i]`` is the view's sample i
        self.view = record if isinstance(record, View) else None
        if self.view is not None:
            record = self.view.manifest
        self.manifest: Manifest = as_manifest(record, storage_options)
        #: sidecar columns, a join, fields=: the parts read and merged per row (else None)
        self.layout = None
        if fields is not None or self.manifest.columns or self.manifest.join:
            from .sidecar import layout_for

            self.layout = layout_for(self.manifest, fields, storage_options=storage_options)
        self._parts: list = []  # per part of the layout: its own IndexedDataset where aligned
        if self.layout is not None:
            self.manifest = self.layout.manifest
            self._parts = [
                IndexedDataset(p.manifest, verify=verify, storage_options=storage_options)
                if p.aligned
                else None
                for p in self.layout.parts
            ]
        else:
            self.manifest = _with_indexes(self.manifest)
        self.urls = self.manifest.shard_urls()
        counts = np.fromiter(
            (r.samples for r in self.manifest.shards), np.int64, len(self.manifest.shards)
        )
        if self.view is not None:
            counts = np.asarray(self.view.selected_counts, dtype=np.int64)
            self._rows = self.view.rows
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._start_list = self._starts.tolist()
        self._len = self._start_list[-1]
        self.storage_options = storage_options
        self.verify = verify
        self.transform = transform
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        if decode is None:
            self._decode = None
        else:
            modes = decode if isinstance(decode, (list, tuple)) else [decode]
            kw: dict = {"allow_unsafe": allow_unsafe}
            if decode_size is not None:
                kw["size"] = decode_size
            list(_stages.decode(iter(()), *modes, **kw))  # check the modes now, not in a worker
            self._decode = (tuple(modes), kw)
        # media decoders (tarshards.video(), tarshards.audio()): their fields are decoded from
        # the member's byte range of the shard, the demuxer fetching only what the clip needs
        self._media = tuple(
            m for m in (self._decode[0] if self._decode is not None else ()) if _is_media(m)
        )
        self._readers: dict = {}
        self._infos: dict = {}
        self._cache = None
        self._pid = os.getpid()

    # ---- the map-style protocol --------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard number, sample number in that shard)`` of global sample ``i``."""
        n = self._len
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range (the data set has {n} samples)")
        starts = self._start_list
        shard = bisect.bisect_right(starts, i) - 1
        if self.view is not None:  # the view's sample: the row it keeps
            rows = self._rows[shard]
            if rows is not None:
                return shard, int(rows[i - starts[shard]])
        return shard, i - starts[shard]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        try:
            i = operator.index(i)  # numpy / torch integers too
        except TypeError:
            raise TypeError(f"samples are indexed by int, not {type(i).__name__}") from None
        shard, j = self.locate(i)
        sample = self._media_sample(shard, j) if self._media and self.layout is None else None
        if sample is None:
            sample = self.raw_sample(shard, j)
        if self._decode is not None:
            modes, kw = self._decode
            if sample.get("__media__"):
                del sample["__media__"]
                kw = dict(kw, partial=True)  # its media fields are decoded already
            sample = next(_stages.decode(iter((sample,)), *modes, **kw))
        if self.transform is not None:
            sample = self.transform(sample)
        return sample

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self):
        return (
            f"IndexedDataset({len(self)} samples in {len(self.urls)} shards, "
            f"manifest={self.manifest.url!r})"
        )

    # ---- reading -----------------------------------------------------------------------------
    def _info(self, shard: int) -> "_ShardInfo":
        info = self._infos.get(shard)
        if info is None:
            info = self._infos[shard] = _ShardInfo(
                self.manifest.load_index(shard), self.urls[shard]
            )
        return info

    def _media_sample(self, shard: int, j: int) -> dict | None:
        """Sample ``j`` of shard ``shard`` with its media fields decoded from their byte ranges
        (:func:`tarshards.media.read_media`) and its other fields read as bytes; ``None`` where
        the shard's members cannot be read alone (compressed, rebuilt), or with ``verify``
        (which checks whole members)."""
        info = self._info(shard)
        if not info.plain or j in info.rebuilt or self.verify or j >= info.n:
            return None
        from ..media.access import read_media

        url = info.url
        source = url
        if not is_local(url) and self.cache_dir is not None:
            source = self._shard_cache().fetch(url)
        key = info.keys[j]
        base = info.tar_offsets[j]
        sample: dict = {"__key__": key, "__url__": url, "__offset__": int(base)}
        decoded = False
        reader = None
        for m in range(info.starts[j], info.starts[j + 1]):
            ext = info.exts[m]
            doff, size = info.data_offsets[m], info.sizes[m]
            handler = next((h for h in self._media if _claims(h, ext)), None)
            if handler is None:
                if reader is None:
                    reader = self._reader(shard)
                sample[ext] = reader.read(doff, doff + size)
                continue
            rng = random.Random(f"{random.getrandbits(64)}/{url}/{key}")
            try:
                sample[ext] = read_media(
                    source,
                    doff,
                    size,
                    handler,
                    rng=rng,
                    member=f"{key}.{ext}",
                    storage_options=self.storage_options,
                    keyframes=info.index.member_keyframes(m),
                )
            except TarshardsError as exn:
                raise exn.with_context(url=url, member=f"{key}.{ext}", offset=doff) from None
            decoded = True
        if decoded:
            sample["__media__"] = True
        return sample

    def raw_sample(self, shard: int, j: int) -> dict:
        """Sample ``j`` of shard ``shard`` as raw bytes (no decoding, no transform).

        The sample's bytes are read in one piece and its fields cut out where the index says
        they are (the first member's header is checked against the index, so an index made
        for another version of the shard is caught; ``verify=True`` checks every field)."""
        if self.layout is not None:  # the parts' rows (an aligned part's by its own ds[i])
            rows = [
                sub.raw_sample(shard, j)
                if sub is not None
                else part.read_rows(shard, j, j + 1, self.verify)[0]
                for part, sub in zip(self.layout.parts, self._parts)
            ]
            return self.layout.merge(rows)
        info = self._info(shard)
        url = info.url
        if j >= info.n:
            raise IntegrityError(
                f"the index has {info.n} samples, the manifest "
                f"{self.manifest.shards[shard].samples}",
                url=url,
            )
        start = info.offsets[j]
        end = info.ends[j]
        base = info.tar_offsets[j]
        r = self._readers.get(shard) if info.plain else None
        if type(r) is LocalRanges and _read_sample is not None and j not in info.rebuilt:
            # the usual case, in one C call: one pread, the header checked, the dict made
            m0 = info.starts[j]
            sample = _read_sample(
                r.fd,
                start,
                end,
                base,
                info.member_offsets[m0] if m0 < len(info.member_offsets) else base,
                info.data_offsets,
                info.sizes,
                info.exts,
                m0,
                info.starts[j + 1],
                info.keys[j],
                url,
            )
            if sample is not None:  # else the general path, which says what is wrong
                if self.verify:
                    _check_members(sample, info.index, j, url)
                return sample
        if type(r) is LocalRanges:  # one pread (fds survive a fork)
            data = os.pread(r.fd, end - start, start)
            if len(data) != end - start:
                data = r.read(start, end)
        elif info.seekable:
            data = self._reader(shard).read(start, end)
            if info.compression != "none":
                data = _inflate(data, info.entry, url, start)
        else:  # compressed as one stream: offsets are in the uncompressed stream
            data = self._reader(shard, stream=True).read(start, end)
        m0, m1 = info.starts[j], info.starts[j + 1]
        if j in info.rebuilt:
            return self._rebuilt_sample(info, j, data, m0, m1)
        doffs, sizes, exts = info.data_offsets, info.sizes, info.exts
        at = info.member_offsets[m0] - base
        if _header_ok is None or not _header_ok(data, at, sizes[m0]):
            size = None if j in info.global_size else sizes[m0]
            _check_header(data, at, size, url, info.member_offsets[m0])
        # __offset__: where the sample's first header starts in the tar stream, as a
        # sequential read reports it
        sample = {"__key__": info.keys[j], "__url__": url, "__offset__": int(base)}
        for m in range(m0, m1):
            a = doffs[m] - base
            sample[exts[m]] = data[a : a + sizes[m]]
        if self.verify:
            _check_members(sample, info.index, j, url)
        return sample

    def _rebuilt_sample(self, info: "_ShardInfo", j: int, data, m0: int, m1: int) -> dict:
        """A sample holding a member whose stored bytes are not its content (a GNU sparse
        member): its bytes parsed by the tar reader, which rebuilds it, member for member as
        the index lists them."""
        base = info.tar_offsets[j]
        url = info.url
        members = [
            (name, content)
            for name, content, _ in iter_tar((bytes(data), bytes(2 * BLOCK)), url, offset=base)
            if (split_name(name, info.index.last_dot) or ("",))[0] == info.keys[j]
        ]
        if len(members) != m1 - m0:
            raise IntegrityError(
                f"the index lists {m1 - m0} members of sample {info.keys[j]!r}, its bytes "
                f"hold {len(members)}",
                url=url,
                offset=base,
            )
        sample = {"__key__": info.keys[j], "__url__": url, "__offset__": int(base)}
        for m, (name, content) in zip(range(m0, m1), members):
            if len(content) != info.sizes[m]:
                raise IntegrityError(
                    f"member of {len(content)} bytes where the index says {info.sizes[m]}",
                    url=url,
                    member=name,
                    offset=info.member_offsets[m],
                )
            sample[info.exts[m]] = content
        if self.verify:
            _check_members(sample, info.index, j, url)
        return sample

    def _reader(self, shard: int, stream: bool = False):
        """The shard's byte ranges; ``stream``: of the uncompressed stream of a shard compressed
        as one stream (a .tgz's through indexed_gzip's seek points where the shard is local or
        cached and indexed_gzip is installed, else a decompressed copy: _unpacked_copy)."""
        if os.getpid() != self._pid:  # forked into a worker: do not share descriptors
            self._readers = {}
            self._cache = None
            self._pid = os.getpid()
        r = self._readers.get(shard)
        if r is None:
            url = self.urls[shard]
            if stream:
                source = url
                if is_local(url):
                    source = local_path(url)
                elif self.cache_dir is not None:  # fetched whole and verified first
                    source = self._shard_cache().fetch(url)
                if (
                    self._infos[shard].compression == "gzip"
                    and is_local(source)
                    and GzipSeekRanges.available()
                ):
                    r = GzipSeekRanges(local_path(source), url)
                else:
                    r = _unpacked_copy(source, url, self.storage_options, self.cache_dir)
            elif is_local(url):
                r = LocalRanges(local_path(url), url)
            elif self.cache_dir is not None:
                r = LocalRanges(self._shard_cache().fetch(url), url)
            else:
                r = RemoteRanges(url, self.storage_options)
            self._readers[shard] = r
        return r

    def _shard_cache(self):
        if self._cache is None:
            from ..storage import ShardCache

            self._cache = ShardCache(
                self.cache_dir,
                max_bytes=self.cache_size,
                storage_options=self.storage_options,
                manifest=self.manifest,
            )
        return self._cache

    def close(self) -> None:
        """Close the open shard files (they reopen on the next access)."""
        for r in self._readers.values():
            r.close()
        self._readers = {}
        if self.layout is not None:
            self.layout.close()
            for sub in self._parts:
                if sub is not None:
                    sub.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_readers"] = {}
        state["_infos"] = {}
        state["_cache"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pid = os.getpid()


def _is_media(handler) -> bool:
    """A media decoder (:func:`tarshards.video`, :func:`tarshards.audio`): it decodes from a
    seekable file, so its fields are read as byte ranges."""
    return getattr(handler, "media", None) in ("video", "audio") and hasattr(handler, "decode")


def _claims(handler, ext: str) -> bool:
    return ext.rpartition(".")[2].lower() in handler.extensions


class _ShardInfo:
    """One shard's index as plain lists: what ``ds[i]`` looks up, at list speed."""

    __slots__ = (
        "compression",
        "data_offsets",
        "ends",
        "entry",
        "exts",
        "global_size",
        "index",
        "keys",
        "member_offsets",
        "n",
        "offsets",
        "plain",
        "rebuilt",
        "seekable",
        "sizes",
        "starts",
        "tar_offsets",
        "url",
    )

    def __init__(self, idx, url: str):
        self.index = idx
        self.url = url
        self.n = idx.num_samples
        self.offsets = idx.sample_offsets.tolist()
        self.ends = idx.sample_ends.tolist()
        self.tar_offsets = idx.tar_offsets.tolist()
        self.starts = idx.member_starts.tolist()
        self.keys = idx.keys
        self.member_offsets = idx.member_offsets.tolist()
        self.data_offsets = idx.member_data_offsets.tolist()
        self.sizes = idx.member_sizes.tolist()
        lowered = [e.lower() for e in idx.extensions]  # the reader lower-cases extensions
        self.exts = [lowered[c] for c in idx.member_ext.tolist()]
        self.seekable = idx.seekable
        self.compression = idx.compression
        self.entry = idx.entry
        self.plain = idx.seekable and idx.compression == "none"
        # samples with a member to rebuild (GNU sparse): parsed, not sliced (usually none)
        self.rebuilt = frozenset(np.flatnonzero(idx.sample_flags & FLAG_REBUILT).tolist())
        self.global_size = frozenset(np.flatnonzero(idx.sample_flags & FLAG_GLOBAL_SIZE).tolist())


def _with_indexes(manifest: Manifest) -> Manifest:
    """The manifest, each shard with its index: one the manifest names, or the index file
    beside the shard (``SHARD.tsidx``; a wids ``shardindex.json`` names none). A shard with
    neither fails here, at construction, not at its first ``ds[i]``."""
    if all(r.index is not None for r in manifest.shards):
        return manifest
    manifest = manifest.with_sidecar_indexes()
    missing = [u for r, u in zip(manifest.shards, manifest.shard_urls()) if r.index is None]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ShardFormatError(
            f"random access needs each shard's index; none is named by the manifest or lies "
            f"beside the shard for {missing[0]}{more} (a wids shardindex.json holds counts "
            f"only): make them with  tarshards index SPEC -o DIR/manifest.json  (DIR: the "
            f"shards' directory, so that each SHARD.tsidx lands beside its shard) and open "
            f"that manifest, or this one again",
            url=manifest.url,
        )
    return manifest


def _inflate(data: bytes, entry: str, url, offset: int) -> bytes:
    """The uncompressed bytes of one or more whole gzip members / zstd frames, or
    (``entry="deflate"``) of the raw deflate data between two flush points."""
    try:
        if entry == "deflate":
            return b"".join(inflated_from([data], url, offset, bounded=True))
        return b"".join(decompressed_chunks([data], url))
    except TarshardsError as exc:
        raise exc.with_context(url=url, offset=offset) from None


def _check_header(data: bytes, at: int, size: int | None, url, offset: int) -> None:
    """The tar header at ``data[at:]`` must be sound and, when plain, give ``size`` (``None``:
    the size is a pax global header's, not the header's own)."""
    hdr = data[at : at + 512]
    if len(hdr) < 512:
        ok = False
    else:
        try:  # our writer's (and most) headers: six octal digits; else the exact check
            ok = sum(hdr) - sum(hdr[148:156]) + 256 == parse_octal(hdr[148:154]) or checksum_ok(hdr)
        except ValueError:
            ok = checksum_ok(hdr)
    if not ok:
        raise IntegrityError(
            "no valid tar header where the index puts this sample (is the "
            "index for another version of this shard?)",
            url=url,
            offset=offset,
        )
    if hdr[156] in (0x30, 0) and size is not None:
        try:
            stored = size_number(hdr)
        except ValueError:  # the reader's fallback: any octal field, spaces and NULs around
            try:
                stored = parse_number(hdr[124:136])
            except ValueError:
                stored = -1
        if stored != size:
            raise IntegrityError(
                "the member's size is not the index's (is the index for "
                "another version of this shard?)",
                url=url,
                offset=offset,
            )


def _check_members(sample: dict, idx, j: int, url) -> None:
    """Compare each field of sample ``j`` with the checksums the index holds."""
    starts = idx.member_starts
    csum = idx.checksum_fn()
    exts = idx.extensions
    for m in range(int(starts[j]), int(starts[j + 1])):
        ext = exts[int(idx.member_ext[m])].lower()
        data = sample.get(ext)
        if data is None:
            raise IntegrityError(
                f"field {ext!r} of sample {idx.keys[j]!r} is missing",
                url=url,
                offset=int(idx.member_offsets[m]),
            )
        if csum(data) != int(idx.member_checksums[m]):
            raise IntegrityError(
                "member checksum does not match the index",
                url=url,
                member=idx.member_names(j)[m - int(starts[j])],
                offset=int(idx.member_offsets[m]),
            )
