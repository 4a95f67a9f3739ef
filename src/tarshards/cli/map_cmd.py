"""``tarshards map``: run a Python function or a per-sample shell command over many shards.

A thin layer over :func:`tarshards.parallel.map_shards`: each input shard becomes the output shard
of the same position, written under a temporary name and committed when complete; outputs that
already exist are skipped (so a job that died is rerun with the same command line), and the summary
table at the end counts shards done, skipped and failed. Exit status 1 when a shard failed.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from typing import Any, Callable

import click

from ..errors import TarshardsError, TarshardsWarning
from ..format.manifest import spec_urls
from ..parallel import FAILED, SKIPPED, format_summary, map_shards, shell_sample_fn
from ..pipeline.stages import reraise_exception, warn_and_continue
from ..read.specs import expand_urls
from ..storage import is_local, local_path
from ._common import (
    CONTEXT_SETTINGS,
    DataError,
    handle_errors,
    on_error_option,
    print_err,
    quiet_option,
)

__all__ = ["load_function", "map_cmd"]

_EPILOG = """\b
Examples:
  tarshards map -c 'mogrify -resize 256x256 *.jpg' 'in-{0000..0999}.tar' -o 'out-{0000..0999}.tar' -p 16
  tarshards map -f mypkg.prep:resize --decode pil 'in-{0000..0999}.tar' -o 's3://b/out-{0000..0999}.tar'
  tarshards map -f mypkg.prep:resize in-{0000..0999}.tar -o out-{0000..0999}.tar \\
      --engine dask --address tcp://scheduler:8786
"""


def load_function(spec: str) -> Callable[..., Any]:
    """``module:function`` (``module.sub:obj.attr``) -> the callable; the current directory is
    searched first, as with ``python -m``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise click.BadParameter(f"{spec!r} is not MODULE:FUNCTION", param_hint="'-f'")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exn:
        raise click.BadParameter(
            f"cannot import {module_name!r}: {exn}", param_hint="'-f'"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise click.BadParameter(
                f"{module_name!r} has no attribute {attr!r}", param_hint="'-f'"
            ) from None
    if not callable(obj):
        raise click.BadParameter(f"{spec!r} is not callable", param_hint="'-f'")
    return obj


@click.command("map", context_settings=CONTEXT_SETTINGS, epilog=_EPILOG)
@click.argument("inputs", nargs=-1, required=True)
@click.option(
    "-o",
    "--output",
    "outputs",
    required=True,
    help="Output shards: a spec naming as many shards as the inputs.",
)
@click.option("-c", "--command", help="Shell command run on each sample (as tarproc -c).")
@click.option(
    "-f",
    "--function",
    "function",
    metavar="MODULE:FUNCTION",
    help="Python function fn(sample) -> sample | None | list of samples.",
)
@click.option(
    "--decode",
    "decode",
    metavar="MODE",
    help="Decode samples before -f (e.g. pil, rgb8, torchrgb); default: raw bytes.",
)
@click.option(
    "--engine",
    type=click.Choice(["processes", "dask", "ray"]),
    default="processes",
    show_default=True,
    help="Local worker processes, a Dask distributed cluster, or a Ray cluster.",
)
@click.option(
    "--address",
    metavar="URL",
    help="Dask scheduler (tcp://host:8786) or Ray address (auto, ray://host:10001); default: a "
    "local cluster of -p workers.",
)
@click.option(
    "-p",
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (default: one per CPU).",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Extra attempts for a shard whose worker died or that hit an I/O error.",
)
@click.option("--overwrite", is_flag=True, help="Redo outputs that already exist.")
@on_error_option("a sample error", "skip the sample")
@quiet_option()
@handle_errors
def map_cmd(
    inputs: tuple[str, ...],
    outputs: str,
    command: str | None,
    function: str | None,
    decode: str | None,
    engine: str,
    address: str | None,
    workers: int | None,
    retries: int,
    overwrite: bool,
    on_error: str,
    quiet: bool,
) -> None:
    """Apply a function or a shell command to every sample of many shards, in parallel.

    INPUTS are shard specs (braces, globs, lists); -o names the output shards, one per input, in
    the same order. With -c, each sample's files are unpacked to a temporary directory as BASE.EXT
    with $KEY set, the command runs there, and the files left form the output sample. With -f the
    function gets sample dicts (raw bytes unless --decode) and returns a sample, None (drop) or a
    list of samples. Tasks are shards: each output appears only when complete, existing outputs
    are skipped (rerun a failed job with the same command), a shard whose worker died is tried
    again. Prints a summary; exit status 1 when a shard failed.
    """
    if (command is None) == (function is None):
        raise click.UsageError("give exactly one of -c COMMAND and -f MODULE:FUNCTION")
    if command is not None and decode is not None:
        raise click.UsageError("--decode applies to -f functions; -c gets the raw files")
    if address is not None and engine not in ("dask", "ray"):
        raise click.UsageError("--address needs --engine dask or --engine ray")
    fn: Callable[..., Any]
    if command is not None:
        fn = shell_sample_fn(command)
    else:
        assert function is not None  # exactly one of the two (checked above)
        fn = load_function(function)
    try:
        ins = spec_urls(list(inputs))  # a manifest names its shards
        outs = expand_urls(outputs)
    except (ValueError, FileNotFoundError) as exn:
        raise click.BadParameter(str(exn)) from None
    if len(ins) != len(outs):
        raise click.BadParameter(
            f"{len(ins)} input shards but -o names {len(outs)}", param_hint="'-o'"
        )
    missing = [u for u in ins if is_local(u) and u != "-" and not os.path.exists(local_path(u))]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DataError(f"no such input shard: {missing[0]}{more}")
    handler = warn_and_continue if on_error == "skip" else reraise_exception
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)  # failures are listed below
        try:
            reports = map_shards(
                fn,
                ins,
                outs,
                engine=engine,
                workers=workers,
                address=address,
                retries=retries,
                overwrite=overwrite,
                decode=decode,
                handler=handler,
                progress=not quiet and None,
            )
        except ValueError as exn:
            if isinstance(exn, TarshardsError):
                raise
            raise click.UsageError(str(exn)) from None
    wall = time.monotonic() - t0
    failed = [r for r in reports if r.status == FAILED]
    for r in failed:
        print_err(f"failed: {r.input} -> {r.output}: {r.error}")
    kept = [r for r in reports if r.status == SKIPPED]
    if kept:
        print_err(
            f"{len(kept)} of {len(reports)} outputs exist already and were kept, not made "
            f"again ({kept[0].output}{' ...' if len(kept) > 1 else ''}): a changed function or "
            "command does not reach them; rerun with --overwrite to redo them"
        )
    skipped_samples = [r for r in reports if r.messages]
    for r in skipped_samples[:10]:
        print_err(f"skipped {r.samples_skipped} sample(s) in {r.input}; first: {r.messages[0]}")
    click.echo(format_summary(reports, wall))
    if failed:
        sys.exit(1)
