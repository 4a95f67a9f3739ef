"""What a media member is, without decoding it: sizes of images, duration, frame rate, frame count,
codec, sample rate and channels of audio and video; and the PyAV backend.

:func:`probe` reads an image's header (Pillow's lazy open: no pixels decoded) or a container's
header and stream parameters (PyAV: no frames decoded). :func:`media_meta` turns a sample into
per-sample numeric metadata columns named after the field and the property (``jpg.width``,
``mp4.duration``, ``flac.rate``...), what ``tarshards index --media`` and
``ShardWriter(..., meta=tarshards.media_meta())`` store in the index
(:meth:`tarshards.Manifest.meta` reads them).

PyAV (whose wheels bundle FFmpeg) is an optional dependency: ``pip install 'tarshards[av]'``.
"""

from __future__ import annotations

import io
import multiprocessing
import os
from typing import Any, Callable, Iterable

from ..errors import DecodeError, MissingDependencyError

__all__ = [
    "AUDIO_EXTENSIONS",
    "IMAGE_PROPERTIES",
    "MEDIA_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "av_module",
    "clip_offset",
    "decoder_threads",
    "media_meta",
    "open_container",
    "probe",
    "register_worker_count",
]

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi", "m4v")
AUDIO_EXTENSIONS = ("wav", "flac", "mp3", "ogg", "opus", "m4a")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm")
MEDIA_EXTENSIONS = VIDEO_EXTENSIONS + AUDIO_EXTENSIONS

IMAGE_PROPERTIES = ("width", "height")
VIDEO_PROPERTIES = ("width", "height", "duration", "fps", "frames")
AUDIO_PROPERTIES = ("duration", "rate", "channels", "samples")

INSTALL = "pip install 'tarshards[av]'"


def av_module():
    """The ``av`` module (PyAV), or :class:`MissingDependencyError` saying how to install it."""
    try:
        import av
    except ImportError:
        raise MissingDependencyError(
            f"decoding audio and video needs PyAV (which bundles FFmpeg): {INSTALL}"
        ) from None
    return av


# what tells a decoder how many loader workers share this host's cores with its process: the
# torch adapter registers DataLoader's (0 outside a worker)
_WORKER_COUNTS: list[Callable[[], int]] = []


