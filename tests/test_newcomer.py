"""The walkthrough of issue 42: a newcomer's five tasks, from the documentation's own code blocks.

The README's quickstart, then (1) images to shards with a manifest and the command-line tools,
(2) two epochs through a 2-worker loader, (3) stop and resume mid-epoch, (4) ``len()`` and
``ds[i]``, (5) a parallel resize and its rerun. The code is not copied here: each test runs the
blocks of a page in order (as tests/test_docs.py does), up to the block a task needs, and then
checks what a newcomer would look at: nothing dropped or repeated silently, warnings where they
are due and only there.
"""

from __future__ import annotations

import types
import warnings

import pytest
from test_docs import (
    ROOT,
    RUN_PY,
    RUN_SH,
    _run_python,
    _run_shell,
    _skip_if_needs_missing,
    extract_blocks,
)

from tarshards.errors import TarshardsWarning


def run_doc(name: str, cwd, until: str | None = None) -> types.SimpleNamespace:
    """Run the blocks of ``name`` (README.md, docs/x.md) in order in ``cwd``, through the first
    one whose code contains ``until``; its namespace, with ``warnings`` (TarshardsWarnings
    raised in this process) and ``ran`` (the blocks run)."""
    path = ROOT / name
    module = types.ModuleType("tarshards_newcomer_" + path.stem.replace("-", "_"))
    module.__file__ = str(path)
    ran = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in extract_blocks(path.read_text()):
            if block["skip"] or block["lang"] not in RUN_PY | RUN_SH:
                continue
            where = f"{name}:{block['line']}"
            try:
                if block["lang"] in RUN_PY:
                    _run_python(block["code"], path, block["line"], module)
                else:
                    _run_shell(block["code"], where, cwd)
            except Exception as exn:  # the lean install: skip where an optional package is due
                _skip_if_needs_missing(where, f"{type(exn).__name__}: {exn}")
                raise
            ran.append(block["code"])
            if until is not None and until in block["code"]:
                break
        else:
            if until is not None:
                raise AssertionError(f"no block of {name} contains {until!r}")
    ns = types.SimpleNamespace(**vars(module))
    ns.warnings = [w for w in caught if issubclass(w.category, TarshardsWarning)]
    ns.ran = ran
    return ns


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_quickstart_then_two_epochs_through_a_two_worker_loader(here, capfd):
    """The README's quickstart as written (shards with a manifest, reading, a 2-worker
    WebLoader, the command-line tools, map_shards), then task 2: two full epochs through its
    loader, each with every sample, in two different orders, without a warning."""
    pytest.importorskip("torch")
    ns = run_doc("README.md", here)
    assert any("tarcheck train.json" in code for code in ns.ran)  # the manifest as a CLI spec
    assert [r.status for r in ns.reports] == ["done"] * 4
    assert ns.warnings == []
    assert ns.loader.num_workers == 2
    orders = []
    for _epoch in range(2):
        classes = [int(c) for _images, batch in ns.loader for c in batch]
        assert len(classes) == 400  # every sample of the data, each epoch
        assert sorted(classes) == sorted(i % 10 for i in range(400))
        orders.append(classes)
    assert orders[0] != orders[1]  # WebLoader moves the epoch: a new order
    assert "again" not in capfd.readouterr().err  # no "starts epoch 0 ... again" warning


def test_images_to_shards_with_a_manifest_and_the_cli(here, monkeypatch):
    """Task 1: the README's images written with a manifest, checked by the tools; format.md's
    manifest read by the tools as a spec (tarcheck, tarscat)."""
    ns = run_doc("README.md", here, until='manifest="train.json"')
    assert [info.url for info in ns.sink.shards] == [f"train-{i:06d}.tgz" for i in range(4)]
    from tarshards import Manifest, WebDataset

    m = Manifest.load("train.json")
    assert m.num_samples == 400 and len(WebDataset("train.json")) == 400
    (here / "fmt").mkdir()
    monkeypatch.chdir(here / "fmt")
    fmt = run_doc("docs/format.md", here / "fmt", until="tarscat -c 3 ds/manifest.json")
    assert any("tarcheck -q ds/manifest.json" in code for code in fmt.ran)


def test_stop_and_resume_mid_epoch(here):
    """Task 3: distributed.md's resume recipe (a 2-worker loader stopped after 7 batches, its
    state loaded into a 3-worker one) gives the rest exactly, and over the epoch every sample
    once; it chooses its remainder, so nothing is dropped without a word."""
    pytest.importorskip("torch")
    ns = run_doc("docs/distributed.md", here, until="resumed.load_state_dict(state)")
    assert 'remainder="carry"' in ns.ran[-1]
    keys = [k for batch, _ in ns.first + ns.again for k in batch]
    assert len(keys) == len(set(keys)) == 80  # 7 batches before the stop, 13 after: all 80
    assert not [w for w in ns.warnings if "drops" in str(w.message)]
    # the same recipe on 90 samples (10 more than 10 readers x 2 batches x 4): what the first
    # epoch cannot fit opens the next one, so two epochs deliver every sample
    from tarshards import ShardWriter, WebLoader

    with ShardWriter("more-%04d.tar", maxcount=30) as sink:
        for i in range(90):
            sink.write({"__key__": f"m{i:03d}", "cls": i % 10})
    ns.planned.__globals__["urls"] = "more-{0000..0002}.tar"
    loader = WebLoader(ns.planned(), batch_size=None, num_workers=2)
    seen = [k for _ in range(2) for batch, _ in loader for k in batch]
    assert set(seen) == {f"m{i:03d}" for i in range(90)}
    # without the recipe's choice the default drops them, and says how many
    ds = ns.WebDataset("more-{0000..0002}.tar", shardshuffle=True, readers=10)
    ds = ds.decode().to_tuple("__key__", "cls").batched(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sum(len(batch) for batch, _ in ds) == 80
    assert ["epoch 0 drops 10 of 90 samples" in str(w.message) for w in caught] == [True]


def test_len_and_random_access(here):
    """Task 4: format.md's manifest gives len() and ds[i]; indexing the stream says where to
    go."""
    ns = run_doc("docs/format.md", here, until="IndexedDataset(")
    assert len(ns.ds) == 100 and ns.ds[99]["__key__"] == "s00099"
    with pytest.raises(TypeError, match="IndexedDataset"):
        ns.WebDataset("ds/manifest.json")[5]


def test_a_parallel_resize_and_its_rerun(here):
    """Task 5: processing.md's map_shards, then its rerun with a changed function: the outputs
    kept, a warning saying so and how to redo them, and the redo."""
    ns = run_doc("docs/processing.md", here, until="overwrite=True")
    assert {r.status for r in ns.again} == {"skipped"}
    said = [str(w.message) for w in ns.caught]
    assert len(said) == 1 and "4 of 4 outputs exist already" in said[0]
    assert "overwrite=True" in said[0]
    sizes = {s["png"].size for s in ns.WebDataset("resized-{0000..0003}.tar").decode("pil")}
    assert sizes == {(16, 16)}  # made again, by the changed function
