"""Audio and video from tar members: clip decoders, media metadata, byte-range access.

=============  ==============================================================================
``probe``      properties without decoding (image sizes, duration, fps, frames, rate...), the
               PyAV backend, :func:`media_meta` (per-sample metadata columns for the index)
``output``     numpy arrays or tensors (registered by :mod:`tarshards.torch`)
``video``      :func:`video`: clips decoded from the keyframe before them
``audio``      :func:`audio`: spans, resampled where asked
``access``     :func:`read_media`: a member decoded from its byte range of a shard
``metadata``   :func:`add_media_meta`: the media columns of an indexed data set's indexes
=============  ==============================================================================

PyAV is an optional dependency: ``pip install 'tarshards[av]'``.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "AudioClip": "audio",
    "AudioDecoder": "audio",
    "VideoClip": "video",
    "VideoDecoder": "video",
    "media_meta": "probe",
    "read_media": "access",
    "member_file": "access",
    "add_media_meta": "metadata",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'tarshards.media' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tarshards.media.{module}"), name)
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
