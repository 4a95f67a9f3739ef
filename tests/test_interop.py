"""Every reader reads what we write: each writer mode of tarshards (TarWriter, ShardWriter,
tarsplit, tarscat -o, map_shards; plain, gzip, zstd, bzip2, xz, lz4; sample-aligned or not) read
back by Python's streaming ``tarfile`` (``r|*``, what webdataset, Hugging Face ``datasets`` and Ray
use; where it supports the compression), by a zstd reader that crosses frames, by GNU tar
(``tar -t``, and ``tar -x`` byte for byte) and by webdataset 1.0.2: every member, every sample.

Sample-aligned ``.tgz`` is one gzip member with a flush point per sample
(:class:`tarshards.format.compression.FlushedGzip`); it is also entered at those points by
``IndexedDataset`` and by a mid-epoch resume. Shards of the old layout (a gzip member per sample)
are still read by tarshards, and ``tarcheck`` warns about them.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
import zlib

import pytest
from click.testing import CliRunner

from tarshards import IndexedDataset, ShardWriter, TarWriter, WebDataset
from tarshards.cli import main as cli
from tarshards.format.compression import gzip_layout
from tarshards.format.index import ShardIndex, index_url
from tarshards.pipeline.dataset import shard_samples
from tarshards.storage import read_sample_at, samples_from
from tarshards.testing import write_member_per_sample_gzip

SUFFIX = {
    "plain": ".tar",
    "gz": ".tgz",
    "zst": ".tar.zst",
    "bz2": ".tar.bz2",
    "xz": ".tar.xz",
    "lz4": ".tar.lz4",
}
TARFILE_READS = {"plain", "gz", "bz2", "xz"}  # what Python 3.11's tarfile decompresses
PROGRAM = {"gz": "gzip", "zst": "zstd", "bz2": "bzip2", "xz": "xz", "lz4": "lz4"}
N = 23


def samples(n=N, prefix="s"):
    # sizes across block boundaries, and text that compresses (flush points inside matches)
    return [
        {
            "__key__": f"{prefix}{i:04d}",
            "txt": (f"sample {i} " * (i * 7 + 1)).encode(),
            "cls": str(i % 5).encode(),
            "bin": bytes(range(256)) * (i % 4) + bytes([i]),
        }
        for i in range(n)
    ]


def expected_members(rows):
    return [
        (f"{s['__key__']}.{ext}", s[ext])
        for s in rows
        for ext in sorted(k for k in s if k[0] != "_")
    ]


def run_cli(name, args, input=None):
    cmd, prog = cli.load_command(name), cli.COMMANDS[name][0] or f"tarshards {name}"
    result = CliRunner().invoke(
        cmd, [str(a) for a in args], input=input, prog_name=prog, catch_exceptions=False
    )
    return result


def _need(comp):
    if comp == "lz4":
        pytest.importorskip("lz4.frame", reason="lz4 shards need the lz4 package")


def _to_map_input(tmp_path, rows, parts=2):
    """Plain input shards for the shard map (and tarsplit / tarscat)."""
    paths = []
    per = (len(rows) + parts - 1) // parts
    for j in range(parts):
        p = str(tmp_path / f"in-{j}.tar")
        with TarWriter(p, encoder=False) as w:
            for s in rows[j * per : (j + 1) * per]:
                w.write(s)
        paths.append(p)
    return paths


def _identity(sample):
    return {k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}


def write(tool, comp, aligned, tmp_path, rows):
    """The shard files ``tool`` writes for ``rows``, in order."""
    suffix = SUFFIX[comp]
    out = tmp_path / "out"
    out.mkdir()
    if tool == "TarWriter":
        p = str(out / f"one{suffix}")
        with TarWriter(p, encoder=False, aligned=aligned) as w:
            for s in rows:
                w.write(s)
        return [p]
    if tool == "ShardWriter":
        with ShardWriter(
            str(out / f"part-%03d{suffix}"),
            maxcount=9,
            encoder=False,
            aligned=aligned,
            manifest=str(out / "m.json"),
        ) as w:
            for s in rows:
                w.write(s)
        return [info.url for info in w.shards]
    if tool == "tarsplit":
        src = _to_map_input(tmp_path, rows, parts=1)[0]
        flags = {"plain": [], "gz": ["-z"], "zst": ["--zstd"]}[comp]
        args = [*flags, *(["--aligned"] if aligned else []), "-n", "10", "-q"]
        res = run_cli("split", [*args, "-o", str(out / f"sp-%02d{suffix}"), src])
        assert res.exit_code == 0, res.output
        return sorted(str(out / n) for n in os.listdir(out) if n.endswith(suffix))
    if tool == "tarscat":
        ins = _to_map_input(tmp_path, rows)
        p = str(out / f"cat{suffix}")
        res = run_cli("cat", [*ins, "-o", p, "-q"])
        assert res.exit_code == 0, res.output
        return [p]
    if tool == "map_shards":
        from tarshards.parallel import map_shards

        ins = _to_map_input(tmp_path, rows)
        outs = [str(out / f"mapped-{j}{suffix}") for j in range(len(ins))]
        map_shards(_identity, ins, outs, workers=1, encoder=False, aligned=aligned)
        return outs
    raise AssertionError(tool)


CASES = [
    *(
        pytest.param(tool, comp, aligned, id=f"{tool}-{comp}-{'aligned' if aligned else 'stream'}")
        for tool in ("TarWriter", "ShardWriter", "map_shards")
        for comp in SUFFIX
        for aligned in (False, True)
        if not (aligned and comp == "plain")
    ),
    *(
        pytest.param("tarsplit", comp, aligned, id=f"tarsplit-{comp}-{int(aligned)}")
        for comp in ("plain", "gz", "zst")
        for aligned in (False, True)
        if not (aligned and comp == "plain")
    ),
    *(pytest.param("tarscat", comp, False, id=f"tarscat-{comp}") for comp in SUFFIX),
]


def _tarfile_members(data: bytes, mode: str) -> list[tuple[str, bytes]]:
    got = []
    with tarfile.open(fileobj=io.BytesIO(data), mode=mode) as tf:
        for m in tf:
            if m.isfile():
                got.append((m.name, tf.extractfile(m).read()))
    return got


def _zstd_tar_members(path: str) -> list[tuple[str, bytes]]:
    import zstandard

    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        got = []
        with tarfile.open(fileobj=raw, mode="r|") as tf:
            for m in tf:
                got.append((m.name, tf.extractfile(m).read()))
    return got


def _gnu_tar(path: str, comp: str, dest) -> list[str]:
    prog = PROGRAM.get(comp)
    if shutil.which("tar") is None or (prog is not None and shutil.which(prog) is None):
        pytest.skip(f"GNU tar or {prog} not installed")
    flag = [] if prog is None else ["-I", prog]
    listed = subprocess.run(
        ["tar", *flag, "-tf", path], capture_output=True, check=True, text=True
    ).stdout.split()
    os.makedirs(dest, exist_ok=True)
    subprocess.run(["tar", *flag, "-xf", path, "-C", str(dest)], capture_output=True, check=True)
    return listed


@pytest.mark.parametrize("tool,comp,aligned", CASES)
def test_every_reader_sees_every_member(tool, comp, aligned, tmp_path):
    _need(comp)
    rows = samples()
    paths = write(tool, comp, aligned, tmp_path, rows)
    want = expected_members(rows)
    # 1. Python's streaming tarfile (r|*), shard by shard, where it reads the compression
    if comp in TARFILE_READS:
        got = []
        for p in paths:
            with open(p, "rb") as f:
                got += _tarfile_members(f.read(), "r|*")
        assert got == want
    # 2. zstd: a stream reader that crosses frames, and zstd -dc | tar t
    if comp == "zst":
        got = [m for p in paths for m in _zstd_tar_members(p)]
        assert got == want
        if shutil.which("zstd") is None:
            pytest.skip("the zstd program is not installed (apt-get install zstd)")
        for p in paths:
            pipe = subprocess.run(
                f"zstd -dc {p} | tar -tf -", shell=True, capture_output=True, check=True, text=True
            )
            assert pipe.stdout.split() == [n for n, _ in _zstd_tar_members(p)]
    # 3. GNU tar: lists every member, extracts them byte for byte
    listed = []
    for j, p in enumerate(paths):
        listed += _gnu_tar(p, comp, tmp_path / f"x{j}")
    assert listed == [n for n, _ in want]
    for name, data in want:
        found = [tmp_path / f"x{j}" / name for j in range(len(paths))]
        hits = [f.read_bytes() for f in found if f.exists()]
        assert hits == [data], name
    # 4. tarshards itself
    assert [
        (f"{s['__key__']}.{e}", s[e])
        for p in paths
        for s in shard_samples(p)
        for e in sorted(s)
        if e[0] != "_"
    ] == want


@pytest.mark.parametrize(
    "comp,aligned",
    [("plain", False), ("gz", False), ("gz", True), ("bz2", False), ("bz2", True), ("xz", True)],
)
@pytest.mark.filterwarnings("ignore::ResourceWarning")  # webdataset's own unclosed files
def test_webdataset_sees_every_sample(comp, aligned, tmp_path):
    wds = pytest.importorskip("webdataset")
    rows = samples()
    paths = write("ShardWriter", comp, aligned, tmp_path, rows)
    got = []
    for p in paths:
        for s in wds.WebDataset(p, shardshuffle=False, empty_check=False):
            got.append((s["__key__"], s["txt"], s["cls"], s["bin"]))
    assert got == [(s["__key__"], s["txt"], s["cls"], s["bin"]) for s in rows]


# ---- sample-aligned .tgz: one gzip member, entered at flush points -------------------------


@pytest.fixture()
def aligned_tgz(tmp_path):
    rows = samples(60)
    with ShardWriter(
        str(tmp_path / "a-%02d.tgz"),
        maxcount=25,
        encoder=False,
        aligned=True,
        manifest=str(tmp_path / "m.json"),
    ) as w:
        for s in rows:
            w.write(s)
    return w, rows, str(tmp_path / "m.json")


def test_aligned_tgz_is_one_gzip_member_with_flush_points(aligned_tgz):
    w, _rows, _ = aligned_tgz
    for j, info in enumerate(w.shards):
        with open(info.url, "rb") as f:
            data = f.read()
        assert gzip_layout(data) == "flush"
        d = zlib.decompressobj(31)
        tar_bytes = d.decompress(data)
        assert d.eof and d.unused_data == b""  # one member, nothing after it
        assert tar_bytes == gzip.decompress(data)
        idx = w.manifest.load_index(j)
        assert idx.entry == "deflate" and idx.seekable
        # each sample's flush point: a raw inflater started there gives its tar bytes
        for i in range(len(idx)):
            a, b = int(idx.sample_offsets[i]), int(idx.sample_ends[i])
            out = zlib.decompressobj(-15).decompress(data[a:b])
            t0 = int(idx.tar_offsets[i])
            t1 = int(idx.tar_offsets[i + 1]) if i + 1 < len(idx) else t0 + 512
            assert out == tar_bytes[t0 : t0 + len(out)] and len(out) >= t1 - t0
        # indexing the file again finds the same flush points
        assert index_url(info.url) == idx
        assert ShardIndex.from_bytes(idx.to_bytes()) == idx


def test_aligned_tgz_random_access_and_seeks(aligned_tgz):
    w, rows, manifest = aligned_tgz
    ds = IndexedDataset(manifest)
    order = [37, 0, 59, 24, 25, 13, 50]
    for i in order:
        got = ds[i]
        assert (got["__key__"], got["txt"], got["bin"]) == (
            rows[i]["__key__"],
            rows[i]["txt"],
            rows[i]["bin"],
        )
    idx = w.manifest.load_index(1)
    url = w.shards[1].url
    with open(url, "rb") as f:
        s = read_sample_at(
            f,
            int(idx.sample_offsets[3]),
            end=int(idx.sample_ends[3]),
            compression="gzip",
            tar_offset=int(idx.tar_offsets[3]),
            entry=idx.entry,
        )
        assert s["__key__"] == rows[28]["__key__"]
        rest = list(
            samples_from(
                f,
                int(idx.sample_offsets[20]),
                compression="gzip",
                tar_offset=int(idx.tar_offsets[20]),
                entry=idx.entry,
            )
        )
    assert [r["__key__"] for r in rest] == [r["__key__"] for r in rows[45:50]]


# (planned batches drop the remainder by default; the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:epoch \\d+ drops:tarshards.errors.TarshardsWarning")
def test_aligned_tgz_resume_seeks_to_flush_points(aligned_tgz, monkeypatch):
    import tarshards.plan.cursor as source_mod
    from tarshards.testing import check_resume

    _, _rows, manifest = aligned_tgz
    entered = []
    real = source_mod.resumed_chunks

    def spy(stream, entry, url, offset, chunk_size):
        entered.append((entry, offset))
        return real(stream, entry, url, offset, chunk_size)

    monkeypatch.setattr(source_mod, "resumed_chunks", spy)
    alone = []  # the shuffle buffer's samples, each decompressed alone at its flush point
    real_entered = source_mod.ReaderStream._read_entered

    def entered_alone(self, stream, url, points, idxs):
        alone.extend(idxs)
        return real_entered(self, stream, url, points, idxs)

    monkeypatch.setattr(source_mod.ReaderStream, "_read_entered", entered_alone)

    def make():
        return (
            WebDataset(manifest, shardshuffle=True, seed=2, readers=6)
            .shuffle(4)
            .to_tuple("__key__", "txt")
            .batched(3)
        )

    ref = check_resume(make, epochs=1, cuts=[(0, 5)])
    assert sum(len(b) for b in ref[0]) > 0
    assert entered and all(e == "deflate" and off > 0 for e, off in entered)
    assert alone  # the buffer was rebuilt without decompressing from the shards' starts


# ---- the old layout (a gzip member per sample): still read; tarcheck warns ------------------


def test_old_layout_is_read_and_tarcheck_warns(tmp_path):
    rows = samples(12)
    old = str(tmp_path / "old.tgz")
    write_member_per_sample_gzip(old, rows)
    with open(old, "rb") as f:
        data = f.read()
    # the defect: Python's streaming tarfile sees the first member only, without an error
    assert [n for n, _ in _tarfile_members(data, "r|*")] != [n for n, _ in expected_members(rows)]
    # tarshards reads it all, and indexes it as seekable (a member per sample)
    assert [s["__key__"] for s in shard_samples(old)] == [r["__key__"] for r in rows]
    idx = index_url(old)
    assert idx.seekable and idx.entry == "member" and idx.compression == "gzip"
    with open(old, "rb") as f:
        s = read_sample_at(
            f,
            int(idx.sample_offsets[7]),
            end=int(idx.sample_ends[7]),
            compression="gzip",
            tar_offset=int(idx.tar_offsets[7]),
        )
    assert s["txt"] == rows[7]["txt"]
    # tarcheck: still ok (exit 0), with a warning naming how many samples other readers see
    # and the command that rewrites the shard
    res = run_cli("check", [old, "-q"])
    assert res.exit_code == 0
    assert "Python's streaming tarfile" in res.output and "sees 1 of 12 samples" in res.output
    assert "tarsplit --aligned -z" in res.output
    # the command it names gives a shard every reader reads whole
    out = tmp_path / "new"
    out.mkdir()
    res = run_cli(
        "split",
        [
            "--aligned",
            "-z",
            "-n",
            "1000000000",
            "-s",
            "1P",
            "-q",
            "-o",
            str(out / "new-%06d.tgz"),
            old,
        ],
    )
    assert res.exit_code == 0, res.output
    (new,) = sorted(out.iterdir())
    assert _tarfile_members(new.read_bytes(), "r|*") == expected_members(rows)
    assert run_cli("check", [str(new), "-q"]).output.count("warning") == 0


def test_aligned_bzip2_and_xz_are_one_stream(tmp_path):
    # Python's tarfile reads only the first bzip2/xz stream: aligned=True writes one
    rows = samples(8)
    for comp in ("bz2", "xz"):
        p = str(tmp_path / f"a{SUFFIX[comp]}")
        with TarWriter(p, encoder=False, aligned=True, index=True) as w:
            for s in rows:
                w.write(s)
        assert not w.index.seekable
        with open(p, "rb") as f:
            assert _tarfile_members(f.read(), "r|*") == expected_members(rows)


def test_index_versions(aligned_tgz, tmp_path):
    """An index of flush points is version 2 (older tarshards refuse it by its number instead
    of taking its offsets for gzip members); every other index stays version 1 and loads as
    before (``entry`` "member")."""
    import struct

    w, _, _ = aligned_tgz
    flushed = w.manifest.load_index(0).to_bytes()
    assert struct.unpack_from("<I", flushed, 8)[0] == 2
    with TarWriter(str(tmp_path / "p.tar"), index=True) as pw:
        pw.write({"__key__": "a", "txt": "x"})
    plain = pw.index.to_bytes()
    assert struct.unpack_from("<I", plain, 8)[0] == 1 and b'"entry"' not in plain
    assert ShardIndex.from_bytes(plain).entry == "member"
    bad = bytearray(flushed)
    struct.pack_into("<I", bad, 8, 3)
    with pytest.raises(Exception, match="version 3 is not supported"):
        ShardIndex.from_bytes(bytes(bad))
