"""``tarshards split MANIFEST --into NAME=SHARE ... -O DIR``: named splits of a data set as views
(decided by a hash of the key: stable when shards are added). ``tarshards split`` without
``--into`` splits a tar stream into shards (``tarsplit``, :mod:`tarshards.cli.split`)."""

from __future__ import annotations

import click

from ._common import print_err

__all__ = ["parse_shares", "split_views"]


def parse_shares(items: tuple[str, ...]) -> dict[str, float]:
    """``("train=0.98", "val=0.02")`` (or ``"train=0.98,val=0.02"``) -> ``{"train": 0.98, ...}``."""
    out: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            name, sep, share = part.partition("=")
            try:
                value = float(share.rstrip("%")) / (100.0 if share.endswith("%") else 1.0)
            except ValueError:
                value = -1.0
            if not sep or not name.strip() or value < 0:
                raise click.BadParameter(
                    f"{part!r} is not NAME=SHARE (train=0.98, val=2%)", param_hint="'--into'"
                )
            out[name.strip()] = value
    return out


def split_views(
    inputs: tuple[str, ...], into: tuple[str, ...], output_dir: str | None, seed: int, quiet: bool
) -> None:
    from ..curate.views import split

    if len(inputs) != 1:
        raise click.UsageError("--into splits one MANIFEST|VIEW into views")
    if output_dir is None:
        raise click.UsageError("--into needs -O/--output-dir DIR (where NAME.view.json go)")
    made = split(inputs[0], parse_shares(into), output_dir=output_dir, seed=seed)
    if not quiet:
        for name, v in made.items():
            print_err(f"# {name}: {len(v)} samples -> {v.url}")
