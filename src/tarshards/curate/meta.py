"""Per-sample metadata columns added to an existing data set: :func:`add_meta`.

``tarshards.add_meta(source, {"tokens": fn}, output=...)`` reads every sample of a manifest's
shards once (raw: ``{"__key__", "__url__", ext: bytes}``, as ``ShardWriter(meta=)`` sees them),
applies the functions, and stores the columns with each shard's index, where
:meth:`tarshards.Manifest.meta` reads them as numpy arrays in manifest order. The shards are not
touched: with ``output=`` a new manifest names the same shards and new indexes beside it (the
source's indexes stay as they are); without it the source's indexes are saved again with the
columns. One task a shard, on the processes, Dask or Ray engine.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ShardFormatError
from ..format.manifest import (
    Manifest,
    ShardRecord,
    as_manifest,
    index_path_for,
    relative_url,
    resolve_url,
)
from ..parallel import FAILED, map_shard_files
from ..read.reading import shard_samples
from ..write.writer import meta_functions, meta_row, meta_table

__all__ = ["add_meta"]


class _MetaJob:
    """One shard's columns: ``job(i, index_url)`` reads shard ``i`` of the manifest, computes
    the columns and saves its index with them at ``index_url`` (picklable: it runs in workers)."""

    def __init__(self, manifest: Manifest, meta: list, storage_options: dict | None):
        self.manifest = manifest
        self.meta = meta
        self.storage_options = storage_options

    def __call__(self, i: str, out: str) -> int:
        k = int(i)
        m = self.manifest
        url = m.shard_urls()[k]
        index = m.load_index(k)
        keys = index.keys
        rows = []
        for j, sample in enumerate(shard_samples(url, storage_options=self.storage_options)):
            if j >= len(keys) or sample["__key__"] != keys[j]:
                raise ShardFormatError(
                    f"sample {j} of the shard is {sample['__key__']!r}, its index says "
                    f"{keys[j] if j < len(keys) else 'nothing'!r}: the index is stale "
                    "(tarshards index --overwrite)",
                    url=url,
                    offset=int(sample.get("__offset__", 0) or 0),
                )
            rows.append(meta_row(self.meta, sample))
        if len(rows) != len(keys):
            raise ShardFormatError(
                f"the shard holds {len(rows)} samples, its index {len(keys)}: the index is stale "
                "(tarshards index --overwrite)",
                url=url,
            )
        index.with_meta(meta_table(rows)).save(out, storage_options=self.storage_options)
        return len(rows)


def add_meta(
    source: Any,
    meta: Any,
    *,
    output: str | os.PathLike | None = None,
    engine: Any = "processes",
    workers: int | None = None,
    address: str | None = None,
    client: Any = None,
    retries: int = 2,
    progress: bool | None = None,
    storage_options: dict | None = None,
) -> Manifest:
    """Add per-sample metadata columns to the data set of ``source`` (a manifest, or its
    path/URL, whose shards have indexes); returns the manifest that holds them.

    ``meta``: as ``ShardWriter(meta=...)``: ``{"tokens": fn}`` (``fn(sample)`` a number, or
    None for no value: NaN), a function returning ``{name: number}`` (``tarshards.media_meta()``),
    or a list of them. The functions see raw samples (fields as bytes).

    ``output``: where the new manifest goes. Its records name the source's shards (relative to
    it where they can be) and new index files beside it, so the source's manifest and indexes
    stay as they are; None saves the source's indexes again with the columns added (they then
    replace columns of the same name).

    One task a shard on ``engine`` (``"processes"``, ``"dask"``, ``"ray"``; ``workers``,
    ``address``, ``client`` as :func:`tarshards.parallel.map_shards`); a shard whose index no
    longer matches it (other keys or counts) fails naming the shard. The data's fingerprint is
    unchanged (the same samples in the same shards).
    """
    fns = meta_functions(meta)
    if not fns:
        raise ValueError("meta= names no column (a dict of functions or a function)")
    m = as_manifest(source, storage_options)
    if any(r.index is None for r in m.shards):
        missing = [r.url for r in m.shards if r.index is None]
        raise ShardFormatError(
            f"{len(missing)} shard(s) have no index (first: {missing[0]}): make them with "
            "tarshards index first",
            url=m.url,
        )
    urls = m.shard_urls()
    if output is None:
        if m.url is None:
            raise ValueError("a manifest that was not loaded from a file needs output=")
        targets = [m.index_url(i) or "" for i in range(len(m.shards))]
        records = list(m.shards)
    else:
        output = os.fspath(output)
        base = Manifest((), url=output).base
        records, targets = [], []
        for r, url in zip(m.shards, urls):
            rel = relative_url(url, base)
            index = index_path_for(rel)
            records.append(ShardRecord(rel, r.samples, r.nbytes, r.hash, index))
            targets.append(resolve_url(index, base))
        for t in targets:  # local index folders (_index/ for shards outside the output's)
            if "://" not in t:
                os.makedirs(os.path.dirname(os.path.abspath(t)), exist_ok=True)
    job = _MetaJob(m, fns, storage_options)
    reports = map_shard_files(
        job,
        [(str(i), t) for i, t in enumerate(targets)],
        engine=engine,
        workers=workers,
        address=address,
        client=client,
        retries=retries,
        overwrite=True,  # every index is made again (its columns are what this call adds)
        storage_options=storage_options,
        progress=progress,
        warn_failed=False,  # raised below, naming the shards
    )
    failed = [r for r in reports if r.status == FAILED]
    if failed:
        raise ShardFormatError(
            f"{len(failed)} of {len(reports)} shards failed; first: {failed[0].error}",
            url=failed[0].input,
        )
    if output is None:
        return Manifest.load(m.url, storage_options=storage_options)
    new = Manifest(tuple(records), info=dict(m.info))
    return new.save(output, storage_options=storage_options)
