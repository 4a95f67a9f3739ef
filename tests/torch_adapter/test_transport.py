"""Batches through shared-memory slots: same batches as DataLoader's own path, no leftovers."""

from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import write_shards

from tarshards.torch.transport import Packer, Ticket, Unpacker

pytestmark = pytest.mark.timeout(240)

Pair = collections.namedtuple("Pair", "image label")


def _same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a).__module__ == "torch":
        import torch

        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_round_trip_of_nested_batches_in_one_process():
    rng = np.random.default_rng(0)
    packer, unpacker = Packer(slots=3, min_bytes=0), Unpacker()
    batches = []
    for i in range(10):
        n = 16 + i  # growing batches: the ring is outgrown and replaced
        batches.append(
            {
                "x": rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
                "pair": Pair(rng.random((n, 5)).astype(np.float32), np.arange(n)),
                "keys": [f"k{j}" for j in range(n)],
                "nested": [np.full((n,), i, dtype=np.int16), "text", 3.5],
                "fortran": np.asfortranarray(rng.random((n, 7))),
                "objects": np.array([object()] * 2),
            }
        )
    tickets = [packer(b) for b in batches[:3]]
    assert all(isinstance(t, Ticket) for t in tickets)
    # three slots: three batches can wait at once and each still comes back intact
    for b, t in zip(batches[:3], tickets):
        out = unpacker(t)
        assert _same(
            {k: v for k, v in b.items() if k != "objects"},
            {k: v for k, v in out.items() if k != "objects"},
        )
        assert out["objects"] is b["objects"]  # object arrays are not packed
        assert isinstance(out["pair"], Pair) and out["x"].flags.writeable
    for b in batches[3:]:
        out = unpacker(packer(b))
        assert _same(b["x"], out["x"]) and _same(b["pair"], out["pair"])
        assert out["keys"] == b["keys"] and _same(b["fortran"], out["fortran"])
    unpacker.close()


def test_small_or_arrayless_batches_pass_through():
    packer = Packer(slots=2)  # default threshold: 32 KiB of array data
    small = (np.zeros(10, dtype=np.uint8), [1, 2])
    assert packer(small) is small
    keys = ["a", "b"]
    assert packer(keys) is keys
    assert Unpacker()(keys) is keys


def test_copied_out_batches_survive_slot_reuse():
    packer, unpacker = Packer(slots=2, min_bytes=0), Unpacker()
    kept = [unpacker(packer(np.full((100, 100), i, dtype=np.int32))) for i in range(6)]
    assert [int(k[0, 0]) for k in kept] == list(range(6))
    assert all(int(k.min()) == int(k.max()) == i for i, k in enumerate(kept))


def test_views_hold_their_slot_until_collected():
    packer, unpacker = Packer(slots=2, min_bytes=0), Unpacker(copy=False)
    first = unpacker(packer((np.full((64, 64), 1, dtype=np.int32), np.arange(3))))
    second = unpacker(packer({"x": np.full((64, 64), 2, dtype=np.int32)}))
    assert not first[0].flags.owndata and first[0].flags.writeable  # a view of the slot
    # both slots are held: the next batch comes back unchanged (the usual way), not by a slot
    third = np.full((64, 64), 3, dtype=np.int32)
    assert packer(third) is third and unpacker.tickets == 2
    view_of_view = first[0][10:20].T  # keeps the slot as much as the batch does
    del first
    assert packer(third) is third
    del view_of_view
    fourth = unpacker(packer(np.full((64, 64), 4, dtype=np.int32)))  # the freed slot again
    assert unpacker.tickets == 3
    assert int(second["x"].min()) == int(second["x"].max()) == 2  # untouched
    assert int(fourth.min()) == int(fourth.max()) == 4
    unpacker.close()  # batches still alive keep their mapping
    assert int(second["x"].sum()) == 2 * 64 * 64


def _primed(slots=3):
    """A packer whose ring exists (the first batch sizes it): 4 KiB slots and more."""
    packer, unpacker = Packer(slots=slots, min_bytes=0), Unpacker(copy=False)
    del unpacker  # the first batch only sized the ring; its slot is given back
    first = packer(np.zeros(3000, dtype=np.uint8))
    packer._ring.busy[first.slot] = 0
    return packer


