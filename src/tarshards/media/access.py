"""Decoding a media member straight from its byte range of a shard: ``(url, offset, size)``.

:func:`read_media` opens bytes ``[offset, offset+size)`` of the shard at ``url`` as a seekable
file (:class:`tarshards.storage.ranges.RangeFile`: ``pread`` locally, ranged requests over
HTTP/S3/GCS, a few blocks kept) and hands it to a decoder (:func:`tarshards.video`,
:func:`tarshards.audio`), whose demuxer then reads only what the clip needs: its header, its
index, and the packets from the keyframe before the clip to the clip's end.
``tarshards.IndexedDataset(manifest, decode=tarshards.video())`` reads video and audio fields
this way (the member's offset and size come from the shard's index).
"""

from __future__ import annotations

import random
from typing import Any

from ..errors import TarshardsError
from ..storage.ranges import RangeFile

__all__ = ["member_file", "read_media"]


def member_file(
    url: str,
    offset: int,
    size: int,
    *,
    storage_options: dict | None = None,
    block_size: int = 32 << 10,
) -> RangeFile:
    """A member's bytes (at ``offset`` of the shard at ``url``, ``size`` long) as a seekable
    file (a context manager)."""
    return RangeFile(url, offset, size, storage_options=storage_options, block_size=block_size)


def read_media(
    url: str,
    offset: int,
    size: int,
    decoder: Any,
    *,
    rng: random.Random | None = None,
    member: str | None = None,
    storage_options: dict | None = None,
    block_size: int = 32 << 10,
    stats: dict | None = None,
    keyframes=None,
) -> Any:
    """Decode the member at bytes ``[offset, offset+size)`` of ``url`` with ``decoder`` (a
    :class:`~tarshards.media.video.VideoDecoder` or
    :class:`~tarshards.media.audio.AudioDecoder`), fetching only the ranges its demuxer reads.
    Errors name the shard, the member and the offset. ``stats`` (a dict) receives
    ``bytes_fetched`` and ``requests``. ``keyframes``: the member's ``(times, positions)`` from
    the index's keyframe table (``tarshards index --keyframes``), with which a video clip's
    packets are fetched in one request."""
    with member_file(
        url, offset, size, storage_options=storage_options, block_size=block_size
    ) as f:
        try:
            if keyframes is not None and getattr(decoder, "media", None) == "video":
                return decoder.decode(f, rng, keyframes=keyframes)
            return decoder.decode(f, rng)
        except TarshardsError as exn:
            raise exn.with_context(url=url, member=member, offset=offset) from None
        finally:
            if stats is not None:
                stats["bytes_fetched"] = stats.get("bytes_fetched", 0) + f.bytes_fetched
                stats["requests"] = stats.get("requests", 0) + f.requests
