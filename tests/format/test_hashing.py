"""The optional C xxh3_64 (``_xxh3``, over the system's libxxhash) gives the xxhash package's values
everywhere it is used: one-shot, streaming at every split, the C loops' capsule, threads."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from pathlib import Path

import pytest
import xxhash
from conftest import refused_in_forked_child
from hypothesis import given, settings
from hypothesis import strategies as st

from tarshards import ShardWriter, TarWriter
from tarshards.errors import DuplicateFieldError
from tarshards.format import hashing
from tarshards.format import index as index_mod
from tarshards.format.index import index_stream, index_url
from tarshards.format.manifest import build_manifest
from tarshards.read.reading import iter_samples
from tarshards.write.writer import _READ_BACK_COLUMNS as _COLUMNS  # the order finish() gives them

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


def _recorder(checksum):
    from tarshards._speedups import Recorder

    from tarshards.tario import header_size

    keys: list = []
    codes: dict = {}
    return Recorder(keys, codes, checksum, header_size), keys, codes


def _rows(rec):
    import numpy as np

    return np.frombuffer(rec.members, index_mod.MEMBER_DTYPE)


def test_recorder_rows_are_where_the_writer_puts_the_members():
    """Recorder lays out each member's offsets as TarMemberWriter writes them (a pax header for
    the non-ASCII name included), with the same checksums for each way of giving the hash."""
    import numpy as np

    from tarshards.tario import TarMemberWriter

    writes = [
        ([("d/k1.cls", b"1"), ("d/k1.jpg", os.urandom(70_000)), ("d/k1.t\u00e9", b"x")], "d/k1"),
        ([("d/k1.cls", b"1")], "d/k1"),  # the same key again: the same sample
        ([("d/k2.cls", b"2")], "d/k2"),
        ([], "d/k3"),  # nothing to record
    ]
    got = []
    for checksum in (_xxh3.checksum64, _xxh3.xxh3_64_intdigest, xxhash.xxh3_64_intdigest):
        rec, keys, codes = _recorder(checksum)
        for members, key in writes:
            assert rec.record(members, key)
        assert keys == ["d/k1", "d/k2"] and rec.count == 5
        got.append((dict(codes), bytes(rec.members), bytes(rec.samples)))
    assert got[0] == got[1] == got[2]
    buf = io.BytesIO()
    tw = TarMemberWriter(buf)
    for members, _ in writes:
        tw.add_all(members)
    tw.finish()
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        infos = tf.getmembers()
    rows = _rows(rec)
    assert rows["offset"].tolist() == [i.offset for i in infos]
    assert rows["data"].tolist() == [i.offset_data for i in infos]
    assert rows["size"].tolist() == [i.size for i in infos]
    assert rows["sample"].tolist() == [0, 0, 0, 0, 1]
    all_members = [m for members, _ in writes for m in members]
    assert rows["checksum"].tolist() == [xxhash.xxh3_64_intdigest(d) for _, d in all_members]
    assert list(codes) == ["cls", "jpg", "t\u00e9"]
    samples = np.frombuffer(rec.samples, "<i8").reshape(-1, 3)
    assert samples.tolist() == [
        [infos[0].offset, infos[4].offset, 0],
        [infos[4].offset, infos[4].offset_data + 512, 0],
    ]
    assert bytes(rec.key_blob) == b"d/k1d/k2"
    assert np.frombuffer(rec.key_offsets, "<i8").tolist() == [0, 4, 8]


def test_recorder_refuses_what_the_reader_would_group_otherwise():
    rec, keys, _ = _recorder(_xxh3.checksum64)
    for members, key in (
        ([("d/k2.cls", b"1")], "d/k1"),  # another key's member
        ([("d/k1.a/b", b"1")], "d/k1"),  # a slash in the extension
        ([("d/k1", b"1")], "d/k1"),  # no extension
        ([("d/k1.cls", bytearray(b"1"))], "d/k1"),  # not bytes
        ([("d/a.b.cls", b"1")], "d/a.b"),  # a dot in the key's base name
        ([("d/__x.cls", b"1")], "d/__x"),  # a name the reader skips
        ([("./k.cls", b"1")], "./k"),  # "./", which the reader strips
        ([("k\udcff.cls", b"1")], "k\udcff"),  # not UTF-8 (a lone surrogate)
    ):
        assert not rec.record(members, key), key
    assert keys == [] and rec.count == 0 and bytes(rec.samples) == b""


def test_recorder_in_tar_sample_takes_and_refuses_what_record_does():
    """tar_sample records ASCII keys by a shorter path than Recorder.record: the same rows for
    the writes both take (a key again, a dot or "__" in a directory, "_" keys), and nothing for
    the writes record refuses."""
    from tarshards._speedups import tar_sample

    taken = [
        ([("d/k1.cls", b"1"), ("d/k1.jpg", os.urandom(3000))], "d/k1"),
        ([("d/k1.txt", b"again")], "d/k1"),  # the same key: the same sample
        ([("a.b/__d/_k.x.y", b"2"), ("a.b/__d/_k.z", b"")], "a.b/__d/_k"),
        ([("k.e", b"3")], "k"),
        ([("d/k1.cls", b"4")], "d/k1"),  # d/k1 after another key: a sample of its own
    ]
    refused = [
        ([("d/k2.cls", b"1")], "d/k1"),  # another key's member
        ([("d/k1.a/b", b"1")], "d/k1"),  # a slash in the extension
        ([("d/k1", b"1")], "d/k1"),  # no extension
        ([("d/k1.", b"1")], "d/k1"),  # an empty extension
        ([("d/a.b.cls", b"1")], "d/a.b"),  # a dot in the key's base name
        ([("d/__x.cls", b"1")], "d/__x"),  # a name the reader skips
        ([("__x.cls", b"1")], "__x"),
        ([("./k.cls", b"1")], "./k"),  # "./", which the reader strips
        ([("d/.cls", b"1")], "d/"),  # an empty base name
        ([(".cls", b"1")], ""),
        ([("k.cls", b"1"), ("j.cls", b"1")], "k"),  # the second member another key's
    ]
    by_record, _, _ = _recorder(_xxh3.checksum64)
    by_tar, keys, codes = _recorder(_xxh3.checksum64)
    for members, key in taken:
        assert by_record.record(members, key)
        assert tar_sample(members, 0, 0o444, 1 << 30, by_tar, key) is not None, key
        for members, key in refused:
            assert tar_sample(members, 0, 0o444, 1 << 30, by_tar, key) is None, key
            assert not by_record.record(members, key), key
    assert keys == ["d/k1", "a.b/__d/_k", "k", "d/k1"] and list(codes) == [
        "cls",
        "jpg",
        "txt",
        "x.y",
        "z",
        "e",
    ]
    for name in ("members", "samples", "key_blob", "key_offsets"):
        assert bytes(getattr(by_tar, name)) == bytes(getattr(by_record, name)), name


def _tar_bytes(members, fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_background_reads_back_what_is_written(tmp_path, fmt):
    """The thread follows a file while it grows, in pieces of every size, and gives the file's
    xxh3_64 and each regular member's, in order (pax and GNU long-name headers skipped)."""
    import random

    rnd = random.Random(fmt)
    members = [
        (
            ("d" * rnd.choice([1, 120]) if fmt != tarfile.USTAR_FORMAT else "d") + f"/k{i}.bin",
            os.urandom(rnd.choice([0, 1, 511, 512, 513, 70_000, 300_000])),
        )
        for i in range(40)
    ]
    members.append(("d/caf\u00e9.txt", b"non-ascii")) if fmt == tarfile.PAX_FORMAT else None
    data = _tar_bytes(members, fmt)
    path = tmp_path / "a.tar"
    with open(path, "wb") as f:
        bg = _xxh3.Background(str(path))
        pos = 0
        while pos < len(data):  # written in pieces, flushed as a writer's buffer would be
            step = rnd.choice([1, 100, 512, 4096, 1 << 20])
            f.write(data[pos : pos + step])
            f.flush()
            pos += step
        digest, sums = bg.finish(len(data))
    assert digest == xxhash.xxh3_64(data).hexdigest()
    assert [int.from_bytes(sums[i : i + 8], "little") for i in range(0, len(sums), 8)] == [
        xxhash.xxh3_64_intdigest(d) for _, d in members
    ]
    bg.close()  # again: nothing happens