def test_arrays_made_in_the_open_slot_travel_without_a_copy():
    packer = _primed()
    unpacker = Unpacker(copy=False)
    x = packer.allocate((4, 100), np.int16)
    assert x is not None and x.shape == (4, 100) and x.dtype == np.int16
    x[:] = np.arange(400).reshape(4, 100)
    labels = np.arange(4)  # made elsewhere: copied in after the allocated bytes
    ticket = packer((x, labels, "meta"))
    assert isinstance(ticket, Ticket) and ticket.copied == labels.nbytes
    assert ticket.tree[0].offset == 0 and ticket.tree[1].offset >= x.nbytes
    out = unpacker(ticket)
    assert _same(out[0], x) and _same(out[1], labels) and out[2] == "meta"
    x[0, 0] = -7  # the worker's array *is* the batch in the slot: no copy was taken of it
    assert out[0][0, 0] == -7
    assert unpacker.copied_bytes == labels.nbytes and unpacker.slot_bytes == 800 + 32
    # the next batch opens another slot: the one above is still held by `out`
    y = packer.allocate((4, 100), np.int16)
    assert y is not None and not np.shares_memory(y, out[0])
    y[:] = 5
    second = unpacker(packer([y]))
    assert int(second[0].sum()) == 2000 and out[0][0, 0] == -7


def test_an_allocation_the_batch_does_not_use_is_given_back():
    packer = _primed(slots=2)
    unused = packer.allocate((10,), np.float64)
    assert unused is not None and sum(packer._ring.busy) == 1
    batch = np.ones((10, 10))  # made elsewhere: copied into a free slot, the open one freed
    ticket = packer(batch)
    assert ticket.copied == batch.nbytes and sum(packer._ring.busy) == 1
    # views of an allocation that are not the whole of it are copied into another slot, never
    # over their own bytes
    z = packer.allocate((8, 8), np.uint8)
    z[:] = np.arange(64).reshape(8, 8)
    expected = (z[4:].copy(), z.T.copy())
    ticket = packer((z[4:], z.T))
    assert ticket.copied == 32 + 64
    out = Unpacker()(ticket)
    assert _same(out[0], expected[0]) and _same(out[1], expected[1])


def test_no_room_for_the_rest_moves_the_batch_to_a_larger_ring():
    packer = _primed(slots=2)
    old_ring = packer._ring
    x = packer.allocate((1000,), np.uint8)
    x[:] = 9
    big = np.arange(100_000, dtype=np.int64)  # does not fit after x
    ticket = packer((x, big))
    assert packer._ring is not old_ring and ticket.segment == packer._ring.shm.name
    assert sum(old_ring.busy) == 0  # the open slot of the outgrown ring is free again
    out = Unpacker()(ticket)
    assert _same(out[0], x) and _same(out[1], big)
    # too big to allocate at all: None, and the stage makes the array itself
    assert packer.allocate((10**8,), np.uint8) is None
    # no ring yet: the first allocation makes one (if the array is worth a slot)
    assert Packer(slots=2).allocate((4,), np.uint8) is None
    fresh = Packer(slots=2)
    first = fresh.allocate((64, 1024), np.uint8)
    assert first is not None and fresh._ring.slot_bytes >= first.nbytes * 5 // 4
    assert packer.allocate((2,), object) is None


torch = pytest.importorskip("torch", reason="the loader tests need torch")


