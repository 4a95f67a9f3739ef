"""The per-shard index: offsets agree with tarfile's, the file format round-trips and refuses
what it cannot read, the writer records what a later read finds, DALI's index is exported."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tarshards import IntegrityError, ShardFormatError, ShardWriter, TarWriter
from tarshards.format import hashing
from tarshards.format import index as index_mod
from tarshards.format.hashing import HashingReader, file_hasher, member_checksum_fn
from tarshards.format.index import ShardIndex, index_stream, index_url
from tarshards.pipeline.dataset import shard_samples
from tarshards.storage import read_sample_at, samples_from
from tarshards.tario import iter_tar, tar_byte_source
from tarshards.write import writer as writer_mod


def _tar_bytes(members, fmt=tarfile.PAX_FORMAT, dirs=()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for d in dirs:
            ti = tarfile.TarInfo(d)
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _tarfile_shard(path, members, fmt=tarfile.PAX_FORMAT, dirs=()):
    Path(path).write_bytes(_tar_bytes(members, fmt, dirs))
    return path


def _members(n=12, long_every=4):
    out = []
    for i in range(n):
        key = ("d" * 90 + "/" + "k" * 30 if i % long_every == 0 else "dir") + f"/s{i:04d}"
        out.append((f"{key}.jpg", os.urandom(37 * i + 1)))
        out.append((f"{key}.cls", str(i).encode()))
    return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_offsets_agree_with_tarfile(tmp_path, fmt):
    members = _members(long_every=4 if fmt != tarfile.USTAR_FORMAT else 10**9)
    path = _tarfile_shard(str(tmp_path / "a.tar"), members, fmt, dirs=["dir/"])
    idx = index_url(path)
    with tarfile.open(path) as tf:
        infos = [ti for ti in tf.getmembers() if ti.isreg()]
    assert idx.member_offsets.tolist() == [ti.offset for ti in infos]
    assert idx.member_data_offsets.tolist() == [ti.offset_data for ti in infos]
    assert idx.member_sizes.tolist() == [ti.size for ti in infos]
    csum = member_checksum_fn(idx.member_hash)
    assert idx.member_checksums.tolist() == [csum(d) for _, d in members]
    assert idx.num_samples == len(members) // 2
    assert idx.keys == [n.rsplit(".", 1)[0] for n, _ in members[::2]]
    assert [idx.member_names(i) for i in range(2)] == [
        [members[0][0], members[1][0]],
        [members[2][0], members[3][0]],
    ]
    assert idx.nbytes == os.path.getsize(path)
    h = file_hasher("xxh3_64")
    h.update(Path(path).read_bytes())
    assert idx.hash == f"xxh3_64:{h.hexdigest()}"


def test_gnu_tar_shard(tmp_path):
    src = tmp_path / "src"
    names = []
    for i in range(5):
        sub = src / ("long" * 30) if i % 2 else src / "short"
        sub.mkdir(parents=True, exist_ok=True)
        for ext, data in (("txt", b"t" * i), ("bin", os.urandom(700))):
            (sub / f"key{i}.{ext}").write_bytes(data)
            names.append(os.path.relpath(sub / f"key{i}.{ext}", src))
    path = tmp_path / "gnu.tar"
    subprocess.run(["tar", "--format=gnu", "-cf", str(path), "-C", str(src), *names], check=True)
    idx = index_url(str(path))
    seq = list(shard_samples(str(path)))
    assert idx.num_samples == len(seq) == 5
    with open(path, "rb") as f:
        for i, want in enumerate(seq):
            got = read_sample_at(
                f, int(idx.sample_offsets[i]), end=int(idx.sample_ends[i]), url=str(path)
            )
            assert got == want


def test_round_trip_bytes_and_file(tmp_path):
    path = _tarfile_shard(str(tmp_path / "a.tar"), _members())
    idx = index_url(path)
    data = idx.to_bytes()
    assert len(data) % 8 == 0
    again = ShardIndex.from_bytes(data)
    assert again == idx and again.keys == idx.keys and again.extensions == idx.extensions
    idx.save(str(tmp_path / "a.tar.tsidx"))
    loaded = ShardIndex.load(str(tmp_path / "a.tar.tsidx"))
    assert loaded == idx and loaded.url.endswith("a.tar.tsidx")
    assert loaded.sample_offsets.dtype == np.dtype("<i8")


def test_bad_index_files_are_refused(tmp_path):
    idx = index_url(_tarfile_shard(str(tmp_path / "a.tar"), _members()))
    data = idx.to_bytes()
    with pytest.raises(IntegrityError, match="not a tarshards index"):
        ShardIndex.from_bytes(b"PK\x03\x04" + data[4:])
    bumped = bytearray(data)
    bumped[8] = 99
    with pytest.raises(IntegrityError, match="version 99 is not supported"):
        ShardIndex.from_bytes(bytes(bumped))
    with pytest.raises(IntegrityError, match="truncated"):
        ShardIndex.from_bytes(data[: len(data) - 64])


def test_non_ascii_keys_and_skipped_members(tmp_path):
    members = [
        ("ключ1.txt", b"a"),
        ("ключ1.json", b"{}"),
        ("__meta__.json", b"{}"),
        ("noext", b"x"),
        ("./dotslash.txt", b"b"),
        ("./dotslash.cls", b"1"),
    ]
    path = _tarfile_shard(str(tmp_path / "a.tar"), members)
    idx = index_url(path)
    assert idx.keys == ["ключ1", "dotslash"]
    assert idx.member_names(1) == ["./dotslash.txt", "./dotslash.cls"]
    seq = list(shard_samples(path))
    with open(path, "rb") as f:
        for i in range(2):
            assert (
                read_sample_at(f, int(idx.sample_offsets[i]), end=int(idx.sample_ends[i]), url=path)
                == seq[i]
            )
        # without the end: read until the next sample starts
        assert read_sample_at(f, int(idx.sample_offsets[0]), url=path) == seq[0]
        assert list(samples_from(f, int(idx.sample_offsets[1]), url=path)) == seq[1:]


@pytest.mark.parametrize("background", [True, False])
def test_writer_records_what_a_read_finds(tmp_path, monkeypatch, background):
    if not background:  # hashed on the writing thread (no _xxh3, or not a file it can read)
        monkeypatch.setattr(hashing, "background_hasher", lambda *a, **k: None)
    samples = [
        {"__key__": f"s{i}", "txt": "x" * (i * 300), "cls": i, "json": {"i": i}} for i in range(30)
    ]
    samples[3]["__key__"] = "p/" + "q" * 150 + "/s3"  # a pax header
    for suffix, aligned in (
        (".tar", False),
        (".tar.gz", False),
        (".tar.zst", False),
        (".tar.gz", True),
        (".tar.zst", True),
    ):
        path = str(tmp_path / f"w{int(aligned)}{suffix}")
        with TarWriter(path, index=path + ".tsidx", aligned=aligned) as w:
            for s in samples:
                w.write(s)
        recorded = ShardIndex.load(path + ".tsidx")
        assert recorded == w.index
        read = index_url(path)
        assert read == recorded, suffix
        assert recorded.seekable == (suffix == ".tar" or aligned)
        assert (
            recorded.compression == {".tar": "none", ".tar.gz": "gzip", ".tar.zst": "zstd"}[suffix]
        )


def test_aligned_shards_are_valid_for_other_tools(tmp_path):
    samples = [{"__key__": f"s{i}", "txt": f"sample {i}"} for i in range(5)]
    gz = str(tmp_path / "a.tar.gz")
    with TarWriter(gz, aligned=True) as w:
        for s in samples:
            w.write(s)
    with tarfile.open(gz, "r:gz") as tf:
        assert [m.name for m in tf.getmembers()] == [f"s{i}.txt" for i in range(5)]
    assert subprocess.run(["tar", "-tzf", gz], capture_output=True, check=True).stdout.split() == [
        f"s{i}.txt".encode() for i in range(5)
    ]
    zst = str(tmp_path / "a.tar.zst")
    with TarWriter(zst, aligned=True) as w:
        for s in samples:
            w.write(s)
    with open(zst, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        with tarfile.open(fileobj=raw, mode="r|") as tf:
            assert [m.name for m in tf] == [f"s{i}.txt" for i in range(5)]


def test_foreign_compressed_shard_is_indexed_but_not_seekable(tmp_path):
    path = _tarfile_shard(str(tmp_path / "a.tar"), _members())
    tgz = str(tmp_path / "a.tgz")
    with open(path, "rb") as f, gzip.open(tgz, "wb") as g:
        g.write(f.read())
    idx = index_url(tgz)
    plain = index_url(path)
    assert idx.compression == "gzip" and not idx.seekable
    assert idx.keys == plain.keys
    assert idx.tar_offsets.tolist() == plain.tar_offsets.tolist()
    assert idx.nbytes == os.path.getsize(tgz)


@pytest.mark.parametrize("kind", ["gz", "zst", "bz2", "xz"])
@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_compressed_damage_is_reported_as_the_reader_reports_it(tmp_path, kind, damage):
    """The indexer decompresses with the reader's frame loop: the same error class, shard and
    compressed offset as the tar reader's sequential read of the same damaged file (members,
    not grouped samples: garbage decoded before the damage may repeat a field)."""
    import bz2
    import lzma
    import random

    rng = random.Random(1)
    members = [
        (f"dir/s{i:04d}.{ext}", rng.randbytes(37 * i + 1))
        for i in range(40)
        for ext in ("jpg", "cls")
    ]
    raw = Path(_tarfile_shard(str(tmp_path / "a.tar"), members)).read_bytes()
    data = bytearray(
        {
            "gz": gzip.compress,
            "zst": zstandard.ZstdCompressor(write_checksum=True).compress,  # else a flip in
            # literal bytes decodes to other bytes, silently
            "bz2": bz2.compress,
            "xz": lambda b: lzma.compress(b, format=lzma.FORMAT_XZ),
        }[kind](raw)
    )
    if damage == "cut":
        data = data[: len(data) * 2 // 3]
    else:
        for i in range(len(data) // 2, len(data) // 2 + 16):
            data[i] ^= 0xA5
    bad = tmp_path / f"bad.tar.{kind}"
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError) as read, open(bad, "rb") as f:
        list(iter_tar(tar_byte_source(f, str(bad))))
    with pytest.raises(ShardFormatError) as indexed:
        index_url(str(bad))
    assert type(indexed.value) is type(read.value)
    assert (indexed.value.url, indexed.value.offset) == (read.value.url, read.value.offset)
    assert indexed.value.url == str(bad) and indexed.value.offset is not None


def test_corrupt_shards_raise_with_context(tmp_path):
    path = _tarfile_shard(str(tmp_path / "a.tar"), _members())
    data = bytearray(Path(path).read_bytes())
    cut = str(tmp_path / "cut.tar")
    Path(cut).write_bytes(data[:3000])
    with pytest.raises(ShardFormatError, match="truncated") as e:
        index_url(cut)
    assert e.value.url == cut
    bad = str(tmp_path / "bad.tar")
    at = int(index_url(path).member_offsets[3])  # a plain ustar header
    data[at + 10] ^= 0xFF
    Path(bad).write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="checksum"):
        index_url(bad)


@pytest.mark.parametrize("compress", [None, "gz"])
@pytest.mark.parametrize("chunk", [512, 1 << 20])
def test_a_tar_without_its_end_marker_indexes_as_it_reads(tmp_path, compress, chunk):
    """Writers that stop after the last member (no two zero blocks): the reader accepts them as
    tar does, and so does the index, whichever of its loops reached the end."""
    path = _tarfile_shard(str(tmp_path / "a.tar"), _members())
    data = Path(path).read_bytes()
    data = data[: int(index_url(path).sample_ends[-1])]  # up to the last member's padding
    assert data[-1024:] != bytes(1024)
    cut = tmp_path / "noeoa.tar"
    cut.write_bytes(gzip.compress(data) if compress else data)
    read = [(s["__key__"], s["__offset__"]) for s in shard_samples(str(cut))]
    with open(cut, "rb") as f:
        idx = index_stream(f, url=str(cut), chunk_size=chunk)
    assert len(read) == len(idx) > 3
    assert idx.tar_offsets.tolist() == [offset for _, offset in read]


def test_dali_export_matches_wds2idx_format(tmp_path):
    members = _members(6, long_every=10**9)
    path = _tarfile_shard(str(tmp_path / "a.tar"), members, tarfile.USTAR_FORMAT)
    idx = index_url(path)
    text = idx.to_dali()
    lines = text.splitlines()
    assert lines[0] == "v1.2 6"
    with tarfile.open(path) as tf:
        infos = [ti for ti in tf.getmembers() if ti.isreg()]
    # each line: ext offset size name, per member of the sample (offset of the data)
    for line, pair in zip(lines[1:], zip(infos[::2], infos[1::2])):
        fields = line.split()
        assert len(fields) == 8
        for k, ti in enumerate(pair):
            ext, off, size, name = fields[4 * k : 4 * k + 4]
            assert (ext, int(off), int(size), name) == (
                ti.name.split(".", 1)[1],
                ti.offset_data,
                ti.size,
                ti.name,
            )
            with open(path, "rb") as f:
                f.seek(int(off))
                assert f.read(int(size)) == dict(members)[ti.name]
    idx.save_dali(str(tmp_path / "a.idx"))
    assert (tmp_path / "a.idx").read_text() == text


def test_hashing_reader_covers_the_whole_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 << 20))
    with open(path, "rb", buffering=0) as f:
        r = HashingReader(f, "sha256")
        view = bytearray(1000)
        assert r.readinto(view) == 1000
        r.read(5000)
        r.finish()
    import hashlib

    assert r.digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert r.nbytes == 3 << 20


def test_index_stream_of_a_non_seekable_stream(tmp_path):
    path = _tarfile_shard(str(tmp_path / "a.tar"), _members())
    with subprocess.Popen(["cat", path], stdout=subprocess.PIPE) as proc:
        idx = index_stream(proc.stdout, "pipe")
    assert idx == index_url(path)


def test_shardwriter_sample_offsets_open_samples(tmp_path):
    with ShardWriter(
        str(tmp_path / "s-%02d.tar.zst"),
        maxcount=10,
        aligned=True,
        manifest=str(tmp_path / "m.json"),
    ) as w:
        for i in range(25):
            w.write({"__key__": f"k{i}", "txt": "y" * i})
    m = w.manifest
    for i, url in enumerate(m.shard_urls()):
        idx = m.load_index(i)
        seq = list(shard_samples(url))
        with open(url, "rb") as f:
            for j in range(len(idx)):
                assert (
                    list(
                        samples_from(
                            f,
                            int(idx.sample_offsets[j]),
                            compression="zstd",
                            tar_offset=int(idx.tar_offsets[j]),
                            url=url,
                        )
                    )
                    == seq[j:]
                )


# ---- the C paths (member scan, writer's records) agree with the Python reference -------------

needs_c = pytest.mark.skipif(
    index_mod._index_members is None or writer_mod._CRecorder is None,
    reason="the C accelerator is not built",
)


def test_member_checksum_is_xxhash_xxh3_64():
    assert hashing.MEMBER_HASH == "xxh3_64"
    fn = member_checksum_fn("xxh3_64")  # _xxh3's where built (over libxxhash), else xxhash's
    assert fn is (
        xxhash.xxh3_64_intdigest if hashing._xxh3 is None else hashing._xxh3.xxh3_64_intdigest
    )
    for data in (b"", b"x", bytes(range(256)) * 400):
        assert fn(data) == xxhash.xxh3_64_intdigest(data)
    assert member_checksum_fn("xxh3_64")(b"") == 0x2D06800538D394C2  # xxh3_64's published value
    assert member_checksum_fn("crc32") is zlib.crc32
    with pytest.raises(ValueError, match="unknown member checksum 'wmix64'"):
        member_checksum_fn("wmix64")


def _python_only(monkeypatch):
    monkeypatch.setattr(index_mod, "_index_members", None)
    monkeypatch.setattr(writer_mod, "_CRecorder", None)


@needs_c
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("last_dot", [False, True])
def test_c_member_scan_equals_python(tmp_path, monkeypatch, fmt, last_dot):
    members = _members(long_every=3 if fmt != tarfile.USTAR_FORMAT else 10**9)
    members += [
        ("./dot/s9000.a.b.png", b"x" * 700),  # "./", several dots
        ("./dot/s9000.a.b.txt", b"y"),
        ("dir/__skipped.txt", b"z" * 10),
        ("noext", b"w"),
        ("dir/s9001.", b"v"),
        ("dir/s9002.CLS", b"1"),
        ("dir/s9002.jpg", b""),
    ]
    if fmt != tarfile.USTAR_FORMAT:
        members.append(("dir/s9003.t\u00e9xt", b"non-ascii extension"))
    path = _tarfile_shard(str(tmp_path / "a.tar"), members, fmt, dirs=["dir/"])
    data = Path(path).read_bytes()
    c = [
        index_stream(io.BytesIO(data), path, last_dot=last_dot, chunk_size=n)
        for n in (700, 1 << 20)
    ]
    with monkeypatch.context() as m:
        _python_only(m)
        py = index_stream(io.BytesIO(data), path, last_dot=last_dot)
    assert c[0] == py and c[1] == py
    assert py.member_hash == "xxh3_64"
    assert py.member_checksums.tolist() == [
        xxhash.xxh3_64_intdigest(d)
        for name, d in members
        if not name.rsplit("/", 1)[-1].startswith("__") and name not in ("noext", "dir/s9001.")
    ]


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])  # crc32: where xxhash is missing
def test_member_checksums_c_and_python_agree(tmp_path, monkeypatch, algo):
    members = _members() + [("big/s1.bin", os.urandom(3 << 20))]  # over one read chunk
    path = _tarfile_shard(str(tmp_path / "a.tar"), members)
    data = Path(path).read_bytes()
    idx = index_url(path, member_hash=algo)
    fn = member_checksum_fn(algo)
    assert idx.member_hash == algo
    assert idx.member_checksums.tolist() == [fn(d) for _, d in members]
    again = ShardIndex.from_bytes(idx.to_bytes(), url=path)
    assert again == idx and again.checksum_fn() is fn
    for chunk in (700, 1000):  # members (and their padding) across chunk boundaries
        assert index_stream(io.BytesIO(data), path, member_hash=algo, chunk_size=chunk) == idx
    with monkeypatch.context() as m:
        _python_only(m)
        assert index_stream(io.BytesIO(data), path, member_hash=algo) == idx


@needs_c
@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
    chunk=st.integers(512, 5000),
)
def test_c_checksums_equal_python_any_sizes_and_chunks(sizes, chunk):
    rng = np.random.default_rng(len(sizes) * 7919 + chunk)
    members = [(f"s{i // 2}.{'ab'[i % 2]}", rng.bytes(n)) for i, n in enumerate(sizes)]
    data = _tar_bytes(members, tarfile.USTAR_FORMAT)
    c = index_stream(io.BytesIO(data), "x.tar", chunk_size=chunk)
    assert c.member_checksums.tolist() == [xxhash.xxh3_64_intdigest(d) for _, d in members]
    saved = index_mod._index_members
    index_mod._index_members = None  # the Python path (hypothesis runs without monkeypatch)
    try:
        assert index_stream(io.BytesIO(data), "x.tar", chunk_size=chunk) == c
    finally:
        index_mod._index_members = saved


class _ShortReads(io.RawIOBase):
    """A stream whose reads return at most 300 bytes (as pipes and network streams may)."""

    def __init__(self, data: bytes):
        self.inner = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, b):
        return self.inner.readinto(memoryview(b)[:300])


def test_short_reads_index_the_same(tmp_path):
    # members over several short reads: the reused read buffer must not alias kept pieces
    members = [(f"s{i}.bin", os.urandom(200 * i + 1)) for i in range(12)]
    path = _tarfile_shard(str(tmp_path / "a.tar"), members, tarfile.USTAR_FORMAT)
    data = Path(path).read_bytes()
    short = index_stream(_ShortReads(data), path)
    assert short == index_stream(io.BytesIO(data), path)
    assert short.member_checksums.tolist() == [xxhash.xxh3_64_intdigest(d) for _, d in members]


@needs_c
def test_c_scan_hands_the_checksum_views_it_releases(tmp_path):
    members = [(f"s{i}.{ext}", os.urandom(100 * i)) for i in range(5) for ext in ("a", "b")]
    path = _tarfile_shard(str(tmp_path / "a.tar"), members, tarfile.USTAR_FORMAT)
    data = bytearray(Path(path).read_bytes())
    kept = []

    def keeping(view):  # a checksum that keeps what it was given
        kept.append(view)
        return xxhash.xxh3_64_intdigest(view)

    builder = index_mod.IndexBuilder()
    builder.checksum = keeping
    end = sum(512 + -(-len(d) // 512) * 512 for _, d in members)  # headers and padded data
    assert builder.scan(data, 0, 0, len(data)) == end
    assert len(kept) == len(members)
    for view in kept:  # views over the read buffer: released, never dangling
        with pytest.raises(ValueError, match="released"):
            bytes(view)
    idx = builder.build(nbytes=len(data), hash=None)
    assert idx.member_checksums.tolist() == [xxhash.xxh3_64_intdigest(d) for _, d in members]

    def failing(view):
        raise RuntimeError("checksum failed")

    builder = index_mod.IndexBuilder()
    builder.checksum = failing
    with pytest.raises(RuntimeError, match="checksum failed"):
        builder.scan(data, 0, 0, len(data))
    assert builder.count == 0 and not builder._members  # nothing half-recorded


@needs_c
def test_writer_c_records_equal_python_records(tmp_path, monkeypatch):
    samples = [
        {"__key__": f"d/s{i}", "txt": "x" * (i * 301), "cls": i, "json": {"i": i}}
        for i in range(40)
    ]
    samples[3]["__key__"] = "p/" + "q" * 150 + "/s3"  # a pax header
    samples[5]["T\u00e9XT"] = "a non-ASCII extension (a pax header)"
    samples[7]["__key__"] = samples[6]["__key__"]  # two writes, one sample (as the reader sees it)
    samples[7] = {"__key__": samples[7]["__key__"], "other": b"o"}

    def write(path, odd_write):
        with TarWriter(path, index=True) as w:
            for i, s in enumerate(samples):
                w.write(s)
                if odd_write and i == 20:  # names the C path does not take: the rest in lists
                    w.write_members([("e/x21.a.b", b"1"), ("e/x21.a.c", b"22")], key="e/x21")
        return w.index

    for odd in (False, True):
        c = write(str(tmp_path / f"c{odd}.tar"), odd)
        with monkeypatch.context() as m:
            _python_only(m)
            py = write(str(tmp_path / f"p{odd}.tar"), odd)
        assert c == py
        assert c == index_url(str(tmp_path / f"c{odd}.tar"))


def _threads() -> int:
    """This process's hashing threads (named by _xxh3)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "tarshards-hash"
        except OSError:  # a thread that ended meanwhile
            pass
    return count