def test_background_honours_a_pax_size_record(tmp_path):
    """A member whose size only a pax record gives (as the writer does from 8 GiB on): the size
    field says 0, the pax "size" record the real size."""
    from tarshards.tario.writer import _pax_record, tar_header

    payload = _pax_record("size", "700")
    data = tar_header("././@PaxHeader", len(payload), typeflag=b"x") + payload
    data += bytes(-len(data) % 512)
    body = os.urandom(700)
    data += tar_header("k.bin", 0) + body + bytes(-700 % 512) + bytes(1024)
    path = tmp_path / "p.tar"
    path.write_bytes(data)
    bg = _xxh3.Background(str(path))
    digest, sums = bg.finish(len(data))
    assert int.from_bytes(sums, "little") == xxhash.xxh3_64_intdigest(body)
    assert digest == xxhash.xxh3_64(data).hexdigest()


def test_background_errors(tmp_path):
    path = tmp_path / "t.tar"
    path.write_bytes(b"x" * 100)
    with pytest.raises(OSError):  # the file is shorter than the writer says
        _xxh3.Background(str(path)).finish(200)
    path.write_bytes(_tar_bytes([("k.a", b"1" * 1000)])[:900])  # ends inside a member
    with pytest.raises(ValueError, match="ends inside a member"):
        _xxh3.Background(str(path)).finish(900)
    bad = bytearray(_tar_bytes([("k.a", b"1")]))
    bad[156:157] = b"5"  # a directory: not what the writer makes
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="not a regular file"):
        _xxh3.Background(str(path)).finish(len(bad))
    with pytest.raises(OSError):
        _xxh3.Background(str(tmp_path / "missing.tar"))
    bg = _xxh3.Background(str(path))
    bg.close()
    with pytest.raises(ValueError, match="closed"):
        bg.finish(len(bad))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_background_refuses_a_forked_child(tmp_path):
    path = tmp_path / "t.tar"
    path.write_bytes(bytes(1024))
    bg = _xxh3.Background(str(path))
    assert refused_in_forked_child(lambda: bg.finish(1024))
    digest, sums = bg.finish(1024)  # the parent's thread is unharmed
    assert digest == xxhash.xxh3_64(bytes(1024)).hexdigest() and sums == b""


