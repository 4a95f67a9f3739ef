"""The original WebDataset notebook, step by step, with tarshards, on locally generated shards.

The notebook streamed ImageNet shards (``imagenet_train-{0000..0147}.tgz``, members ``KEY.jpg``,
``KEY.cls``, ``KEY.json``) from Google Cloud Storage. This script makes a few shards of the same
shape locally, then runs each cell of the notebook: the seed constructor, ``decoder="torch"``,
augmentation with ``transforms=``, ``shuffle=``, a multi-worker ``DataLoader``, the command-line
tools in pipes, and processing from Python (sequential, with ``multiprocessing``, and per shard in
parallel as the notebook's ``distributed_map_unordered`` wished for).

torchvision is not needed: the notebook's ``transforms.Compose([Resize(256), RandomCrop(224),
RandomHorizontalFlip(), ToTensor(), Normalize(...)])`` is written out with PIL and torch below.

Usage: ``python examples/seed_notebook.py [--out seed_out] [--workers 2] [--dask]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tarshards import TarWriter, WebDataset

BIN = Path(sys.executable).parent  # the installed command-line tools live next to python
NSHARDS, PER_SHARD = 4, 40
CLASSES = {
    852: "tennis ball",
    902: "whistle",
    951: "lemon",
    34: "leatherback turtle",
    285: "Egyptian cat",
    589: "hand blower",
    270: "white wolf",
    233: "Bouvier des Flandres",
}


def cell(title: str) -> None:
    print(f"\n--- {title}", flush=True)


# ---------------------------------------------------------------------------------------------
# data: ImageNet-like shards
# ---------------------------------------------------------------------------------------------


def make_image(rng: np.random.Generator) -> Image.Image:
    """A smooth random RGB image of a typical ImageNet size (compresses like a photo)."""
    w, h = int(rng.integers(300, 501)), int(rng.integers(240, 376))
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)


def make_shards(out: Path, seed: int = 0, per_shard: int = PER_SHARD) -> str:
    rng = np.random.default_rng(seed)
    classes = sorted(CLASSES)
    for s in range(NSHARDS):
        with TarWriter(str(out / f"imagenet_train-{s:04d}.tgz")) as sink:
            for i in range(per_shard):
                cls = classes[int(rng.integers(len(classes)))]
                synset = f"n{3000000 + cls * 1000:08d}"
                key = f"{synset}_{s * per_shard + i}"
                sink.write(
                    {
                        "__key__": key,
                        "jpg": make_image(rng),
                        "cls": cls,
                        "json": {
                            "annotation": {"folder": synset, "filename": key},
                            "cls": cls,
                            "cname": CLASSES[cls],
                        },
                    }
                )
    return str(out / f"imagenet_train-{{0000..{NSHARDS - 1:04d}}}.tgz")


# ---------------------------------------------------------------------------------------------
# the notebook's torchvision augmentation, with PIL and torch
# ---------------------------------------------------------------------------------------------

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def resize_shorter(img: Image.Image, size: int) -> Image.Image:
    w, h = img.size
    scale = size / min(w, h)
    return img.resize(
        (max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BILINEAR
    )


def augment(img: Image.Image) -> torch.Tensor:
    """Resize(256), RandomCrop(224), RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)."""
    img = resize_shorter(img.convert("RGB"), 256)
    w, h = img.size
    x, y = random.randint(0, w - 224), random.randint(0, h - 224)
    img = img.crop((x, y, x + 224, y + 224))
    if random.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div_(255)
    return (t - MEAN) / STD


def minus_one(x):
    return x - 1


# ---------------------------------------------------------------------------------------------
# processing from Python
# ---------------------------------------------------------------------------------------------


def process_sample(sample: dict) -> dict:
    return dict(
        __key__=sample["__key__"], png=sample["jpg"].resize((256, 256)), cls=str(sample["cls"])
    )


def process_shard(input_shard: str, output_shard: str) -> dict:
    """The notebook's process_shard: one shard in, one shard out (here without a nested pool)."""
    n = 0
    with TarWriter(output_shard) as sink:
        for sample in WebDataset(input_shard, decoder="pil"):
            sink.write(process_sample(sample))
            n += 1
    return {"samples_in": n, "samples_out": n}


