"""The optional C xxh3_64 (``_xxh3``, over the system's libxxhash) gives the xxhash package's values
everywhere it is used: one-shot, streaming at every split, the C loops' capsule, threads."""

from __future__ import annotations

import io
import os
import struct
import tarfile
import threading
from pathlib import Path

import pytest
import xxhash

from tarshards import ShardWriter, TarWriter, hashing
from tarshards import index as index_mod
from tarshards.index import index_stream, index_url
from tarshards.manifest import build_manifest

_xxh3 = pytest.importorskip("tarshards._xxh3", reason="built only where libxxhash-dev is installed")

SIZES = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65535, 65536, 65537]


def test_one_shot_equals_xxhash():
    for n in SIZES + [1 << 20]:
        data = os.urandom(n)
        assert _xxh3.xxh3_64_intdigest(data) == xxhash.xxh3_64_intdigest(data), n
    assert _xxh3.xxh3_64_intdigest(b"") == 0x2D06800538D394C2  # xxh3_64's published value
    for kind in (bytearray, memoryview):
        assert _xxh3.xxh3_64_intdigest(kind(b"abc")) == xxhash.xxh3_64_intdigest(b"abc")
    with pytest.raises(TypeError):
        _xxh3.xxh3_64_intdigest("text")


def test_streaming_equals_xxhash_at_every_split():
    data = os.urandom(700)  # xxh3's internal block and stripe boundaries lie inside
    want = xxhash.xxh3_64(data)
    for at in range(len(data) + 1):
        h = _xxh3.Xxh3()
        h.update(data[:at])
        h.update(memoryview(data)[at:])
        assert (h.intdigest(), h.hexdigest(), h.digest()) == (
            want.intdigest(),
            want.hexdigest(),
            want.digest(),
        ), at


def test_copy_and_large_updates():
    parts = [os.urandom(n) for n in (512, 100_000, 3, 70_000, 0, 1 << 20)]
    a = _xxh3.Xxh3()
    for p in parts:
        a.update(p)
    want = xxhash.xxh3_64(b"".join(parts)).intdigest()
    assert a.intdigest() == want
    c = a.copy()
    c.update(b"more")
    assert a.intdigest() == want
    assert c.intdigest() == xxhash.xxh3_64(b"".join(parts) + b"more").intdigest()
    with pytest.raises(TypeError):
        a.update(5)
    with pytest.raises(TypeError):
        _xxh3.Xxh3(1)


def test_tee_hashes_each_part_then_writes_them():
    parts = [os.urandom(n) for n in (512, 100_000, 3, 0, 70_000)]
    h = _xxh3.Xxh3()
    out = io.BytesIO()
    tee = h.tee(out.writelines)
    tee(parts)
    tee((bytearray(b"ab"), memoryview(b"cd")))
    data = b"".join(parts) + b"abcd"
    assert out.getvalue() == data
    assert h.intdigest() == xxhash.xxh3_64(data).intdigest()
    with pytest.raises(TypeError):
        tee([b"x", 5])  # not a buffer: nothing written
    assert out.getvalue() == data
    with pytest.raises(TypeError):
        h.tee(5)


