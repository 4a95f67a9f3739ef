"""The manifest: file format, relative URLs, fingerprint, wids' shardindex.json; exact len() per
rank and worker; verify=True and tarcheck --manifest name a shard with one flipped byte."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from tarshards import (
    IntegrityError,
    ShardFormatError,
    ShardWriter,
    TarshardsWarning,
    WebDataset,
    warn_and_continue,
)
from tarshards.cli.main import group
from tarshards.format.manifest import (
    Manifest,
    ShardRecord,
    build_manifest,
    index_path_for,
    relative_url,
    resolve_url,
)
from tarshards.pipeline.dataset import WebDataset as PlainWebDataset
from tarshards.pipeline.dataset import iter_samples


def _write(tmp_path, n=50, maxcount=8, sub="ds", **kw):
    d = tmp_path / sub
    d.mkdir(exist_ok=True)
    with ShardWriter(
        str(d / "part-%04d.tar"), maxcount=maxcount, manifest=str(d / "manifest.json"), **kw
    ) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:05d}", "txt": f"text {i}" * (i % 5), "cls": i % 3})
    return w.manifest


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 1]))


def test_file_format_and_relative_urls(tmp_path):
    m = _write(tmp_path)
    obj = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert obj["format"] == "tarshards.manifest" and obj["version"] == 1
    assert obj["num_samples"] == 50
    assert obj["shards"][0] == {
        "url": "part-0000.tar",
        "samples": 8,
        "nbytes": os.path.getsize(tmp_path / "ds" / "part-0000.tar"),
        "hash": m.shards[0].hash,
        "index": "part-0000.tar.tsidx",
    }
    assert m.shards[0].hash.startswith("xxh3_64:")
    # the data set moves as a whole
    shutil.copytree(tmp_path / "ds", tmp_path / "moved")
    moved = Manifest.load(str(tmp_path / "moved" / "manifest.json"))
    assert moved == m and moved.fingerprint == m.fingerprint
    assert moved.shard_urls()[0] == str(tmp_path / "moved" / "part-0000.tar")
    assert list(iter_samples(moved.shard_urls())) != []
    assert moved.load_index(3) == m.load_index(3)


def test_fingerprint_and_tampering(tmp_path):
    m = _write(tmp_path)
    r = m.shards[0]
    other = Manifest((ShardRecord(r.url, r.samples + 1, r.nbytes, r.hash, r.index),) + m.shards[1:])
    assert other.fingerprint != m.fingerprint and other != m
    path = tmp_path / "ds" / "manifest.json"
    obj = json.loads(path.read_text())
    obj["shards"][1]["samples"] += 1
    path.write_text(json.dumps(obj))
    with pytest.raises(IntegrityError, match="fingerprint"):
        Manifest.load(str(path))
    path.write_text(json.dumps({"format": "tarshards.manifest", "version": 7, "shards": []}))
    with pytest.raises(ShardFormatError, match="version 7"):
        Manifest.load(str(path))
    path.write_text("{not json")
    with pytest.raises(ShardFormatError, match="not valid JSON"):
        Manifest.load(str(path))
    with pytest.raises(FileNotFoundError):
        Manifest.load(str(tmp_path / "nope.json"))


def test_url_helpers(tmp_path):
    base = str(tmp_path)
    assert relative_url(str(tmp_path / "a" / "b.tar"), base) == "a/b.tar"
    assert relative_url("/elsewhere/b.tar", base) == "/elsewhere/b.tar"
    assert relative_url("s3://b/x/y.tar", "s3://b/x/") == "y.tar"
    assert relative_url("s3://b/z/y.tar", "s3://b/x/") == "s3://b/z/y.tar"
    assert resolve_url("y.tar", "s3://b/x/") == "s3://b/x/y.tar"
    assert resolve_url("http://h/y.tar", base) == "http://h/y.tar"
    assert index_path_for("a/b.tar") == "a/b.tar.tsidx"
    far = index_path_for("s3://bucket/data/train-0001.tar")
    assert far.startswith("_index/") and far.endswith("-train-0001.tar.tsidx")
    assert index_path_for("../up.tar").startswith("_index/")


def test_index_of_shards_elsewhere(tmp_path):
    m = _write(tmp_path)
    out = tmp_path / "meta" / "all.json"
    built = build_manifest(m.shard_urls(), str(out), workers=1)
    assert built.shards[0].url == str(tmp_path / "ds" / "part-0000.tar")
    assert built.shards[0].index.startswith("_index/")
    assert (out.parent / built.shards[0].index).exists()
    assert built.load_index(0) == m.load_index(0)
    assert [r.hash for r in built.shards] == [r.hash for r in m.shards]


def test_wids_shardindex_is_read(tmp_path):
    m = _write(tmp_path)
    wids = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": "train",
        "shardlist": [
            {"url": r.url, "nsamples": r.samples, "filesize": r.nbytes} for r in m.shards
        ],
    }
    path = tmp_path / "ds" / "shardindex.json"
    path.write_text(json.dumps(wids))
    w = Manifest.load(str(path))
    assert [r.samples for r in w.shards] == [r.samples for r in m.shards]
    assert w.shard_urls() == m.shard_urls()
    assert w.shards[0].hash is None and w.shards[0].index is None
    ds = WebDataset(str(path))
    assert len(ds) == 50 and len(list(ds)) == 50
    with pytest.raises(ShardFormatError, match="no index"):
        w.load_index(0)


def test_info_is_kept_and_old_manifests_load(tmp_path):
    import dataclasses

    written = _write(tmp_path, n=10)
    m = dataclasses.replace(written, info={"classes": ["a", "b"]}).save(written.url)
    assert m.info == {"classes": ["a", "b"]}
    loaded = Manifest.load(m.url)
    assert loaded.info == {"classes": ["a", "b"]} and loaded == m
    # the fingerprint covers the records only: the same shards without info, the same print
    with open(m.url) as f:
        obj = json.load(f)
    del obj["info"]
    plain = Manifest.from_json(obj, url=m.url)
    assert plain.info == {} and plain.fingerprint == m.fingerprint and plain != m
    assert "info" not in plain.to_json() and plain == written
    with pytest.raises(TypeError, match="info is a dict"):
        Manifest((), info=["not", "a", "dict"])  # type: ignore[arg-type]


# (the ranks' unequal shares are incidental here: the warning has tests of its own)
@pytest.mark.filterwarnings("ignore:\\d+ ranks (may )?read:tarshards.errors.TarshardsWarning")
def test_exact_len_per_rank_and_worker(tmp_path):
    m = _write(tmp_path, n=61, maxcount=7)  # 9 shards of 7, 7, ..., 5
    url = str(tmp_path / "ds" / "manifest.json")
    assert len(PlainWebDataset(url)) == 61
    assert len(PlainWebDataset(m)) == 61
    assert len(PlainWebDataset(m.shard_urls(), manifest=url)) == 61
    for shardshuffle in (False, True):
        for world in (1, 2, 3):
            total = 0
            for rank in range(world):
                ds = PlainWebDataset(
                    url, rank=rank, world_size=world, shardshuffle=shardshuffle, seed=5
                )
                ds.set_epoch(3)
                n = len(ds)
                assert n == len(list(ds)), (world, rank)
                by_worker = [ds.num_samples(worker=w, num_workers=2) for w in range(2)]
                assert sum(by_worker) == n
                total += n
            assert total == 61
    ds = PlainWebDataset(url).with_length(10)
    assert len(ds) == 10
    with pytest.raises(TypeError, match="without a manifest"):
        len(PlainWebDataset(m.shard_urls()))
    with pytest.raises(TypeError, match="endless"):
        len(PlainWebDataset(url, resampled=True))
    part = PlainWebDataset(m.shard_urls()[:2] + [str(tmp_path / "x.tar")], manifest=m)
    with pytest.raises(TypeError, match="not in the manifest"):
        len(part)


def test_verify_names_the_bad_shard(tmp_path):
    m = _write(tmp_path)
    url = str(tmp_path / "ds" / "manifest.json")
    assert len(list(WebDataset(url, verify=True))) == 50
    bad = m.shard_urls()[3]
    _flip(bad, 700)  # in the padding of a member: invisible to the tar reader
    assert len(list(WebDataset(url))) == 50
    with pytest.raises(IntegrityError) as e:
        list(WebDataset(url, verify=True))
    assert e.value.url == bad and "hash" in str(e.value)
    # a continuing handler skips the shard's check and goes on
    with pytest.warns(Warning, match="part-0003"):
        assert len(list(WebDataset(url, verify=True, handler=warn_and_continue))) == 50
    with pytest.raises(ValueError, match="manifest"):
        WebDataset(m.shard_urls(), verify=True)


def test_verify_catches_a_truncated_or_grown_shard(tmp_path):
    m = _write(tmp_path)
    bad = m.shard_urls()[1]
    with open(bad, "ab") as f:
        f.write(bytes(512))
    with pytest.raises(IntegrityError, match="bytes, the manifest says") as e:
        list(WebDataset(str(tmp_path / "ds" / "manifest.json"), verify=True))
    assert e.value.url == bad


def test_tarcheck_manifest_names_the_shard(tmp_path):
    m = _write(tmp_path)
    url = str(tmp_path / "ds" / "manifest.json")
    res = CliRunner().invoke(group, ["check", "-q", "--manifest", url])
    assert res.exit_code == 0, res.output
    bad = m.shard_urls()[5]
    _flip(bad, 900)
    res = CliRunner().invoke(group, ["check", "-q", "--manifest", url])
    assert res.exit_code == 1
    problems = [ln for ln in res.output.splitlines() if "problem:" in ln]
    assert len(problems) == 2 and bad in problems[0] and "hash" in problems[0]
    assert bad in problems[1]  # and where, from the shard's index (here: a header or padding)
    # INPUTS with --manifest: only those, and one the manifest lacks is a problem
    res = CliRunner().invoke(group, ["check", "-q", "--manifest", url, m.shard_urls()[0]])
    assert res.exit_code == 0, res.output
    stray = tmp_path / "stray.tar"
    shutil.copy(m.shard_urls()[0], stray)
    res = CliRunner().invoke(group, ["check", "-q", "--manifest", url, str(stray)])
    assert res.exit_code == 1 and "not in the manifest" in res.output


def test_tarsplit_writes_a_manifest(tmp_path):
    m = _write(tmp_path, n=20, maxcount=100)
    out = tmp_path / "split"
    out.mkdir()
    res = CliRunner().invoke(
        group,
        [
            "split",
            "-q",
            "-n",
            "6",
            "-z",
            "--aligned",
            "--manifest",
            str(out / "m.json"),
            "-o",
            str(out / "p"),
            m.shard_urls()[0],
        ],
    )
    assert res.exit_code == 0, res.output
    sm = Manifest.load(str(out / "m.json"))
    assert [r.samples for r in sm.shards] == [6, 6, 6, 2]
    assert all(sm.load_index(i).seekable for i in range(4))
    assert sm == build_manifest(sm.shard_urls(), str(out / "again.json"), workers=1)


def test_map_shards_writes_a_manifest(tmp_path):
    from tarshards.parallel import map_shards

    m = _write(tmp_path, n=30, maxcount=10)
    outs = [str(tmp_path / f"out-{i}.tar") for i in range(3)]
    map_shards(_upper, m.shard_urls()[:2], outs[:2], workers=1, progress=False)
    # the third is new; the first two exist and are indexed by reading them
    with pytest.warns(TarshardsWarning, match="2 of 3 outputs exist already and were kept"):
        reports = map_shards(
            _upper,
            m.shard_urls(),
            outs,
            workers=2,
            progress=False,
            manifest=str(tmp_path / "out.json"),
        )
    assert [r.status for r in reports] == ["skipped", "skipped", "done"]
    om = Manifest.load(str(tmp_path / "out.json"))
    assert om.num_samples == 30 and [r.url for r in om.shards] == [
        "out-0.tar",
        "out-1.tar",
        "out-2.tar",
    ]
    assert om == build_manifest(outs, str(tmp_path / "again.json"), workers=1)


def _upper(sample):
    return {"__key__": sample["__key__"], "txt": sample["txt"].upper()}


def test_writer_sweeps_the_index_directory_once_not_per_shard(tmp_path, monkeypatch):
    """Stale temporaries (a writer killed mid-save) are cleared from where the indexes go, once
    per directory: listing it for every shard's index made writing N shards cost O(N^2)."""
    import time

    from tarshards.storage import atomic

    real_listdir = os.listdir

    def run(folder, shards):
        folder.mkdir()
        other = "0" * 8 if atomic._host_tag() != "0" * 8 else "1" * 8
        stale = folder / f".s-00000.tar.tsidx.123-{other}-5-00000004.tmp"  # another host's, old
        stale.write_bytes(b"partial index")
        old = time.time() - atomic.STALE_AFTER - 10
        os.utime(stale, (old, old))
        listed = []

        def listdir(path="."):
            listed.append(os.path.abspath(path))
            return real_listdir(path)

        monkeypatch.setattr(os, "listdir", listdir)
        with ShardWriter(str(folder / "s-%05d.tar"), maxcount=2, manifest=folder / "m.json") as w:
            for i in range(2 * shards):
                w.write({"__key__": f"k{i:03d}", "txt": b"x" * i})
        monkeypatch.undo()
        assert not stale.exists()
        m = Manifest.load(str(folder / "m.json"))
        assert len(m.shards) == shards and m.num_samples == 2 * shards
        assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".tsidx")) == [
            f"s-{i:05d}.tar.tsidx" for i in range(shards)
        ]
        return listed.count(str(folder))

    assert run(tmp_path / "one", 1) == run(tmp_path / "many", 8)


