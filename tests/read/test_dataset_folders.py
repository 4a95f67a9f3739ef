"""Data sets as other tools lay them out: a wids ``shardindex.json`` for random access, a plain
folder of shards and a folder that Megatron-Energon prepared (``.nv-meta/split.yaml``) as shard
specs."""

from __future__ import annotations

import json
import os

import pytest

from tarshards import IndexedDataset, ShardWriter, WebDataset
from tarshards.errors import ShardFormatError
from tarshards.read.specs import _mini_yaml, directory_shards, expand_urls


def _write(folder, prefix, n, per=5, suffix=".tar", manifest=None):
    os.makedirs(folder, exist_ok=True)
    rows = [
        {"__key__": f"{prefix}{i:03d}", "txt": f"{prefix} {i}".encode(), "cls": str(i).encode()}
        for i in range(n)
    ]
    with ShardWriter(
        os.path.join(folder, f"{prefix}-%03d{suffix}"),
        maxcount=per,
        encoder=False,
        manifest=manifest,
    ) as w:
        for r in rows:
            w.write(r)
    return [info.url for info in w.shards], rows


def _wids_index(path, urls, counts):
    base = os.path.dirname(path)
    obj = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": "test",
        "shardlist": [
            {"url": os.path.relpath(u, base), "nsamples": c} for u, c in zip(urls, counts)
        ],
    }
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


# (without indexed_gzip, as in the lean install, a .tgz is read from a decompressed copy, which
# warns: incidental here, tested in tests/read/test_indexed.py)
@pytest.mark.filterwarnings("ignore:.*compressed as one stream:tarshards.errors.TarshardsWarning")
@pytest.mark.parametrize("suffix", [".tar", ".tgz"])
def test_wids_index_uses_the_indexes_beside_the_shards(tmp_path, suffix):
    d = str(tmp_path / "ds")
    # the manifest in the shards' folder: each SHARD.tsidx lies beside its shard
    urls, rows = _write(d, "s", 13, suffix=suffix, manifest=os.path.join(d, "m.json"))
    assert all(os.path.exists(u + ".tsidx") for u in urls)
    wids = _wids_index(os.path.join(d, "shardindex.json"), urls, [5, 5, 3])
    ds = IndexedDataset(wids)
    assert len(ds) == 13
    for i in (12, 0, 7, 5):
        assert (ds[i]["__key__"], ds[i]["txt"]) == (rows[i]["__key__"], rows[i]["txt"])


def test_wids_index_without_indexes_fails_at_construction(tmp_path):
    d = str(tmp_path / "ds")
    urls, _ = _write(d, "s", 8)
    wids = _wids_index(os.path.join(d, "shardindex.json"), urls, [5, 3])
    with pytest.raises(ShardFormatError, match="tarshards index") as info:
        IndexedDataset(wids)
    assert "s-000.tar" in str(info.value)
    # one index present, one missing: still at construction
    from tarshards.format.index import index_url

    index_url(urls[0]).save(urls[0] + ".tsidx")
    with pytest.raises(ShardFormatError, match=r"s-001.tar"):
        IndexedDataset(wids)
    index_url(urls[1]).save(urls[1] + ".tsidx")
    assert IndexedDataset(wids)[6]["__key__"] == "s006"


def test_a_folder_is_its_shards(tmp_path):
    d = tmp_path / "data"
    _urls, rows = _write(str(d), "b", 12, per=4)
    _write(str(d), "a", 3, per=4, suffix=".tgz")
    # sidecars and other things a folder holds are left out
    (d / "m.json").write_text("{}")
    (d / "notes.txt").write_text("x")
    (d / ".nv-meta").mkdir()
    (d / ".nv-meta" / "index.sqlite").write_bytes(b"x")
    (d / "sub").mkdir()
    (d / "sub" / "z-000.tar").write_bytes(b"")
    (d / "b-000.tar.tsidx").write_bytes(b"x")
    (d / "b-000.idx").write_text("v1.2 0")
    want = [str(d / "a-000.tgz"), str(d / "b-000.tar"), str(d / "b-001.tar"), str(d / "b-002.tar")]
    assert directory_shards(str(d)) == want
    assert expand_urls(str(d) + "/") == want
    assert expand_urls([str(d), str(d / "b-000.tar")]) == [*want, str(d / "b-000.tar")]
    keys = [s["__key__"] for s in WebDataset(str(d) + "/")]
    assert keys == ["a000", "a001", "a002"] + [r["__key__"] for r in rows]
    with pytest.raises(ValueError, match=r"split.yaml"):
        WebDataset(str(d), split="train")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no shards"):
        expand_urls(str(empty))


ENERGON_SPLIT = """\
split_parts:
  train:
  - parts/train-{000..001}.tar
  - parts/extra-000.tar
  val:
  - parts/val-000.tar
  test: []
exclude: []
"""


def test_an_energon_folder_selects_its_split(tmp_path):
    d = tmp_path / "energon"
    train, train_rows = _write(str(d / "parts"), "train", 8, per=4)
    extra, extra_rows = _write(str(d / "parts"), "extra", 2, per=4)
    val, val_rows = _write(str(d / "parts"), "val", 3, per=4)
    (d / ".nv-meta").mkdir()
    (d / ".nv-meta" / "split.yaml").write_text(ENERGON_SPLIT)
    (d / ".nv-meta" / "dataset.yaml").write_text("sample_type: {}\n")
    base = str(d)
    assert expand_urls(base, split="train") == [*train, *extra]
    assert expand_urls(base, split="val") == val
    assert expand_urls(base, split="test") == []
    assert expand_urls(base) == [*train, *extra, *val]
    got = [s["__key__"] for s in WebDataset(base, split="train")]
    assert got == [r["__key__"] for r in train_rows + extra_rows]
    got = [s["__key__"] for s in WebDataset(base + "/", split="val")]
    assert got == [r["__key__"] for r in val_rows]
    with pytest.raises(ValueError, match="not a part"):
        expand_urls(base, split="holdout")
    # exclude drops shards from every part
    (d / ".nv-meta" / "split.yaml").write_text(
        ENERGON_SPLIT.replace("exclude: []", "exclude:\n- parts/train-001.tar")
    )
    assert expand_urls(base, split="train") == [train[0], *extra]
    # the CLI expands folders the same way
    from click.testing import CliRunner

    from tarshards.cli import main as cli

    res = CliRunner().invoke(cli.load_command("check"), [base + "/", "-q"], prog_name="tarcheck")
    assert res.exit_code == 0, res.output


def test_mini_yaml_reads_what_energon_writes():
    yaml = pytest.importorskip("yaml")
    text = ENERGON_SPLIT.replace("exclude: []", "exclude:\n- 'parts/x-000.tar'  # dropped")
    assert _mini_yaml(text, "split.yaml") == yaml.safe_load(text)