def test_threads_share_one_hasher_safely():
    # updates without the GIL (>= 64 KiB) from several threads: each is whole (the lock), and
    # equal chunks make the result independent of their order
    chunk = os.urandom(200_000)
    h = _xxh3.Xxh3()
    threads = [
        threading.Thread(target=lambda: [h.update(chunk) for _ in range(20)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.intdigest() == xxhash.xxh3_64(chunk * 80).intdigest()


def test_threads_hash_in_parallel_to_the_same_values():
    datas = [os.urandom(1 << 20) for _ in range(4)]
    got: dict = {}

    def run(i):
        h = _xxh3.Xxh3()
        for _ in range(3):
            h.update(datas[i])
        got[i] = (h.intdigest(), _xxh3.xxh3_64_intdigest(datas[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, d in enumerate(datas):
        assert got[i] == (xxhash.xxh3_64(d * 3).intdigest(), xxhash.xxh3_64_intdigest(d))


def test_hashing_uses_the_c_module():
    assert hashing.HASHING_RELEASES_GIL
    assert isinstance(hashing.file_hasher("xxh3_64"), _xxh3.Xxh3)
    assert hashing.member_checksum_fn("xxh3_64") is _xxh3.xxh3_64_intdigest
    assert hashing.member_checksum_c("xxh3_64") is _xxh3.checksum64
    assert hashing.member_checksum_c("crc32") is hashing.member_checksum_fn("crc32")


def _shard(path: Path, n: int = 30) -> bytes:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            for ext, size in (("cls", 2), ("bin", 5000 * i + 7)):  # some over 64 KiB
                ti = tarfile.TarInfo(f"s{i:04d}.{ext}")
                data = os.urandom(size)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return path.read_bytes()


def test_index_and_writer_equal_the_xxhash_package_path(tmp_path, monkeypatch):
    data = _shard(tmp_path / "a.tar")
    c = index_url(str(tmp_path / "a.tar"))
    samples = [{"__key__": f"k{i}", "bin": os.urandom(3000 * i), "cls": b"1"} for i in range(40)]
    with TarWriter(str(tmp_path / "w.tar"), index=True) as w:
        for s in samples:
            w.write(s)
    written = w.index
    with monkeypatch.context() as m:  # the package path: xxhash's functions, called from C
        m.setattr(hashing, "_xxh3", None)
        assert isinstance(hashing.file_hasher("xxh3_64"), type(xxhash.xxh3_64()))
        py = index_stream(io.BytesIO(data), str(tmp_path / "a.tar"))
        with TarWriter(str(tmp_path / "w2.tar"), index=True) as w2:
            for s in samples:
                w2.write(s)
    assert c == py and c.hash == py.hash
    assert written == w2.index and written.hash == w2.index.hash
    assert written.member_checksums.tolist() == [
        xxhash.xxh3_64_intdigest(v) for s in samples for v in (s["bin"], s["cls"])
    ]
    assert (
        written.hash == "xxh3_64:" + xxhash.xxh3_64((tmp_path / "w.tar").read_bytes()).hexdigest()
    )


@pytest.mark.parametrize("chunk", [1024, 1536, 4096, 70_000])
def test_plain_scan_refills_give_the_same_index(tmp_path, monkeypatch, chunk):
    # the buffer's tail moves to the front at every refill; members larger than the buffer and
    # the end of the archive go to the general walk
    data = _shard(tmp_path / "a.tar", 25)
    whole = index_stream(io.BytesIO(data), "a.tar")
    assert index_stream(io.BytesIO(data), "a.tar", chunk_size=chunk) == whole
    monkeypatch.setattr(index_mod, "_index_members", None)
    assert index_stream(io.BytesIO(data), "a.tar", chunk_size=chunk) == whole


def test_build_manifest_with_threads_equals_one_worker(tmp_path):
    pattern = str(tmp_path / "w-%02d.tar")
    with ShardWriter(pattern, maxcount=7, manifest=str(tmp_path / "written.json")) as sw:
        for i in range(30):
            sw.write({"__key__": f"k{i:03d}", "bin": os.urandom(20_000 * (i % 5)), "cls": i})
    urls = [s.url for s in sw.shards]
    one = build_manifest(urls, str(tmp_path / "one" / "m.json"), workers=1)
    many = build_manifest(urls, str(tmp_path / "many" / "m.json"), workers=3)
    assert [r.hash for r in one.shards] == [r.hash for r in many.shards]
    assert [r.hash for r in one.shards] == [r.hash for r in sw.manifest.shards]
    assert [r.samples for r in many.shards] == [7, 7, 7, 7, 2]
    for i in range(len(urls)):
        assert one.load_index(i) == many.load_index(i)


def test_record_members_capsule_equals_callable_and_refuses_odd_names():
    from tarshards._speedups import record_members

    members = [("d/k1.cls", b"1"), ("d/k1.jpg", os.urandom(70_000)), ("d/k1.t\u00e9", b"x")]
    got = []
    for checksum in (_xxh3.checksum64, _xxh3.xxh3_64_intdigest, xxhash.xxh3_64_intdigest):
        codes: dict = {}
        packed = bytearray()
        keys: list = []
        assert record_members(codes, packed, checksum, keys, members, "d/k1")
        assert record_members(codes, packed, checksum, keys, members[:1], "d/k1")  # same sample
        assert record_members(codes, packed, checksum, keys, [("d/k2.cls", b"2")], "d/k2")
        assert record_members(codes, packed, checksum, keys, [], "d/k3")  # nothing to record
        assert keys == ["d/k1", "d/k2"]
        got.append((codes, bytes(packed)))
    assert got[0] == got[1] == got[2]
    rec = [struct.unpack_from("<5Q", got[0][1], 40 * i) for i in range(5)]
    assert [r[4] for r in rec] == [0, 0, 0, 0, 1]  # the members' sample numbers
    assert [r[1] for r in rec] == [1, 70_000, 1, 1, 1]
    assert rec[1][2] == xxhash.xxh3_64_intdigest(members[1][1])
    assert [r[3] for r in rec] == [512, 512, 0, 512, 512]  # 0: a pax header (non-ASCII name)
    for odd in (
        [("d/k2.cls", b"1")],  # another key's member
        [("d/k1.a/b", b"1")],  # a slash in the extension
        [("d/k1", b"1")],  # no extension
        [("d/k1.cls", bytearray(b"1"))],  # not bytes
    ):
        packed = bytearray()
        keys = []
        assert not record_members({}, packed, _xxh3.checksum64, keys, odd, "d/k1")
        assert packed == bytearray() and keys == []
