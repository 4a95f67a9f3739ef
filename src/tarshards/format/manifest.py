"""The manifest of a data set: per shard its URL, sample count, size, hash and index.

A manifest is a small JSON file (``docs/format.md``)::

    {"format": "tarshards.manifest", "version": 1, "fingerprint": "sha256:...",
     "num_samples": 2000,
     "shards": [{"url": "train-000000.tar", "samples": 1000, "nbytes": 10496000,
                 "hash": "xxh3_64:9f0c...", "index": "train-000000.tar.tsidx"}, ...]}

An optional ``"info"`` object carries what describes the data set as a whole (the class names
of a converted ImageFolder, where it came from...); it is not part of the fingerprint, and
manifests without it load as before.

URLs (shards and indexes) are relative to the manifest where possible, so a data set can be
moved or copied to a bucket as a whole. ``Manifest.load`` also reads the ``shardindex.json`` that
``wids`` writes (counts only).

Two hashes, for two questions:

- :attr:`Manifest.fingerprint`, *which samples in which shards*: :func:`data_fingerprint` over
  the shards' file names and sample counts, the data an epoch plan is a function of. A scan of
  the shards without a manifest (:func:`tarshards.plan.epoch.scan_shards`, which yields a manifest
  without hashes) gives the same value, so plans, resume states (and views, ledgers) refer to
  the data by it whether or not a manifest exists.
- :attr:`Manifest.checksum`, *are these the records that were written*: ``sha256:`` over the
  records (URL, count, size, hash). The file stores it under its historical key
  ``"fingerprint"`` and loading refuses records that do not match it; the sizes and hashes
  check the shards themselves (``verify=True``, ``tarcheck --manifest``). Resume states saved
  with a manifest by tarshards before the two were told apart carry this value: a pipeline
  given the same manifest accepts it (:attr:`tarshards.plan.epoch.ShardTable.aliases`).

Manifests are made while writing (``ShardWriter(..., manifest=PATH)``) or for existing shards by
:func:`build_manifest` (the ``tarshards index`` command).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from ..errors import IntegrityError, ShardFormatError, ShardNotFoundError, TarshardsError
from ..storage import (
    AtomicOutput,
    is_local,
    local_path,
    open_url,
    remove_stale_temporaries,
    temporary_directory,
    url_protocol,
)
from .hashing import DEFAULT_HASH, HASHING_RELEASES_GIL, MEMBER_HASH

__all__ = [
    "MANIFEST_FORMAT",
    "ColumnGroup",
    "Manifest",
    "IndexJob",
    "ManifestRecorder",
    "ShardRecord",
    "build_manifest",
    "data_fingerprint",
    "index_path_for",
    "is_manifest_spec",
    "relative_url",
    "spec_urls",
]

MANIFEST_FORMAT = "tarshards.manifest"
MANIFEST_VERSION = 1
WIDS_KIND = "wids-shard-index-v1"
INDEX_SUFFIX = ".tsidx"


@dataclass(frozen=True)
class ShardRecord:
    """One shard of a manifest. ``url`` and ``index`` are as written (relative to the
    manifest where possible); ``hash`` is ``ALGORITHM:HEX`` of the whole file; ``nbytes`` and
    ``hash`` are ``None`` only for manifests read from other tools (wids)."""

    url: str
    samples: int
    nbytes: int | None = None
    hash: str | None = None
    index: str | None = None

    def to_json(self) -> dict:
        out = {"url": self.url, "samples": self.samples, "nbytes": self.nbytes, "hash": self.hash}
        if self.index is not None:
            out["index"] = self.index
        return out


def data_fingerprint(urls: Iterable[str], counts: Iterable[int]) -> str:
    """The identity of *which samples in which shards*: sha256 (hex) over the shards' file names
    (the last part of each URL, so a data set moved elsewhere keeps it) and sample counts, in
    order. The one fingerprint of the data: :attr:`Manifest.fingerprint`,
    :attr:`tarshards.plan.epoch.ShardTable.fingerprint` (a scan without a manifest gives the same
    value) and the ``fingerprint`` of a resume state."""
    names = [os.fspath(u).rstrip("/").rsplit("/", 1)[-1] for u in urls]
    text = json.dumps([names, [int(c) for c in counts]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _checksum(shards: Sequence[ShardRecord]) -> str:
    h = hashlib.sha256()
    for r in shards:
        h.update(json.dumps([r.url, r.samples, r.nbytes, r.hash], separators=(",", ":")).encode())
        h.update(b"\n")
    return f"sha256:{h.hexdigest()}"


@dataclass(frozen=True)
class ColumnGroup:
    """A group of sidecar columns (:func:`tarshards.add_columns`): the fields it holds and its
    shards, one per shard of the base data set, aligned row by row with it (same keys, same
    order). Its records are as a manifest's (relative to the manifest that holds the group).

    ``rows``: for a group made over a view (``add_columns(view, ...)``), the view file whose
    rows the group covers (``{"view": url, "fingerprint": ...}``, the URL relative to the
    manifest): its shard ``i`` holds the view's rows of base shard ``i``, in order, and the rows
    the view leaves out have none of the group's fields."""

    name: str
    fields: tuple[str, ...]
    shards: tuple[ShardRecord, ...]
    rows: dict | None = field(default=None, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "fields", tuple(str(f) for f in self.fields))
        object.__setattr__(self, "shards", tuple(self.shards))
        if not self.name or not isinstance(self.name, str):
            raise ValueError("a column group has a name")
        if not self.fields:
            raise ValueError(f"column group {self.name!r} holds no field")

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "name": self.name,
            "fields": list(self.fields),
            "shards": [r.to_json() for r in self.shards],
        }
        if self.rows is not None:
            out["rows"] = dict(self.rows)
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "ColumnGroup":
        rows = obj.get("rows")
        return cls(
            name=obj["name"],
            fields=tuple(obj["fields"]),
            shards=tuple(_record(s) for s in obj["shards"]),
            rows=None
            if rows is None
            else {"view": rows["view"], "fingerprint": rows["fingerprint"]},
        )


