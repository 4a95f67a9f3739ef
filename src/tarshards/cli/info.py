"""``tarshards info``: what a dataset spec holds (sources, sample and byte counts, weights and
the share of every batch and of an epoch each source gets, after subsets and repeats); for a
manifest, a view or a shard spec, the same for its one source."""

from __future__ import annotations

import json

import click

from ._common import CONTEXT_SETTINGS, DataError, examples, handle_errors

__all__ = ["format_info", "info_cmd"]


def _human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def format_info(info: dict) -> str:
    """The text ``tarshards info`` prints for :func:`tarshards.curate.spec.spec_info`'s dict."""
    if "splits" in info:
        return "\n\n".join(
            format_info(dict(part, spec=f"{info['spec']} (split {name})"))
            for name, part in info["splits"].items()
        )
    rows = [
        (
            "source",
            "kind",
            "shards",
            "samples",
            "subset",
            "selected",
            "bytes",
            "weight",
            "repeat",
            "share",
            "epoch",
        )
    ]
    for s in info["sources"]:
        rows.append(
            (
                s["name"],
                s["kind"],
                str(s["shards"]),
                str(s["samples"]),
                "-" if s["subset"] is None else "-".join(s["subset"]),
                str(s["selected"]),
                _human(s["bytes"]),
                _number(s["weight"]),
                _number(s["repeat"]),
                f"{100 * s['share']:.1f}%",
                "-" if s["epoch_samples"] is None else str(s["epoch_samples"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    left = {0, 1, 4}
    lines = [
        f"{info['spec']}: {len(info['sources'])} source(s), {info['samples']} samples, "
        f"{_human(info['bytes'])}; stop: {info['stop']}"
        + ("" if info.get("unit", "samples") == "samples" else f"; weights of {info['unit']}")
    ]
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
    if "batches" in info:
        lines.append(
            f"an epoch: {info['epoch_samples']} samples, {info['batches']} batches of "
            f"{info['batch_size']} over {info['readers']} readers"
        )
    elif info["epoch_samples"] is None:
        lines.append("an epoch: --readers V --batch-size B say how many samples (by tokens)")
    else:
        lines.append(
            f"an epoch: {info['epoch_samples']} samples (with one reader; readers=V and "
            ".batched(B) round each source to whole batches)"
        )
    return "\n".join(lines)


@click.command(
    "info",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshards info train.yaml",
        "tarshards info train.yaml --split val --json",
        "tarshards info data/manifest.json",
        "tarshards info 'shards/train-{0000..0099}.tar'",
    ),
)
@click.argument("inputs", nargs=-1, required=True, metavar="SPEC")
@click.option("--split", default=None, metavar="NAME", help="The split of a spec with splits.")
@click.option(
    "--readers",
    type=click.IntRange(min=1),
    default=None,
    metavar="V",
    help="With --batch-size: the exact epoch of WebDataset(SPEC, readers=V).batched(B).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    metavar="B",
    help="With --readers: the batch size of that epoch.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@handle_errors
def info_cmd(
    inputs: tuple[str, ...],
    split: str | None,
    readers: int | None,
    batch_size: int | None,
    as_json: bool,
) -> None:
    """Show what a dataset spec (.yaml), a manifest, a view or a shard spec holds: its sources,
    their samples and bytes, subsets, weights, repeats, and the share of every batch and the
    samples of an epoch each source gets."""
    from ..curate.spec import spec_info

    source: str | list[str] = inputs[0] if len(inputs) == 1 else list(inputs)
    if (readers is None) != (batch_size is None):
        raise click.UsageError("--readers and --batch-size go together")
    try:
        info = spec_info(source, split=split, readers=readers, batch_size=batch_size)
    except (ValueError, FileNotFoundError) as exn:
        raise DataError(str(exn)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        click.echo(format_info(info))
