"""TarWriter and ShardWriter: write-then-read, determinism, compatibility, rotation, atomicity."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from conftest import refused_in_forked_child
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tarshards.pipeline.dataset import shard_samples
from tarshards.tario import iter_tar, read_chunks
from tarshards.write.writer import ShardWriter, TarWriter, shard_name

HAVE_TAR = shutil.which("tar") is not None


def fields(sample):
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def write(path, samples, **kw):
    with TarWriter(str(path), **kw) as w:
        for s in samples:
            w.write(s)
    return path


_key_part = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-é中", min_size=1, max_size=30)
_key = (
    st.lists(_key_part, min_size=1, max_size=3)
    .map("/".join)
    .filter(lambda k: not k.rpartition("/")[2].startswith("__"))
)
_ext = st.from_regex(r"[a-z][a-z0-9]{0,5}(\.[a-z0-9]{1,4})?", fullmatch=True)
_sample = st.builds(
    lambda key, flds: {"__key__": key, **flds},
    _key,
    st.dictionaries(_ext, st.binary(max_size=1500), min_size=1, max_size=4),
)


def distinct_adjacent(samples):
    out = []
    for s in samples:
        if not out or out[-1]["__key__"] != s["__key__"]:
            out.append(s)
    return out


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    samples=st.lists(_sample, max_size=8).map(distinct_adjacent),
    suffix=st.sampled_from([".tar", ".tgz", ".tar.gz", ".tar.zst"]),
)
def test_write_then_read(tmp_path_factory, samples, suffix):
    path = tmp_path_factory.mktemp("w") / f"out{suffix}"
    write(path, samples)
    got = list(shard_samples(str(path), chunk_size=777))
    assert [(s["__key__"], fields(s)) for s in got] == [(s["__key__"], fields(s)) for s in samples]
    assert all(s["__url__"] == str(path) for s in got)
    if suffix == ".tar":  # the standard library reads it too, and members are sorted
        with tarfile.open(path) as tf:
            names = tf.getnames()
            assert [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()] == [
                (f"{s['__key__']}.{e}", s[e]) for s in samples for e in sorted(fields(s))
            ]
        assert len(names) == sum(len(fields(s)) for s in samples)


@pytest.mark.parametrize("suffix", [".tar", ".tgz", ".tar.gz", ".tar.zst"])
def test_byte_identical_for_equal_samples(tmp_path, suffix):
    samples = [
        {"__key__": f"k{i}", "txt": f"t{i}", "cls": i, "json": {"i": i}, "npy": np.arange(i + 1)}
        for i in range(10)
    ]
    a = write(tmp_path / f"a{suffix}", samples).read_bytes()
    b = write(tmp_path / f"b{suffix}", samples).read_bytes()
    assert a == b
    # field order in the dict does not matter either
    reordered = [dict(reversed(list(s.items()))) for s in samples]
    assert write(tmp_path / f"c{suffix}", reordered).read_bytes() == a


def test_headers_are_deterministic_ustar(tmp_path):
    path = write(tmp_path / "a.tar", [{"__key__": "k", "txt": b"x"}])
    with tarfile.open(path) as tf:
        (m,) = tf.getmembers()
    assert (m.mtime, m.uid, m.gid, m.mode, m.uname, m.gname) == (0, 0, 0, 0o444, "", "")
    raw = path.read_bytes()
    assert raw[257:263] == b"ustar\0"
    assert len(raw) == 512 + 512 + 1024  # header, data block, end marker: no pax header


def test_long_and_unicode_names(tmp_path):
    samples = [
        {"__key__": "d" * 60 + "/" + "e" * 80, "txt": b"prefix split"},
        {"__key__": "f" * 200, "txt": b"pax path"},
        {"__key__": "x/" * 100 + "y", "seg.png": b"very long"},
        {"__key__": "ünïcödé/中文", "txt": b"unicode"},
    ]
    path = write(tmp_path / "long.tar", samples)
    got = list(shard_samples(str(path)))
    assert [(s["__key__"], fields(s)) for s in got] == [(s["__key__"], fields(s)) for s in samples]
    with tarfile.open(path) as tf:
        assert tf.getnames() == [f"{s['__key__']}.{e}" for s in samples for e in fields(s)]


@pytest.mark.skipif(not HAVE_TAR, reason="GNU tar is not installed")
def test_gnu_tar_lists_our_shards(tmp_path):
    samples = [
        {"__key__": "a/b" * 50, "txt": b"x" * 1000},
        {"__key__": "k2", "cls": b"1"},
        {"__key__": "ünï", "json": b"{}"},
    ]
    for suffix, flag in ((".tar", "-tvf"), (".tgz", "-tzvf"), (".tar.zst", None)):
        path = write(tmp_path / f"s{suffix}", samples)
        cmd = ["tar", flag, str(path)] if flag else ["tar", "--zstd", "-tvf", str(path)]
        if flag is None and not shutil.which("zstd"):
            continue
        res = subprocess.run(
            cmd, capture_output=True, check=True, env={**os.environ, "LC_ALL": "C.UTF-8"}
        )
        assert res.stderr == b""
        lines = res.stdout.decode().splitlines()
        assert len(lines) == 3
        assert all(line.startswith("-r--r--r-- 0/0") for line in lines)
        assert lines[0].endswith("a/b" * 50 + ".txt")
        assert " 1000 1970-01-01 00:00 " in lines[0]
        assert lines[2].endswith("ünï.json")


def test_encodes_values_by_extension(tmp_path):
    img = Image.fromarray(np.full((8, 9, 3), 200, np.uint8))
    sample = {
        "__key__": "s",
        "png": img,
        "jpg": img,
        "cls": 3,
        "json": {"a": 1},
        "npy": np.eye(2),
        "txt": "str",
        "bin": b"bytes",
        "__extra__": "not written",
        "none": None,
    }
    path = write(tmp_path / "e.tar", [sample])
    (got,) = shard_samples(str(path))
    assert sorted(fields(got)) == ["bin", "cls", "jpg", "json", "npy", "png", "txt"]
    assert got["cls"] == b"3" and got["json"] == b'{"a":1}' and got["txt"] == b"str"
    assert got["png"].startswith(b"\x89PNG") and got["jpg"].startswith(b"\xff\xd8")
    np.testing.assert_array_equal(np.load(io.BytesIO(got["npy"])), np.eye(2))


def test_encoder_false_requires_bytes(tmp_path):
    with pytest.raises(TypeError), TarWriter(str(tmp_path / "x.tar"), encoder=False) as w:
        w.write({"__key__": "k", "cls": 3})
    assert not (tmp_path / "x.tar").exists()


@pytest.mark.parametrize(
    "sample, match",
    [
        ({"txt": b"x"}, "__key__"),
        ({"__key__": "", "txt": b"x"}, "__key__"),
        ({"__key__": "a.b", "txt": b"x"}, "dot"),
        ({"__key__": "k"}, "no fields"),
        ({"__key__": "__k", "txt": b"x"}, "__"),
        ({"__key__": "dir/", "txt": b"x"}, "base name"),
        ({"__key__": "k", "a/b": b"x"}, "extension"),
        ({"__key__": "k", "": b"x"}, "extension"),
    ],
)
def test_rejects_samples_readers_would_lose(tmp_path, sample, match):
    with pytest.raises(ValueError, match=match), TarWriter(str(tmp_path / "x.tar")) as w:
        w.write(sample)
    assert not (tmp_path / "x.tar").exists()
    assert os.listdir(tmp_path) == []


def test_file_objects_and_stdout(tmp_path):
    samples = [{"__key__": f"k{i}", "txt": f"{i}"} for i in range(3)]
    buf = io.BytesIO()
    with TarWriter(buf) as w:
        for s in samples:
            w.write(s)
    assert not buf.closed
    path = write(tmp_path / "p.tar", samples)
    assert buf.getvalue() == path.read_bytes()
    # to stdout, through a subprocess
    code = (
        "from tarshards import TarWriter\n"
        "with TarWriter('-') as w:\n"
        "    [w.write({'__key__': f'k{i}', 'txt': f'{i}'}) for i in range(3)]\n"
    )
    out = subprocess.run([os.sys.executable, "-c", code], stdout=subprocess.PIPE, check=True).stdout
    assert out == path.read_bytes()
    # a compressed file object
    buf = io.BytesIO()
    with TarWriter(buf, compress="gz") as w:
        w.write(samples[0])
    assert buf.getvalue()[:2] == b"\x1f\x8b"
    assert [n for n, _, _ in iter_tar([__import__("gzip").decompress(buf.getvalue())])] == [
        "k0.txt"
    ]


def test_write_after_close_fails(tmp_path):
    w = TarWriter(str(tmp_path / "c.tar"))
    w.write({"__key__": "a", "txt": "x"})
    w.close()
    with pytest.raises(ValueError):
        w.write({"__key__": "b", "txt": "y"})
    with pytest.raises(ValueError):
        TarWriter(str(tmp_path / "d.tar"), compress="lzip")
    assert sorted(os.listdir(tmp_path)) == ["c.tar"]  # no temporary file left behind


def test_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), TarWriter(str(tmp_path / "x.tgz")) as w:
        w.write({"__key__": "a", "txt": "x"})
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# ShardWriter
# ---------------------------------------------------------------------------------------------


def sized_samples(n, sizes):
    return [
        {"__key__": f"s{i:04d}", "bin": bytes([i % 256]) * sizes[i % len(sizes)]} for i in range(n)
    ]


def read_dir(tmp_path, glob="*.tar"):
    out = []
    for p in sorted(tmp_path.glob(glob)):
        out.extend(shard_samples(str(p)))
    return out


def test_shardwriter_maxcount(tmp_path):
    samples = sized_samples(25, [10])
    with ShardWriter(str(tmp_path / "out-%06d.tar"), maxcount=10) as sw:
        for s in samples:
            sw.write(s)
    names = sorted(os.listdir(tmp_path))
    assert names == ["out-000000.tar", "out-000001.tar", "out-000002.tar"]
    assert [i.count for i in sw.shards] == [10, 10, 5]
    assert [os.path.basename(i.url) for i in sw.shards] == names
    assert [i.size for i in sw.shards] == [os.path.getsize(tmp_path / n) for n in names]
    assert sw.total == 25
    assert [(s["__key__"], s["bin"]) for s in read_dir(tmp_path)] == [
        (s["__key__"], s["bin"]) for s in samples
    ]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=30),
    maxsize=st.integers(3000, 20000),
    maxcount=st.integers(1, 12),
)
def test_shardwriter_limits(tmp_path_factory, sizes, maxsize, maxcount):
    d = tmp_path_factory.mktemp("sw")
    samples = sized_samples(len(sizes), sizes)
    with ShardWriter(str(d / "o-{shard:04d}.tar"), maxcount=maxcount, maxsize=maxsize) as sw:
        for s in samples:
            sw.write(s)
    files = sorted(d.glob("*.tar"))
    assert [f.name for f in files] == [f"o-{i:04d}.tar" for i in range(len(files))]
    assert len(files) == len(sw.shards)
    for f, info in zip(files, sw.shards):
        assert info.count <= maxcount
        assert f.stat().st_size == info.size
        if info.size > maxsize:
            assert info.count == 1  # only a single oversized sample may pass the limit
    # shards are filled greedily: the next sample would not have fitted
    for a, b in zip(sw.shards, sw.shards[1:]):
        first_of_next = 512 + 512 * -(
            -len(samples[sum(i.count for i in sw.shards[: sw.shards.index(b)])]["bin"]) // 512
        )
        assert a.count == maxcount or a.size + first_of_next > maxsize
    assert [(s["__key__"], s["bin"]) for s in read_dir(d)] == [
        (s["__key__"], s["bin"]) for s in samples
    ]


def test_shardwriter_patterns():
    assert shard_name("out-%06d.tar", 7) == "out-000007.tar"
    assert shard_name("out-{shard:06d}.tgz", 7) == "out-000007.tgz"
    assert shard_name("out-{}.tar", 3) == "out-3.tar"
    with pytest.raises(ValueError, match="shard number"):
        shard_name("out.tar", 1)
    with pytest.raises(ValueError):
        ShardWriter("out.tar")
    with pytest.raises(ValueError):
        ShardWriter("o-%d.tar", maxcount=0)
    with pytest.raises(ValueError):
        ShardWriter("o-%d.tar", maxsize=0)
    with pytest.raises(ValueError):
        ShardWriter("o-%d.tar", maxsize="lots")


def test_shardwriter_maxsize_string(tmp_path):
    assert ShardWriter(str(tmp_path / "o-%d.tar"), maxsize="1GB").maxsize == 10**9
    assert ShardWriter(str(tmp_path / "o-%d.tar"), maxsize="2KiB").maxsize == 2048
    samples = sized_samples(6, [1500])
    with ShardWriter(str(tmp_path / "s-%02d.tar"), maxsize="6KB") as sw:
        for s in samples:
            sw.write(s)
    # each sample takes 512 + 1536 bytes: two fit in 6000 bytes with the end marker, three do not
    assert [info.count for info in sw.shards] == [2, 2, 2]


def test_shardwriter_compressed_and_post(tmp_path):
    posted = []
    samples = sized_samples(7, [100, 5000])
    with ShardWriter(
        str(tmp_path / "z-{shard:03d}.tar.zst"), maxcount=3, post=posted.append, start_shard=5
    ) as sw:
        for s in samples:
            sw.write(s)
    assert [os.path.basename(p) for p in posted] == [
        "z-005.tar.zst",
        "z-006.tar.zst",
        "z-007.tar.zst",
    ]
    got = read_dir(tmp_path, "*.tar.zst")
    assert [s["bin"] for s in got] == [s["bin"] for s in samples]


def test_shardwriter_exception_leaves_no_partial_shard(tmp_path):
    samples = sized_samples(5, [10])
    with pytest.raises(RuntimeError), ShardWriter(str(tmp_path / "x-%03d.tar"), maxcount=2) as sw:
        for s in samples:
            sw.write(s)
        raise RuntimeError("boom")
    # the two complete shards are committed; the open one vanished with its temp file
    assert sorted(os.listdir(tmp_path)) == ["x-000.tar", "x-001.tar"]
    assert [i.count for i in sw.shards] == [2, 2]


def test_shardwriter_bad_sample_leaves_no_partial_shard(tmp_path):
    with pytest.raises(ValueError), ShardWriter(str(tmp_path / "x-%03d.tar")) as sw:
        sw.write({"__key__": "ok", "txt": "x"})
        sw.write({"__key__": "bad.key", "txt": "x"})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# upstream webdataset
# ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # upstream leaves its file open
@pytest.mark.parametrize("suffix", [".tar", ".tgz"])
def test_reads_upstream_webdataset_shards(tmp_path, suffix):
    wds = pytest.importorskip("webdataset")
    samples = [
        {
            "__key__": f"dir/sample{i:05d}",
            "jpg": os.urandom(100 + i * 50),
            "cls": str(i).encode(),
            "json": b'{"i": %d}' % i,
            "seg.png": b"png" * i,
        }
        for i in range(30)
    ]
    samples.append({"__key__": "x" * 150, "txt": b"long key"})
    path = tmp_path / f"up{suffix}"
    with wds.TarWriter(str(path)) as w:
        for s in samples:
            w.write(s)
    got = list(shard_samples(str(path)))
    assert [(s["__key__"], fields(s)) for s in got] == [(s["__key__"], fields(s)) for s in samples]
    # and upstream reads ours
    ours = write(tmp_path / f"ours{suffix}", samples)
    theirs = list(wds.WebDataset(str(ours), shardshuffle=False))
    assert [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in theirs
    ] == [(s["__key__"], fields(s)) for s in samples]


def test_upstream_shardwriter_shards(tmp_path):
    wds = pytest.importorskip("webdataset")
    samples = sized_samples(12, [100, 2000])
    with wds.ShardWriter(str(tmp_path / "u-%03d.tar"), maxcount=5, verbose=0) as sw:
        for s in samples:
            sw.write(s)
    assert [(s["__key__"], s["bin"]) for s in read_dir(tmp_path)] == [
        (s["__key__"], s["bin"]) for s in samples
    ]


def test_reader_chunk_size_edges(tmp_path):
    samples = sized_samples(6, [0, 1, 511, 512, 513, 5000])
    path = write(tmp_path / "e.tar", samples)
    for cs in (1, 511, 512, 513, 1 << 20):
        with open(path, "rb") as f:
            got = [(n, d) for n, d, _ in iter_tar(read_chunks(f, cs))]
        assert got == [(f"{s['__key__']}.bin", s["bin"]) for s in samples]


# ---------------------------------------------------------------------------------------------
# header fields that do not fit (issue 10, defect 4): never truncated, C and Python equal
# ---------------------------------------------------------------------------------------------

from tarshards import tario  # noqa: E402
from tarshards.errors import EncodeError  # noqa: E402

_names = st.one_of(
    st.from_regex(r"[a-z0-9_/]{1,130}\.[a-z]{1,4}", fullmatch=True),
    st.text(min_size=1, max_size=60).filter(lambda t: "\0" not in t).map(lambda t: t + ".txt"),
    st.binary(min_size=1, max_size=40)
    .filter(lambda b: b"\0" not in b)
    .map(lambda b: b.decode("utf-8", "surrogateescape") + ".bin"),
)


def _write_members(members, mtime, mode, accelerate):
    buf = io.BytesIO()
    w = tario.TarMemberWriter(buf, mtime=mtime, mode=mode)
    n = w.add_all(members, accelerate=accelerate)
    w.finish()
    assert n + 1024 == len(buf.getvalue())
    return buf.getvalue()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_names, st.binary(max_size=700)), max_size=6),
    st.one_of(
        st.integers(0, 2**33 - 1),
        st.integers(2**33 - 3, 2**33 + 3),
        st.integers(-(2**70), 2**70),
        st.just(1_700_000_000_123),
    ),
    st.one_of(st.sampled_from([0o444, 0o644]), st.integers(-3, 2**21 + 3)),
)
def test_header_fields_c_equals_python_and_never_truncate(members, mtime, mode):
    fits = 0 <= mtime < 8**11 and 0 <= mode < 8**7
    outs = []
    for accelerate in (True, False):
        if not fits:
            with pytest.raises(EncodeError, match=r"mtime|mode"):
                _write_members(members, mtime, mode, accelerate)
            continue
        outs.append(_write_members(members, mtime, mode, accelerate))
    if not fits:
        return
    assert outs[0] == outs[1]
    raw = outs[0]
    assert len(raw) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(raw), errors="surrogateescape") as tf:
        got = [(m.name, m.mtime, m.mode, tf.extractfile(m).read()) for m in tf.getmembers()]
    assert got == [(n, mtime, mode, d) for n, d in members]
    assert [(n, d) for n, d, _ in iter_tar(iter([raw]))] == [(n, d) for n, d in members]


def test_c_header_writer_stops_at_fields_that_do_not_fit():
    if tario._ustar_parts is None:
        pytest.skip("the C extension is not built")
    members = [("a.txt", b"x"), ("b\0c.txt", b"y")]
    for mtime, mode in ((8**11, 0o444), (-1, 0o444), (0, 8**7), (0, -1)):
        parts = []
        assert tario._ustar_parts(parts, members, 0, mtime, mode) == (0, 0)
        assert parts == []
    parts = []
    assert tario._ustar_parts(parts, members, 0, 0, 0o444) == (1024, 1)  # stops at the NUL
    # the one-buffer writer takes plain members only, and all of them, or nothing
    sample = tario.writer._tar_sample
    for mtime, mode in ((8**11, 0o444), (-1, 0o444), (0, 8**7), (0, -1)):
        assert sample(members[:1], mtime, mode, 1 << 20) is None
    assert sample(members, 0, 0o444, 1 << 20) is None  # the NUL
    assert sample([("a.txt", bytearray(b"x"))], 0, 0o444, 1 << 20) is None  # not bytes
    assert sample([("\u00e9.txt", b"x")], 0, 0o444, 1 << 20) is None  # a pax header
    assert sample([("a.txt", b"x" * 600)], 0, 0o444, 1535) is None  # over max_size
    got = sample([("a.txt", b"x" * 600)], 0, 0o444, 1536)
    header = tario.TarMemberWriter(io.BytesIO())._template.header(b"a.txt", 600)  # Python's
    assert got == header + b"x" * 600 + bytes(424)


@pytest.mark.parametrize("mtime", [1_700_000_000_000, 8**11, -1, 2**64])
def test_out_of_range_mtime_raises_encode_error(tmp_path, mtime):
    with pytest.raises(EncodeError, match=f"mtime={mtime} does not fit"):
        TarWriter(str(tmp_path / "a.tar"), mtime=mtime)
    with pytest.raises(EncodeError, match="mtime"):
        tario.tar_header("a.txt", 1, mtime=mtime)
    assert os.listdir(tmp_path) == []
    with pytest.raises(EncodeError, match="milliseconds"):
        TarWriter(io.BytesIO(), mtime=1_700_000_000_000)


def test_float_mtime_is_whole_seconds_and_largest_mtime_fits(tmp_path):
    path = write(tmp_path / "f.tar", [{"__key__": "k", "txt": b"x"}], mtime=1_700_000_000.75)
    with tarfile.open(path) as tf:
        assert tf.getmembers()[0].mtime == 1_700_000_000
    path = write(tmp_path / "g.tar", [{"__key__": "k", "txt": b"x"}], mtime=8**11 - 1)
    raw = path.read_bytes()
    assert len(raw) == 2048 and raw[136:148] == b"77777777777\0"
    with tarfile.open(path) as tf:
        assert tf.getmembers()[0].mtime == 8**11 - 1


def test_huge_size_and_long_names_get_pax_and_whole_blocks():
    hdr = tario.tar_header("a.bin", 8**11 + 5)
    assert len(hdr) == 3 * 512
    assert b"size=8589934597\n" in hdr[512:1024]
    assert tario.header_size("a.bin", 8**11 + 5) == 3 * 512
    for name in ("x" * 101, "é" * 80, "d/" * 100 + "f", "a" * 100):
        h = tario.tar_header(name, 3)
        assert len(h) % 512 == 0 and len(h) == tario.header_size(name, 3)
        members = list(iter_tar(iter([h + b"abc" + bytes(509) + bytes(1024)])))
        assert [(n, d) for n, d, _ in members] == [(name, b"abc")]


def test_names_that_cannot_be_written_raise_encode_error(tmp_path):
    with pytest.raises(EncodeError, match="NUL"):
        tario.tar_header("a\0b.txt", 1)
    with pytest.raises(EncodeError, match="cannot be encoded"):
        tario.tar_header("\ud800.txt", 1)
    w = TarWriter(str(tmp_path / "n.tar"), encoder=False)
    with pytest.raises(EncodeError, match="NUL"):
        w.write_members([("ok.txt", b"1"), ("a\0b.txt", b"2")])
    w.abort()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# pipe: outputs (issue 10, defect 4)
# ---------------------------------------------------------------------------------------------

from tarshards.errors import PipeNotAllowedError, StorageError  # noqa: E402


def test_pipe_output_needs_allow_pipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipeNotAllowedError, match="allow_pipe=True"):
        TarWriter("pipe:gzip > out.tgz")
    with pytest.raises(PipeNotAllowedError, match="allow_pipe=True"):
        ShardWriter("pipe:gzip > out-%02d.tgz")
    assert os.listdir(tmp_path) == []  # no file named 'pipe:gzip > out.tgz', no temporary


@pytest.mark.skipif(shutil.which("gzip") is None, reason="needs gzip")
def test_pipe_output_runs_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    samples = [{"__key__": f"k{i}", "txt": f"t{i}".encode()} for i in range(5)]
    write("pipe:gzip > out.tgz", samples, allow_pipe=True)
    assert sorted(os.listdir(tmp_path)) == ["out.tgz"]
    with tarfile.open(tmp_path / "out.tgz") as tf:  # gzip once, by the command, not twice
        assert [m.name for m in tf.getmembers()] == [f"k{i}.txt" for i in range(5)]
    got = list(shard_samples(str(tmp_path / "out.tgz")))
    assert [fields(s) for s in got] == [fields(s) for s in samples]
    with ShardWriter("pipe:cat > s-%02d.tar", maxcount=2, allow_pipe=True) as sink:
        for s in samples:
            sink.write(s)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("s-")) == [
        "s-00.tar",
        "s-01.tar",
        "s-02.tar",
    ]
    assert [
        s["__key__"]
        for p in ("s-00.tar", "s-01.tar", "s-02.tar")
        for s in shard_samples(str(tmp_path / p))
    ] == [s["__key__"] for s in samples]


def test_pipe_output_failing_command_raises(tmp_path):
    with pytest.raises(StorageError, match="status 3"):
        write("pipe:cat > /dev/null; exit 3", [{"__key__": "a", "txt": b"x"}], allow_pipe=True)
    w = TarWriter(f"pipe:cat > {tmp_path}/never.tar; exit 0", allow_pipe=True)
    w.write({"__key__": "a", "txt": b"x"})
    w.abort()  # kills the command; nothing to commit


# ---------------------------------------------------------------------------------------------
# temporary files: owned, locked, removed when their writer died (issue 10, defect 5)
# ---------------------------------------------------------------------------------------------

import sys  # noqa: E402
import time  # noqa: E402

from tarshards.storage import atomic  # noqa: E402


def tmp_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


_HOLD = """
import sys
from tarshards import TarWriter
w = TarWriter(sys.argv[1])
w.write({"__key__": "a", "bin": b"x" * 100000})
print("ready", flush=True)
sys.stdin.readline()
w.write({"__key__": "b", "bin": b"y" * 1000})
w.close()
"""


def hold_writer(path):
    """A writer in another process, stopped in the middle of its shard until told to go on."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_temporary_name_names_its_owner(tmp_path):
    w = TarWriter(str(tmp_path / "a.tar"))
    (name,) = tmp_files(tmp_path)
    m = atomic._TEMP_RE.fullmatch(name)
    assert m and m["base"] == "a.tar" and int(m["pid"]) == os.getpid()
    assert not atomic.is_stale_temporary(str(tmp_path / name))  # our own, and locked
    w.close()
    assert os.listdir(tmp_path) == ["a.tar"]


