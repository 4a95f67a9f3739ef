"""Turn a folder of images in ImageFolder layout into tar shards.

The layout is torchvision's ``ImageFolder``: one sub-directory per class, images inside::

    ROOT/cat/0001.jpg
    ROOT/cat/0002.png
    ROOT/dog/img_17.jpeg

Each image becomes one sample: the image file as it is (``jpg``/``png``/... by its suffix, no
re-encoding unless ``--resize`` is given), the class index as ``cls`` (classes numbered in sorted
order, as ImageFolder does) and a ``json`` with the class name and the original path. Keys are
``CLASS/STEM`` (dots in the stem become ``_``). Samples are shuffled (``--seed``) so that each
shard holds a mix of classes, then written with ``tarshards.ShardWriter``; a ``classes.json``
next to the shards lists the class names.

Examples::

    python examples/imagefolder_to_shards.py ~/data/pets/train -o shards/pets-train-%06d.tar
    python examples/imagefolder_to_shards.py ROOT -o 's3://bucket/train-%06d.tar' --maxcount 5000
    python examples/imagefolder_to_shards.py ROOT -o out/train-%06d.tar.zst --resize 256
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path

from tarshards import ShardWriter

IMAGE_SUFFIXES = {
    ".jpg": "jpg",
    ".jpeg": "jpg",
    ".png": "png",
    ".ppm": "ppm",
    ".pgm": "pgm",
    ".bmp": "bmp",
    ".tif": "tif",
    ".tiff": "tif",
    ".webp": "webp",
    ".gif": "gif",
}


def find_images(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Classes (sorted sub-directory names) and ``(path, class index)`` for every image."""
    if not root.is_dir():
        raise SystemExit(f"error: {root} is not a directory")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise SystemExit(
            f"error: {root} has no class sub-directories (ImageFolder layout: ROOT/CLASS/IMAGE)"
        )
    items = []
    for index, name in enumerate(classes):
        for path in sorted((root / name).rglob("*")):
            if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
                items.append((path, index))
    if not items:
        raise SystemExit(
            f"error: no images under {root} (suffixes: {', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return classes, items


def resized(data: bytes, ext: str, size: int) -> bytes:
    """Re-encode an image with its shorter side ``size`` pixels."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        w, h = img.size
        scale = size / min(w, h)
        if scale < 1:
            img = img.resize(
                (max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS
            )
        if ext == "jpg" and img.mode not in ("RGB", "L"):
            img = img.convert("RGB")
        buf = io.BytesIO()
        fmt = {"jpg": "JPEG", "tif": "TIFF"}.get(ext, ext.upper())
        img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        return buf.getvalue()


def convert(
    root: Path,
    pattern: str,
    *,
    maxcount: int,
    maxsize: float,
    seed: int | None,
    resize: int | None,
    quiet: bool = False,
) -> dict:
    classes, items = find_images(root)
    if seed is not None:
        random.Random(seed).shuffle(items)
    used: set[str] = set()
    t0 = time.perf_counter()
    verbose = 0 if quiet else 1
    with ShardWriter(pattern, maxcount=maxcount, maxsize=maxsize, verbose=verbose) as sink:
        for path, index in items:
            ext = IMAGE_SUFFIXES[path.suffix.lower()]
            rel = path.relative_to(root / classes[index])
            stem = "_".join(rel.with_suffix("").parts).replace(".", "_")
            key = f"{classes[index]}/{stem}".replace(".", "_")
            base, n = key, 1
            while key in used:  # a.jpg and a.png in one class: keep both, as distinct samples
                n += 1
                key = f"{base}_{n}"
            used.add(key)
            data = path.read_bytes()
            if resize:
                data = resized(data, ext, resize)
            sink.write(
                {
                    "__key__": key,
                    ext: data,
                    "cls": index,
                    "json": {
                        "class": classes[index],
                        "cls": index,
                        "path": str(path.relative_to(root)),
                    },
                }
            )
    seconds = time.perf_counter() - t0
    shards = [info.url for info in sink.shards]
    listing = {"classes": classes, "shards": shards, "samples": len(items)}
    first = shards[0]
    if "://" not in first:
        Path(first).parent.joinpath("classes.json").write_text(json.dumps(listing, indent=1))
    if not quiet:
        print(
            f"{len(items)} images of {len(classes)} classes -> {len(shards)} shards "
            f"in {seconds:.1f}s ({len(items) / max(seconds, 1e-9):.0f} images/s)"
        )
    return listing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Examples::") :].replace("Examples::", "examples:"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("root", type=Path, help="ImageFolder root: ROOT/CLASS/IMAGE")
    parser.add_argument(
        "-o",
        "--output",
        default="shards/train-%06d.tar",
        help="shard name pattern, %%06d or {shard:06d} for the number; the "
        "suffix picks compression (.tar, .tgz, .tar.zst) "
        "(default shards/train-%%06d.tar)",
    )
    parser.add_argument(
        "-n", "--maxcount", type=int, default=10_000, help="most samples per shard (default 10000)"
    )
    parser.add_argument(
        "-s",
        "--maxsize",
        type=float,
        default=1e9,
        help="largest shard in bytes, uncompressed (default 1e9)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="shuffle seed, so that shards mix classes (default 0)"
    )
    parser.add_argument(
        "--no-shuffle", action="store_true", help="keep the folder order (class by class)"
    )
    parser.add_argument(
        "--resize",
        type=int,
        default=None,
        metavar="PIXELS",
        help="re-encode images with the shorter side at most PIXELS",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    if "://" not in args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    convert(
        args.root,
        args.output,
        maxcount=args.maxcount,
        maxsize=args.maxsize,
        seed=None if args.no_shuffle else args.seed,
        resize=args.resize,
        quiet=args.quiet,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