def _loader_batches(paths, transport, **kw):
    from tarshards.torch.adapter import WebDataset, WebLoader

    ds = (
        WebDataset(paths, shardshuffle=True, seed=3)
        .shuffle(10)
        .decode("rgb8")
        .to_tuple("__key__", "jpg", "cls")
        .batched(16)
    )  # 16 x 32x24x3 > 32 KiB
    loader = WebLoader(ds, batch_size=None, num_workers=2, transport=transport, **kw)
    return loader, [list(loader) for _ in range(2)]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_webloader_batches_equal_the_plain_path(tmp_path, context):
    paths, samples = write_shards(tmp_path, 4, 16)
    _, plain = _loader_batches(paths, None, multiprocessing_context=context)
    loader, shm = _loader_batches(paths, "auto", multiprocessing_context=context)
    assert loader._packing and len(loader._unpacker._segments) == 2  # batches went by slots
    # the images are stacked in the slots by the pipeline's batched(): only labels are copied;
    # each worker's two batches of the last epoch travelled together (one group, one ticket)
    unpacker = loader._unpacker
    assert unpacker.tickets == 2 and unpacker.copied_bytes == 4 * 16 * 8
    assert unpacker.slot_bytes == 4 * 16 * (32 * 24 * 3 + 8)
    for epoch_plain, epoch_shm in zip(plain, shm):
        assert len(epoch_plain) == len(epoch_shm) == 4
        assert all(_same(a, b) for a, b in zip(epoch_plain, epoch_shm))
        keys = [k for batch in epoch_shm for k in batch[0]]
        assert sorted(keys) == sorted(s["__key__"] for s in samples)
        images = epoch_shm[0][1]
        assert isinstance(images, torch.Tensor) and images.dtype == torch.uint8


def test_slots_are_reused_and_kept_batches_stay_intact(tmp_path):
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, samples = write_shards(tmp_path, 4, 512)
    all_bytes = len(samples) * (32 * 24 * 3 + 8)  # of the images and labels

    def loader(transport):
        ds = WebDataset(paths).decode("rgb8").to_tuple("__key__", "jpg", "cls").batched(16)
        return WebLoader(ds, batch_size=None, num_workers=2, transport=transport)

    plain = list(loader(None))
    # every batch dropped before the next: each of the 128 batches comes through a slot (in
    # groups of up to 8), and the 5 slots of each worker's ring are written again and again
    shm = loader("auto")
    labels = [int(y.sum()) for _k, _x, y in shm]
    assert labels == [int(y.sum()) for _k, _x, y in plain]
    assert shm._unpacker.slot_bytes == all_bytes and len(shm._unpacker._segments) == 2
    assert 2 * 8 <= shm._unpacker.tickets < 128
    # every batch kept: the rings fill up, the rest come the usual way, nothing is overwritten
    kept = loader("auto")
    batches = list(kept)
    assert 0 < kept._unpacker.slot_bytes < all_bytes
    assert len(batches) == len(plain) == 128
    assert all(_same(a, b) for a, b in zip(plain, batches))
    keys = [k for batch in batches for k in batch[0]]
    assert sorted(keys) == sorted(s["__key__"] for s in samples)


@pytest.mark.parametrize("workers", [2, 3])
def test_groups_are_handed_out_in_the_plain_order_when_workers_run_out_unevenly(tmp_path, workers):
    """Workers send groups of batches; the loader hands the batches out as DataLoader's own
    path does (workers in turn, one batch each, those that ran out skipped): planned steps and
    resumed positions depend on it."""
    from tarshards.torch.adapter import WebDataset, WebLoader

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    big, _ = write_shards(tmp_path / "a", 1, 400, prefix="big")
    small, _ = write_shards(tmp_path / "b", 3, 40, prefix="small")
    paths = [big[0], small[0], small[1], small[2]]  # worker 0 reads far more than the others

    def keys(transport, **kw):
        ds = WebDataset(paths).decode("rgb8").to_tuple("__key__", "jpg", "cls").batched(16)
        loader = WebLoader(ds, batch_size=None, num_workers=workers, transport=transport, **kw)
        epochs = [[list(k) for k, _x, _y in loader] for _ in range(2)]
        return loader, epochs

    _, plain = keys(None)
    loader, grouped = keys("auto")
    assert grouped == plain
    assert loader._unpacker.tickets < len(plain[1])  # batches did travel together
    _, persistent = keys("auto", persistent_workers=True)
    assert persistent == plain


