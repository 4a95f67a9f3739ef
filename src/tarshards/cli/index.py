"""``tarshards index``: the manifest and per-shard indexes of existing shards.

Each shard is read once from its start to its end (local or any URL the library reads; plain,
gzip or zstd; written by GNU tar, Python's tarfile, webdataset or tarshards), its bytes hashed,
its samples and members located. The indexes go beside the shards when they lie under the
manifest's directory, else into ``_index/`` beside the manifest. Shards are indexed in parallel
(``-p``), with a progress bar on stderr, on this machine or on a cluster (``--engine dask|ray``,
one task per shard, retried when its worker dies). Each index is saved as soon as it is made: a
rerun reads only the shards that have no index yet (``--overwrite`` reads them all), and
``--append`` adds new shards to an existing manifest without reading the old ones.
"""

from __future__ import annotations

import os

import click

from ..format.hashing import DEFAULT_HASH, HASHES
from ._common import (
    CONTEXT_SETTINGS,
    collect_inputs,
    files_from_option,
    handle_errors,
    on_error_option,
    one_blas_thread,
    print_err,
    quiet_option,
)

__all__ = ["index_cmd"]


@click.command(
    "index",
    context_settings=CONTEXT_SETTINGS,
    epilog="\b\nExamples:\n"
    "  tarshards index 'train-{0000..0147}.tar' -o train.json\n"
    "  tarshards index -p 8 's3://bucket/ds/train-{0000..0999}.tar' -o ds.json\n"
    "  tarshards index --dali shards/*.tar -o shards/manifest.json\n"
    "  tarshards index --media 'clips-{0000..0099}.tar' -o clips.json\n"
    "  tarshards index 'ds/train-{0000..9999}.tar' -o ds/train.json --engine dask \\\n"
    "      --address tcp://scheduler:8786\n"
    "  tarshards index --append 'train-{0148..0150}.tar' -o train.json",
)
@click.argument("inputs", nargs=-1, metavar="SPEC...")
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="MANIFEST",
    help="The manifest to write (path or URL, .json).",
)
@files_from_option
@click.option(
    "-p",
    "--parallel",
    type=click.IntRange(min=1),
    default=None,
    help="Shards at once: threads where hashing runs without the GIL, else processes (default: "
    "one per CPU, or 1 where it would take processes).",
)
@click.option(
    "--hash",
    "hash_name",
    type=click.Choice(HASHES),
    default=DEFAULT_HASH,
    metavar="ALGO",
    help=f"Shard hash: {', '.join(HASHES)}.",
)
@click.option(
    "--engine",
    type=click.Choice(["processes", "dask", "ray"]),
    default=None,
    help="Index one task per shard on local processes, a Dask or a Ray cluster (default: "
    "threads on this machine).",
)
@click.option(
    "--address",
    metavar="URL",
    help="The cluster of --engine: a Dask scheduler (tcp://host:8786) or a Ray address "
    "(auto, ray://host:10001); default: a local one of -p workers.",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="With --engine: extra attempts for a shard whose worker died or hit an I/O error.",
)
@click.option(
    "--append",
    is_flag=True,
    help="Add the shards MANIFEST does not list yet after its records (the old shards are not "
    "read).",
)
@click.option(
    "--overwrite", is_flag=True, help="Index every shard again (default: reuse complete indexes)."
)
@click.option("--dali", is_flag=True, help="Also write DALI indexes (SHARD.idx).")
@click.option(
    "--media",
    is_flag=True,
    help="Also record media metadata columns in the indexes (jpg.width, jpg.height, "
    "mp4.duration, mp4.fps, mp4.frames, flac.rate...; image headers and container headers "
    "only, nothing decoded; needs tarshards[av] for audio and video).",
)
@click.option(
    "--keyframes",
    is_flag=True,
    help="With --media: also store each video member's keyframe table (times and byte "
    "positions; demuxes every video), so random access fetches a clip's packets at once.",
)
@on_error_option("a bad shard", "leave it out")
@quiet_option()
@handle_errors
def index_cmd(
    inputs: tuple[str, ...],
    output: str,
    listfile: str | None,
    parallel: int | None,
    hash_name: str,
    engine: str | None,
    address: str | None,
    retries: int,
    append: bool,
    overwrite: bool,
    dali: bool,
    media: bool,
    keyframes: bool,
    on_error: str,
    quiet: bool,
) -> None:
    """Index shards: write MANIFEST (counts, sizes, hashes) and one index per shard."""
    with one_blas_thread():
        from ..format.index import INDEX_SUFFIX
        from ..format.manifest import Manifest, build_manifest
    if not inputs and listfile is None:
        raise click.UsageError("name the shards to index (SPEC... or -T FILE)")
    if keyframes and not media:
        raise click.UsageError("--keyframes goes with --media")
    views = [i for i in inputs if i.lower().endswith(".view.json")]
    if views:  # a view selects indexed samples: there is nothing of its own to index
        raise click.BadParameter(
            f"{views[0]} is a view: it selects samples of a manifest whose shards are indexed "
            "already (a view is read through those indexes), so it has nothing to index. "
            "Index the shards themselves (tarshards index SPEC -o MANIFEST), then make the "
            "view over that manifest (tarshards view MANIFEST ...)",
            param_hint="SPEC",
        )
    urls = collect_inputs(inputs, listfile)
    if "-" in urls:
        raise click.BadParameter(
            "shards are indexed from files or URLs, not stdin", param_hint="SPEC"
        )
    if address is not None and engine not in ("dask", "ray"):
        raise click.UsageError("--address needs --engine dask or --engine ray")
    if append and overwrite:
        raise click.UsageError("--append keeps the manifest's shards; --overwrite redoes them")
    prog = click.get_current_context().command_path
    before = None
    if append:
        try:
            before = Manifest.load(output)
        except FileNotFoundError:  # no manifest yet: a plain build
            pass
    skipped: list[str] = []

    def report(url: str, exc: BaseException) -> None:
        skipped.append(url)
        print_err(f"{prog}: warning: left out {url}: {exc}")

    manifest = build_manifest(
        urls,
        output,
        hash=hash_name,
        workers=parallel,
        progress=not quiet,
        on_error="skip" if on_error == "skip" else "raise",
        report=report,
        engine=engine,
        address=address,
        retries=retries,
        append=append,
        overwrite=overwrite,
    )
    if media:
        from ..media.metadata import add_media_meta

        manifest = add_media_meta(manifest, workers=parallel, keyframes=keyframes)
        if not quiet:
            print_err(f"# media columns: {', '.join(manifest.meta_columns()) or 'none'}")
    if dali:
        start = 0 if before is None else len(before.shards)  # appended: the new shards
        for i, rec in enumerate(manifest.shards[start:], start):
            idx = manifest.load_index(i)
            if idx.compression != "none":
                print_err(f"{prog}: warning: no DALI index for compressed {rec.url}")
                continue
            path = manifest.index_url(i)
            assert path is not None  # load_index(i) raised otherwise
            idx.save_dali(
                path[: -len(INDEX_SUFFIX)] + ".idx"
                if path.endswith(INDEX_SUFFIX)
                else path + ".idx"
            )
    if not quiet:
        print_err(
            f"# {len(manifest.shards)} shards, {manifest.num_samples} samples -> "
            f"{os.fspath(output)}"
        )
        if before is not None:
            added = len(manifest.shards) - len(before.shards)
            print_err(
                f"# appended {added} shards, {manifest.num_samples - before.num_samples} "
                f"samples; fingerprint {before.fingerprint} -> {manifest.fingerprint}"
            )
    if skipped:
        click.get_current_context().exit(1)
