"""Views over manifests with sidecar columns and joins (issue 37: views are accepted everywhere a
manifest is): a view's rows select the logical rows of the layout; every part is read at those
rows; ``fields=`` still opens only the parts it needs; ``len``, ``ds[i]``, planned iteration,
resume through ``WebLoader`` workers and elastic resume hold; ``view``/``dedup``/``split`` over a
sidecar manifest see merged samples; ``verify=True`` over a view checks the members it reads."""

from __future__ import annotations

import gc
import os
import shutil
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tarshards
from tarshards import IndexedDataset, ShardWriter, View, WebDataset
from tarshards.errors import IntegrityError
from tarshards.testing import check_resume


def caption(sample):
    """New fields of a sample (module level: the processes engine pickles it)."""
    return {"txt": f"a caption of {sample['__key__']}", "n.txt": str(int(sample["cls"]) * 3)}


def odd_cls(sample):
    return int(sample["n.txt"]) % 2 == 1 and sample["txt"].endswith(b"1")


def by_caption_word(sample):
    return sample["dup.txt"]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    base = root / "base"
    base.mkdir()
    rows = []
    with ShardWriter(str(base / "b-%04d.tar"), maxcount=9, manifest=str(base / "m.json")) as w:
        for i in range(40):
            sample = {
                "__key__": f"k{i:04d}",
                "bin": bytes([i % 251]) * (300 + i),
                "cls": i % 7,
                "ref.txt": f"img{i:04d}",
            }
            w.write(sample)
            rows.append(sample)
    cols = tarshards.add_columns(
        str(base / "m.json"),
        caption,
        output=str(root / "cols" / "m.json"),
        name="caption",
        workers=1,
        progress=False,
    )
    (root / "R").mkdir()
    images = {}
    with ShardWriter(
        str(root / "R" / "r-%04d.tar"), maxcount=5, manifest=str(root / "R" / "m.json")
    ) as w:
        for i in sorted(range(0, 40, 2), key=lambda i: (i * 7) % 40):
            images[f"img{i:04d}"] = bytes([i]) * (50 + i)
            w.write({"__key__": f"img{i:04d}", "png": images[f"img{i:04d}"]})
    joins = {
        how: tarshards.join(
            str(base / "m.json"),
            str(root / "R" / "m.json"),
            on="ref.txt",
            how=how,
            prefix="right.",
            output=str(root / "J" / f"{how}.json"),
            workers=1,
        )
        for how in ("inner", "left")
    }
    return _Sets(
        root=root, base=str(base / "m.json"), rows=rows, cols=cols, joins=joins, images=images
    )


class _Sets(types.SimpleNamespace):
    def __repr__(self) -> str:  # (hypothesis prints its arguments)
        return "<sets>"


def merged_rows(s, which):
    """The merged samples of a data set, in order (what a full read yields), as compared."""
    return [strip(x) for x in WebDataset(record(s, which))]


def record(s, which):
    return s.cols if which == "cols" else s.joins[which]


def strip(sample):
    out = {k: bytes(v) for k, v in sample.items() if not k.startswith("__")}
    out["__key__"] = sample["__key__"]
    return out


WHICH = ["cols", "inner", "left"]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    which=st.sampled_from(WHICH), picked=st.lists(st.integers(0, 10_000), min_size=1, max_size=30)
)
def test_a_views_samples_are_the_selected_merged_samples_in_order(sets, which, picked):
    m = record(sets, which)
    full = merged_rows(sets, which)
    positions = sorted({p % len(full) for p in picked})
    v = View.from_positions(m, positions)
    want = [full[p] for p in positions]
    assert len(v) == len(want) == len(WebDataset(v))
    assert [strip(x) for x in WebDataset(v)] == want
    ds = IndexedDataset(v)
    assert len(ds) == len(want)
    assert [strip(ds[i]) for i in range(len(ds))] == want
    # planned: every selected sample once
    planned = WebDataset(v, readers=3, remainder="pad", seed=2).shuffle(3)
    planned = planned.to_tuple("__key__", "__pad__").batched(2)
    got = sorted(k for b in planned for k, p in zip(*b) if not p)
    assert got == sorted(w["__key__"] for w in want)