def _record(s: dict) -> ShardRecord:
    return ShardRecord(
        url=s["url"],
        samples=int(s["samples"]),
        nbytes=s.get("nbytes"),
        hash=s.get("hash"),
        index=s.get("index"),
    )


def _extension_checksum(base: str, columns, base_ref, join) -> str:
    """The records' checksum of a manifest with sidecar columns or a join: the base's
    :func:`_checksum` and those parts' JSON, hashed together."""
    text = json.dumps(
        [base, [g.to_json() for g in columns], base_ref, join],
        separators=(",", ":"),
        sort_keys=True,
    )
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def _base_of(url: str) -> str:
    """The directory part of a manifest URL (with its trailing slash for remote URLs)."""
    if is_local(url):
        return os.path.dirname(os.path.abspath(local_path(url)))
    return url.rsplit("/", 1)[0] + "/" if "/" in url.partition("://")[2] else url + "/"


def _is_relative(url: str) -> bool:
    return url_protocol(url) is None and not url.startswith(("file:", "/")) and url != "-"


def resolve_url(url: str, base: str | None) -> str:
    """``url`` as an absolute path or URL, relative ones taken from ``base`` (a directory)."""
    if base is None or not _is_relative(url):
        return url
    if url_protocol(base) is None:
        return os.path.normpath(os.path.join(base, url))
    return base.rstrip("/") + "/" + posixpath.normpath(url)


def relative_url(url: str, base: str | None) -> str:
    """``url`` relative to the directory ``base`` when it lies inside it, else unchanged."""
    if base is None:
        return url
    url = os.fspath(url)
    if url_protocol(base) is None:
        if url_protocol(url) is not None or url in ("-",) or url.startswith("pipe:"):
            return url
        path = os.path.abspath(local_path(url))
        rel = os.path.relpath(path, base)
        if rel.startswith(".." + os.sep) or rel == "..":
            return path
        return rel.replace(os.sep, "/")
    prefix = base.rstrip("/") + "/"
    return url[len(prefix) :] if url.startswith(prefix) else url


def index_path_for(shard_url: str) -> str:
    """Where a shard's index goes, relative to the manifest: beside the shard when the shard
    is inside the manifest's directory, else in ``_index/`` beside the manifest."""
    if (
        _is_relative(shard_url)
        and not shard_url.startswith("../")
        and ".." not in shard_url.split("/")
    ):
        return shard_url + INDEX_SUFFIX
    digest = hashlib.sha256(shard_url.encode()).hexdigest()[:12]
    base = shard_url.split("?", 1)[0].rstrip("/").rpartition("/")[2] or "shard"
    return f"_index/{digest}-{base}{INDEX_SUFFIX}"


