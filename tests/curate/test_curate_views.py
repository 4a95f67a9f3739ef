"""``tarshards.view`` (filter), ``tarshards.dedup`` and ``tarshards.split`` (issue 37, items 1
and 4): views made from a function, keys, duplicates or a hash of the key, saved beside the data,
without copying any sample."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tarshards
from tarshards import IndexedDataset, Manifest, TarWriter, View, WebDataset, build_manifest


def write_shards(d, counts, start=0, prefix="part"):
    """Shards of ``counts`` samples (keys k0000...), with their indexes; returns their paths."""
    n = start
    paths = []
    for s, cnt in enumerate(counts):
        path = str(d / f"{prefix}-{s:02d}.tar")
        with TarWriter(path, index=True) as w:
            for _ in range(cnt):
                w.write(
                    {
                        "__key__": f"k{n:04d}",
                        "txt": f"value {n} " + "x" * (n % 17),
                        "cls": str(n % 7),
                        "bin": bytes([n % 251]) * 700,
                    }
                )
                n += 1
        paths.append(path)
    return paths


def all_keys(m):
    return [f"k{i:04d}" for i in range(m.num_samples)]


COUNTS = [14, 9, 20, 11]  # 54 samples


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("curate")
    m = build_manifest(write_shards(d, COUNTS), str(d / "m.json"))
    return d, m


def is_even(sample):  # module level: the processes engine pickles it
    return int(sample["cls"]) % 2 == 0


def long_text(sample):
    return len(sample["txt"]) > 12


def keys_of(record):
    return [s["__key__"] for s in WebDataset(record)]


def test_view_by_function_on_processes(data):
    d, m = data
    out = d / "even.view.json"
    v = tarshards.view(str(d / "m.json"), is_even, output=out, workers=2)
    want = [k for i, k in enumerate(all_keys(m)) if (i % 7) % 2 == 0]
    assert isinstance(v, View) and v.url == str(out) and out.exists()
    assert keys_of(str(out)) == want and len(v) == len(want)
    assert v.info["kept"] == len(want) and v.info["removed"] == m.num_samples - len(want)
    # a view of the view: rows of its rows, the function reading only its samples
    vv = tarshards.view(out, long_text, exclude={"k0000"}, output=d / "even-long.view.json")
    want2 = [
        k
        for k in want
        if len(f"value {int(k[1:])} " + "x" * (int(k[1:]) % 17)) > 12 and k != "k0000"
    ]
    assert keys_of(vv) == want2 and vv.parent == str(out) and vv.manifest == m
    assert View.load(d / "even-long.view.json") == vv


def test_view_by_keys_and_exclude_reads_no_data(data, tmp_path):
    d, m = data
    moved = tmp_path / "copy"
    shutil.copytree(d, moved)
    for p in moved.glob("*.tar"):  # the shards' bytes are never read: only indexes
        p.write_bytes(b"")
    src = str(moved / "m.json")
    keep = {"k0003", "k0020", "k0050", "nope"}
    v = tarshards.view(src, keep, output=None)
    assert v.global_rows().tolist() == [3, 20, 50]
    v = tarshards.view(src, exclude=["k0001", "k0002"], output=moved / "x.view.json")
    assert len(v) == m.num_samples - 2 and v.info["removed"] == 2
    with pytest.raises(TypeError, match="collection of keys"):
        tarshards.view(src, "k0001", output=None)


def test_view_with_decode_on_dask(data, tmp_path):
    pytest.importorskip("distributed")

    d, m = data
    v = tarshards.view(
        str(d / "m.json"),
        is_even_decoded,
        decode=True,  # fields by extension: cls -> int, txt -> str
        output=tmp_path / "v.view.json",
        engine="dask",
        workers=1,
    )
    want = [k for i, k in enumerate(all_keys(m)) if (i % 7) % 2 == 0]
    assert keys_of(v) == want


def is_even_decoded(sample):
    assert isinstance(sample["cls"], int) and isinstance(sample["txt"], str)
    return sample["cls"] % 2 == 0


# ---- dedup ------------------------------------------------------------------------------------


def write_with_duplicates(d, counts, planted: dict[int, int]):
    """Shards of ``counts`` samples; sample ``j`` in ``planted`` is a copy (under another key)
    of sample ``planted[j]`` (< j; of what that one holds, itself maybe a copy). Returns the
    manifest and the samples that are not a copy of an earlier one."""
    total = sum(counts)
    content_id = list(range(total))
    for j in sorted(planted):
        content_id[j] = content_id[planted[j]]
    firsts = _firsts(content_id)
    paths, n = [], 0

    def content(i):
        return {"txt": f"text {i}".encode(), "bin": bytes([i % 251]) * (50 + i % 9)}

    for s, cnt in enumerate(counts):
        path = str(d / f"dup-{s:02d}.tar")
        with TarWriter(path, index=True) as w:
            for _ in range(cnt):
                w.write({"__key__": f"s{n:04d}", **content(content_id[n])})
                n += 1
        paths.append(path)
    return build_manifest(paths, str(d / "dup.json")), firsts


def _firsts(ids):
    seen, out = set(), []
    for i, c in enumerate(ids):
        if c not in seen:
            seen.add(c)
            out.append(i)
    return out


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    counts=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    picks=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=12),
)
def test_dedup_by_content_finds_exactly_the_planted_duplicates(tmp_path_factory, counts, picks):
    d = tmp_path_factory.mktemp("dup")
    total = sum(counts)
    planted: dict[int, int] = {}
    for a, b in picks:
        j = a % total
        if j:
            planted[j] = b % j
    m, firsts = write_with_duplicates(d, counts, planted)
    v = tarshards.dedup(str(d / "dup.json"), output=d / "dedup.view.json")
    assert keys_of(v) == [f"s{i:04d}" for i in firsts]
    assert v.removed == total - len(firsts) and len(v) == len(firsts)
    assert View.load(d / "dedup.view.json") == v and v.manifest == m


def test_dedup_by_content_reads_no_data_and_tells_fields_apart(tmp_path):
    planted = {3: 1, 7: 1, 9: 2}
    m, _ = write_with_duplicates(tmp_path, [6, 6], planted)
    for p in tmp_path.glob("*.tar"):
        p.write_bytes(b"")  # never read
    v = tarshards.dedup(m, output=None)
    assert v.global_rows().tolist() == [0, 1, 2, 4, 5, 6, 8, 10, 11]


def text_of(sample):
    return sample["txt"].decode().split()[0]  # "text": every sample the same


def test_dedup_by_field_and_function(tmp_path):
    planted = {4: 0, 5: 2}
    m, _ = write_with_duplicates(tmp_path, [5, 4], planted)
    v = tarshards.dedup(m, by="txt", output=None, workers=1)
    assert v.global_rows().tolist() == [0, 1, 2, 3, 6, 7, 8]
    v = tarshards.dedup(m, by=text_of, output=None, workers=1)
    assert v.global_rows().tolist() == [0] and v.info["removed"] == 8
    v = tarshards.dedup(m, by="nothere", output=None, workers=1)  # no value: no duplicates
    assert len(v) == 9


# ---- split ------------------------------------------------------------------------------------


def test_split_disjoint_covering_and_stable_when_shards_are_appended(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    first = write_shards(d, [30, 25, 40], prefix="a")
    m1 = build_manifest(first, str(d / "m1.json"))
    fracs = {"train": 0.8, "val": 0.15, "test": 0.05}
    s1 = tarshards.split(m1, fracs, output_dir=d / "splits1", seed=3)
    assert set(s1) == set(fracs)
    for name in fracs:
        assert (d / "splits1" / f"{name}.view.json").exists()
        assert View.load(d / "splits1" / f"{name}.view.json") == s1[name]
    rows = [set(v.global_rows().tolist()) for v in s1.values()]
    assert sum(len(r) for r in rows) == m1.num_samples
    assert set().union(*rows) == set(range(m1.num_samples))
    assert 60 <= len(s1["train"]) <= 92  # about 80% of 95
    # more shards appended: no sample of before changes split
    more = write_shards(d, [33, 21], start=95, prefix="b")
    m2 = build_manifest(first + more, str(d / "m2.json"))
    s2 = tarshards.split(str(d / "m2.json"), fracs, output_dir=d / "splits2", seed=3)
    for name in fracs:
        before = set(keys_of(s1[name]))
        after = set(keys_of(s2[name]))
        assert before == {k for k in after if int(k[1:]) < 95}
    assert sum(len(v) for v in s2.values()) == m2.num_samples
    # another seed: another split
    s3 = tarshards.split(m1, fracs, output_dir=None, seed=4)
    assert keys_of(s3["val"]) != keys_of(s1["val"])
    # a split of a view splits its samples
    half = View.from_positions(m1, range(0, m1.num_samples, 2))
    sv = tarshards.split(half, {"a": 1, "b": 1}, output_dir=None)
    assert sorted(sv["a"].global_rows().tolist() + sv["b"].global_rows().tolist()) == list(
        range(0, m1.num_samples, 2)
    )
    with pytest.raises(ValueError, match="shares"):
        tarshards.split(m1, {"a": -1}, output_dir=None)


def test_views_made_here_read_everywhere(data, tmp_path):
    d, m = data
    v = tarshards.dedup(m, output=d / "all.view.json")  # no duplicates: every sample
    assert v.fingerprint == m.fingerprint and len(v) == m.num_samples
    parts = tarshards.split(str(d / "m.json"), {"a": 0.5, "b": 0.5}, output_dir=tmp_path)
    ds = IndexedDataset(str(tmp_path / "a.view.json"))
    assert [ds[i]["__key__"] for i in range(len(ds))] == keys_of(parts["a"])
    assert json.loads((tmp_path / "a.view.json").read_text())["format"] == "tarshards.view"
    assert os.path.isabs(json.loads((tmp_path / "a.view.json").read_text())["manifest"])
    assert isinstance(Manifest.load(str(d / "m.json")), Manifest)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=40))
def test_first_of_each_group_of_equal_digests(rows):
    from tarshards.curate.views import _first_of_each  # the grouping dedup runs on digests

    d = np.array(rows, dtype=np.uint64).reshape(-1, 2)
    seen: dict = {}
    for i, r in enumerate(rows):
        seen.setdefault(r, i)
    assert _first_of_each(d).tolist() == sorted(seen.values())