def test_a_live_writers_temporary_is_kept_and_a_dead_ones_removed(tmp_path):
    live = hold_writer(tmp_path / "live.tar")
    dead = hold_writer(tmp_path / "dead.tar")
    try:
        dead.kill()
        dead.wait()
        assert len(tmp_files(tmp_path)) == 2
        # another writer into the same directory: removes the dead one's temporary only
        with ShardWriter(str(tmp_path / "other-%02d.tar"), maxcount=1) as sink:
            sink.write({"__key__": "o", "txt": b"1"})
        (left,) = tmp_files(tmp_path)
        assert left.startswith(".live.tar.")
        write(tmp_path / "more.tar", [{"__key__": "m", "txt": b"2"}])  # TarWriter: same
        assert tmp_files(tmp_path) == [left]
        _out, _ = live.communicate("go\n", timeout=60)
        assert live.returncode == 0
    finally:
        for p in (live, dead):
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert tmp_files(tmp_path) == []
    assert [s["__key__"] for s in shard_samples(str(tmp_path / "live.tar"))] == ["a", "b"]
    assert not (tmp_path / "dead.tar").exists()


def test_stale_rules_for_reused_pids_and_other_hosts(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        start = atomic._process_start(sleeper.pid)
        host = atomic._host_tag()
        other = "0" * 8 if host != "0" * 8 else "1" * 8
        names = {
            "alive": f".x.tar.{sleeper.pid}-{host}-{start}-00000001.tmp",
            "reused": f".x.tar.{sleeper.pid}-{host}-{start + 1 if start else 0}-00000002.tmp",
            "far_fresh": f".x.tar.123-{other}-5-00000003.tmp",
            "far_old": f".x.tar.123-{other}-5-00000004.tmp",
            "far_locked": f".x.tar.123-{other}-5-00000005.tmp",
            "not_ours": ".x.tar.abcdef12.tmp",
        }
        for n in names.values():
            (tmp_path / n).write_bytes(b"partial")
        old = time.time() - atomic.STALE_AFTER - 10
        for key in ("far_old", "far_locked"):
            os.utime(tmp_path / names[key], (old, old))
        import fcntl

        with open(tmp_path / names["far_locked"], "rb") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            removed = atomic.remove_stale_temporaries(str(tmp_path))
        expect_removed = {"far_old"} | ({"reused"} if start else set())
        assert sorted(os.path.basename(p) for p in removed) == sorted(
            names[k] for k in expect_removed
        )
        assert sorted(os.listdir(tmp_path)) == sorted(
            n for k, n in names.items() if k not in expect_removed
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    # the sleeper is gone now: its temporaries are stale
    atomic.remove_stale_temporaries(str(tmp_path))
    assert names["alive"] not in os.listdir(tmp_path)


def test_commit_fsyncs_before_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("rename"), real_replace(a, b))[1])
    write(tmp_path / "f.tar", [{"__key__": "a", "txt": b"x"}])
    assert calls == ["fsync", "rename", "fsync"]  # the file, the rename, the directory


