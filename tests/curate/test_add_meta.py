"""``tarshards.add_meta``: per-sample metadata columns added to an existing data set's indexes,
in manifest order, without touching the shards (issue 38, item 1)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import tarshards
from tarshards import Manifest, ShardWriter
from tarshards.errors import ShardFormatError


def tokens(sample):
    return len(sample["txt"].split())


def cls_of(sample):
    return int(sample["cls"])


def chars(sample):
    return {"txt.chars": len(sample["txt"]), "odd": 1.0 if int(sample["cls"]) % 2 else None}


@pytest.fixture
def data(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    rows = [(f"k{i:04d}", " ".join(["w"] * (1 + (i * 7) % 13)), i % 5) for i in range(37)]
    with ShardWriter(str(base / "d-%04d.tar"), maxcount=10, manifest=str(base / "m.json")) as w:
        for key, txt, cls in rows:
            w.write({"__key__": key, "txt": txt, "cls": cls})
    return base, rows


def _state(base):
    return {name: os.path.getmtime(base / name) for name in sorted(os.listdir(base)) if name != "x"}


@pytest.mark.parametrize("workers", [1, 2])
def test_columns_in_manifest_order_in_a_new_manifest(data, tmp_path, workers):
    base, rows = data
    before = _state(base)
    out = tmp_path / "with-meta" / "m.json"
    m = tarshards.add_meta(
        str(base / "m.json"),
        [{"tokens": tokens}, chars],
        output=out,
        workers=workers,
        progress=False,
    )
    assert isinstance(m, Manifest) and m.url == str(out)
    again = Manifest.load(out)
    want_tokens = [len(t.split()) for _, t, _ in rows]
    np.testing.assert_array_equal(again.meta("tokens"), want_tokens)
    np.testing.assert_array_equal(again.meta("txt.chars"), [len(t) for _, t, _ in rows])
    odd = again.meta("odd")
    assert [bool(np.isnan(v)) for v in odd] == [c % 2 == 0 for _, _, c in rows]
    # the same data: the same samples, the same fingerprint; the shards and the source's indexes
    # are untouched
    src = Manifest.load(base / "m.json")
    assert again.fingerprint == src.fingerprint
    assert again.shard_urls() == src.shard_urls()
    assert _state(base) == before
    assert src.meta_columns() == []
    keys = [s["__key__"] for s in tarshards.WebDataset(str(out), shardshuffle=False)]
    assert keys == [k for k, _, _ in rows]


def test_in_place_and_through_the_reader(data):
    base, rows = data
    m = tarshards.add_meta(base / "m.json", {"tokens": tokens}, progress=False)
    assert m.url == str(base / "m.json")
    np.testing.assert_array_equal(
        Manifest.load(base / "m.json").meta("tokens"), [len(t.split()) for _, t, _ in rows]
    )
    # a second column joins the first
    m = tarshards.add_meta(base / "m.json", {"cls": cls_of}, progress=False)
    assert set(m.meta_columns()) == {"tokens", "cls"}
    np.testing.assert_array_equal(m.meta("cls"), [c for _, _, c in rows])


def test_a_stale_index_is_named(data, tmp_path):
    base, _ = data
    # rewrite one shard with other keys under the same name: its index no longer fits it
    with tarshards.TarWriter(str(base / "d-0001.tar")) as w:
        for i in range(10):
            w.write({"__key__": f"other{i}", "txt": "x", "cls": 0})
    with pytest.raises(ShardFormatError, match="stale") as info:  # one error, no warning first
        tarshards.add_meta(
            base / "m.json",
            {"tokens": tokens},
            output=tmp_path / "o.json",
            workers=1,
            progress=False,
        )
    assert "d-0001.tar" in str(info.value)


def test_arguments_are_checked(data, tmp_path):
    base, _ = data
    with pytest.raises(ValueError):
        tarshards.add_meta(base / "m.json", {}, output=tmp_path / "o.json")
    with pytest.raises(TypeError):
        tarshards.add_meta(base / "m.json", {"x": 3}, output=tmp_path / "o.json")
    bare = json.loads((base / "m.json").read_text())
    for r in bare["shards"]:
        r.pop("index", None)
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    (tmp_path / "d-0000.tar").symlink_to(base / "d-0000.tar")
    with pytest.raises(ShardFormatError, match="tarshards index"):
        tarshards.add_meta(tmp_path / "bare.json", {"tokens": tokens}, output=tmp_path / "o.json")
