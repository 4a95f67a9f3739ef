"""Converting data sets into shards, and shards into Parquet: ``tarshards.convert``.

The module is callable: ``tarshards.convert(src, output, ...)`` is :func:`convert` (the package
``tarshards.convert`` and the function share the name, and importing the package binds the name
in ``tarshards`` to it, so the package calls the function).

* :mod:`.sources`: what is read (an ImageFolder tree, files grouped by name, Parquet, a Hugging
  Face dataset, JSONL naming files), each as a numbered list of rows;
* :mod:`.columns`: which member each column of a table becomes;
* :mod:`.shards`: the plan (rows to shards), one atomic job per shard on an engine, the manifest;
* :mod:`.parquet`: shards back to a Parquet file.
"""

from __future__ import annotations

import os
import sys
import types

from ..format.manifest import Manifest, is_manifest_spec
from .columns import Column, format_of, plan_columns
from .parquet import ParquetOutput, write_parquet
from .shards import WriteOptions, assign_rows, output_layout, write_shards
from .sources import KINDS, Source, detect_kind, open_source

__all__ = [
    "KINDS",
    "Column",
    "ParquetOutput",
    "Source",
    "WriteOptions",
    "assign_rows",
    "convert",
    "detect_kind",
    "format_of",
    "open_source",
    "output_layout",
    "plan_columns",
    "write_parquet",
    "write_shards",
]


def _is_parquet_output(output) -> bool:
    return isinstance(output, (str, os.PathLike)) and os.fspath(output).lower().endswith(".parquet")


def convert(
    src,
    output,
    *,
    kind: str | None = None,
    fields=None,
    extensions: dict[str, str] | None = None,
    key: str | None = None,
    split: str | None = None,
    manifest=None,
    maxcount: int = 10_000,
    maxsize: int | float | str | None = None,
    compress: str | None = None,
    aligned: bool = False,
    level: int | None = None,
    info: dict | None = None,
    meta=None,
    engine="processes",
    workers: int | None = None,
    address: str | None = None,
    client=None,
    retries: int = 2,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict | None = None,
    text: bool = True,
    row_group_size: int = 1000,
    from_: str | None = None,
):
    """Convert ``src`` into shards with a manifest and indexes, or shards into Parquet.

    Into shards (returns the :class:`~tarshards.format.manifest.Manifest`): ``src`` is an
    ImageFolder
    tree (``cls`` from the class folder, the class names in the manifest's ``info``), a folder of
    files grouped by name (``a.jpg``, ``a.json``), a Parquet file, list or folder, a Hugging Face
    ``datasets.Dataset``/``DatasetDict`` or ``save_to_disk`` folder (``split=``), or a JSONL
    file whose fields name files; ``kind=`` (``imagefolder``, ``files``, ``parquet``, ``hf``,
    ``jsonl``) overrides what :func:`detect_kind` finds. For tables, ``fields`` chooses the
    columns, ``extensions={column: ext}`` names their members (see
    :mod:`tarshards.convert.columns` for the defaults) and ``key`` the column of sample keys
    (default ``__key__`` where there is one, else row numbers).

    ``output`` is a folder (``OUT/shard-000000.tar``..., manifest ``OUT/manifest.json``) or a
    pattern (``out/train-%06d.tar.gz``, manifest ``out/train.json``; ``manifest=`` chooses).
    Shards hold at most ``maxcount`` samples and, with ``maxsize``, about that many bytes (the
    rows then cut into shards of about equal size; a folder's files are measured for it, a
    ``stat`` each; tables give estimates); compression by suffix
    or ``compress=``, ``aligned=True`` for sample-aligned compression, ``info=`` added to the
    manifest's ``info``. ``meta=`` records per-sample metadata columns in the shards' indexes,
    as ``ShardWriter(meta=)`` does (``{"tokens": fn}``, or :func:`tarshards.media_meta` for
    image sizes and media durations; each function gets the sample before decoding,
    ``{"__key__": key, ext: bytes}``): :meth:`Manifest.meta` reads them. Shards are written in
    parallel: ``engine="processes"`` with ``workers`` processes (one per CPU by default;
    ``workers=1`` writes in this process), ``engine="dask"`` (``address=``/``client=``, else a
    local cluster) or ``engine="ray"`` (the Ray this process is connected to, the one at
    ``address=``, else a local one of ``workers`` CPUs), with a progress bar (``progress``,
    default: when stderr is a terminal).

    Resumable: rows go to shards by a fixed plan, each shard is committed atomically, and a
    rerun after a kill writes only the missing shards (``overwrite=True`` writes them all).

    Into Parquet (``output`` ending in ``.parquet``; returns a :class:`ParquetOutput`): ``src``
    is a manifest, or a shard spec; ``fields`` chooses the fields; ``text=False`` makes every
    column binary. See :func:`tarshards.convert.write_parquet`.
    """
    if from_ is not None:
        if kind is not None and kind != from_:
            raise ValueError("give kind= or from_=, not both")
        kind = from_
    if _is_parquet_output(output):
        if meta is not None:
            raise ValueError("meta= is for the indexes of shards, not for Parquet output")
        if kind not in (None, "shards"):
            raise ValueError(f"Parquet output is made from shards, not from kind={kind!r}")
        if kind is None and not _names_shards(src):
            raise ValueError(
                f"{src!r} does not name shards or a manifest; Parquet output is made from shards"
            )
        return write_parquet(
            src,
            output,
            fields=fields,
            text=text,
            row_group_size=row_group_size,
            storage_options=storage_options,
            progress=progress,
        )
    if kind == "shards":
        raise ValueError("shards convert to Parquet: give an output ending in .parquet")
    source = open_source(
        src,
        kind,
        fields=fields,
        extensions=extensions,
        key=key,
        split=split,
        sizes=maxsize is not None,
    )
    options = WriteOptions(
        maxcount=maxcount, maxsize=maxsize, compress=compress, aligned=aligned, level=level
    )
    split_name = getattr(source, "split", None)
    return write_shards(
        source,
        output,
        manifest=manifest,
        options=options,
        info=info,
        prefix=split_name or "shard",
        engine=engine,
        workers=workers,
        address=address,
        client=client,
        retries=retries,
        overwrite=overwrite,
        progress=progress,
        storage_options=storage_options,
        meta=meta,
    )


def _names_shards(src) -> bool:
    if isinstance(src, Manifest) or is_manifest_spec(src):
        return True
    if isinstance(src, (list, tuple)):
        return all(_names_shards(s) for s in src)
    if not isinstance(src, (str, os.PathLike)):
        return False
    text = os.fspath(src)
    if "{" in text or "::" in text or "*" in text:
        return True
    from ..format.compression import is_compressed_name

    return text.lower().endswith(".tar") or is_compressed_name(text)


class _CallableModule(types.ModuleType):
    """This package's module type: calling it calls :func:`convert`."""

    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
