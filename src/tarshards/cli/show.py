"""``tarshow``: show the first samples, each field with a short preview; or a contact sheet."""

from __future__ import annotations

import io
import itertools

import click

from ..images import IMAGE_EXTENSIONS

from ._common import (
    CONTEXT_SETTINGS,
    as_text,
    collect_inputs,
    examples,
    handle_errors,
    inputs_argument,
    on_error_option,
    print_err,
    read_samples,
    skip_option,
)

__all__ = ["contact_sheet", "preview", "show_cmd"]


def preview(data: bytes, width: int) -> str:
    """One-line preview of a field: text shown, binary as size and first bytes."""
    if isinstance(data, str):
        text = data
    else:
        text = as_text(data[: 4 * width]) if len(data) > 4 * width else as_text(data)
        if text is None and len(data) > 4 * width:  # a cut multi-byte character
            text = (
                as_text(data[: 4 * width - 3])
                or as_text(data[: 4 * width - 2])
                or as_text(data[: 4 * width - 1])
            )
    if text is not None:
        flat = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        if len(flat) > width:
            flat = flat[: width - 3] + "..."
        return flat
    head = " ".join(f"{b:02x}" for b in data[: max(4, (width - 20) // 3)])
    return f"[{len(data)} bytes] {head}{' ...' if len(data) > (width - 20) // 3 else ''}"


def contact_sheet(samples: list[dict], path: str, thumb: int = 160) -> int:
    """Write a grid of the image fields of ``samples`` with their keys; returns how many."""
    from PIL import Image, ImageDraw

    tiles = []
    for sample in samples:
        for ext, data in sample.items():
            if ext.startswith("__") or ext.rsplit(".", 1)[-1] not in IMAGE_EXTENSIONS:
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
        draw.text((x, y + thumb + 1), label[-(thumb // 6) :], fill="black")
    sheet.save(path)
    return len(tiles)


@click.command(
    "show",
    context_settings=CONTEXT_SETTINGS,
    epilog=examples(
        "tarshow -c 2 small.tar", "tarshow -c 24 --images grid.png 'train-{0000..0147}.tar'"
    ),
)
@inputs_argument
@click.option(
    "-c",
    "--count",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Show the first N samples.",
)
@skip_option
@click.option("-f", "--fields", default=None, help="Only these fields, space separated.")
@click.option(
    "-w",
    "--width",
    type=click.IntRange(min=20),
    default=72,
    show_default=True,
    help="Width of a field preview.",
)
@click.option(
    "--images",
    "grid",
    default=None,
    metavar="PNG",
    help="Write a contact sheet of the images to PNG.",
)
@on_error_option()
@handle_errors
def show_cmd(inputs, count, skip, fields, width, grid, on_error):
    """Show the first samples of INPUTS: each field with a short preview."""
    urls = collect_inputs(inputs)
    wanted = fields.split() if fields else None
    samples = read_samples(urls, on_error)
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
        print_err(
            f"# {n} images in {grid}" if n else "# no image fields: contact sheet not written"
        )