@pytest.mark.skipif(
    hashing._xxh3 is None or not os.path.isdir("/proc/self/task"),
    reason="the hashing thread needs _xxh3; counting threads needs /proc",
)
def test_writer_hashing_threads_end_with_the_shard(tmp_path):
    """Each shard's read-back thread ends when the shard is closed or aborted, whatever
    happens."""
    before = _threads()
    w = TarWriter(str(tmp_path / "a.tar"), index=True)
    assert w._recorder.background is not None and _threads() == before + 1
    w.write({"__key__": "k", "txt": "x"})
    w.close()
    assert _threads() == before
    w = TarWriter(str(tmp_path / "b.tar"), index=True)
    w.write({"__key__": "k", "txt": "x"})
    w.abort()
    assert _threads() == before and not (tmp_path / "b.tar").exists()
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(
            str(tmp_path / "s-%02d.tar"), maxcount=2, manifest=tmp_path / "m.json"
        ) as sw:
            for i in range(5):
                sw.write({"__key__": f"k{i}", "txt": "x"})
            raise RuntimeError("boom")
    assert _threads() == before
    with ShardWriter(str(tmp_path / "t-%02d.tar"), maxcount=2, manifest=tmp_path / "n.json") as sw:
        for i in range(5):
            sw.write({"__key__": f"k{i}", "txt": "x"})
    assert _threads() == before
    assert [i.samples for i in sw.manifest.shards] == [2, 2, 1]
    for i in range(3):
        assert sw.manifest.load_index(i) == index_url(str(tmp_path / f"t-{i:02d}.tar"))


