"""Audio from tar members: ``ds.decode(tarshards.audio(rate=16000, seconds=4))``.

:func:`audio` is a decode handler for ``.wav .flac .mp3 .ogg .opus .m4a`` fields. Each field
becomes an :class:`AudioClip`: ``samples``, float32 ``(channels, samples)`` in [-1, 1] (a tensor
where torch is installed, else a numpy array; ``output=`` chooses), and ``rate``, the sample rate
of those samples.

``seconds=None`` decodes the whole recording; ``seconds=S`` a span of S seconds chosen by
``clip`` (``"random"``: drawn from the sample's generator, seeded from the pipeline's seed and
epoch and the sample's shard and key alone, so a resumed run decodes the same spans; ``"start"``;
``"center"``), zero-padded where the recording is shorter. The span is found by seeking
(``container.seek`` on the audio stream) and decoding forward, and cut to the sample. Integer PCM
is scaled as libsndfile scales it (``x / 2**(bits-1)``), so an uncompressed or lossless file gives
exactly what ``soundfile.read`` gives. ``rate=R`` resamples the span with FFmpeg's resampler
(PyAV's ``AudioResampler``); ``mono=True`` averages the channels into one.
"""

from __future__ import annotations

import random
from typing import Any, Callable, NamedTuple, Sequence

from ..errors import DecodeError
from .output import media_converter
from .probe import AUDIO_EXTENSIONS, av_module, clip_offset, open_container, stream_info

__all__ = ["AudioClip", "AudioDecoder", "audio"]

CLIPS = ("random", "start", "center", "all")

# integer sample formats -> the scale to [-1, 1) (and the offset of unsigned 8-bit)
_SCALE = {"s16": 1 / 32768, "s32": 1 / 2147483648, "s64": 1 / 9223372036854775808, "u8": 1 / 128}


class AudioClip(NamedTuple):
    """Decoded audio: ``samples`` (channels, samples) float32 and their ``rate`` (Hz)."""

    samples: Any
    rate: Any  # an int (a list in a batch of recordings at different rates)

    def __getitem__(self, i):  # clip["samples"] as well as clip[0] and clip.samples
        return getattr(self, i) if isinstance(i, str) else tuple.__getitem__(self, i)


def frame_array(frame):
    """One decoded audio frame as float32 ``(channels, samples)``."""
    import numpy as np

    arr = frame.to_ndarray()
    fmt = frame.format
    channels = frame.layout.nb_channels
    if not fmt.is_planar:
        arr = arr.reshape(-1, channels).T
    name = fmt.name.rstrip("p")
    scale = _SCALE.get(name)
    if scale is None:
        return arr.astype(np.float32, copy=False)
    if name == "u8":
        return (arr.astype(np.float32) - 128.0) * np.float32(scale)
    if name == "s64":
        return (arr.astype(np.float64) * scale).astype(np.float32)
    return arr.astype(np.float32) * np.float32(scale)


def resample(samples, rate: int, new_rate: int):
    """float32 ``(channels, n)`` at ``rate`` -> ``(channels, m)`` at ``new_rate``, with FFmpeg's
    resampler (each channel on its own: any number of channels)."""
    import numpy as np

    av = av_module()
    out = []
    for ch in samples:
        r = av.AudioResampler(format="flt", layout="mono", rate=new_rate)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(ch[None, :], np.float32), format="flt", layout="mono"
        )
        frame.sample_rate = rate
        frame.pts = None
        parts = [f.to_ndarray().reshape(-1) for f in r.resample(frame) + r.resample(None)]
        out.append(np.concatenate(parts) if parts else np.zeros(0, np.float32))
    n = min(len(x) for x in out)
    return np.stack([x[:n] for x in out]).astype(np.float32, copy=False)


