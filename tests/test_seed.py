"""The seed notebook's cells, run as written against local .tgz shards.

The shards look like the seed's ImageNet shards: ``nXXXXXXXX_NNNN.{cls,jpg,json}`` members in
gzipped tar files. torchvision is not available here, so ``augment`` is a small stand-in with the
same steps (resize 256, random crop 224, random flip, to tensor, normalize).
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import random
import tarfile
import warnings

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from tarshards import TarWriter, WebDataset  # noqa: E402


def _jpeg(rng, w, h):
    arr = (rng.random((h, w, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """10 gzipped shards x 8 samples, written with the standard library's tarfile."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    classes = []
    for s in range(10):
        with tarfile.open(root / f"imagenet_train-{s:04d}.tgz", "w:gz") as tf:
            for i in range(8):
                cls = int(rng.integers(1, 1000))
                classes.append(cls)
                key = f"n{int(rng.integers(10**7, 10**8)):08d}_{s * 100 + i}"
                members = {
                    "cls": str(cls).encode(),
                    "jpg": _jpeg(rng, int(rng.integers(260, 500)), int(rng.integers(240, 400))),
                    "json": json.dumps({"cls": cls, "cname": "thing"}).encode(),
                }
                for ext, data in members.items():
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    ti.uname = ti.gname = "bigdata"
                    tf.addfile(ti, io.BytesIO(data))
    return str(root / "imagenet_train-{0000..0009}.tgz"), classes


def augment(image):
    """Resize(256), RandomCrop(224), RandomHorizontalFlip, ToTensor, Normalize (ImageNet)."""
    w, h = image.size
    scale = 256 / min(w, h)
    image = image.convert("RGB").resize((max(256, round(w * scale)), max(256, round(h * scale))))
    w, h = image.size
    x, y = random.randint(0, w - 224), random.randint(0, h - 224)
    image = image.crop((x, y, x + 224, y + 224))
    if random.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    return (t - mean) / std


def process_sample(sample):
    return dict(
        __key__=sample["__key__"], png=sample["jpg"].resize((256, 256)), cls=str(sample["cls"])
    )


def test_cells(imagenet, tmp_path, monkeypatch):
    url, classes = imagenet
    first = url.replace("{0000..0009}", "0000")
    monkeypatch.chdir(tmp_path)

    imagenet_ds = WebDataset(first, extensions="jpg cls")
    for image, cls in imagenet_ds:
        break
    assert cls == classes[0]
    assert image.ndim == 3 and image.shape[2] == 3  # imshow-able

    assert WebDataset.__base__.__name__ == "IterableDataset"
    with pytest.raises(TypeError):
        imagenet_ds[0]

    imagenet_ds = WebDataset(url, extensions="jpg cls", decoder="torch")
    for image, cls in imagenet_ds:
        break
    assert image.permute(1, 2, 0).shape[2] == 3
    assert image.dtype == torch.float32 and image.shape[0] == 3
    assert image.min().item() >= 0.0 and image.max().item() <= 1.0
    assert cls == classes[0]

    imagenet_ds = WebDataset(
        url, extensions="jpg cls", decoder="pil", transforms=[augment, lambda x: x - 1]
    )
    for image, cls in imagenet_ds:
        break
    assert image.shape == (3, 224, 224) and cls == classes[0] - 1

    imagenet_ds = WebDataset(
        url, shuffle=100, extensions="jpg cls", decoder="pil", transforms=[augment, lambda x: x - 1]
    )
    got = [int(c) for _, c in imagenet_ds]
    assert sorted(got) == sorted(c - 1 for c in classes)

    imagenet_ds = WebDataset(
        url, extensions="jpg cls", decoder="pil", transforms=[augment, lambda x: x - 1]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 8 workers on a 2-core machine
        loader = DataLoader(imagenet_ds, batch_size=16, num_workers=8)
        images, classes_batch = next(iter(loader))
    assert images.size() == torch.Size([16, 3, 224, 224])
    assert classes_batch.size() == torch.Size([16])

    # tarscat -c 10 equivalent, then the TarWriter cells
    with TarWriter("small.tar") as sink:
        for i, sample in enumerate(WebDataset(first)):
            sink.write(sample)
    sink = TarWriter("out2.tar")
    for sample in WebDataset("small.tar", decoder="pil"):
        sink.write(process_sample(sample))
    sink.close()
    out = list(WebDataset("out2.tar", decoder="pil"))
    assert len(out) == 8 and out[0]["png"].size == (256, 256)
    assert out[0]["cls"] == classes[0]

    pool = mp.Pool(2)
    try:
        processed = pool.imap_unordered(process_sample, WebDataset("small.tar", decoder="pil"))
        with TarWriter("out2.tar") as sink:
            for sample in processed:
                sink.write(sample)
    finally:
        pool.close()
        pool.join()
    out = list(WebDataset("out2.tar").decode("pil"))
    assert sorted(s["cls"] for s in out) == sorted(classes[:8])
    assert all(s["png"].size == (256, 256) for s in out)
