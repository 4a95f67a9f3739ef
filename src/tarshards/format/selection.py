"""Views: a selection of a data set's samples, stored as a small file beside its manifest.

A :class:`View` is a base data set (a :class:`~tarshards.format.manifest.Manifest`) and, for each
of its
shards, the sorted rows (sample numbers in the shard, in tar order) it keeps, or ``None`` for all
of them. A view of a view is resolved down to the manifest when it is made (rows of rows), so a
view always names its manifest and rows of that manifest's shards. It is accepted wherever a
manifest is: ``WebDataset(view)``, ``IndexedDataset(view)``, ``readers=V`` plans and their resume
states, ``mix``, the command line (a ``*.view.json`` path).

Over a manifest with sidecar columns or a join, a view's rows are the rows of the data set as
read (:func:`row_counts`: the shards' samples, or a join's rows per left shard), and every part
of the layout is read at them (:mod:`tarshards.read.sidecar`).

Its :attr:`View.fingerprint` is the identity of the samples it holds (the base's
:attr:`~tarshards.format.manifest.Manifest.fingerprint` and a hash of the selection; a view that
keeps everything has the base's fingerprint). Resume states saved over a view carry it.

The file (``*.view.json``)::

    {"format": "tarshards.view", "version": 1,
     "manifest": "manifest.json",          # the base, relative to the view file where it can be
     "base_fingerprint": "...", "fingerprint": "...", "num_samples": N,
     "shards": [null,                      # all of the shard's rows
                {"n": 120, "bits": "..."},  # or a bitmap of the shard's rows (zlib, base64)
                {"n": 3, "runs": "..."}],  # or runs (start, length) as uint32 deltas (zlib, b64)
     "parent": "clean.view.json",          # (optional) the view this one was made from
     "info": {...}}

Each shard's rows are stored as whichever of the two encodings is smaller: a 10M-row view of
random rows is about a bit per base row compressed, loaded with one ``numpy.unpackbits``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from .._lazy import LazyModule
from ..errors import IntegrityError, ShardFormatError, ShardNotFoundError
from ..storage import AtomicOutput, is_local, local_path, open_url
from .manifest import Manifest, relative_url, resolve_url

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")

__all__ = [
    "VIEW_FORMAT",
    "VIEW_SUFFIX",
    "View",
    "as_record",
    "is_view_spec",
    "load_record",
    "row_counts",
]

VIEW_FORMAT = "tarshards.view"
VIEW_VERSION = 1
VIEW_SUFFIX = ".view.json"


def _sorted_unique(a):
    """``a`` (int64) sorted without repeats (as it is where it is so already; a sort, not
    ``np.unique``'s hash table, which is several times slower on millions of rows)."""
    if len(a) > 1 and np.any(a[1:] <= a[:-1]):
        a = np.sort(a)
        a = a[np.concatenate([[True], a[1:] != a[:-1]])]
    return a


def _rows_array(rows, n: int, shard: int):
    """``rows`` as a sorted, unique int64 array within ``0..n-1`` (``None`` stays ``None``)."""
    if rows is None:
        return None
    a = np.asarray(rows)
    if a.dtype == bool:
        if a.shape != (n,):
            raise ValueError(f"shard {shard}: a mask of {a.shape} for {n} rows")
        a = np.flatnonzero(a)
    a = _sorted_unique(np.asarray(a, dtype=np.int64).ravel())
    if len(a) and (a[0] < 0 or a[-1] >= n):
        raise ValueError(f"shard {shard}: rows outside 0..{n - 1}")
    if len(a) == n:
        return None  # every row
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class View:
    """A selection of the samples of ``manifest`` (see the module docstring).

    ``rows``: one entry per shard of the manifest, ``None`` (all its rows) or a sorted int array
    of the rows kept. Make one from a base and selected rows with :meth:`of` (the base a manifest
    or a view: rows of a view's rows compose), or with :func:`tarshards.view`,
    :func:`tarshards.dedup`, :func:`tarshards.split`.
    """

    manifest: Manifest
    rows: tuple = ()
    url: str | None = field(default=None)
    parent: str | None = field(default=None)
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.manifest, Manifest):
            raise TypeError(f"a view's base is a Manifest, not {type(self.manifest).__name__}")
        rows = tuple(self.rows) if self.rows else (None,) * len(self.manifest.shards)
        if len(rows) != len(self.manifest.shards):
            raise ValueError(
                f"a view has one row selection per shard: {len(rows)} for "
                f"{len(self.manifest.shards)} shards"
            )
        rows = tuple(
            _rows_array(r, n, i) for i, (r, n) in enumerate(zip(rows, row_counts(self.manifest)))
        )
        object.__setattr__(self, "rows", rows)

    # ---- making ------------------------------------------------------------------------------
    @classmethod
    def of(cls, base: "Manifest | View", rows: Sequence, **kw: Any) -> "View":
        """The view of ``base`` keeping ``rows`` (per shard of the base: ``None``, a sorted int
        array of positions among the base's rows of that shard, or a bool mask over them). Over
        a view, the positions are among the rows the view keeps (rows of rows)."""
        if isinstance(base, View):
            out = []
            for i, r in enumerate(rows):
                mine = base.rows[i]
                n = base.shard_count(i)
                r = _rows_array(r, n, i)
                if r is None:
                    out.append(mine)
                elif mine is None:
                    out.append(r)
                else:
                    out.append(mine[r])
            kw.setdefault("parent", base.url)
            return cls(base.manifest, tuple(out), **kw)
        return cls(base, tuple(rows), **kw)

    @classmethod
    def from_positions(cls, base: "Manifest | View", positions) -> "View":
        """The view of ``base`` keeping the samples at ``positions`` (global sample numbers in
        the base's order: shard by shard, in tar order)."""
        counts = base.selected_counts if isinstance(base, View) else row_counts(base)
        pos = _sorted_unique(np.asarray(positions, dtype=np.int64).ravel())
        total = int(sum(counts))
        if len(pos) and (pos[0] < 0 or pos[-1] >= total):
            raise ValueError(f"positions outside 0..{total - 1}")
        starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        cut = np.searchsorted(pos, starts)
        rows = [pos[cut[i] : cut[i + 1]] - starts[i] for i in range(len(counts))]
        return cls.of(base, rows)

    # ---- values ------------------------------------------------------------------------------
    @property
    def selected_counts(self) -> tuple[int, ...]:
        """The samples kept in each shard."""
        got = self.__dict__.get("_counts")
        if got is None:
            got = tuple(
                n if r is None else len(r) for r, n in zip(self.rows, row_counts(self.manifest))
            )
            object.__setattr__(self, "_counts", got)
        return got

    def shard_count(self, i: int) -> int:
        return self.selected_counts[i]

    @property
    def num_samples(self) -> int:
        return sum(self.selected_counts)

    def __len__(self) -> int:
        """The number of samples the view holds."""
        return self.num_samples

    @property
    def removed(self) -> int | None:
        """How many samples of its source the function that made the view dropped
        (``info["removed"]``: :func:`tarshards.view`, :func:`tarshards.dedup`), or None."""
        got = self.info.get("removed")
        return None if got is None else int(got)

    @property
    def base_fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def is_everything(self) -> bool:
        return all(r is None for r in self.rows)

    @property
    def fingerprint(self) -> str:
        """The identity of the samples the view holds: the base's fingerprint when it keeps
        every row, else sha256 over the base's fingerprint and the rows kept."""
        fp = self.__dict__.get("_fp")
        if fp is None:
            if self.is_everything:
                fp = self.manifest.fingerprint
            else:
                h = hashlib.sha256(b"tarshards.view/1\0" + self.manifest.fingerprint.encode())
                for i, r in enumerate(self.rows):
                    if r is None:
                        h.update(b"%d:*;" % i)
                    else:
                        h.update(b"%d:%d:" % (i, len(r)))
                        h.update(np.ascontiguousarray(r, dtype="<i8").tobytes())
                fp = h.hexdigest()
            object.__setattr__(self, "_fp", fp)
        return fp

    @property
    def checksum(self) -> str:
        """``sha256:`` over the base's checksum and the view's fingerprint (the view file's
        integrity check)."""
        text = f"{self.manifest.checksum}/{self.fingerprint}".encode()
        return "sha256:" + hashlib.sha256(text).hexdigest()

    def shard_urls(self) -> list[str]:
        """The base's shard URLs (all of them: a shard may keep no row)."""
        return self.manifest.shard_urls()

    def counts(self) -> dict[str, int]:
        """Absolute shard URL -> samples kept."""
        return dict(zip(self.manifest.shard_urls(), self.selected_counts))

    def shard_rows(self, i: int):
        """The rows of shard ``i`` kept (an int64 array; all of them where the view keeps
        every row)."""
        r = self.rows[i]
        return np.arange(row_counts(self.manifest)[i], dtype=np.int64) if r is None else r

    def global_rows(self):
        """The samples kept as global sample numbers of the base (shard by shard)."""
        parts, start = [], 0
        for i, n in enumerate(row_counts(self.manifest)):
            parts.append(self.shard_rows(i) + start)
            start += n
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def meta_columns(self) -> list[str]:
        """The per-sample metadata columns of the base's indexes (see
        :meth:`~tarshards.format.manifest.Manifest.meta_columns`)."""
        return self.manifest.meta_columns()

    def meta(self, name: str):
        """Per-sample metadata column ``name`` for the view's samples, in its order (the base's
        :meth:`~tarshards.format.manifest.Manifest.meta` at the rows kept)."""
        column = self.manifest.meta(name)
        return column if self.is_everything else column[self.global_rows()]

    def load_index(self, i: int):
        """The index of shard ``i`` of the base (all its rows)."""
        return self.manifest.load_index(i)

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard, row in the shard)`` of the view's sample ``i``."""
        n = self.num_samples
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range (the view has {n} samples)")
        starts = np.cumsum(self.selected_counts)
        shard = int(np.searchsorted(starts, i, side="right"))
        j = i - (int(starts[shard - 1]) if shard else 0)
        r = self.rows[shard]
        return shard, j if r is None else int(r[j])

    def take(self, positions) -> "View":
        """The view of this view keeping its samples at ``positions`` (rows of rows)."""
        return View.from_positions(self, positions)

    def fraction(self, lo: float, hi: float) -> "View":
        """The samples from fraction ``lo`` to ``hi`` of this view (in its order: ``0.0, 0.8``
        is the first 80%)."""
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"a fraction range is 0 <= lo <= hi <= 1, got {lo}, {hi}")
        n = self.num_samples
        return self.take(np.arange(round(lo * n), round(hi * n)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, View):
            return NotImplemented
        return self.manifest == other.manifest and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return (
            f"View({self.num_samples} of {self.manifest.num_samples} samples in "
            f"{len(self.manifest.shards)} shards, url={self.url!r})"
        )

    # ---- files -------------------------------------------------------------------------------
    def to_json(self, path: str | None = None) -> dict:
        """The view file's object; ``path``: where it goes (the manifest is named relative to
        it where it can be)."""
        murl = self.manifest.url
        if murl is None:
            raise ValueError(
                "the view's manifest was not loaded from a file: save it first "
                "(manifest.save(path)) so that the view can name it"
            )
        base = _base_dir(path)
        out: dict[str, Any] = {
            "format": VIEW_FORMAT,
            "version": VIEW_VERSION,
            "manifest": relative_url(murl, base),
            "base_fingerprint": self.manifest.fingerprint,
            "base_checksum": self.manifest.checksum,
            "fingerprint": self.fingerprint,
            "num_samples": self.num_samples,
            "base_samples": self.manifest.num_samples,
            "shards": [_encode_rows(r, n) for r, n in zip(self.rows, row_counts(self.manifest))],
        }
        if self.parent is not None:
            out["parent"] = relative_url(self.parent, base)
        if self.info:
            out["info"] = self.info
        return out

    def save(self, path, *, storage_options: dict | None = None) -> "View":
        """Write the view file to ``path`` atomically; returns the view as loaded from there."""
        path = os.fspath(path)
        text = json.dumps(self.to_json(path), indent=1) + "\n"
        with AtomicOutput(path, storage_options=storage_options) as out:
            out.stream.write(text.encode("utf-8"))
        return replace(self, url=path)

    @classmethod
    def from_json(
        cls, obj: dict, url: str | None = None, storage_options: dict | None = None
    ) -> "View":
        if not isinstance(obj, dict) or obj.get("format") != VIEW_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ShardFormatError(f"not a tarshards view (format {got!r})", url=url)
        if obj.get("version") != VIEW_VERSION:
            raise ShardFormatError(
                f"view version {obj.get('version')} is not supported (this tarshards reads "
                f"version {VIEW_VERSION})",
                url=url,
            )
        base = _base_dir(url)
        murl = resolve_url(obj["manifest"], base)
        manifest = Manifest.load(murl, storage_options=storage_options)
        if obj.get("base_fingerprint") not in (None, manifest.fingerprint):
            raise IntegrityError(
                f"the view was made over other data than the manifest {murl} now holds "
                "(its shards or counts changed): make the view again",
                url=url,
            )
        shards = obj.get("shards")
        if not isinstance(shards, list) or len(shards) != len(manifest.shards):
            raise ShardFormatError(
                f"the view lists {len(shards) if isinstance(shards, list) else 'no'} shards, "
                f"its manifest {len(manifest.shards)}",
                url=url,
            )
        try:
            rows = tuple(_decode_rows(s, n) for s, n in zip(shards, row_counts(manifest)))
        except (KeyError, TypeError, ValueError, zlib.error) as exn:
            raise ShardFormatError(f"malformed view rows: {exn}", url=url) from None
        parent = obj.get("parent")
        view = cls(
            manifest,
            rows,
            url=url,
            parent=None if parent is None else resolve_url(parent, base),
            info=obj.get("info") or {},
        )
        if obj.get("fingerprint") not in (None, view.fingerprint):
            raise IntegrityError(
                "the view's rows do not match its fingerprint (edited by hand?)", url=url
            )
        return view

    @classmethod
    def load(cls, url, storage_options: dict | None = None) -> "View":
        """Read a view file (``*.view.json``) and its manifest."""
        obj = _read_json(os.fspath(url), storage_options, "view")
        return cls.from_json(obj, url=os.fspath(url), storage_options=storage_options)


def row_counts(manifest: Manifest) -> tuple[int, ...]:
    """The rows of each shard of ``manifest`` that a view selects among: its shards' samples,
    or for a join the join's rows per left shard (an inner join keeps the left rows that
    matched). Column groups are aligned with the shards: their rows are the shards'."""
    if manifest.join:
        return tuple(int(c) for c in manifest.join["counts"])
    return tuple(r.samples for r in manifest.shards)


def _base_dir(url: str | None) -> str | None:
    return None if url is None else Manifest((), url=url).base


def _b64(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data, 6)).decode("ascii")


