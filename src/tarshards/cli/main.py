"""Entry points of the command-line tools and the ``tarshards`` command group.

Each tool is one click command, installed both as its own script (``tarscat``) and as a
subcommand (``tarshards cat``). Reading goes through :func:`tarshards.pipeline.iter_samples`,
writing through :class:`tarshards.writer.TarWriter` / :class:`~tarshards.writer.ShardWriter`;
fields pass through as raw bytes, never decoded.
"""

from __future__ import annotations

import io
import itertools
import re
import sys

import click

from ..pipeline import iter_samples
from ..stages import reraise_exception, shuffle as shuffle_stage
from ..writer import ShardWriter, TarWriter, shard_name
from ._common import (
    CONTEXT_SETTINGS,
    SIZE,
    Progress,
    check_stdout_not_tty,
    output_dest,
    collect_inputs,
    handle_errors,
    members_of,
    print_err,
)

__all__ = [
    "main", "tar2tsv", "tarcheck", "tarpcat", "tarproc", "tarscat", "tarshow", "tarsort",
    "tarsplit",
]


def skip_handler(prog: str):
    """An error handler that reports a bad shard on stderr and goes on with the next one."""

    def handler(exn) -> bool:
        print_err(f"{prog}: warning: skipped the rest of a shard: {exn}")
        return True

    return handler


def error_handler(on_error: str):
    if on_error == "abort":
        return reraise_exception
    return skip_handler(click.get_current_context().command_path)


def read_samples(urls, on_error: str = "abort"):
    """Samples of ``urls`` in turn, fields as raw bytes."""
    return iter_samples(urls, handler=error_handler(on_error))


_ON_ERROR = click.Choice(["abort", "skip"])


def _examples(*lines: str) -> str:
    # "\b" keeps click from rewrapping the example lines
    return "\b\nExamples:\n" + "\n".join(f"  {ln}" for ln in lines)


# ---------------------------------------------------------------------------------------------
# tarscat
# ---------------------------------------------------------------------------------------------


@click.command("cat", context_settings=CONTEXT_SETTINGS, epilog=_examples(
    "tarscat -c 10 imagenet-0000.tar > small.tar",
    "tarscat 'train-{0000..0009}.tar' --shuffle 1000 --seed 1 -o mixed.tar",
    "curl -s URL | tarscat -s 100 -c 10 | tar tvf -"))
@click.argument("inputs", nargs=-1, metavar="[INPUTS]...")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file or URL; - is stdout.")
@click.option("-c", "--count", type=click.IntRange(min=0), default=None,
              help="Write at most N samples.")
@click.option("-s", "--skip", type=click.IntRange(min=0), default=0,
              help="Skip the first N samples.")
@click.option("--shuffle", type=click.IntRange(min=0), default=0, metavar="N",
              help="Shuffle with a buffer of N samples.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for --shuffle.")
@click.option("-T", "--files-from", "listfile", default=None, metavar="FILE",
              help="Read input URLs from FILE, one per line.")
