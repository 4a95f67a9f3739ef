"""``tarshow``: show the first samples, each field with a short preview (video and audio: their
duration and format); or a contact sheet (video: a poster frame and the duration)."""

from __future__ import annotations

import io
import itertools

import click

from ..codecs.images import IMAGE_EXTENSIONS
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

__all__ = ["contact_sheet", "media_summary", "preview", "show_cmd"]

_MEDIA = ("mp4", "webm", "mkv", "mov", "avi", "m4v", "wav", "flac", "mp3", "ogg", "opus", "m4a")


def media_summary(data: bytes, ext: str) -> str | None:
    """``video 64x48, 25 fps, 4.00 s, 100 frames, mpeg4`` / ``audio 2 ch, 16000 Hz, 3.00 s,
    flac`` for a media field; None for other fields, or where it cannot be read."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last not in _MEDIA:
        return None
    from ..errors import TarshardsError
    from ..media.probe import VIDEO_EXTENSIONS, probe

    try:
        info = probe(data, last)
    except TarshardsError as exn:
        return f"(not readable: {exn.reason})"
    if last in VIDEO_EXTENSIONS:
        return (
            f"video {info['width']}x{info['height']}, {info['fps']:g} fps, "
            f"{info['duration']:.2f} s, {info['frames']} frames, {info['codec']}"
        )
    return (
        f"audio {info['channels']} ch, {info['rate']} Hz, {info['duration']:.2f} s, {info['codec']}"
    )


def _poster(data: bytes, ext: str):
    """A video's poster frame (its middle frame) as a PIL image, and its duration."""
    from PIL import Image

    from ..media.probe import probe
    from ..media.video import video

    clip = video(frames=1, clip="center", output="numpy").decode(data)
    return Image.fromarray(clip.frames[0]), probe(data, ext)["duration"]


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
            last = ext.rsplit(".", 1)[-1].lower()
            is_video = last in ("mp4", "webm", "mkv", "mov", "avi", "m4v")
            if ext.startswith("__") or (last not in IMAGE_EXTENSIONS and not is_video):
                continue
            label = f"{sample['__key__']}.{ext}"
            try:
                if is_video:  # a poster frame, labelled with the duration
                    img, seconds = _poster(data, last)
                    label = f"{label} {seconds:.1f}s"
                else:
                    img = Image.open(io.BytesIO(data))
                    img.load()
            except Exception as exn:  # noqa: BLE001 - report undecodable images, go on
                print_err(f"tarshow: warning: cannot decode {sample['__key__']}.{ext}: {exn}")
                continue
            img = img.convert("RGB")
            scale = min(thumb / img.width, thumb / img.height)
            img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
            tiles.append((label, img))
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
    help="Write a contact sheet of the images (and video poster frames) to PNG.",
)
@on_error_option()
@handle_errors
def show_cmd(
    inputs: tuple[str, ...],
    count: int,
    skip: int,
    fields: str | None,
    width: int,
    grid: str | None,
    on_error: str,
) -> None:
    """Show the first samples of INPUTS: each field with a short preview."""
    urls = collect_inputs(inputs)
    wanted = fields.split() if fields else None
    samples = read_samples(urls, on_error)
    shown: list[dict | None] = []
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
                summary = media_summary(data, ext) if isinstance(data, bytes) else None
                if summary is not None:
                    click.echo(f"{'':<10} {summary}")
            shown.append(sample if grid else None)
    finally:
        samples.close()
    if grid:
        n = contact_sheet([s for s in shown if s is not None], grid)
        print_err(
            f"# {n} images in {grid}" if n else "# no image fields: contact sheet not written"
        )
