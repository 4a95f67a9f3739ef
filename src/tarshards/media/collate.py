"""Batches of clips: a column of :class:`VideoClip` collates to one ``VideoClip`` of stacked
frames ``(B, T, H, W, C)`` and timestamps ``(B, T)``; a column of :class:`AudioClip` to one
``AudioClip`` of stacked samples ``(B, channels, samples)`` (a list where the lengths differ) and
the rate (a list where the rates differ). Registered with the collation table
(:func:`tarshards.pipeline.stages.register_collation`) when such a column is first met (the package
declares the names)."""

from __future__ import annotations

from typing import Any, Callable

from ..pipeline.stages import default_collation_fn, register_collation
from .audio import AudioClip
from .video import VideoClip

__all__ = ["collate_audio", "collate_video"]


def collate_video(col: list, allocate: Callable | None = None) -> VideoClip:
    frames, timestamps = default_collation_fn([tuple(c) for c in col], allocate)
    return VideoClip(frames, timestamps)


def _same_shape(values: list) -> bool:
    shapes = {tuple(getattr(v, "shape", ())) for v in values}
    return len(shapes) == 1


def collate_audio(col: list, allocate: Callable | None = None) -> AudioClip:
    samples = [c.samples for c in col]
    rates = [c.rate for c in col]
    stacked: Any = (
        default_collation_fn([(s,) for s in samples], allocate)[0]
        if _same_shape(samples)
        else samples
    )
    return AudioClip(stacked, rates[0] if len(set(rates)) == 1 else rates)


register_collation(VideoClip, collate_video, into=collate_video)
register_collation(AudioClip, collate_audio, into=collate_audio)
