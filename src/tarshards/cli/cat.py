"""``tarscat``: concatenate the samples of its inputs into one tar stream (take, skip, shuffle)."""

from __future__ import annotations

import itertools
from typing import Iterator

import click

from ..format.selection import is_view_spec
from ..pipeline.stages import shuffle as shuffle_stage
from ..write.writer import TarWriter
from ._common import (
    CONTEXT_SETTINGS,
    Progress,
    check_stdout_not_tty,
    collect_inputs,
    count_option,
    examples,
    files_from_option,
    handle_errors,
    inputs_argument,
    members_of,
    on_error_option,
    output_dest,
    output_option,
    quiet_option,
    read_samples,
    shuffle_options,
    skip_option,
)

__all__ = ["cat_cmd"]


def _with_views(inputs, listfile, on_error: str) -> Iterator[dict]:
    """The samples of INPUTS in turn, a view's (``*.view.json``) as it selects them."""
    from ..pipeline.dataset import WebDataset

    for spec in inputs:
        if is_view_spec(spec):
            yield from WebDataset(spec, on_error="raise" if on_error == "raise" else "warn")
        else:
            yield from read_samples(collect_inputs([spec]), on_error)
    if listfile is not None:
        yield from read_samples(collect_inputs([], listfile), on_error)


@click.command(
    "cat",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarscat -c 10 imagenet-0000.tar > small.tar",
        "tarscat 'train-{0000..0009}.tar' --shuffle 1000 --seed 1 -o mixed.tar",
        "curl -s URL | tarscat -s 100 -c 10 | tar tvf -",
    ),
)
@inputs_argument
@output_option()
@count_option("Write")
@skip_option
@shuffle_options
@files_from_option
@on_error_option()
@quiet_option()
@handle_errors
def cat_cmd(
    inputs: tuple[str, ...],
    output: str,
    count: int | None,
    skip: int,
    shuffle: int,
    seed: int,
    listfile: str | None,
    on_error: str,
    quiet: bool,
) -> None:
    """Concatenate the samples of INPUTS (files, URLs, brace specs; default stdin) into one tar."""
    check_stdout_not_tty(output)
    samples: Iterator[dict]
    if any(is_view_spec(s) for s in inputs):  # a view: only its samples (their bytes) are read
        samples = _with_views(inputs, listfile, on_error)
    else:
        urls = collect_inputs(inputs, listfile)
        samples = read_samples(urls, on_error)
    if shuffle > 1:
        samples = shuffle_stage(samples, shuffle, seed=seed)
    if skip or count is not None:
        samples = itertools.islice(samples, skip, None if count is None else skip + count)
    with Progress(quiet, "tarscat") as bar, TarWriter(output_dest(output), encoder=False) as sink:
        write = sink.write_members
        for sample in bar.wrap(samples):
            write(members_of(sample))
