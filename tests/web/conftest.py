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


# ---- a data set of media: a short video (PyAV), tones (soundfile) -------------------------------
MEDIA_N = 6
VIDEO_FRAMES, VIDEO_FPS = 20, 25
TONE_SECONDS, TONE_RATE = 0.5, 8000
BROKEN_VIDEO = 4  # the sample whose mp4 is not a video


def make_video(frames: int = VIDEO_FRAMES, fps: int = VIDEO_FPS) -> bytes:
    """A 64x48 MPEG-4 video of moving noise over a gray ramp (a poster frame is not blank)."""
    import av

    pattern = np.random.default_rng(0).integers(0, 200, (48, 64, 3), np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.codec_context.bit_rate = 2_000_000
        for i in range(frames):
            img = (np.roll(pattern, 2 * i, axis=1) + 4 * i).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def make_tone(seconds: float = TONE_SECONDS, rate: int = TONE_RATE, fmt: str = "WAV") -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (np.sin(2 * np.pi * 440 * t) * 0.5).astype(np.float32), rate, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="session")
def media_dataset(tmp_path_factory):
    """``(manifest path, shard spec, samples)``: 6 samples in 2 shards, each a video (sample 4's
    is not one), a WAV tone, a FLAC tone and a caption; the manifest's indexes hold the media
    metadata columns (``tarshards.media_meta()``: ``mp4.duration``, ``wav.rate``...)."""
    pytest.importorskip("av", reason="the media browser tests need PyAV (pip install av)")
    pytest.importorskip("soundfile", reason="the media browser tests need soundfile")
    import tarshards

    root = tmp_path_factory.mktemp("browse-media")
    video, wav, flac = make_video(), make_tone(), make_tone(0.25, fmt="FLAC")
    made = [
        {
            "__key__": f"clip{i:02d}",
            "mp4": b"not a video at all" if i == BROKEN_VIDEO else video,
            "wav": wav,
            "flac": flac,
            "txt": f"clip {i}".encode(),
        }
        for i in range(MEDIA_N)
    ]
    with ShardWriter(
        str(root / "media-%04d.tar"),
        maxcount=4,
        manifest=str(root / "media.json"),
        encoder=False,
        meta=tarshards.media_meta(),
    ) as sink:
        for s in made:
            sink.write(s)
    return str(root / "media.json"), str(root / "media-{0000..0001}.tar"), made
