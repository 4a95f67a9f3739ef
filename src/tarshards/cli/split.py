"""``tarsplit``: split a tar stream into shards by size or count, never splitting a sample."""

from __future__ import annotations

import click

from ..format.compression import GZIP, ZSTD
from ..write.writer import ShardWriter, shard_name
from ._common import (
    CONTEXT_SETTINGS,
    SIZE,
    collect_inputs,
    examples,
    handle_errors,
    inputs_argument,
    on_error_option,
    print_err,
    quiet_option,
    read_samples,
)

__all__ = ["split_cmd"]


class _MaxShardsReached(Exception):
    pass


@click.command(
    "split",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tar -cf - --sort=name -C /data/imagenet train | tarsplit -s 1e9 -o imagenet_train",
        "tarsplit -n 1000 -z -o shards/part big.tar   # shards/part-000000.tgz ...",
        "tarscat 'in-{000..099}.tar' | tarsplit -s 500M --maxshards 2 -o sample",
        "tarshards split ds/manifest.json --into train=98%,val=2% -O ds/splits  # views",
    ),
)
@inputs_argument
@click.option(
    "-o",
    "--output",
    "prefix",
    default="shard",
    show_default=True,
    help="Output prefix (or a pattern like out-%06d.tar).",
)
@click.option(
    "-s",
    "--maxsize",
    type=SIZE,
    default="3e9",
    show_default=True,
    help="Largest shard (uncompressed): 1e9, 500M, 2G.",
)
@click.option(
    "-n",
    "--maxcount",
    type=click.IntRange(min=1),
    default=100_000,
    show_default=True,
    help="Most samples per shard.",
)
@click.option(
    "--maxshards", type=click.IntRange(min=1), default=None, help="Stop after writing N shards."
)
@click.option(
    "--start",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Number of the first shard.",
)
@click.option("-z", "--gzip", "gz", is_flag=True, help="Write gzip-compressed shards (.tgz).")
@click.option("--zstd", is_flag=True, help="Write zstd-compressed shards (.tar.zst).")
@click.option(
    "--aligned",
    is_flag=True,
    help="With -z/--zstd: each sample decompresses alone (random access).",
)
@click.option(
    "--manifest", default=None, metavar="PATH", help="Write a manifest and shard indexes."
)
@click.option(
    "--into",
    multiple=True,
    metavar="NAME=SHARE",
    help="Views of a MANIFEST|VIEW: train=98%,val=2%.",
)
@click.option(
    "-O", "--output-dir", default=None, metavar="DIR", help="With --into: DIR/NAME.view.json."
)
@click.option("--seed", type=int, default=0, show_default=True, help="With --into: hash seed.")
@on_error_option()
@quiet_option("Do not list the shards being written.")
@handle_errors
def split_cmd(
    inputs: tuple[str, ...],
    prefix: str,
    maxsize: int,
    maxcount: int,
    maxshards: int | None,
    start: int,
    gz: bool,
    zstd: bool,
    on_error: str,
    quiet: bool,
    aligned: bool = False,
    manifest: str | None = None,
    into: tuple[str, ...] = (),
    output_dir: str | None = None,
    seed: int = 0,
) -> None:
    """Split a tar stream (default stdin) into shards PREFIX-000000.tar..., samples kept whole.

    With --into NAME=SHARE: split a MANIFEST or VIEW into one view per name instead (no data
    copied), each sample's split decided by a hash of (--seed, its key)."""
    if into:
        from .split_views import split_views

        split_views(inputs, into, output_dir, seed, quiet)
        return
    if gz and zstd:
        raise click.UsageError("choose one of -z/--gzip and --zstd")
    urls = collect_inputs(inputs)
    suffix = GZIP.suffix if gz else ZSTD.suffix if zstd else ".tar"
    pattern = prefix if ("%" in prefix or "{" in prefix) else f"{prefix}-%06d{suffix}"
    try:
        shard_name(pattern, start)
    except (ValueError, TypeError) as exn:
        raise click.BadParameter(str(exn), param_hint="'-o'") from None

    def post(url: str) -> None:
        if maxshards is not None and len(sink.shards) >= maxshards:
            raise _MaxShardsReached()

    sink = ShardWriter(
        pattern,
        maxcount=maxcount,
        maxsize=maxsize,
        start_shard=start,
        post=post,
        encoder=False,
        manifest=manifest,
        aligned=aligned,
    )
    current = None
    nsamples = nbytes = 0
    stopped = False
    samples = read_samples(urls, on_error)
    try:
        with sink:
            for sample in samples:
                n = sink.write(sample)
                if sink.fname != current:
                    current = sink.fname
                    if not quiet:
                        print_err(f"# writing {current} ({nsamples}, {nbytes})")
                nsamples += 1
                nbytes += n
    except _MaxShardsReached:
        stopped = True
        sink.save_manifest()  # of the complete shards
    finally:
        samples.close()
    done = sum(s.count for s in sink.shards)
    if stopped:
        print_err(
            f"{click.get_current_context().command_path}: stopped after --maxshards "
            f"{maxshards}: wrote {len(sink.shards)} complete shards ({done} samples); "
            "the rest of the input was not read"
        )
    elif not quiet:
        print_err(f"# done: {len(sink.shards)} shards, {done} samples")