def sh(cmd: str, cwd: Path) -> None:
    print(f"$ {cmd}")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, executable="/bin/bash"
    )
    out = (proc.stdout + proc.stderr).rstrip()
    if out:
        print(out)
    if proc.returncode != 0:
        raise SystemExit(f"command failed with status {proc.returncode}: {cmd}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="seed_out", help="working directory (default seed_out)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers/processes")
    parser.add_argument(
        "--per-shard",
        type=int,
        default=PER_SHARD,
        help=f"samples per shard (default {PER_SHARD}, at least 16)",
    )
    parser.add_argument(
        "--dask", action="store_true", help="also run the per-shard job on a local Dask cluster"
    )
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    random.seed(0)
    torch.manual_seed(0)

    cell("make ImageNet-like shards: imagenet_train-{0000..0003}.tgz (jpg, cls, json)")
    if args.per_shard < 16:
        parser.error("--per-shard must be at least 16 (a batch of 16 is drawn from one shard)")
    urls = make_shards(out, per_shard=args.per_shard)
    first = str(out / "imagenet_train-0000.tgz")
    sh(f"tar -ztvf {first} | sed 5q", out)

    cell('WebDataset(url, extensions="jpg cls")')
    imagenet = WebDataset(first, extensions="jpg cls")
    for image, cls in imagenet:
        print(type(image).__name__, image.shape, image.dtype, cls)
        break

    cell("a streaming dataset: an IterableDataset that cannot be indexed")
    print(WebDataset.__base__)
    try:
        imagenet[0]
    except TypeError as exn:
        print(f"TypeError: {exn}")

    cell('decoder="torch"')
    imagenet = WebDataset(urls, extensions="jpg cls", decoder="torch")
    for image, cls in imagenet:
        break
    print(cls)
    print(image.shape, image.min().item(), image.max().item(), image.dtype)

    cell('decoder="pil", transforms=[augment, lambda x: x-1]')
    imagenet = WebDataset(
        urls, extensions="jpg cls", decoder="pil", transforms=[augment, minus_one]
    )
    for image, cls in imagenet:
        break
    print(cls, image.shape, image.dtype)

    cell("shuffle=100")
    imagenet = WebDataset(
        urls, shuffle=100, extensions="jpg cls", decoder="pil", transforms=[augment, minus_one]
    )
    for image, cls in imagenet:
        break
    print(cls)

    cell(f"DataLoader(imagenet, batch_size=16, num_workers={args.workers})")
    imagenet = WebDataset(
        urls, extensions="jpg cls", decoder="pil", transforms=[augment, minus_one]
    )
    loader = DataLoader(imagenet, batch_size=16, num_workers=args.workers)
    images, classes = next(iter(loader))
    print(images.size(), classes.size())
    assert images.shape == (16, 3, 224, 224) and classes.shape == (16,)

    cell("command-line tools in pipes")
    sh(f"cat {first} | tarscat -c 10 > small.tar", out)
    sh("tar tvf small.tar | fgrep .jpg | wc -l", out)
    sh("tar2tsv -f cls small.tar", out)
    raw = out / "raw" / "train"
    raw.mkdir(parents=True)
    sh(f"tar -xzf {first} -C raw/train", out)
    sh(
        "tar -cf - --sort=name -C raw train | tarsplit -s 2e5 -o imagenet_resplit --maxshards 2",
        out,
    )
    sh("tarshow -c 2 small.tar", out)
    resize = (
        'python -c "import glob; from PIL import Image; '
        '[Image.open(f).resize((256, 256)).save(f) for f in glob.glob(\\"*.jpg\\")]"'
    )
    sh(f"tarproc -p 5 -c '{resize}' small.tar > out.tar", out)
    sh("tar2tsv -f jpg -c 3 out.tar", out)

    cell("processing from Python: sequential, with TarWriter")
    with TarWriter(str(out / "out2.tar")) as sink:
        for sample in WebDataset(str(out / "small.tar"), decoder="pil"):
            sink.write(process_sample(sample))
    sh("tar tf out2.tar | sed 3q", out)

    cell(f"processing from Python: multiprocessing.Pool({args.workers}).imap_unordered")
    with mp.Pool(args.workers) as pool:
        processed = pool.imap_unordered(
            process_sample, WebDataset(str(out / "small.tar"), decoder="pil")
        )
        with TarWriter(str(out / "out2.tar")) as sink:
            for sample in processed:
                sink.write(sample)
    print(sum(1 for _ in WebDataset(str(out / "out2.tar"))), "samples in out2.tar")

    cell("per-shard jobs in parallel: distributed_map_unordered(process_shard, shards)")
    from tarshards.parallel import format_summary, map_shard_files

    shards = [
        (str(out / f"imagenet_train-{i:04d}.tgz"), str(out / f"rescaled-{i:04d}.tar"))
        for i in range(NSHARDS)
    ]
    engines = ["processes"] + (["dask"] if args.dask else [])
    for engine in engines:
        reports = map_shard_files(
            process_shard,
            shards,
            engine=engine,
            workers=args.workers,
            overwrite=True,
            progress=False,
        )
        print(f"engine={engine!r}")
        print(format_summary(reports))
    sizes = {s["png"].size for s in WebDataset(str(out / "rescaled-0000.tar"), decoder="pil")}
    print("rescaled image sizes:", sizes)
    assert sizes == {(256, 256)}
    print(f"\nall outputs are in {out}")
    (out / "done.json").write_text(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
