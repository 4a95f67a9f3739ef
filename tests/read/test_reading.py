"""Reading samples from a damaged shard: every complete sample before the damage, then the error."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib

import pytest

import tarshards
from tarshards.errors import ShardFormatError
from tarshards.format.names import group_samples
from tarshards.read.reading import shard_samples
from tarshards.tario import iter_tar, read_chunks

N = 1500  # samples of ~3 KB: a shard of ~5.4 MB, several of the reader's 1 MiB buffers


def _shard() -> tuple[bytes, list[int]]:
    """A ustar shard written by tarfile, and the offset just past each sample's last data byte."""
    out = io.BytesIO()
    ends = []
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(N):
            for ext, data in (("txt", bytes([65 + i % 26]) * 3000), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            ends.append(out.tell() - (-len(data) % 512))
    return out.getvalue(), ends


RAW, ENDS = _shard()
HEADER = [-(-e // 512) * 512 for e in ENDS]  # where the header after each sample starts
CUTS = [
    600,  # inside the first member's data
    ENDS[0] + 10,  # inside the padding after the first sample's last member: the stream ends
    HEADER[0] + 100,  # inside the next header, before its name can be read whole
    HEADER[0] + 505,  # inside the next header, its name (another sample's) legible
    len(RAW) // 3,
    len(RAW) // 2 + 7,
    ENDS[N - 2] + 700,
]


def _complete_before(cut: int) -> int:
    """How many samples the reader can tell are complete: those whose data ends before the cut,
    less the last of them when the cut falls in the next header before its name is legible
    (a ustar header's name is known once its prefix field, bytes 345-500, is there)."""
    n = sum(1 for e in ENDS if e <= cut)
    if n and HEADER[n - 1] < cut < HEADER[n - 1] + 500:
        n -= 1
    return n


def _read(path, how: str):
    if how == "file":  # a local plain file: memory-mapped and parsed in place
        return tarshards.WebDataset(str(path))
    # a stream without a file descriptor: read into the reader's buffer, chunk by chunk
    chunk = 1 << 20 if how == "stream" else 4096
    return shard_samples(
        str(path), opener=lambda u: io.BytesIO(path.read_bytes()), chunk_size=chunk
    )


@pytest.mark.parametrize("how", ["file", "stream", "small-chunks"])
@pytest.mark.parametrize("cut", CUTS)
def test_a_cut_plain_shard_yields_every_complete_sample_then_raises(tmp_path, cut, how):
    path = tmp_path / "cut.tar"
    path.write_bytes(RAW[:cut])
    got = []
    with pytest.raises(ShardFormatError) as ei:
        for sample in _read(path, how):
            got.append(sample)
    want = _complete_before(cut)
    assert [s["__key__"] for s in got] == [f"s{i:05d}" for i in range(want)]
    assert all(s["cls"] == str(i).encode() for i, s in enumerate(got))
    assert str(path) in str(ei.value) and "offset" in str(ei.value)


@pytest.mark.parametrize("cut", CUTS[2:])
def test_a_cut_gzip_shard_yields_every_complete_sample_then_raises(tmp_path, cut):
    # cut the compressed stream where the uncompressed stream holds `cut` bytes
    packed = gzip.compress(RAW, compresslevel=1)
    lo, hi = 0, len(packed)
    while lo < hi:  # the shortest prefix that decompresses to at least `cut` bytes
        mid = (lo + hi) // 2
        if len(zlib.decompressobj(31).decompress(packed[:mid])) >= cut:
            hi = mid
        else:
            lo = mid + 1
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(packed[:lo])
    got = []
    with pytest.raises(ShardFormatError) as ei:
        for sample in tarshards.WebDataset(str(path)):
            got.append(sample["__key__"])
    # the prefix holds `cut` bytes of the tar stream, and less than one more deflate block
    have = len(zlib.decompressobj(31).decompress(packed[:lo]))
    assert got == [f"s{i:05d}" for i in range(len(got))]
    assert _complete_before(cut) <= len(got) <= _complete_before(have)
    assert str(path) in str(ei.value)


@pytest.mark.parametrize("cut", CUTS)
def test_the_reference_grouping_loop_keeps_the_same_samples(cut):
    # the pure-Python grouping (no C extension, one member at a time) decides the same way
    members = iter_tar(read_chunks(io.BytesIO(RAW[:cut]), 1 << 16), "s")
    got = []
    with pytest.raises(ShardFormatError):
        for sample in group_samples(members, "s", accelerate=False):
            got.append(sample["__key__"])
    assert got == [f"s{i:05d}" for i in range(_complete_before(cut))]