_keys = st.one_of(
    st.sampled_from(["k", "d/k0", "a/b/c", "", ".", "a.b", "d/__k", "__k", "d/", "d/.x"]),
    st.text(max_size=12),
    st.integers(),
)
_exts = st.one_of(
    st.sampled_from(["jpg", "cls", "txt", "json", "gz", "t.GZ", "__meta__", "", "a/b", "x.y"]),
    st.text(max_size=6),
)
_values = st.one_of(
    st.none(),
    st.binary(max_size=40),
    st.text(max_size=20),
    st.binary(max_size=10).map(bytearray),
    st.binary(max_size=10).map(memoryview),
    st.integers(-5, 10**6),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.just("lone \udc80 surrogate"),
    st.builds(object),
)


def _outcome(fn, sample, encoder):
    try:
        return fn(sample, encoder)
    except Exception as exc:  # noqa: BLE001 - compared: the same error, the same message
        return (type(exc), str(exc))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_keys, st.dictionaries(_exts, _values, max_size=5), st.booleans())
def test_c_sample_members_equal_python(key, fields, encoder):
    from tarshards.write import writer as writer_mod

    if writer_mod._c_sample_members is None:
        pytest.skip("the C accelerator is not built")
    sample = {"__key__": key, **fields}
    got = _outcome(writer_mod.sample_members, sample, encoder)
    want = _outcome(writer_mod._sample_members_py, sample, encoder)
    assert got == want
    if isinstance(got, list):
        assert all(type(n) is str and type(d) is bytes for n, d in got)