def _unb64(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def _encode_rows(rows, n: int):
    if rows is None:
        return None
    if len(rows) == 0:
        return {"n": 0}
    mask = np.zeros(n, dtype=bool)
    mask[rows] = True
    bits = _b64(np.packbits(mask).tobytes())
    # runs: (start, length) pairs, starts as deltas from the previous run's end
    brk = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate([[0], brk])]
    ends = rows[np.concatenate([brk - 1, [len(rows) - 1]])] + 1
    gaps = starts - np.concatenate([[0], ends[:-1]])
    pairs = np.empty(2 * len(starts), dtype="<u4")
    pairs[0::2] = gaps
    pairs[1::2] = ends - starts
    runs = _b64(pairs.tobytes())
    if len(runs) < len(bits):
        return {"n": int(len(rows)), "runs": runs}
    return {"n": int(len(rows)), "bits": bits}


def _decode_rows(obj, n: int):
    if obj is None:
        return None
    k = int(obj["n"])
    if k == 0:
        return np.zeros(0, np.int64)
    if "bits" in obj:
        mask = np.unpackbits(np.frombuffer(_unb64(obj["bits"]), np.uint8), count=n)
        rows = np.flatnonzero(mask).astype(np.int64)
    else:
        pairs = np.frombuffer(_unb64(obj["runs"]), "<u4").astype(np.int64)
        gaps, lengths = pairs[0::2], pairs[1::2]
        starts = np.cumsum(gaps + np.concatenate([[0], lengths[:-1]]))
        total = int(lengths.sum())
        # rows: each run's start repeated, plus 0..length-1 within the run
        offs = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows = np.repeat(starts, lengths) + offs
    if len(rows) != k:
        raise ValueError(f"{len(rows)} rows decoded where {k} were stored")
    return rows


