"""``tarshards bench SPEC``: where your input pipeline's time goes, on your data.

The measuring is :func:`tarshards.benchmark.bench_pipeline`; this module only parses options
and prints (a table, ``--json``, a PNG with ``--plot``).
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any, Callable

import click

from ..benchmark import bench_pipeline, dataset_from_options, format_report, plot_report
from ..codecs.images import EXTRA_MODES, IMAGE_MODES
from ._common import CONTEXT_SETTINGS, handle_errors, print_err

__all__ = ["bench_cmd"]


def _load_factory(ref: str) -> Callable[..., Any]:
    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise click.BadParameter(f"expected MODULE:FUNCTION, got {ref!r}", param_hint="--pipeline")
    sys.path.insert(0, ".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot load {ref!r}: {exc}", param_hint="--pipeline") from None
    finally:
        sys.path.pop(0)
    return fn


@click.command(
    "bench",
    context_settings=CONTEXT_SETTINGS,
    epilog="""\b
Examples:
  tarshards bench 'train-{0000..0009}.tar' --decode rgb8 --to-tuple 'jpg cls' --batch-size 64
  tarshards bench 'train-{0000..0009}.tar' --crop 224 --to-tuple 'jpg cls' --workers 4
  tarshards bench 'clips-{0000..0009}.tar' --media --frames 16 --to-tuple 'mp4 txt'
  tarshards bench 's3://bucket/train-{0000..0099}.tar' --pipeline mytrain:make_dataset --json
""",
)
@click.argument("spec")
@click.option(
    "--decode",
    "decode",
    multiple=True,
    metavar="MODE",
    help="Decode images with this mode (pil, rgb8, torchrgb...); repeatable.",
)
@click.option(
    "--crop",
    type=click.IntRange(min=1),
    default=None,
    metavar="SIZE",
    help="Decode images to random_resized_crop(SIZE) (float tensors with torch).",
)
@click.option(
    "--media",
    is_flag=True,
    help="Decode video fields to clips (tarshards.video, --frames frames) and audio fields "
    "(tarshards.audio).",
)
@click.option(
    "--frames",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Frames per video clip with --media.",
)
@click.option(
    "--shuffle",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="A shuffle buffer of N samples (and shard shuffling).",
)
@click.option(
    "--to-tuple",
    "fields",
    default=None,
    metavar="'F1 F2'",
    help="Keep these fields as a tuple (e.g. 'jpg cls').",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Batch inside the pipeline (.batched(N)); the loader then gets batches.",
)
@click.option(
    "--pipeline",
    "factory",
    default=None,
    metavar="MODULE:FUNCTION",
    help="Your own pipeline: FUNCTION(spec) returns a WebDataset / DataPipeline "
    "(or any iterable); replaces the options above.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=None,
    help="DataLoader workers for the loader row (default 2 with torch; 0: none).",
)
@click.option(
    "-n",
    "--samples",
    "max_samples",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="Samples per measurement.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="At most this long per measurement.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--plot", default=None, metavar="FILE.png", help="Also draw a PNG bar chart.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def bench_cmd(
    spec: str,
    decode: tuple[str, ...],
    crop: int | None,
    media: bool,
    frames: int,
    shuffle: int,
    fields: str | None,
    batch_size: int | None,
    factory: str | None,
    workers: int | None,
    max_samples: int,
    seconds: float,
    as_json: bool,
    plot: str | None,
    quiet: bool,
) -> None:
    """Measure an input pipeline on SPEC's shards: raw read MB/s against cat (local) or a plain
    GET (remote), samples/s after each stage (read, decode, transforms, batching) and through
    a DataLoader, time to the first sample and batch, peak memory, and what bounds it."""
    for mode in decode:
        if mode not in IMAGE_MODES and mode not in EXTRA_MODES:
            raise click.BadParameter(
                f"unknown decoding mode {mode!r}; choose one of {', '.join(sorted(IMAGE_MODES))}",
                param_hint="--decode",
            )
    if factory is not None:
        dataset = _load_factory(factory)(spec)
    else:
        try:
            dataset = dataset_from_options(
                spec,
                shuffle=shuffle,
                decode=decode,
                crop=crop,
                media=media,
                frames=frames,
                fields=fields,
                batch_size=batch_size,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    report = bench_pipeline(
        spec,
        dataset,
        max_samples=max_samples,
        seconds_per_stage=seconds,
        workers=workers,
        progress=not quiet and sys.stderr.isatty(),
    )
    if plot:
        plot_report(report, plot)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(report))
        if plot:
            print_err(f"chart: {plot}")
