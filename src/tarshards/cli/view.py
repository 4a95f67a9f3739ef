"""``tarshards view``: a view of a data set (a filter), saved beside it, no sample copied."""

from __future__ import annotations

from typing import Any

import click

from ._common import CONTEXT_SETTINGS, examples, handle_errors, print_err, quiet_option

__all__ = ["engine_options", "read_keys", "view_cmd"]


def read_keys(path: str) -> list[str]:
    """Keys, one a line (blank lines and ``#`` comments skipped), from a file (``-``: stdin)."""
    stream = click.open_file(path, "r", encoding="utf-8")
    with stream:
        return [
            line.strip() for line in stream if line.strip() and not line.lstrip().startswith("#")
        ]


def engine_options(fn):
    """``--engine``, ``--address``, ``-p/--workers``: where per-shard tasks run."""
    fn = click.option(
        "-p",
        "--workers",
        type=click.IntRange(min=1),
        default=None,
        help="Worker processes (default: one per CPU).",
    )(fn)
    fn = click.option(
        "--address",
        metavar="URL",
        help="Dask scheduler or Ray address (default: local).",
    )(fn)
    fn = click.option(
        "--engine",
        type=click.Choice(["processes", "dask", "ray"]),
        default="processes",
        show_default=True,
        help="Where the per-shard tasks run.",
    )(fn)
    return fn


def report(what: str, made, quiet: bool) -> None:
    if not quiet:
        removed = made.info.get("removed")
        tail = f", {removed} removed" if removed is not None else ""
        print_err(
            f"# {what}: {len(made)} of {made.manifest.num_samples} samples{tail} -> {made.url}"
        )


@click.command(
    "view",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards view ds/manifest.json --keys keep.txt -o ds/keep.view.json",
        "tarshards view ds/manifest.json --exclude-keys bad.txt -o ds/clean.view.json",
        "tarshards view ds/clean.view.json -f mypkg.filters:good_caption -o ds/good.view.json",
    ),
)
@click.argument("source", metavar="MANIFEST|VIEW")
@click.option(
    "-o", "--output", required=True, metavar="VIEW", help="The view file to write (.view.json)."
)
@click.option(
    "-f",
    "--function",
    metavar="MODULE:FUNCTION",
    help="Keep the samples where fn(sample) is true.",
)
@click.option("--decode", metavar="MODE", help="Decode samples before -f (pil, rgb8...).")
@click.option("--keys", "keys_file", metavar="FILE", help="Keep the keys listed (one a line).")
@click.option(
    "--exclude-keys", "exclude_file", metavar="FILE", help="Drop the keys listed (one a line)."
)
@engine_options
@quiet_option("Do not print what the view holds.")
@handle_errors
def view_cmd(
    source: str,
    output: str,
    function: str | None,
    decode: str | None,
    keys_file: str | None,
    exclude_file: str | None,
    engine: str,
    address: str | None,
    workers: int | None,
    quiet: bool,
) -> None:
    """Write a view of MANIFEST|VIEW: the samples that -f keeps, or those --keys lists, less
    those --exclude-keys lists. Keys are looked up in the shards' indexes (nothing read); -f
    reads the samples, one task a shard. Readers take the view file where they take a
    manifest."""
    from ..curate.views import view

    if function is not None and keys_file is not None:
        raise click.UsageError("give -f or --keys, not both (--exclude-keys goes with either)")
    if function is None and keys_file is None and exclude_file is None:
        raise click.UsageError("give -f MODULE:FUNCTION, --keys FILE or --exclude-keys FILE")
    if decode is not None and function is None:
        raise click.UsageError("--decode applies to -f")
    keep: Any = None
    if function is not None:
        from .map_cmd import load_function

        keep = load_function(function)
    elif keys_file is not None:
        keep = read_keys(keys_file)
    exclude = read_keys(exclude_file) if exclude_file is not None else None
    made = view(
        source,
        keep,
        exclude=exclude,
        output=output,
        decode=decode,
        engine=engine,
        address=address,
        workers=workers,
    )
    report("view", made, quiet)
