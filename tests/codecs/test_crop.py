"""Fused random-resized-crop decoding: torchvision's crop distribution, pixels as decode-then-crop,
seeded per sample from the pipeline."""

from __future__ import annotations

import io
import math
import random
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import tarshards
from tarshards import TarWriter, WebDataset
from tarshards.codecs.crop import _dct_scale, crop_params, random_resized_crop
from tarshards.pipeline.stages import decode

try:
    import torch
except ImportError:  # pragma: no cover - CI installs torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


# ---------------------------------------------------------------------------------------------
# the crop distribution
# ---------------------------------------------------------------------------------------------


def reference_get_params(
    gen: np.random.Generator, n, width, height, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> np.ndarray:
    """``n`` crops (top, left, h, w) by torchvision's RandomResizedCrop.get_params as
    documented, vectorized on numpy's generator: ten tries of (area uniform in scale * image
    area, aspect ratio log-uniform in ratio, w = round(sqrt(area * ratio)),
    h = round(sqrt(area / ratio))); the first that fits is placed uniformly (top in
    [0, H - h], left in [0, W - w]); else the central crop with the image's aspect ratio
    clamped to ratio."""
    target = width * height * gen.uniform(scale[0], scale[1], (n, 10))
    aspect = np.exp(gen.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, 10)))
    w = np.round(np.sqrt(target * aspect)).astype(np.int64)  # round half to even, as round()
    h = np.round(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = np.argmax(fits, axis=1)
    rows = np.arange(n)
    w, h, ok = w[rows, first], h[rows, first], fits[rows, first]
    in_ratio = width / height
    if in_ratio < min(ratio):
        cw, ch = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        cw, ch = int(round(height * max(ratio))), height
    else:
        cw, ch = width, height
    w, h = np.where(ok, w, cw), np.where(ok, h, ch)
    top = np.where(ok, gen.integers(0, height - h + 1), (height - ch) // 2)
    left = np.where(ok, gen.integers(0, width - w + 1), (width - cw) // 2)
    return np.stack([top, left, h, w], axis=1)


def ks_statistic(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic (max distance between the empirical CDFs)."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


@pytest.mark.parametrize(
    "width,height,scale,ratio",
    [
        (500, 375, (0.08, 1.0), (3 / 4, 4 / 3)),
        (375, 500, (0.08, 1.0), (3 / 4, 4 / 3)),
        (224, 224, (0.5, 1.0), (0.5, 2.0)),
        (1000, 120, (0.08, 1.0), (3 / 4, 4 / 3)),  # a wide image: the fallback is common
        (90, 60, (0.9, 1.0), (1.0, 1.0)),  # square crops of 90% or more never fit: mostly fallback
    ],
)
def test_crop_distribution_matches_torchvision_algorithm(width, height, scale, ratio):
    n = 20000
    rng = random.Random(1234)
    ours = np.array([crop_params(rng, width, height, scale, ratio) for _ in range(n)])
    ref = reference_get_params(np.random.default_rng(99), n, width, height, scale, ratio)
    # every crop lies inside the image
    assert (ours[:, 2] >= 1).all() and (ours[:, 3] >= 1).all()
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()
    # KS at alpha = 1e-4 (for discrete values the test is conservative)
    critical = math.sqrt(-math.log(1e-4 / 2) / 2) * math.sqrt(2 / n)
    columns = {"top": 0, "left": 1, "height": 2, "width": 3}
    for name, col in columns.items():
        d = ks_statistic(ours[:, col], ref[:, col])
        assert d < critical, f"{name}: KS distance {d:.4f} >= {critical:.4f}"
    for name, f in {
        "area": lambda c: c[:, 2] * c[:, 3],
        "aspect": lambda c: c[:, 3] / c[:, 2],
    }.items():
        d = ks_statistic(f(ours), f(ref))
        assert d < critical, f"{name}: KS distance {d:.4f} >= {critical:.4f}"
    # how often the central-crop fallback is taken (binomial, 5 sigma)
    center = reference_get_params(np.random.default_rng(0), 1, width, height, (2.0, 2.0), ratio)

    def fallback(c):
        return np.mean(np.all(c == center, axis=1))

    p_ours, p_ref = fallback(ours), fallback(ref)
    sigma = math.sqrt(max(p_ref * (1 - p_ref), 1 / n) * 2 / n)
    assert abs(p_ours - p_ref) < 5 * sigma + 1e-9, (p_ours, p_ref)


def test_crop_distribution_is_not_trivially_equal():
    """The KS check above has power: a slightly different algorithm (uniform instead of
    log-uniform aspect ratios) is told apart."""
    n = 20000
    rng = random.Random(5)
    ours = np.array([crop_params(rng, 500, 375) for _ in range(n)])
    gen = np.random.default_rng(7)
    other = []
    for _ in range(n):
        for _ in range(10):
            target = 500 * 375 * gen.uniform(0.08, 1.0)
            aspect = gen.uniform(0.5, 2.0)  # wider than ratio, not log-uniform
            w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < w <= 500 and 0 < h <= 375:
                other.append((h, w))
                break
        else:
            other.append((375, 500))
    other = np.array(other)
    critical = math.sqrt(-math.log(1e-4 / 2) / 2) * math.sqrt(2 / n)
    assert ks_statistic(ours[:, 3] / ours[:, 2], other[:, 1] / other[:, 0]) > critical


def test_crop_params_fallback_is_central():
    class NeverFits(random.Random):
        def uniform(self, a, b):
            return b * 100  # areas far larger than the image

    assert crop_params(NeverFits(0), 1000, 100) == (0, (1000 - 133) // 2, 100, 133)
    assert crop_params(NeverFits(0), 100, 1000) == ((1000 - 133) // 2, 0, 133, 100)
    assert crop_params(NeverFits(0), 300, 280) == (0, 0, 280, 300)


def test_dct_scale_keeps_enough_pixels():
    assert _dct_scale(1000, 1000, 224, 224) == 4
    assert _dct_scale(448, 448, 224, 224) == 2
    assert _dct_scale(447, 900, 224, 224) == 1
    assert _dct_scale(100, 100, 224, 224) == 1
    assert _dct_scale(4000, 4000, 224, 224) == 8


# ---------------------------------------------------------------------------------------------
# the pixels
# ---------------------------------------------------------------------------------------------


def photo_like(width, height, seed=0) -> np.ndarray:
    """Smooth structure (gradients and blobs) plus mild noise: a misplaced crop shows."""
    gen = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack(
        [255 * x / width, 255 * y / height, 127 + 100 * np.sin(x / 23.0) * np.cos(y / 17.0)],
        axis=-1,
    )
    img += gen.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(arr, quality=90, mode=None) -> bytes:
    img = Image.fromarray(arr)
    if mode is not None:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def reference_crop(data: bytes, seed: int, size, flip=True) -> np.ndarray:
    """torchvision-style: decode the whole image with Pillow, crop, resize, flip (HxWx3 float)."""
    rng = random.Random(seed)
    img = Image.open(io.BytesIO(data)).convert("RGB")
    top, left, h, w = crop_params(rng, img.width, img.height)
    do_flip = flip and rng.random() < 0.5
    out = img.crop((left, top, left + w, top + h)).resize(
        (size[1], size[0]), Image.Resampling.BILINEAR
    )
    if do_flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out).astype(np.float32)


@pytest.mark.parametrize(
    "width,height,size",
    [
        (500, 375, (224, 224)),  # crops mostly smaller than the output: full-scale decode
        (1024, 768, (64, 80)),  # crops much larger than the output: decoded at 1/2 .. 1/8
        (320, 240, (32, 32)),
    ],
)
@pytest.mark.parametrize(
    "output",
    [
        "rgb8",
        pytest.param("torchrgb", marks=needs_torch),
        pytest.param("torchrgb8", marks=needs_torch),
    ],
)
def test_fused_crop_matches_decode_then_crop(width, height, size, output):
    data = jpeg_bytes(photo_like(width, height))
    crop = random_resized_crop(size, output=output)
    diffs = []
    for seed in range(12):
        got = crop("jpg", data, rng=random.Random(seed))
        if output == "torchrgb":
            assert got.dtype == torch.float32 and got.is_contiguous()
            assert tuple(got.shape) == (3, *size) and 0 <= float(got.min()) <= float(got.max()) <= 1
            got = got.permute(1, 2, 0).numpy() * 255
        elif output == "torchrgb8":
            assert got.dtype == torch.uint8 and tuple(got.shape) == (3, *size)
            got = got.permute(1, 2, 0).numpy()
        else:
            assert got.dtype == np.uint8 and got.shape == (*size, 3) and got.flags.writeable
        ref = reference_crop(data, seed, size)
        diffs.append(np.abs(got.astype(np.float32) - ref).mean())
    # same crop and flip: within JPEG-scale and resampling differences (a crop one pixel off,
    # or a wrong flip, gives far more on this image)
    assert max(diffs) < 4.0, diffs
    assert np.mean(diffs) < 2.0, diffs


def test_a_misplaced_crop_would_be_seen():
    """The tolerance above is meaningful: the reference against itself with another seed."""
    data = jpeg_bytes(photo_like(500, 375))
    diffs = [
        np.abs(
            reference_crop(data, s, (224, 224)) - reference_crop(data, s + 100, (224, 224))
        ).mean()
        for s in range(6)
    ]
    assert min(diffs) > 10.0, diffs


def test_flip_is_a_mirror_of_the_same_crop():
    data = jpeg_bytes(photo_like(400, 300))
    plain = random_resized_crop(48, flip=False, output="rgb8")
    flipping = random_resized_crop(48, flip=True, output="rgb8")
    seen = set()
    for seed in range(16):
        a = plain("jpg", data, rng=random.Random(seed))
        b = flipping("jpg", data, rng=random.Random(seed))
        if np.array_equal(a, b):
            seen.add("same")
        else:
            np.testing.assert_array_equal(a[:, ::-1], b)
            seen.add("flipped")
    assert seen == {"same", "flipped"}


@pytest.mark.parametrize("ext,mode", [("png", None), ("jpg", "L"), ("jpg", "CMYK"), ("webp", None)])
def test_other_images_are_cropped_too(ext, mode):
    arr = photo_like(200, 150)
    img = Image.fromarray(arr)
    if mode is not None:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext])
    got = random_resized_crop(40, output="rgb8")(ext, buf.getvalue(), rng=random.Random(0))
    assert got.shape == (40, 40, 3) and got.dtype == np.uint8


def test_non_image_fields_fall_through():
    crop = random_resized_crop(32, output="rgb8")
    assert crop("cls", b"3", rng=random.Random(0)) is None
    assert crop("json", b"{}") is None


def test_arguments_are_checked():
    for kwargs in (
        {"size": 0},
        {"size": (3, 4, 5)},
        {"scale": (0.5, 0.1)},
        {"ratio": (0, 1)},
        {"output": "bgr"},
    ):
        with pytest.raises(ValueError):
            random_resized_crop(**kwargs)


def test_numpy_output_needs_no_torch():
    code = (
        "import sys, random, io, numpy as np\nfrom PIL import Image\n"
        "from tarshards import random_resized_crop\n"
        "buf = io.BytesIO()\n"
        "Image.fromarray(np.zeros((50, 60, 3), np.uint8)).save(buf, 'JPEG')\n"
        "out = random_resized_crop(16, output='rgb8')('jpg', buf.getvalue(),\n"
        "                                             rng=random.Random(1))\n"
        "print(out.shape, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["(16,", "16,", "3)", "False"]


# ---------------------------------------------------------------------------------------------
# seeding through the pipeline
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def crop_shard(tmp_path):
    path = str(tmp_path / "crops.tar")
    with TarWriter(path) as w:
        for i in range(12):
            w.write(
                {"__key__": f"s{i:03d}", "jpg": jpeg_bytes(photo_like(160, 120, seed=i)), "cls": i}
            )
    return path


def crops_of(ds):
    return {int(c): img.copy() for img, c in ds}


def test_pipeline_crops_follow_seed_and_epoch(crop_shard):
    def dataset(seed):
        return (
            WebDataset(crop_shard, seed=seed)
            .decode(random_resized_crop(24, output="rgb8"))
            .to_tuple("jpg", "cls")
        )

    ds = dataset(0)
    ds.set_epoch(0)
    first = crops_of(ds)
    again = crops_of(ds)  # the same epoch again: the same crops
    assert all(np.array_equal(first[k], again[k]) for k in first)
    ds.set_epoch(1)
    other_epoch = crops_of(ds)
    assert sum(np.array_equal(first[k], other_epoch[k]) for k in first) <= 1
    other_seed = dataset(1)
    other_seed.set_epoch(0)
    seeded = crops_of(other_seed)
    assert sum(np.array_equal(first[k], seeded[k]) for k in first) <= 1
    fresh = dataset(0)
    fresh.set_epoch(0)
    assert all(np.array_equal(first[k], v) for k, v in crops_of(fresh).items())


def test_a_samples_crop_does_not_depend_on_the_samples_before_it(crop_shard):
    samples = list(WebDataset(crop_shard))
    crop = random_resized_crop(24, output="rgb8")
    whole = {s["__key__"]: s["jpg"] for s in decode(samples, crop, rng=random.Random(3))}
    tail = {s["__key__"]: s["jpg"] for s in decode(samples[5:], crop, rng=random.Random(3))}
    assert tail and all(np.array_equal(whole[k], v) for k, v in tail.items())


@needs_torch
def test_batches_of_float_crops(crop_shard):
    ds = WebDataset(crop_shard).decode(random_resized_crop(32)).to_tuple("jpg", "cls").batched(5)
    images, classes = next(iter(ds))
    assert tuple(images.shape) == (5, 3, 32, 32) and images.dtype == torch.float32
    assert tuple(classes.shape) == (5,)


def test_exported():
    assert tarshards.random_resized_crop is random_resized_crop


# ---------------------------------------------------------------------------------------------
# the C decoder's cropped decoding against the whole-image path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output",
    [
        "rgb8",
        pytest.param("torchrgb", marks=needs_torch),
        pytest.param("torchrgb8", marks=needs_torch),
    ],
)
@pytest.mark.parametrize("width,height,size", [(500, 375, (224, 224)), (1024, 768, (64, 80))])
def test_cropped_decoding_is_the_whole_decode_cropped(monkeypatch, width, height, size, output):
    pytest.importorskip("tarshards._jpeg", reason="the C JPEG decoder was not built")
    # the reference is simplejpeg's whole decode (the same libjpeg-turbo IDCT); Pillow's own
    # decoder, the fallback without simplejpeg, rounds differently
    pytest.importorskip("simplejpeg", reason="the whole-image reference decodes with simplejpeg")
    import tarshards.codecs.crop as crop_module

    data = jpeg_bytes(photo_like(width, height))
    crop = random_resized_crop(size, output=output)
    cropped = [crop("jpg", data, rng=random.Random(s)) for s in range(10)]
    monkeypatch.setattr(crop_module, "_cjpeg", lambda: None)  # simplejpeg, the whole image
    whole = [crop("jpg", data, rng=random.Random(s)) for s in range(10)]
    for a, b in zip(cropped, whole):
        a, b = np.asarray(a), np.asarray(b)
        if output.startswith("torch"):
            np.testing.assert_array_equal(a, b)  # the same pixels, the same resize
        else:  # Pillow's filter near the box edges: the decoded margin is enough
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