def test_batches_made_after_the_last_batched_are_copied(tmp_path):
    """Stacking in the slot is only for the pipeline's last stage, with the default collation:
    a stage after it, or a collation of the user's, may keep arrays; they take the copy."""
    from tarshards.pipeline.stages import default_collation_fn
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, samples = write_shards(tmp_path, 2, 32)

    def keep_last(batch, kept=[]):  # noqa: B006 - holds the previous batch on purpose
        kept[:] = [batch]
        return batch

    base = WebDataset(paths).decode("rgb8").to_tuple("jpg", "cls")
    pipelines = {
        "map after": base.batched(16).map(keep_last),
        "own collation": base.batched(16, collation_fn=lambda b: default_collation_fn(b)),
        "re-batched": base.batched(8).unbatched().batched(16),
    }
    expected = sorted(int(y) for _x, y in base)
    assert len(expected) == len(samples)
    for name, ds in pipelines.items():
        loader = WebLoader(ds, batch_size=None, num_workers=2)
        batches = [(x.clone(), y.clone()) for x, y in loader]
        assert sorted(int(v) for _x, y in batches for v in y) == expected, name
        ref = sorted((int(y), x.tobytes()) for x, y in base)
        got = sorted((int(v), im.numpy().tobytes()) for x, y in batches for im, v in zip(x, y))
        assert [g[1] for g in got] == [r[1] for r in ref], name
        copied_all = loader._unpacker.copied_bytes == loader._unpacker.slot_bytes
        assert copied_all == (name != "re-batched"), name


def test_epochs_broken_off_leave_no_slot_taken(tmp_path):
    from tarshards.torch.adapter import WebDataset, WebLoader

    paths, _ = write_shards(tmp_path, 4, 64)
    ds = WebDataset(paths).decode("rgb8").to_tuple("jpg", "cls").batched(16)
    loader = WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for _ in range(4):  # each time the workers had batches made ahead that nobody takes
        for _batch in loader:
            break
    assert sum(len(y) for _x, y in loader) == 256
    # every batch of the last epoch came by a slot
    assert loader._unpacker.slot_bytes == 256 * (32 * 24 * 3 + 8)


def test_persistent_workers_reuse_their_rings(tmp_path):
    paths, _samples = write_shards(tmp_path, 4, 16)
    _, plain = _loader_batches(paths, None, persistent_workers=True)
    loader, shm = _loader_batches(paths, "auto", persistent_workers=True)
    for a, b in zip(plain, shm):
        assert all(_same(x, y) for x, y in zip(a, b))
    assert len(loader._unpacker._segments) == 2  # one ring per worker, for every epoch


def test_no_segment_and_no_tracker_warning_left_behind(tmp_path):
    paths, _ = write_shards(tmp_path, 4, 12)
    script = textwrap.dedent(f"""
        import torch
        from tarshards.torch import WebDataset, WebLoader
        ds = WebDataset({paths!r}).decode("rgb8").to_tuple("jpg", "cls").batched(16)
        for ctx in ("fork", "spawn"):
            loader = WebLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx)
            for epoch in range(2):
                n = sum(len(y) for x, y in loader)
                assert n == 48 and loader._unpacker._segments, n
            for x, y in loader:  # broken off: the other worker's first ticket never comes
                break
            assert sum(len(y) for x, y in loader) == 48
        for x, y in loader:  # broken off at exit
            break
        print("ok")
    """)
    before = set(glob.glob("/dev/shm/tarshards-*"))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=200,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    # no warning about our segments (shared_memory objects); a semaphore of multiprocessing's own
    # queues reported "leaked" while already unlinked (ENOENT) is CPython's tracker racing a
    # spawned process's exit, not something left behind, and is allowed
    tracker = [ln for ln in proc.stderr.splitlines() if "Warning: resource_tracker:" in ln]
    leaked = [re.search(r"There appear to be (\d+) leaked semaphore objects", ln) for ln in tracker]
    gone = [ln for ln in tracker if "[Errno 2] No such file or directory" in ln]
    assert all(m or ln in gone for m, ln in zip(leaked, tracker)), proc.stderr
    assert sum(int(m.group(1)) for m in leaked if m) <= len(gone), proc.stderr
    assert "shared_memory" not in proc.stderr and "tarshards-" not in proc.stderr, proc.stderr
    assert set(glob.glob("/dev/shm/tarshards-*")) <= before