class AudioDecoder:
    """A decode handler: audio fields -> :class:`AudioClip` (see the module)."""

    wants_rng = "sample"  # a generator from (seed, epoch, shard, key): not the place
    media = "audio"  # IndexedDataset reads these fields as byte ranges

    def __init__(
        self,
        rate: int | None = None,
        seconds: float | None = None,
        clip: str = "random",
        mono: bool = False,
        output: str = "auto",
        extensions: Sequence[str] | str | None = None,
    ):
        if rate is not None and int(rate) < 1:
            raise ValueError(f"rate must be >= 1, got {rate!r}")
        if seconds is not None and not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds!r}")
        if clip not in CLIPS:
            raise ValueError(f"clip must be one of {', '.join(CLIPS)}, got {clip!r}")
        media_converter(output)
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.extensions = frozenset(
            e.lower() for e in (AUDIO_EXTENSIONS if extensions is None else extensions)
        )
        self.rate = None if rate is None else int(rate)
        self.seconds = None if seconds is None else float(seconds)
        self.clip = clip
        self.mono = bool(mono)
        self.output = output
        self._convert: Callable[[Any], Any] | None = None

    def __repr__(self):
        return (
            f"audio(rate={self.rate}, seconds={self.seconds}, clip={self.clip!r}, mono={self.mono})"
        )

    def __call__(self, key: str, data, rng: random.Random | None = None) -> Any:
        if key.rpartition(".")[2].lower() not in self.extensions:
            return None
        return self.decode(data, rng)

    def decode(self, source, rng: random.Random | None = None) -> AudioClip:
        """Decode from ``source``: bytes or a seekable binary file."""
        av = av_module()
        if rng is None:
            rng = random.Random()
        state = rng.getstate()
        try:
            with open_container(source, "audio") as container:
                samples, rate = self._decode(container, rng, True)
        except av.FFmpegError:
            # a demuxer that cannot go on after a seek (FLAC without a seek table, say):
            # the same span, decoded from the start
            rng.setstate(state)
            _rewind(source)
            try:
                with open_container(source, "audio") as container:
                    samples, rate = self._decode(container, rng, False)
            except av.FFmpegError as exn:
                raise DecodeError(f"cannot decode the audio: {exn}") from exn
        if self.mono and samples.shape[0] > 1:
            samples = samples.mean(axis=0, keepdims=True, dtype="float32")
        if self.rate is not None and self.rate != rate:
            samples = resample(samples, rate, self.rate)
            rate = self.rate
        if self._convert is None:
            self._convert = media_converter(self.output)
        return AudioClip(self._convert(samples), rate)

    def _decode(self, container, rng: random.Random, seek: bool):
        import numpy as np

        info = stream_info(container, "audio")
        stream = container.streams.audio[0]
        tb = stream.time_base
        rate = info["rate"]
        if not rate:
            raise DecodeError("the audio stream has no sample rate")
        start = info["start"]
        total = info["samples"]
        if self.seconds is None or self.clip == "all":
            s0, n = 0, None
        else:
            n = max(1, int(round(self.seconds * rate)))
            room = max(total - n, 0)
            s0 = clip_offset(room, self.clip, rng)
        for attempt in (0, 1):
            if s0 > 0 and attempt == 0 and seek:
                container.seek(int((start + s0 / rate) / tb), stream=stream, backward=True)
            elif attempt == 1:
                container.seek(0, stream=stream, backward=True)
            parts = []
            pos = None
            overshot = False
            channels = info["channels"] or 1
            for frame in container.decode(stream):
                arr = frame_array(frame)
                channels = arr.shape[0]
                if frame.pts is not None:
                    fpos = int(round((float(frame.pts * tb) - start) * rate))
                    if pos is None and fpos > s0 and attempt == 0 and s0 > 0 and seek:
                        overshot = True
                        break
                    if pos is None or abs(fpos - pos) > 1:
                        pos = fpos
                elif pos is None:
                    pos = 0
                lo, hi = pos, pos + arr.shape[1]
                pos = hi
                if hi <= s0:
                    continue
                a = max(s0 - lo, 0)
                b = arr.shape[1] if n is None else min(arr.shape[1], s0 + n - lo)
                if b > a:
                    parts.append(arr[:, a:b])
                if n is not None and hi >= s0 + n:
                    break
            if not overshot:
                break
        got = np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), np.float32)
        if got.shape[1] == 0 and (n is None or total == 0):
            raise DecodeError("the audio has no samples")
        if n is not None and got.shape[1] < n:  # shorter than the span: zeros after it
            got = np.concatenate([got, np.zeros((got.shape[0], n - got.shape[1]), np.float32)], 1)
        return np.ascontiguousarray(got, dtype=np.float32), rate


def _rewind(source) -> None:
    if hasattr(source, "seek"):
        source.seek(0)


def audio(
    rate: int | None = None,
    seconds: float | None = None,
    clip: str = "random",
    mono: bool = False,
    output: str = "auto",
    extensions: Sequence[str] | str | None = None,
) -> AudioDecoder:
    """A decode handler for audio: ``ds.decode(tarshards.audio(rate=16000, seconds=4))``.

    See the module :mod:`tarshards.media.audio`."""
    return AudioDecoder(
        rate, seconds=seconds, clip=clip, mono=mono, output=output, extensions=extensions
    )