def test_fields_over_a_view_reads_only_the_groups_asked_for(sets, tmp_path):
    # the sidecar and its manifest moved without the base: a view still reads fields=["txt"]
    shutil.copytree(sets.root / "cols", tmp_path / "cols")
    os.makedirs(tmp_path / "base")  # the base's manifest and shards are not there
    m = tarshards.Manifest.load(str(tmp_path / "cols" / "m.json"))
    v = View.from_positions(m, [1, 5, 9, 10, 33]).save(str(tmp_path / "cols" / "few.view.json"))
    got = [(x["__key__"], x["txt"]) for x in WebDataset(v.url, fields=["txt"])]
    assert got == [(f"k{i:04d}", f"a caption of k{i:04d}".encode()) for i in (1, 5, 9, 10, 33)]
    assert [IndexedDataset(v.url, fields=["txt"])[i]["txt"] for i in (0, 4)] == [
        b"a caption of k0001",
        b"a caption of k0033",
    ]
    planned = WebDataset(v.url, fields=["txt"], readers=2, remainder="pad").batched(5)
    assert sorted(k for b in planned for k, p in zip(b["__key__"], b["__pad__"]) if not p) == [
        f"k{i:04d}" for i in (1, 5, 9, 10, 33)
    ]
    with pytest.raises(tarshards.errors.TarshardsError):  # a base field needs the base
        list(WebDataset(v.url, fields=["bin"]))


def make_planned(v, torch_ds=False, field="txt", **kw):
    cls = WebDataset
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as cls
    ds = cls(v, shardshuffle=True, seed=4, readers=4, remainder="pad", **kw)
    return ds.shuffle(3).to_tuple("__key__", field, "__pad__").batched(2)


def test_planned_resume_over_a_view_of_a_sidecar_manifest(sets):
    v = View.from_positions(sets.cols, np.flatnonzero(np.arange(40) % 3 != 0))
    ref = check_resume(lambda: make_planned(v), epochs=2, resumes_in_one_epoch=2)
    assert ref[0] != ref[1]
    for b in make_planned(v):
        for k, t, _ in zip(*b):
            assert t == f"a caption of {k}".encode() and int(k[1:]) % 3 != 0
    # a state saved over the view is not one of the whole manifest
    run = make_planned(v)
    next(iter(run))
    with pytest.raises(tarshards.errors.ResumeError, match="fingerprint"):
        make_planned(sets.cols).load_state_dict(run.state_dict())


def test_webloader_with_two_workers_resumes_over_a_view_of_a_join(sets):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    v = View.from_positions(sets.joins["left"], np.flatnonzero(np.arange(40) % 4 != 1))

    def make():
        ds = make_planned(v, torch_ds=True, field="ref.txt")
        return WebLoader(ds, batch_size=None, num_workers=2)

    check_resume(make, epochs=1, cuts=[(0, 3)])


def test_elastic_resume_over_a_view_of_an_inner_join(sets):
    m = sets.joins["inner"]
    v = View.from_positions(m, np.flatnonzero(np.arange(m.num_samples) % 3 != 2))

    def mk(**kw):
        ds = WebDataset(v, shardshuffle=True, seed=2, readers=6, remainder="pad", **kw)
        return ds.shuffle(4).to_tuple("__key__", "right.png", "__pad__").batched(2)

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
    got = [
        (k, png) for b in first + [b for x in after for b in x] for k, png, p in zip(*b) if not p
    ]
    full = [x for x in WebDataset(m)]
    want = [full[i] for i in np.flatnonzero(np.arange(m.num_samples) % 3 != 2)]
    assert sorted(got) == sorted((w["__key__"], w["right.png"]) for w in want)
    for k, png in got:
        assert png == sets.images[f"img{int(k[1:]):04d}"]


def test_view_dedup_split_over_a_sidecar_manifest_see_merged_samples(sets, tmp_path):
    full = merged_rows(sets, "cols")
    v = tarshards.view(sets.cols, odd_cls, output=str(tmp_path / "odd.view.json"), workers=1)
    want = [x for x in full if int(x["n.txt"]) % 2 == 1 and x["txt"].endswith(b"1")]
    assert want and [strip(x) for x in WebDataset(v.url)] == want
    # by key over a join: the join's keys (its left rows)
    m = sets.joins["inner"]
    jfull = merged_rows(sets, "inner")
    keys = {x["__key__"] for x in jfull[::3]}
    vk = tarshards.view(m, keys, output=None)
    assert [x["__key__"] for x in WebDataset(vk)] == [x["__key__"] for x in jfull[::3]]
    # split over a join: disjoint, covering, by the join's keys
    parts = tarshards.split(m, {"a": 0.5, "b": 0.5}, output_dir=None, seed=1)
    got = [x["__key__"] for p in parts.values() for x in WebDataset(p)]
    assert sorted(got) == sorted(x["__key__"] for x in jfull) and len(set(got)) == len(got)
    # dedup by content of a sidecar manifest: the column group's content counts
    d = tarshards.dedup(sets.cols, by="content", output=None)
    assert len(d) == len(full)  # every row differs (its key is in its caption)
    d2 = tarshards.dedup(sets.cols, by="n.txt", output=None, workers=1)
    assert [x["n.txt"] for x in WebDataset(d2)] == sorted(
        {x["n.txt"] for x in full}, key=[x["n.txt"] for x in full].index
    )


