"""Shards to Parquet: one row per sample, one column per field, for tools that read Parquet.

The key is the ``__key__`` column (a string); each chosen field (extension) is a column named as
it: text fields (``txt``, ``json``, ``cls``... and ``*.txt``/``*.json``/``*.cls``) as strings,
everything else (images, audio, arrays) as binary, the member's bytes as they are. A sample
without a field has a null there. The schema's metadata (``b"tarshards"``) records the key
column, each column's extension and the manifest's ``info``, so ``tarshards convert`` of the file
gives back shards whose members are byte for byte the same.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from ..format.manifest import Manifest, is_manifest_spec
from ..read.reading import iter_samples
from ..read.specs import expand_urls
from ..storage import AtomicOutput
from .columns import CLS_EXTENSIONS, JSON_EXTENSIONS, TEXT_EXTENSIONS
from .sources import require_pyarrow

__all__ = ["ParquetOutput", "write_parquet"]

KEY_COLUMN = "__key__"


@dataclass(frozen=True)
class ParquetOutput:
    """What :func:`write_parquet` wrote: where, how many rows, which columns."""

    url: str
    num_rows: int
    columns: tuple[str, ...]


def _is_text(ext: str) -> bool:
    last = ext.rsplit(".", 1)[-1].lower()
    return last in TEXT_EXTENSIONS or last in JSON_EXTENSIONS or last in CLS_EXTENSIONS


def write_parquet(
    spec,
    output,
    *,
    fields=None,
    text: bool = True,
    row_group_size: int = 1000,
    compression: str = "zstd",
    storage_options: dict | None = None,
    progress: bool | None = None,
) -> ParquetOutput:
    """Write the samples of ``spec`` (a manifest, its path, or a shard spec) to the Parquet file
    ``output``, in order. ``fields``: the extensions to keep (default: every field; from a
    manifest they are read from its indexes, else from the first shard); ``text=False`` writes
    every field as binary. A sample with a field outside the chosen ones is written without it
    when ``fields`` is given, and is an error otherwise."""
    pa = require_pyarrow()
    pq = pa.parquet
    if row_group_size < 1:
        raise ValueError(f"row_group_size must be >= 1, got {row_group_size!r}")
    info: dict = {}
    if is_manifest_spec(spec):
        manifest = (
            spec
            if isinstance(spec, Manifest)
            else Manifest.load(spec, storage_options=storage_options)
        )
        urls = manifest.shard_urls()
        info = dict(manifest.info)
        if fields is None:
            found: dict[str, None] = {}
            for i in range(len(manifest.shards)):
                if manifest.shards[i].index is not None:
                    for ext in manifest.load_index(i).extensions:
                        found.setdefault(ext)
            fields = list(found) or None
    else:
        urls = expand_urls(spec, storage_options=storage_options)
    if not urls:
        raise ValueError(f"{spec!r} names no shards")
    strict = fields is None
    samples = iter_samples(urls, storage_options=storage_options)
    first: list[dict] = []
    if fields is None:  # from the first shard's samples
        found = {}
        for s in samples:
            first.append(s)
            for k in s:
                if not k.startswith("__"):
                    found.setdefault(k)
            if s["__url__"] != urls[0]:
                break
        fields = list(found)
    fields = [f for f in dict.fromkeys(fields) if f and not f.startswith("__")]
    if not fields:
        raise ValueError("no fields to write")
    is_text = {f: text and _is_text(f) for f in fields}
    schema = pa.schema(
        [pa.field(KEY_COLUMN, pa.string(), nullable=False)]
        + [pa.field(f, pa.string() if is_text[f] else pa.binary()) for f in fields],
        metadata={
            b"tarshards": json.dumps(
                {"key": KEY_COLUMN, "extensions": {f: f for f in fields}, "info": info}
            ).encode()
        },
    )
    bar = None
    if progress is None:
        progress = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="sample", desc="to parquet", file=sys.stderr, dynamic_ncols=True)
    rows = 0
    with AtomicOutput(os.fspath(output), storage_options=storage_options) as out:
        with pq.ParquetWriter(out.stream, schema, compression=compression) as writer:
            batch: dict[str, list] = {KEY_COLUMN: [], **{f: [] for f in fields}}

            def flush():
                if batch[KEY_COLUMN]:
                    writer.write_table(pa.table(batch, schema=schema))
                    for v in batch.values():
                        v.clear()

            def every():
                yield from first
                yield from samples

            for s in every():
                if strict:
                    extra = [k for k in s if not k.startswith("__") and k not in is_text]
                    if extra:
                        raise ValueError(
                            f"sample {s['__key__']} ({s.get('__url__')}) has fields "
                            f"{', '.join(extra)} that the first shard's samples do not; "
                            "name the fields to write with fields="
                        )
                batch[KEY_COLUMN].append(s["__key__"])
                for f, as_text in is_text.items():
                    v = s.get(f)
                    if v is not None:
                        v = bytes(v)
                        if as_text:
                            try:
                                v = v.decode("utf-8")
                            except UnicodeDecodeError:
                                raise ValueError(
                                    f"field {f!r} of sample {s['__key__']} is not UTF-8 text; "
                                    "write every field as binary with text=False (--binary)"
                                ) from None
                    batch[f].append(v)
                rows += 1
                if bar is not None:
                    bar.update(1)
                if len(batch[KEY_COLUMN]) >= row_group_size:
                    flush()
            flush()
    if bar is not None:
        bar.close()
    return ParquetOutput(os.fspath(output), rows, (KEY_COLUMN, *fields))
