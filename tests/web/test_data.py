"""The browser's data layer without a server: fields read alone where the shard is plain, cut from
the sample where it is compressed; large samples are not read whole to show a caption."""

from __future__ import annotations

import pytest

import tarshards.web.data as webdata
from tarshards import ShardWriter
from tarshards.errors import TarshardsError
from tarshards.web import BrowseApp, BrowseData


def test_fields_read_alone_equal_the_data(dataset):
    made = dataset[2]
    with BrowseData(dataset[0]) as data:
        for i in (0, 11, 63, 119):
            for name, value in made[i].items():
                if not name.startswith("__"):
                    assert data.field_bytes(i, name) == value
        with pytest.raises(webdata.NotFound, match="no field 'x'"):
            data.field_bytes(3, "x")


def test_large_samples_show_their_small_fields_read_alone(dataset, monkeypatch):
    made = dataset[2]
    monkeypatch.setattr(webdata, "WHOLE_SAMPLE", 0)  # every sample "large"
    with BrowseData(dataset[0]) as data:
        reads = []
        monkeypatch.setattr(data, "read", lambda i: reads.append(i))  # must not be called
        info = data.info(5)
        small = data.small_fields(info, 100)
        assert small == {k: v for k, v in made[5].items() if k[:2] != "__" and len(v) <= 100}
        app = BrowseApp(data, page_size=6)
        status, _, body, _ = app.answer("/", "page=1")
        assert status == 200
        assert b"caption of sample 6" in body and b"caption of sample 11" in body
        assert app.answer("/sample/4", "")[0] == 200 and not reads


def test_aligned_compressed_shards(tmp_path):
    manifest = str(tmp_path / "z.json")
    with ShardWriter(
        str(tmp_path / "z-%04d.tar.gz"), maxcount=10, manifest=manifest, aligned=True
    ) as sink:
        for i in range(25):
            sink.write({"__key__": f"k{i:03d}", "txt": f"text {i}", "bin": bytes([i]) * 300})
    with BrowseData(manifest) as data:
        assert len(data) == 25 and data.manifest.load_index(2).compression == "gzip"
        assert data.field_bytes(23, "txt") == b"text 23"
        assert data.field_bytes(17, "bin") == bytes([17]) * 300
        status, _, body, _ = BrowseApp(data).answer("/sample/23", "")
        assert status == 200 and b"text 23" in body


def test_a_manifest_without_indexes_is_indexed_first(dataset, tmp_path):
    import json
    import os

    # a wids shardindex.json: counts only, no index files
    folder = os.path.dirname(dataset[0])
    wids = {
        "__kind__": "wids-shard-index-v1",
        "shardlist": [
            {"url": os.path.join(folder, f"train-{k:04d}.tar"), "nsamples": n}
            for k, n in enumerate((50, 50, 20))
        ],
    }
    path = tmp_path / "shardindex.json"
    path.write_text(json.dumps(wids))
    with BrowseData(str(path)) as data:
        assert len(data) == 120 and all(r.index for r in data.manifest.shards)
        assert data.read(100)["txt"] == b"caption of sample 100"


def test_kept_indexes_are_rebuilt_when_a_shard_changes(tmp_path):
    def write(n):
        with ShardWriter(str(tmp_path / "d-%04d.tar"), maxcount=100) as sink:
            for i in range(n):
                sink.write({"__key__": f"k{i:03d}", "txt": f"t{i}"})

    write(10)
    spec, kept = str(tmp_path / "d-0000.tar"), tmp_path / "idx"
    with BrowseData(spec, index_dir=kept) as data:
        assert len(data) == 10
    write(12)  # the same name, other contents
    with BrowseData(spec, index_dir=kept) as data:
        assert len(data) == 12 and data.read(11)["txt"] == b"t11"


def test_a_bad_spec_leaves_no_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    from tarshards.errors import TarshardsError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TarshardsError):
        BrowseData(str(tmp_path / "missing-{0..1}.tar"))
    assert not list(tmp_path.glob("tarshards-browse-*"))


def test_changed_bytes_are_caught_by_the_index_checksums(tmp_path):
    manifest = str(tmp_path / "c.json")
    with ShardWriter(str(tmp_path / "c-%04d.tar"), maxcount=100, manifest=manifest) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i}", "txt": f"caption {i}", "cls": i})
    with BrowseData(manifest) as data:
        f = data.info(3).field("txt")
        with open(data.urls[0], "r+b") as fh:  # the same size, another byte
            fh.seek(f.data_offset)
            fh.write(b"K")
        with pytest.raises(TarshardsError, match="checksum does not match") as err:
            data.field_bytes(3, "txt")
        assert err.value.url == data.urls[0] and err.value.offset == f.offset
        assert data.field_bytes(3, "cls") == b"3"  # the other field is intact
        app = BrowseApp(data)
        status, _, body, _ = app.answer("/", "")  # the grid shows the error in its cell
        assert status == 200 and b"checksum does not match" in body
        assert b"caption 4" in body
