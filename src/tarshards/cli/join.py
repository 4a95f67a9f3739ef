"""``tarshards join``: join two data sets by key (:func:`tarshards.join`)."""

from __future__ import annotations

import click

from ._common import CONTEXT_SETTINGS, examples, handle_errors

__all__ = ["join_cmd"]


@click.command(
    "join",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards join texts/manifest.json images/manifest.json --on image.id "
        "--prefix img. -o pairs/manifest.json",
        "tarshards join a/manifest.json b/manifest.json --how left -o ab/manifest.json",
    ),
)
@click.argument("left")
@click.argument("right")
@click.option("-o", "--output", required=True, metavar="MANIFEST", help="The join's manifest.")
@click.option(
    "--on",
    default="__key__",
    show_default=True,
    help="__key__, or a field of the left samples whose text is a right key.",
)
@click.option(
    "--how",
    type=click.Choice(["inner", "left"]),
    default="inner",
    show_default=True,
    help="inner: matched left rows only; left: every left row.",
)
@click.option("--prefix", default="", help="Prepended to the right fields' names (img.).")
@click.option(
    "--keyindex",
    default=None,
    metavar="DIR",
    help="The right side's KeyIndex (default: built beside the output).",
)
@click.option(
    "-p",
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Workers building the key index.",
)
@handle_errors
def join_cmd(left, right, output, on, how, prefix, keyindex, workers):
    """Join LEFT and RIGHT (manifests) by key, without copying either."""
    from ..curate import join

    try:
        m = join(
            left,
            right,
            on=on,
            how=how,
            prefix=prefix,
            output=output,
            keyindex=keyindex,
            workers=workers,
        )
    except ValueError as exn:
        raise click.UsageError(str(exn)) from None
    click.echo(f"{output}: {m.num_samples} rows ({how} join on {on})")
