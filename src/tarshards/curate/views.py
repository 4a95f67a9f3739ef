"""Views of a data set (issue 37): filter, deduplicate and split without copying any media.

:class:`View` is the record (defined with the manifest, in :mod:`tarshards.format.selection`, so
that
every reader below the curation layer accepts it): a manifest and the rows of each shard it keeps.
The functions here make views and save them beside the data (``*.view.json``):

- :func:`view`: keep the samples a function (of the raw or decoded sample) or a set of keys
  selects, or drop a set of keys. Keys are read from the shards' indexes (no data read); a
  function runs one task a shard on the processes, Dask or Ray engine, reading only the rows of
  the source (a view of a view reads only the first view's samples).
- :func:`dedup`: keep the first (in the source's order) of each group of duplicates. ``by=
  "content"`` compares the member checksums the indexes hold (no data read): a sample's digest
  combines its members' extensions, sizes and checksums, so duplicates under other keys are
  found; ``by="<field>"`` compares one field's bytes, ``by=fn`` a function's value.
- :func:`split`: one view per named split, decided by a hash of (seed, key) alone, so that
  adding shards never moves a sample from one split to another.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Callable, Collection, Mapping

from .._lazy import LazyModule
from ..errors import ShardFormatError, TarshardsError
from ..format.hashing import hash_rows
from ..format.manifest import Manifest
from ..format.selection import VIEW_SUFFIX, View, as_record, is_view_spec, load_record
from ..parallel.engines import make_engine
from ..parallel.reports import FAILED, ShardReport
from ..plan.cursor import read_rows
from ..plan.epoch import ShardTable
from ..storage import open_url

np = LazyModule("numpy", globals(), "np")

__all__ = [
    "VIEW_SUFFIX",
    "View",
    "as_record",
    "dedup",
    "is_view_spec",
    "load_record",
    "split",
    "view",
]


# ---------------------------------------------------------------------------------------------
# the source and its rows
# ---------------------------------------------------------------------------------------------


def _as_view(source: Any, storage_options: dict | None) -> View:
    """``source`` (a manifest, a view, or the path of either) as a view (a manifest: all of
    it)."""
    record = as_record(source, storage_options)
    return record if isinstance(record, View) else View(record, url=None)


def _need_indexes(m: Manifest, what: str) -> None:
    missing = [r.url for r in m.shards if r.index is None]
    if missing:
        raise ShardFormatError(
            f"{what} reads the shards' indexes, and {len(missing)} shard(s) have none (first: "
            f"{missing[0]}): make them with  tarshards index SPEC -o MANIFEST",
            url=m.url,
        )


def _check_sizes(n: int, expected: int, url: str) -> None:
    if n != expected:
        raise ShardFormatError(
            f"the shard's index holds {n} samples, the manifest {expected}: the index is stale "
            "(tarshards index --overwrite)",
            url=url,
        )


def _finish(
    base: View,
    rows: list,
    output,
    storage_options: dict | None,
    info: dict,
) -> View:
    """The view of ``base`` keeping ``rows`` (per shard, positions among its rows), saved to
    ``output`` where given."""
    out = View.of(base, rows, info=info)
    if output is None:
        return out
    return out.save(os.fspath(output), storage_options=storage_options)


# ---------------------------------------------------------------------------------------------
# one task a shard on the engines
# ---------------------------------------------------------------------------------------------


class _ShardTask:
    """``task(i, "")``: read the rows ``view`` keeps of shard ``i`` and return, in the report's
    ``info``, what ``what`` asks: ``"keep"`` (a bit per row: ``fn(sample)`` is true) or
    ``"digest"`` (16 bytes per row: a digest of a field's bytes or of ``fn(sample)``). Picklable:
    it runs in worker processes, Dask or Ray."""

    def __init__(
        self,
        view: View,
        what: str,
        fn: Callable | None,
        field: str | None,
        decode: Any,
        storage_options: dict | None,
    ):
        # the indexes this process loaded stay here (a worker loads the one of its shard)
        self.view = View(replace(view.manifest, _indexes={}), view.rows)
        self.what = what
        self.fn = fn
        self.field = field
        self.decode = decode
        self.storage_options = storage_options

    def _open(self, url):
        return open_url(url, storage_options=self.storage_options)

    def _open_range(self, url, offset, length):
        return open_url(url, offset=offset, length=length, storage_options=self.storage_options)

    def samples(self, i: int):
        m = self.view.manifest
        lists: Any
        if m.columns or m.join:  # the merged samples (base and columns, both sides of a join)
            lists = self._merged(i)
        else:
            table = ShardTable.from_view(self.view)
            lists = read_rows(
                table,
                i,
                range(table.counts[i]),
                opener=self._open,
                range_opener=self._open_range,
                last_dot=False,
            )
        if self.decode is None or self.decode is False:
            for got in lists:
                yield from got
            return
        from ..pipeline.stages import decode

        decoder = "rgb" if self.decode is True else self.decode  # True: WebDataset's default
        modes = decoder if isinstance(decoder, (list, tuple)) else [decoder]
        for got in lists:
            yield from decode(iter(got), *modes)

    def _merged(self, i: int):
        from ..read.sidecar import layout_for

        layout = layout_for(self.view.manifest, storage_options=self.storage_options)
        if layout is None:  # (not for a manifest with columns or a join)
            raise RuntimeError("no layout")
        try:
            yield list(layout.iter_rows(i, self.view.shard_rows(i)))
        finally:
            layout.close()

    def __call__(self, inp: str, out: str) -> ShardReport:
        t0 = time.monotonic()
        i = int(inp)
        n = self.view.selected_counts[i]
        if self.what == "keep":
            fn = self.fn
            if fn is None:
                raise TypeError("keep= is a function here")
            mask = np.zeros(n, dtype=bool)
            for k, sample in enumerate(self.samples(i)):
                mask[k] = bool(fn(sample))
            info = {"keep": np.packbits(mask).tobytes()}
            kept = int(mask.sum())
        else:
            digests = np.zeros((n, 2), dtype=np.uint64)
            for k, sample in enumerate(self.samples(i)):
                digests[k] = _value_digest(self._value(sample), i, k)
            info = {"digest": digests.tobytes()}
            kept = n
        return ShardReport(
            inp,
            out,
            samples_in=n,
            samples_out=kept,
            seconds=time.monotonic() - t0,
            info=info,
        )

    def _value(self, sample: dict):
        if self.field is not None:
            return sample.get(self.field.lower())
        if self.fn is None:
            raise TypeError("by= is a field or a function")
        return self.fn(sample)


_MISSING = 0x9E3779B97F4A7C15  # digests of samples without a value: unique by place


def _value_digest(value, shard: int, row: int) -> tuple[int, int]:
    """Two 64-bit halves of the xxh3_128 of a value's bytes (``None``: a digest no other
    sample has)."""
    import xxhash

    if value is None:
        return (_MISSING, (shard << 40) | row)
    if isinstance(value, memoryview):
        value = value.tobytes()
    if isinstance(value, str):
        value = value.encode("utf-8")
    elif not isinstance(value, (bytes, bytearray)):
        value = repr(value).encode("utf-8")
    d = xxhash.xxh3_128_intdigest(value)
    return (d >> 64, d & 0xFFFFFFFFFFFFFFFF)


def _run_tasks(
    task: _ShardTask,
    shards: list[int],
    *,
    engine,
    workers,
    address,
    client,
    retries,
) -> dict[int, ShardReport]:
    """Run ``task`` for each shard of ``shards`` on the engine; raise naming the first
    failure."""
    if not shards:
        return {}
    runner = make_engine(engine, workers=workers, address=address, client=client, retries=retries)
    pairs = [(str(i), "") for i in shards]
    reports: dict[int, ShardReport] = {}

    def finished(k: int, report: ShardReport) -> None:
        reports[shards[k]] = report

    runner.run(task, pairs, list(range(len(shards))), finished)
    failed = [(i, r) for i, r in sorted(reports.items()) if r.status == FAILED]
    if failed:
        i, r = failed[0]
        raise TarshardsError(
            f"{len(failed)} of {len(shards)} shards failed; first: {r.error}",
            url=task.view.manifest.shard_urls()[i],
        )
    if len(reports) != len(shards):
        raise RuntimeError(f"the engine reported {len(reports)} of {len(shards)} shards")
    return reports


# ---------------------------------------------------------------------------------------------
# view: filter
# ---------------------------------------------------------------------------------------------


def _keys_of(view: View, i: int) -> list[str]:
    idx = view.manifest.load_index(i)
    keys = idx.keys
    _check_sizes(len(keys), view.manifest.shards[i].samples, view.manifest.shard_urls()[i])
    rows = _base_rows(view.manifest, i, view.rows[i])
    return keys if rows is None else [keys[r] for r in rows.tolist()]


def _base_rows(m: Manifest, i: int, rows):
    """The rows of base (left) shard ``i`` of ``m`` that its logical rows ``rows`` (None: all)
    are: themselves, except in a join, whose rows are the left rows its pointers name."""
    if not m.join:
        return rows
    from ..format.manifest import resolve_url
    from ..read.sidecar import load_pointers

    counts = np.asarray([int(c) for c in m.join["counts"]], dtype=np.int64)
    start = int(counts[:i].sum())
    ptr = load_pointers(resolve_url(m.join["pointers"], m.base), m.storage_options)
    left = np.asarray(ptr[start : start + int(counts[i]), 0], dtype=np.int64)
    return left if rows is None else left[rows]


def _digests(m: Manifest, i: int):
    """The content digest of each logical row of shard ``i`` of ``m``: its base's (a join's
    left side's), combined with those of its column groups' rows."""
    d = content_digests(m, i)
    left = _base_rows(m, i, None)
    if left is not None:
        d = d[left]
    for g in m.columns:
        extra = content_digests(m.group_manifest(g.name), i)
        with np.errstate(over="ignore"):
            d = np.stack([_mix(d[:, 0] ^ extra[:, 0]), _mix(d[:, 1] + extra[:, 1])], axis=1)
    return d


def _key_set(keys, name: str) -> frozenset:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Collection):
        raise TypeError(
            f"{name} is a collection of keys (a set, a list), not {type(keys).__name__}"
        )
    return frozenset(str(k) for k in keys)


def view(
    source: Any,
    keep: Callable | Collection[str] | None = None,
    *,
    exclude: Collection[str] | None = None,
    output: str | os.PathLike | None,
    decode: Any = None,
    engine: Any = "processes",
    workers: int | None = None,
    address: str | None = None,
    client: Any = None,
    retries: int = 2,
    storage_options: dict | None = None,
) -> View:
    """The view of ``source``'s samples that ``keep`` selects, less those named in
    ``exclude``; written to ``output`` (a ``*.view.json`` path, beside the manifest being the
    usual place; ``None``: not saved).

    ``source``: a manifest or a view (or the path of either: a view of a view keeps rows of its
    rows). ``keep``: a function of the sample (raw: ``{"__key__", "__url__", ext: bytes}``;
    with ``decode=`` (a ``WebDataset(decoder=)`` value: ``"pil"``, ``"rgb8"``, a function...;
    ``True``: ``"rgb"``), the decoded sample) returning true to keep it; or a collection of keys
    to keep; ``None``: every sample. ``exclude``: a collection of keys to drop. Keys come from
    the shards' indexes (no data is read); a function runs one task a shard on ``engine``
    (``"processes"``, ``"dask"``, ``"ray"``; ``workers``/``address``/``client`` as
    :func:`tarshards.parallel.map_shards`), reading only the source's rows. The view's
    ``info`` records how many samples were kept and removed.
    """
    base = _as_view(source, storage_options)
    m = base.manifest
    fn = None
    keys_in: frozenset | None = None
    if callable(keep):
        fn = keep
    elif keep is not None:
        keys_in = _key_set(keep, "keep")
    keys_out = _key_set(exclude, "exclude") if exclude is not None else None
    if (keys_in is not None or keys_out is not None) and not all(
        r.index is not None for r in m.shards
    ):
        _need_indexes(m, "selecting by key")
    n_shards = len(m.shards)
    rows: list = []
    for i in range(n_shards):
        if keys_in is None and keys_out is None:
            rows.append(None)
            continue
        keys = _keys_of(base, i)
        mask = np.ones(len(keys), dtype=bool)
        if keys_in is not None:
            mask &= np.fromiter((k in keys_in for k in keys), bool, len(keys))
        if keys_out is not None:
            mask &= np.fromiter((k not in keys_out for k in keys), bool, len(keys))
        rows.append(mask)
    if fn is not None:
        task = _ShardTask(base, "keep", fn, None, decode, storage_options)
        todo = [i for i in range(n_shards) if base.selected_counts[i]]
        if keys_in is not None or keys_out is not None:  # only shards with rows left
            todo = [i for i in todo if rows[i] is None or rows[i].any()]
        reports = _run_tasks(
            task,
            todo,
            engine=engine,
            workers=workers,
            address=address,
            client=client,
            retries=retries,
        )
        for i in range(n_shards):
            n = base.selected_counts[i]
            if i in reports:
                got = np.unpackbits(
                    np.frombuffer(reports[i].info["keep"], np.uint8),  # type: ignore[index]
                    count=n,
                ).astype(bool)
                rows[i] = got if rows[i] is None else (rows[i] & got)
            elif n:
                rows[i] = np.zeros(n, dtype=bool)
    kept = sum(base.selected_counts[i] if r is None else int(np.sum(r)) for i, r in enumerate(rows))
    info = {"made_by": "view", "kept": kept, "removed": len(base) - kept}
    return _finish(base, rows, output, storage_options, info)


# ---------------------------------------------------------------------------------------------
# dedup
# ---------------------------------------------------------------------------------------------

_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _mix(x):
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(_M1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_M2)
        x ^= x >> np.uint64(31)
    return x


def content_digests(manifest: Manifest, i: int):
    """The content digest of each sample of shard ``i`` (an ``(n, 2)`` uint64 array) from its
    index alone: over its members' extensions (lower-cased), sizes and checksums, whatever
    the sample's key (so a sample stored again under another key has the same digest)."""
    import xxhash

    idx = manifest.load_index(i)
    n = idx.num_samples
    _check_sizes(n, manifest.shards[i].samples, manifest.shard_urls()[i])
    if n == 0:
        return np.zeros((0, 2), np.uint64)
    ext_h = np.array(
        [xxhash.xxh3_64_intdigest(e.lower().encode("utf-8")) for e in idx.extensions] or [0],
        dtype=np.uint64,
    )
    name = np.uint64(xxhash.xxh3_64_intdigest(str(idx.member_hash).encode()))
    ext = ext_h[np.asarray(idx.member_ext, dtype=np.int64)]
    sizes = np.asarray(idx.member_sizes).astype(np.uint64)
    sums = np.asarray(idx.member_checksums, dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = _mix(sums ^ _mix(ext ^ name) ^ _mix(sizes + np.uint64(1)))
        b = _mix(a ^ _mix(ext + sizes * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(_M2))
        starts = np.asarray(idx.member_starts, dtype=np.int64)[:-1]
        d1 = np.add.reduceat(a, starts)
        d2 = np.add.reduceat(b, starts)
        count = np.diff(np.asarray(idx.member_starts, dtype=np.int64)).astype(np.uint64)
        d1 = _mix(d1 ^ count)
    return np.stack([d1, d2], axis=1)


def _first_of_each(digests):
    """The positions (sorted) of the first row of each group of equal rows of an ``(n, 2)``
    uint64 array."""
    n = len(digests)
    if n == 0:
        return np.zeros(0, np.int64)
    # sorted by the first half; where two rows share a first half but not the second (~never:
    # 64 bits of a hash), by both
    order = np.argsort(digests[:, 0])
    d = digests[order]
    if np.any((d[1:, 0] == d[:-1, 0]) & (d[1:, 1] != d[:-1, 1])):
        order = np.lexsort((digests[:, 1], digests[:, 0]))
        d = digests[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (d[1:, 0] != d[:-1, 0]) | (d[1:, 1] != d[:-1, 1])
    # each group's smallest position (the sort need not keep a group's rows in order)
    return np.sort(np.minimum.reduceat(order, np.flatnonzero(new)))


def dedup(
    source: Any,
    *,
    by: str | Callable = "content",
    output: str | os.PathLike | None,
    decode: Any = None,
    engine: Any = "processes",
    workers: int | None = None,
    address: str | None = None,
    client: Any = None,
    retries: int = 2,
    storage_options: dict | None = None,
) -> View:
    """The view of ``source`` that keeps the first (in its order: shard by shard, in tar order)
    of each group of duplicate samples; written to ``output`` (``None``: not saved). The view's
    ``info["removed"]`` says how many samples were dropped.

    ``by="content"``: samples are duplicates when their members have the same extensions, sizes
    and checksums (the checksums the shards' indexes hold: no sample data is read; the keys do
    not count). ``by="<field>"``: when that field's bytes are equal (read; a sample without the
    field is no one's duplicate). ``by=fn``: when ``fn(sample)`` (raw, or decoded with
    ``decode=``) is equal (bytes or str compared as such, other values by their ``repr``;
    ``None``: no one's duplicate). A field or function runs one task a shard on ``engine`` (see
    :func:`view`).
    """
    base = _as_view(source, storage_options)
    m = base.manifest
    n_shards = len(m.shards)
    parts: list = []
    if by == "content":
        _need_indexes(m, 'dedup(by="content")')
        hashes = {str(m.load_index(i).member_hash) for i in range(n_shards)}
        if len(hashes) > 1:
            raise ValueError(
                f"the shards' indexes hold member checksums of different kinds "
                f"({', '.join(sorted(hashes))}): index them again with one (tarshards index "
                "--overwrite) to compare their contents"
            )
        for i in range(n_shards):
            d = _digests(m, i)
            rows = base.rows[i]
            parts.append(d if rows is None else d[rows])
    elif isinstance(by, str) or callable(by):
        field = by if isinstance(by, str) else None
        fn = None if isinstance(by, str) else by
        task = _ShardTask(base, "digest", fn, field, decode, storage_options)
        todo = [i for i in range(n_shards) if base.selected_counts[i]]
        reports = _run_tasks(
            task,
            todo,
            engine=engine,
            workers=workers,
            address=address,
            client=client,
            retries=retries,
        )
        for i in range(n_shards):
            if i in reports:
                raw = reports[i].info["digest"]  # type: ignore[index]
                parts.append(np.frombuffer(raw, np.uint64).reshape(-1, 2))
            else:
                parts.append(np.zeros((0, 2), np.uint64))
    else:
        raise TypeError(f'by= is "content", a field name or a function, not {by!r}')
    digests = np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64))
    first = _first_of_each(digests)
    removed = len(digests) - len(first)
    counts = np.asarray(base.selected_counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    cut = np.searchsorted(first, starts)
    rows = [first[cut[i] : cut[i + 1]] - starts[i] for i in range(n_shards)]
    info = {
        "made_by": "dedup",
        "by": by if isinstance(by, str) else getattr(by, "__name__", "function"),
        "kept": int(len(first)),
        "removed": int(removed),
    }
    return _finish(base, rows, output, storage_options, info)


# ---------------------------------------------------------------------------------------------
# split
# ---------------------------------------------------------------------------------------------


def key_fractions(manifest: Manifest, i: int, seed: int):
    """Where each sample of shard ``i`` falls in [0, 1): a hash of (``seed``, its key), from
    the shard's index (no data read)."""
    idx = manifest.load_index(i)
    _check_sizes(idx.num_samples, manifest.shards[i].samples, manifest.shard_urls()[i])
    blob = np.ascontiguousarray(idx.key_blob, dtype=np.uint8)
    offsets = np.ascontiguousarray(idx.key_offsets, dtype=np.int64)
    h = np.frombuffer(hash_rows(blob, offsets), dtype=np.uint64)
    s = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        mixed = _mix(h ^ s)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def split(
    source: Any,
    fractions: Mapping[str, float],
    *,
    output_dir: str | os.PathLike | None,
    seed: int = 0,
    storage_options: dict | None = None,
) -> dict[str, View]:
    """One view of ``source`` per named split (``{"train": 0.98, "val": 0.02}``; the fractions
    are shares, normalised to sum to 1), written to ``output_dir/<name>.view.json`` (``None``:
    not saved). A sample's split is decided by a hash of (``seed``, its key) alone (the keys in
    the shards' indexes: no data read), so the splits are disjoint and cover the source, and
    shards added later never move a sample from one split to another."""
    if not isinstance(fractions, Mapping) or not fractions:
        raise TypeError("fractions is a dict {name: share}, e.g. {'train': 0.98, 'val': 0.02}")
    names = [str(k) for k in fractions]
    shares = np.array([float(v) for v in fractions.values()], dtype=np.float64)
    if np.any(shares < 0) or not np.all(np.isfinite(shares)) or shares.sum() <= 0:
        raise ValueError(f"split shares are finite and >= 0, with a positive sum: {fractions!r}")
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"a split name names a file: {name!r}")
    bounds = np.cumsum(shares / shares.sum())
    bounds[-1] = np.inf  # float rounding: the last split takes the rest
    base = _as_view(source, storage_options)
    m = base.manifest
    _need_indexes(m, "split")
    per: list[list] = [[] for _ in names]
    for i in range(len(m.shards)):
        u = key_fractions(m, i, int(seed))
        rows = _base_rows(m, i, base.rows[i])
        if rows is not None:
            u = u[rows]
        which = np.searchsorted(bounds, u, side="right")
        for k in range(len(names)):
            per[k].append(which == k)
    out: dict[str, View] = {}
    if output_dir is not None:
        output_dir = os.fspath(output_dir)
        if "://" not in output_dir:
            os.makedirs(output_dir, exist_ok=True)
    for k, name in enumerate(names):
        info = {
            "made_by": "split",
            "split": name,
            "share": float(shares[k] / shares.sum()),
            "seed": int(seed),
        }
        target = None if output_dir is None else f"{output_dir.rstrip('/')}/{name}{VIEW_SUFFIX}"
        out[name] = _finish(base, per[k], target, storage_options, info)
    return out