def test_c_sample_members_declines_what_python_decides():
    from tarshards import _speedups
    from tarshards.codecs.registry import encode_value
    from tarshards.write.writer import sample_members as writer_sample_members

    if not hasattr(_speedups, "sample_members"):
        pytest.skip("the C accelerator is not built")

    class Sub(dict):
        pass

    for sample in (
        Sub(__key__="k", txt="x"),  # a dict subclass
        {"__key__": "k"},  # no member
        {"__key__": "k", 3: b"x"},  # a field that is not a str
        {"__key__": "a.b", "txt": "x"},  # a dot in the key's base name
    ):
        assert _speedups.sample_members(sample, True, encode_value) is None
    calls = []

    def encode(value, ext):  # what an encoder returns is taken as it is, after one call
        calls.append(ext)
        return bytearray(b"v")

    got = _speedups.sample_members({"__key__": "k", "cls": 3, "txt": "t"}, True, encode)
    assert got == [("k.cls", bytearray(b"v")), ("k.txt", b"t")] and calls == ["cls"]

    sample = {"__key__": "".join(["ke", "y"]), "cls": 1, "txt": 2, "zzz": b"c"}

    def meddling(value, ext):  # changes the sample under the C loop: its key, a later field
        sample["__key__"] = "".join(["other", "-key"])
        sample.pop("txt", None)
        return b"%d" % value

    got = _speedups.sample_members(sample, True, meddling)
    assert got is None  # a field gone: the Python function decides
    assert writer_sample_members(sample) == [("other-key.cls", b"1"), ("other-key.zzz", b"c")]


