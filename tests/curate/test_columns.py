"""``tarshards.add_columns``: sidecar column groups aligned row by row with their base, read
merged (plain, random access, planned with exact and elastic resume), ``fields=`` that never opens
the base shards, corruption named (issue 37, item 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tarshards
from tarshards import IndexedDataset, Manifest, ShardWriter, WebDataset
from tarshards.errors import IntegrityError, ShardFormatError, TarshardsError
from tarshards.testing import check_resume


def caption(sample):
    """The new fields of a sample (module level: the processes engine pickles it)."""
    n = int(sample["cls"])
    return {"txt": f"a caption of {sample['__key__']}", "score.json": {"n": n, "sq": n * n}}


def length(sample):
    return {"len.txt": str(len(sample["txt"]))}


def write_base(folder, n=37, maxcount=10, size=64):
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    with ShardWriter(
        str(folder / "b-%04d.tar"), maxcount=maxcount, manifest=str(folder / "m.json")
    ) as w:
        for i in range(n):
            sample = {"__key__": f"k{i:04d}", "bin": bytes([i % 251]) * (size + i), "cls": i % 7}
            w.write(sample)
            rows.append(sample)
    return str(folder / "m.json"), rows


@pytest.fixture(scope="module")
def cols(tmp_path_factory):
    root = tmp_path_factory.mktemp("cols")
    base, rows = write_base(root / "base")
    m = tarshards.add_columns(
        base,
        caption,
        output=str(root / "cols" / "m.json"),
        name="caption",
        workers=2,
        progress=False,
    )
    return root, base, m, rows


def expected(sample):
    new = caption(sample)
    return {
        "txt": new["txt"].encode(),
        "score.json": json.dumps(new["score.json"], separators=(",", ":")).encode(),
    }


def test_manifest_records_the_group_and_base(cols):
    root, base, m, _rows = cols
    again = Manifest.load(root / "cols" / "m.json")
    assert again == m and len(again.columns) == 1
    g = again.columns[0]
    assert g.name == "caption" and g.fields == ("score.json", "txt")
    assert [r.samples for r in g.shards] == [r.samples for r in again.shards] == [10, 10, 10, 7]
    assert all(r.hash and r.nbytes and r.index for r in g.shards)
    assert again.base_ref["manifest"] == "../base/m.json"
    assert again.base_ref["checksum"] == Manifest.load(base).checksum
    # the base's shards are named relative to the sidecar manifest
    assert again.shards[0].url == "../base/b-0000.tar"
    # the fingerprint covers the base and the group; the base's stays as it was
    plain = Manifest.load(base)
    assert again.fingerprint != plain.fingerprint
    assert again.plain().fingerprint == plain.fingerprint
    # an older manifest (no columns) writes no new keys and loads unchanged
    assert "columns" not in plain.to_json() and "base" not in plain.to_json()


def test_merged_samples_are_base_plus_new_fields(cols):
    root, base, _m, rows = cols
    got = list(WebDataset(str(root / "cols" / "m.json")))
    base_samples = list(WebDataset(base))
    assert len(got) == len(rows) == len(WebDataset(str(root / "cols" / "m.json")))
    for g, b in zip(got, base_samples):
        want = {k: v for k, v in b.items() if k != "__url__"}
        want.update(expected(b))
        assert {k: v for k, v in g.items() if k != "__url__"} == want
    ids = IndexedDataset(str(root / "cols" / "m.json"))
    assert len(ids) == len(rows)
    for i in (0, 9, 10, 36):
        assert {k: v for k, v in ids[i].items() if k != "__url__"} == {
            k: v for k, v in got[i].items() if k != "__url__"
        }


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(1, 30),
    maxcount=st.integers(1, 9),
    fields=st.sampled_from([None, ["txt"], ["cls", "txt"], ["bin"], ["score.json", "cls"]]),
)
def test_property_merged_equals_base_plus_fields(tmp_path_factory, n, maxcount, fields):
    root = tmp_path_factory.mktemp("prop")
    base, rows = write_base(root / "base", n=n, maxcount=maxcount, size=5)
    out = str(root / "cols" / "m.json")
    tarshards.add_columns(base, caption, output=out, engine="processes", workers=1, progress=False)
    want = []
    for r in rows:
        whole = {"__key__": r["__key__"], "bin": r["bin"], "cls": str(r["cls"]).encode()}
        whole.update(expected(r))
        if fields is not None:
            whole = {k: v for k, v in whole.items() if k in fields or k == "__key__"}
        want.append(whole)

    def strip(s):
        return {k: v for k, v in s.items() if k not in ("__url__", "__offset__")}

    assert [strip(s) for s in WebDataset(out, fields=fields)] == want
    ids = IndexedDataset(out, fields=fields)
    assert [strip(ids[i]) for i in range(len(ids))] == want
    planned = WebDataset(out, fields=fields, readers=1, shardshuffle=False, remainder="pad")
    got = [
        strip({k: v for k, v in s.items() if k != "__pad__"})
        for s in planned.batched(1).unbatched()
    ]
    assert got == want


def test_fields_of_the_sidecar_never_open_the_base(cols, tmp_path):
    root, _base, _m, rows = cols
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "base")  # the base shards (and manifest) moved away
    out = str(copy / "cols" / "m.json")
    got = list(WebDataset(out, fields=["txt"]))
    assert [s["txt"] for s in got] == [expected(r)["txt"] for r in rows]
    assert all(set(s) == {"__key__", "__url__", "__offset__", "txt"} for s in got)
    ids = IndexedDataset(out, fields=["txt", "score.json"])
    assert ids[12]["score.json"] == expected(rows[12])["score.json"]
    planned = WebDataset(out, fields=["txt"], readers=2, seed=3, remainder="pad").shuffle(4)
    keys = [k for b in planned.batched(3) for k, p in zip(b["__key__"], b["__pad__"]) if not p]
    assert sorted(keys) == [r["__key__"] for r in rows]
    with pytest.raises(TarshardsError):  # a base field needs the base
        list(WebDataset(out, fields=["bin"]))


def make_planned(out, *, fields=None, torch_ds=False, **kw):
    cls = WebDataset
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as cls
    ds = cls(out, fields=fields, shardshuffle=True, seed=1, readers=6, remainder="pad", **kw)
    return ds.shuffle(5).to_tuple("__key__", "txt", "__pad__").batched(3)


def test_planned_resume_over_sidecar_columns(cols):
    root, _base, _m, _rows = cols
    out = str(root / "cols" / "m.json")
    ref = check_resume(lambda: make_planned(out), epochs=2, resumes_in_one_epoch=2)
    assert len(ref[0]) == len(make_planned(out)) and ref[0] != ref[1]
    # the txt of each key is its own (rows stay aligned through the shuffle and resume)
    for b in make_planned(out):
        for k, t, _ in zip(*b):
            assert t == f"a caption of {k}".encode()


def test_resume_through_webloader_with_two_workers(cols):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    root, _base, _m, _rows = cols
    out = str(root / "cols" / "m.json")
    check_resume(
        lambda: WebLoader(
            make_planned(out, fields=["txt"], torch_ds=True), batch_size=None, num_workers=2
        ),
        epochs=1,
        cuts=[(0, 5)],
    )


def test_elastic_resume_over_sidecar_columns(cols):
    root, _base, _m, rows = cols
    out = str(root / "cols" / "m.json")
    first = [[] for _ in range(2)]
    saved = None
    for r in range(2):
        ds = make_planned(out, rank=r, world_size=2)
        it = iter(ds)
        first[r] = [next(it) for _ in range(2)]
        if r == 0:
            saved = ds.state_dict()
    after = []
    for r in range(3):
        ds = make_planned(out, rank=r, world_size=3)
        ds.load_state_dict(saved)
        after.append(list(ds))
    assert len({len(x) for x in after}) == 1
    got = [
        k
        for b in first[0] + first[1] + [b for x in after for b in x]
        for k, _, p in zip(*b)
        if not p
    ]
    assert sorted(got) == [r["__key__"] for r in rows]


def test_a_state_of_another_field_selection_is_refused(cols):
    root, _base, _m, _rows = cols
    out = str(root / "cols" / "m.json")
    ds = make_planned(out)
    next(iter(ds))
    with pytest.raises(tarshards.errors.ResumeError, match="fingerprint"):
        make_planned(out, fields=["txt"]).load_state_dict(ds.state_dict())


def test_a_group_over_a_group(cols, tmp_path):
    """add_columns over a manifest with columns: fn sees them merged; both groups are kept."""
    root, _base, _m, _rows = cols
    out = str(tmp_path / "more" / "m.json")
    m2 = tarshards.add_columns(
        str(root / "cols" / "m.json"),
        length,
        output=out,
        fields=["txt"],
        name="len",
        workers=1,
        progress=False,
    )
    assert [g.name for g in m2.columns] == ["caption", "len"]
    got = list(WebDataset(out, fields=["len.txt", "txt"]))
    assert all(int(s["len.txt"]) == len(s["txt"]) for s in got)


def test_misaligned_sidecar_is_named(cols, tmp_path):
    root, _base, _m, _rows = cols
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    # a sidecar shard rewritten with another key in row 3 (its index made for it)
    shard = copy / "cols" / "caption-000001.tar"
    with tarshards.TarWriter(str(shard), index=str(shard) + ".tsidx") as w:
        for i in range(10, 20):
            w.write({"__key__": "zzz" if i == 13 else f"k{i:04d}", "txt": "x"})
    # the manifest refreshed to the new shard's size and hash
    mm = Manifest.load(copy / "cols" / "m.json")
    idx = tarshards.ShardIndex.load(str(shard) + ".tsidx")
    g = mm.columns[0]
    recs = list(g.shards)
    from dataclasses import replace

    recs[1] = replace(recs[1], nbytes=idx.nbytes, hash=idx.hash)
    mm = replace(mm, columns=(replace(g, shards=tuple(recs), fields=("txt",)),), url=None)
    mm.save(copy / "cols" / "m.json")
    with pytest.raises(ShardFormatError, match=r"'zzz' where 'k0013'") as exc:
        list(WebDataset(str(copy / "cols" / "m.json")))
    assert exc.value.url.endswith("caption-000001.tar") and exc.value.member.startswith("zzz.")
    assert exc.value.offset == 3 * 1024


def test_sidecar_corruption_named_by_tarcheck_and_verify(cols, tmp_path):
    root, _base, _m, rows = cols
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shard = copy / "cols" / "caption-000002.tar"
    data = bytearray(shard.read_bytes())
    at = data.index(b"a caption of k0025")
    data[at] ^= 0x20  # one byte of a member's data
    shard.write_bytes(bytes(data))
    out = str(copy / "cols" / "m.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "tarshards.cli.main", "check", "--manifest", out],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "caption-000002.tar" in proc.stderr and "hash" in proc.stderr
    assert "k0025.txt" in proc.stderr  # the member whose checksum differs
    assert "b-0002.tar" not in proc.stderr  # the base is sound
    with pytest.raises(IntegrityError) as exc:
        list(WebDataset(out, verify=True))
    assert exc.value.url.endswith("caption-000002.tar")
    with pytest.raises(IntegrityError) as exc:
        IndexedDataset(out, verify=True)[25]
    assert exc.value.url.endswith("caption-000002.tar") and exc.value.member == "k0025.txt"
    assert len(list(WebDataset(out, verify=True, fields=["bin"]))) == len(rows)  # base only


def test_arguments_checked(cols, tmp_path):
    root, base, _m, _rows = cols
    with pytest.raises(TypeError):
        tarshards.add_columns(base, 3, output=str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="already"):
        tarshards.add_columns(
            str(root / "cols" / "m.json"), caption, output=str(tmp_path / "y.json"), name="caption"
        )
    with pytest.raises(ValueError, match="fields="):
        WebDataset(str(root / "base" / "b-0000.tar"), fields=["txt"])


def empty(sample):
    return {}


def test_a_row_without_new_fields_fails(cols, tmp_path):
    _root, base, _m, _rows = cols
    with pytest.raises(ShardFormatError, match="one or more new fields"):
        tarshards.add_columns(
            base, empty, output=str(tmp_path / "e.json"), workers=1, progress=False
        )


def test_mix_of_a_sidecar_manifest_and_a_plain_one(cols, tmp_path):
    """mix() reads a sidecar manifest's rows merged (its readers are the layout's), and resumes."""
    from tarshards.plan.mixing import mix

    other, _ = write_base(tmp_path / "other", n=20, maxcount=6)
    out = str(cols[0] / "cols" / "m.json")

    def make():
        a = WebDataset(out, fields=["txt"], shardshuffle=True, seed=0).shuffle(3)
        b = WebDataset(other, shardshuffle=True, seed=0)
        mixed = mix({"a": a, "b": b}, weights={"a": 0.5, "b": 0.5}, readers=2, seed=1)
        return mixed.map(lambda s: (s["__key__"], s["__source__"], s.get("txt", b""))).batched(4)

    seen = 0
    for batch in make():
        for k, src, txt in zip(*batch):
            if src == "a":
                assert txt == f"a caption of {k}".encode()
                seen += 1
    assert seen
    check_resume(make, epochs=1, cuts=[(0, 2)])


def test_a_missing_sidecar_shard_goes_to_on_error(cols, tmp_path):
    """A sidecar shard that cannot be read is a shard error: raised naming it, or skipped
    with the rest of its base shard under on_error="skip"."""
    copy = tmp_path / "copy"
    shutil.copytree(cols[0], copy)
    (copy / "cols" / "caption-000001.tar").unlink()
    out = str(copy / "cols" / "m.json")
    with pytest.raises(TarshardsError) as exc:
        list(WebDataset(out))
    assert "caption-000001.tar" in str(exc.value)
    got = [s["__key__"] for s in WebDataset(out, on_error="skip")]
    assert got == [r["__key__"] for r in cols[3] if not 10 <= int(r["__key__"][1:]) < 20]