def register_worker_count(fn: Callable[[], int]) -> None:
    """Register ``fn() -> int``: the number of loader worker processes this process is one of
    (0: it is not a loader worker). :mod:`tarshards.torch` registers DataLoader's."""
    if fn not in _WORKER_COUNTS:
        _WORKER_COUNTS.append(fn)


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def decoder_threads(threads: int | None = None) -> int:
    """FFmpeg decoding threads for one decoder: ``threads`` where given (0: FFmpeg's choice);
    otherwise chosen from where it runs: in a DataLoader worker, this process's share of the
    cores (cores // workers, at least 1: the workers decode in parallel already, and threads
    beyond that only compete for the same cores); in another worker process (a
    ``multiprocessing`` child: a pool, a Dask or Ray worker), 1; in a lone process, FFmpeg's
    choice (0)."""
    if threads is not None:
        return int(threads)
    for fn in _WORKER_COUNTS:
        workers = int(fn() or 0)
        if workers > 0:
            return max(1, _cpus() // workers)
    if multiprocessing.parent_process() is not None:
        return 1
    return 0


def _as_file(source) -> Any:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(source)
    return source


def open_container(source, what: str = "media"):
    """``av.open`` of ``source`` (bytes or a seekable binary file) for reading; a file FFmpeg
    cannot read is a :class:`~tarshards.errors.DecodeError`."""
    av = av_module()
    try:
        return av.open(_as_file(source), mode="r")
    except av.FFmpegError as exn:
        raise DecodeError(f"not a readable {what} file: {exn}") from exn


def _last_extension(ext: str) -> str:
    return ext.rpartition(".")[2].lower()


def _rate(x) -> float:
    return float(x) if x else 0.0


def stream_info(container, kind: str) -> dict:
    """The properties of the first ``kind`` (``"video"``/``"audio"``) stream of an open
    container; :class:`DecodeError` when it has none."""
    streams = container.streams.video if kind == "video" else container.streams.audio
    if not streams:
        raise DecodeError(f"the file has no {kind} stream")
    s = streams[0]
    tb = s.time_base
    duration = 0.0
    if s.duration is not None and tb is not None:
        duration = float(s.duration * tb)
    elif container.duration is not None:
        duration = container.duration / 1_000_000
    start = float(s.start_time * tb) if s.start_time is not None and tb is not None else 0.0
    codec = s.codec_context.name
    if kind == "video":
        fps = _rate(s.average_rate) or _rate(s.guessed_rate) or _rate(s.base_rate)
        frames = int(s.frames or 0) or (int(round(duration * fps)) if fps else 0)
        return {
            "width": int(s.codec_context.width),
            "height": int(s.codec_context.height),
            "duration": duration,
            "fps": fps,
            "frames": frames,
            "codec": codec,
            "start": start,
        }
    rate = int(s.codec_context.sample_rate or s.rate or 0)
    channels = int(s.codec_context.channels or 0)
    return {
        "duration": duration,
        "rate": rate,
        "channels": channels,
        "samples": int(round(duration * rate)),
        "codec": codec,
        "start": start,
    }


def probe(data, ext: str) -> dict:
    """The properties of one member's bytes (or a seekable file over them), by extension:
    images ``width``, ``height`` (from the header); video ``width``, ``height``, ``duration``
    (seconds), ``fps``, ``frames``, ``codec``; audio ``duration``, ``rate``, ``channels``,
    ``samples``, ``codec``. Nothing is decoded. Other extensions: ``{}``."""
    ext = _last_extension(ext)
    if ext in IMAGE_EXTENSIONS:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(_as_file(data)) as img:  # lazy: the header only
                return {"width": int(img.width), "height": int(img.height)}
        except (UnidentifiedImageError, OSError, ValueError) as exn:
            raise DecodeError(f"not a readable image: {exn}") from exn
    kind = "video" if ext in VIDEO_EXTENSIONS else "audio" if ext in AUDIO_EXTENSIONS else None
    if kind is None:
        return {}
    with open_container(data, kind) as container:
        info = stream_info(container, kind)
    info.pop("start", None)
    return info


class MediaMeta:
    """``media_meta()``: a sample's media fields -> numeric columns ``{"EXT.PROP": value}``.

    Bytes fields are probed (:func:`probe`); a ``.wav``/``.flac`` field given as an array or
    ``(array, rate)`` (as ``ShardWriter`` takes them) gives its rate, channels, samples and
    duration from the array. ``fields`` limits it to some extensions; a field that does not
    probe is left out of the sample's columns (NaN in the index) unless ``strict``.
    """

    def __init__(self, fields: Iterable[str] | str | None = None, strict: bool = False):
        if isinstance(fields, str):
            fields = fields.split()
        self.fields = None if fields is None else {f.lower() for f in fields}
        self.strict = strict

    def __call__(self, sample: dict) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in sample.items():
            if k.startswith("__"):
                continue
            ext = _last_extension(k)
            if self.fields is not None and k.lower() not in self.fields and ext not in self.fields:
                continue
            if ext not in IMAGE_EXTENSIONS and ext not in MEDIA_EXTENSIONS:
                continue
            try:
                info = self._info(v, ext)
            except (DecodeError, MissingDependencyError):
                if self.strict:
                    raise
                continue
            for prop, value in info.items():
                if isinstance(value, (int, float)):
                    out[f"{k}.{prop}"] = float(value)
        return out

    @staticmethod
    def _info(v, ext: str) -> dict:
        if isinstance(v, (bytes, bytearray, memoryview)):
            return probe(v, ext)
        if ext in ("wav", "flac"):
            from ..codecs.registry import audio_value

            arr, rate = audio_value(v, None)
            n = arr.shape[0]
            channels = 1 if arr.ndim == 1 else arr.shape[1]
            if rate is None:
                return {"samples": n, "channels": channels}
            return {"samples": n, "channels": channels, "rate": rate, "duration": n / rate}
        return {}


def media_meta(fields: Iterable[str] | str | None = None, strict: bool = False) -> Callable:
    """A per-sample metadata function for the index (see :class:`MediaMeta`):
    ``ShardWriter(..., manifest=M, meta=tarshards.media_meta())``."""
    return MediaMeta(fields, strict)


def clip_offset(room: int, clip: str, rng) -> int:
    """Where a clip starts, in frames or samples, given ``room`` (how far it may start from
    the beginning): drawn from ``rng`` for ``"random"``, the middle for ``"center"``, else 0."""
    if clip == "random":
        return rng.randint(0, room)
    return room // 2 if clip == "center" else 0
