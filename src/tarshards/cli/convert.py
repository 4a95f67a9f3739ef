"""``tarshards convert``: a data set into shards (with a manifest and indexes), or shards into
Parquet. A thin layer over :func:`tarshards.convert.convert`; see docs/convert.md."""

from __future__ import annotations

import json
import os

import click

from ._common import CONTEXT_SETTINGS, SIZE, handle_errors, print_err, quiet_option

__all__ = ["convert_cmd"]

_EPILOG = """\b
Examples:
  tarshards convert imagenet/train -o shards/train -p 8          # ImageFolder tree
  tarshards convert pairs/ -o 'shards/pairs-%06d.tar.zst' --maxsize 512MB
  tarshards convert data/*.parquet -o shards/ --ext image=jpg --key id
  tarshards convert hf_saved/ --split train -o shards/train      # datasets' save_to_disk
  tarshards convert captions.jsonl -o shards/ --engine dask --address tcp://sched:8786
  tarshards convert imagenet/train -o shards/train --media --engine ray --address auto
  tarshards convert shards/manifest.json -o train.parquet -f jpg,cls
"""

KINDS = ("imagefolder", "files", "parquet", "hf", "jsonl", "shards")


def _pairs(values, what: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, ext = v.partition("=")
        if not sep or not name or not ext:
            raise click.BadParameter(f"{v!r} is not COLUMN=EXT", param_hint=what)
        out[name] = ext
    return out


@click.command("convert", context_settings=CONTEXT_SETTINGS, epilog=_EPILOG)
@click.argument("src", nargs=-1, required=True, metavar="SRC...")
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="OUTPUT",
    help="A folder, a shard pattern (out/train-%06d.tar.gz), or a .parquet file (from shards).",
)
@click.option(
    "--from",
    "kind",
    type=click.Choice(KINDS),
    default=None,
    help="The kind of SRC (default: detected).",
)
@click.option("--manifest", metavar="PATH", help="Where the manifest goes (default: see docs).")
@click.option(
    "-f",
    "--fields",
    metavar="A,B",
    help="Columns (tables), extensions (folders) or fields (to Parquet) to keep.",
)
@click.option(
    "--ext",
    "exts",
    multiple=True,
    metavar="COLUMN=EXT",
    help="The member extension of a column (repeatable).",
)
@click.option("--key", metavar="COLUMN", help="The column of sample keys (tables).")
@click.option("--split", metavar="NAME", help="The split of a Hugging Face DatasetDict.")
@click.option(
    "-c",
    "--maxcount",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Samples per shard at most.",
)
@click.option(
    "-s",
    "--maxsize",
    type=SIZE,
    default=None,
    help="Bytes per shard, about (uncompressed; shards of equal size). Default: by count only.",
)
@click.option(
    "-z",
    "--compress",
    type=click.Choice(["gz", "zst", "bz2", "xz", "lz4"]),
    default=None,
    help="Compression (default: by the pattern's suffix; none for a folder).",
)
@click.option("--aligned", is_flag=True, help="Sample-aligned compression (random access).")
@click.option(
    "--info",
    "info",
    multiple=True,
    metavar="KEY=JSON",
    help="An entry of the manifest's info (repeatable); the value is JSON, or else text.",
)
@click.option(
    "--media",
    is_flag=True,
    help="Also record media metadata columns in the indexes (jpg.width, jpg.height, "
    "mp4.duration, flac.rate...; headers only, nothing decoded), for Manifest.meta and "
    "tarshards browse.",
)
@click.option(
    "--engine",
    type=click.Choice(["processes", "dask", "ray"]),
    default="processes",
    show_default=True,
    help="Local worker processes, a Dask cluster, or a Ray cluster.",
)
@click.option(
    "--address",
    metavar="URL",
    help="Dask scheduler (tcp://host:8786) or Ray address (auto, ray://host:10001); default: a "
    "local cluster.",
)
@click.option(
    "-p",
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Shards written at once (default: one per CPU; 1: in this process).",
)
@click.option("--overwrite", is_flag=True, help="Write every shard again.")
@click.option("--binary", is_flag=True, help="To Parquet: every field as a binary column.")
@quiet_option()
@handle_errors
def convert_cmd(
    src,
    output,
    kind,
    manifest,
    fields,
    exts,
    key,
    split,
    maxcount,
    maxsize,
    compress,
    aligned,
    info,
    media,
    engine,
    address,
    workers,
    overwrite,
    binary,
    quiet,
):
    """Convert SRC into shards with a manifest and indexes, or shards into Parquet.

    SRC is an ImageFolder tree (class folders: cls and the class names in the manifest), a folder
    of files grouped by name (a.jpg, a.json, a.txt), Parquet files or a Parquet folder, a Hugging
    Face dataset saved with save_to_disk, or a JSONL file whose fields name files. Rows go to
    shards by a fixed plan and each shard appears only when complete: after a kill, the same
    command writes only the missing shards. With OUTPUT ending in .parquet, SRC is a manifest or
    a shard spec, and each sample becomes a row (key, then one column per field).
    """
    from ..convert import convert
    from ..read.specs import expand_urls

    if address is not None and engine not in ("dask", "ray"):
        raise click.UsageError("--address needs --engine dask or --engine ray")
    chosen = [f for f in fields.split(",") if f] if fields else None
    parsed_info = {}
    for item in info:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="'--info'")
        try:
            parsed_info[name] = json.loads(value)
        except ValueError:
            parsed_info[name] = value
    srcs: list = list(src)
    to_parquet = output.lower().endswith(".parquet")
    if to_parquet:
        source = srcs[0] if len(srcs) == 1 else expand_urls(srcs)
    elif len(srcs) == 1:
        source = srcs[0]
    elif all(s.lower().endswith(".parquet") for s in srcs):
        source = srcs
    else:
        raise click.UsageError("several SRC are Parquet files; other sources are one path")
    if media and to_parquet:
        raise click.UsageError("--media records metadata in shards' indexes, not in Parquet")
    meta = None
    if media:
        from ..media import media_meta

        meta = media_meta()
    if not to_parquet and isinstance(source, str) and not os.path.exists(source):
        raise click.BadParameter(f"no such file or folder: {source}", param_hint="SRC")
    try:
        result = convert(
            source,
            output,
            kind=kind,
            fields=chosen,
            extensions=_pairs(exts, "'--ext'") or None,
            key=key,
            split=split,
            manifest=manifest,
            maxcount=maxcount,
            maxsize=maxsize,
            compress=compress,
            aligned=aligned,
            info=parsed_info or None,
            meta=meta,
            engine=engine,
            workers=workers,
            address=address,
            overwrite=overwrite,
            progress=not quiet and None,
            text=not binary,
        )
    except ValueError as exn:
        from ..errors import TarshardsError

        if isinstance(exn, TarshardsError):
            raise
        raise click.UsageError(str(exn)) from None
    if quiet:
        return
    if to_parquet:
        print_err(f"# {result.num_rows} rows, columns {', '.join(result.columns)} -> {output}")
    else:
        print_err(f"# {len(result.shards)} shards, {result.num_samples} samples -> {result.url}")
