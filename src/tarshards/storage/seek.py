"""Random access into a shard: one sample at a byte offset, or every sample from an offset on.

The offsets come from a :class:`tarshards.format.index.ShardIndex`: for plain tar shards, where a
sample's first header starts; for sample-aligned compressed shards, where its compressed bytes
start: a zstd/lz4 frame (or an old-layout gzip member), or a full-flush point inside the one gzip
member (``entry="deflate"``, the index's ``entry``: a raw inflater starts there). The members
are parsed by the ordinary tar reader and grouped by :func:`tarshards.format.names.group_samples`,
so a sample read here is the sample a sequential read gives (same fields, same bytes).
"""

from __future__ import annotations

from typing import BinaryIO, Iterable, Iterator

from ..errors import ShardFormatError, TruncatedShardError
from ..format.compression import inflated_from
from ..format.names import group_samples
from ..tario import decompressed_chunks, iter_tar, read_chunks

__all__ = ["read_exact", "read_sample_at", "sample_from_bytes", "samples_from"]

_CHUNK = 1 << 20


def read_exact(stream: BinaryIO, n: int, url=None, offset: int | None = None) -> bytes:
    """Exactly ``n`` bytes from ``stream`` (raises :class:`TruncatedShardError` on a short read)."""
    parts = []
    left = n
    while left > 0:
        data = stream.read(left)
        if not data:
            raise TruncatedShardError(
                f"the shard ends {left} bytes before the sample does", url=url, offset=offset
            )
        parts.append(data)
        left -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _shifted(members, delta: int):
    for name, data, offset in members:
        yield name, data, offset + delta


def _position(stream: BinaryIO, offset: int) -> None:
    seekable = getattr(stream, "seekable", None)
    if seekable is not None and seekable():
        stream.seek(offset)


def read_sample_at(
    stream: BinaryIO,
    offset: int,
    *,
    end: int | None = None,
    compression: str = "none",
    tar_offset: int | None = None,
    url=None,
    last_dot: bool = False,
    entry: str = "member",
) -> dict:
    """The sample whose bytes start at ``offset`` of a shard file.

    ``stream`` is a binary file: a seekable one is moved to ``offset``; any other must already
    be there (a ranged request, say). ``end`` (the index's ``sample_ends``) bounds the read to
    that sample's bytes; without it the stream is read until the next sample begins.
    ``compression`` is the index's: ``"none"``, or ``"gzip"``/``"zstd"`` for sample-aligned
    compressed shards, where ``offset`` is the sample's frame and ``tar_offset`` its position in
    the uncompressed tar stream (member offsets are reported from there); ``entry`` is the
    index's too (``"deflate"``: a flush point of a one-member gzip shard).
    """
    _position(stream, offset)
    chunks: Iterable[bytes]
    if end is not None:
        if end <= offset:
            raise ValueError(f"a sample's end ({end}) must lie after its offset ({offset})")
        chunks = [read_exact(stream, end - offset, url, offset)]
    else:
        chunks = read_chunks(stream, _CHUNK)
    return _first_sample(
        chunks,
        offset if tar_offset is None else tar_offset,
        compression,
        url,
        last_dot,
        offset,
        entry,
    )


def sample_from_bytes(
    data: bytes,
    tar_offset: int,
    *,
    compression: str = "none",
    url=None,
    last_dot: bool = False,
    offset: int | None = None,
    entry: str = "member",
) -> dict:
    """The sample held by ``data``: the bytes of a shard from a sample's offset to its end (as
    a ranged read gives them). ``tar_offset`` is where they start in the tar stream."""
    return _first_sample(
        [data],
        tar_offset,
        compression,
        url,
        last_dot,
        tar_offset if offset is None else offset,
        entry,
    )


def _decompressed(chunks, compression: str, entry: str, url, offset, bounded: bool):
    if compression == "none":
        return chunks
    if entry == "deflate":
        return inflated_from(chunks, url, offset or 0, bounded=bounded)
    return decompressed_chunks(chunks, url)


def _first_sample(
    chunks, base: int, compression: str, url, last_dot: bool, offset, entry="member"
) -> dict:
    chunks = _decompressed(chunks, compression, entry, url, offset, True)
    members = _shifted(iter_tar(chunks, url, drain=False), base)
    for sample in group_samples(members, url, last_dot=last_dot):
        return sample
    raise ShardFormatError("no sample at this offset", url=url, offset=offset)


def samples_from(
    stream: BinaryIO,
    offset: int,
    *,
    compression: str = "none",
    tar_offset: int | None = None,
    url=None,
    last_dot: bool = False,
    entry: str = "member",
) -> Iterator[dict]:
    """Every sample of a shard from the one at ``offset`` on (how a resumed reader seeks).

    Same offsets as :func:`read_sample_at`; a compressed shard must be sample-aligned (the
    reader starts decompressing at the sample's own frame, or its flush point).
    """
    _position(stream, offset)
    chunks = _decompressed(read_chunks(stream, _CHUNK), compression, entry, url, offset, False)
    base = offset if tar_offset is None else tar_offset
    yield from group_samples(_shifted(iter_tar(chunks, url), base), url, last_dot=last_dot)
