"""What the browser shows, computed from a data set's index: pages, samples, search, statistics.

:class:`BrowseData` opens a manifest (or indexes a shard spec first, into a directory of its own)
and answers everything the web pages ask through the index's random access: a page of samples is
the index's rows for those positions and one read per sample, so page 1000 of a large set costs
what page 1 does. Nothing here knows about HTTP; :mod:`tarshards.web.server` serves it.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import io
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ..codecs.images import IMAGE_EXTENSIONS
from ..errors import IntegrityError, MissingDependencyError, TarshardsError
from ..format.index import FLAG_REBUILT
from ..format.manifest import Manifest, build_manifest, is_manifest_spec
from ..format.selection import View, as_record, is_view_spec
from ..read.indexed import IndexedDataset
from ..read.specs import expand_urls
from ..storage import filesystem, is_local, local_path, open_url

__all__ = [
    "AUDIO_TYPES",
    "BadRequest",
    "BrowseData",
    "NotFound",
    "VIDEO_TYPES",
    "av_available",
    "field_kind",
    "media_type",
]

TEXT_EXTENSIONS = frozenset(
    ("txt", "text", "caption", "cls", "cls2", "class", "label", "labels", "id", "index", "inx")
)
JSON_EXTENSIONS = frozenset(("json", "jsn"))
CLASS_FIELDS = ("cls", "class", "label", "cls2", "target")
TEXT_LIMIT = 100_000  # characters of a text field shown on a sample page
WHOLE_SAMPLE = 4 << 20  # a sample up to this size is read in one piece for its fields
WHOLE_FIELD = 8 << 20  # a byte range of a field up to this size: the field read whole, checked
# what the browser plays: the Content-Type of the raw-field route for audio and video fields
AUDIO_TYPES = {
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "ogg": "audio/ogg",
    "opus": "audio/ogg",
    "m4a": "audio/mp4",
}
VIDEO_TYPES = {
    "mp4": "video/mp4",
    "m4v": "video/mp4",
    "webm": "video/webm",
    "mkv": "video/x-matroska",
    "mov": "video/quicktime",
    "avi": "video/x-msvideo",
}
PLAYABLE_VIDEO = frozenset(("mp4", "m4v", "webm"))  # containers Chromium plays in <video>
MEDIA_INFO_CACHE = 4096  # probed media fields kept (LRU)
_CONTROL = frozenset(chr(c) for c in range(32) if chr(c) not in "\t\n\r")


class BadRequest(ValueError):
    """A request the data set cannot answer as asked (a bad number, an unknown field): 400."""

    status = 400


class NotFound(BadRequest):
    """A sample or field that is not there: 404."""

    status = 404


def field_kind(name: str) -> str:
    """``"image"``, ``"audio"``, ``"video"``, ``"json"``, ``"text"`` or ``"binary"`` for a field
    (its last extension part decides: ``seg.png`` is an image, ``left.mp4`` a video)."""
    last = name.rsplit(".", 1)[-1].lower()
    if last in IMAGE_EXTENSIONS:
        return "image"
    if last in AUDIO_TYPES:
        return "audio"
    if last in VIDEO_TYPES:
        return "video"
    if last in JSON_EXTENSIONS:
        return "json"
    if last in TEXT_EXTENSIONS:
        return "text"
    return "binary"


def media_type(name: str) -> str | None:
    """The Content-Type of an audio or video field (``audio/flac``, ``video/mp4``...), else
    None."""
    last = name.rsplit(".", 1)[-1].lower()
    return AUDIO_TYPES.get(last) or VIDEO_TYPES.get(last)


def av_available() -> bool:
    """Whether PyAV can be imported (video posters and probed durations need it)."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def as_text(data: bytes) -> str | None:
    """The bytes as text when they are UTF-8 without control characters, else None."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(c in _CONTROL for c in text[:4096]):
        return None
    return text


@dataclass(frozen=True)
class FieldInfo:
    """One member of a sample, as the index records it."""

    name: str  # the field name the reader gives (the extension, lower-cased)
    member: str  # the member's name in the tar
    size: int
    offset: int  # the member's header, in the (uncompressed) tar stream
    data_offset: int
    checksum: str  # ALGORITHM:HEX of the member's data

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "member": self.member,
            "kind": field_kind(self.name),
            "size": self.size,
            "offset": self.offset,
            "data_offset": self.data_offset,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class SampleInfo:
    """Where sample ``index`` is and what it holds, from the index alone (no data read)."""

    index: int
    key: str
    shard: int
    shard_url: str
    position: int  # the sample's number in its shard
    offset: int  # its first header, in the (uncompressed) tar stream
    file_offset: int  # the bytes of the shard file read for it alone
    file_end: int
    fields: tuple[FieldInfo, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.fields)

    def field(self, name: str) -> FieldInfo:
        for f in self.fields:
            if f.name == name:
                return f
        have = ", ".join(f.name for f in self.fields) or "none"
        raise NotFound(f"sample {self.index} has no field {name!r} (its fields: {have})")

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "key": self.key,
            "shard": self.shard,
            "shard_url": self.shard_url,
            "position": self.position,
            "offset": self.offset,
            "file_offset": self.file_offset,
            "file_end": self.file_end,
            "size": self.size,
            "fields": [f.to_json() for f in self.fields],
        }


class _ShardRows:
    """One shard's index, looked up per sample (numpy arrays as the index holds them: nothing
    converted for the whole shard, so the first page of a shard costs little more than the
    next)."""

    def __init__(self, idx) -> None:
        self.index = idx
        self.key_offsets = idx.key_offsets
        self.key_blob = idx.key_blob
        self.starts = idx.member_starts
        self.tar_offsets = idx.tar_offsets
        self.file_offsets = idx.sample_offsets
        self.file_ends = idx.sample_ends
        self.ext_codes = idx.member_ext
        self.offsets = idx.member_offsets
        self.data_offsets = idx.member_data_offsets
        self.sizes = idx.member_sizes
        self.checksums = idx.member_checksums
        self.extensions: tuple[str, ...] = tuple(idx.extensions)
        self.member_hash: str = idx.member_hash
        self.flags = idx.sample_flags
        self._sorted: bool | None = None

    @property
    def keys(self) -> list[str]:
        """Every key of the shard (decoded once, for search)."""
        return self.index.keys

    def key(self, j: int) -> str:
        """Key ``j`` alone (a page does not decode the shard's 50,000 keys)."""
        a, b = int(self.key_offsets[j]), int(self.key_offsets[j + 1])
        return bytes(self.key_blob[a:b]).decode("utf-8", "surrogateescape")

    @property
    def keys_sorted(self) -> bool:
        if self._sorted is None:
            k = self.keys
            self._sorted = all(k[i] <= k[i + 1] for i in range(len(k) - 1))
        return self._sorted


class BrowseData:
    """A data set opened for browsing (see the module docstring).

    ``spec``: a manifest (``.json`` path or URL, or a
    :class:`~tarshards.format.manifest.Manifest`), a
    view (a ``*.view.json`` path or a :class:`~tarshards.View`: the pages, search and index
    statistics are the view's samples; its manifest's shards need indexes), or a shard spec
    (brace ranges, globs, ``::``-joined, a list; local or remote). Shards without an index are
    indexed once (one sequential read each) into ``index_dir`` (kept, and reused while the
    shards' sizes are unchanged), else into a temporary directory removed at :meth:`close`.
    ``seed``: which samples the decoded statistics read.
    """

    def __init__(
        self,
        spec,
        *,
        storage_options: dict | None = None,
        index_dir=None,
        seed: int = 0,
        stats_samples: int = 256,
        progress: bool = False,
    ):
        self.storage_options = storage_options
        self.seed = int(seed)
        self.stats_samples = int(stats_samples)
        self._tmp: str | None = None
        #: the view browsed (its samples are the pages), or None
        self.view: View | None = None
        try:
            self.manifest = self._open(spec, index_dir, progress)
        except BaseException:
            self.close_files()
            raise
        self.spec = (
            os.fspath(spec)
            if isinstance(spec, (str, os.PathLike))
            else (self.manifest.url if self.view is None else self.view.url)
        )
        self.dataset = IndexedDataset(
            self.manifest if self.view is None else self.view, storage_options=storage_options
        )
        self.urls = self.dataset.urls
        self._lock = threading.RLock()
        self._opened: set[int] = set()  # shards read once (their reader made)
        self._checksum_fns: dict[int, Any] = {}
        self._rows: dict[int, _ShardRows] = {}
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()
        self._media_info: collections.OrderedDict = collections.OrderedDict()

    # ---- opening -----------------------------------------------------------------------------
    def _open(self, spec, index_dir, progress: bool) -> Manifest:
        if is_view_spec(spec):
            view = as_record(spec, self.storage_options)
            if not isinstance(view, View):
                raise TypeError(f"not a view: {spec!r}")
            missing = [r.url for r in view.manifest.shards if r.index is None]
            if missing:
                raise ValueError(
                    f"the view's manifest has shards without an index ({missing[0]}...): a view "
                    "is browsed through its manifest's indexes (tarshards index)"
                )
            self.view = view
            return view.manifest
        if is_manifest_spec(spec):
            manifest = (
                spec
                if isinstance(spec, Manifest)
                else Manifest.load(spec, storage_options=self.storage_options)
            )
            if all(r.index is not None for r in manifest.shards):
                return manifest
            urls = manifest.shard_urls()  # counts only (a wids shardindex.json): index them
        else:
            urls = expand_urls(spec, storage_options=self.storage_options)
        if not urls:
            raise ValueError(f"no shards in {spec!r}")
        if index_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="tarshards-browse-")
            folder = self._tmp
        else:
            folder = os.fspath(index_dir)
            os.makedirs(folder, exist_ok=True)
        digest = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]
        path = os.path.join(folder, f"browse-{digest}.json")
        if index_dir is not None and os.path.exists(path):
            try:
                old = Manifest.load(path)
            except TarshardsError:
                old = None
            if old is not None and _still_valid(old, urls, self.storage_options):
                return old
        return build_manifest(urls, path, storage_options=self.storage_options, progress=progress)

    def close(self) -> None:
        """Close the shard files and remove the temporary index directory (if any)."""
        self.dataset.close()
        self.close_files()

    def close_files(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "BrowseData":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- samples -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def num_shards(self) -> int:
        return len(self.urls)

    def _count(self, shard: int) -> int:
        """The samples browsed of shard ``shard`` (a view's: the rows it keeps)."""
        if self.view is not None:
            return self.view.selected_counts[shard]
        return self.manifest.shards[shard].samples

    def rows(self, shard: int) -> _ShardRows:
        rows = self._rows.get(shard)
        if rows is None:
            with self._lock:
                rows = self._rows.get(shard)
                if rows is None:
                    rows = self._rows[shard] = _ShardRows(self.manifest.load_index(shard))
        return rows

    def check_index(self, i) -> int:
        """``i`` as a sample number (an int, or a string of one) in range, else BadRequest."""
        if isinstance(i, str):
            text = i.strip()
            if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 20:
                raise BadRequest(f"bad sample index {i[:40]!r} (an integer)")
            i = int(text)
        n = len(self)
        if not 0 <= i < n:
            raise NotFound(f"sample {i} out of range (the data set has {n} samples: 0..{n - 1})")
        return i

    def info(self, i) -> SampleInfo:
        """What the index says about sample ``i`` (no data read)."""
        i = self.check_index(i)
        shard, j = self.dataset.locate(i)
        r = self.rows(shard)
        key = r.key(j)
        prefix = "./" if int(r.flags[j]) & 1 else ""
        algo = r.member_hash
        m0, m1 = int(r.starts[j]), int(r.starts[j + 1])
        codes = r.ext_codes[m0:m1].tolist()
        sizes = r.sizes[m0:m1].tolist()
        offsets = r.offsets[m0:m1].tolist()
        data_offsets = r.data_offsets[m0:m1].tolist()
        checksums = r.checksums[m0:m1].tolist()
        fields = []
        for k in range(m1 - m0):
            ext = r.extensions[codes[k]]
            fields.append(
                FieldInfo(
                    name=ext.lower(),
                    member=f"{prefix}{key}.{ext}",
                    size=sizes[k],
                    offset=offsets[k],
                    data_offset=data_offsets[k],
                    checksum=f"{algo}:{checksums[k]:016x}",
                )
            )
        return SampleInfo(
            index=i,
            key=key,
            shard=shard,
            shard_url=self.urls[shard],
            position=j,
            offset=int(r.tar_offsets[j]),
            file_offset=int(r.file_offsets[j]),
            file_end=int(r.file_ends[j]),
            fields=tuple(fields),
        )

    def read(self, i) -> dict:
        """Sample ``i``'s raw fields (one read of its bytes through the index)."""
        i = self.check_index(i)
        shard, _ = self.dataset.locate(i)
        if shard in self._opened:  # the dataset's reader of this shard is made: reads only
            return self.dataset[i]
        with self._lock:  # the first read of a shard makes its reader (not thread safe)
            sample = self.dataset[i]
            self._opened.add(shard)
            return sample

    def field_bytes(self, i, name: str, info: SampleInfo | None = None) -> bytes:
        """One field's bytes: read alone (its byte range, from the index, checked against the
        index's member checksum) where the shard is a plain tar, else cut from the sample.
        ``info``: sample ``i``'s, when the caller has it."""
        if info is None or info.index != i:
            info = self.info(i)
        f = info.field(name)  # NotFound naming the fields it has
        if not self._plain(info):
            return bytes(self.read(info.index)[name])
        return self._checked(info, f, self._read_range(info, f.data_offset, f.size))

    def small_fields(self, info: SampleInfo, limit: int) -> dict[str, bytes]:
        """The fields of a sample up to ``limit`` bytes each: the whole sample read in one piece
        when it is small (:data:`WHOLE_SAMPLE` bytes at most), else each such field alone (a
        sample with a large video is not read to show its caption). From a plain tar shard the
        bytes are cut where the index says and checked against its member checksums."""
        wanted = [f for f in info.fields if f.size <= limit]
        if info.size > WHOLE_SAMPLE:
            return {f.name: self.field_bytes(info.index, f.name, info) for f in wanted}
        if not self._plain(info):
            sample = self.read(info.index)
            return {f.name: sample[f.name] for f in wanted}
        data = self._read_range(info, info.file_offset, info.file_end - info.file_offset)
        out = {}
        for f in wanted:
            a = f.data_offset - info.file_offset
            out[f.name] = self._checked(info, f, data[a : a + f.size])
        return out

    def _plain(self, info: SampleInfo) -> bool:
        """Whether the sample's bytes lie as they are in its shard file (a plain tar: offsets
        in the tar stream are offsets in the file; no sparse member to rebuild)."""
        idx = self.manifest.load_index(info.shard)
        return (
            idx.compression == "none"
            and bool(idx.seekable)
            and not int(idx.sample_flags[info.position]) & FLAG_REBUILT
        )

    def _read_range(self, info: SampleInfo, start: int, length: int) -> bytes:
        url = info.shard_url
        if is_local(url):
            with open(local_path(url), "rb") as fh:
                data = os.pread(fh.fileno(), length, start)
        else:
            with open_url(
                url, offset=start, length=length, storage_options=self.storage_options
            ) as fh:
                data = fh.read()
        if len(data) != length:
            raise IntegrityError(
                f"the shard ends inside sample {info.index} (is the index for another version "
                "of this shard?)",
                url=url,
                offset=start + len(data),
            )
        return data

    def _checked(self, info: SampleInfo, f: FieldInfo, data: bytes) -> bytes:
        """``data`` when its checksum is the index's for field ``f``, else IntegrityError."""
        fn = self._checksum_fns.get(info.shard)
        if fn is None:
            fn = self.manifest.load_index(info.shard).checksum_fn()
            self._checksum_fns[info.shard] = fn
        if fn(data) != int(f.checksum.rpartition(":")[2], 16):
            raise IntegrityError(
                "member checksum does not match the index (is the index for another version "
                "of this shard?)",
                url=info.shard_url,
                member=f.member,
                offset=f.offset,
            )
        return data

    def field_range(self, i, name: str, start: int, end: int, info: SampleInfo | None = None):
        """Bytes ``[start, end)`` of a field (an HTTP Range request): the field read whole and
        checked against the index's checksum up to :data:`WHOLE_FIELD` bytes, else the range
        alone (from a plain tar shard; a range of a member cannot be checked)."""
        if info is None or info.index != i:
            info = self.info(i)
        f = info.field(name)
        if not 0 <= start <= end <= f.size:
            raise BadRequest(f"byte range {start}-{end} outside field {name!r} ({f.size} bytes)")
        if f.size <= WHOLE_FIELD or not self._plain(info):
            return self.field_bytes(info.index, name, info)[start:end]
        return self._read_range(info, f.data_offset + start, end - start)

    def media_file(self, info: SampleInfo, name: str):
        """A field's bytes as a seekable file (a context manager): the member's byte range of a
        plain tar shard (:func:`tarshards.media.member_file`: a demuxer reads only what it
        needs), else the field read from its sample."""
        f = info.field(name)
        if self._plain(info):
            from ..media.access import member_file

            return member_file(
                info.shard_url, f.data_offset, f.size, storage_options=self.storage_options
            )
        return io.BytesIO(self.field_bytes(info.index, name, info))

    def meta_value(self, info: SampleInfo, column: str) -> float | None:
        """Per-sample metadata ``column`` of a sample, from its shard's index (nothing read);
        None where the index has no such column or no value for it."""
        arr = self.rows(info.shard).index.meta.get(column)
        if arr is None:
            return None
        value = float(arr[info.position])
        return None if value != value else value

    def media_info(self, i, name: str, info: SampleInfo | None = None) -> dict:
        """``duration`` (seconds) and the other properties of an audio or video field: from the
        index's metadata columns (``mp4.duration``...) when it has them, else probed from the
        member's header (PyAV; cached). ``{}`` when neither tells (no PyAV, not readable)."""
        if info is None or info.index != i:
            info = self.info(i)
        f = info.field(name)
        kind = field_kind(f.name)
        if kind not in ("audio", "video"):
            return {}
        duration = self.meta_value(info, f"{f.name}.duration")
        if duration is not None:
            out: dict = {"duration": duration}
            props = ("width", "height", "fps") if kind == "video" else ("rate", "channels")
            for prop in props:
                value = self.meta_value(info, f"{f.name}.{prop}")
                if value is not None:
                    out[prop] = value
            return out
        key = (info.index, f.name)
        with self._lock:
            cached = self._media_info.get(key)
            if cached is not None:
                self._media_info.move_to_end(key)
                return cached
        if not av_available():
            return {}
        from ..media.probe import probe

        try:
            with self.media_file(info, f.name) as fh:
                got = probe(fh, f.name)
        except (TarshardsError, MissingDependencyError):
            got = {}
        got = {k: v for k, v in got.items() if k != "start"}
        with self._lock:
            self._media_info[key] = got
            while len(self._media_info) > MEDIA_INFO_CACHE:
                self._media_info.popitem(last=False)
        return got

    def poster(self, i, name: str, size: int, info: SampleInfo | None = None) -> bytes:
        """A video field's poster frame (its middle frame, decoded with
        :func:`tarshards.video` from the member's byte range) as a JPEG at most ``size`` pixels
        wide and high. :class:`~tarshards.errors.MissingDependencyError` without PyAV,
        ValueError when the video cannot be decoded."""
        if info is None or info.index != i:
            info = self.info(i)
        f = info.field(name)
        if field_kind(f.name) != "video":
            raise BadRequest(f"field {name!r} of sample {info.index} is not a video")
        from ..media.probe import av_module
        from ..media.video import VideoDecoder

        av_module()  # MissingDependencyError saying how to install PyAV
        decoder = VideoDecoder(frames=1, clip="center", output="numpy")
        try:
            with self.media_file(info, f.name) as fh:
                clip = decoder.decode(fh)
        except TarshardsError as exc:
            raise ValueError(f"not a video PyAV decodes ({exc.reason})") from None
        from PIL import Image

        img = Image.fromarray(np.asarray(clip.frames[0]))
        img.thumbnail((size, size))
        buf = io.BytesIO()
        img.convert("RGB").save(buf, "JPEG", quality=85)
        return buf.getvalue()

    def page(self, page, size: int) -> tuple[int, int, range]:
        """``(page, pages, sample numbers)`` of page ``page`` (from 0) of ``size`` samples."""
        if isinstance(page, str):
            text = page.strip()
            if not (text.isascii() and text.isdigit()) or len(text) > 18:
                raise BadRequest(f"bad page number {page[:40]!r} (an integer from 0)")
            page = int(text)
        n = len(self)
        pages = max(1, -(-n // size))
        if not 0 <= page < pages:
            raise NotFound(f"page {page} out of range (there are {pages} pages: 0..{pages - 1})")
        return page, pages, range(page * size, min(n, (page + 1) * size))

    # ---- search ------------------------------------------------------------------------------
    def search(self, prefix: str, start: int = 0, limit: int = 48) -> tuple[int, list[int]]:
        """``(number of samples whose key starts with prefix, their sample numbers from the
        start-th match, at most limit)``, in data set order. Shards whose keys are sorted are
        searched by bisection, the others scanned."""
        if len(prefix) > 1000:
            raise BadRequest("search prefix too long (at most 1000 characters)")
        total = 0
        found: list[int] = []
        base = 0
        for shard in range(self.num_shards):
            count = self._count(shard)
            if count == 0:
                continue
            keys = self.rows(shard).keys
            sel = None if self.view is None else self.view.rows[shard]
            if sel is not None:  # a view: its rows' keys (in order: sorted stays sorted)
                keys = [keys[r] for r in sel.tolist()]
            if self.rows(shard).keys_sorted:
                lo = bisect.bisect_left(keys, prefix)
                hi = lo
                if prefix:
                    hi = bisect.bisect_left(keys, prefix + "\U0010ffff", lo)
                    # keys continuing the prefix with the highest character: rare; scan on
                    while hi < len(keys) and keys[hi].startswith(prefix):
                        hi += 1
                else:
                    hi = len(keys)
                hits: Iterable[int] = range(lo, hi)
                n_hits = hi - lo
            else:
                hits = [j for j, k in enumerate(keys) if k.startswith(prefix)]
                n_hits = len(hits)
            if n_hits and len(found) < limit and total + n_hits > start:
                skip = max(0, start - total)
                for j in list(hits)[skip : skip + limit - len(found)]:
                    found.append(base + j)
            total += n_hits
            base += count
        return total, found

    # ---- statistics --------------------------------------------------------------------------
    def index_stats(self) -> dict:
        """What the index alone tells (no sample data read): samples per shard, per field its
        count and sizes, bytes and members per sample."""
        with self._stats_lock:
            cached = self._stats.get("index")
            if cached is not None:
                return cached
            per_shard = [self._count(i) for i in range(self.num_shards)]
            sizes: dict[str, list] = collections.defaultdict(list)
            sample_bytes = []
            members_per_sample = []
            for shard in range(self.num_shards):
                if per_shard[shard] == 0:
                    continue
                idx = self.manifest.load_index(shard)
                exts = np.array([e.lower() for e in idx.extensions] or [""], dtype=object)
                names = exts[idx.member_ext] if len(idx.member_ext) else exts[:0]
                msizes = np.asarray(idx.member_sizes)
                starts = np.asarray(idx.member_starts)
                per_sample = np.diff(starts)
                cum = np.concatenate([[0], np.cumsum(msizes)])
                nbytes = cum[starts[1:]] - cum[starts[:-1]]
                sel = None if self.view is None else self.view.rows[shard]
                if sel is not None:  # a view: the members of its rows only
                    keep = np.repeat(np.isin(np.arange(len(per_sample)), sel), per_sample)
                    names, msizes = names[keep], msizes[keep]
                    per_sample, nbytes = per_sample[sel], nbytes[sel]
                for name in dict.fromkeys(names.tolist()):
                    sizes[name].append(msizes[names == name])
                members_per_sample.append(per_sample)
                sample_bytes.append(nbytes)
            fields = {}
            for name, parts in sorted(sizes.items()):
                arr = np.concatenate(parts)
                fields[name] = {
                    "count": int(arr.size),
                    "bytes": int(arr.sum()),
                    "min": int(arr.min()),
                    "mean": float(arr.mean()),
                    "max": int(arr.max()),
                    "histogram": histogram(arr),
                }
            sb = np.concatenate(sample_bytes) if sample_bytes else np.zeros(0, np.int64)
            mp = np.concatenate(members_per_sample) if members_per_sample else sb
            out = {
                "samples": len(self),
                "shards": self.num_shards,
                "samples_per_shard": per_shard,
                "shard_urls": self.urls,
                "fields": fields,
                "sample_bytes": histogram(sb),
                "members_per_sample": {
                    str(k): int(v) for k, v in zip(*np.unique(mp, return_counts=True))
                },
                "meta": self._meta_stats(),
            }
            self._stats["index"] = out
            return out

    def _meta_stats(self) -> dict:
        """Each per-sample metadata column of the indexes (``tokens``, ``jpg.width``,
        ``mp4.duration``...: :meth:`tarshards.Manifest.meta`): how many samples have a value,
        min, mean, max and a histogram (no data read)."""
        out = {}
        record = self.manifest if self.view is None else self.view
        for name in record.meta_columns()[:META_COLUMNS]:
            arr = np.asarray(record.meta(name), dtype=np.float64)
            values = arr[np.isfinite(arr)]
            if values.size and np.all(values == np.round(values)) and np.abs(values).max() < 2**53:
                values = values.astype(np.int64)  # counts, sizes: one bin per value when few
            out[name] = {
                "count": int(values.size),
                "missing": int(arr.size - values.size),
                "min": float(values.min()) if values.size else None,
                "mean": float(values.mean()) if values.size else None,
                "max": float(values.max()) if values.size else None,
                "histogram": histogram(values),
            }
        return out

    def data_stats(self) -> dict:
        """Statistics of a sample of decoded data: ``stats_samples`` samples drawn by ``seed``
        (image sizes per image field, the class histogram, text lengths)."""
        with self._stats_lock:
            cached = self._stats.get("data")
            if cached is not None:
                return cached
        n = len(self)
        k = min(n, self.stats_samples)
        rng = np.random.default_rng(self.seed)
        chosen = np.sort(rng.choice(n, k, replace=False)).tolist() if k else []
        images: dict[str, list] = collections.defaultdict(list)
        modes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        classes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        text_lengths: dict[str, list] = collections.defaultdict(list)
        json_columns: dict[str, dict] = collections.defaultdict(dict)
        unreadable = 0
        for i in chosen:
            try:
                sample = self.small_fields(self.info(i), 16 << 20)
            except TarshardsError:
                unreadable += 1
                continue
            for name, data in sample.items():
                kind = field_kind(name)
                if kind == "image":
                    size = image_size(data)
                    if size is not None:
                        images[name].append(size[:2])
                        modes[name][size[2]] += 1
                elif name in CLASS_FIELDS or name.split(".")[0] in CLASS_FIELDS:
                    text = as_text(data)
                    if text is not None and len(text) <= 200:
                        classes[name][text.strip()] += 1
                elif kind == "text":
                    text = as_text(data)
                    if text is not None:
                        text_lengths[name].append(len(text))
                elif kind == "json":
                    _numbers(data, json_columns[name])
        out = {
            "samples_read": len(chosen) - unreadable,
            "seed": self.seed,
            "unreadable": unreadable,
            "images": {
                name: {
                    "sizes": sizes,
                    "width": histogram(np.array([w for w, _ in sizes])),
                    "height": histogram(np.array([h for _, h in sizes])),
                    "modes": dict(modes[name]),
                }
                for name, sizes in sorted(images.items())
            },
            "classes": {
                name: dict(sorted(c.items(), key=_class_order)) for name, c in classes.items()
            },
            "text_lengths": {
                name: histogram(np.array(v)) for name, v in sorted(text_lengths.items())
            },
            "json_columns": {
                name: {key: histogram(np.array(v)) for key, v in columns.items() if v}
                for name, columns in sorted(json_columns.items())
            },
        }
        with self._stats_lock:
            self._stats["data"] = out
        return out


JSON_COLUMNS = 12  # numeric keys of a JSON field plotted, at most
META_COLUMNS = 64  # per-sample metadata columns of the index plotted, at most


def _numbers(data: bytes, columns: dict) -> None:
    """Append the top-level numbers of a JSON object to ``columns`` (key -> values)."""
    try:
        obj = json.loads(bytes(data))
    except ValueError:
        return
    if not isinstance(obj, dict):
        return
    for key, value in obj.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key in columns or len(columns) < JSON_COLUMNS:
                columns.setdefault(str(key), []).append(value)


def _class_order(item: tuple[str, int]):
    label = item[0]
    try:
        return (0, int(label), "")
    except ValueError:
        return (1, 0, label)


def _still_valid(manifest: Manifest, urls: list[str], storage_options: dict | None) -> bool:
    """A manifest made earlier for ``urls`` still describes them (same URLs, each shard of the
    recorded size: a stat, or a HEAD/metadata request for a remote one)."""
    if manifest.shard_urls() != urls or any(r.index is None for r in manifest.shards):
        return False
    for url, r in zip(urls, manifest.shards):
        try:
            if is_local(url):
                size = os.path.getsize(local_path(url))
            else:
                fs, path = filesystem(url, storage_options)
                size = fs.size(path)
        except (OSError, TarshardsError, ValueError):
            return False
        if size != r.nbytes:
            return False
    return True


def histogram(values: np.ndarray, bins: int = 30) -> dict:
    """``{"edges": [...], "counts": [...], "log": bool}``: equal-width bins, or bins equal in
    log scale when the values span more than a factor of 100 (sizes usually do)."""
    values = np.asarray(values)
    if values.size == 0:
        return {"edges": [0, 1], "counts": [0], "log": False}
    lo, hi = float(values.min()), float(values.max())
    integers = bool(np.issubdtype(values.dtype, np.integer))
    if lo == hi:
        return {
            "edges": [lo - 0.5, lo + 0.5],
            "counts": [int(values.size)],
            "log": False,
            "integers": integers,
        }
    if integers and hi - lo < bins:  # one bin per value
        counts = np.bincount((values - int(lo)).astype(np.int64), minlength=int(hi - lo) + 1)
        return {
            "edges": [lo + k - 0.5 for k in range(len(counts) + 1)],
            "counts": counts.tolist(),
            "log": False,
            "integers": True,
        }
    log = lo > 0 and hi / lo > 100
    if log:
        edges = np.geomspace(lo, hi, bins + 1)
    else:
        edges = np.linspace(lo, hi, bins + 1)
    counts, edges = np.histogram(values, edges)
    return {"edges": edges.tolist(), "counts": counts.tolist(), "log": bool(log)}


def image_size(data: bytes) -> tuple[int, int, str] | None:
    """``(width, height, mode)`` from an image's header (nothing decoded), or None."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size[0], img.size[1], img.mode
    except Exception:  # Pillow raises many kinds for data that is not an image
        return None


def thumbnail(data: bytes, size: int) -> bytes:
    """An image field as a JPEG at most ``size`` pixels wide and high (re-encoded here, so what
    reaches the browser is always a plain JPEG); ValueError when it is not a readable image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format == "JPEG":
                img.draft("RGB", (size, size))  # decode at a fraction of the size: fast
            img.thumbnail((size, size))
            if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                rgba = img.convert("RGBA")
                flat = Image.new("RGB", rgba.size, (255, 255, 255))
                flat.paste(rgba, mask=rgba.getchannel("A"))
                out_img = flat
            elif img.mode in ("I;16", "I", "F"):
                arr = np.asarray(img, dtype=np.float64)
                span = float(arr.max() - arr.min()) or 1.0
                out_img = Image.fromarray(((arr - arr.min()) * (255.0 / span)).astype(np.uint8))
            else:
                out_img = img.convert("RGB") if img.mode not in ("RGB", "L") else img
            buf = io.BytesIO()
            out_img.save(buf, "JPEG", quality=85)
            return buf.getvalue()
    except Exception as exc:  # Pillow raises many kinds for data that is not an image
        raise ValueError(f"not an image Pillow reads ({type(exc).__name__})") from None


def pretty_json(data: bytes) -> str | None:
    """A JSON field indented, or None when it is not JSON."""
    try:
        return json.dumps(json.loads(bytes(data)), indent=2, ensure_ascii=False, sort_keys=False)
    except ValueError:
        return None
