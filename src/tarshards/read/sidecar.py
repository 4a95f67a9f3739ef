"""Reading sidecar column groups and joins, merged row by row with their base: the *layout* of
a manifest that holds more than its shards.

A manifest with column groups (:func:`tarshards.add_columns`) or a join (:func:`tarshards.join`),
or any manifest read with ``fields=[...]``, is read through a :class:`Layout`: a list of
*parts*, each giving some fields of every row of the data set:

- an *aligned* part has one shard per base shard and its row ``i`` is the base's row ``i`` (the
  base shards themselves, a column group, the left side of a ``how="left"`` join): it is read as
  a stream, side by side with the others, and its keys must be the base's;
- a *pointer* part is read by random access (through its shards' indexes): each row names the
  part's shard and row to read (the right side of a join, -1 where nothing matched; the left
  side of an ``how="inner"`` join, whose rows are the matched ones).

The rows of the data set (its *logical* shards and counts) are the first part's; an epoch plan
is made over them as over any shards, so resume stays plan arithmetic: :class:`MergedReaderStream`
is a :class:`~tarshards.plan.cursor.ReaderStream` whose lists are the parts' lists for the same plan
positions, merged. ``fields=`` leaves out the parts that hold none of the fields asked for: the
base shards are never opened when only sidecar fields are asked for.

Merging: the first part's sample, then each other part's fields. A column group's field replaces
a base field of the same name (a better caption); a join's right fields are renamed with its
``prefix`` and a name both sides hold is an error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Any, Iterable, Iterator, Sequence

from .._lazy import LazyModule
from ..errors import IntegrityError, ShardFormatError, TarshardsError
from ..format.manifest import Manifest, ShardRecord, resolve_url
from ..on_error import error_policy
from ..plan.cursor import ReaderStream
from ..plan.epoch import EpochPlan, ShardTable
from ..storage import is_local, local_path, open_url
from ..storage.ranges import ShardRanges, open_ranges
from ..storage.seek import sample_from_bytes
from .reading import shard_samples

np = LazyModule("numpy", globals(), "np")

__all__ = ["Layout", "MergedReaderStream", "Part", "RowReader", "layout_for", "load_pointers"]

_ROWS = 256  # rows merged at once on the plain path
_GAP = 1 << 16  # rows read in one request when the bytes between them are fewer than this
_RUN = 16 << 20  # bytes of one request at most


# ---------------------------------------------------------------------------------------------
# random access to rows of a plain manifest's shards
# ---------------------------------------------------------------------------------------------


class RowReader:
    """Samples of a plain manifest's shards by (shard, row), through their indexes: nearby rows
    are read in one request (a local ``pread`` or a ranged read), each sample parsed from its
    own bytes. Plain tar shards and sample-aligned compressed ones (``aligned=True``)."""

    def __init__(self, manifest: Manifest, *, storage_options=None, last_dot: bool = False):
        self.manifest = manifest
        self.urls = manifest.shard_urls()
        self.storage_options = storage_options or manifest.storage_options
        self.last_dot = last_dot
        self._ranges: dict[int, ShardRanges] = {}
        self._pid = os.getpid()

    def index(self, shard: int):
        return self.manifest.load_index(shard)

    def read(self, shard: int, rows: Sequence[int], *, verify: bool = False) -> list[dict]:
        """The samples at ``rows`` (any order, repeats allowed) of shard ``shard``."""
        rows = [int(r) for r in rows]
        if not rows:
            return []
        idx = self.index(shard)
        url = self.urls[shard]
        n = idx.num_samples
        bad = [r for r in rows if not 0 <= r < n]
        if bad:
            raise IntegrityError(
                f"row {bad[0]} asked of a shard whose index holds {n} samples (the pointers "
                "were made for another version of it)",
                url=url,
            )
        if not idx.seekable:
            raise ShardFormatError(
                "this shard is compressed as one stream, so its samples cannot be read alone: "
                "rewrite it plain or sample-aligned (tarsplit --aligned)",
                url=url,
            )
        starts, ends = idx.sample_offsets, idx.sample_ends
        tar_offsets = idx.tar_offsets
        compression = "none" if idx.compression == "none" else "any"
        entry = idx.entry
        if idx.compression == "gzip" and entry == "deflate":
            compression = "gzip"
        wanted = sorted(set(rows))
        got: dict[int, dict] = {}
        run: list[int] = []
        for r in wanted + [-1]:
            if run and (
                r < 0
                or int(starts[r]) - int(ends[run[-1]]) > _GAP
                or int(ends[r]) - int(starts[run[0]]) > _RUN
            ):
                lo, hi = int(starts[run[0]]), int(ends[run[-1]])
                data = self._bytes(shard, url, lo, hi)
                for q in run:
                    a, b = int(starts[q]) - lo, int(ends[q]) - lo
                    try:
                        sample = sample_from_bytes(
                            data[a:b],
                            int(tar_offsets[q]),
                            compression=compression,
                            url=url,
                            last_dot=self.last_dot,
                            offset=int(starts[q]),
                            entry=entry,
                        )
                    except TarshardsError as exn:
                        raise exn.with_context(url=url, offset=int(starts[q])) from None
                    if sample["__key__"] != idx.keys[q]:
                        raise IntegrityError(
                            f"row {q} of the shard is {sample['__key__']!r}, its index says "
                            f"{idx.keys[q]!r} (is the index for another version of it?)",
                            url=url,
                            offset=int(starts[q]),
                        )
                    sample["__offset__"] = int(tar_offsets[q])
                    if verify:
                        check_members(sample, idx, q, url)
                    got[q] = sample
                run = []
            if r >= 0:
                run.append(r)
        out = []
        seen: set[int] = set()
        for r in rows:
            out.append(got[r] if r not in seen else dict(got[r]))
            seen.add(r)
        return out

    def _bytes(self, shard: int, url: str, lo: int, hi: int) -> bytes:
        if os.getpid() != self._pid:  # forked into a worker: descriptors of its own
            self._ranges, self._pid = {}, os.getpid()
        r = self._ranges.get(shard)
        if r is None:
            r = self._ranges[shard] = open_ranges(url, self.storage_options)
        return r.read(lo, hi)

    def close(self) -> None:
        if os.getpid() == self._pid:
            for r in self._ranges.values():
                r.close()
        self._ranges = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_ranges"] = {}
        return state


def check_members(sample: dict, idx, j: int, url) -> None:
    """Each field of sample ``j`` against the member checksums of its index."""
    idx.check_sample(sample, j, url)


# ---------------------------------------------------------------------------------------------
# parts and the layout
# ---------------------------------------------------------------------------------------------


class Part:
    """One source of fields for every row (see the module docstring)."""

    def __init__(
        self,
        name: str,
        manifest: Manifest,
        *,
        keep: frozenset | None = None,
        prefix: str = "",
        shards: Any = None,
        rows: Any = None,
        starts: Any = None,
        optional: bool = False,
        on: str | None = None,
        replaces: bool = True,
        pointers: str | None = None,
        columns: tuple[int, int] = (1, 2),
        selection: Any = None,
    ):
        self.name = name
        self.manifest = manifest  # a plain manifest of the part's shards
        self.urls = manifest.shard_urls()
        self.keep = keep  # the fields kept (None: all)
        self.prefix = prefix
        # a column group made over a view (its shard i holds the view's rows of shard i)
        self.selection = selection
        self.aligned = shards is None and pointers is None and selection is None
        self._shards, self._rows, self._starts = shards, rows, starts  # pointer parts
        # or columns (shard, row) of a join's pointer file, mapped when first used (a worker
        # process maps the file again instead of receiving a copy of the arrays)
        self.pointers_url, self.columns = pointers, columns
        self.optional = optional  # pointer rows of -1 allowed (a left join's unmatched rows)
        self.on = on  # a join's right side: its key is the first part's key or this field
        self.replaces = replaces  # its fields replace earlier ones of the same name
        self.reader: RowReader | None = None

    def pointers(self, shard: int, lo: int, hi: int):
        """(part shards, part rows) of logical rows ``lo:hi`` of logical shard ``shard``."""
        return self.pointers_at(shard, np.arange(lo, hi, dtype=np.int64))

    def pointers_at(self, shard: int, rows):
        """(part shards, part rows) of logical rows ``rows`` (an int array) of logical shard
        ``shard`` (a view's rows: any of them, in any order)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.aligned:
            return np.full(len(rows), shard, np.int64), rows
        if self.selection is not None:  # the row's place among the view's rows, or -1
            sel = self.selection.shard_rows(shard)
            pos = np.searchsorted(sel, rows)
            hit = pos < len(sel)
            hit[hit] = sel[pos[hit]] == rows[hit]
            return np.where(hit, shard, -1).astype(np.int64), np.where(hit, pos, -1)
        if self._rows is None and self.pointers_url is not None:
            table = load_pointers(self.pointers_url, self.manifest.storage_options)
            a, b = self.columns
            self._shards = table[:, a] if a >= 0 else None
            self._rows = table[:, b]
        at = int(self._starts[shard]) + rows
        if self._shards is None:  # the left side of an inner join: rows of the same shard
            return np.full(len(rows), shard, np.int64), np.asarray(self._rows[at], np.int64)
        return np.asarray(self._shards[at], np.int64), np.asarray(self._rows[at], np.int64)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["reader"] = None
        if self.pointers_url is not None:  # mapped again where unpickled
            state["_shards"] = state["_rows"] = None
        return state

    def read_rows(self, shard: int, lo: int, hi: int, verify: bool = False) -> list:
        """The part's samples of logical rows ``lo:hi`` of ``shard`` by random access (None
        where a pointer is -1)."""
        return self.read_at(shard, np.arange(lo, hi, dtype=np.int64), verify)

    def read_at(self, shard: int, rows, verify: bool = False) -> list:
        """The part's samples of logical rows ``rows`` of ``shard`` by random access (None
        where a pointer is -1)."""
        shards, prow = self.pointers_at(shard, rows)
        out: list = [None] * len(prow)
        if self.reader is None:
            self.reader = RowReader(self.manifest)
        for s in np.unique(shards).tolist():
            if s < 0:
                if not self.optional:
                    raise IntegrityError(
                        f"{self.name}: logical rows of shard {shard} point nowhere"
                    )
                continue
            where = np.flatnonzero(shards == s)
            got = self.reader.read(s, prow[where].tolist(), verify=verify)
            for k, sample in zip(where.tolist(), got):
                out[k] = sample
        return out

    def close(self) -> None:
        """Close the part's open shard files and let go of its memory-mapped pointer table
        (a mapping holds a file descriptor); both come back on the next read."""
        if self.reader is not None:
            self.reader.close()
        if self.pointers_url is not None:
            self._shards = self._rows = None


class Layout:
    """How the rows of a manifest with column groups, a join or ``fields=`` are read (see the
    module docstring). :attr:`manifest` is the logical data set, a plain manifest of the first
    part's shards with the logical counts (what ``len()``, ``shard_list`` and the plan count);
    :attr:`fingerprint` its identity."""

    def __init__(
        self,
        source: Manifest,
        parts: list[Part],
        counts: Sequence[int],
        fingerprint: str,
        fields: Sequence[str] | None,
    ):
        self.source = source
        self.parts = parts
        self.counts = [int(c) for c in counts]
        self.fingerprint = fingerprint
        self.fields = None if fields is None else tuple(fields)
        first = parts[0]
        records = first.manifest.shards
        if [r.samples for r in records] != self.counts:
            records = tuple(
                ShardRecord(r.url, c, None, None, r.index) for r, c in zip(records, self.counts)
            )
        self.manifest = Manifest(
            records,
            info=dict(source.info),
            url=first.manifest.url,
            storage_options=source.storage_options,
        )
        self.urls = first.urls

    def __repr__(self) -> str:
        return f"Layout({[p.name for p in self.parts]}, {sum(self.counts)} rows)"

    # ---- the plan --------------------------------------------------------------------------
    def table(self, view=None) -> ShardTable:
        """The plan's table of the logical rows; over a :class:`~tarshards.format.selection.View` of
        the manifest (its rows select logical rows), the rows it keeps."""
        if view is None:
            return ShardTable(
                self.urls, self.counts, fingerprint=self.fingerprint, manifest=self.manifest
            )
        if view.manifest.fingerprint != self.source.fingerprint:
            raise ValueError("the view was made over another manifest than this layout's")
        return ShardTable(
            self.urls,
            self.counts,
            fingerprint=_projected(view.fingerprint, self.fields),
            manifest=self.manifest,
            rows=view.rows,
        )

    def reader_stream(self, table: ShardTable, plan: EpochPlan, reader: int, **options):
        return MergedReaderStream(self, table, plan, reader, **options)

    # ---- merging ---------------------------------------------------------------------------
    def merge(self, samples: list) -> dict:
        """One row's samples (one per part, None where a pointer part has nothing) as one."""
        first = samples[0]
        keep = self.parts[0].keep
        key = first["__key__"]
        out = {k: v for k, v in first.items() if keep is None or k in keep or k.startswith("__")}
        for part, sample in zip(self.parts[1:], samples[1:]):
            if sample is None:
                continue
            expected = key if part.on in (None, "__key__") else _as_key(first.get(part.on))
            if sample["__key__"] != expected:
                member = next((k for k in sample if not k.startswith("__")), "")
                raise ShardFormatError(
                    f"{part.name}: sample {sample['__key__']!r} where {expected!r} was expected "
                    f"(row of {key!r}): the parts are not aligned (made for another version of "
                    "the data?)",
                    url=sample.get("__url__"),
                    member=f"{sample['__key__']}.{member}" if member else None,
                    offset=sample.get("__offset__"),
                )
            for k, v in sample.items():
                if k.startswith("__") or (part.keep is not None and k not in part.keep):
                    continue
                name = part.prefix + k
                if not part.replaces and name in out:
                    raise ValueError(
                        f"field {name!r} of {key!r} is on both sides of the join: give "
                        "join(..., prefix='right.') (right fields renamed right.EXT)"
                    )
                out[name] = v
        if self.fields is not None and self.parts[0].keep is None:  # a join's projection
            wanted = set(self.fields)
            out = {k: v for k, v in out.items() if k in wanted or k.startswith("__")}
        return out

    # ---- random access ---------------------------------------------------------------------
    def read_rows(self, shard: int, rows: Sequence[int], *, verify: bool = False) -> list[dict]:
        """Logical rows ``rows`` of logical shard ``shard``, merged (random access)."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = [part.read_at(shard, rows, verify) for part in self.parts]
        return [self.merge([c[k] for c in cols]) for k in range(len(rows))]

    # ---- the plain path --------------------------------------------------------------------
    def iter_samples(
        self,
        urls: Iterable[str],
        *,
        on_error: Any = "raise",
        verify: bool = False,
        rows: Sequence | None = None,
        **options: Any,
    ) -> Iterator[dict]:
        """The merged samples of the logical shards ``urls`` in turn (the plain path of
        ``WebDataset``); a shard's error goes to ``on_error``, which may skip its rest.
        ``rows``: a view's rows (per logical shard, None for all): only those are read, every
        part by random access through its index (``verify``: each read member against the
        checksums of its index). The parts' open files are closed when the iteration ends."""
        policy = error_policy(on_error)
        where = {u: i for i, u in enumerate(self.urls)}
        try:
            for url in urls:
                shard = where[url]
                sel = None if rows is None else rows[shard]
                try:
                    if sel is None:
                        yield from self.iter_shard(shard, verify=verify, **options)
                    else:
                        yield from self.iter_rows(shard, sel, verify=verify)
                except TarshardsError as exn:
                    if policy(exn):
                        continue
                    return
        finally:
            self.close()

    def iter_rows(self, shard: int, rows, *, verify: bool = False) -> Iterator[dict]:
        """The merged samples of logical rows ``rows`` (sorted) of ``shard``, by random
        access, ``_ROWS`` at a time."""
        rows = np.asarray(rows, dtype=np.int64)
        for lo in range(0, len(rows), _ROWS):
            yield from self.read_rows(shard, rows[lo : lo + _ROWS], verify=verify)

    def iter_shard(self, shard: int, *, verify: bool = False, **options: Any) -> Iterator[dict]:
        n = self.counts[shard]
        streams: list = []
        for part in self.parts:
            if part.aligned:
                record = part.manifest.shards[shard]
                streams.append(
                    shard_samples(part.urls[shard], expect=record if verify else None, **options)
                )
            else:
                streams.append(None)
        try:
            for lo in range(0, n, _ROWS):
                hi = min(n, lo + _ROWS)
                cols = []
                for part, stream in zip(self.parts, streams):
                    if stream is None:
                        cols.append(part.read_rows(shard, lo, hi, verify))
                        continue
                    got = list(itertools.islice(stream, hi - lo))
                    if len(got) < hi - lo:
                        raise ShardFormatError(
                            f"{part.name}: the shard holds {lo + len(got)} samples, the "
                            f"manifest {n}",
                            url=part.urls[shard],
                        )
                    cols.append(got)
                for k in range(hi - lo):
                    yield self.merge([c[k] for c in cols])
            for part, stream in zip(self.parts, streams):  # to its end: verify=True checks there
                if stream is not None and next(stream, None) is not None:
                    raise ShardFormatError(
                        f"{part.name}: the shard holds more samples than the manifest's {n}",
                        url=part.urls[shard],
                    )
        finally:
            for stream in streams:
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """Close the parts' open shard files (they reopen on the next read)."""
        for part in self.parts:
            part.close()


def _as_key(value) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8")
    return str(value).strip()


# ---------------------------------------------------------------------------------------------
# the planned path
# ---------------------------------------------------------------------------------------------


class MergedReaderStream(ReaderStream):
    """A :class:`~tarshards.plan.cursor.ReaderStream` over a :class:`Layout`: its lists are, for the
    same plan positions, the lists of a stream per aligned part (each over its own shards, cut at
    the same positions) and the rows of the pointer parts, merged row by row. The shuffle buffer
    and the resume arithmetic are the base class's."""

    def __init__(self, layout: Layout, table: ShardTable, plan: EpochPlan, reader: int, **options):
        super().__init__(table, plan, reader, **options)
        self.layout = layout
        options = dict(options, unit=self.unit)
        options.pop("stats", None)
        self.inner = [
            ReaderStream(
                ShardTable(part.urls, table.base_counts, manifest=part.manifest, rows=table.rows),
                plan,
                reader,
                **options,
            )
            if part.aligned
            else None
            for part in layout.parts
        ]

    def chunks(self, position: int = 0):
        layout, unit = self.layout, self.unit
        lists = [None if s is None else s.chunks(position) for s in self.inner]
        try:
            at = position
            for shard, a, b, pad in self.plan.segment_runs(self.reader, position):
                i = a
                while i < b:
                    j = min(b, i + unit - (at + i - a) % unit)
                    cols = []
                    for part, it in zip(layout.parts, lists):
                        if it is None:
                            cols.append(part.read_at(shard, self.logical(shard, i, j), self.verify))
                            continue
                        got = next(it, None)
                        if got is None or len(got) != j - i:
                            raise TarshardsError(
                                f"{part.name}: {0 if got is None else len(got)} samples where "
                                f"the plan has {j - i} (the shard changed since it was counted)",
                                url=part.urls[shard],
                            )
                        cols.append(got)
                    merged = [layout.merge([c[k] for c in cols]) for k in range(j - i)]
                    for sample in merged:
                        sample["__pad__"] = pad
                    i = j
                    yield merged
                at += b - a
        finally:
            for it in lists:
                if it is not None:
                    it.close()
            layout.close()

    def logical(self, shard: int, i: int, j: int):
        """The logical rows of plan positions ``i:j`` of ``shard`` (a view's rows kept)."""
        sel = self.table.rows[shard]
        return np.arange(i, j, dtype=np.int64) if sel is None else np.asarray(sel[i:j], np.int64)

    def read_positions(self, positions: Sequence[int]) -> dict[int, dict]:
        layout = self.layout
        located = _locate(self.plan, self.reader, positions)
        cols: list[dict] = []
        for part, inner in zip(layout.parts, self.inner):
            if inner is not None:
                cols.append(inner.read_positions(positions))
                continue
            got = {}
            for p, (shard, row, _pad) in located.items():
                got[p] = part.read_at(shard, self.logical(shard, row, row + 1), self.verify)[0]
            cols.append(got)
        out = {}
        for p, (_shard, _row, pad) in located.items():
            sample = layout.merge([c[p] for c in cols])
            sample["__pad__"] = pad
            out[p] = sample
        return out


def _locate(plan: EpochPlan, reader: int, positions: Sequence[int]) -> dict:
    """Segment position -> (shard, row, pad) for ``positions`` of reader ``reader``."""
    out = {}
    ps = sorted(set(positions))
    k, start = 0, 0
    for shard, a, b, pad in plan.segment_runs(reader):
        end = start + b - a
        while k < len(ps) and ps[k] < end:
            out[ps[k]] = (shard, a + ps[k] - start, pad)
            k += 1
        start = end
    if k < len(ps):
        raise ValueError(f"position {ps[k]} outside reader segment of {start}")
    return out


# ---------------------------------------------------------------------------------------------
# a manifest's layout
# ---------------------------------------------------------------------------------------------


def load_pointers(url: str, storage_options=None):
    """A join's pointer table (``.npy``, ``int32`` rows of (left row, right shard, right row)),
    memory-mapped when local."""
    if is_local(url):
        try:
            return np.load(local_path(url), mmap_mode="r")
        except FileNotFoundError:
            raise ShardFormatError("the join's pointer file is missing", url=url) from None
    import io

    with open_url(url, storage_options=storage_options) as f:
        return np.load(io.BytesIO(f.read()))


def _projected(fingerprint: str, fields: Sequence[str] | None) -> str:
    if fields is None:
        return fingerprint
    text = json.dumps([fingerprint, sorted(fields)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def layout_for(
    manifest: Manifest, fields: Sequence[str] | None = None, *, storage_options=None
) -> Layout | None:
    """The :class:`Layout` of ``manifest`` read with ``fields`` (None: all), or None for a plain
    manifest read whole."""
    if fields is not None:
        if isinstance(fields, str):
            fields = fields.split()
        fields = [str(f).lower() for f in fields]
        if not fields:
            raise ValueError("fields= names no field")
    if not manifest.columns and not manifest.join and fields is None:
        return None
    so = storage_options or manifest.storage_options
    if manifest.join:
        return _join_layout(manifest, fields, so)
    base = Manifest(manifest.shards, url=manifest.url, storage_options=so)
    parts: list[Part] = []
    counts = [r.samples for r in manifest.shards]
    if fields is None:
        parts.append(Part("base", base))
        for g in manifest.columns:
            parts.append(_group_part(manifest, g, None, so))
    else:
        holder = manifest.column_fields()
        in_base = frozenset(f for f in fields if f not in holder)
        for g in manifest.columns:
            mine = frozenset(f for f in fields if holder.get(f) == g.name)
            if mine:
                parts.append(_group_part(manifest, g, mine, so))
        if in_base or parts[0].selection is not None:
            # (a group made over a view lacks some rows: the base gives every row's key)
            parts.insert(0, Part("base", base, keep=in_base))
    return Layout(manifest, parts, counts, _projected(manifest.fingerprint, fields), fields)


def _group_part(manifest: Manifest, g, keep, so) -> Part:
    """The part of column group ``g``: aligned with the base, or, for a group made over a view,
    read by random access at the view's rows (the others have none of its fields)."""
    name = f"column group {g.name!r}"
    if g.rows is None:
        return Part(name, manifest.group_manifest(g.name), keep=keep)
    from ..format.selection import View

    url = resolve_url(g.rows["view"], manifest.base)
    view = View.load(url, storage_options=so)
    if (
        view.fingerprint != g.rows["fingerprint"]
        or len(view.rows) != len(manifest.shards)
        or list(view.selected_counts) != [r.samples for r in g.shards]
    ):
        raise IntegrityError(
            f"{name} was made over other rows than its view file now holds", url=url
        )
    return Part(name, manifest.group_manifest(g.name), keep=keep, optional=True, selection=view)


def _join_layout(manifest: Manifest, fields, so) -> Layout:
    join = manifest.join or {}
    left = Manifest(manifest.shards, url=manifest.url, storage_options=so)
    right_info = join["right"]
    right = Manifest(
        tuple(
            ShardRecord(r["url"], int(r["samples"]), r.get("nbytes"), r.get("hash"), r.get("index"))
            for r in right_info["shards"]
        ),
        url=manifest.url,
        storage_options=so,
    )
    counts = [int(c) for c in join["counts"]]
    url = resolve_url(join["pointers"], manifest.base)
    ptr = load_pointers(url, so)
    if ptr.ndim != 2 or ptr.shape[1] != 3 or len(ptr) != sum(counts):
        raise IntegrityError(
            f"the join's pointer file holds {ptr.shape} rows, its manifest {sum(counts)} x 3",
            url=url,
        )
    del ptr
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    how = join["how"]
    if how == "left":
        lpart = Part("left", left)
    else:
        lpart = Part("left", left, starts=starts, pointers=url, columns=(-1, 0))
    rpart = Part(
        "right",
        right,
        prefix=join.get("prefix", ""),
        starts=starts,
        pointers=url,
        optional=how == "left",
        on=join.get("on", "__key__"),
        replaces=False,
    )
    return Layout(
        manifest, [lpart, rpart], counts, _projected(manifest.fingerprint, fields), fields
    )
