"""Media written in the tests: videos whose frames carry their index in their pixels, tones."""

from __future__ import annotations

import io

import numpy as np
import pytest

try:  # the test modules skip without them (pytest.importorskip there)
    import av
    import soundfile as sf
except ImportError:  # a lean install
    av = sf = None

LEVEL = 4  # frame i is a solid gray of level (i * LEVEL) % 256


def frame_level(i: int) -> int:
    return (i * LEVEL) % 256


def make_video(
    n: int,
    *,
    fps: int = 25,
    width: int = 64,
    height: int = 48,
    fmt: str = "mp4",
    codec: str = "mpeg4",
    gop: int = 12,
    texture: bool = False,
) -> bytes:
    """A video of ``n`` frames; frame ``i`` is a solid gray of level ``frame_level(i)`` (with
    ``texture``, plus noise: frames of realistic size)."""
    pattern = np.random.default_rng(0).integers(0, 48, (height, width, 3), np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height = width, height
        s.pix_fmt = "yuv420p"
        s.gop_size = gop
        # near-lossless: the gray levels survive the codec
        s.options = {"crf": "0"} if codec == "libx264" else {}
        if codec == "mpeg4":
            s.codec_context.bit_rate = 2_000_000
        for i in range(n):
            img = np.full((height, width, 3), frame_level(i), np.uint8)
            if texture:  # a noise pattern that moves (no scene cuts: keyframes every gop)
                img = (img + np.roll(pattern, 2 * i, axis=1)).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def make_tone(seconds: float, rate: int = 8000, channels: int = 1, freq: float = 440.0):
    t = np.arange(int(seconds * rate)) / rate
    x = np.stack([np.sin(2 * np.pi * freq * (c + 1) * t) * 0.5 for c in range(channels)], 1)
    return x.astype(np.float32)


def encode_audio(x: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def full_decode(data: bytes) -> tuple[list, list]:
    """Every frame (rgb24 arrays) and its time, decoding from the start."""
    frames, times = [], []
    with av.open(io.BytesIO(data)) as c:
        for f in c.decode(video=0):
            frames.append(f.to_ndarray(format="rgb24"))
            times.append(float(f.time))
    return frames, times


@pytest.fixture(scope="session")
def video_100():
    return make_video(100)