def test_writing_with_a_manifest_does_not_import_numpy(tmp_path):
    """A converting script (ints, dicts, str and bytes fields) that records a manifest never
    imports numpy: indexes built in C, class labels encoded without it (numpy and its BLAS
    threads cost ~0.1 s of a process's start)."""
    from tarshards.format import index as index_mod

    if index_mod._index_columns is None:
        pytest.skip("the C accelerator is not built (indexes are then built with numpy)")
    code = (
        "import sys\n"
        "from tarshards import ShardWriter\n"
        f"with ShardWriter({str(tmp_path / 'w-%03d.tar')!r}, maxcount=7, "
        f"manifest={str(tmp_path / 'm.json')!r}) as w:\n"
        "    for i in range(20):\n"
        "        w.write({'__key__': f's{i}', 'cls': i, 'json': {'i': i}, 'txt': 'x',\n"
        "                 'bin': b'y'})\n"
        "print('numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"
    from tarshards import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "m.json"))
    assert len(ds) == 20 and int(bytes(ds[13]["cls"])) == 13


# ---- AtomicOutput.write_behind: a file written by a thread of its own, committed later ----------


def _temporaries(folder):
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


@pytest.mark.parametrize("thread", [True, False])
def test_write_behind_appears_under_its_name_only_at_commit(tmp_path, monkeypatch, thread):
    from tarshards.storage import AtomicOutput, atomic

    if not thread:  # the C accelerator not built: written at once, committed as well
        monkeypatch.setattr(atomic, "_WriteBehind", None)
    elif atomic._WriteBehind is None:
        pytest.skip("the C accelerator is not built")
    target = tmp_path / "f.bin"
    parts = [b"head", memoryview(b"x" * 300_000), bytearray(b"tail"), b""]
    out = AtomicOutput(str(target))
    out.write_behind(parts)
    assert not target.exists() and len(_temporaries(tmp_path)) == 1
    out.commit()
    assert target.read_bytes() == b"head" + b"x" * 300_000 + b"tail"
    assert _temporaries(tmp_path) == []
    out.commit()  # idempotent

    out = AtomicOutput(str(tmp_path / "g.bin"))
    out.write_behind([b"discarded"])
    out.abort()
    assert not (tmp_path / "g.bin").exists() and _temporaries(tmp_path) == []