def _read_back(path: Path, data: bytes, rnd):
    """Write ``data`` to ``path`` in pieces while a Background(index=True) follows it; then
    collect."""
    with open(path, "wb") as f:
        bg = _xxh3.Background(str(path), index=True)
        pos = 0
        while pos < len(data):
            step = rnd.choice([1, 100, 512, 4096, 1 << 20])
            f.write(data[pos : pos + step])
            f.flush()
            pos += step
    return bg.finish(len(data))


def _assert_index_columns(got, path: Path) -> None:
    """The thread's columns are those of the index a sequential read builds (the reader's
    names: keys, extensions, skipped members), byte for byte."""
    digest, *columns, exts = got
    want = index_url(str(path))
    assert f"xxh3_64:{digest}" == want.hash
    assert tuple(exts) == want.extensions
    for name, column in zip(_COLUMNS, columns):
        assert bytes(memoryview(column)) == bytes(want._array_bytes(name)), name


def test_background_index_names_members_as_the_reader(tmp_path):
    """The writer's headers (plain ustar; a ustar prefix; a pax path for long and non-ASCII names;
    a pax size), names the reader skips, keys that come back, and extensions in every order."""
    import random

    from tarshards.tario.writer import _pax_record, tar_header

    rnd = random.Random(7)
    names = [
        "a.jpg",
        "a.cls",
        "a.json",
        "b.json",
        "b.jpg",
        "./c.txt",  # "./": the sample's flag
        "./c.cls",
        "__meta__.json",  # skipped: "__"
        "d/__x.txt",
        "noext",  # skipped: no extension
        ".hidden",  # skipped: the dot starts the base name
        "trailing.",  # skipped: nothing after the dot
        "d.e/k.tar.gz",  # the key's directory may hold dots; the extension is after the first
        "p/" * 60 + "long.bin",  # prefix and name
        "q" * 150 + ".bin",  # a pax path
        "ключ.txt",  # a pax path (UTF-8)
        "a.jpg",  # a key seen before, not the last one: a new sample
        "empty.txt",
        "\u00e9\u00e9.txt/",  # a pax path (not ASCII), whose trailing slash the reader drops
    ]
    members = [(n, os.urandom(rnd.choice([0, 1, 511, 512, 513, 9000]))) for n in names]
    members[-1] = (names[-1], b"")  # empty (not a second "empty.txt": a repeated field, which
    # the sequential read refuses, and so does indexing)
    data = b""
    for name, body in members:
        data += tar_header(name, len(body)) + body + bytes(-len(body) % 512)
    payload = _pax_record("size", "700")  # a size only a pax record gives (>= 8 GiB in practice)
    data += tar_header("././@PaxHeader", len(payload), typeflag=b"x") + payload
    data += bytes(-len(data) % 512)
    data += tar_header("z.bin", 0) + os.urandom(700) + bytes(-700 % 512)
    data += bytes(1024)
    path = tmp_path / "a.tar"
    got = _read_back(path, data, rnd)
    _assert_index_columns(got, path)
    assert got[-1] == ["jpg", "cls", "json", "txt", "tar.gz", "bin"]
    assert len(got[4]) == 8 * (len(index_url(str(path))) + 1)  # key_offsets


