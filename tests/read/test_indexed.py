"""Random access through the manifest: ``ds[i]`` equals the i-th sample of a sequential read, for
shards written by tarfile (ustar/gnu/pax), GNU tar and ShardWriter, plain, gzip and zstd; exact
``len()``; IndexedDataset in a real DataLoader and with DistributedSampler."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import io
import lzma
import os
import pickle
import subprocess
import tarfile
import tempfile
import warnings

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tarshards import IntegrityError, ShardFormatError, ShardWriter, TarshardsWarning, WebDataset
from tarshards.format.manifest import Manifest, build_manifest
from tarshards.pipeline.dataset import iter_samples
from tarshards.read import indexed as indexed_mod
from tarshards.read.indexed import IndexedDataset

HAVE_INDEXED_GZIP = importlib.util.find_spec("indexed_gzip") is not None

_EXTS = ["jpg", "cls", "json", "seg.png", "txt"]


@st.composite
def datasets(draw):
    n = draw(st.integers(1, 12))
    samples = []
    for i in range(n):
        where = draw(st.sampled_from(["", "dir/", "d" * 120 + "/", "a/b/"]))
        key = f"{where}k{i:03d}" + draw(st.sampled_from(["", "_" + "x" * 40]))
        exts = draw(st.lists(st.sampled_from(_EXTS), min_size=1, max_size=3, unique=True))
        fields = {e: draw(st.binary(max_size=1500)) for e in exts}
        samples.append((key, fields))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=2)))
    shards, start = [], 0
    for c in cuts + [n]:
        if c > start:
            shards.append(samples[start:c])
            start = c
    return shards


def _write_tar(path: str, samples, writer: str) -> None:
    members = [(f"{key}.{ext}", data) for key, fields in samples for ext, data in fields.items()]
    if writer.startswith("tarfile"):
        fmt = {
            "tarfile-ustar": tarfile.USTAR_FORMAT,
            "tarfile-gnu": tarfile.GNU_FORMAT,
            "tarfile-pax": tarfile.PAX_FORMAT,
        }[writer]
        with tarfile.open(path, "w", format=fmt) as tf:
            for name, data in members:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                ti.mtime = 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))
        return
    # GNU tar over a directory of files, in our member order
    with tempfile.TemporaryDirectory() as src:
        for name, data in members:
            os.makedirs(os.path.join(src, os.path.dirname(name)), exist_ok=True)
            with open(os.path.join(src, name), "wb") as f:
                f.write(data)
        fmt = writer.split("-", 1)[1]
        subprocess.run(
            [
                "tar",
                f"--format={fmt}",
                "--no-recursion",
                "-cf",
                path,
                "-C",
                src,
                *[n for n, _ in members],
            ],
            check=True,
            capture_output=True,
        )


def _compress(path: str, compression: str) -> str:
    if compression == "none":
        return path
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    if compression == "gz":
        out = path + ".gz"
        with gzip.open(out, "wb") as g:
            g.write(data)
    elif compression == "bz2":  # bzip2 and xz as GNU tar -j / -J write them (one stream)
        out = path + ".bz2"
        with open(out, "wb") as f:
            f.write(bz2.compress(data))
    elif compression == "xz":
        out = path + ".xz"
        with open(out, "wb") as f:
            f.write(lzma.compress(data, format=lzma.FORMAT_XZ))
    else:
        out = path + ".zst"
        with open(out, "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(data))
    return out


def _check_random_access(manifest: Manifest, expect_seekable: bool | None = None):
    urls = manifest.shard_urls()
    seq = list(iter_samples(urls))
    ds = WebDataset(manifest)
    assert len(ds) == len(seq) == manifest.num_samples
    ids = IndexedDataset(manifest)
    assert len(ids) == len(seq)
    indexes = [manifest.load_index(i) for i in range(len(urls))]
    # a shard compressed as one stream is read through seek points (a .tgz, with indexed_gzip)
    # or a decompressed copy, which warns
    copied = not all(
        ix.seekable or (ix.compression == "gzip" and HAVE_INDEXED_GZIP) for ix in indexes
    )
    if expect_seekable is not None:
        assert all(ix.seekable for ix in indexes) == expect_seekable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, want in enumerate(seq):
            assert ids[i] == want, i
        assert ids[-1] == seq[-1]
    said = [w for w in caught if "compressed as one stream" in str(w.message)]
    assert bool(said) == copied


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shards=datasets(),
    writer=st.sampled_from(
        ["tarfile-ustar", "tarfile-gnu", "tarfile-pax", "gnutar-gnu", "gnutar-pax"]
    ),
    compression=st.sampled_from(["none", "gz", "zst", "bz2", "xz"]),
)
def test_foreign_shards_random_access_equals_sequential(shards, writer, compression):
    with tempfile.TemporaryDirectory() as d:
        urls = []
        for s, samples in enumerate(shards):
            path = os.path.join(d, f"part-{s:03d}.tar")
            _write_tar(path, samples, writer)
            urls.append(_compress(path, compression))
        m = build_manifest(urls, os.path.join(d, "manifest.json"), workers=1)
        assert [r.samples for r in m.shards] == [len(s) for s in shards]
        _check_random_access(Manifest.load(os.path.join(d, "manifest.json")))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shards=datasets(),
    compression=st.sampled_from(["none", "gz", "zst", "bz2", "xz"]),
    aligned=st.booleans(),
    maxcount=st.integers(1, 6),
)
def test_shardwriter_manifest_equals_index_command(shards, compression, aligned, maxcount):
    samples = [s for shard in shards for s in shard]
    suffix = {
        "none": ".tar",
        "gz": ".tar.gz",
        "zst": ".tar.zst",
        "bz2": ".tar.bz2",
        "xz": ".tar.xz",
    }[compression]
    with tempfile.TemporaryDirectory() as d:
        with ShardWriter(
            os.path.join(d, "out-%04d" + suffix),
            maxcount=maxcount,
            manifest=os.path.join(d, "written.json"),
            aligned=aligned,
            encoder=False,
        ) as w:
            for key, fields in samples:
                w.write({"__key__": key, **fields})
        written = Manifest.load(os.path.join(d, "written.json"))
        assert written == w.manifest
        indexed = build_manifest(written.shard_urls(), os.path.join(d, "indexed.json"), workers=1)
        assert indexed == written
        assert indexed.fingerprint == written.fingerprint
        for i in range(len(written)):
            assert indexed.load_index(i) == written.load_index(i)
        # plain and aligned shards are always seekable (bzip2 and xz are written as one stream
        # even when aligned: Python's tarfile reads only the first); others only by chance
        # (one sample)
        seekable = compression == "none" or (aligned and compression in ("gz", "zst"))
        _check_random_access(written, expect_seekable=True if seekable else None)


def _manifest(tmp_path, n=40, maxcount=9, suffix=".tar", **kw):
    with ShardWriter(
        str(tmp_path / f"s-%03d{suffix}"),
        maxcount=maxcount,
        manifest=str(tmp_path / "m.json"),
        **kw,
    ) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:04d}", "txt": f"sample {i}" * (i % 7), "cls": i % 10})
    return w.manifest


def test_errors_and_indexing(tmp_path):
    m = _manifest(tmp_path)
    ds = IndexedDataset(str(tmp_path / "m.json"))
    assert len(ds) == 40
    assert ds[39]["__key__"] == ds[-1]["__key__"] == "k0039"
    assert [s["__key__"] for s in ds[3:6]] == ["k0003", "k0004", "k0005"]
    import numpy as np

    assert ds[np.int64(7)]["__key__"] == "k0007"
    with pytest.raises(IndexError):
        ds[40]
    with pytest.raises(TypeError):
        ds["a"]
    assert ds.locate(9) == (1, 0)
    assert repr(ds).startswith("IndexedDataset(40 samples in 5 shards")
    again = pickle.loads(pickle.dumps(ds))
    assert again[12] == ds[12]
    ds.close()
    assert m.num_samples == 40


@pytest.mark.parametrize("accelerate", [True, False])
def test_upper_case_extensions_are_keyed_as_the_reader_keys_them(tmp_path, monkeypatch, accelerate):
    """The index keeps an extension as written ("JPG", "Txt.GZ", "Ünï"); ds[i] keys it as the
    reader does (lower-cased), on the C path and the Python path."""
    if not accelerate:
        monkeypatch.setattr(indexed_mod, "_read_sample", None)
    path = tmp_path / "upper.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in (("a.JPG", b"x"), ("a.Cls", b"1"), ("b.Txt.GZ", b"y"), ("c.Ünï", b"z")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    build_manifest([str(path)], str(tmp_path / "m.json"))
    ds = IndexedDataset(str(tmp_path / "m.json"))
    assert [ds[i] for i in range(len(ds))] == list(iter_samples([str(path)]))
    assert sorted(ds[0]) == ["__key__", "__offset__", "__url__", "cls", "jpg"]


def test_decode_and_transform(tmp_path):
    _manifest(tmp_path)
    ds = IndexedDataset(
        str(tmp_path / "m.json"), decode="rgb8", transform=lambda s: (s["txt"], s["cls"])
    )
    assert ds[3] == ("sample 3" * 3, 3)
    with pytest.raises(ValueError, match="unknown decoding mode"):
        IndexedDataset(str(tmp_path / "m.json"), decode="nonsense")


def test_verify_names_the_member(tmp_path):
    m = _manifest(tmp_path)
    idx = m.load_index(2)
    url = m.shard_urls()[2]
    at = int(idx.member_data_offsets[5])  # a txt member's first data byte
    with open(url, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x20]))
    plain = IndexedDataset(m)
    s = 2 * 9 + int(idx.member_sample[5])
    assert plain[s]["__key__"] == f"k{s:04d}"  # without verify, the changed byte is not seen
    ds = IndexedDataset(m, verify=True)
    for i in range(len(ds)):
        if i != s:
            ds[i]
    with pytest.raises(IntegrityError, match="checksum") as e:
        ds[s]
    assert e.value.url == url and e.value.member == f"k{s:04d}.txt"


@pytest.mark.parametrize("accelerate", [True, False])
def test_index_for_another_shard_is_refused(tmp_path, monkeypatch, accelerate):
    if not accelerate:  # the header check in Python (the C one only says "sound" or "ask")
        monkeypatch.setattr(indexed_mod, "_header_ok", None)
        monkeypatch.setattr(indexed_mod, "_read_sample", None)
    m = _manifest(tmp_path)
    url = m.shard_urls()[1]
    with ShardWriter(url.replace("001", "%03d"), start_shard=1, maxcount=100) as w:
        for i in range(9):
            w.write({"__key__": f"other{i}", "txt": "z" * i, "cls": 0})
    ds = IndexedDataset(m)
    with pytest.raises(ShardFormatError):
        for i in range(9, 18):
            ds[i]


def test_without_the_c_extension_samples_are_the_same(tmp_path, monkeypatch):
    m = _manifest(tmp_path)
    with IndexedDataset(m, verify=True) as ds:
        fast = [ds[i] for i in range(len(ds))]
    monkeypatch.setattr(indexed_mod, "_header_ok", None)
    monkeypatch.setattr(indexed_mod, "_read_sample", None)
    with IndexedDataset(m, verify=True) as ds:
        assert [ds[i] for i in range(len(ds))] == fast
        assert [ds[i] for i in range(len(ds) - 1, -1, -1)] == fast[::-1]
    assert fast == list(iter_samples(m.shard_urls()))


@pytest.mark.parametrize("compression", ["zst", "bz2", "xz"])
def test_one_stream_shard_read_at_random_from_a_decompressed_copy(tmp_path, compression):
    """A shard compressed as one stream (GNU tar --zstd, -j, -J) is decompressed once, into a
    file of the process's that is unlinked at once (nothing left behind), with a warning that
    names the shard and says what to do; every ds[i] then equals the sequential read."""
    samples = [(f"k{i}", {"txt": os.urandom(700 * i), "cls": b"%d" % i}) for i in range(12)]
    path = str(tmp_path / "a.tar")
    _write_tar(path, samples, "tarfile-pax")
    one = _compress(path, compression)
    m = build_manifest([one], str(tmp_path / "m.json"), workers=1)
    seq = list(iter_samples([one]))
    spare = tmp_path / "spare"  # made when first needed
    with IndexedDataset(m, cache_dir=str(spare)) as ds:
        with pytest.warns(
            TarshardsWarning, match=r"a\.tar\.\w+: .*compressed as one stream.*aligned"
        ):
            assert ds[5] == seq[5]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per shard and process
            assert [ds[i] for i in reversed(range(len(ds)))] == seq[::-1]
        assert list(spare.iterdir()) == []  # the copy was unlinked when made


@pytest.mark.skipif(not HAVE_INDEXED_GZIP, reason="indexed_gzip is not installed")
def test_foreign_tgz_through_gzip_seek_points(tmp_path):
    samples = [(f"k{i}", {"txt": os.urandom(3000 * i)}) for i in range(30)]
    path = str(tmp_path / "a.tar")
    _write_tar(path, samples, "tarfile-gnu")
    tgz = _compress(path, "gz")
    m = build_manifest([tgz], str(tmp_path / "m.json"), workers=1)
    ds = IndexedDataset(m)
    seq = list(iter_samples([tgz]))
    for i in reversed(range(len(seq))):
        assert ds[i] == seq[i]


def test_parallel_index_command_and_cli(tmp_path):
    m = _manifest(tmp_path, n=30, maxcount=5)
    built = build_manifest(m.shard_urls(), str(tmp_path / "again.json"), workers=2, progress=False)
    assert built == m
    from click.testing import CliRunner

    from tarshards.cli.main import group

    res = CliRunner().invoke(
        group,
        ["index", "-q", "--dali", str(tmp_path / "s-*.tar"), "-o", str(tmp_path / "cli.json")],
    )
    assert res.exit_code == 0, res.output
    assert Manifest.load(str(tmp_path / "cli.json")) == m
    dali = (tmp_path / "s-000.tar.idx").read_text().splitlines()
    assert dali[0] == "v1.2 5" and dali[1].startswith("cls ")
    res = CliRunner().invoke(
        group, ["index", "-q", str(tmp_path / "missing.tar"), "-o", str(tmp_path / "x.json")]
    )
    assert res.exit_code == 1 and "missing.tar" in res.output


torch = pytest.importorskip("torch", reason="the DataLoader tests need torch")


def test_dataloader_shuffle_two_workers(tmp_path):
    from torch.utils.data import DataLoader

    import tarshards

    _manifest(tmp_path, n=50)
    ds = tarshards.IndexedDataset(
        str(tmp_path / "m.json"), transform=lambda s: (s["__key__"], int(s["cls"]))
    )
    assert isinstance(ds, torch.utils.data.Dataset)
    loader = DataLoader(
        ds, batch_size=8, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0)
    )
    assert len(loader) == 7
    keys, labels = [], []
    for k, c in loader:
        keys.extend(k)
        labels.extend(c.tolist())
    assert sorted(keys) == [f"k{i:04d}" for i in range(50)]
    assert keys != sorted(keys)  # shuffled
    assert dict(zip(keys, labels)) == {f"k{i:04d}": i % 10 for i in range(50)}


def test_distributed_sampler_splits_exactly(tmp_path):
    from torch.utils.data import DataLoader, DistributedSampler

    import tarshards

    _manifest(tmp_path, n=42)
    ds = tarshards.IndexedDataset(str(tmp_path / "m.json"), transform=lambda s: s["__key__"])
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=1)
        sampler.set_epoch(2)
        got = [
            k
            for batch in DataLoader(ds, batch_size=5, sampler=sampler, num_workers=1)
            for k in batch
        ]
        assert len(got) == 14
        seen.extend(got)
    assert sorted(seen) == [f"k{i:04d}" for i in range(42)]


def _sparse_file(path: str, chunks: int) -> bytes:
    """A file of ``chunks`` short data runs with 64 KiB holes between them (and a hole at the
    end), written with seeks so that the file system keeps the holes; returns its content."""
    content = bytearray()
    with open(path, "wb") as f:
        for i in range(chunks):
            f.seek(len(content) + (64 << 10))
            content += bytes(64 << 10)
            run = (b"run %03d " % i) * 300
            f.write(run)
            content += run
        f.truncate(len(content) + (64 << 10))
        content += bytes(64 << 10)
    return bytes(content)


@pytest.mark.parametrize(
    "fmt",
    [
        ("--format=gnu",),  # old-GNU 'S' members (30 runs: the map needs extension blocks)
        ("--format=posix", "--sparse-version=0.0"),
        ("--format=posix", "--sparse-version=0.1"),
        ("--format=posix", "--sparse-version=1.0"),
    ],
    ids=["gnu", "pax-0.0", "pax-0.1", "pax-1.0"],
)
def test_gnu_tar_sparse_members_random_access(tmp_path, fmt):
    """GNU tar --sparse stores a map and the data runs, not the content: the index records the
    content's size and checksum and ds[i] rebuilds it (it used to slice the stored runs)."""
    src = tmp_path / "src"
    src.mkdir()
    want = {}
    names = []
    for i in range(3):
        (src / f"s{i}.cls").write_bytes(b"%d" % i)
        want[f"s{i}"] = _sparse_file(str(src / f"s{i}.bin"), chunks=30 if i == 1 else 2)
        names += [f"s{i}.bin", f"s{i}.cls"]
    shard = str(tmp_path / "sparse.tar")
    subprocess.run(
        ["tar", *fmt, "--sparse", "--no-recursion", "-cf", shard, "-C", str(src), *names],
        check=True,
        capture_output=True,
    )
    assert os.path.getsize(shard) < sum(map(len, want.values()))  # stored sparse, really
    manifest = build_manifest([shard], str(tmp_path / "m.json"), workers=1)
    seq = list(iter_samples([shard]))
    assert [s["bin"] for s in seq] == [want[f"s{i}"] for i in range(3)]
    ids = IndexedDataset(str(tmp_path / "m.json"), verify=True)
    assert len(ids) == 3
    for i, s in enumerate(seq):
        assert ids[i] == s
    assert [s["bin"] for s in WebDataset(manifest, verify=True)] == [s["bin"] for s in seq]


def test_large_and_empty_members_read_at_random_equal_a_sequential_read(tmp_path):
    """ds[i] through the one-call C read (a sample larger than its stack buffer, empty members,
    a sample of one member) gives what a sequential read gives."""
    urls = str(tmp_path / "big-%02d.tar")
    with ShardWriter(urls, maxcount=3, manifest=tmp_path / "m.json") as w:
        for i in range(7):
            w.write({"__key__": f"b{i}", "bin": os.urandom(70_000 * (i % 3)), "txt": "t" * i})
        w.write({"__key__": "solo", "bin": b""})
    m = w.manifest
    with IndexedDataset(m) as ds:
        assert [ds[i] for i in (7, 0, 5, 3, 6, 1, 4, 2)] == [
            list(iter_samples(m.shard_urls()))[i] for i in (7, 0, 5, 3, 6, 1, 4, 2)
        ]
