"""``tarshards.join``: two data sets of different shard layouts joined by key through the right
side's KeyIndex; inner and left joins read plain, by random access and planned, with exact and
elastic resume (issue 37, item 3)."""

from __future__ import annotations

import types

import numpy as np
import pytest

import tarshards
from tarshards import IndexedDataset, Manifest, ShardWriter, WebDataset
from tarshards.testing import check_resume


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("join")
    (root / "R").mkdir()
    (root / "L").mkdir()
    images = {}
    # the right side: "images" of every third key, 7 a shard, written in another order
    with ShardWriter(
        str(root / "R" / "r-%04d.tar"), maxcount=7, manifest=str(root / "R" / "m.json")
    ) as w:
        for i in sorted(range(0, 60, 3), key=lambda i: (i * 7) % 60):
            img = bytes([i]) * (40 + i)
            images[f"img{i:04d}"] = img
            w.write({"__key__": f"img{i:04d}", "png": img, "cls": i})
    texts = []
    with ShardWriter(
        str(root / "L" / "l-%04d.tar"), maxcount=4, manifest=str(root / "L" / "m.json")
    ) as w:
        for i in range(45):
            sample = {"__key__": f"t{i:04d}", "txt": f"text {i}", "ref.txt": f"img{i:04d}"}
            w.write(sample)
            texts.append(sample)
    return types.SimpleNamespace(root=root, images=images, texts=texts)


def expected(s, how):
    out = []
    for t in s.texts:
        img = s.images.get(t["ref.txt"])
        if img is None and how == "inner":
            continue
        row = {"__key__": t["__key__"], "txt": t["txt"].encode(), "ref.txt": t["ref.txt"].encode()}
        if img is not None:
            row.update({"right.png": img, "right.cls": str(int(t["ref.txt"][3:])).encode()})
        out.append(row)
    return out


def strip(sample):
    return {k: v for k, v in sample.items() if not k.startswith("__") or k == "__key__"}


@pytest.fixture(scope="module")
def joins(sets):
    out = {}
    for how in ("inner", "left"):
        out[how] = tarshards.join(
            str(sets.root / "L" / "m.json"),
            str(sets.root / "R" / "m.json"),
            on="ref.txt",
            how=how,
            prefix="right.",
            output=str(sets.root / "J" / f"{how}.json"),
            workers=1,
        )
    return out


@pytest.mark.parametrize("how", ["inner", "left"])
def test_join_reads_left_fields_with_right_fields(sets, joins, how):
    m = joins[how]
    want = expected(sets, how)
    assert m.num_samples == len(want) == (15 if how == "inner" else 45)
    again = Manifest.load(m.url)
    assert again == m and again.join["how"] == how
    assert [strip(s) for s in WebDataset(m.url)] == want
    assert len(WebDataset(m.url)) == len(want)
    ids = IndexedDataset(m.url)
    assert len(ids) == len(want)
    assert [strip(ids[i]) for i in range(len(ids))] == want
    planned = WebDataset(m.url, readers=1, shardshuffle=False, remainder="pad").batched(1)
    got = [strip(s) for s in planned.unbatched()]
    assert got == want
    # the pointers: int32 rows of (left row, right shard, right row), 12 bytes a row
    ptr = np.load(str(sets.root / "J" / f"{how}.pointers.npy"), mmap_mode="r")
    assert ptr.dtype == np.int32 and ptr.shape == (len(want), 3)


def test_join_on_key_and_fields(sets, tmp_path):
    """on="__key__" (keys shared by both sides), and fields= projecting the joined rows."""
    root = tmp_path
    with ShardWriter(str(root / "a-%04d.tar"), maxcount=5, manifest=str(root / "a.json")) as w:
        for i in range(0, 30, 2):
            w.write({"__key__": f"img{i:04d}", "json": {"i": i}})
    j = tarshards.join(
        str(root / "a.json"),
        str(sets.root / "R" / "m.json"),
        output=str(root / "j" / "m.json"),
        workers=1,
    )
    rows = list(WebDataset(j.url))
    assert [r["__key__"] for r in rows] == [f"img{i:04d}" for i in range(0, 30, 6)]
    assert all(r["png"] == sets.images[r["__key__"]] for r in rows)
    only = list(WebDataset(j.url, fields=["png"]))
    assert all(set(r) - {"__key__", "__url__", "__offset__"} == {"png"} for r in only)


def test_name_clash_is_refused(sets, tmp_path):
    with pytest.raises(ValueError, match="prefix="):
        tarshards.join(
            str(sets.root / "L" / "m.json"),
            str(sets.root / "L" / "m.json"),
            output=str(tmp_path / "x.json"),
            workers=1,
        )
    with pytest.raises(ValueError, match="how"):
        tarshards.join(
            str(sets.root / "L" / "m.json"),
            str(sets.root / "R" / "m.json"),
            how="outer",
            output=str(tmp_path / "y.json"),
        )


def make(url, torch_ds=False, **kw):
    cls = WebDataset
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as cls
    ds = cls(url, shardshuffle=True, seed=2, readers=4, remainder="pad", **kw)
    return ds.shuffle(4).to_tuple("__key__", "right.png", "__pad__").batched(2)


def test_resume_over_a_join(sets, joins):
    url = joins["inner"].url
    ref = check_resume(lambda: make(url), epochs=2, resumes_in_one_epoch=2)
    assert ref[0] != ref[1]
    for b in make(url):
        for k, png, _ in zip(*b):
            i = int(k[1:])
            assert png == sets.images[f"img{i:04d}"]


def test_resume_through_webloader_with_two_workers(joins):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    url = joins["inner"].url
    check_resume(
        lambda: WebLoader(make(url, torch_ds=True), batch_size=None, num_workers=2),
        epochs=1,
        cuts=[(0, 3)],
    )


def test_elastic_resume_over_a_join(sets, joins):
    url = joins["left"].url

    def mk(**kw):
        ds = WebDataset(url, shardshuffle=True, seed=2, readers=6, remainder="pad", **kw)
        return ds.shuffle(4).to_tuple("__key__", "__pad__").batched(2)

    first, saved = [], None
    for r in range(2):
        ds = mk(rank=r, world_size=2)
        it = iter(ds)
        first += [next(it) for _ in range(2)]
        if r == 0:
            saved = ds.state_dict()
    after = []
    for r in range(3):
        ds = mk(rank=r, world_size=3)
        ds.load_state_dict(saved)
        after.append(list(ds))
    assert len({len(x) for x in after}) == 1
    got = [k for b in first + [b for x in after for b in x] for k, p in zip(*b) if not p]
    assert sorted(got) == [t["__key__"] for t in sets.texts]