@dataclass(frozen=True)
class Manifest:
    """A data set's shards with their counts, sizes and hashes (see the module docstring).

    Two manifests are equal when their records and ``info`` are; ``url`` (where it was loaded
    from) and the index cache do not count. ``info`` is a JSON object describing the data set
    (``{"classes": [...]}`` for a converted ImageFolder); the fingerprint does not cover it.
    """

    shards: tuple[ShardRecord, ...]
    info: dict = field(default_factory=dict)
    url: str | None = field(default=None, compare=False)
    storage_options: dict | None = field(default=None, compare=False, repr=False)
    _indexes: dict = field(default_factory=dict, compare=False, repr=False)
    #: sidecar column groups (:func:`tarshards.add_columns`), aligned row by row with shards
    columns: tuple[ColumnGroup, ...] = ()
    #: the manifest this one was derived from: {"manifest": URL relative to this one, "checksum"}
    base_ref: dict | None = None
    #: a join (:func:`tarshards.join`): its right side and the file of per-row pointers
    join: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "columns", tuple(self.columns))
        for g in self.columns:
            if not isinstance(g, ColumnGroup):
                raise TypeError(f"a manifest's columns are ColumnGroups, not {type(g).__name__}")
            if len(g.shards) != len(self.shards) or (
                g.rows is None and [r.samples for r in g.shards] != [r.samples for r in self.shards]
            ):  # (a group made over a view holds the view's rows: its view checks them)
                raise ValueError(
                    f"column group {g.name!r} is not aligned with the shards (its sample "
                    "counts differ)"
                )
        for r in self.shards:
            if not isinstance(r, ShardRecord):
                raise TypeError(f"a manifest holds ShardRecords, not {type(r).__name__}")
            if r.samples < 0:
                raise ValueError(f"negative sample count for {r.url}")
        if not isinstance(self.info, dict):
            raise TypeError(f"a manifest's info is a dict, not {type(self.info).__name__}")

    # ---- values ------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """The data's identity: :func:`data_fingerprint` of the shards' names and sample counts
        (the same as a scan of the shards gives; sizes and hashes do not count)."""
        fp = self.__dict__.get("_fp")
        if fp is None:
            fp = data_fingerprint((r.url for r in self.shards), (r.samples for r in self.shards))
            if self.columns or self.join:  # what is read with the shards counts too
                fp = _extended_fingerprint(fp, self.columns, self.join)
            object.__setattr__(self, "_fp", fp)
        return fp

    @property
    def checksum(self) -> str:
        """``sha256:HEX`` over the records (URL as written, count, size, hash): the integrity
        check the file stores under ``"fingerprint"`` (and what this property was called before
        :attr:`fingerprint` became the data's identity)."""
        sum_ = self.__dict__.get("_checksum")
        if sum_ is None:
            sum_ = _checksum(self.shards)
            if self.columns or self.base_ref or self.join:
                sum_ = _extension_checksum(sum_, self.columns, self.base_ref, self.join)
            object.__setattr__(self, "_checksum", sum_)
        return sum_

    @classmethod
    def from_counts(cls, urls: Sequence[str], counts: Sequence[int]) -> "Manifest":
        """A manifest without sizes, hashes or indexes: what a scan of the shards knows."""
        urls = [os.fspath(u) for u in urls]
        counts = [int(c) for c in counts]
        if len(urls) != len(counts):
            raise ValueError("one count per shard")
        return cls(tuple(ShardRecord(u, c) for u, c in zip(urls, counts)))

    @property
    def num_samples(self) -> int:
        if self.join:  # the join's rows (an inner join keeps the left rows that matched)
            return sum(int(c) for c in self.join["counts"])
        return sum(r.samples for r in self.shards)

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def base(self) -> str | None:
        """The directory relative URLs are taken from (None for a manifest not yet saved)."""
        return None if self.url is None else _base_of(self.url)

    def shard_urls(self) -> list[str]:
        """The shards' absolute URLs (relative ones resolved against the manifest's place)."""
        base = self.base
        return [resolve_url(r.url, base) for r in self.shards]

    def index_url(self, i: int) -> str | None:
        r = self.shards[i]
        return None if r.index is None else resolve_url(r.index, self.base)

    def counts(self) -> dict[str, int]:
        """Absolute shard URL -> sample count."""
        return dict(zip(self.shard_urls(), (r.samples for r in self.shards)))

    def records_by_url(self) -> dict[str, ShardRecord]:
        """Absolute shard URL -> record."""
        return dict(zip(self.shard_urls(), self.shards))

    def load_index(self, i: int):
        """The :class:`~tarshards.format.index.ShardIndex` of shard ``i`` (loaded once, then
        kept)."""
        from .index import ShardIndex

        idx = self._indexes.get(i)
        if idx is None:
            url = self.index_url(i)
            if url is None:
                raise ShardFormatError(
                    "the manifest has no index for this shard (make one "
                    "with: tarshards index SPEC -o MANIFEST)",
                    url=self.shard_urls()[i],
                )
            idx = ShardIndex.load(url, storage_options=self.storage_options)
            self._indexes[i] = idx
        return idx

    # ---- per-sample metadata ---------------------------------------------------------------
    def meta_columns(self) -> list[str]:
        """The names of the per-sample metadata columns stored with the shards' indexes
        (``tokens``, ``jpg.width``, ``mp4.duration``...; every index is loaded)."""
        names: dict[str, None] = {}
        for i, r in enumerate(self.shards):
            if r.index is not None:
                names.update(dict.fromkeys(self.load_index(i).meta))
        return sorted(names)

    def meta(self, name: str):
        """Per-sample metadata column ``name`` as one float64 numpy array in manifest order
        (shard by shard, in tar order), read from the shards' indexes without reading any
        data; NaN for the samples of a shard whose index lacks it. ``KeyError`` when no shard
        has it. Columns are recorded by ``ShardWriter(..., meta=...)`` and
        ``tarshards index --media``."""
        import numpy as np

        parts = []
        found = False
        for i, r in enumerate(self.shards):
            got = self.load_index(i).meta.get(name) if r.index is not None else None
            if got is None:
                parts.append(np.full(r.samples, np.nan))
            else:
                found = True
                parts.append(got)
        if not found:
            raise KeyError(
                f"no metadata column {name!r} in this manifest's indexes (record one with "
                "ShardWriter(..., meta=...) or tarshards index --media)"
            )
        return np.concatenate(parts) if parts else np.zeros(0)

    # ---- files -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "fingerprint": self.checksum,  # the records' checksum (its historical key)
            "num_samples": self.num_samples,
            "shards": [r.to_json() for r in self.shards],
        }
        if self.info:
            out["info"] = self.info
        if self.base_ref:
            out["base"] = self.base_ref
        if self.columns:
            out["columns"] = [g.to_json() for g in self.columns]
        if self.join:
            out["join"] = self.join
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    def save(self, path, *, storage_options: dict | None = None) -> "Manifest":
        """Write the manifest to ``path`` (path or URL), atomically; returns it as loaded from
        there. URLs are written as they are in the records (see :meth:`relocated`)."""
        path = os.fspath(path)
        with AtomicOutput(path, storage_options=storage_options) as out:
            out.stream.write(self.dumps().encode("utf-8"))
        return replace(self, url=path, storage_options=storage_options, _indexes={})

    @classmethod
    def from_json(
        cls, obj: dict, url: str | None = None, storage_options: dict | None = None
    ) -> "Manifest":
        if not isinstance(obj, dict):
            raise ShardFormatError("a manifest is a JSON object", url=url)
        if obj.get("__kind__") == WIDS_KIND or ("shardlist" in obj and "shards" not in obj):
            return cls._from_wids(obj, url, storage_options)
        if obj.get("format") != MANIFEST_FORMAT:
            raise ShardFormatError(
                f"not a tarshards manifest (format {obj.get('format')!r})", url=url
            )
        version = obj.get("version")
        if version != MANIFEST_VERSION:
            raise ShardFormatError(
                f"manifest version {version} is not supported (this "
                f"tarshards reads version {MANIFEST_VERSION})",
                url=url,
            )
        try:
            shards = tuple(
                ShardRecord(
                    url=s["url"],
                    samples=int(s["samples"]),
                    nbytes=s.get("nbytes"),
                    hash=s.get("hash"),
                    index=s.get("index"),
                )
                for s in obj["shards"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"malformed manifest record: {exc}", url=url) from None
        info = obj.get("info") or {}
        if not isinstance(info, dict):
            raise ShardFormatError("the manifest's info is not a JSON object", url=url)
        try:
            columns = tuple(ColumnGroup.from_json(g) for g in obj.get("columns") or ())
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"malformed column group: {exc}", url=url) from None
        extra: dict = {}
        if columns:
            extra["columns"] = columns
        if obj.get("base"):
            extra["base_ref"] = dict(obj["base"])
        if obj.get("join"):
            extra["join"] = dict(obj["join"])
        try:
            m = cls(shards, info=info, url=url, storage_options=storage_options, **extra)
        except ValueError as exc:
            raise ShardFormatError(str(exc), url=url) from None
        stored = obj.get("fingerprint")
        if stored is not None and stored != m.checksum:
            raise IntegrityError(
                "the manifest's records do not match its fingerprint (edited "
                "by hand? rebuild it with tarshards index)",
                url=url,
            )
        return m

    @classmethod
    def _from_wids(cls, obj: dict, url, storage_options) -> "Manifest":
        shards = []
        for s in obj.get("shardlist", ()):
            md5 = s.get("md5sum")
            shards.append(
                ShardRecord(
                    url=s["url"],
                    samples=int(s["nsamples"]),
                    nbytes=s.get("filesize"),
                    hash=f"md5:{md5}" if md5 else None,
                )
            )
        return cls(tuple(shards), url=url, storage_options=storage_options)

    @classmethod
    def load(cls, url, storage_options: dict | None = None) -> "Manifest":
        """Read a manifest (ours, or a wids ``shardindex.json``) from a path or URL."""
        url = os.fspath(url)
        if is_local(url) and not os.path.exists(local_path(url)):
            raise ShardNotFoundError("no manifest at this path", url=url)
        with open_url(url, storage_options=storage_options) as f:
            data = f.read()
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise ShardFormatError(f"the manifest is not valid JSON: {exc}", url=url) from None
        return cls.from_json(obj, url=url, storage_options=storage_options)

    def with_sidecar_indexes(self) -> "Manifest":
        """The same records, each shard without an index given one where its index file lies
        beside it (``SHARD.tsidx``, as ``tarshards index --sidecar`` and the writers put them):
        how a wids ``shardindex.json``, which holds counts only, finds its indexes. Returns
        ``self`` when nothing was found."""
        urls = self.shard_urls()
        shards = list(self.shards)
        found = False
        for i, r in enumerate(shards):
            if r.index is not None:
                continue
            candidate = urls[i] + INDEX_SUFFIX
            if _exists(candidate, self.storage_options):
                shards[i] = replace(r, index=r.url + INDEX_SUFFIX)
                found = True
        if not found:
            return self
        return replace(self, shards=tuple(shards), _indexes={})

    def relocated(self, base: str | None) -> "Manifest":
        """The same records with URLs rewritten relative to the directory ``base``."""
        old = self.base
        shards = []
        for r in self.shards:
            url = relative_url(resolve_url(r.url, old), base)
            index = None if r.index is None else relative_url(resolve_url(r.index, old), base)
            shards.append(replace(r, url=url, index=index))
        if self.columns or self.base_ref or self.join:
            return _relocated_parts(self, old, base, tuple(shards))
        return replace(self, shards=tuple(shards), _indexes={})

    # ---- sidecar columns -------------------------------------------------------------------
    def column_fields(self) -> dict[str, str]:
        """Field -> the name of the column group that holds it (sidecar fields only)."""
        return {f: g.name for g in self.columns for f in g.fields}

    def group_manifest(self, name: str) -> "Manifest":
        """Column group ``name``'s shards as a plain manifest (their URLs resolved against
        this manifest's place, as the group's records are written relative to it)."""
        for g in self.columns:
            if g.name == name:
                return Manifest(g.shards, url=self.url, storage_options=self.storage_options)
        raise KeyError(f"no column group {name!r} (groups: {[g.name for g in self.columns]})")

    def plain(self) -> "Manifest":
        """The base shards alone: this manifest without column groups, base or join."""
        if not (self.columns or self.base_ref or self.join):
            return self
        return Manifest(
            self.shards, info=self.info, url=self.url, storage_options=self.storage_options
        )

    def every_shard(self) -> "Manifest":
        """A plain manifest of every shard this one names: the base shards, then each column
        group's, then a join's right shards (what ``tarcheck --manifest`` checks)."""
        if not self.columns and not self.join:
            return self.plain()
        shards = self.shards + tuple(r for g in self.columns for r in g.shards)
        if self.join:
            shards += tuple(_record(r) for r in self.join["right"]["shards"])
        return Manifest(shards, url=self.url, storage_options=self.storage_options)


