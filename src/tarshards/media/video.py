"""Video clips from tar members: ``ds.decode(tarshards.video(frames=16))``.

:func:`video` is a decode handler (like :func:`tarshards.random_resized_crop`) for ``.mp4 .webm
.mkv .mov .avi .m4v`` fields. Each field becomes a :class:`VideoClip`: ``frames``, uint8
``(T, H, W, C)`` RGB (a tensor where torch is installed, else a numpy array; ``output=``
chooses), and ``timestamps``, the presentation time in seconds of each frame (float64).

Only what the clip needs is decoded: the demuxer seeks (``container.seek`` on the video stream,
backwards to the keyframe at or before the clip's first frame) and the decoder runs forward from
there until the clip's last frame; frames outside the clip are decoded (a codec needs them) but
never converted to RGB. The member's bytes are read through any seekable file: the sample's
bytes in memory in a streaming pipeline, or a :class:`tarshards.storage.ranges.RangeFile` over
the member's byte range of the shard in random access (:func:`read_media`,
``IndexedDataset(..., decode=tarshards.video())``), where only the blocks the demuxer asks for
are fetched (its header and index, then the clip's packets).

Which frames: ``frames`` frames, every ``stride``-th frame of the source (``stride=1``:
consecutive frames), or sampled at ``fps`` frames a second (the frame shown at each instant: a
frame repeats where ``fps`` is above the source's). ``clip``: ``"random"`` (a start drawn from
the sample's generator, which the decode stage seeds from the pipeline's seed and epoch and the
sample's shard and key alone, not from the rank or worker reading it, so a resumed run, with any
number of workers, decodes the same clips), ``"start"``,
``"center"``, or ``"all"`` (every frame, or every ``stride``-th, or the whole video at ``fps``;
``frames`` is ignored). A video shorter than the clip gives its last frame repeated (at its
timestamp) up to ``frames``. ``size``: ``None`` (as stored), an int (the shorter side, aspect
kept) or ``(height, width)``; FFmpeg's scaler resizes while converting to RGB.
"""

from __future__ import annotations

import random
import threading
from typing import Any, Callable, NamedTuple, Sequence

from ..errors import DecodeError
from .output import media_converter
from .probe import (
    VIDEO_EXTENSIONS,
    av_module,
    clip_offset,
    decoder_threads,
    open_container,
    stream_info,
)

__all__ = ["VideoClip", "VideoDecoder", "video"]

CLIPS = ("random", "start", "center", "all")
THREAD_TYPES = ("slice", "frame", "auto")


class VideoClip(NamedTuple):
    """A decoded clip: ``frames`` (T, H, W, C) uint8 and ``timestamps`` (T,) seconds."""

    frames: Any
    timestamps: Any

    def __getitem__(self, i):  # clip["frames"] as well as clip[0] and clip.frames
        return getattr(self, i) if isinstance(i, str) else tuple.__getitem__(self, i)


def _out_size(size, width: int, height: int) -> tuple[int, int] | None:
    """``(width, height)`` to scale to, or None (as stored)."""
    if size is None:
        return None
    if isinstance(size, int):
        if width <= height:
            return size, max(1, int(round(height * size / width)))
        return max(1, int(round(width * size / height))), size
    h, w = size
    return int(w), int(h)


