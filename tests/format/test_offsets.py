"""Samples carry ``__offset__``: where their first member's first header starts in the tar stream.

For random archives (our writer and tarfile's ustar/GNU/pax, with directories, metadata members
and long names between the samples), reading one sample at its ``__offset__`` gives the same
sample, whichever way the sequential read went (C or Python grouping and reader, memory-mapped
file, stream, gzip); a reader that starts at a sample's offset reports the same offsets.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tarshards.format.names import group_samples
from tarshards.storage.seek import read_sample_at, samples_from
from tarshards.tario import TarMemberWriter, iter_tar_batches, tar_byte_source
from tarshards.tario.buffer import MappedFile

_EXTS = ["jpg", "cls", "json", "seg.png", "TXT"]


@st.composite
def archives(draw):
    """``(members, writer)``: members are ``(kind, name, data)`` in archive order."""
    writer = draw(st.sampled_from(["ours", "ustar", "gnu", "pax"]))
    long = writer != "ustar"  # ustar cannot hold the long names
    members = []
    for i in range(draw(st.integers(1, 10))):
        for _ in range(draw(st.integers(0, 1))):  # something that is no sample's member
            junk = draw(st.sampled_from(["dir", "__meta__.json", "noext", "d/__x__"]))
            members.append(("dir" if junk == "dir" else "file", f"j{i}/{junk}", b"junk"))
        where = draw(st.sampled_from(["", "dir/", "./"] + (["d" * 120 + "/"] if long else [])))
        key = f"{where}k{i:03d}" + draw(st.sampled_from(["", "_" + "x" * (90 if long else 40)]))
        exts = draw(st.lists(st.sampled_from(_EXTS), min_size=1, max_size=3, unique=True))
        for ext in exts:
            members.append(("file", f"{key}.{ext}", draw(st.binary(max_size=1500))))
    return members, writer


def _build(members, writer: str) -> bytes:
    buf = io.BytesIO()
    if writer == "ours":
        w = TarMemberWriter(buf)
        w.add_all([(name, data) for kind, name, data in members if kind == "file"])
        w.finish()
        return buf.getvalue()
    fmt = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
    with tarfile.open(fileobj=buf, mode="w", format=fmt[writer]) as tf:
        for kind, name, data in members:
            ti = tarfile.TarInfo(name)
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _samples(stream, accelerate: bool) -> list[dict]:
    batches = iter_tar_batches(tar_byte_source(stream, "u.tar"), "u.tar", accelerate=accelerate)
    return list(group_samples(batches, "u.tar", batched=True, accelerate=accelerate))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(archive=archives())
def test_reading_at_offset_gives_the_same_sample(archive):
    data = _build(*archive)
    seq = _samples(io.BytesIO(data), True)
    assert seq, "every archive here holds a sample"
    assert [s["__offset__"] for s in seq] == sorted({s["__offset__"] for s in seq})
    # every way of reading gives the same samples, offsets included
    assert _samples(io.BytesIO(data), False) == seq
    assert _samples(io.BytesIO(gzip.compress(data)), True) == seq  # uncompressed offsets
    fd, path = tempfile.mkstemp(suffix=".tar")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for accelerate in (True, False):
            with open(path, "rb", buffering=0) as f:
                assert isinstance(tar_byte_source(f, "u.tar"), MappedFile)
                f.seek(0)
                assert _samples(f, accelerate) == seq
        with open(path, "rb", buffering=0) as f:
            for s in seq:  # one sample at its offset (a mapped file, then a stream)
                assert read_sample_at(f, s["__offset__"], url="u.tar") == s
                got = read_sample_at(io.BytesIO(data), s["__offset__"], url="u.tar")
                assert got == s
            # a reader that starts at a sample reports the offsets of a full read
            mid = seq[len(seq) // 2]["__offset__"]
            f.seek(mid)
            batches = iter_tar_batches(tar_byte_source(f, "u.tar"), "u.tar", offset=mid)
            rest = list(group_samples(batches, "u.tar", batched=True))
            assert rest == seq[len(seq) // 2 :]
            assert list(samples_from(f, mid, url="u.tar")) == rest
    finally:
        os.unlink(path)


def test_writers_skip_the_offset_field():
    """A sample read back and written again holds the same members: ``__offset__`` (like every
    ``__`` field but ``__key__``) is not written."""
    from tarshards.write.writer import TarWriter

    buf = io.BytesIO()
    w = TarMemberWriter(buf)
    w.add_all([("a.jpg", b"1"), ("a.cls", b"2"), ("b.jpg", b"3")])
    w.finish()
    seq = _samples(io.BytesIO(buf.getvalue()), True)
    assert [s["__offset__"] for s in seq] == [0, 2048]
    out = io.BytesIO()
    with TarWriter(out, encoder=False) as tw:
        for s in seq:
            tw.write(s)
        data = out.getvalue()
    names = [m.name for m in tarfile.open(fileobj=io.BytesIO(data))]
    assert sorted(names) == ["a.cls", "a.jpg", "b.jpg"]
    again = _samples(io.BytesIO(data), True)
    assert [{k: v for k, v in s.items() if k != "__offset__"} for s in again] == [
        {k: v for k, v in s.items() if k != "__offset__"} for s in seq
    ]
