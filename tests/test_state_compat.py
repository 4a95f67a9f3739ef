"""States saved by an earlier tarshards load, and resume where they were saved.

``tests/data/frozen_states.json`` holds resume states made by tarshards at commit 8777d68 (before
the iteration refactor of the house issue), for both resume paths (the epoch plan, ``readers=V``,
and the plain shard split, which resumes by replay) at the dataset and the ``WebLoader`` level,
together with the digests of the batches the uninterrupted run yielded after each cut. A change
that renames a state key, changes its meaning or changes an order fails here.

Regenerate (only on purpose, when a state format changes with a migration):
``PYTHONPATH=src python tests/test_state_compat.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tarshards import ShardWriter, WebDataset
from tarshards.testing import batch_digest

# the planned pipelines batch 100 samples on 4 readers and drop the remainder (the default), which
# warns; the states were saved so, and the warning has tests of its own
pytestmark = pytest.mark.filterwarnings(
    "ignore:epoch \\d+ drops \\d+ of 100 samples:tarshards.errors.TarshardsWarning"
)

FROZEN = Path(__file__).resolve().parent / "data" / "frozen_states.json"
SHARDS, PER_SHARD = 4, 25


def _write(root: Path) -> list[str]:
    """The data the states were saved against (its fingerprint is in the plan states)."""
    root.mkdir(parents=True, exist_ok=True)
    with ShardWriter(str(root / "data-%06d.tar"), maxcount=PER_SHARD) as sink:
        for i in range(SHARDS * PER_SHARD):
            sink.write({"__key__": f"s{i:05d}", "cls": i % 7, "txt": f"text {i}"})
    return [str(root / f"data-{i:06d}.tar") for i in range(SHARDS)]


def _planned(urls):
    return (
        WebDataset(urls, shardshuffle=True, seed=5, readers=4)
        .shuffle(8)
        .decode()
        .to_tuple("__key__", "cls")
        .batched(4)
    )


def _stream(urls):
    return (
        WebDataset(urls, shardshuffle=True, seed=7)
        .shuffle(10)
        .decode()
        .to_tuple("__key__", "txt")
        .batched(3)
    )


def _digests(it, n=None) -> list[str]:
    out = []
    for b in it:
        out.append(batch_digest(b))
        if n is not None and len(out) == n:
            break
    return out


CASES = {  # name -> (pipeline, cut after this many batches, epoch)
    "planned-dataset": (_planned, 5, 0),
    "planned-dataset-epoch1": (_planned, 3, 1),
    "stream-dataset": (_stream, 4, 0),
}
LOADER_CASES = {"planned-loader": (_planned, 6), "stream-loader": (_stream, 5)}


def _make(root: Path) -> dict:
    """Run each case to its cut, save the state, and record what the run yields next."""
    urls = _write(root)
    out: dict = {"made_at": "8777d68", "cases": {}}
    for name, (build, cut, epoch) in CASES.items():
        ds = build(urls)
        ds.set_epoch(epoch)
        it = iter(ds)
        _digests(it, cut)
        state = ds.state_dict()
        out["cases"][name] = {"epoch": epoch, "state": state, "rest": _digests(it)}
    pytest.importorskip("torch")
    from tarshards import WebLoader

    for name, (build, cut) in LOADER_CASES.items():
        loader = WebLoader(build(urls), batch_size=None, num_workers=0)
        it = iter(loader)
        _digests(it, cut)
        state = loader.state_dict()
        rest = _digests(it)
        out["cases"][name] = {"state": state, "rest": rest, "next_epoch": _digests(loader)}
    return out


@pytest.fixture(scope="module")
def frozen():
    return json.loads(FROZEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_dataset_state_from_before_resumes(tmp_path, frozen, name):
    build, _, _epoch = CASES[name]
    case = frozen["cases"][name]
    ds = build(_write(tmp_path))
    ds.load_state_dict(case["state"])
    assert _digests(ds) == case["rest"]


# a plain pipeline's state resumes only in the place (worker count) it was saved in
@pytest.mark.parametrize(
    "name,workers", [("planned-loader", 0), ("planned-loader", 2), ("stream-loader", 0)]
)
def test_loader_state_from_before_resumes(tmp_path, frozen, name, workers):
    pytest.importorskip("torch")
    from tarshards import WebLoader

    build, _ = LOADER_CASES[name]
    case = frozen["cases"][name]
    loader = WebLoader(build(_write(tmp_path)), batch_size=None, num_workers=workers)
    loader.load_state_dict(case["state"])
    assert _digests(loader) == case["rest"]
    assert _digests(loader) == case["next_epoch"]


# the states were saved without a manifest; a manifest of the same shards describes the same
# data (one fingerprint: shard names and counts), so they load and resume the same through it
@pytest.mark.parametrize("name", ["planned-dataset", "planned-dataset-epoch1"])
def test_state_from_before_resumes_with_a_manifest(tmp_path, frozen, name):
    from tarshards.format.manifest import build_manifest

    build, _, _ = CASES[name]
    case = frozen["cases"][name]
    build_manifest(_write(tmp_path), tmp_path / "data.json", workers=1)
    ds = build(str(tmp_path / "data.json"))
    assert ds.table.manifest.shards[0].hash is not None  # read from the manifest, not scanned
    ds.load_state_dict(case["state"])
    assert _digests(ds) == case["rest"]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_state_from_before_resumes_with_a_manifest(tmp_path, frozen, workers):
    pytest.importorskip("torch")
    from tarshards import WebLoader
    from tarshards.format.manifest import build_manifest

    build, _ = LOADER_CASES["planned-loader"]
    case = frozen["cases"]["planned-loader"]
    build_manifest(_write(tmp_path), tmp_path / "data.json", workers=1)
    loader = WebLoader(build(str(tmp_path / "data.json")), batch_size=None, num_workers=workers)
    loader.load_state_dict(case["state"])
    assert _digests(loader) == case["rest"]
    assert _digests(loader) == case["next_epoch"]


def test_frozen_states_are_what_today_saves(tmp_path, frozen):
    """Today's code saves the same states (keys and values) at the same cuts."""
    made = _make(tmp_path)
    for name, case in frozen["cases"].items():
        assert made["cases"][name]["state"] == case["state"], name


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = _make(Path(tmp))
    FROZEN.parent.mkdir(exist_ok=True)
    FROZEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FROZEN} ({len(data['cases'])} cases)", file=sys.stderr)