def test_verify_over_a_view_checks_the_members_it_reads(sets, tmp_path):
    shutil.copytree(sets.root / "base", tmp_path / "base")
    m = tarshards.Manifest.load(str(tmp_path / "base" / "m.json"))
    idx = m.load_index(1)
    row_in, row_out = 2, 5  # of shard 1: one selected, one left out

    def biggest(row):  # the sample's largest member: a byte inside its data
        a, b = int(idx.member_starts[row]), int(idx.member_starts[row + 1])
        k = a + int(np.argmax(idx.member_sizes[a:b]))
        return k, int(idx.member_data_offsets[k]) + 10

    m_in, bad_in = biggest(row_in)
    _, bad_out = biggest(row_out)
    v = View.of(m, [None, [0, 1, row_in, 3], None, None, None])
    assert [len(x) for x in [list(WebDataset(v, verify=True))]] == [len(v)]  # clean: fine
    path = tmp_path / "base" / "b-0001.tar"
    data = bytearray(path.read_bytes())
    data[bad_out] ^= 0xFF  # outside the view: not read, so not detected (documented)
    path.write_bytes(bytes(data))
    assert len(list(WebDataset(v, verify=True))) == len(v)
    data[bad_in] ^= 0xFF  # inside a selected sample: named
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        list(WebDataset(v, verify=True))
    msg = str(info.value)
    assert "b-0001.tar" in msg and f"k{9 + row_in:04d}" in msg
    assert info.value.offset == int(idx.member_offsets[m_in])
    # planned (readers=V): the samples read are checked the same way
    with pytest.raises(IntegrityError, match="member checksum"):
        list(WebDataset(v, verify=True, readers=2, remainder="pad").to_tuple("__key__").batched(2))
    # without verify the flipped byte goes unnoticed
    assert len(list(WebDataset(v))) == len(v)
    with pytest.raises(IntegrityError):
        IndexedDataset(v, verify=True)[9 + row_in]  # the view's sample 11: shard 1's row 2


def test_no_file_descriptors_leak(sets):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    v = View.from_positions(sets.joins["left"], list(range(0, 40, 3)))
    gc.collect()
    gc.disable()  # (a leak must show, not be hidden by a collection of the datasets' cycles)
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            assert len(list(WebDataset(v))) == len(v)
            assert len(list(WebDataset(sets.joins["inner"]))) == 20
            planned = WebDataset(v, readers=2, remainder="pad").to_tuple("__key__").batched(2)
            assert len(list(planned)) > 0
            assert len(list(WebDataset(sets.cols, fields=["txt"], readers=2).batched(4))) > 0
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        gc.enable()


def test_remote_sidecar_and_join_reads_use_ranges_and_only_the_needed_bytes(sets):
    pytest.importorskip(
        "aiohttp", reason="http:// needs the http extra (pip install tarshards[http])"
    )
    from conftest import load_servers

    servers = load_servers()
    root = sets.root

    def sizes(folder, prefix):
        return {
            f"/{folder}/{f}": os.path.getsize(root / folder / f)
            for f in os.listdir(root / folder)
            if f.startswith(prefix) and f.endswith(".tar")
        }

    caption_shards, base_shards, right_shards = (
        sizes("cols", "caption"),
        sizes("base", "b-"),
        sizes("R", "r-"),
    )
    with servers.HTTPFileServer(root) as srv:
        cols = tarshards.Manifest.load(f"{srv.url}/cols/m.json")
        # fields= of the sidecar columns: the caption shards alone, each once
        srv.reset()
        got = [(x["__key__"], x["txt"]) for x in WebDataset(cols, fields=["txt"])]
        assert got == [(f"k{i:04d}", f"a caption of k{i:04d}".encode()) for i in range(40)]
        tar_paths = {p for _m, p, _r in srv.requests if p.endswith(".tar")}
        assert tar_paths == set(caption_shards)
        assert srv.bytes_sent() <= sum(caption_shards.values()) + 4096  # (+ the JSON read)
        # a view of it with fields=: ranged reads of the selected caption rows only
        v = View.from_positions(cols, [3, 21])
        srv.reset()
        got = [x["txt"] for x in WebDataset(v, fields=["txt"])]
        assert got == [b"a caption of k0003", b"a caption of k0021"]
        tar = [(p, r) for _m, p, r in srv.requests if p.endswith(".tar")]
        assert tar and all(r is not None and r.startswith("bytes=") for _p, r in tar), tar
        assert {p for p, _r in tar} <= set(caption_shards)
        assert sum(srv.bytes_sent(p) for p in caption_shards) <= 2 * 2048
        # a join's right side: random access by ranges, only the rows the left side names
        inner = tarshards.Manifest.load(f"{srv.url}/J/inner.json")
        v = View.from_positions(inner, [0, 7])  # two of its 20 rows
        srv.reset()
        got = [(x["__key__"], x["right.png"]) for x in WebDataset(v)]
        assert got == [("k0000", sets.images["img0000"]), ("k0014", sets.images["img0014"])]
        right = [(p, r) for _m, p, r in srv.requests if p in right_shards]
        assert right and all(r is not None and r.startswith("bytes=") for _p, r in right)
        sent_right = sum(srv.bytes_sent(p) for p in right_shards)
        assert sent_right <= 2 * 2048 < sum(right_shards.values()), sent_right
        left = [(p, r) for _m, p, r in srv.requests if p in base_shards]
        assert all(r is not None for _p, r in left)  # the view's left rows: ranges too
        local = tarshards.Manifest.load(sets.base)
        one = int(np.diff(local.load_index(0).sample_offsets[:2])[0])  # a left sample's bytes
        assert sum(srv.bytes_sent(p) for p in base_shards) <= 2 * one + 1024


