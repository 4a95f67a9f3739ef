"""``tar2tsv``: tabulate fields of samples as tab-separated text."""

from __future__ import annotations

import itertools
import sys
from typing import Iterator

import click

from ._common import (
    CONTEXT_SETTINGS,
    as_text,
    collect_inputs,
    count_option,
    examples,
    handle_errors,
    inputs_argument,
    on_error_option,
    output_option,
    read_samples,
)

__all__ = ["tsv_cmd"]


def _tsv_cell(data) -> str:
    if data is None:
        return ""
    text = as_text(data)
    if text is None:
        return str(len(data))
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _pick(sample: dict, alternatives: list[str]):
    for ext in alternatives:
        value = sample.get(ext)
        if value is not None:
            return value
    return None


@click.command(
    "tsv",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tar2tsv -f cls small.tar",
        "tar2tsv -f 'jpg;png cls json' --noheader 'train-{0000..0003}.tar' > table.tsv",
    ),
)
@inputs_argument
@click.option(
    "-f", "--fields", default=None, help="Fields to show, space separated; a;b = first present."
)
@count_option("Show")
@click.option("--nokey", is_flag=True, help="Leave out the __key__ column.")
@click.option("--noheader", is_flag=True, help="Leave out the header line.")
@output_option("file")
@on_error_option()
@handle_errors
def tsv_cmd(
    inputs: tuple[str, ...],
    fields: str | None,
    count: int | None,
    nokey: bool,
    noheader: bool,
    output: str,
    on_error: str,
) -> None:
    """Tabulate fields of samples: text fields as text, binary fields as their size in bytes."""
    columns = None
    if fields is not None:
        columns = [f.split(";") for f in fields.split()]
        if not columns or not all(all(c) for c in columns):
            raise click.BadParameter("no field names given (or an empty one)", param_hint="'-f'")
    urls = collect_inputs(inputs)
    samples: Iterator[dict] = read_samples(urls, on_error)
    if count is not None:
        samples = itertools.islice(samples, count)
    out = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")
    try:
        header_done = noheader
        for sample in samples:
            if columns is None:
                columns = [[k] for k in sample if not k.startswith("__")]
            if not header_done:
                names = ([] if nokey else ["__key__"]) + [";".join(c) for c in columns]
                out.write("\t".join(names) + "\n")
                header_done = True
            cells = [] if nokey else [sample["__key__"]]
            cells += [_tsv_cell(_pick(sample, c)) for c in columns]
            out.write("\t".join(cells) + "\n")
        if not header_done and columns is not None:
            out.write(
                "\t".join(([] if nokey else ["__key__"]) + [";".join(c) for c in columns]) + "\n"
            )
        out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