# ---------------------------------------------------------------------------------------------
# building: reruns read only the shards without an index, --append, the processes engine
# ---------------------------------------------------------------------------------------------


def _shards(tmp_path, n, sub="ds"):
    from conftest import write_shards

    d = tmp_path / sub
    d.mkdir(exist_ok=True)
    return d, write_shards(d, n, 6)[0]


def _files(d) -> dict:
    """The manifest and index files of a directory, by name: their bytes."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".json", ".tsidx")}


def test_rerun_reads_only_the_shards_without_an_index(tmp_path):
    from conftest import ShardOpener

    d, paths = _shards(tmp_path, 5)
    opener = ShardOpener(tmp_path / "log")
    m = build_manifest(paths, d / "m.json", workers=2, opener=opener)
    assert opener.opened() == [os.path.basename(p) for p in paths]
    built = _files(d)
    # a rerun after a crash: two indexes are missing (one never written, one cut short)
    os.remove(d / "shard-0001.tar.tsidx")
    with open(d / "shard-0003.tar.tsidx", "r+b") as f:
        f.truncate(40)
    os.remove(d / "m.json")
    opener.clear()
    assert build_manifest(paths, d / "m.json", workers=2, opener=opener) == m
    assert opener.opened() == ["shard-0001.tar", "shard-0003.tar"]
    assert _files(d) == built  # byte for byte
    # a shard rewritten since its index was made is read again, and so is everything with
    # overwrite=True or another hash
    from conftest import write_shards

    write_shards(d, 1, 7)  # shard-0000.tar: 7 samples now
    opener.clear()
    again = build_manifest(paths, d / "m.json", workers=1, opener=opener)
    assert opener.opened() == ["shard-0000.tar"] and again.shards[0].samples == 7
    opener.clear()
    build_manifest(paths, d / "m.json", workers=1, opener=opener, overwrite=True)
    assert opener.opened() == sorted(os.path.basename(p) for p in paths)
    opener.clear()
    sha = build_manifest(paths, d / "m.json", workers=1, opener=opener, hash="sha256")
    assert len(opener.opened()) == 5 and sha.shards[0].hash.startswith("sha256:")


def test_append_three_shards_equals_a_full_rebuild(tmp_path):
    from conftest import ShardOpener

    d, paths = _shards(tmp_path, 8)
    res = CliRunner().invoke(group, ["index", "-q", *paths[:5], "-o", str(d / "m.json")])
    assert res.exit_code == 0, res.output
    old = Manifest.load(d / "m.json")
    old_indexes = {n: (d / n).stat().st_mtime_ns for n in _files(d) if n.endswith(".tsidx")}
    opener = ShardOpener(tmp_path / "log")
    new = build_manifest(paths, d / "m.json", append=True, opener=opener)  # names all 8
    assert opener.opened() == ["shard-0005.tar", "shard-0006.tar", "shard-0007.tar"]
    assert new.shards[:5] == old.shards and len(new) == 8
    assert new.fingerprint != old.fingerprint
    assert {n: (d / n).stat().st_mtime_ns for n in old_indexes} == old_indexes  # untouched
    appended = (d / "m.json").read_bytes()
    # the same through the CLI, naming only the new shards
    res = CliRunner().invoke(group, ["index", *paths[:5], "-o", str(d / "cli.json"), "-q"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(group, ["index", "--append", *paths[5:], "-o", str(d / "cli.json")])
    assert res.exit_code == 0, res.output
    assert "appended 3 shards, 18 samples" in res.output and new.fingerprint in res.output
    assert (d / "cli.json").read_bytes() == appended
    # a full rebuild from scratch, elsewhere: the same bytes
    full_dir = tmp_path / "full"
    shutil.copytree(d, full_dir, ignore=shutil.ignore_patterns("*.json", "*.tsidx"))
    full = [str(full_dir / os.path.basename(p)) for p in paths]
    build_manifest(full, full_dir / "m.json", workers=1)
    assert _files(full_dir) == {k: v for k, v in _files(d).items() if k != "cli.json"}
    # nothing new: the manifest as it was
    assert build_manifest(paths[:2], d / "m.json", append=True) == new


def test_processes_engine_equals_local_index_and_retries_a_dead_worker(tmp_path):
    from conftest import ShardOpener

    d, paths = _shards(tmp_path, 4)
    local = build_manifest(paths, d / "m.json", workers=1)
    want = _files(d)
    for p in d.glob("*.tsidx"):
        p.unlink()
    opener = ShardOpener(tmp_path / "log", die="shard-0002.tar")
    m = build_manifest(paths, d / "m.json", engine="processes", workers=2, opener=opener)
    assert os.path.exists(opener.marker)  # the worker reading shard 2 died once
    assert m == local and _files(d) == want
    assert opener.opened().count("shard-0002.tar") == 2
    assert not [n for n in os.listdir(d) if ".tmp" in n]


def test_engine_failures_raise_or_are_left_out(tmp_path):
    d, paths = _shards(tmp_path, 3)
    with open(paths[1], "r+b") as f:  # a broken header checksum
        f.seek(148)
        f.write(b"99999")
    with pytest.raises(ShardFormatError, match=r"shard-0001.tar"):
        build_manifest(paths, d / "m.json", workers=1)
    from tarshards import TarshardsError

    with pytest.raises(TarshardsError, match=r"shard-0001.tar"):
        build_manifest(paths, d / "m.json", engine="processes", workers=2)
    assert not os.path.exists(d / "m.json")
    assert os.path.exists(d / "shard-0002.tar.tsidx")  # the good shards are checkpointed
    left_out = []
    m = build_manifest(
        paths,
        d / "m.json",
        engine="processes",
        workers=2,
        on_error="skip",
        report=lambda u, e: left_out.append(u),
    )
    assert [r.url for r in m.shards] == ["shard-0000.tar", "shard-0002.tar"]
    assert left_out == [paths[1]]
    with pytest.raises(ValueError, match="engine must be one of"):
        build_manifest(paths, d / "m.json", engine="spark", overwrite=True)