def test_shardwriter_index_save_errors_fail_the_write(tmp_path):
    """An index that cannot be saved (its folder is a file) fails the write that closes its
    shard, naming the cause, and no manifest is written."""
    out = tmp_path / "shards"
    out.mkdir()
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "_index").write_text("in the way")  # the indexes of shards elsewhere go in _index/
    with pytest.raises(OSError):
        with ShardWriter(str(out / "s-%02d.tar"), maxcount=2, manifest=meta / "m.json") as sw:
            for i in range(5):
                sw.write({"__key__": f"k{i}", "txt": "x"})
    assert not (meta / "m.json").exists()


def test_shardwriter_post_sees_the_index(tmp_path):
    """With post=, each shard's index is saved before post(url) is called."""
    seen = []

    def post(url):
        seen.append(os.path.exists(url + ".tsidx"))

    with ShardWriter(
        str(tmp_path / "s-%02d.tar"), maxcount=2, manifest=tmp_path / "m.json", post=post
    ) as sw:
        for i in range(5):
            sw.write({"__key__": f"k{i}", "txt": "x"})
    assert seen == [True, True, True]


def _sparse_shard(path) -> str:
    """A GNU tar shard with a sparse member (a sample with FLAG_REBUILT) beside plain ones."""
    src = Path(path).parent / "sparse-src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"first")
    with open(src / "b.bin", "wb") as f:  # a hole, then data
        f.seek(300_000)
        f.write(b"tail")
    (src / "c.txt").write_bytes(b"third")
    subprocess.run(
        ["tar", "--format=gnu", "-S", "-cf", str(path), "-C", str(src), "a.txt", "b.bin", "c.txt"],
        check=True,
    )
    return str(path)


