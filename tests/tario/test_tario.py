"""The streaming tar reader agrees with ``tarfile`` and GNU tar; compressed and piped streams;
precise errors on truncated and corrupted shards."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import warnings

import pytest
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tarshards.errors import ShardFormatError
from tarshards.pipeline.dataset import shard_samples
from tarshards.tario import (
    decompressed_chunks,
    iter_tar,
    open_tar_bytes,
    read_chunks,
    tar_byte_source,
    tar_header,
)
from tarshards.tario.buffer import DirectFile, MappedFile, map_local

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
HAVE_TAR = shutil.which("tar") is not None


def read_all(data: bytes, chunk_size: int = 1 << 20, source="mem"):
    """Members read with fresh chunks and with one reused read buffer (the pipeline's way): the
    two must agree, errors included."""
    sources = [
        decompressed_chunks(read_chunks(io.BytesIO(data), chunk_size, reuse=reuse), source)
        for reuse in (False, True)
    ]
    # and read straight into the reader's buffer, from a stream that returns short reads
    sources.append(tar_byte_source(Trickle(data, chunk_size), source, chunk_size))
    results = []
    with local_file(data) as f, local_file(data) as g:  # and memory-mapped, from a local file
        sources.append(tar_byte_source(f, source, chunk_size))
        # and read with pread, members the buffer cuts straight into their bytes (however short)
        direct = tar_byte_source(g, source, chunk_size, direct=True)
        if isinstance(direct, DirectFile):
            direct.min_read = 1
        sources.append(direct)
        for chunks in sources:
            try:
                results.append(list(iter_tar(chunks, source)))
            except ShardFormatError as exc:
                results.append(exc)
        f.seek(0)  # and zero-copy: members are read-only views of the map, the same bytes
        try:
            views = list(iter_tar(tar_byte_source(f, source, chunk_size), source, copy=False))
            assert all(
                type(d) is bytes or (type(d) is memoryview and d.readonly) for _, d, _ in views
            )
            results.append([(n, bytes(d), o) for n, d, o in views])
        except ShardFormatError as exc:
            results.append(exc)
    plain = results[0]
    if isinstance(plain, ShardFormatError):
        for other in results[1:]:
            assert isinstance(other, ShardFormatError) and str(other) == str(plain)
        raise plain
    assert all(other == plain for other in results[1:])
    return plain


class local_file:
    """``data`` in a local file, open for reading (unbuffered, as ``open_url`` opens it), so that
    :func:`tar_byte_source` maps it (a plain tar that is not empty)."""

    def __init__(self, data: bytes, buffering: int = 0):
        fd, self.path = tempfile.mkstemp(suffix=".tar")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self.f = open(self.path, "rb", buffering=buffering)

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        self.f.close()
        os.unlink(self.path)


def test_local_plain_files_are_mapped():
    data = _member("a.txt", b"x" * 1000) + bytes(1024)
    for buffering in (0, -1):
        with local_file(data, buffering) as f:
            f.read(0)
            src = tar_byte_source(f, "f")
            assert isinstance(src, MappedFile) and src.start == 0
            assert [(n, d) for n, d, _ in iter_tar(src, "f")] == [("a.txt", b"x" * 1000)]
            assert src.map.closed  # the reader unmaps the file when it finishes
            assert not f.closed  # the file object stays the caller's
    # from the position the file is at, offsets counted from there (or from offset=)
    two = _member("a.txt", b"1") + _member("b.txt", b"2") + bytes(1024)
    with local_file(two, -1) as f:
        f.seek(1024)
        src = tar_byte_source(f, "f")
        assert isinstance(src, MappedFile) and src.start == 1024
        assert list(iter_tar(src, "f")) == [("b.txt", b"2", 0)]
        f.seek(1024)
        assert list(iter_tar(tar_byte_source(f, "f"), "f", offset=1024)) == [("b.txt", b"2", 1024)]
        f.seek(1024)
        assert not isinstance(tar_byte_source(f, "f", mapped=False), MappedFile)
    # compressed, empty, and not-a-file inputs are streams as before
    with local_file(gzip.compress(two)) as f:
        assert not isinstance(tar_byte_source(f, "f"), MappedFile)
        f.seek(0)
        assert [m[0] for m in iter_tar(tar_byte_source(f, "f"), "f")] == ["a.txt", "b.txt"]
    with local_file(b"") as f:
        assert not isinstance(tar_byte_source(f, "f"), MappedFile)
    assert not isinstance(tar_byte_source(io.BytesIO(two), "f"), MappedFile)


@pytest.mark.parametrize("accelerate", [True, False])
def test_mapped_copies_come_in_small_batches(accelerate):
    """Members copied out of a mapped file come in batches of at most ``COPY_WINDOW`` bytes of
    the file (plus the member that starts before it ends), so that a batch's fresh ``bytes``
    reuse the memory the consumer freed of the last one; views keep the 1 MiB header window."""
    from tarshards.tario import iter_tar_batches
    from tarshards.tario.buffer import COPY_WINDOW

    member = 100_000
    members = [(f"{i:04d}.jpg", bytes([i % 251]) * member) for i in range(40)]
    raw = b"".join(tar_header(n, len(d)) + d + bytes(-len(d) % 512) for n, d in members)
    raw += bytes(1024)
    step = 512 + member + (-member % 512)  # a member's bytes in the file
    with local_file(raw) as f:
        batches = list(iter_tar_batches(tar_byte_source(f, "f"), "f", accelerate=accelerate))
        f.seek(0)
        views = list(
            iter_tar_batches(tar_byte_source(f, "f"), "f", accelerate=accelerate, copy=False)
        )
        assert [(n, bytes(d)) for b in views for n, d, _ in b] == members
        assert max(len(b) for b in views) > COPY_WINDOW // step + 1
    assert [(n, d) for b in batches for n, d, _ in b] == members
    assert all(type(d) is bytes for b in batches for _, d, _ in b)
    assert max(len(b) for b in batches) == -(-COPY_WINDOW // step)


@pytest.mark.parametrize("chunk_size", [1 << 20, 64 << 10, 4096])
def test_direct_reads_put_large_members_straight_into_their_bytes(chunk_size, monkeypatch):
    """``direct=True`` (what the sample readers use for copies): a local plain file read with
    pread, no map; a member the buffer cuts is read straight into its ``bytes`` and the buffer
    refilled from the next header (a batch: the buffer's members, then about ``DIRECT_WINDOW``
    bytes of members read so). The same
    members, offsets and errors as the mapped file; ``shard_samples`` reads copies so, and maps
    the file for views."""
    from tarshards.tario import iter_tar_batches
    from tarshards.tario.buffer import DIRECT_WINDOW

    sizes = [100_000, 3, 250_000, 17, 20_000, 0, 70_000, 1_000_000, 5, 16_384, 33_000] * 3
    members = [
        (f"{i:04d}.{'jpg' if n > 100 else 'cls'}", bytes([i % 251]) * n)
        for i, n in enumerate(sizes)
    ]
    raw = b"".join(tar_header(n, len(d)) + d + bytes(-len(d) % 512) for n, d in members)
    raw += bytes(1024)
    with local_file(raw) as f:
        mapped = list(iter_tar_batches(tar_byte_source(f, "f", chunk_size), "f"))
        src = tar_byte_source(f, "f", chunk_size, direct=True)
        assert isinstance(src, DirectFile) and f.tell() == 0
        direct = list(iter_tar_batches(src, "f", chunk_size=chunk_size))
    flat = [m for b in direct for m in b]
    assert flat == [m for b in mapped for m in b]
    assert [(n, d) for n, d, _ in flat] == members and all(type(d) is bytes for _, d, _ in flat)
    # a batch: what the buffer held (grown to hold the members the scan left to it: the 70 KB
    # one after a 16 KB one with the smallest buffer), then members read straight in up to
    # about DIRECT_WINDOW
    bound = max(chunk_size, 100_000) + DIRECT_WINDOW
    assert max(sum(len(d) for _, d, _ in b[:-1]) for b in direct) < bound
    # cut short inside a large member: the error the mapped reader raises, at its offset
    with local_file(raw[: len(raw) // 2]) as f, local_file(raw[: len(raw) // 2]) as g:
        errors = []
        for src in (tar_byte_source(f, "f"), tar_byte_source(g, "f", direct=True)):
            with pytest.raises(ShardFormatError) as ei:
                list(iter_tar_batches(src, "f"))
            errors.append((type(ei.value), str(ei.value)))
        assert errors[0] == errors[1] and "truncated" in errors[0][1]
    # the sample reader: pread for copies, the map for views
    made = []
    import tarshards.tario.buffer as buffer

    for name in ("direct_local", "map_local"):
        real = getattr(buffer, name)
        monkeypatch.setattr(
            buffer, name, lambda *a, real=real, name=name, **k: made.append(name) or real(*a, **k)
        )
    with local_file(raw) as f:
        path = f.name
        assert len(list(shard_samples(path))) == len(members)
        assert made[-1:] == ["direct_local"]
        assert len(list(shard_samples(path, copy=False))) == len(members)
        assert made[-1:] == ["map_local"]


def test_direct_refills_sized_by_the_last_sample_read_a_growing_gap_right():
    """A refill after a member read straight in asks for about the bytes the last sample had
    between its large members (its headers and small members), not a fixed 8 KB: where the next
    sample's small members are larger (a caption that grows, several small fields), the refill
    cuts one and the reader reads on from there. The same members and offsets as the map, for
    gaps that grow, shrink and jump."""
    from tarshards.tario import iter_tar_batches

    rng = random.Random(41)
    members = []
    small = [10, 10, 400, 1500, 3000, 9000, 12, 20_000, 5, 700, 5000, 2, 2]
    for i, n in enumerate(small * 2):
        members.append((f"{i:04d}.txt", bytes([i % 251]) * n))
        for j in range(rng.randrange(0, 3)):  # more small fields, some samples
            members.append((f"{i:04d}.x{j}", bytes([j]) * rng.randrange(0, 2000)))
        members.append((f"{i:04d}.jpg", bytes([(i * 7) % 251]) * rng.randrange(40_000, 140_000)))
    raw = b"".join(tar_header(n, len(d)) + d + bytes(-len(d) % 512) for n, d in members)
    raw += bytes(1024)
    for chunk_size in (1 << 20, 64 << 10, 4096):
        with local_file(raw) as f:
            mapped = [m for b in iter_tar_batches(tar_byte_source(f, "f"), "f") for m in b]
            src = tar_byte_source(f, "f", chunk_size, direct=True)
            assert isinstance(src, DirectFile)
            direct = [m for b in iter_tar_batches(src, "f", chunk_size=chunk_size) for m in b]
        assert direct == mapped
        assert [(n, d) for n, d, _ in direct] == members


def test_a_mapped_range_ends_where_it_is_told():
    """``map_local(stream, length)`` and ``MappedFile.part`` read a byte range of a file (a
    planned reader's run of samples, a resumed buffer's samples): the members inside it with
    their offsets in the file, the end of the range taken as the end of the input. A part
    leaves the map open for the next part; the whole file's object closes it."""
    members = [_member(f"{i}.txt", bytes([65 + i]) * (100 * i + 1)) for i in range(5)]
    data = b"".join(members) + bytes(1024)
    starts = [sum(map(len, members[:i])) for i in range(6)]
    want = [(f"{i}.txt", bytes([65 + i]) * (100 * i + 1), starts[i]) for i in range(5)]
    with local_file(data, -1) as f:
        f.seek(starts[1])
        src = map_local(f, starts[3] - starts[1])
        assert isinstance(src, MappedFile) and (src.start, src.stop) == (starts[1], starts[3])
        assert list(iter_tar(src, "f", offset=starts[1])) == want[1:3]
        assert src.map.closed
        f.seek(0)
        whole = map_local(f)
        assert whole is not None and whole.stop == len(data)
        for a, b in ((0, 1), (2, 5), (4, 5), (1, 4)):
            for size in (512, 700, 1 << 20):  # the window of headers parsed at a time
                part = whole.part(starts[a], starts[b])
                batches = iter_tar_batches(part, "f", offset=starts[a], chunk_size=size)
                assert [m for batch in batches for m in batch] == want[a:b]
                assert not whole.map.closed
        assert list(iter_tar(whole.part(starts[3]), "f", offset=starts[3])) == want[3:]
        whole.close()
        assert whole.map.closed
        f.seek(0)
        assert map_local(f, 0) is None  # nothing to read
    assert map_local(io.BytesIO(data), 10) is None  # not a file: the caller reads it


@pytest.mark.parametrize("size", [512, 700, 4096, 1 << 20])
def test_the_reader_buffer_size_changes_nothing_but_the_reads(size):
    """A reader's buffer reads ``chunk_size`` bytes at a time (a planned reader passes a small
    one): the members are the same for every size, from a stream and from a map."""
    members = [_member(f"m{i}.bin", os.urandom(37 * i)) for i in range(40)]
    data = b"".join(members) + bytes(1024)
    want = list(iter_tar([data], "f"))
    reads = []

    class Counting(Trickle):
        def readinto(self, view):
            reads.append(len(view))
            return super().readinto(view)

    got = iter_tar_batches(
        tar_byte_source(Counting(data, 1 << 30), "f", size), "f", chunk_size=size
    )
    assert [m for batch in got for m in batch] == want
    assert size <= max(reads) <= 2 * size + 4096  # about a chunk at a time (or one member)
    with local_file(data) as f:
        got = iter_tar_batches(tar_byte_source(f, "f"), "f", chunk_size=size)
        assert [m for batch in got for m in batch] == want


class Trickle(io.RawIOBase):
    """A stream whose reads return at most ``n`` bytes (a pipe or a slow socket)."""

    def __init__(self, data: bytes, n: int):
        self._data = io.BytesIO(data)
        self._n = n

    def readable(self):
        return True

    def readinto(self, view):
        chunk = self._data.read(min(self._n, len(view)))
        view[: len(chunk)] = chunk
        return len(chunk)


def tarfile_regular(data: bytes):
    """``(name, bytes, offset)`` of the regular members, as the standard library reads them."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
        for m in tf:
            if m.isreg():
                out.append((m.name, tf.extractfile(m).read(), m.offset))
    return out


# ---------------------------------------------------------------------------------------------
# archives built by tarfile, in every format
# ---------------------------------------------------------------------------------------------

_segment = st.text(
    alphabet=st.sampled_from("abcXYZ019_-. " + "éüß中文ʃ🙂"),
    min_size=1,
    max_size=12,
).filter(lambda s: s not in (".", "..") and not s.startswith(" "))


@st.composite
def member_names(draw):
    kind = draw(st.sampled_from(["short", "short", "long100", "long255"]))
    parts = draw(st.lists(_segment, min_size=1, max_size=4))
    if kind == "long100":
        parts.append("n" * draw(st.integers(90, 140)))
    elif kind == "long255":
        parts = ["d" * draw(st.integers(60, 99)) for _ in range(3)] + parts
    return "/".join(parts)


@st.composite
def archive_entries(draw):
    n = draw(st.integers(0, 8))
    entries = []
    for _ in range(n):
        kind = draw(st.sampled_from(["file", "file", "file", "empty", "dir", "symlink", "link"]))
        name = draw(member_names())
        if kind == "file":
            size = draw(st.sampled_from([1, 511, 512, 513, 1000, 3000, 70_000]))
            data = (
                draw(st.binary(min_size=size, max_size=size)) if size < 2000 else os.urandom(size)
            )
        else:
            data = b""
        target = draw(member_names()) if kind in ("symlink", "link") else ""
        entries.append((kind, name, data, target))
    return entries


def build_tarfile(entries, fmt, pax_global=None):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_global) as tf:
        for kind, name, data, target in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if kind in ("file", "empty"):
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            elif kind == "dir":
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                ti.linkname = target
                tf.addfile(ti)
    return buf.getvalue()


# (the archives hold links, which the reader skips with a warning tested on its own)
@pytest.mark.filterwarnings("ignore:.* links to .* is skipped:tarshards.errors.TarshardsWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=archive_entries(),
    fmt=st.sampled_from(sorted(FORMATS)),
    chunk_size=st.sampled_from([1, 7, 100, 512, 513, 4096, 1 << 20]),
)
def test_reader_agrees_with_tarfile(entries, fmt, chunk_size):
    try:
        data = build_tarfile(entries, FORMATS[fmt])
    except ValueError:  # ustar cannot hold this name
        assume(False)
    expected = tarfile_regular(data)
    got = read_all(data, chunk_size)
    assert got == expected
    assert [n for _, n, _, _ in entries if True] or got == []
    # every regular entry written is read back, in order
    assert [(n, d) for n, d, _ in got] == [
        (n, d) for k, n, d, _ in entries if k in ("file", "empty")
    ]


# (the archives hold links, which the reader skips with a warning tested on its own)
@pytest.mark.filterwarnings("ignore:.* links to .* is skipped:tarshards.errors.TarshardsWarning")
@settings(max_examples=25, deadline=None)
@given(entries=archive_entries(), data=st.data())
def test_reader_irregular_chunks(entries, data):
    """Chunks of arbitrary, varying sizes (as from a network stream) change nothing."""
    raw = build_tarfile(entries, tarfile.PAX_FORMAT)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=30)))
    pieces = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
    pieces = [p for p in pieces if p]
    assert list(iter_tar(pieces, "x")) == tarfile_regular(raw)


def test_pax_global_header_names_and_data():
    entries = [("file", "a/x.txt", b"hello", ""), ("file", "é" * 120 + ".bin", b"z" * 700, "")]
    raw = build_tarfile(entries, tarfile.PAX_FORMAT, pax_global={"comment": "made by a test"})
    got = read_all(raw, 100)
    assert [(n, d) for n, d, _ in got] == [(n, d) for n, d, _ in tarfile_regular(raw)]
    assert [(n, d) for n, d, _ in got] == [("a/x.txt", b"hello"), ("é" * 120 + ".bin", b"z" * 700)]


def test_pax_size_overrides_header_size():
    payload = bytes(range(256)) * 4
    pax = tarfile.TarInfo._create_pax_generic_header(
        {"size": str(len(payload)), "path": "p/long.bin"}, tarfile.XHDTYPE, "utf-8"
    )
    ti = tarfile.TarInfo("short")
    ti.size = 0  # the pax record rules
    raw = pax + ti.tobuf(tarfile.USTAR_FORMAT) + payload + bytes(-len(payload) % 512) + bytes(1024)
    assert read_all(raw, 300) == tarfile_regular(raw) == [("p/long.bin", payload, 0)]


def test_gnu_base256_size():
    payload = b"q" * 777
    ti = tarfile.TarInfo("big.bin")
    ti.size = len(payload)
    hdr = bytearray(ti.tobuf(tarfile.GNU_FORMAT))
    hdr[124:136] = b"\x80" + len(payload).to_bytes(11, "big")
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    raw = bytes(hdr) + payload + bytes(-len(payload) % 512) + bytes(1024)
    assert read_all(raw) == tarfile_regular(raw) == [("big.bin", payload, 0)]


def test_gnu_magic_ignores_prefix_field():
    """Old GNU headers keep atime/ctime where ustar has its prefix: no prefix is applied."""
    ti = tarfile.TarInfo("x.txt")
    ti.size = 3
    hdr = bytearray(ti.tobuf(tarfile.GNU_FORMAT))
    assert hdr[257:265] == b"ustar  \0"
    hdr[345:357] = b"14755171432\0"  # a GNU atime
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    raw = bytes(hdr) + b"abc" + bytes(509) + bytes(1024)
    assert read_all(raw) == [("x.txt", b"abc", 0)]


def test_v7_directory_with_regular_typeflag_is_skipped():
    """Pre-POSIX tars mark directories as typeflag NUL with a trailing slash (tarfile agrees)."""
    d = tarfile.TarInfo("olddir/")
    d.type = tarfile.AREGTYPE
    f = tarfile.TarInfo("olddir/f.txt")
    f.size = 2
    raw = d.tobuf(tarfile.USTAR_FORMAT) + f.tobuf(tarfile.USTAR_FORMAT) + b"hi" + bytes(510)
    raw += bytes(1024)
    assert read_all(raw) == tarfile_regular(raw) == [("olddir/f.txt", b"hi", 512)]


def test_end_marker_and_missing_end_marker():
    raw = build_tarfile([("file", "a.txt", b"1", "")], tarfile.USTAR_FORMAT)
    # trailing data after the end-of-archive marker is not read as members
    assert read_all(raw + b"garbage" * 100) == [("a.txt", b"1", 0)]
    # an archive that stops on a block boundary without the marker is accepted (as tar does)
    assert read_all(raw[:1024]) == [("a.txt", b"1", 0)]
    # an empty archive (the end-of-archive marker alone) is an archive; a 0-byte stream is not
    assert read_all(bytes(1024)) == read_all(bytes(10240)) == []


# ---------------------------------------------------------------------------------------------
# GNU tar itself
# ---------------------------------------------------------------------------------------------


def make_tree(root, long_names: bool):
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "emptydir").mkdir()
    (root / "a.txt").write_bytes(b"alpha")
    (root / "empty.bin").write_bytes(b"")
    (root / "sub" / "b.json").write_bytes(json.dumps({"x": 1}).encode())
    (root / "sub" / "deeper" / "big.bin").write_bytes(os.urandom(300_000))
    (root / "sub" / "ünï.txt").write_bytes("ünïcödé".encode())
    (root / "link").symlink_to("a.txt")
    os.link(root / "a.txt", root / "hard.txt")
    if long_names:
        d = root / ("L" * 90) / ("M" * 90) / ("N" * 90)
        d.mkdir(parents=True)
        (d / ("f" * 120 + ".dat")).write_bytes(b"long" * 300)
        (root / ("g" * 150 + ".txt")).write_bytes(b"long base name")
    else:
        d = root / ("L" * 90)
        d.mkdir()
        (d / ("f" * 95 + ".dat")).write_bytes(b"prefix split" * 50)


# (the archives hold links, which the reader skips with a warning tested on its own)
@pytest.mark.filterwarnings("ignore:.* links to .* is skipped:tarshards.errors.TarshardsWarning")
@pytest.mark.skipif(not HAVE_TAR, reason="GNU tar is not installed")
@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
def test_gnu_tar_archives(tmp_path, fmt):
    root = tmp_path / "tree"
    root.mkdir()
    make_tree(root, long_names=fmt != "ustar")
    out = tmp_path / "t.tar"
    subprocess.run(
        ["tar", f"--format={fmt}", "-cf", str(out), "-C", str(root), "."],
        check=True,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    raw = out.read_bytes()
    expected = tarfile_regular(raw)
    names = {n for n, _, _ in expected}
    assert "./sub/deeper/big.bin" in names and "./empty.bin" in names
    assert any(len(n) > 100 for n in names)
    for chunk_size in (512, 10_000, 1 << 20):
        assert read_all(raw, chunk_size) == expected
    # and compressed by the real tools
    assert read_all(gzip.compress(raw), 4096) == expected
    if shutil.which("zstd"):
        zst = subprocess.run(
            ["zstd", "-q", "-c"], input=raw, stdout=subprocess.PIPE, check=True
        ).stdout
        assert read_all(zst, 4096) == expected


# ---------------------------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def plain_tar():
    entries = [
        ("file", f"s{i:03d}.{ext}", os.urandom(100 + 37 * i), "")
        for i in range(20)
        for ext in ("jpg", "cls")
    ]
    return build_tarfile(entries, tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("chunk_size", [1, 64, 4096, 1 << 20])
def test_gzip_and_zstd_read_the_same(plain_tar, chunk_size):
    expected = read_all(plain_tar)
    assert len(expected) == 40
    gz = gzip.compress(plain_tar)
    zs = zstandard.ZstdCompressor().compress(plain_tar)
    assert read_all(gz, chunk_size) == expected
    assert read_all(zs, chunk_size) == expected


@pytest.mark.parametrize("cut", [0, 1, 100, 5000, None])
def test_concatenated_gzip_and_zstd_members(plain_tar, cut):
    """``cat a.gz b.gz`` (pigz, multi-member gzip) and multi-frame zstd decode as one stream."""
    cut = len(plain_tar) // 2 if cut is None else cut
    a, b = plain_tar[:cut], plain_tar[cut:]
    gz = gzip.compress(a) + gzip.compress(b)
    zs = zstandard.ZstdCompressor().compress(a) + zstandard.ZstdCompressor().compress(b)
    expected = read_all(plain_tar)
    for data in (gz, zs):
        for chunk_size in (1, 19, 1000, 1 << 20):
            assert read_all(data, chunk_size) == expected
    # the exact chunk boundary at the member boundary
    assert list(iter_tar(decompressed_chunks([gzip.compress(a), gzip.compress(b)]))) == expected


def test_truncated_gzip_raises(plain_tar):
    gz = gzip.compress(plain_tar)
    for cut in (len(gz) // 2, len(gz) - 4):
        with pytest.raises(ShardFormatError) as ei:
            read_all(gz[:cut], 4096, source="cut.tgz")
        assert ei.value.url == "cut.tgz" and "cut.tgz" in str(ei.value)
        assert ei.value.offset is not None and "offset" in str(ei.value)


def test_truncated_zstd_raises(plain_tar):
    zs = zstandard.ZstdCompressor().compress(plain_tar)
    with pytest.raises(ShardFormatError) as ei:
        read_all(zs[: len(zs) // 2], 4096, source="cut.tar.zst")
    assert ei.value.url == "cut.tar.zst"


def test_corrupt_gzip_raises(plain_tar):
    gz = bytearray(gzip.compress(plain_tar))
    gz[len(gz) // 2] ^= 0xFF
    gz[len(gz) // 2 + 1] ^= 0xFF
    with pytest.raises(ShardFormatError, match=r"bad.tgz"):
        read_all(bytes(gz), 4096, source="bad.tgz")


# ---------------------------------------------------------------------------------------------
# pipes and stdin
# ---------------------------------------------------------------------------------------------

CHILD = r"""
import hashlib, json, sys
from tarshards import shard_samples
out = [[s["__key__"], {k: hashlib.sha1(v).hexdigest() for k, v in s.items()
                       if not k.startswith("__")}] for s in shard_samples("-")]
json.dump(out, sys.stdout)
"""


def _digest(samples):
    import hashlib

    return [
        [
            s["__key__"],
            {k: hashlib.sha1(v).hexdigest() for k, v in s.items() if not k.startswith("__")},
        ]
        for s in samples
    ]


@pytest.mark.parametrize("compress", [None, "gzip", "zstd"])
def test_read_from_stdin_pipe(tmp_path, plain_tar, compress):
    path = tmp_path / "s.tar"
    path.write_bytes(plain_tar)
    expected = _digest(shard_samples(str(path)))
    assert len(expected) == 20
    data = plain_tar
    if compress == "gzip":
        data = gzip.compress(plain_tar)
    elif compress == "zstd":
        data = zstandard.ZstdCompressor().compress(plain_tar)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )

    def feed():  # small writes, so the reader sees many short reads from the pipe
        for i in range(0, len(data), 333):
            child.stdin.write(data[i : i + 333])
            child.stdin.flush()
        child.stdin.close()

    t = threading.Thread(target=feed)
    t.start()
    with child.stdout:
        out = child.stdout.read()
    t.join()
    assert child.wait() == 0
    assert json.loads(out) == expected


@pytest.mark.skipif(not HAVE_TAR, reason="GNU tar is not installed")
def test_gnu_tar_piped_into_stdin(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(5):
        (root / f"k{i}.txt").write_text(f"text {i}")
        (root / f"k{i}.cls").write_text(str(i))
    cmd = f"tar -cf - -C {root} --sort=name . | gzip | {sys.executable} -c '{CHILD}'"
    res = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, check=True)
    got = json.loads(res.stdout)
    assert [k for k, _ in got] == [f"k{i}" for i in range(5)]
    assert all(sorted(f) == ["cls", "txt"] for _, f in got)


def test_os_pipe_stream():
    payload = [(f"m{i}.bin", os.urandom(i * 1000)) for i in range(10)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for n, d in payload:
            ti = tarfile.TarInfo(n)
            ti.size = len(d)
            tf.addfile(ti, io.BytesIO(d))
    raw = buf.getvalue()
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "wb") as f:
            f.write(raw)

    t = threading.Thread(target=feed)
    t.start()
    with os.fdopen(r, "rb") as f:
        got = [(n, d) for n, d, _ in open_tar_bytes(f, "pipe", chunk_size=4096)]
    t.join()
    assert got == payload


# ---------------------------------------------------------------------------------------------
# truncated and corrupted shards
# ---------------------------------------------------------------------------------------------


def three_member_tar():
    members = [("a.txt", b"A" * 100), ("b.bin", b"B" * 3000), ("c.txt", b"C" * 10)]
    raw = b"".join(tar_header(n, len(d)) + d + bytes(-len(d) % 512) for n, d in members)
    return raw + bytes(1024), [0, 1024, 1024 + 512 + 3072]


@pytest.mark.parametrize("chunk_size", [100, 1 << 20])
def test_truncated_mid_member(tmp_path, chunk_size):
    raw, offsets = three_member_tar()
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[: offsets[1] + 512 + 1000])  # inside b.bin's data
    got = []
    with pytest.raises(ShardFormatError), open(path, "rb") as f:
        for name, _, _ in open_tar_bytes(f, str(path), chunk_size):
            got.append(name)
    assert got == ["a.txt"]  # members before the cut are read
    with pytest.raises(ShardFormatError) as ei:
        list(shard_samples(str(path), chunk_size=chunk_size))
    e = ei.value
    assert e.url == str(path) and e.member == "b.bin" and e.offset == offsets[1]
    msg = str(e)
    assert str(path) in msg and "b.bin" in msg and f"offset {offsets[1]}" in msg
    assert "truncated" in msg


@pytest.mark.parametrize("chunk_size", [100, 1 << 20])
def test_truncated_mid_header(tmp_path, chunk_size):
    raw, offsets = three_member_tar()
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[: offsets[2] + 200])  # inside c.txt's header
    with pytest.raises(ShardFormatError) as ei:
        list(shard_samples(str(path), chunk_size=chunk_size))
    e = ei.value
    assert e.url == str(path) and e.offset == offsets[2]
    assert str(path) in str(e) and f"offset {offsets[2]}" in str(e)


def test_truncated_after_long_name_header():
    raw = tar_header("x" * 300 + ".bin", 5) + b"12345" + bytes(507) + bytes(1024)
    assert read_all(raw) == [("x" * 300 + ".bin", b"12345", 0)]
    with pytest.raises(ShardFormatError) as ei:
        read_all(raw[:1024], source="s")  # pax header and ustar header, no data
    assert ei.value.offset == 0 and ei.value.member == "x" * 300 + ".bin"
    assert "truncated" in str(ei.value)
    with pytest.raises(ShardFormatError) as ei:
        read_all(raw[:1536], source="s")  # the headers, no data
    assert ei.value.offset == 0 and ei.value.member == "x" * 300 + ".bin"
    with pytest.raises(ShardFormatError) as ei:
        read_all(raw[:512], source="s")  # pax header block only: its payload is missing
    assert ei.value.offset == 0


@settings(max_examples=40, deadline=None)
@given(
    which=st.integers(0, 2),
    pos=st.integers(0, 511).filter(lambda p: not 148 <= p < 156),
    flip=st.integers(1, 255),
    chunk_size=st.sampled_from([64, 512, 1 << 20]),
)
def test_corrupted_header_byte(which, pos, flip, chunk_size):
    raw, offsets = three_member_tar()
    bad = bytearray(raw)
    bad[offsets[which] + pos] ^= flip
    with pytest.raises(ShardFormatError) as ei:
        read_all(bytes(bad), chunk_size, source="bad.tar")
    e = ei.value
    assert e.url == "bad.tar" and e.offset == offsets[which]
    assert "bad.tar" in str(e) and f"offset {offsets[which]}" in str(e)
    assert "checksum" in str(e)


def test_corrupted_checksum_field():
    raw, offsets = three_member_tar()
    for pos, value in ((148, ord("7")), (150, ord("x")), (154, ord("1"))):
        bad = bytearray(raw)
        bad[offsets[1] + pos] = value
        with pytest.raises(ShardFormatError) as ei:
            read_all(bytes(bad), source="bad.tar")
        assert ei.value.offset == offsets[1]
        assert ei.value.member == "b.bin"


@pytest.mark.parametrize(
    "content",
    [
        b"hello, this is not a tar file\n",
        b"<html>" + b"x" * 5000,
        bytes(range(256)) * 10,
    ],
)
def test_not_a_tar_file(tmp_path, content):
    path = tmp_path / "notatar.tar"
    path.write_bytes(content)
    with pytest.raises(ShardFormatError) as ei:
        list(shard_samples(str(path)))
    msg = str(ei.value)
    assert str(path) in msg and "offset 0" in msg
    assert "not a tar" in msg


def test_truncated_tgz_shard(tmp_path):
    raw, _ = three_member_tar()
    gz = gzip.compress(raw)
    path = tmp_path / "cut.tgz"
    path.write_bytes(gz[: len(gz) - 10])
    with pytest.raises(ShardFormatError) as ei:
        list(shard_samples(str(path)))
    assert ei.value.url == str(path) and str(path) in str(ei.value)
    assert "gzip" in str(ei.value) and ei.value.offset is not None


def test_error_pickles_with_context():
    import pickle

    raw, offsets = three_member_tar()
    with pytest.raises(ShardFormatError) as ei:
        read_all(raw[: offsets[1] + 600], source="s.tar")
    e = pickle.loads(pickle.dumps(ei.value))
    assert (e.url, e.member, e.offset) == ("s.tar", "b.bin", offsets[1])
    assert isinstance(e, ValueError)


# ---------------------------------------------------------------------------------------------
# regressions from the fuzz run (issue 10): every path, every read size, the same result
# ---------------------------------------------------------------------------------------------

from tarshards.errors import (  # noqa: E402
    CompressionError,
    HeaderError,
    TarshardsWarning,
    TruncatedShardError,
)
from tarshards.tario import iter_tar_batches  # noqa: E402

SIZES = (1, 7, 512, 513, 4096, 1 << 20)


def _outcome(chunks, accelerate, copy=True):
    got = []
    try:
        for batch in iter_tar_batches(chunks, "mem", accelerate=accelerate, copy=copy):
            got.extend(batch if copy else [(n, bytes(d), o) for n, d, o in batch])
    except ShardFormatError as exc:
        return got, (type(exc), str(exc))
    return got, None


def all_ways(data: bytes, sizes=SIZES):
    """``(members, (error type, message) or None)``, read at every chunk size, with and without
    the C path, from fresh chunks, a reused buffer and a short-read stream: all must agree."""
    first = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TarshardsWarning)
        for size in sizes:
            for accelerate in (True, False):
                sources = [
                    decompressed_chunks(read_chunks(io.BytesIO(data), size, reuse=r), "mem")
                    for r in (False, True)
                ]
                sources.append(tar_byte_source(Trickle(data, size), "mem", size))
                for chunks in sources:
                    out = _outcome(chunks, accelerate)
                    if first is None:
                        first = out
                    assert out == first, (size, accelerate)
        with local_file(data) as f:  # memory-mapped: no chunks at all
            for accelerate in (True, False):
                for copy in (True, False):  # copy=False: views of the map, the same bytes
                    f.seek(0)
                    out = _outcome(tar_byte_source(f, "mem"), accelerate, copy)
                    assert out == first, ("mapped", accelerate, copy)
    return first


def _fix_checksum(hdr: bytearray) -> bytearray:
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    return hdr


def _member(name: str, data: bytes, fmt=tarfile.USTAR_FORMAT, **attrs) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    for k, v in attrs.items():
        setattr(ti, k, v)
    return ti.tobuf(fmt) + data + bytes(-len(data) % 512)


def _declaring(size_field: bytes) -> bytes:
    """A 10 KB archive whose second member declares the given size field."""
    hdr = bytearray(tarfile.TarInfo("huge.bin").tobuf(tarfile.GNU_FORMAT))
    hdr[124:136] = size_field
    return _member("a.txt", b"first") + bytes(_fix_checksum(hdr)) + os.urandom(7500)


def _pax_declaring(size: int) -> bytes:
    pax = tarfile.TarInfo._create_pax_generic_header({"size": str(size)}, tarfile.XHDTYPE, "utf-8")
    return (
        _member("a.txt", b"first")
        + pax
        + tarfile.TarInfo("huge.bin").tobuf(tarfile.USTAR_FORMAT)
        + os.urandom(7500)
    )


HUGE = {
    "octal 77777777777": _declaring(b"77777777777\0"),
    "base-256 1 TB": _declaring(b"\x80" + (1 << 40).to_bytes(11, "big")),
    "base-256 2**87": _declaring(b"\x80" + ((1 << 87) - 1).to_bytes(11, "big")),
    "pax size=1 TB": _pax_declaring(1 << 40),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_huge_declared_size_raises_without_allocating(case):
    import tracemalloc

    data = HUGE[case]
    assert len(data) <= 10_240
    tracemalloc.start()
    try:
        for accelerate in (True, False):
            for chunks in (
                tar_byte_source(io.BytesIO(data), "huge.tar"),
                decompressed_chunks(read_chunks(io.BytesIO(data)), "huge.tar"),
            ):
                got = []
                with pytest.raises(TruncatedShardError) as ei:
                    for batch in iter_tar_batches(chunks, "huge.tar", accelerate=accelerate):
                        got.extend(batch)
                assert [n for n, _, _ in got] == ["a.txt"]
                assert ei.value.member == "huge.bin" and ei.value.offset == 1024, ei.value
                assert isinstance(ei.value, ShardFormatError)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, f"{peak} bytes allocated reading a {len(data)}-byte file"
    assert all_ways(data, (100, 4096))[1][0] is TruncatedShardError


def test_huge_declared_size_rss(tmp_path):
    """The same through the pipeline from a file, measured as the process's RSS growth."""
    resource = pytest.importorskip("resource")
    path = tmp_path / "huge.tar"
    path.write_bytes(HUGE["base-256 1 TB"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TruncatedShardError) as ei:
        list(shard_samples(str(path)))
    growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert growth_kb < 10 * 1024
    assert ei.value.url == str(path) and str(path) in str(ei.value)


def test_huge_size_of_skipped_and_extended_members():
    hdr = bytearray(tarfile.TarInfo("dev").tobuf(tarfile.GNU_FORMAT))
    hdr[156] = ord("V")  # a type we skip, declaring 8 GB of data
    hdr[124:136] = b"77777777777\0"
    data = bytes(_fix_checksum(hdr)) + bytes(5000)
    got, err = all_ways(data, (512, 1 << 20))
    assert got == [] and err[0] is TruncatedShardError and "skipped" in err[1]
    hdr[156] = ord("L")
    data = bytes(_fix_checksum(hdr)) + bytes(5000)
    got, err = all_ways(data, (512, 1 << 20))
    assert err[0] is HeaderError and "implausibly large" in err[1]


@pytest.mark.parametrize(
    "field", [b"0000001_000\0", b"+0000001000\0", b"0o000001000\0", b"-1\0" + bytes(9)]
)
def test_size_field_that_int_takes_but_is_not_octal(field):
    """A size field is octal digits between spaces and NULs: '1_000', '+1000', '0o1000' and '-1'
    (which Python's int(x, 8), and so tarfile, takes) are rejected, as GNU tar rejects them,
    on every read path."""
    hdr = bytearray(tarfile.TarInfo("a.txt").tobuf(tarfile.USTAR_FORMAT))
    hdr[124:136] = field
    data = bytes(_fix_checksum(hdr)) + b"x" * 512 + bytes(1024)
    got, err = all_ways(data, (512, 1 << 20))
    assert got == [] and err[0] is HeaderError and "bad size field" in err[1]
    # the same digits without the extra characters read as the member they describe
    hdr[124:136] = b"%011o\0" % 512
    got, err = all_ways(bytes(_fix_checksum(hdr)) + b"x" * 512 + bytes(1024))
    assert err is None and got == [("a.txt", b"x" * 512, 0)]


def test_checksum_field_that_int_takes_but_is_not_octal():
    """A checksum written '0o12345' (the right value, with Python's prefix) is not a checksum."""
    hdr = bytearray(tarfile.TarInfo("a.txt").tobuf(tarfile.USTAR_FORMAT))
    hdr[124:136] = b"%011o\0" % 1
    good = bytes(_fix_checksum(hdr))
    assert all_ways(good + b"1" + bytes(511) + bytes(1024))[1] is None
    field = b"0o%o" % int(good[148:154], 8)
    assert len(field) <= 8
    hdr = bytearray(good)
    hdr[148:156] = field.ljust(8, b"\0")
    got, err = all_ways(bytes(hdr) + b"1" + bytes(511) + bytes(1024))
    assert got == [] and err[0] is HeaderError and "checksum" in err[1]


def test_cut_after_the_last_members_data_is_the_same_at_every_size():
    raw = _member("a.txt", b"A" * 700) + _member("b.txt", b"B" * 100) + bytes(1024)
    data_end = 1536 + 512 + 100
    for cut in (data_end, data_end + 1, data_end + 200, data_end + 411):
        got, err = all_ways(raw[:cut])
        # every member whose data is there is handed out, then the cut is reported
        assert [(n, d) for n, d, _ in got] == [("a.txt", b"A" * 700), ("b.txt", b"B" * 100)]
        assert err is not None and err[0] is TruncatedShardError
        assert "zero padding" in err[1] and "'b.txt'" in err[1]
    # cut on the block boundary after the padding: a clean end without the marker
    assert all_ways(raw[: data_end + 412])[1] is None
    # cut inside the data: the member is not handed out
    got, err = all_ways(raw[: data_end - 1])
    assert [n for n, _, _ in got] == ["a.txt"] and err[0] is TruncatedShardError


def test_lone_zero_block_warns_and_reads_on():
    a, b = _member("a.txt", b"1"), _member("b.txt", b"2")
    raw = a + bytes(512) + b + bytes(1024)
    with pytest.warns(TarshardsWarning, match="lone zero block at offset 1024"):
        got = list(iter_tar([raw], "z.tar"))
    assert [(n, d, o) for n, d, o in got] == [("a.txt", b"1", 0), ("b.txt", b"2", 1536)]
    assert all_ways(raw) == (got, None)
    # a zero block, then a header that is not one: the checksum decides, loudly
    got, err = all_ways(a + bytes(512) + b"x" * 512 + bytes(1024))
    assert [n for n, _, _ in got] == ["a.txt"] and err[0] is HeaderError
    # a zero block, then less than a block of non-zero bytes
    got, err = all_ways(a + bytes(512) + b"xyz")
    assert err[0] is TruncatedShardError
    # two zero blocks end the archive whatever follows; so does one zero block and the end
    assert all_ways(a + bytes(1024) + b + bytes(1024)) == ([("a.txt", b"1", 0)], None)
    assert all_ways(a + bytes(512)) == ([("a.txt", b"1", 0)], None)
    assert all_ways(a + bytes(700)) == ([("a.txt", b"1", 0)], None)


def _high_byte_header(name: str, size: int, extra: int) -> bytearray:
    """A GNU header (no prefix field) whose unused fields are 0xFF: a byte sum above 65521."""
    hdr = bytearray(tarfile.TarInfo(name).tobuf(tarfile.GNU_FORMAT))
    hdr[124:136] = b"%011o\0" % size
    hdr[157:257] = b"\xff" * 100  # linkname
    hdr[265:329] = b"\xff" * 64  # uname, gname
    hdr[345 : 345 + extra] = b"\xff" * extra  # GNU atime/ctime area
    return _fix_checksum(hdr)


@pytest.mark.parametrize("kind", ["plain", "high-sum"])
@pytest.mark.parametrize("delta", [65521, -65521, 2 * 65521])
def test_checksum_off_by_65521_rejected_by_every_path(kind, delta):
    if kind == "plain":
        hdr = bytearray(tarfile.TarInfo("b.bin").tobuf(tarfile.USTAR_FORMAT))
        hdr[124:136] = b"%011o\0" % 600
        hdr = _fix_checksum(hdr)
    else:
        hdr = _high_byte_header("b.bin", 600, 120)
    good = int(hdr[148:154], 8)
    assert (good >= 65521) == (kind == "high-sum")
    if not 0 <= good + delta < 8**6:
        pytest.skip("not representable")
    raw = _member("a.txt", b"1") + bytes(hdr) + b"x" * 600 + bytes(424) + bytes(1024)
    got, err = all_ways(raw)
    assert err is None and [n for n, _, _ in got] == ["a.txt", "b.bin"]  # the good one reads
    bad = bytearray(hdr)
    bad[148:156] = b"%06o\0 " % (good + delta)
    raw = _member("a.txt", b"1") + bytes(bad) + b"x" * 600 + bytes(424) + bytes(1024)
    got, err = all_ways(raw)
    assert [n for n, _, _ in got] == ["a.txt"]
    assert err[0] is HeaderError and "checksum" in err[1] and "offset 1024" in err[1]


def test_signed_checksum_accepted_by_every_path():
    """Old writers summed signed chars; tarfile accepts that sum, and so do all our paths."""
    name = "ü" * 20 + ".txt"
    hdr = bytearray(tarfile.TarInfo(name).tobuf(tarfile.USTAR_FORMAT))
    hdr[124:136] = b"%011o\0" % 3
    hdr[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in hdr)
    hdr[148:156] = b"%06o\0 " % signed
    raw = bytes(hdr) + b"abc" + bytes(509) + bytes(1024)
    assert all_ways(raw) == ([(name, b"abc", 0)], None)
    assert tarfile_regular(raw) == [(name, b"abc", 0)]


def test_member_after_gnu_long_link_reports_its_offset():
    entries = [
        ("symlink", "s.lnk", b"", "t" * 150),
        ("file", "a.txt", b"1" * 10, ""),
        ("file", "big.bin", os.urandom(70_000), ""),
        ("link", "h.lnk", b"", "h" * 130),
        ("file", "z.txt", b"zz", ""),
    ]
    raw = build_tarfile(entries, tarfile.GNU_FORMAT)
    assert b"././@LongLink" in raw
    expected = tarfile_regular(raw)
    assert all_ways(raw, (512, 4096, 1 << 20)) == (expected, None)
    # a K header directly before a regular member: the member starts at the K header
    k = raw.index(b"././@LongLink", raw.index(b"big.bin"))
    link = k + 1024  # K header, its payload, then the hard link's header
    patched = bytearray(raw)
    patched[link + 156] = ord("0")
    patched[link : link + 512] = _fix_checksum(patched[link : link + 512])
    expected = tarfile_regular(bytes(patched))
    assert ("h.lnk", b"", k) in expected
    assert all_ways(bytes(patched), (512, 4096, 1 << 20)) == (expected, None)


def _sparse_file(
    path,
    size=3_000_000,
    chunks=(
        (0, 5000),
        (200_000, 40),
        (1_000_000, 8192),
        (1_500_000, 3),
        (2_000_000, 20_000),
        (2_500_000, 1000),
    ),
):
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, n in chunks:
            f.seek(offset)
            f.write(os.urandom(n))
    return path.read_bytes()


@pytest.mark.skipif(not HAVE_TAR, reason="GNU tar is not installed")
@pytest.mark.parametrize(
    "fmt, version, marker",
    [
        ("gnu", None, None),
        ("posix", "0.0", b"GNU.sparse.offset="),
        ("posix", "0.1", b"GNU.sparse.map="),
        ("posix", "1.0", b"GNU.sparse.major=1"),
    ],
)
@pytest.mark.parametrize("tail_hole", [False, True])
def test_gnu_tar_sparse_members_are_rebuilt(tmp_path, fmt, version, marker, tail_hole):
    root = tmp_path / "d"
    root.mkdir()
    content = _sparse_file(root / "sparse.bin", size=3_000_000 if tail_hole else 2_501_000)
    (root / "plain.txt").write_bytes(b"plain")
    out = tmp_path / "s.tar"
    cmd = [
        "tar",
        f"--format={fmt}",
        "--sparse",
        "--hole-detection=raw",
        "-cf",
        str(out),
        "-C",
        str(root),
        "sparse.bin",
        "plain.txt",
    ]
    if version:
        cmd.insert(3, f"--sparse-version={version}")
    subprocess.run(cmd, check=True)
    raw = out.read_bytes()
    if marker:
        assert marker in raw
    else:
        assert raw[156:157] == b"S" and raw[482] == 1  # old GNU sparse, with extension blocks
    assert len(raw) < len(content) // 4  # really stored sparse
    expected = tarfile_regular(raw)
    assert [(n, d) for n, d, _ in expected] == [("sparse.bin", content), ("plain.txt", b"plain")]
    assert all_ways(raw, (512, 10_000, 1 << 20)) == (expected, None)
    assert read_all(gzip.compress(raw), 4096) == expected


def test_unsupported_or_inconsistent_sparse_raises():
    def pax_member(records, data):
        pax = tarfile.TarInfo._create_pax_generic_header(records, tarfile.XHDTYPE, "utf-8")
        return pax + _member("GNUSparseFile.0/f", data) + bytes(1024)

    got, err = all_ways(
        pax_member(
            {
                "GNU.sparse.major": "2",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": "f",
                "GNU.sparse.realsize": "10",
            },
            b"x",
        )
    )
    assert got == [] and err[0] is HeaderError and "unsupported GNU sparse format 2.0" in err[1]
    got, err = all_ways(
        pax_member(
            {"GNU.sparse.map": "0,5,3,5", "GNU.sparse.size": "20", "GNU.sparse.name": "f"},
            b"x" * 10,
        )
    )
    assert err[0] is HeaderError and "inconsistent GNU sparse map" in err[1]
    got, err = all_ways(
        pax_member(
            {"GNU.sparse.map": "0,5", "GNU.sparse.size": str(1 << 40), "GNU.sparse.name": "f"},
            b"x" * 5,
        )
    )
    assert err[0] is HeaderError and "sparse member of" in err[1]
    got, err = all_ways(
        pax_member(
            {"GNU.sparse.map": "0,5,10,3", "GNU.sparse.size": "20", "GNU.sparse.name": "f"},
            b"abcdeXYZ",
        )
    )
    assert got == [("f", b"abcde" + bytes(5) + b"XYZ" + bytes(7), 0)] and err is None


def test_zero_byte_shard_raises(tmp_path):
    path = tmp_path / "empty.tar"
    path.write_bytes(b"")
    with pytest.raises(TruncatedShardError) as ei:
        list(shard_samples(str(path)))
    assert ei.value.url == str(path) and str(path) in str(ei.value) and "empty" in str(ei.value)
    for data in (b"", gzip.compress(b""), zstandard.ZstdCompressor().compress(b"")):
        got, err = all_ways(data)
        assert got == [] and err[0] is TruncatedShardError and "0 bytes" in err[1]
    with pytest.raises(tarfile.ReadError):  # the reference agrees
        tarfile.open(fileobj=io.BytesIO(b""))


@pytest.mark.parametrize("where", [-8, -6, -5, -4, -1])  # CRC32 bytes, then ISIZE bytes
def test_gzip_trailer_bit_flip_keeps_the_valid_prefix(plain_tar, where):
    gz = bytearray(gzip.compress(plain_tar))
    gz[where] ^= 0x10
    expected = read_all(plain_tar)
    got, err = all_ways(bytes(gz), (1, 64, 4096, 1 << 20))
    assert got == expected  # every member decompressed before the trailer
    assert err[0] is CompressionError and "gzip" in err[1]
    offset = int(err[1].rsplit("offset ", 1)[1].rstrip(")"))
    assert len(gz) - 8 <= offset < len(gz)


def test_gzip_corruption_midway_keeps_what_came_before(plain_tar):
    """A damaged second gzip member: everything the first one held is handed out."""
    cut = len(plain_tar) // 2
    first = gzip.compress(plain_tar[:cut])
    second = bytearray(gzip.compress(plain_tar[cut:]))
    second[0] ^= 0xFF  # no gzip magic where the next member should start
    expected = read_all(plain_tar)
    got, err = all_ways(first + bytes(second), (64, 4096, 1 << 20))
    assert err[0] is CompressionError
    assert got == [m for m in expected if m[2] + 512 + len(m[1]) <= cut]
    offset = int(err[1].rsplit("offset ", 1)[1].rstrip(")"))
    assert len(first) <= offset <= len(first) + 2  # the byte at which the damage shows


def test_pax_global_header_applies_without_an_x_header():
    def g(records):
        return tarfile.TarInfo._create_pax_generic_header(records, tarfile.XGLTYPE, "utf-8")

    # a global size: the header's size field says 0, the data is 5 bytes (tarfile agrees)
    raw = (
        g({"size": "5"})
        + tarfile.TarInfo("five.bin").tobuf(tarfile.USTAR_FORMAT)
        + b"12345"
        + bytes(507)
        + bytes(1024)
    )
    assert all_ways(raw) == (tarfile_regular(raw), None)
    assert [(n, d) for n, d, _ in tarfile_regular(raw)] == [("five.bin", b"12345")]
    # a global path names every member after it (tarfile agrees)
    raw = g({"path": "same.txt"}) + _member("a.txt", b"a") + _member("b.txt", b"b") + bytes(1024)
    assert all_ways(raw) == (tarfile_regular(raw), None)
    assert [n for n, _, _ in all_ways(raw)[0]] == ["same.txt", "same.txt"]
    # the global header alone is no member, and offsets after it are the members' own
    raw = g({"comment": "x"}) + _member("a.txt", b"a") + bytes(1024)
    assert all_ways(raw) == ([("a.txt", b"a", 1024)], None) == (tarfile_regular(raw), None)


def test_empty_pax_path_deletes_the_keyword():
    """POSIX: a record with an empty value removes the keyword; the header's name applies."""
    x = tarfile.TarInfo._create_pax_generic_header({"path": ""}, tarfile.XHDTYPE, "utf-8")
    raw = x + _member("named.txt", b"n") + bytes(1024)
    assert all_ways(raw) == ([("named.txt", b"n", 0)], None)
    gl = tarfile.TarInfo._create_pax_generic_header({"path": "g.txt"}, tarfile.XGLTYPE, "utf-8")
    raw = gl + x + _member("named.txt", b"n") + _member("other.txt", b"o") + bytes(1024)
    assert all_ways(raw)[0] == [("named.txt", b"n", 1024), ("g.txt", b"o", 3072)]


@pytest.mark.parametrize("kind", ["L", "K", "x"])
def test_extended_header_before_the_end_marker_raises(kind):
    if kind == "x":
        ext = tarfile.TarInfo._create_pax_generic_header(
            {"path": "lost.txt"}, tarfile.XHDTYPE, "utf-8"
        )
    else:
        ext = tarfile.TarInfo._create_gnu_long_header("lost" * 40, kind.encode(), "utf-8", "strict")
    raw = _member("a.txt", b"a") + ext + bytes(1024)
    got, err = all_ways(raw)
    assert [n for n, _, _ in got] == ["a.txt"]
    assert err[0] is HeaderError and "end-of-archive" in err[1] and "offset 1024" in err[1]
    with pytest.raises(tarfile.ReadError):  # the reference refuses it too
        tarfile_regular(raw)


def test_name_precedence_across_extended_header_chains():
    """The outermost header that names the member wins (tarfile applies the chain inside out);
    a pax header without path= does not take the name from a long name after it (fuzz 6534)."""

    def x(records):
        return tarfile.TarInfo._create_pax_generic_header(records, tarfile.XHDTYPE, "utf-8")

    def long(name):
        return tarfile.TarInfo._create_gnu_long_header(
            name, tarfile.GNUTYPE_LONGNAME, "utf-8", "strict"
        )

    body = _member("short.txt", b"data")
    for chain in (
        [x({"comment": "c"}), long("L" * 120), x({"path": "P" * 110})],
        [x({"path": "P" * 110}), long("L" * 120)],
        [long("L" * 120), x({"path": "P" * 110})],
        [long("L" * 120), long("M" * 120)],
    ):
        raw = b"".join(chain) + body + bytes(1024)
        assert all_ways(raw, (512, 1 << 20)) == (tarfile_regular(raw), None)


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_decompression_steps_are_bounded(kind):
    """A small stream that expands a thousandfold comes out in bounded pieces (no bomb)."""
    import tracemalloc

    zeros = bytes(1 << 20)
    if kind == "gzip":
        data = gzip.compress(zeros * 64, compresslevel=1)
    else:
        out = io.BytesIO()
        with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as z:
            for _ in range(64):
                z.write(zeros)
        data = out.getvalue()
    assert len(data) < 1 << 20
    tracemalloc.start()
    try:
        sizes = [len(c) for c in decompressed_chunks([data])]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(sizes) == 64 << 20 and max(sizes) <= 4 << 20
    assert peak < 24 << 20


class _Hoarder:
    """A stream that keeps every buffer it reads into, as a frame kept alive by a logged
    exception's traceback keeps its arguments (seen with S3 retries under log capture)."""

    def __init__(self, data: bytes, step: int):
        self.data, self.pos, self.step, self.kept = data, 0, step, []

    def readinto(self, view) -> int:
        self.kept.append(view)
        n = min(len(view), len(self.data) - self.pos, self.step)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_buffer_grows_while_a_stream_holds_its_views():
    members = [("a.bin", bytes(range(256)) * 20), ("b.bin", b"x" * 3_000_000), ("c.txt", b"c")]
    raw = b"".join(tar_header(n, len(d)) + d + bytes(-len(d) % 512) for n, d in members)
    raw += bytes(1024)
    stream = _Hoarder(raw, 100_000)
    got = [(n, d) for n, d, _ in iter_tar(stream, "hoard")]
    assert got == members and len(stream.kept) > 3


def _linked(kind: str, name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if kind == "hard" else tarfile.SYMTYPE
    info.linkname = target
    return info


@pytest.mark.parametrize("kind", ["hard", "symbolic"])
def test_a_link_that_a_sample_misses_is_named_once_a_shard(tmp_path, kind):
    """Links are skipped (only regular files are read, as in tarfile and webdataset); where the
    link's name is a sample's field, that sample lacks it, and a warning names the member, its
    target and what to do, once a shard. A link that is no sample's field is not mentioned."""
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for key in ("k1", "k2"):
            for ext in ("jpg", "cls"):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = 3
                tf.addfile(info, io.BytesIO(b"abc"))
        tf.addfile(_linked(kind, "latest", "k2.jpg"))  # no KEY.EXT: nothing is lost
        tf.addfile(_linked(kind, "k3.jpg", "k1.jpg"))
        tf.addfile(_linked(kind, "k4.jpg", "k2.jpg"))
        info = tarfile.TarInfo("k3.cls")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"3"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = list(shard_samples(str(path)))
    assert [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples] == [
        ("k1", ["cls", "jpg"]),
        ("k2", ["cls", "jpg"]),
        ("k3", ["cls"]),
    ]
    said = [str(w.message) for w in caught if "links to" in str(w.message)]
    assert len(said) == 1, said
    assert "'k3.jpg'" in said[0] and "'k1.jpg'" in said[0] and str(path) in said[0]
    assert ("--hard-dereference" if kind == "hard" else "--dereference") in said[0]


@pytest.mark.skipif(not HAVE_TAR, reason="GNU tar is not installed")
def test_gnu_tar_hard_link_in_a_data_set_is_named(tmp_path):
    """GNU tar stores a file with two names once: the second name is a hard link (the data set
    then misses a field, as with tarfile and webdataset); the warning says so."""
    root = tmp_path / "tree"
    root.mkdir()
    (root / "a1.jpg").write_bytes(b"jpeg bytes")
    (root / "a1.cls").write_bytes(b"1")
    os.link(root / "a1.jpg", root / "a2.jpg")
    (root / "a2.cls").write_bytes(b"2")
    out = tmp_path / "t.tar"
    subprocess.run(["tar", "--sort=name", "-cf", str(out), "-C", str(root), "."], check=True)
    with pytest.warns(TarshardsWarning, match=r"'\./a2\.jpg'.* links to '\./a1\.jpg'"):
        samples = list(shard_samples(str(out)))
    assert [sorted(k for k in s if not k.startswith("__")) for s in samples] == [
        ["cls", "jpg"],
        ["cls"],
    ]


@pytest.mark.parametrize(
    "own, after, name",
    [
        ({"mtime": "1.5"}, None, "global/name.txt"),  # the member's pax header sets no path
        ({"path": "own/name.txt"}, None, "own/name.txt"),  # its own path wins over the global
        ({"size": ""}, None, "global/name.txt"),  # an empty value deletes only that key
        # a second pax header of the member's after the global one: its path wins (seed 1111)
        ({"mtime": "2.5"}, {"path": "later/name.txt"}, "later/name.txt"),
    ],
)
def test_global_pax_header_between_a_members_pax_header_and_the_member(own, after, name):
    """A pax global header ('g') that comes after a member's pax header ('x') and before the
    member applies to that member too, under the member's own keys: GNU tar lists the member
    under the global path= (checked with tar -tf on such an archive; the fuzzer's seeds 1357
    and 1111 found it)."""

    def pax(records, kind):
        return tarfile.TarInfo._create_pax_generic_header(records, kind, "utf-8")

    raw = (
        _member("a.txt", b"first")
        + pax(own, tarfile.XHDTYPE)
        + pax({"path": "global/name.txt"}, tarfile.XGLTYPE)
        + (pax(after, tarfile.XHDTYPE) if after else b"")
        + _member("b.txt", b"second")
        + bytes(1024)
    )
    got, err = all_ways(raw)
    assert err is None
    assert [(n, d) for n, d, _ in got] == [("a.txt", b"first"), (name, b"second")]
    if HAVE_TAR and own != {"size": ""}:  # GNU tar: "invalid size=" for the empty size
        listed = subprocess.run(
            ["tar", "-tf", "-"], input=raw, capture_output=True, check=True
        ).stdout.split()
        assert listed == [b"a.txt", name.encode()]


def test_gnu_long_name_runs_on_past_its_declared_size():
    """A GNU long name is read to its NUL within its blocks, past the size its header declares
    (GNU tar and tarfile read it so; the fuzzer's seed 4444 found that we stopped at the size)."""
    long = tarfile.TarInfo("././@LongLink")
    long.type = tarfile.GNUTYPE_LONGNAME
    long.size = 5  # "abcde" declared; the block holds "abcdefgh.txt"
    raw = (
        long.tobuf(tarfile.GNU_FORMAT)
        + b"abcdefgh.txt".ljust(512, b"\0")
        + _member("short.txt", b"xyz", tarfile.GNU_FORMAT)
        + bytes(1024)
    )
    got, err = all_ways(raw)
    assert err is None and [(n, d) for n, d, _ in got] == [("abcdefgh.txt", b"xyz")]
    assert tarfile_regular(raw) == got
    if HAVE_TAR:
        listed = subprocess.run(["tar", "-tf", "-"], input=raw, capture_output=True, check=True)
        assert listed.stdout.split() == [b"abcdefgh.txt"]
