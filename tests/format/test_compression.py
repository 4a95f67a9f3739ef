"""compression.py: every compression GNU tar and the usual tools write reads as the plain tar
does (bzip2, xz, lz4, pzstd's skippable frames, zstd --long windows), by every read path; the
formats tarshards does not read are named in the error; damage names the shard and an offset."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import shutil
import subprocess
import tarfile
import zipfile

import pytest
import zstandard

from tarshards import ShardWriter, TarWriter
from tarshards.errors import CompressionError, ShardFormatError, TruncatedShardError
from tarshards.format.compression import (
    BZIP2,
    LZ4,
    XZ,
    ZSTD,
    by_magic,
    by_name,
    decompressed_chunks,
)
from tarshards.format.manifest import build_manifest
from tarshards.pipeline.dataset import iter_samples, shard_samples
from tarshards.tario import iter_tar, read_chunks, tar_byte_source

HAVE_LZ4 = __import__("importlib").util.find_spec("lz4") is not None
needs_lz4 = pytest.mark.skipif(not HAVE_LZ4, reason="needs the lz4 package")


def _plain_tar(n: int = 30) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(n):
            for ext, data in (("bin", os.urandom(50 + 97 * i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"d/s{i:03d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


PLAIN = _plain_tar()


def _compress(kind: str, data: bytes) -> bytes:
    if kind == "bz2":
        return bz2.compress(data)
    if kind == "xz":
        return lzma.compress(data, format=lzma.FORMAT_XZ)
    if kind == "lz4":
        import lz4.frame

        return lz4.frame.compress(data)
    if kind == "gz":
        return gzip.compress(data)
    return zstandard.ZstdCompressor().compress(data)


KINDS = ["bz2", "xz", pytest.param("lz4", marks=needs_lz4)]


def _members(chunks, source="mem"):
    return [(name, bytes(data)) for name, data, _ in iter_tar(chunks, source)]


def _all_ways(data: bytes, tmp_path, chunk_size: int, name: str = "s.tar.x"):
    """The members read from chunks, from a stream and from a local file (the map path)."""
    path = tmp_path / name
    path.write_bytes(data)
    ways = [
        _members(decompressed_chunks(read_chunks(io.BytesIO(data), chunk_size, reuse=True))),
        _members(tar_byte_source(io.BytesIO(data), "mem", chunk_size)),
    ]
    with open(path, "rb") as f:
        ways.append(_members(tar_byte_source(f, str(path), chunk_size)))
    return ways


EXPECTED = _members([PLAIN])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [1, 100, 4096, 1 << 20])
def test_bzip2_xz_lz4_read_as_the_plain_tar(kind, chunk_size, tmp_path):
    data = _compress(kind, PLAIN)
    assert len(EXPECTED) == 60
    for got in _all_ways(data, tmp_path, chunk_size):
        assert got == EXPECTED


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cut", [0, 1, 513, None])
def test_streams_back_to_back_read_as_one(kind, cut, tmp_path):
    """pbzip2 / lbzip2 / xz -T write several streams back to back (and xz pads between them)."""
    cut = len(PLAIN) // 2 if cut is None else cut
    a, b = _compress(kind, PLAIN[:cut]), _compress(kind, PLAIN[cut:])
    padding = bytes(8) if kind == "xz" else b""  # xz's stream padding: zeros, 4-byte multiples
    for chunk_size in (7, 4096):
        for got in _all_ways(a + padding + b, tmp_path, chunk_size):
            assert got == EXPECTED


def test_pzstd_skippable_frames_read(tmp_path):
    """pzstd puts a skippable frame before every frame; a file may even start with one."""
    z = zstandard.ZstdCompressor()
    half = len(PLAIN) // 2

    def skip(payload: bytes) -> bytes:
        magic = (0x184D2A50 + 3).to_bytes(4, "little")
        return magic + len(payload).to_bytes(4, "little") + payload

    data = (
        skip(b"\x01\x02\x03\x04") + z.compress(PLAIN[:half]) + skip(b"") + z.compress(PLAIN[half:])
    )
    assert by_magic(data) is ZSTD
    for chunk_size in (3, 4096):
        for got in _all_ways(data, tmp_path, chunk_size):
            assert got == EXPECTED


@pytest.mark.skipif(shutil.which("pzstd") is None, reason="needs pzstd")
def test_a_shard_written_by_pzstd(tmp_path):
    plain = tmp_path / "a.tar"
    plain.write_bytes(PLAIN)
    out = tmp_path / "a.tar.zst"
    subprocess.run(["pzstd", "-q", "-p", "2", str(plain), "-o", str(out)], check=True)
    assert out.read_bytes()[:4] != b"\x28\xb5\x2f\xfd"  # it starts with a skippable frame
    assert [s["__key__"] for s in shard_samples(str(out))] == [
        s["__key__"] for s in shard_samples(str(plain))
    ]


def test_zstd_long_window_frames_read(tmp_path):
    """zstd --long=28..31 (and streaming writers with a large window_log) declare windows over
    zstandard's default limit of 128 MiB."""
    params = zstandard.ZstdCompressionParameters(window_log=28)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as w:
        w.write(PLAIN)
    data = out.getvalue()
    assert zstandard.get_frame_parameters(data).window_size == 1 << 28
    with pytest.raises(zstandard.ZstdError):  # what the default limit says
        zstandard.ZstdDecompressor().decompressobj().decompress(data)
    for got in _all_ways(data, tmp_path, 4096):
        assert got == EXPECTED


GNU_TAR_FLAGS = [
    ("-j", "bzip2", "tar.bz2"),
    ("-J", "xz", "tar.xz"),
    ("--zstd", "zstd", "tar.zst"),
    pytest.param("--use-compress-program=lz4", "lz4", "tar.lz4", marks=needs_lz4),
]