def test_background_index_of_the_writers_shards(tmp_path):
    """TarWriter(index=True) takes its index from the thread, for any names it writes."""
    import random

    rnd = random.Random(3)
    exts = ["jpg", "cls", "json", "TXT", "tar.gz"]
    path = tmp_path / "w.tar"
    with TarWriter(str(path), index=True) as w:
        assert w._recorder.read_back
        for i in range(300):
            key = rnd.choice([f"s{i}", f"d{i % 7}/s{i}", "k" * rnd.choice([1, 99, 160]) + str(i)])
            w.write(
                {"__key__": key, **{e: os.urandom(rnd.randrange(2000)) for e in exts[: i % 5 + 1]}}
            )
        w.write_members([("__key__.txt", b"x"), ("raw", b"y"), ("x.y.z", b"z")])
    assert w.index == index_url(str(path))


def test_background_index_refuses_headers_the_writer_does_not_make(tmp_path):
    import random

    data = _tar_bytes([("L" * 120 + ".txt", b"1")], tarfile.GNU_FORMAT)  # a GNU long name
    with pytest.raises(ValueError, match="the writer does not make"):
        _read_back(tmp_path / "g.tar", data, random.Random(1))


def test_background_finish_after_the_thread_found_the_end(tmp_path):
    """The thread may find the end of the file before the last write lands and be told the size
    right after: it reads again instead of failing (finish() comes once the file is complete)."""
    import random

    rnd = random.Random(5)
    data = _tar_bytes([(f"k{i}.bin", os.urandom(3000)) for i in range(50)], tarfile.USTAR_FORMAT)
    for _ in range(30):
        path = tmp_path / "e.tar"
        with open(path, "wb") as f:
            bg = _xxh3.Background(str(path), index=True)
            half = rnd.randrange(len(data))
            f.write(data[:half])
            f.flush()
            if rnd.random() < 0.5:
                threading.Event().wait(rnd.choice([0.0005, 0.002]))  # it reaches what is there
            f.write(data[half:])
        _assert_index_columns(bg.finish(len(data)), path)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            # \udce9: a byte that is not UTF-8 (surrogateescape)
            st.text(alphabet="ab./_\u00e9\udce9", min_size=1, max_size=130),
            st.binary(max_size=700),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_background_index_property(members):
    """Any names the writer writes: the thread's index is the sequential read's."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "h.tar")
        with TarWriter(path, index=True) as w:
            for name, body in members:
                w.write_members([(name, body)])
        try:
            list(iter_samples([path]))
        except DuplicateFieldError:  # a sample repeats a field: indexing refuses it as reading
            with pytest.raises(DuplicateFieldError):
                index_url(path)
            return
        assert w.index == index_url(path)