def _shards_of_every_kind(tmp_path) -> list:
    out = []
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        members = _members(long_every=4 if fmt != tarfile.USTAR_FORMAT else 10**9)
        out.append(_tarfile_shard(str(tmp_path / f"f{fmt}.tar"), members, fmt, dirs=["dir/"]))
    out.append(  # non-ASCII keys, "./" names, members the reader skips
        _tarfile_shard(
            str(tmp_path / "odd.tar"),
            [
                ("./k\u00e9y.txt", b"a"),
                ("./k\u00e9y.cls", b"1"),
                ("__meta__", b"m"),
                ("noext", b"n"),
                ("./b.c.d", b"xyz"),
            ],
        )
    )
    out.append(_sparse_shard(tmp_path / "sparse.tar"))
    path = str(tmp_path / "w.tar")
    with TarWriter(path) as w:
        for i in range(50):
            w.write({"__key__": f"s{i}", "txt": "x" * i, "cls": i})
    out.append(path)
    return out


@needs_c
@pytest.mark.parametrize("last_dot", [False, True])
def test_index_built_without_numpy_equals_numpy_build(tmp_path, monkeypatch, last_dot):
    """Plain shards' indexes are built in C without numpy (``_build_raw``, what lets
    ``tarshards index`` not import it): the same bytes, the same arrays as the numpy build, for
    every kind of shard the reader takes."""
    for path in _shards_of_every_kind(tmp_path):
        raw = index_url(path, last_dot=last_dot)
        with monkeypatch.context() as m:
            m.setattr(index_mod, "_index_columns", None)  # the numpy build
            with_numpy = index_url(path, last_dot=last_dot)
        assert "sample_offsets" in with_numpy.__dict__
        assert "sample_offsets" not in raw.__dict__  # not made into arrays yet
        assert raw.num_samples == with_numpy.num_samples
        assert raw.keys == with_numpy.keys
        assert raw.to_bytes() == with_numpy.to_bytes(), path
        for name, dtype, _ in index_mod._ARRAYS:  # and asked for, each array as numpy's
            a, b = getattr(raw, name), getattr(with_numpy, name)
            assert a.dtype == np.dtype(dtype) and np.array_equal(a, b), (path, name)
        back = ShardIndex.from_bytes(raw.to_bytes())
        assert back == with_numpy and back.member_names(0) == with_numpy.member_names(0)