# ---- files written by an earlier tarshards: manifests, indexes and views still load ----------

WRITTEN = Path(__file__).resolve().parent / "data" / "written_v1"


def test_files_written_before_the_packages_still_load(tmp_path):
    """``tests/data/written_v1`` holds two shards with their indexes, a manifest and a view,
    written by tarshards at commit a00a5c1 (before the modules moved into packages). Their
    format identifiers are data, not module paths: they load unchanged, and what this tarshards
    writes carries the same identifiers."""
    import json
    import shutil

    import tarshards
    from tarshards.format.index import ShardIndex
    from tarshards.format.manifest import MANIFEST_FORMAT, Manifest, build_manifest
    from tarshards.format.selection import VIEW_FORMAT
    from tarshards.plan.ledger import LEDGER_FORMAT
    from tarshards.read.indexed import IndexedDataset

    data = tmp_path / "v1"
    shutil.copytree(WRITTEN, data)
    m = Manifest.load(str(data / "manifest.json"))
    assert m.num_samples == 12
    ds = IndexedDataset(m)
    assert [ds[i]["__key__"] for i in (0, 7, 11)] == ["s0000", "s0007", "s0011"]
    assert ds[7]["txt"] == b"text 7"
    idx = ShardIndex.load(str(data / "data-000001.tar.tsidx"))
    assert idx.num_samples == 6
    view = tarshards.View.load(str(data / "odd.view.json"))
    keys = [s["__key__"] for s in WebDataset(view)]
    assert keys == [f"s{i:04d}" for i in range(12) if i % 3 != 1]

    # the same identifiers in what is written now
    old = json.loads((data / "manifest.json").read_text())
    assert old["format"] == MANIFEST_FORMAT == "tarshards.manifest"
    assert json.loads((data / "odd.view.json").read_text())["format"] == VIEW_FORMAT
    new = tmp_path / "new"
    urls = _write(new)
    build_manifest(urls, str(new / "manifest.json"))
    assert json.loads((new / "manifest.json").read_text())["format"] == "tarshards.manifest"
    assert LEDGER_FORMAT == "tarshards.ledger/1"
    assert ShardIndex.load(urls[0] + ".tsidx").num_samples == PER_SHARD
    for written in (data / "data-000000.tar.tsidx", Path(urls[0] + ".tsidx")):
        assert b'"format":"tarshards.index"' in written.read_bytes()[:4096]