class VideoDecoder:
    """A decode handler: video fields -> :class:`VideoClip` (see the module)."""

    wants_rng = "sample"  # a generator from (seed, epoch, shard, key): not the place
    media = "video"  # IndexedDataset reads these fields as byte ranges (tarshards.media.read_media)

    def __init__(
        self,
        frames: int = 16,
        stride: int = 1,
        fps: float | None = None,
        clip: str = "random",
        size: int | Sequence[int] | None = None,
        output: str = "auto",
        extensions: Sequence[str] | str | None = None,
        threads: int | None = None,
        thread_type: str = "slice",
    ):
        if int(frames) < 1:
            raise ValueError(f"frames must be >= 1, got {frames!r}")
        if int(stride) < 1:
            raise ValueError(f"stride must be >= 1, got {stride!r}")
        if fps is not None and not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        if fps is not None and stride != 1:
            raise ValueError("give stride= or fps=, not both")
        if clip not in CLIPS:
            raise ValueError(f"clip must be one of {', '.join(CLIPS)}, got {clip!r}")
        if size is not None and not isinstance(size, int):
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"size must be an int or (height, width), got {size!r}")
            size = (int(size[0]), int(size[1]))
        elif isinstance(size, int) and size < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        if threads is not None and int(threads) < 0:
            raise ValueError(
                f"threads must be None (chosen), or >= 0 (0: FFmpeg's choice), got {threads!r}"
            )
        if thread_type not in THREAD_TYPES:
            raise ValueError(
                f"thread_type must be one of {', '.join(THREAD_TYPES)}, got {thread_type!r}"
            )
        media_converter(output)  # checks the name
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.extensions = frozenset(
            e.lower() for e in (VIDEO_EXTENSIONS if extensions is None else extensions)
        )
        self.frames = int(frames)
        self.stride = int(stride)
        self.fps = None if fps is None else float(fps)
        self.clip = clip
        self.size = size
        self.output = output
        # FFmpeg's decoding threads per clip; None (default): chosen where the decoder runs
        # (probe.decoder_threads: a lone process FFmpeg's choice, a DataLoader worker its share
        # of the cores); 0: FFmpeg's choice
        self.threads = None if threads is None else int(threads)
        # how FFmpeg's threads share the work: "slice" (PyAV's default: the slices of a frame,
        # where the encoder made several; no added delay), "frame" (frames in flight at once:
        # any stream, for more CPU time a frame) or "auto" (both)
        self.thread_type = thread_type
        self._convert: Callable[[Any], Any] | None = None
        # per thread: the RGB converter (an FFmpeg scaler context kept from frame to frame and
        # clip to clip, not made again for each frame); made where the decoder runs
        self._local = threading.local()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_local"] = None
        state["_convert"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self):
        how = f"fps={self.fps}" if self.fps is not None else f"stride={self.stride}"
        return f"video(frames={self.frames}, {how}, clip={self.clip!r}, size={self.size!r})"

    def __call__(self, key: str, data, rng: random.Random | None = None) -> Any:
        if key.rpartition(".")[2].lower() not in self.extensions:
            return None
        return self.decode(data, rng)

    # ---- the work ------------------------------------------------------------------------------
    def decode(self, source, rng: random.Random | None = None, keyframes=None) -> VideoClip:
        """Decode the clip from ``source``: bytes or a seekable binary file. ``keyframes``:
        ``(times, positions)`` of the video's keyframes (the index's keyframe table), with
        which a source that can (:meth:`tarshards.storage.ranges.RangeFile.prefetch`) fetches
        the clip's packets, from the keyframe before it to the keyframe after it, in one
        request."""
        av = av_module()
        if rng is None:
            rng = random.Random()
        state = rng.getstate()
        try:
            with open_container(source, "video") as container:
                plan = (source, keyframes) if keyframes is not None else None
                return self._decode(container, rng, True, plan)
        except av.FFmpegError:
            # a demuxer that cannot go on after a seek: the same clip, decoded from the start
            rng.setstate(state)
            if hasattr(source, "seek"):
                source.seek(0)
            try:
                with open_container(source, "video") as container:
                    return self._decode(container, rng, False)
            except av.FFmpegError as exn:
                raise DecodeError(f"cannot decode the video: {exn}") from exn

    def _targets(self, info: dict, rng: random.Random) -> list[float] | None:
        """The clip's instants, seconds from the stream's start (None: every frame)."""
        src_fps = info["fps"] or 25.0
        duration = info["duration"] or (info["frames"] / src_fps)
        n_total = info["frames"] or max(1, int(round(duration * src_fps)))
        if self.fps is None:
            if self.clip == "all":
                if self.stride == 1:
                    return None
                return [i / src_fps for i in range(0, n_total, self.stride)]
            span = (self.frames - 1) * self.stride + 1
            room = max(n_total - span, 0)
            first = clip_offset(room, self.clip, rng)
            return [(first + i * self.stride) / src_fps for i in range(self.frames)]
        step = 1.0 / self.fps
        if self.clip == "all":
            count = max(1, int(duration * self.fps + 1e-9))
            return [i * step for i in range(count)]
        span_s = (self.frames - 1) * step
        room_s = max(duration - 1.0 / src_fps - span_s, 0.0)
        t0 = (
            rng.uniform(0.0, room_s)
            if self.clip == "random"
            else room_s / 2
            if self.clip == "center"
            else 0.0
        )
        # on the source's frame grid, so the choice of frames does not hang on rounding
        t0 = round(t0 * src_fps) / src_fps
        return [t0 + i * step for i in range(self.frames)]

    def _decode(self, container, rng: random.Random, seek: bool, plan=None) -> VideoClip:
        import numpy as np

        info = stream_info(container, "video")
        stream = container.streams.video[0]
        threads = decoder_threads(self.threads)
        if threads != 1:
            stream.thread_type = self.thread_type.upper()
        if threads:  # else FFmpeg's choice
            stream.codec_context.thread_count = threads
        tb = stream.time_base
        start = info["start"]
        targets = self._targets(info, rng)
        eps = 0.5 / (info["fps"] or 25.0)
        chosen: list = []
        if targets is None:  # every frame
            chosen = [f for f in container.decode(stream)]
        else:
            targets = [start + t for t in targets]
            if plan is not None:
                _prefetch(plan, targets[0] - eps, targets[-1] + eps)
            chosen = self._collect(container, stream, targets, eps, tb, start, seek)
        if not chosen:
            raise DecodeError("the video has no frames")
        first = chosen[0]
        width, height = _out_size(self.size, first.width, first.height) or (
            first.width,
            first.height,
        )
        # each frame converted once, straight into its row of the clip (a frame shown twice,
        # at fps above the source's, is copied from its first row)
        frames = np.empty((len(chosen), height, width, 3), np.uint8)
        rgb = self._rgb
        rows: dict[int, int] = {}
        for i, f in enumerate(chosen):
            j = rows.get(id(f))
            if j is None:
                rows[id(f)] = i
                frames[i] = rgb(f, width, height)
            else:
                frames[i] = frames[j]
        times = np.array([_time(f, tb) for f in chosen], dtype=np.float64)
        if self._convert is None:
            self._convert = media_converter(self.output)
        return VideoClip(self._convert(frames), self._convert(times))

    def _rgb(self, frame, width: int, height: int):
        """``frame`` as an RGB array ``(height, width, 3)`` (a view of FFmpeg's frame): through
        this thread's scaler context, one thread (FFmpeg's default would make a pool of
        threads for every frame, whose start costs more than the conversion of a frame)."""
        local = self._local
        reformat = getattr(local, "reformat", None)
        if reformat is None:
            reformat = local.reformat = _reformatter()
        return reformat(frame, width, height).to_ndarray()

    def _collect(
        self, container, stream, targets: list[float], eps: float, tb, start: float, seek: bool
    ):
        """For each target instant, the last frame shown at or before it (decoded forward from
        the keyframe at or before the first)."""
        for attempt in (0, 1) if seek else (1,):
            if targets[0] - eps > start and attempt == 0:
                container.seek(int((targets[0] - eps) / tb), stream=stream, backward=True)
            elif attempt == 1 and seek:
                container.seek(int(start / tb) if start > 0 else 0, stream=stream, backward=True)
            chosen: list = []
            prev = None
            j, m = 0, len(targets)
            overshot = False
            for f in container.decode(stream):
                t = _time(f, tb)
                if prev is None and t > targets[0] + eps and attempt == 0 and targets[0] > start:
                    overshot = True  # the seek landed after the clip: once more from the start
                    break
                while j < m and t > targets[j] + eps:
                    chosen.append(prev if prev is not None else f)
                    j += 1
                if j == m:
                    break
                prev = f
            if overshot:
                continue
            while j < m and prev is not None:  # the video ended: its last frame, repeated
                chosen.append(prev)
                j += 1
            return chosen
        return []


