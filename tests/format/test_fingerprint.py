"""One record of the data: one fingerprint (shard names and sample counts) whether the shards
were scanned or described by a manifest, so a resume state saved without a manifest loads with
one and back; the manifest's checksum (its file's ``fingerprint`` key) still guards its records,
and a state saved with a manifest by an earlier tarshards (carrying that checksum) still loads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import warnings
from pathlib import Path

import pytest

from tarshards import TarWriter
from tarshards.errors import IntegrityError, ResumeError
from tarshards.format.manifest import Manifest, ShardRecord, build_manifest, data_fingerprint
from tarshards.plan.epoch import ShardTable, scan_shards
from tarshards.storage import open_url
from tarshards.testing import batch_digest, check_resume, run_epochs

COUNTS = [7, 13, 5, 11, 9, 3, 17, 8]  # uneven shards, 73 samples (as in test_resume.py)


def write_uneven(directory, counts=COUNTS, prefix="k"):
    directory.mkdir(parents=True, exist_ok=True)
    urls, n = [], 0
    for s, cnt in enumerate(counts):
        path = directory / f"part-{s:02d}.tar"
        with TarWriter(str(path)) as w:
            for _ in range(cnt):
                w.write({"__key__": f"{prefix}{n:04d}", "cls": str(n % 7).encode()})
                n += 1
        urls.append(str(path))
    return urls


def make_ds(spec, *, torch_ds=False):
    if torch_ds:
        from tarshards.torch.adapter import WebDataset
    else:
        from tarshards.pipeline.dataset import WebDataset
    ds = WebDataset(spec, shardshuffle=True, seed=1, readers=6, remainder="carry")
    return ds.shuffle(5).decode().to_tuple("__key__", "cls", "__pad__").batched(4)


def make_mix(specs):
    from tarshards.pipeline.dataset import WebDataset
    from tarshards.plan.mixing import mix

    a = WebDataset(specs[0], shardshuffle=True, seed=0).shuffle(4).decode()
    b = WebDataset(specs[1], shardshuffle=True, seed=0).decode()
    return (
        mix({"a": a, "b": b}, weights={"a": 0.7, "b": 0.3}, readers=4, stop="first", seed=3)
        .to_tuple("__key__", "__source__", "__pad__")
        .batched(10)
    )


def old_manifest_fingerprint(records) -> str:
    """What ``Manifest.fingerprint`` was before the data had one fingerprint (written out here,
    not taken from tarshards): sha256 over the records' URL, count, size and hash."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.url, r.samples, r.nbytes, r.hash], separators=(",", ":")).encode())
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("record")
    urls = write_uneven(d)
    build_manifest(urls, str(d / "m.json"), workers=1)
    return urls, str(d / "m.json")


def alternating(first, second):
    """A factory whose calls alternate: ``check_resume`` makes the reference run, then for each
    cut the run it saves and the run it loads into, so ``first`` makes the reference and every
    loading run, ``second`` every saving run (and in ``resumes_in_one_epoch`` the two take
    turns)."""
    calls = itertools.count()
    return lambda: (first if next(calls) % 2 == 0 else second)()


def test_a_scan_and_a_manifest_give_one_fingerprint(data):
    urls, path = data
    manifest = Manifest.load(path)
    scanned = scan_shards(urls, opener=lambda u: open_url(u))
    table = ShardTable.from_manifest(manifest, urls)
    assert scanned.counts == table.counts == tuple(COUNTS)
    want = data_fingerprint([f"part-{i:02d}.tar" for i in range(len(COUNTS))], COUNTS)
    assert scanned.fingerprint == table.fingerprint == manifest.fingerprint == want
    # a scan's record is a manifest without sizes and hashes, with the same fingerprint
    rec = scanned.manifest
    assert isinstance(rec, Manifest) and rec.fingerprint == manifest.fingerprint
    assert [r.samples for r in rec.shards] == COUNTS and {r.hash for r in rec.shards} == {None}
    assert rec.checksum != manifest.checksum
    # sizes and hashes are not the data's identity: the same names and counts, one fingerprint
    bare = Manifest(tuple(ShardRecord(r.url, r.samples) for r in manifest.shards))
    assert bare.fingerprint == manifest.fingerprint and bare != manifest
    # the table of a subset, in another order, takes its counts from the records by URL
    sub = ShardTable.from_manifest(manifest, [urls[3], urls[0]])
    assert sub.counts == (COUNTS[3], COUNTS[0])
    assert sub.fingerprint == scan_shards([urls[3], urls[0]], opener=open_url).fingerprint
    assert sub.sample_offsets(0) is not None and list(sub.sample_offsets(0)) == list(
        scanned.sample_offsets(3)
    )


def test_manifest_file_keeps_its_checksum(data, tmp_path):
    """The file format is as before: ``"fingerprint"`` holds the records' checksum (the old
    fingerprint's value), which loading checks; a scan's manifest saves and loads too."""
    urls, path = data
    obj = json.loads(Path(path).read_text())
    manifest = Manifest.load(path)
    assert obj["fingerprint"] == old_manifest_fingerprint(manifest.shards) == manifest.checksum
    assert manifest.to_json()["fingerprint"] == manifest.checksum
    obj["shards"][2]["hash"] = "xxh3_64:0000000000000000"  # a hash edited: refused
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(IntegrityError, match="fingerprint"):
        Manifest.load(tmp_path / "bad.json")
    scanned = scan_shards(urls, opener=open_url).manifest.save(tmp_path / "scan.json")
    again = Manifest.load(tmp_path / "scan.json")
    assert again == scanned and again.fingerprint == manifest.fingerprint