def test_write_behind_error_is_raised_at_commit_naming_the_file(tmp_path):
    """A write that fails on the thread (here a file size limit: EFBIG) is raised by commit(),
    with the output's name, and leaves neither the file nor its temporary."""
    script = f"""
import os, resource, signal, sys
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..", "..", "src")!r})
from tarshards.storage import AtomicOutput
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
out = AtomicOutput({str(tmp_path / "big.bin")!r})
out.write_behind([b"y" * 10_000])
try:
    out.commit()
except OSError as exc:
    print("raised", exc.errno, exc.filename)
"""
    import errno
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["raised", str(errno.EFBIG), str(tmp_path / "big.bin")]
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_write_behind_refuses_a_forked_child(tmp_path):
    _speedups = pytest.importorskip("tarshards._speedups")
    fd = os.open(tmp_path / "f.bin", os.O_WRONLY | os.O_CREAT)
    job = _speedups.WriteBehind(fd, 0, [b"abc" * 1000], str(tmp_path / "f.bin"))
    assert refused_in_forked_child(job.wait)  # the thread is not in the child: no hang
    job.wait()  # the parent's thread is unharmed
    os.close(fd)
    assert (tmp_path / "f.bin").read_bytes() == b"abc" * 1000


def test_shardwriter_indexes_are_saved_before_post_and_kept_on_abort(tmp_path):
    """With manifest=, a shard's index is written behind; post still sees it under its name,
    and an abort keeps the committed shards' indexes (and leaves no temporaries)."""
    from tarshards.format.index import ShardIndex
    from tarshards.format.manifest import index_path_for

    seen = []

    def post(name):
        index = tmp_path / index_path_for(os.path.basename(name))
        seen.append((os.path.basename(name), ShardIndex.load(str(index)).num_samples))

    with pytest.raises(RuntimeError, match="stop"):
        with ShardWriter(
            str(tmp_path / "p-%03d.tar"), maxcount=3, manifest=tmp_path / "m.json", post=post
        ) as w:
            for i in range(8):
                w.write({"__key__": f"k{i}", "txt": b"t" * i})
            raise RuntimeError("stop")
    assert seen == [("p-000.tar", 3), ("p-001.tar", 3)]
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "p-002.tar").exists()

    with pytest.raises(RuntimeError, match="stop"):
        with ShardWriter(
            str(tmp_path / "q-%03d.tar"), maxcount=3, manifest=tmp_path / "n.json"
        ) as w:
            for i in range(5):
                w.write({"__key__": f"k{i}", "txt": b"t" * i})
            raise RuntimeError("stop")
    got = ShardIndex.load(str(tmp_path / index_path_for("q-000.tar")))
    assert got.num_samples == 3 and got.hash.startswith("xxh3_64:")
    assert not (tmp_path / index_path_for("q-001.tar")).exists()
    for folder, _, names in os.walk(tmp_path):
        assert [n for n in names if n.endswith(".tmp")] == [], folder