def _prefetch(plan, first: float, last: float) -> None:
    """Ask the source for the bytes from the keyframe at or before ``first`` to the keyframe
    after ``last`` (the packets decoding the clip reads), where it can take them."""
    source, (times, positions) = plan
    prefetch = getattr(source, "prefetch", None)
    if prefetch is None or len(times) == 0:
        return
    import numpy as np

    i = max(int(np.searchsorted(times, first, side="right")) - 1, 0)
    j = int(np.searchsorted(times, last, side="right"))
    lo = int(positions[i])
    size = getattr(source, "size", None)
    hi = int(positions[j]) if j < len(positions) and size is None else size
    if j < len(positions) and size is not None:
        # the decoder reads one frame past the clip, through FFmpeg's 32 KiB reads
        hi = min(int(positions[j]) + (32 << 10), size)
    if lo >= 0 and hi is not None and hi > lo:
        prefetch(lo, hi)


def _reformatter() -> Callable[[Any, int, int], Any]:
    """``f(frame, width, height) -> rgb24 frame``, one scaler context reused (PyAV's
    ``VideoReformatter``, which makes its context again only when the frames change), run on
    one thread (PyAV before 14 has no ``threads=``: its scaler runs on one anyway)."""
    from av.video.reformatter import VideoReformatter

    r = VideoReformatter()
    one_thread: dict = {"threads": 1}

    def reformat(frame, width: int, height: int):
        try:
            return r.reformat(frame, width, height, "rgb24", **one_thread)
        except TypeError:
            if not one_thread:
                raise
            one_thread.clear()
            return r.reformat(frame, width, height, "rgb24")

    return reformat


def _time(frame, tb) -> float:
    t = frame.time
    if t is None:
        return float(frame.pts * tb) if frame.pts is not None else 0.0
    return float(t)


def video(
    frames: int = 16,
    stride: int = 1,
    fps: float | None = None,
    clip: str = "random",
    size: int | Sequence[int] | None = None,
    output: str = "auto",
    extensions: Sequence[str] | str | None = None,
    threads: int | None = None,
    thread_type: str = "slice",
) -> VideoDecoder:
    """A decode handler for video clips: ``ds.decode(tarshards.video(frames=16, stride=2))``.

    See the module :mod:`tarshards.media.video`."""
    return VideoDecoder(
        frames,
        stride=stride,
        fps=fps,
        clip=clip,
        size=size,
        output=output,
        extensions=extensions,
        threads=threads,
        thread_type=thread_type,
    )