@needs_c
def test_writer_index_without_numpy_equals_numpy_build(tmp_path, monkeypatch):
    samples = [{"__key__": f"d/s{i}", "txt": "x" * (i * 301), "cls": i} for i in range(40)]
    samples[3]["__key__"] = "p/" + "q" * 150 + "/s\u00e93"  # a pax header, a non-ASCII key
    indexes = []
    for raw in (False, True):
        with monkeypatch.context() as m:
            if not raw:
                m.setattr(index_mod, "_index_columns", None)
            with TarWriter(str(tmp_path / f"w{raw}.tar"), index=True) as w:
                for s in samples:
                    w.write(s)
        indexes.append(w.index)
    assert indexes[0].to_bytes() == indexes[1].to_bytes()
    assert indexes[1] == index_url(str(tmp_path / "wTrue.tar"))


def test_shard_index_is_immutable_and_checks_its_arrays(tmp_path):
    path = _tarfile_shard(str(tmp_path / "a.tar"), _members(4))
    idx = ShardIndex.from_bytes(index_url(path).to_bytes())
    with pytest.raises(AttributeError):
        idx.nbytes = 3
    with pytest.raises(AttributeError):
        assert idx.no_such_thing is None  # raises
    arrays = {name: getattr(idx, name) for name, _, _ in index_mod._ARRAYS}
    assert ShardIndex(**arrays, nbytes=idx.nbytes, hash=idx.hash, extensions=idx.extensions) == idx
    del arrays["member_sizes"]
    with pytest.raises(TypeError, match="member_sizes"):
        ShardIndex(**arrays)


