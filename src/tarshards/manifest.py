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
moved or copied to a bucket as a whole. The fingerprint is a hash over the records (URL, count,
size, hash), the identity a saved training state checks. ``Manifest.load`` also reads the
``shardindex.json`` that ``wids`` writes (counts only).

Manifests are made while writing (``ShardWriter(..., manifest=PATH)``) or for existing shards by
:func:`build_manifest` (the ``tarshards index`` command).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from .errors import IntegrityError, ShardFormatError, ShardNotFoundError, TarshardsError
from .hashing import DEFAULT_HASH, HASHING_RELEASES_GIL, MEMBER_HASH
from .storage import (
    AtomicOutput,
    is_local,
    local_path,
    open_url,
    remove_stale_temporaries,
    temporary_directory,
    url_protocol,
)

__all__ = [
    "MANIFEST_FORMAT",
    "Manifest",
    "ManifestRecorder",
    "ShardRecord",
    "build_manifest",
    "index_path_for",
    "is_manifest_spec",
    "relative_url",
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


def _fingerprint(shards: Sequence[ShardRecord]) -> str:
    h = hashlib.sha256()
    for r in shards:
        h.update(json.dumps([r.url, r.samples, r.nbytes, r.hash], separators=(",", ":")).encode())
        h.update(b"\n")
    return f"sha256:{h.hexdigest()}"


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

    def __post_init__(self):
        object.__setattr__(self, "shards", tuple(self.shards))
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
        """``sha256:HEX`` over the records (URL as written, count, size, hash)."""
        fp = self.__dict__.get("_fp")
        if fp is None:
            fp = _fingerprint(self.shards)
            object.__setattr__(self, "_fp", fp)
        return fp

    @property
    def num_samples(self) -> int:
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
        """The :class:`~tarshards.index.ShardIndex` of shard ``i`` (loaded once, then kept)."""
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

    # ---- files -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "fingerprint": self.fingerprint,
            "num_samples": self.num_samples,
            "shards": [r.to_json() for r in self.shards],
        }
        if self.info:
            out["info"] = self.info
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
        m = cls(shards, info=info, url=url, storage_options=storage_options)
        stored = obj.get("fingerprint")
        if stored is not None and stored != m.fingerprint:
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

    def relocated(self, base: str | None) -> "Manifest":
        """The same records with URLs rewritten relative to the directory ``base``."""
        old = self.base
        shards = []
        for r in self.shards:
            url = relative_url(resolve_url(r.url, old), base)
            index = None if r.index is None else relative_url(resolve_url(r.index, old), base)
            shards.append(replace(r, url=url, index=index))
        return replace(self, shards=tuple(shards), _indexes={})


def is_manifest_spec(spec) -> bool:
    """Whether a URL spec names a manifest (a :class:`Manifest` or a ``.json`` path/URL)."""
    if isinstance(spec, Manifest):
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
    if isinstance(spec, Manifest):
        return spec
    return Manifest.load(spec, storage_options=storage_options)


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


def _index_one(args):
    url, storage_options, hash, member_hash, last_dot = args
    from .index import index_url

    return index_url(
        url, storage_options=storage_options, hash=hash, member_hash=member_hash, last_dot=last_dot
    )


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
) -> Manifest:
    """Index existing shards (one sequential read each, ``workers`` at once: threads where the
    hashing runs without the GIL (:data:`tarshards.hashing.HASHING_RELEASES_GIL`, the ``_xxh3``
    module built), else processes) and write the manifest to ``output`` with the indexes beside
    it; returns the manifest. By default one thread per CPU, or one at a time where only
    processes would run in parallel (spawning them costs more than 1 GB of shards takes).

    ``on_error="skip"`` leaves unreadable shards out (each one passed to ``report(url, error)``)
    instead of raising.
    """
    urls = list(urls)
    if not urls:
        raise ValueError("no shards to index")
    if on_error not in ("raise", "skip"):
        raise ValueError("on_error is 'raise' or 'skip'")
    recorder = ManifestRecorder(output, storage_options=storage_options)
    jobs = [(u, storage_options, hash, member_hash, last_dot) for u in urls]
    if workers is None:  # threads start at no cost; processes each import tarshards anew
        workers = min(len(urls), os.cpu_count() or 1) if HASHING_RELEASES_GIL else 1
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(urls), unit="shard", desc="indexing")
    results: list = [None] * len(urls)
    try:
        if workers <= 1 or len(urls) == 1:
            for i, job in enumerate(jobs):
                results[i] = _run_one(job)
                if bar is not None:
                    bar.update(1)
        else:
            import concurrent.futures as cf

            pool: cf.Executor
            if HASHING_RELEASES_GIL:  # threads: no start-up; the hashing and reads run in parallel
                pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="tarshards-index")
            else:  # the xxhash package holds the GIL while hashing: processes
                import multiprocessing as mp

                pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
            with pool:
                futures = {pool.submit(_run_one, job): i for i, job in enumerate(jobs)}
                for fut in cf.as_completed(futures):
                    results[futures[fut]] = fut.result()
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    with recorder:
        for url, res in zip(urls, results):
            if isinstance(res, BaseException):
                if on_error == "raise":
                    raise res
                if report is not None:
                    report(url, res)
                continue
            recorder.add(url, res)
        return recorder.save()


def _run_one(job):
    try:
        return _index_one(job)
    except TarshardsError as exc:
        return exc
