"""``tarshards columns``: add a sidecar column group to a data set (:func:`tarshards.add_columns`).

``tarshards columns MANIFEST -f mypkg.captions:caption -o cols/manifest.json`` runs the function
``caption(sample) -> {field: value}`` over every sample and writes only the new fields, into
sidecar shards beside the output manifest, aligned row by row with the base shards.
"""

from __future__ import annotations

import click

from ._common import CONTEXT_SETTINGS, examples, handle_errors

__all__ = ["columns_cmd"]


@click.command(
    "columns",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards columns data/manifest.json -f mypkg.captions:caption -o cols/manifest.json",
        "tarshards columns data/manifest.json -f mypkg.emb:embed --decode rgb --name emb "
        "-o emb/manifest.json --engine dask --address tcp://scheduler:8786",
    ),
)
@click.argument("manifest")
@click.option(
    "-f",
    "--function",
    "function",
    required=True,
    metavar="MODULE:FUNCTION",
    help="fn(sample) -> {field: value}: the new fields of each sample.",
)
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="MANIFEST",
    help="The output manifest (the sidecar shards go beside it).",
)
@click.option("--name", default=None, help="The column group's name (default: columns).")
@click.option(
    "--fields",
    default=None,
    metavar="F1,F2",
    help="Read only these fields of the source (what the function needs).",
)
@click.option(
    "--decode",
    default=None,
    metavar="MODE",
    help="Decode samples before the function (pil, rgb, ...); default raw bytes.",
)
@click.option(
    "--engine",
    type=click.Choice(["processes", "dask", "ray"]),
    default="processes",
    show_default=True,
    help="Where the shard tasks run.",
)
@click.option(
    "-p",
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (default: one per CPU).",
)
@click.option("--address", default=None, help="The Dask scheduler or Ray cluster.")
@click.option("--keep", is_flag=True, help="Keep sidecar shards a killed run completed.")
@handle_errors
def columns_cmd(manifest, function, output, name, fields, decode, engine, workers, address, keep):
    """Add a sidecar column group: the new fields of each sample, in shards of their own."""
    from ..curate import add_columns
    from .map_cmd import load_function

    fn = load_function(function)
    m = add_columns(
        manifest,
        fn,
        output=output,
        name=name,
        fields=None if fields is None else [f for f in fields.split(",") if f],
        decode=decode,
        engine=engine,
        workers=workers,
        address=address,
        overwrite=not keep,
    )
    g = m.columns[-1]
    click.echo(
        f"{output}: column group {g.name!r} ({', '.join(g.fields)}) over {m.num_samples} "
        f"samples in {len(g.shards)} shards, {sum(r.nbytes or 0 for r in g.shards):,} bytes"
    )
