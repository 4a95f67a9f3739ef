"""A small data set to browse: noisy images (so thumbnails are not blank), captions, JSON, a
binary field, and a key and a caption that are HTML (data must show as text, never run)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from tarshards import ShardWriter

EVIL_KEY = 'evil/<img src=x onerror="window.__xss=1">&<script>window.__xss=2</script>'
EVIL_CAPTION = "<script>window.__xss=3</script><b>bold?</b> & done"
N = 120
PER_SHARD = 50


def _image(i: int) -> tuple[bytes, str]:
    rng = np.random.default_rng(i)
    h, w = 40 + (i % 3) * 8, 48 + (i % 4) * 8
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG" if i % 2 else "JPEG")
    return buf.getvalue(), ("png" if i % 2 else "jpg")


def samples():
    out = []
    for i in range(N):
        data, ext = _image(i)
        key = EVIL_KEY if i == 7 else f"img{i:04d}"
        sample = {
            "__key__": key,
            ext: data,
            "cls": str(i % 4).encode(),
            "txt": (EVIL_CAPTION if i == 7 else f"caption of sample {i}").encode(),
            "json": json.dumps({"i": i, "tag": "<i>x</i>"}).encode(),
            "bin": bytes(range(256)) * (1 + i % 3),
        }
        if i == 11:
            sample["seg.png"] = b"not an image"  # an image field Pillow cannot read
        out.append(sample)
    return out


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """``(manifest path, shard spec, samples)``: 120 samples in 3 shards (50, 50, 20)."""
    root = tmp_path_factory.mktemp("browse")
    made = samples()
    with ShardWriter(
        str(root / "train-%04d.tar"),
        maxcount=PER_SHARD,
        manifest=str(root / "train.json"),
        encoder=False,
    ) as sink:
        for s in made:
            sink.write(s)
    return str(root / "train.json"), str(root / "train-{0000..0002}.tar"), made


@pytest.fixture(scope="session")
def evil():
    """``(key, caption)``: the HTML that must show as text."""
    return EVIL_KEY, EVIL_CAPTION