def _read_json(url: str, storage_options, what: str) -> dict:
    if is_local(url) and not os.path.exists(local_path(url)):
        raise ShardNotFoundError(f"no {what} at this path", url=url)
    with open_url(url, storage_options=storage_options) as f:
        data = f.read()
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ShardFormatError(f"the {what} is not valid JSON: {exc}", url=url) from None


def is_view_spec(spec) -> bool:
    """Whether ``spec`` is a :class:`View` or a path/URL ending in ``.view.json``."""
    if isinstance(spec, View):
        return True
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    return isinstance(spec, str) and spec.lower().endswith(VIEW_SUFFIX)


def load_record(url, storage_options: dict | None = None) -> "Manifest | View":
    """The manifest or view stored at ``url`` (told apart by the file's ``format``)."""
    url = os.fspath(url)
    obj = _read_json(url, storage_options, "manifest")
    if isinstance(obj, dict) and obj.get("format") == VIEW_FORMAT:
        return View.from_json(obj, url=url, storage_options=storage_options)
    return Manifest.from_json(obj, url=url, storage_options=storage_options)


def as_record(spec, storage_options: dict | None = None) -> "Manifest | View":
    """``spec`` (a :class:`Manifest`, a :class:`View`, or the path/URL of either) loaded."""
    if isinstance(spec, (Manifest, View)):
        return spec
    return load_record(spec, storage_options)