@pytest.mark.parametrize("flag,tool,suffix", GNU_TAR_FLAGS)
def test_gnu_tar_compressed_shards(flag, tool, suffix, tmp_path):
    if shutil.which("tar") is None or shutil.which(tool) is None:
        pytest.skip(f"needs GNU tar and {tool}")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"k{i:02d}.txt").write_text(f"text {i}" * (i + 1))
        (src / f"k{i:02d}.cls").write_text(str(i))
    shard = tmp_path / f"shard.{suffix}"
    files = sorted(os.listdir(src))
    subprocess.run(["tar", flag, "-cf", str(shard), "-C", str(src), *files], check=True)
    got = [(s["__key__"], s["txt"], s["cls"]) for s in shard_samples(str(shard))]
    assert got == [
        (f"k{i:02d}", f"text {i}".encode() * (i + 1), str(i).encode()) for i in range(12)
    ]
    m = build_manifest([str(shard)], str(tmp_path / "m.json"), workers=1)
    assert m.shards[0].samples == 12
    assert m.load_index(0).compression == by_name(suffix).name


@pytest.mark.parametrize(
    "suffix,comp",
    [(".tar.bz2", BZIP2), (".tar.xz", XZ), pytest.param(".tar.lz4", LZ4, marks=needs_lz4)],
)
@pytest.mark.parametrize("aligned", [False, True])
def test_writers_write_bzip2_xz_lz4(suffix, comp, aligned, tmp_path):
    samples = [{"__key__": f"k{i:03d}", "txt": f"sample {i}" * i, "cls": i} for i in range(20)]
    with ShardWriter(
        str(tmp_path / f"out-%02d{suffix}"),
        maxcount=8,
        manifest=str(tmp_path / "m.json"),
        aligned=aligned,
    ) as w:
        for s in samples:
            w.write(s)
    urls = [info.url for info in w.shards]
    assert len(urls) == 3
    for url in urls:
        with open(url, "rb") as f:
            assert by_magic(f.read(8)) is comp
    got = [(s["__key__"], s["txt"], s["cls"]) for s in iter_samples(urls)]
    assert got == [(s["__key__"], s["txt"].encode(), str(s["cls"]).encode()) for s in samples]
    idx = w.manifest.load_index(0)
    # aligned: lz4 frames; bzip2 and xz one stream (Python's tarfile reads only the first)
    assert idx.compression == comp.name and idx.seekable == (aligned and comp is LZ4)
    if shutil.which("tar") is not None and shutil.which(comp.name) is not None:
        listed = subprocess.run(
            ["tar", "-I", comp.name, "-tf", urls[0]], capture_output=True, check=True
        )
        assert listed.stdout.decode().split() == [
            f"k{i:03d}.{ext}" for i in range(8) for ext in ("cls", "txt")
        ]
    with TarWriter(str(tmp_path / f"one{suffix}"), compress=None) as tw:  # by suffix too
        tw.write(samples[0])
    assert [s["__key__"] for s in shard_samples(str(tmp_path / f"one{suffix}"))] == ["k000"]


@pytest.mark.parametrize("kind", ["bz2", "xz"])
def test_truncated_and_corrupt_streams_name_the_shard(kind, tmp_path):
    data = _compress(kind, PLAIN)
    path = tmp_path / f"cut.tar.{kind}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedShardError) as ei:
        list(shard_samples(str(path)))
    assert ei.value.url == str(path) and ei.value.offset is not None
    bad = bytearray(data)
    for i in range(40, 60):
        bad[len(bad) // 2 + i] ^= 0x5A
    path = tmp_path / f"bad.tar.{kind}"
    path.write_bytes(bytes(bad))
    with pytest.raises(ShardFormatError) as ei:
        list(shard_samples(str(path)))
    assert ei.value.url == str(path) and "offset" in str(ei.value)
    assert isinstance(ei.value, (CompressionError, TruncatedShardError))


@pytest.mark.parametrize("kind", ["bz2", "xz"])
def test_bzip2_and_xz_steps_are_bounded(kind):
    """A small stream that expands a thousandfold comes out in bounded pieces (no bomb)."""
    data = _compress(kind, bytes(64 << 20))
    assert len(data) < 1 << 20
    sizes = [len(c) for c in decompressed_chunks([data])]
    assert sum(sizes) == 64 << 20 and max(sizes) <= 4 << 20


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("k.txt", "hello")
    return buf.getvalue()


@pytest.mark.parametrize(
    "data,name",
    [
        (_zip_bytes(), "zip"),
        (b"LZIP\x01" + os.urandom(200), "lzip"),
        (b"\x1f\x9d\x90" + os.urandom(200), "Unix compress"),
        (b"7z\xbc\xaf\x27\x1c" + os.urandom(200), "7z"),
    ],
)
def test_formats_that_are_not_read_are_named(data, name, tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    for read in (
        lambda: list(shard_samples(str(path))),
        lambda: build_manifest([str(path)], str(tmp_path / "m.json"), workers=1),
    ):
        with pytest.raises(CompressionError) as ei:
            read()
        assert name in str(ei.value) and ei.value.url == str(path) and ei.value.offset == 0


def test_a_member_named_like_a_magic_number_is_still_a_tar(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name in ("LZIPnotes.txt", "PK\x03\x04odd.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tf.addfile(info, io.BytesIO(b"ok"))
    path = tmp_path / "odd.tar"
    path.write_bytes(buf.getvalue())
    assert [s["__key__"] for s in shard_samples(str(path))] == ["LZIPnotes", "PK\x03\x04odd"]