@click.option("-e", "--on-error", type=_ON_ERROR, default="abort", show_default=True,
              help="On a bad shard: stop, or skip its rest.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def cat_cmd(inputs, output, count, skip, shuffle, seed, listfile, on_error, quiet):
    """Concatenate the samples of INPUTS (files, URLs, brace specs; default stdin) into one tar."""
    urls = collect_inputs(inputs, listfile)
    check_stdout_not_tty(output)
    samples = read_samples(urls, on_error)
    if shuffle > 1:
        samples = shuffle_stage(samples, shuffle, seed=seed)
    if skip or count is not None:
        samples = itertools.islice(samples, skip, None if count is None else skip + count)
    with Progress(quiet, "tarscat") as bar, \
            TarWriter(output_dest(output), encoder=False) as sink:
        write = sink.write_members
        for sample in bar.wrap(samples):
            write(members_of(sample))


# ---------------------------------------------------------------------------------------------
# tar2tsv
# ---------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def as_text(data: bytes) -> str | None:
    """The bytes as text when they are printable UTF-8, else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _CONTROL.search(text):
        return None
    return text


def _tsv_cell(data) -> str:
    if data is None:
        return ""
    text = as_text(data)
    if text is None:
        return str(len(data))
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace(
        "\r", "\\r")


def _pick(sample: dict, alternatives: list[str]):
    for ext in alternatives:
        value = sample.get(ext)
        if value is not None:
            return value
    return None


@click.command("tsv", context_settings=CONTEXT_SETTINGS, epilog=_examples(
    "tar2tsv -f cls small.tar",
    "tar2tsv -f 'jpg;png cls json' --noheader 'train-{0000..0003}.tar' > table.tsv"))
@click.argument("inputs", nargs=-1, metavar="[INPUTS]...")
@click.option("-f", "--fields", default=None,
              help="Fields to show, space separated; a;b = first present.")
@click.option("-c", "--count", type=click.IntRange(min=0), default=None,
              help="Show at most N samples.")
@click.option("--nokey", is_flag=True, help="Leave out the __key__ column.")
@click.option("--noheader", is_flag=True, help="Leave out the header line.")
@click.option("-o", "--output", default="-", show_default=True, help="Output file; - is stdout.")
@click.option("-e", "--on-error", type=_ON_ERROR, default="abort", show_default=True,
              help="On a bad shard: stop, or skip its rest.")
@handle_errors
def tsv_cmd(inputs, fields, count, nokey, noheader, output, on_error):
    """Tabulate fields of samples: text fields as text, binary fields as their size in bytes."""
    urls = collect_inputs(inputs)
    samples = read_samples(urls, on_error)
    if count is not None:
        samples = itertools.islice(samples, count)
    columns = None
    if fields is not None:
        columns = [f.split(";") for f in fields.split()]
        if not columns:
            raise click.BadParameter("no field names given", param_hint="'-f'")
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
            out.write("\t".join(([] if nokey else ["__key__"]) + [";".join(c) for c in columns])
                      + "\n")
        out.flush()
    finally:
        if out is not sys.stdout:
            out.close()


# ---------------------------------------------------------------------------------------------
# tarsplit
# ---------------------------------------------------------------------------------------------


class _MaxShardsReached(Exception):
    pass


@click.command("split", context_settings=CONTEXT_SETTINGS, epilog=_examples(
    "tar -cf - --sort=name -C /data/imagenet train | tarsplit -s 1e9 -o imagenet_train",
    "tarsplit -n 1000 -z -o shards/part big.tar   # shards/part-000000.tgz ...",
    "tarscat 'in-{000..099}.tar' | tarsplit -s 500M --maxshards 2 -o sample"))
@click.argument("inputs", nargs=-1, metavar="[INPUTS]...")
@click.option("-o", "--output", "prefix", default="shard", show_default=True,
              help="Output prefix (or a pattern like out-%06d.tar).")
@click.option("-s", "--maxsize", type=SIZE, default="3e9", show_default=True,
              help="Largest shard (uncompressed): 1e9, 500M, 2G.")
@click.option("-n", "--maxcount", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Most samples per shard.")
@click.option("--maxshards", type=click.IntRange(min=1), default=None,
              help="Stop after writing N shards.")
@click.option("--start", type=click.IntRange(min=0), default=0, show_default=True,
              help="Number of the first shard.")
@click.option("-z", "--gzip", "gz", is_flag=True, help="Write gzip-compressed shards (.tgz).")
@click.option("--zstd", is_flag=True, help="Write zstd-compressed shards (.tar.zst).")
@click.option("--aligned", is_flag=True,
              help="Compress each sample on its own (with -z/--zstd): random access.")
@click.option("--manifest", default=None, metavar="PATH",
              help="Write the manifest (and an index per shard) of the shards written.")
@click.option("-q", "--quiet", is_flag=True, help="Do not list the shards being written.")
@handle_errors
def split_cmd(inputs, prefix, maxsize, maxcount, maxshards, start, gz, zstd, quiet, aligned=False,
              manifest=None):
    """Split a tar stream (default stdin) into shards PREFIX-000000.tar..., samples kept whole."""
    if gz and zstd:
        raise click.UsageError("choose one of -z/--gzip and --zstd")
    urls = collect_inputs(inputs)
    suffix = ".tgz" if gz else ".tar.zst" if zstd else ".tar"
    pattern = prefix if ("%" in prefix or "{" in prefix) else f"{prefix}-%06d{suffix}"
    try:
        shard_name(pattern, start)
    except (ValueError, TypeError) as exn:
        raise click.BadParameter(str(exn), param_hint="'-o'") from None

    def post(url):
        if maxshards is not None and len(sink.shards) >= maxshards:
            raise _MaxShardsReached()

    sink = ShardWriter(pattern, maxcount=maxcount, maxsize=maxsize, start_shard=start,
                       post=post, encoder=False, manifest=manifest, aligned=aligned)
    current = None
    nsamples = nbytes = 0
    stopped = False
    samples = read_samples(urls)
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
        print_err(f"{click.get_current_context().command_path}: stopped after --maxshards "
                  f"{maxshards}: wrote {len(sink.shards)} complete shards ({done} samples); "
                  "the rest of the input was not read")
    elif not quiet:
        print_err(f"# done: {len(sink.shards)} shards, {done} samples")


# ---------------------------------------------------------------------------------------------
# tarshow
# ---------------------------------------------------------------------------------------------


def preview(data: bytes, width: int) -> str:
    """One-line preview of a field: text shown, binary as size and first bytes."""
    if isinstance(data, str):
        text = data
    else:
        text = as_text(data[:4 * width]) if len(data) > 4 * width else as_text(data)
        if text is None and len(data) > 4 * width:  # a cut multi-byte character
            text = as_text(data[:4 * width - 3]) or as_text(data[:4 * width - 2]) or \
                as_text(data[:4 * width - 1])
    if text is not None:
        flat = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        if len(flat) > width:
            flat = flat[:width - 3] + "..."
        return flat
    head = " ".join(f"{b:02x}" for b in data[:max(4, (width - 20) // 3)])
    return f"[{len(data)} bytes] {head}{' ...' if len(data) > (width - 20) // 3 else ''}"


_IMAGE_EXTS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "bmp", "gif", "tif", "tiff",
               "webp")


def contact_sheet(samples: list[dict], path: str, thumb: int = 160) -> int:
    """Write a grid of the image fields of ``samples`` with their keys; returns how many."""
    from PIL import Image, ImageDraw

    tiles = []
    for sample in samples:
        for ext, data in sample.items():
            if ext.startswith("__") or ext.rsplit(".", 1)[-1] not in _IMAGE_EXTS:
                continue
            try:
                img = Image.open(io.BytesIO(data))
                img.load()
            except Exception as exn:  # noqa: BLE001 - report undecodable images, go on
                print_err(f"tarshow: warning: cannot decode {sample['__key__']}.{ext}: {exn}")
                continue
            img = img.convert("RGB")
            scale = min(thumb / img.width, thumb / img.height)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
            tiles.append((f"{sample['__key__']}.{ext}", img))
    if not tiles:
        return 0
    cols = min(len(tiles), 6)
    rows = (len(tiles) + cols - 1) // cols
    label_h = 14
    sheet = Image.new("RGB", (cols * (thumb + 4), rows * (thumb + label_h + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (label, img) in enumerate(tiles):
        x = (i % cols) * (thumb + 4) + 2
        y = (i // cols) * (thumb + label_h + 4) + 2
        sheet.paste(img, (x + (thumb - img.width) // 2, y + (thumb - img.height) // 2))
        draw.text((x, y + thumb + 1), label[-(thumb // 6):], fill="black")
    sheet.save(path)
    return len(tiles)


@click.command("show", context_settings=CONTEXT_SETTINGS, epilog=_examples(
    "tarshow -c 2 small.tar",
    "tarshow -c 24 --images grid.png 'train-{0000..0147}.tar'"))
@click.argument("inputs", nargs=-1, metavar="[INPUTS]...")
@click.option("-c", "--count", type=click.IntRange(min=0), default=3, show_default=True,
              help="Show the first N samples.")
@click.option("-s", "--skip", type=click.IntRange(min=0), default=0,
              help="Skip the first N samples.")
@click.option("-f", "--fields", default=None, help="Only these fields, space separated.")
@click.option("-w", "--width", type=click.IntRange(min=20), default=72, show_default=True,
              help="Width of a field preview.")
@click.option("--images", "grid", default=None, metavar="PNG",
              help="Write a contact sheet of the images to PNG.")
@handle_errors
def show_cmd(inputs, count, skip, fields, width, grid):
    """Show the first samples of INPUTS: each field with a short preview."""
    urls = collect_inputs(inputs)
    wanted = fields.split() if fields else None
    samples = read_samples(urls)
    shown = []
    try:
        for sample in itertools.islice(samples, skip, skip + count):
            if shown:
                click.echo("")
            click.echo(f"{'__key__':<10} {sample['__key__']}")
            click.echo(f"{'__url__':<10} {sample['__url__']}")
            for ext, data in sample.items():
                if ext.startswith("__") or (wanted is not None and ext not in wanted):
                    continue
                click.echo(f"{ext:<10} {preview(data, width)}")
            shown.append(sample if grid else None)
    finally:
        samples.close()
    if grid:
        n = contact_sheet([s for s in shown if s is not None], grid)
        print_err(f"# {n} images in {grid}" if n
                  else "# no image fields: contact sheet not written")


# ---------------------------------------------------------------------------------------------
# tarpcat
# ---------------------------------------------------------------------------------------------


@click.command("pcat", context_settings=CONTEXT_SETTINGS, epilog=_examples(
    "tarpcat -p 8 'https://host/data-{0000..0099}.tar' > all.tar",
    "tarpcat -p 4 --shuffle 5000 --seed 3 'train-{00..15}.tar' | tarsplit -s 1e9 -o mixed"))
@click.argument("inputs", nargs=-1, metavar="[INPUTS]...")
@click.option("-p", "--parallel", type=click.IntRange(min=1), default=4, show_default=True,
              help="Read N inputs at a time.")
@click.option("-o", "--output", default="-", show_default=True,
              help="Output file or URL; - is stdout.")
@click.option("-c", "--count", type=click.IntRange(min=0), default=None,
              help="Write at most N samples.")
@click.option("--shuffle", type=click.IntRange(min=0), default=0, metavar="N",
              help="Shuffle with a buffer of N samples.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for --shuffle.")
@click.option("-T", "--files-from", "listfile", default=None, metavar="FILE",
              help="Read input URLs from FILE, one per line.")
@click.option("-e", "--on-error", type=_ON_ERROR, default="abort", show_default=True,
              help="On a bad shard: stop, or skip its rest.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@handle_errors
def pcat_cmd(inputs, parallel, output, count, shuffle, seed, listfile, on_error, quiet):
    """Read INPUTS N at a time in parallel and interleave their samples into one tar stream."""
    from .pcat import interleave

    urls = collect_inputs(inputs, listfile)
    check_stdout_not_tty(output)
    samples = interleave(urls, parallel, error_handler(on_error))
    if shuffle > 1:
        samples = shuffle_stage(samples, shuffle, seed=seed)
    if count is not None:
        samples = itertools.islice(samples, count)
    try:
        with Progress(quiet, "tarpcat") as bar, \
                TarWriter(output_dest(output), encoder=False) as sink:
            for sample in bar.wrap(samples):
                sink.write_members(members_of(sample))
    finally:
        samples.close()


# ---------------------------------------------------------------------------------------------
# registration and entry points
# ---------------------------------------------------------------------------------------------


from .check import check_cmd  # noqa: E402
from .proc import proc_cmd  # noqa: E402
from .sort import sort_cmd  # noqa: E402

COMMANDS = {
    "cat": ("tarscat", cat_cmd),
    "tsv": ("tar2tsv", tsv_cmd),
    "split": ("tarsplit", split_cmd),
    "show": ("tarshow", show_cmd),
    "proc": ("tarproc", proc_cmd),
    "pcat": ("tarpcat", pcat_cmd),
    "sort": ("tarsort", sort_cmd),
    "check": ("tarcheck", check_cmd),
}


@click.group("tarshards", context_settings=CONTEXT_SETTINGS, epilog=_examples(
    "tarshards cat -c 10 in.tar > small.tar      # same as: tarscat -c 10 in.tar",
    "tarshards check 'train-{0000..0147}.tar'"))
def group():
    """Tools for datasets stored as sharded tar files (WebDataset format).

    Each subcommand is also installed as its own script: cat=tarscat, tsv=tar2tsv,
    split=tarsplit, show=tarshow, proc=tarproc, pcat=tarpcat, sort=tarsort, check=tarcheck.
    """


for _name, (_script, _cmd) in COMMANDS.items():
    group.add_command(_cmd, _name)

try:  # the ``tarshards map`` subcommand lives in its own module (may be absent)
    from .map_cmd import map_cmd
except ImportError:  # pragma: no cover - depends on the checkout
    map_cmd = None
else:
    group.add_command(map_cmd, "map")


from .index import index_cmd; group.add_command(index_cmd, "index")  # noqa: E402,E702


def main(argv=None):
    """``tarshards SUBCOMMAND ...``"""
    return group.main(args=argv, prog_name="tarshards")


def _entry(name: str):
    script, cmd = COMMANDS[name]

    def run(argv=None):
        return cmd.main(args=argv, prog_name=script)

    run.__name__ = script
    run.__doc__ = f"The ``{script}`` script (``tarshards {name}``)."
    return run


tarscat = _entry("cat")
tar2tsv = _entry("tsv")
tarsplit = _entry("split")
tarshow = _entry("show")
tarproc = _entry("proc")
tarpcat = _entry("pcat")
tarsort = _entry("sort")
tarcheck = _entry("check")

if __name__ == "__main__":  # pragma: no cover
    main()