def _extended_fingerprint(base: str, columns, join) -> str:
    """The data's identity with column groups (their names, fields, shard names and counts)
    and a join (its own identity, stored with it) over the base's."""
    parts = [
        [
            g.name,
            list(g.fields),
            data_fingerprint([r.url for r in g.shards], [r.samples for r in g.shards]),
        ]
        + ([g.rows["fingerprint"]] if g.rows is not None else [])
        for g in columns
    ]
    text = json.dumps([base, parts, (join or {}).get("identity")], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _relocated_parts(m: "Manifest", old, base, shards) -> "Manifest":
    """:meth:`Manifest.relocated` of a manifest with column groups, a base or a join."""

    def move(u):
        return None if u is None else relative_url(resolve_url(u, old), base)

    columns = tuple(
        replace(
            g,
            shards=tuple(replace(r, url=move(r.url), index=move(r.index)) for r in g.shards),
            rows=None if g.rows is None else dict(g.rows, view=move(g.rows["view"])),
        )
        for g in m.columns
    )
    base_ref = dict(m.base_ref, manifest=move(m.base_ref["manifest"])) if m.base_ref else None
    join = m.join
    if join:
        join = dict(join)
        join["pointers"] = move(join["pointers"])
        right = dict(join["right"])
        right["shards"] = [
            dict(r, url=move(r["url"]), index=move(r.get("index"))) for r in right["shards"]
        ]
        if right.get("manifest"):
            right["manifest"] = move(right["manifest"])
        join["right"] = right
    return replace(m, shards=shards, columns=columns, base_ref=base_ref, join=join, _indexes={})


def _exists(url: str, storage_options) -> bool:
    if is_local(url):
        return os.path.isfile(local_path(url))
    from ..storage import filesystem

    try:
        fs, path = filesystem(url, storage_options)
        return bool(fs.exists(path))
    except (OSError, TarshardsError):
        return False


def is_manifest_spec(spec) -> bool:
    """Whether a URL spec names a manifest (a :class:`Manifest` or a ``.json`` path/URL)."""
    if isinstance(spec, Manifest) or type(spec).__name__ == "View":
        return True
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    return (
        isinstance(spec, str)
        and "::" not in spec
        and spec.lower().endswith(".json")
        and "{" not in spec
    )


def as_manifest(spec, storage_options: dict | None = None) -> Manifest:
    """The manifest ``spec`` names: a :class:`Manifest`, its path/URL, or a view
    (:class:`tarshards.format.selection.View` or a ``*.view.json`` path), whose base manifest it
    is."""
    if isinstance(spec, Manifest):
        return spec
    base = getattr(spec, "manifest", None)
    if type(spec).__name__ == "View" and isinstance(base, Manifest):
        return base
    url = os.fspath(spec)
    if url.lower().endswith(".view.json"):  # a view file names its manifest
        with open_url(url, storage_options=storage_options) as f:
            try:
                named = json.loads(f.read())["manifest"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ShardFormatError(f"not a tarshards view: {exc}", url=url) from None
        url = resolve_url(named, _base_of(url))
    return Manifest.load(url, storage_options=storage_options)


def spec_urls(spec, *, storage_options: dict | None = None) -> list[str]:
    """The shard URLs that ``spec`` names, where a manifest (a ``.json`` path or URL, a
    :class:`Manifest`; alone or in a list) names its shards, as ``WebDataset(M)`` reads them:
    the one expansion of the command-line tools and ``map_shards``."""
    if is_manifest_spec(spec):
        return as_manifest(spec, storage_options).shard_urls()
    if isinstance(spec, (list, tuple)):
        return [u for item in spec for u in spec_urls(item, storage_options=storage_options)]
    from ..read.specs import expand_urls

    return expand_urls(spec, storage_options=storage_options)


# ---------------------------------------------------------------------------------------------
# making manifests
# ---------------------------------------------------------------------------------------------


class ManifestRecorder:
    """Collects shards and their indexes as they are written, and saves the manifest.

    ``path`` is where the manifest goes; each shard's index is saved at
    :func:`index_path_for` (relative to the manifest) when the shard is added: written behind
    (:meth:`ShardIndex.start_save`: by a C thread, without the GIL, while the caller goes on to
    its next shard) and committed under its name at the next :meth:`add`, at :meth:`flush` or
    at :meth:`save`, whichever comes first. (The save cost the writing thread 0.5 ms a
    5,000-sample index, 2 % of ShardWriter's rate on 4.5 KB samples, mostly the kernel making
    the new file's pages. A Python thread for it was measured and dropped: the GIL's hand-overs
    cost the writer more than the save.)
    """

    def __init__(self, path, *, storage_options: dict | None = None, info: dict | None = None):
        self.path = os.fspath(path)
        self.storage_options = storage_options
        self.info = dict(info or {})  # the manifest's "info" object
        self.base = _base_of(self.path)
        self.records: list[ShardRecord] = []
        self._swept: set = set()  # index directories cleared of stale temporaries
        self._pending: list = []  # the index files being written (AtomicOutputs to commit)

    def add(self, shard_url: str, index, *, save_index: bool = True) -> ShardRecord:
        rel = relative_url(shard_url, self.base)
        index_rel = index_path_for(rel)
        if save_index:
            target = resolve_url(index_rel, self.base)
            folder = temporary_directory(target)
            if folder is not None and folder not in self._swept:  # once, not once per shard
                remove_stale_temporaries(folder)
                self._swept.add(folder)
            self.flush()  # the previous shard's index: written by now, committed here
            self._pending.append(
                index.start_save(target, storage_options=self.storage_options, remove_stale=False)
            )
        record = ShardRecord(
            url=rel,
            samples=index.num_samples,
            nbytes=index.nbytes,
            hash=index.hash,
            index=index_rel,
        )
        self.records.append(record)
        return record

    def manifest(self) -> Manifest:
        return Manifest(
            tuple(self.records),
            info=self.info,
            url=self.path,
            storage_options=self.storage_options,
        )

    def flush(self) -> None:
        """Commit the index files still being written (each under its name; the error of one
        that could not be written is raised, and the others are committed first)."""
        pending, self._pending = self._pending, []
        error = None
        for out in pending:
            try:
                out.commit()
            except Exception as exc:  # the others still committed
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """The index files still being written are committed (as saved ones were before the
        error; its failure then not raised over the error that ended the block)."""
        if exc_type is None:
            self.flush()
        else:
            with contextlib.suppress(Exception):
                self.flush()
        return False

    def save(self) -> Manifest:
        self.flush()
        return self.manifest().save(self.path, storage_options=self.storage_options)


class IndexJob:
    """One shard's indexing as a job of the parallel engines (:mod:`tarshards.parallel.engines`):
    ``job(shard_url, index_url)`` reads the shard once, saves its index atomically at
    ``index_url`` (the checkpoint a rerun finds) and returns a
    :class:`~tarshards.parallel.ShardReport` whose ``info`` holds the manifest record's values
    (``samples``, ``nbytes``, ``hash``). An I/O error (not a missing shard) is raised, for the
    engine to try again; a damaged or missing shard fails with a report saying why."""

    def __init__(
        self,
        *,
        storage_options=None,
        hash=DEFAULT_HASH,
        member_hash=MEMBER_HASH,
        last_dot=False,
        opener=None,
    ):
        self.storage_options = storage_options
        self.opener = opener
        self.hash = hash
        self.member_hash = member_hash
        self.last_dot = last_dot

    def prepare(self) -> None:
        """Import what the job runs, in the process that starts the workers (the processes
        engine calls it before they fork, so that each does not import it again: measured
        ~11 ms of CPU a worker, in its first shard, beside ~8 ms a 64 MB shard)."""
        from . import index  # noqa: F401

    def index(self, url: str, target: str) -> dict:
        """Index ``url``, save the index at ``target``; the record's values (raises)."""
        from .index import index_url

        idx = index_url(
            url,
            storage_options=self.storage_options,
            hash=self.hash,
            member_hash=self.member_hash,
            last_dot=self.last_dot,
            opener=self.opener,
        )
        idx.save(target, storage_options=self.storage_options, remove_stale=False)
        return {"samples": idx.num_samples, "nbytes": idx.nbytes, "hash": idx.hash}

    def __call__(self, url: str, target: str):
        from ..on_error import describe
        from ..parallel.reports import FAILED, ShardReport

        report = ShardReport(url, target)
        t0 = time.monotonic()
        try:
            report.info = self.index(url, target)
        except FileNotFoundError as exn:  # trying again finds nothing either
            report.status, report.error = FAILED, describe(exn)
        except OSError:
            raise
        except Exception as exn:
            report.status, report.error = FAILED, describe(exn)
        else:
            report.samples_in = report.samples_out = report.info["samples"]
        report.seconds = time.monotonic() - t0
        return report


def _reusable(url: str, target: str, job: IndexJob) -> dict | None:
    """The record's values from the index already at ``target`` when it is complete, made with
    the same hashes, and the shard is as it was then (same size; a local shard not modified
    since the index was written), else None."""
    from ..storage import filesystem
    from .index import index_header

    try:
        if is_local(target):
            index_mtime = os.stat(local_path(target)).st_mtime_ns
        meta = index_header(target, storage_options=job.storage_options)
        if (
            not str(meta.get("hash") or "").startswith(job.hash + ":")
            or meta.get("member_hash") != job.member_hash
            or bool(meta.get("last_dot", False)) != bool(job.last_dot)
        ):
            return None
        if is_local(url):
            st = os.stat(local_path(url))
            # coarse file clocks: a shard written in the same tick as its index counts as newer
            if st.st_size != meta["nbytes"] or st.st_mtime_ns >= index_mtime:
                return None
        else:
            fs, path = filesystem(url, job.storage_options)
            if fs.size(path) != meta["nbytes"]:
                return None
    except (TarshardsError, OSError, ValueError, KeyError, TypeError):
        return None
    return {"samples": int(meta["samples"]), "nbytes": int(meta["nbytes"]), "hash": meta["hash"]}


def _reusable_all(pairs, job: IndexJob) -> list:
    """:func:`_reusable` of each ``(shard, index)`` pair (remote ones a few at a time)."""
    if all(is_local(u) and is_local(t) for u, t in pairs) or len(pairs) < 2:
        return [_reusable(u, t, job) for u, t in pairs]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(min(32, len(pairs)), thread_name_prefix="tarshards-resume") as ex:
        return list(ex.map(lambda p: _reusable(p[0], p[1], job), pairs))


def _index_locally(job: IndexJob, pairs, todo, workers, done: Callable) -> None:
    """The shards ``todo`` on this machine, ``workers`` at once: threads where the hashing runs
    without the GIL, else processes. ``done(i, info or exception)`` per shard (a tarshards error
    is passed on; any other is raised)."""

    def one(i):
        try:
            return job.index(*pairs[i])
        except TarshardsError as exc:
            return exc

    if workers <= 1 or len(todo) == 1:
        for i in todo:
            done(i, one(i))
        return
    import concurrent.futures as cf

    pool: cf.Executor
    if HASHING_RELEASES_GIL:  # threads: no start-up; the hashing and reads run in parallel
        pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="tarshards-index")
        futures = {pool.submit(one, i): i for i in todo}
    else:  # the xxhash package holds the GIL while hashing: processes
        import multiprocessing as mp

        pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
        futures = {pool.submit(_index_in_process, job, *pairs[i]): i for i in todo}
    with pool:
        for fut in cf.as_completed(futures):
            done(futures[fut], fut.result())


def _index_in_process(job: IndexJob, url: str, target: str):
    try:
        return job.index(url, target)
    except TarshardsError as exc:
        return exc


def build_manifest(
    urls: Iterable[str],
    output,
    *,
    storage_options: dict | None = None,
    hash: str = DEFAULT_HASH,
    member_hash: str = MEMBER_HASH,
    last_dot: bool = False,
    workers: int | None = None,
    progress: bool = False,
    on_error: str = "raise",
    report: Callable | None = None,
    engine=None,
    address: str | None = None,
    client=None,
    retries: int = 2,
    append: bool = False,
    overwrite: bool = False,
    opener: Callable | None = None,
) -> Manifest:
    """Index existing shards (one sequential read each) and write the manifest to ``output``
    with the indexes beside it; returns the manifest.

    Each shard's index is saved (atomically) as soon as it is made, and the manifest is put
    together at the end. Those files are the checkpoint: a rerun reuses every index that is
    complete, made with the same hashes, and not older than its shard (same size; a local shard
    not modified since), and reads only the other shards (``overwrite=True`` reads them all).

    Where the shards are read: by default on this machine, ``workers`` at once (threads where
    the hashing runs without the GIL (:data:`tarshards.format.hashing.HASHING_RELEASES_GIL`, the
    ``_xxh3`` module built), by default one per CPU; else one at a time, as spawning processes
    costs more than 1 GB of shards takes). ``engine`` runs one task per shard on an engine of
    :func:`~tarshards.parallel.map_shards`: ``"processes"`` (``workers`` local processes),
    ``"dask"`` (``client=``, the scheduler at ``address``, or a ``LocalCluster`` of ``workers``
    processes) or ``"ray"`` (the Ray cluster at ``address``, the one this process is connected
    to, or a local one of ``workers`` CPUs); a task whose worker dies, or that hits an I/O
    error, is tried again up to ``retries`` times. The workers write the index files, so these
    must lie where the workers can write (a shared file system, a bucket).

    ``append=True`` adds the shards of ``urls`` that ``output`` does not list yet to the
    manifest there, after its records, which are kept as they are (their shards and indexes
    are not read); without a manifest at ``output`` it is a plain build. The result is the
    manifest a full build of the old shards and the new ones would write, and its
    ``fingerprint`` changes with the records.

    ``on_error="skip"`` leaves unreadable shards out (each one passed to ``report(url, error)``)
    instead of raising. ``opener(url)`` opens a shard for reading where ``open_url`` should not
    (it must pickle, for the engines).
    """
    urls = [os.fspath(u) for u in urls]
    if not urls:
        raise ValueError("no shards to index")
    if on_error not in ("raise", "skip"):
        raise ValueError("on_error is 'raise' or 'skip'")
    output = os.fspath(output)
    base = _base_of(output)
    kept: tuple[ShardRecord, ...] = ()
    if append and _exists_or_raise(output, storage_options):
        old = Manifest.load(output, storage_options=storage_options)
        have = set(old.shard_urls())
        kept = old.shards
        urls = [u for u in urls if resolve_url(relative_url(u, base), base) not in have]
        if not urls:
            return old
    job = IndexJob(
        storage_options=storage_options,
        hash=hash,
        member_hash=member_hash,
        last_dot=last_dot,
        opener=opener,
    )
    rels = [relative_url(u, base) for u in urls]
    index_rels = [index_path_for(r) for r in rels]
    pairs = [(u, resolve_url(ir, base)) for u, ir in zip(urls, index_rels)]
    results: list = [None] * len(urls)  # the record's values, or why the shard failed
    if not overwrite:
        results = _reusable_all(pairs, job)
    todo = [i for i, r in enumerate(results) if r is None]
    folders = {temporary_directory(pairs[i][1]) for i in todo}
    for folder in sorted(f for f in folders if f is not None):
        os.makedirs(folder, exist_ok=True)
        remove_stale_temporaries(folder)  # what killed attempts left
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(urls), initial=len(urls) - len(todo), unit="shard", desc="indexing")

    def done(i, result):
        results[i] = result
        if bar is not None:
            bar.update(1)

    try:
        if todo and engine is None:
            if workers is None:  # threads start at no cost; processes each import tarshards
                workers = min(len(todo), os.cpu_count() or 1) if HASHING_RELEASES_GIL else 1
            _index_locally(job, pairs, todo, workers, done)
        elif todo:
            from ..parallel.engines import make_engine

            runner = make_engine(
                engine, workers=workers, address=address, client=client, retries=retries
            )
            runner.run(job, pairs, todo, lambda i, rep: done(i, _report_result(rep)))
    finally:
        if bar is not None:
            bar.close()
    records = list(kept)
    for url, rel, index_rel, res in zip(urls, rels, index_rels, results):
        if isinstance(res, BaseException):
            if on_error == "raise":
                raise res
            if report is not None:
                report(url, res)
            continue
        records.append(ShardRecord(rel, res["samples"], res["nbytes"], res["hash"], index_rel))
    manifest = Manifest(tuple(records), url=output, storage_options=storage_options)
    return manifest.save(output, storage_options=storage_options)


def _report_result(rep):
    """An engine's report as :func:`build_manifest` keeps it: the values, or an error."""
    if rep.info is not None and rep.status == "done":
        return rep.info
    return TarshardsError(f"indexing failed: {rep.error}", url=rep.input)


def _exists_or_raise(url: str, storage_options) -> bool:
    """Whether ``url`` exists; a storage error propagates (an --append must not take a
    manifest it could not see for a missing one and write a new one over it)."""
    if is_local(url):
        return os.path.exists(local_path(url))
    from ..storage import filesystem

    fs, path = filesystem(url, storage_options)
    return fs.exists(path)
