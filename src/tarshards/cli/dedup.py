"""``tarshards dedup``: a view keeping the first of each group of duplicate samples."""

from __future__ import annotations

import click

from ._common import CONTEXT_SETTINGS, examples, handle_errors, quiet_option
from .view import engine_options, report

__all__ = ["dedup_cmd"]


@click.command(
    "dedup",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards dedup ds/manifest.json -o ds/unique.view.json      # by content, no data read",
        "tarshards dedup ds/manifest.json --by txt -o ds/unique-captions.view.json",
        "tarshards dedup ds/clean.view.json -f mypkg.keys:phash -o ds/unique.view.json",
    ),
)
@click.argument("source", metavar="MANIFEST|VIEW")
@click.option(
    "-o", "--output", required=True, metavar="VIEW", help="The view file to write (.view.json)."
)
@click.option(
    "--by",
    default="content",
    show_default=True,
    metavar="content|FIELD",
    help="content (no data read) or a FIELD's bytes.",
)
@click.option(
    "-f",
    "--function",
    metavar="MODULE:FUNCTION",
    help="Duplicates: equal fn(sample) (instead of --by).",
)
@click.option("--decode", metavar="MODE", help="Decode samples before -f (pil, rgb8...).")
@engine_options
@quiet_option("Do not print how many samples were removed.")
@handle_errors
def dedup_cmd(
    source: str,
    output: str,
    by: str,
    function: str | None,
    decode: str | None,
    engine: str,
    address: str | None,
    workers: int | None,
    quiet: bool,
) -> None:
    """Write a view of MANIFEST|VIEW that keeps the first (in its order) of each group of
    duplicate samples; print how many were removed."""
    from ..curate.views import dedup

    key: object = by
    if function is not None:
        from .map_cmd import load_function

        key = load_function(function)
    made = dedup(
        source,
        by=key,  # type: ignore[arg-type]
        output=output,
        decode=decode,
        engine=engine,
        address=address,
        workers=workers,
    )
    report("dedup", made, quiet)