def short_caption(sample):
    return {"cap.txt": f"c{sample['__key__']}"}


def test_add_columns_over_a_view_is_aligned_with_the_views_rows(sets, tmp_path):
    v = View.from_positions(tarshards.Manifest.load(sets.base), [1, 2, 12, 30, 31, 39])
    v = v.save(str(tmp_path / "few.view.json"))
    out = tarshards.add_columns(
        v.url, short_caption, output=str(tmp_path / "cap" / "m.json"), name="cap", workers=1
    )
    assert isinstance(out, View) and out.url.endswith("cap/m.view.json") and len(out) == 6
    m = tarshards.Manifest.load(str(tmp_path / "cap" / "m.json"))
    g = m.columns[0]
    assert [r.samples for r in g.shards] == list(v.selected_counts)  # only the view's rows
    assert g.rows["view"] == "cap.rows.view.json"
    want = [f"k{i:04d}" for i in (1, 2, 12, 30, 31, 39)]
    # the view returned: every sample has the new field, base fields merged
    got = [(x["__key__"], x["cap.txt"], x["cls"]) for x in WebDataset(out.url)]
    assert got == [(k, f"c{k}".encode(), str(int(k[1:]) % 7).encode()) for k in want]
    assert [x["cap.txt"] for x in WebDataset(out.url, fields=["cap.txt"])] == [
        f"c{k}".encode() for k in want
    ]
    ds = IndexedDataset(out.url)
    assert ds[3]["cap.txt"] == b"ck0030"
    planned = WebDataset(out.url, readers=2, remainder="pad", seed=1).shuffle(2)
    planned = planned.to_tuple("__key__", "cap.txt", "__pad__").batched(2)
    got = [(k, c) for b in planned for k, c, p in zip(*b) if not p]
    assert sorted(got) == [(k, f"c{k}".encode()) for k in want]
    # the manifest read whole: every base row, those outside the view without the field
    rows = list(WebDataset(m))
    assert len(rows) == 40
    assert [x["__key__"] for x in rows if "cap.txt" in x] == want
    # its identity covers the rows: another view's group is another data set
    assert m.fingerprint != tarshards.Manifest.load(sets.cols.url).fingerprint


def test_mix_of_views_of_a_sidecar_manifest_and_of_a_join(sets):
    from tarshards.plan.mixing import mix

    a_view = View.from_positions(sets.cols, range(0, 40, 2))
    b_view = View.from_positions(sets.joins["inner"], range(0, 20, 3))

    def make():
        a = WebDataset(a_view, fields=["txt"], shardshuffle=True, seed=0).shuffle(3)
        b = WebDataset(b_view, shardshuffle=True, seed=0)
        mixed = mix({"a": a, "b": b}, weights={"a": 0.5, "b": 0.5}, readers=2, seed=1)
        return mixed.map(
            lambda s: (s["__key__"], s["__source__"], s.get("txt", s.get("right.png")))
        ).batched(4)

    seen = set()
    for batch in make():
        for k, src, value in zip(*batch):
            i = int(k[1:])
            if src == "a":
                assert i % 2 == 0 and value == f"a caption of {k}".encode()
            else:
                assert value == sets.images[f"img{i:04d}"] and i % 6 == 0  # rows 0, 3, .. of 20
            seen.add(src)
    assert seen == {"a", "b"}
    check_resume(make, epochs=1, cuts=[(0, 2)])