@pytest.mark.parametrize("saved_with", ["scan", "manifest"])
def test_state_moves_between_scan_and_manifest(data, saved_with):
    urls, path = data
    scan = lambda: make_ds(urls)  # noqa: E731
    indexed = lambda: make_ds(path)  # noqa: E731
    loads, saves = (indexed, scan) if saved_with == "scan" else (scan, indexed)
    ref = check_resume(
        alternating(loads, saves), epochs=2, cuts=[(0, 4), (0, "end"), (1, 7)],
        resumes_in_one_epoch=2,
    )  # fmt: skip
    assert ref == run_epochs(saves(), 2)


@pytest.mark.parametrize("saved_with", ["scan", "manifest"])
def test_loader_state_moves_between_scan_and_manifest(data, saved_with):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    urls, path = data

    def loader(spec):
        return lambda: WebLoader(make_ds(spec, torch_ds=True), batch_size=None, num_workers=2)

    loads, saves = (loader(path), loader(urls))
    if saved_with == "manifest":
        loads, saves = saves, loads
    check_resume(alternating(loads, saves), epochs=1, cuts=[(0, 5)])


def _legacy(state: dict, fingerprint: str) -> dict:
    """``state`` as tarshards saved it with a manifest before: the manifest's checksum in it."""
    state = json.loads(json.dumps(state))
    inner = state["dataset"] if state.get("kind") == "loader" else state
    inner["fingerprint"] = fingerprint
    return state


def test_state_saved_with_a_manifest_before_still_loads(data):
    urls, path = data
    manifest = Manifest.load(path)
    old = old_manifest_fingerprint(manifest.shards)
    assert old != manifest.fingerprint
    ds = make_ds(path)
    it = iter(ds)
    head = [batch_digest(next(it)) for _ in range(5)]
    state = ds.state_dict()
    assert state["fingerprint"] == manifest.fingerprint
    rest = [batch_digest(b) for b in it]
    legacy = _legacy(state, old)
    fresh = make_ds(path)
    fresh.load_state_dict(legacy)
    assert fresh.state_dict()["fingerprint"] == manifest.fingerprint  # saved again: today's
    assert [batch_digest(b) for b in fresh] == rest and len(head) == 5
    # without the manifest nothing can tell the checksum is this data's: refused, saying why
    with pytest.raises(ResumeError, match="saved with a manifest by an earlier tarshards"):
        make_ds(urls).load_state_dict(legacy)


def test_loader_state_saved_with_a_manifest_before_still_loads(data):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    _urls, path = data
    old = old_manifest_fingerprint(Manifest.load(path).shards)
    loader = WebLoader(make_ds(path, torch_ds=True), batch_size=None)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    rest = [batch_digest(b) for b in it]
    fresh = WebLoader(make_ds(path, torch_ds=True), batch_size=None)
    fresh.load_state_dict(_legacy(state, old))
    assert [batch_digest(b) for b in fresh] == rest


def test_mixture_state_with_old_source_fingerprints_loads(tmp_path):
    a_urls = write_uneven(tmp_path / "a", [20, 15, 25], prefix="a")
    b_urls = write_uneven(tmp_path / "b", [9, 11], prefix="b")
    a = build_manifest(a_urls, str(tmp_path / "a.json"), workers=1)
    b = build_manifest(b_urls, str(tmp_path / "b.json"), workers=1)
    mixed = make_mix((str(tmp_path / "a.json"), str(tmp_path / "b.json")))
    it = iter(mixed)
    next(it)
    state = mixed.state_dict()
    rest = [batch_digest(x) for x in it]
    fps = {a.fingerprint: old_manifest_fingerprint(a.shards)}
    fps[b.fingerprint] = old_manifest_fingerprint(b.shards)
    legacy = json.loads(json.dumps(state))
    for source in legacy["sources"]:
        source[1] = fps[source[1]]
    fresh = make_mix((str(tmp_path / "a.json"), str(tmp_path / "b.json")))
    fresh.load_state_dict(legacy)
    assert [batch_digest(x) for x in fresh] == rest
    scanned = make_mix((a_urls, b_urls))  # no manifests: today's state loads, the old does not
    scanned.load_state_dict(state)
    assert [batch_digest(x) for x in scanned] == rest
    with pytest.raises(ResumeError, match="does not fit"):
        make_mix((a_urls, b_urls)).load_state_dict(legacy)


def test_other_data_is_still_refused(data, tmp_path):
    urls, path = data
    ds = make_ds(path)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    # one count changed
    changed = write_uneven(tmp_path / "changed", COUNTS[:-1] + [9])
    # one shard renamed (same counts, same bytes)
    renamed_dir = tmp_path / "renamed"
    renamed_dir.mkdir()
    renamed = []
    for i, u in enumerate(urls):
        name = f"part-{i:02d}.tar" if i != 4 else "part-99.tar"
        shutil.copy(u, renamed_dir / name)
        renamed.append(str(renamed_dir / name))
    for other in (changed, renamed):
        build_manifest(other, str(tmp_path / f"{len(other)}-{other[4][-6:]}.json"), workers=1)
        for spec in (other, str(tmp_path / f"{len(other)}-{other[4][-6:]}.json")):
            with pytest.raises(ResumeError, match="fingerprint: saved"):
                make_ds(spec).load_state_dict(state)
    # the same data moved elsewhere as a whole keeps its fingerprint
    moved_dir = tmp_path / "moved"
    moved_dir.mkdir()
    moved = [str(shutil.copy(u, moved_dir)) for u in urls]
    make_ds(moved).load_state_dict(state)
