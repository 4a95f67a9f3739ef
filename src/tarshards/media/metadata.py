"""Media metadata columns for the indexes of an existing data set (``tarshards index --media``).

:func:`add_media_meta` probes every image, video and audio member of a manifest's shards
(:func:`tarshards.media.probe.probe`: image headers through Pillow's lazy open, containers
through PyAV; nothing decoded) and stores the columns (``jpg.width``, ``mp4.duration``,
``flac.rate``...) with each shard's index, where :meth:`tarshards.Manifest.meta` reads them.
Members of plain shards are read as byte ranges (:class:`tarshards.storage.ranges.RangeFile`), so
over HTTP/S3 a video's probe fetches its header and index only.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from ..errors import DecodeError, MissingDependencyError, ShardFormatError, TarshardsError
from ..format.manifest import Manifest, as_manifest
from ..storage.ranges import RangeFile
from .probe import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, VIDEO_EXTENSIONS, open_container, probe

__all__ = ["add_media_meta", "member_keyframes", "shard_keyframes", "shard_media_meta"]

_PROBED = frozenset(IMAGE_EXTENSIONS + MEDIA_EXTENSIONS)


def shard_media_meta(
    index,
    url: str,
    *,
    fields: Iterable[str] | None = None,
    storage_options: dict | None = None,
    on_error: str = "skip",
) -> dict:
    """The media columns of one shard (``{"mp4.duration": [...], ...}``, NaN where a sample
    lacks the field), from its :class:`~tarshards.format.index.ShardIndex` and its URL.
    ``on_error="skip"`` leaves a member that does not probe out (NaN); ``"raise"`` raises
    the data error naming the shard, member and offset."""
    if not index.seekable or index.compression != "none":
        raise ShardFormatError(
            "media metadata is read from uncompressed (or sample-aligned) shards' members; "
            "re-write this shard uncompressed (tarsplit) to index its media",
            url=url,
        )
    wanted = None if fields is None else {f.lower() for f in fields}
    n = index.num_samples
    columns: dict[str, list] = {}
    nan = float("nan")
    exts = [e.lower() for e in index.extensions]
    codes = index.member_ext.tolist()
    samples = index.member_sample.tolist()
    offsets = index.member_data_offsets.tolist()
    sizes = index.member_sizes.tolist()
    keys = index.keys
    for m, code in enumerate(codes):
        ext = exts[code]
        last = ext.rpartition(".")[2]
        if last not in _PROBED or (wanted is not None and ext not in wanted and last not in wanted):
            continue
        j = samples[m]
        try:
            with RangeFile(url, offsets[m], sizes[m], storage_options=storage_options) as f:
                info = probe(f, last)
        except (DecodeError, MissingDependencyError) as exn:
            if on_error == "raise" or isinstance(exn, MissingDependencyError):
                if isinstance(exn, TarshardsError):
                    exn.with_context(url=url, member=f"{keys[j]}.{ext}", offset=offsets[m])
                raise
            continue
        for prop, value in info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                col = columns.setdefault(f"{ext}.{prop}", [nan] * n)
                col[j] = float(value)
    return columns


def member_keyframes(source) -> tuple[list[float], list[int]]:
    """``(times, positions)`` of the keyframes of a video's first stream: presentation time in
    seconds and byte position of each keyframe packet, read by demuxing (no decoding)."""
    times: list[float] = []
    positions: list[int] = []
    with open_container(source, "video") as c:
        if not c.streams.video:
            return times, positions
        stream = c.streams.video[0]
        tb = stream.time_base
        for packet in c.demux(stream):
            if packet.is_keyframe and packet.pts is not None and packet.pos is not None:
                if packet.pos >= 0:
                    times.append(float(packet.pts * tb))
                    positions.append(int(packet.pos))
    return times, positions


def shard_keyframes(index, url: str, *, storage_options: dict | None = None) -> tuple:
    """The keyframe table of a plain shard's video members: ``(members, times, positions)``
    (see :attr:`tarshards.format.index.ShardIndex.keyframe_table`); members that do not demux are
    left out."""
    members: list[int] = []
    times: list[float] = []
    positions: list[int] = []
    exts = [e.lower().rpartition(".")[2] for e in index.extensions]
    offsets = index.member_data_offsets.tolist()
    sizes = index.member_sizes.tolist()
    for m, code in enumerate(index.member_ext.tolist()):
        if exts[code] not in VIDEO_EXTENSIONS:
            continue
        try:
            with RangeFile(url, offsets[m], sizes[m], storage_options=storage_options) as f:
                t, p = member_keyframes(f)
        except DecodeError:
            continue
        members += [m] * len(t)
        times += t
        positions += p
    return members, times, positions


def add_media_meta(
    manifest,
    *,
    fields: Iterable[str] | None = None,
    workers: int | None = None,
    storage_options: dict | None = None,
    on_error: str = "skip",
    keyframes: bool = False,
) -> Manifest:
    """Probe the media members of every shard of ``manifest`` (a :class:`Manifest` or its
    path/URL) and save each shard's index again with the media columns added; returns the
    manifest (loaded again, so its indexes are the new ones). ``fields``: the extensions to
    probe (default every image, video and audio extension); ``workers``: shards at once
    (threads). ``keyframes``: also store each video member's keyframe table (it demuxes the
    whole member), with which random access fetches a clip's packets in one request."""
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    m = as_manifest(manifest, storage_options)
    urls = m.shard_urls()

    def one(i: int) -> None:
        idx = m.load_index(i)
        cols = shard_media_meta(
            idx, urls[i], fields=fields, storage_options=storage_options, on_error=on_error
        )
        new = idx.with_meta(cols) if cols else idx
        if keyframes:
            new = new.with_keyframes(
                *shard_keyframes(idx, urls[i], storage_options=storage_options)
            )
        if new is not idx:
            target = m.index_url(i)
            if target is None:
                raise ShardFormatError("the manifest has no index for this shard", url=urls[i])
            new.save(target, storage_options=storage_options)

    n = len(m.shards)
    workers = min(workers or os.cpu_count() or 1, max(n, 1))
    if workers <= 1:
        for i in range(n):
            one(i)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(n)))
    if m.url is None:
        return m
    return Manifest.load(m.url, storage_options=storage_options)