@needs_c  # without the C module, indexes are built with numpy
def test_tarshards_index_does_not_import_numpy(tmp_path):
    """The command's start-up (numpy costs ~60 ms of it) and what it writes: the same manifest
    and indexes as the library writes with numpy."""
    paths = [_tarfile_shard(str(tmp_path / f"s{i}.tar"), _members(6 + i)) for i in range(3)]
    code = (
        "import sys; from tarshards.cli.main import main\n"
        "try:\n"
        f"    main(['index', '-q', '-p', '1', *{paths!r}, '-o', {str(tmp_path / 'm.json')!r}])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
    written = [Path(p + ".tsidx").read_bytes() for p in paths]
    from tarshards.format.manifest import build_manifest

    build_manifest(paths, tmp_path / "m2.json", workers=1)
    assert [Path(p + ".tsidx").read_bytes() for p in paths] == written
    assert (tmp_path / "m.json").read_text() == (tmp_path / "m2.json").read_text()


def test_shard_index_pickles_as_its_file(tmp_path, monkeypatch):
    import pickle

    path = _tarfile_shard(str(tmp_path / "a.tar"), _members(5))
    raw = index_url(path)
    with monkeypatch.context() as m:
        m.setattr(index_mod, "_index_columns", None)  # the numpy build
        built = index_url(path)
    for idx in (raw, built, ShardIndex.from_bytes(memoryview(raw.to_bytes()), url=path)):
        back = pickle.loads(pickle.dumps(idx))
        assert back == idx and back.url == path and back.keys == idx.keys
        assert np.array_equal(back.member_sizes, idx.member_sizes)


@needs_c
def test_index_columns_refuses_partial_rows():
    from tarshards import _speedups

    with pytest.raises(ValueError, match="whole rows"):
        _speedups.index_columns(bytes(24), bytes(47))
    with pytest.raises(ValueError, match="whole rows"):
        _speedups.index_columns(bytes(25), bytes(48))
    cols = _speedups.index_columns(b"", b"")
    assert len(cols) == 9 and all(c == b"" for c in cols)


def test_add_written_with_keys_but_no_counts_takes_the_member_path():
    # keys= without counts= used to raise TypeError (sum(None)); it now records member by
    # member, as without keys: the same index as add() of each member
    names = ["a.txt", "a.cls", "b.txt"]
    data = [b"x" * 700, b"1", b"yy"]
    csum = member_checksum_fn()
    sums = [csum(d) for d in data]

    def built(**kw):
        builder = index_mod.IndexBuilder()
        builder.add_written(names, [len(d) for d in data], sums, **kw)
        return builder.build(nbytes=0, hash=None)

    plain = built()
    assert built(keys=["a", "b"]) == plain
    assert plain.keys == ["a", "b"]
    assert plain.member_sizes.tolist() == [700, 1, 2]
    assert plain.member_offsets.tolist() == [0, 512 + 1024, 512 + 1024 + 1024]
