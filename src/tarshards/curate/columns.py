"""Sidecar columns: new fields computed from a data set, stored beside it (:func:`add_columns`).

``tarshards.add_columns(source, fn, output="cols/manifest.json")`` runs ``fn(sample) -> {field:
value}`` over every sample and writes *only the new fields*, into one sidecar shard per base
shard, aligned row by row with it (same keys, same order), each with its own index and hash.
The output manifest lists the base shards (relative to it, as the source lists them), the column
group with its fields and shards, and the source manifest it came from (``"base"``)::

    {"format": "tarshards.manifest", "version": 1, "fingerprint": "sha256:...",
     "num_samples": 2000, "shards": [...the base shards...],
     "base": {"manifest": "../manifest.json", "checksum": "sha256:..."},
     "columns": [{"name": "caption", "fields": ["txt"],
                  "shards": [{"url": "caption-000000.tar", "samples": 1000, "nbytes": ...,
                              "hash": "xxh3_64:...", "index": "caption-000000.tar.tsidx"}, ...]}]}

Reading it (``WebDataset``, ``IndexedDataset``, ``readers=V`` plans and resume) yields the base
fields and the new ones merged per sample; ``fields=[...]`` reads only the groups that hold
them, and never the base shards when they hold none of them (:mod:`tarshards.read.sidecar`). The
media is never copied: a 100-byte caption costs its tar header and data blocks (about 1 KB a
sample) and a few bytes of index.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Sequence

from ..errors import ShardFormatError
from ..format.index import ShardIndex
from ..format.manifest import (
    ColumnGroup,
    Manifest,
    ShardRecord,
    as_manifest,
    index_path_for,
    relative_url,
    resolve_url,
)
from ..format.selection import VIEW_SUFFIX, View, as_record
from ..parallel import FAILED, map_shard_files
from ..read.reading import shard_samples
from ..read.sidecar import RowReader, layout_for
from ..storage import is_local, local_path
from ..write.writer import TarWriter

__all__ = ["add_columns"]


class _ColumnJob:
    """One shard's sidecar: ``job(i, out)`` reads row by row shard ``i`` of the source (merged
    with its column groups where it has some), applies ``fn`` and writes the new fields to
    ``out`` with its index (picklable: it runs in workers)."""

    def __init__(
        self, manifest: Manifest, fn: Callable, fields, decode, index_urls, options, view=None
    ):
        self.manifest = manifest
        self.view = view  # a View of the manifest: only its rows (the group covers those)
        self.fn = fn
        self.fields = fields
        self.decode = decode
        self.index_urls = index_urls
        self.options = options

    def samples(self, k: int):
        m = self.manifest
        so = self.options.get("storage_options")
        layout = layout_for(m, self.fields, storage_options=so)
        if self.view is not None:  # the view's rows of the shard, by random access
            return self._rows(m, layout, k, self.view.shard_rows(k))
        if layout is None:
            return shard_samples(m.shard_urls()[k], **self.options)
        return layout.iter_shard(k, **self.options)

    def _rows(self, m: Manifest, layout, k: int, rows):
        if layout is not None:
            try:
                yield from layout.iter_rows(k, rows)
            finally:
                layout.close()
            return
        reader = RowReader(m, storage_options=self.options.get("storage_options"))
        try:
            for lo in range(0, len(rows), 256):
                yield from reader.read(k, rows[lo : lo + 256].tolist())
        finally:
            reader.close()

    def __call__(self, i: str, out: str) -> int:
        k = int(i)
        samples: Any = self.samples(k)
        if self.decode is not None:
            from ..pipeline.stages import decode

            modes = self.decode if isinstance(self.decode, (list, tuple)) else [self.decode]
            samples = decode(samples, *modes)
        n = 0
        url = self.manifest.shard_urls()[k]
        with TarWriter(
            out, index=self.index_urls[k], storage_options=self.options.get("storage_options")
        ) as sink:
            for sample in samples:
                new = self.fn(sample)
                key = sample["__key__"]
                if not isinstance(new, dict) or not new:
                    raise ShardFormatError(
                        f"add_columns: fn returned {new!r} for sample {key!r}: it must return a "
                        "dict of one or more new fields for every sample (the sidecar is aligned "
                        "row by row with the base)",
                        url=url,
                        member=key,
                    )
                bad = [f for f in new if not isinstance(f, str) or f.startswith("__") or not f]
                if bad:
                    raise ValueError(
                        f"add_columns: {bad[0]!r} is not a field name (sample {key!r})"
                    )
                sink.write({"__key__": key, **new})
                n += 1
        expected = (
            self.manifest.shards[k].samples if self.view is None else self.view.selected_counts[k]
        )
        if n != expected:
            raise ShardFormatError(f"the shard holds {n} samples, the manifest {expected}", url=url)
        return n


def add_columns(
    source: Any,
    fn: Callable[[dict], dict],
    *,
    output: str | os.PathLike,
    name: str | None = None,
    fields: Sequence[str] | None = None,
    decode: Any = None,
    engine: Any = "processes",
    workers: int | None = None,
    address: str | None = None,
    client: Any = None,
    retries: int = 2,
    overwrite: bool = True,
    progress: bool | None = None,
    storage_options: dict | None = None,
) -> Any:
    """Compute new fields for every sample of ``source`` and store them as a sidecar column
    group beside it (see the module docstring); returns the output manifest.

    ``source``: a manifest (path, URL or :class:`~tarshards.Manifest`), possibly one with
    column groups already (they are kept, and ``fn`` sees them merged). Or a view
    (:class:`~tarshards.View` or ``*.view.json``): ``fn`` runs over the view's samples only
    and the group is aligned with the *view's rows* (its shard ``i`` holds the view's rows of
    base shard ``i``; a copy of the view is saved beside it as ``NAME.rows.view.json``): the
    output manifest reads every base row, those outside the view without the new fields, and
    the view over it, saved as ``OUTPUT.view.json`` (``manifest.json`` ->
    ``manifest.view.json``), is returned (its samples all have them). ``fn(sample)`` returns
    a dict of one or more new fields (``{"txt": "a caption"}``, ``{"emb.npy": array}``...),
    encoded by extension as :class:`~tarshards.TarWriter` encodes; by default the sample is raw
    (fields as bytes); ``decode=`` decodes it first (``"pil"``, ``"rgb"``...: the modes of
    ``.decode()``); ``fields=`` reads only those fields of the source (``fn`` needs no more:
    only the groups holding them are read). A field that the base also has replaces it when
    read (a better caption).

    ``output``: the new manifest's path; the group's shards (``NAME-000000.tar``...) and their
    indexes go beside it. ``name``: the group's name (default: the new fields' names joined).
    One task a shard on ``engine`` (``"processes"``, ``"dask"``, ``"ray"``; ``workers``,
    ``address``, ``client``, ``retries`` as :func:`tarshards.parallel.map_shards`; ``fn`` must
    pickle for processes). ``overwrite=False`` keeps the sidecar shards a killed run completed.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    record = as_record(source, storage_options)
    view = record if isinstance(record, View) and not record.is_everything else None
    m = record.manifest if isinstance(record, View) else as_manifest(record, storage_options)
    if m.join:
        raise ValueError("add_columns adds columns to a manifest's shards, not to a join")
    output = os.fspath(output)
    if m.url is not None and os.path.abspath(m.url) == os.path.abspath(output):
        raise ValueError("output= is the source manifest: give the new manifest another path")
    out_base = Manifest((), url=output).base
    group = name or ("columns" if not m.columns else f"columns{len(m.columns)}")
    if group in {g.name for g in m.columns}:
        raise ValueError(f"the source has a column group {group!r} already: choose another name")
    rels = [f"{_safe(group)}-{i:06d}.tar" for i in range(len(m.shards))]
    index_rels = [index_path_for(r) for r in rels]
    targets = [resolve_url(r, out_base) for r in rels]
    index_urls = [resolve_url(r, out_base) for r in index_rels]
    if "://" not in output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    options: dict[str, Any] = {}
    if storage_options is not None:
        options["storage_options"] = storage_options
    rows_ref = None
    if view is not None:  # the rows the group covers: a copy of the view beside it
        rows_url = resolve_url(f"{_safe(group)}.rows{VIEW_SUFFIX}", out_base)
        view = view.save(rows_url, storage_options=storage_options)
        rows_ref = {"view": rel_url(rows_url, out_base), "fingerprint": view.fingerprint}
    job = _ColumnJob(m, fn, fields, decode, index_urls, options, view)
    reports = map_shard_files(
        job,
        [(str(i), t) for i, t in enumerate(targets)],
        engine=engine,
        workers=workers,
        address=address,
        client=client,
        retries=retries,
        overwrite=overwrite,
        storage_options=storage_options,
        progress=progress,
        warn_kept=False,
        warn_failed=False,  # raised below, naming the shards
    )
    failed = [r for r in reports if r.status == FAILED]
    if failed:
        raise ShardFormatError(
            f"add_columns: {len(failed)} of {len(reports)} shards failed; first: {failed[0].error}",
            url=m.shard_urls()[int(failed[0].input)],
        )
    records, names = [], {}
    wanted = [r.samples for r in m.shards] if view is None else list(view.selected_counts)
    for rel, index_rel, index_url, n in zip(rels, index_rels, index_urls, wanted):
        idx = ShardIndex.load(index_url, storage_options=storage_options)
        if idx.num_samples != n:
            raise ShardFormatError(
                f"the sidecar shard holds {idx.num_samples} samples, its base {n} "
                "(a shard kept from another run? pass overwrite=True)",
                url=resolve_url(rel, out_base),
            )
        names.update(dict.fromkeys(e.lower() for e in idx.extensions))
        records.append(ShardRecord(rel, idx.num_samples, idx.nbytes, idx.hash, index_rel))
    new_group = ColumnGroup(group, tuple(sorted(names)), tuple(records), rows=rows_ref)
    moved = moved_to(m, out_base)
    base_ref = None
    if m.url is not None:
        base_ref = {"manifest": rel_url(m.url, out_base), "checksum": m.checksum}
    result = replace(
        moved,
        columns=(*moved.columns, new_group),
        base_ref=base_ref,
        url=None,
        _indexes={},
    )
    saved = result.save(output, storage_options=storage_options)
    if view is None:
        return saved
    stem = output[:-5] if output.lower().endswith(".json") else output
    return View.of(saved, view.rows).save(stem + VIEW_SUFFIX, storage_options=storage_options)


def rel_url(url: str, base: str | None) -> str:
    """``url`` relative to the directory ``base``, with ``..`` where it lies outside it (both
    local), so that a data set and its sidecars moved together keep working; else as
    :func:`~tarshards.format.manifest.relative_url`."""
    if base is not None and is_local(url) and is_local(base) and "://" not in base:
        return os.path.relpath(os.path.abspath(local_path(url)), base).replace(os.sep, "/")
    return relative_url(url, base)


def moved_to(m: Manifest, base: str | None) -> Manifest:
    """``m``'s records (shards, column groups) with URLs relative to the directory ``base``."""
    old = m.base

    def move(u):
        return None if u is None else rel_url(resolve_url(u, old), base)

    def records(rs):
        return tuple(replace(r, url=move(r.url), index=move(r.index)) for r in rs)

    columns = tuple(
        replace(
            g,
            shards=records(g.shards),
            rows=None if g.rows is None else dict(g.rows, view=move(g.rows["view"])),
        )
        for g in m.columns
    )
    return replace(m, shards=records(m.shards), columns=columns, _indexes={})


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
