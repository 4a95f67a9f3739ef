"""Packs and buckets (tarshards.plan.packing): the plans from metadata and the streaming stages give
the same units; budgets hold; every sample once; exact and elastic resume; through WebLoader."""

from __future__ import annotations

import collections
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tarshards import ShardWriter, WebDataset
from tarshards import packing as packing_module
from tarshards.errors import ResumeError, TarshardsWarning
from tarshards.plan.packing import PACK_RULE, bucket, bucket_units, pack, pack_units
from tarshards.testing import check_resume

N = 240
MAX = 256
BOUNDS = [24, 64]  # three buckets of length
SIZES = [8, 4, 2]


def _lengths(n=N, seed=0, cap=400):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(3.7, 0.9, n).astype(int) + 1, cap)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Uneven shards of token arrays, with a ``tokens`` metadata column in the manifest."""
    d = tmp_path_factory.mktemp("packing")
    lengths = _lengths()
    with ShardWriter(
        str(d / "part-%04d.tar"),
        maxcount=31,
        manifest=str(d / "manifest.json"),
        meta={"tokens": lambda s: len(s["tokens.npy"])},
    ) as sink:
        for i, n in enumerate(lengths):
            sink.write({"__key__": f"k{i:04d}", "tokens.npy": np.full(n, i, dtype=np.int32)})
    return str(d / "manifest.json"), lengths


def _keys(unit) -> list[str]:
    return [s["__key__"] for s in unit]


def packed(manifest, *, readers=4, remainder="pad", seed=3, torch_ds=False, **kw):
    cls = WebDataset
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as cls  # type: ignore[no-redef]
    return (
        cls(manifest, shardshuffle=True, seed=seed, readers=readers, remainder=remainder)
        .decode()
        .pack(MAX, "tokens", window=4, **kw)
    )


def bucketed(manifest, *, readers=4, remainder="pad", seed=3, torch_ds=False):
    cls = WebDataset
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as cls  # type: ignore[no-redef]
    return (
        cls(manifest, shardshuffle=True, seed=seed, readers=readers, remainder=remainder)
        .decode()
        .bucket("tokens", BOUNDS, SIZES)
    )


# ---- the plans: pure functions of the costs ---------------------------------------------------

costs_st = st.lists(
    st.one_of(st.integers(0, 300), st.integers(0, 40)), min_size=0, max_size=300
).map(lambda xs: np.asarray(xs, dtype=np.float64))


@given(costs=costs_st, budget=st.integers(1, 256), window=st.integers(1, 6))
@settings(max_examples=120, deadline=None)
def test_packs_hold_the_budget_and_every_sample_once(costs, budget, window):
    plan = pack_units(costs, budget, window=window)
    seen = []
    for u in range(len(plan)):
        members = plan.unit(u)
        total = costs[members].sum()
        assert total <= budget or len(members) == 1  # over budget: one oversize sample alone
        assert list(members) == sorted(members)
        seen += members.tolist()
    assert sorted(seen) == list(range(len(costs)))  # each sample exactly once
    # the streaming stage makes the same packs of the same stream
    samples = [{"__key__": i, "n": c} for i, c in enumerate(costs)]
    streamed = [[s["__key__"] for s in p] for p in pack(samples, budget, "n", window=window)]
    assert streamed == plan.units()


@given(costs=costs_st, budget=st.integers(1, 256))
@settings(max_examples=60, deadline=None)
def test_oversize_drop_leaves_out_exactly_the_oversize_samples(costs, budget):
    plan = pack_units(costs, budget, oversize="drop")
    got = sorted(plan.members.tolist())
    assert got == [i for i, c in enumerate(costs) if c <= budget]
    assert plan.left_out == int((costs > budget).sum())
    assert all(costs[plan.unit(u)].sum() <= budget for u in range(len(plan)))
    samples = [{"n": c, "i": i} for i, c in enumerate(costs)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streamed = [[s["i"] for s in p] for p in pack(samples, budget, "n", oversize="drop")]
    assert streamed == plan.units()
    assert bool(plan.left_out) == any(issubclass(w.category, TarshardsWarning) for w in caught)
    if plan.left_out:
        with pytest.raises(ValueError, match="max_tokens"):
            pack_units(costs, budget, oversize="raise")


def test_fill_on_long_tailed_lengths():
    rng = np.random.default_rng(1)
    costs = np.minimum(rng.lognormal(6.0, 1.0, 20000).astype(int) + 1, 4096)
    plan = pack_units(costs, 4096)
    assert plan.fill() >= 0.97, plan.fill()
    padded = len(costs) * costs.max()  # padding every sample to the longest
    assert costs.sum() / padded < 0.2 < plan.fill()


@given(
    values=st.lists(st.floats(0, 100, allow_nan=False), max_size=200),
    sizes=st.lists(st.integers(1, 7), min_size=3, max_size=3),
    partial=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_bucket_batches_are_homogeneous_and_cover(values, sizes, partial):
    bounds = [20.0, 60.0]
    plan = bucket_units(values, bounds, sizes, partial=partial)
    which = np.searchsorted(bounds, values, side="right")
    seen = []
    for u in range(len(plan)):
        members = plan.unit(u)
        b = set(which[members].tolist())
        assert len(b) == 1  # one bucket a batch
        size = sizes[b.pop()]
        assert len(members) <= size and (partial or len(members) == size)
        seen += members.tolist()
    assert len(seen) == len(set(seen))
    if partial:
        assert sorted(seen) == list(range(len(values)))
    assert plan.left_out == len(values) - len(seen)
    samples = [{"v": v, "i": i} for i, v in enumerate(values)]
    streamed = [[s["i"] for s in b] for b in bucket(samples, "v", bounds, sizes, partial=partial)]
    assert streamed == plan.units()


def test_bucket_sizes_as_dict_and_errors():
    assert len(bucket_units([1, 2, 30], [10], {0: 2, 1: 1})) == 2
    with pytest.raises(ValueError, match="every bucket"):
        bucket_units([1], [10], {0: 2})
    with pytest.raises(ValueError, match="one size per bucket"):
        bucket_units([1], [10], [1, 2, 3])
    with pytest.raises(ValueError, match="increase"):
        bucket_units([1], [10, 5], 2)


# ---- planned pipelines over real shards -------------------------------------------------------


def test_planned_packs_hold_the_budget_and_every_sample_once(data):
    manifest, lengths = data
    ds = packed(manifest)
    epochs = []
    for _ in range(2):
        units = list(ds)
        assert len(units) == len(ds) and len(units) % 4 == 0
        real = [s for u in units for s in u if not s["__pad__"]]
        assert sorted(_keys(real)) == [f"k{i:04d}" for i in range(N)]  # every sample once
        for u in units:
            total = sum(len(s["tokens.npy"]) for s in u)
            assert total <= MAX or len(u) == 1
            for s in u:  # the tokens read are the sample's own
                assert len(s["tokens.npy"]) == lengths[int(s["__key__"][1:])]
        epochs.append([_keys(u) for u in units])
    assert epochs[0] != epochs[1]  # another epoch, another order
    assert [_keys(u) for u in packed(manifest)] == epochs[0]  # a pure function of the seed


def test_the_plan_names_each_units_samples(data):
    """A global batch's samples follow from the plan alone (what an audit replays)."""
    manifest, _ = data
    ds = packed(manifest)
    prog = ds.epoch_program(0)
    urls = ds.table.urls
    keys_of = {s: [x["__key__"] for x in WebDataset(url)] for s, url in enumerate(urls)}
    ds.set_epoch(0)
    for g, unit in enumerate(ds):
        named = [(keys_of[s][i], pad) for s, i, pad in prog.unit_samples(g)]
        assert named == [(x["__key__"], x["__pad__"]) for x in unit]


def test_planned_packs_equal_the_streaming_stage(data):
    """The packs planned from metadata are those the stage makes of the epoch's stream."""
    manifest, _ = data
    plain = WebDataset(manifest, shardshuffle=False).decode().pack(MAX, "tokens.npy", window=4)
    ref = [_keys(u) for u in plain]
    shuffled = [_keys(u) for u in packed(manifest, readers=1, remainder="drop")]
    unshuffled = (
        WebDataset(manifest, shardshuffle=False, readers=1, remainder="drop")
        .decode()
        .pack(MAX, "tokens", window=4)
    )
    assert [_keys(u) for u in unshuffled] == ref
    assert shuffled != ref  # (shards shuffled)


def test_planned_buckets(data):
    manifest, lengths = data
    ds = bucketed(manifest)
    units = list(ds)
    real = [s for u in units for s in u if not s["__pad__"]]
    assert sorted(_keys(real)) == [f"k{i:04d}" for i in range(N)]
    which = np.searchsorted(BOUNDS, lengths, side="right")
    for u in units:
        got = {int(which[int(k[1:])]) for k in _keys(u)}
        assert len(got) == 1 and len(u) <= SIZES[got.pop()]
        assert {int(np.searchsorted(BOUNDS, len(s["tokens.npy"]), side="right")) for s in u}


@pytest.mark.parametrize("make", [packed, bucketed])
def test_resume_equals_no_interruption(data, make):
    manifest, _ = data
    check_resume(lambda: make(manifest), epochs=2, resumes_in_one_epoch=2)


def test_remainder_drop_counts_and_warns(data):
    manifest, _ = data

    def make(readers):
        return (
            WebDataset(manifest, shardshuffle=True, seed=3, readers=readers)
            .decode()
            .pack(MAX, "tokens", window=4)
        )

    # readers that the epoch's packs do not divide (some are left out)
    packs = len(make(1).epoch_program(0).units)
    readers = next(v for v in range(7, 20) if packs % v)
    ds = make(readers)
    with pytest.warns(TarshardsWarning, match="leaves out"):
        units = list(ds)
    real = sum(len(u) for u in units)
    assert ds.dropped_samples(0) > 0
    assert real + ds.dropped_samples(0) == N
    assert len(units) % readers == 0


@pytest.mark.parametrize("workers", [None, 2])
def test_elastic_resume_every_sample_once(data, workers):
    """Two ranks run some steps; the state goes to three ranks, which finish the epoch: every
    sample once, the same number of steps on every rank (the last one padded). ``workers``:
    each rank through a ``WebLoader`` with that many workers."""
    manifest, _ = data
    if workers is not None:
        pytest.importorskip("torch")
        from tarshards.torch.adapter import WebDataset as TorchWebDataset
        from tarshards.torch.adapter import WebLoader

        warnings.filterwarnings("ignore", message=".*worker processes in total.*")

    def world(n):
        runs = []
        for r in range(n):
            cls = WebDataset if workers is None else TorchWebDataset
            ds = (
                cls(
                    manifest,
                    shardshuffle=True,
                    seed=3,
                    readers=12,
                    remainder="drop",
                    rank=r,
                    world_size=n,
                )
                .decode()
                .pack(MAX, "tokens", window=4)
            )
            runs.append(
                ds if workers is None else WebLoader(ds, batch_size=None, num_workers=workers)
            )
        return runs

    first = world(2)
    its = [iter(run) for run in first]
    delivered = []
    for _ in range(3):
        for it in its:
            delivered += [s for s in next(it) if not s["__pad__"]]
    state = first[0].state_dict()
    assert state == first[1].state_dict()
    del its
    second = world(3)
    steps = []
    for run in second:
        run.load_state_dict(state)
        units = list(run)
        steps.append(len(units))
        delivered += [s for u in units for s in u if not s["__pad__"]]
    assert len(set(steps)) == 1
    plain = world(1)[0] if workers is None else world(1)[0].dataset
    prog = plain.epoch_program(0)
    keys = _keys(delivered)
    assert len(keys) == len(set(keys))
    assert len(keys) == int(prog.units.offsets[prog.num_batches])  # every planned sample once
    assert steps[0] == -(-(prog.num_batches - 6) // 3)


def test_state_of_other_packing_is_refused(data):
    manifest, _ = data
    ds = packed(manifest)
    next(iter(ds))
    state = ds.state_dict()
    other = (
        WebDataset(manifest, shardshuffle=True, seed=3, readers=4, remainder="pad")
        .decode()
        .pack(MAX + 1, "tokens", window=4)
    )
    with pytest.raises(ResumeError, match="max_tokens"):
        other.load_state_dict(state)


def test_state_of_an_earlier_packing_rule_is_refused(data):
    """A state saved by a plan whose packs another rule made (an earlier tarshards' states name
    no rule) does not resume this plan's packs."""
    manifest, _ = data
    ds = packed(manifest)
    next(iter(ds))
    state = ds.state_dict()
    assert state["packs"] == PACK_RULE
    for old in ({k: v for k, v in state.items() if k != "packs"}, dict(state, packs="other/1")):
        with pytest.raises(ResumeError, match="another packing rule"):
            packed(manifest).load_state_dict(old)


@given(costs=costs_st, budget=st.integers(1, 256), k=st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_the_c_loop_makes_the_packs_of_the_python_rule(costs, budget, k):
    if packing_module._c_plan is None:
        pytest.skip("the C extension is not built")
    unit_of, key = packing_module._plan_packs(costs, float(budget), k)
    ref_unit, ref_key = packing_module._plan_packs_py(costs.tolist(), float(budget), k)
    assert unit_of.tolist() == ref_unit and key.tolist() == ref_key


def test_packs_fill_and_hold_few_samples_on_long_tailed_lengths(monkeypatch):
    """The default rule (8 packs open) fills >= 99 % of the budget on long-tailed lengths
    (lognormal, mean ~400 of 8,192), a pack's samples lie in a few runs of adjacent samples
    close together in the stream (what a reader parses on the pack's turn), and the plan is
    the same without the C loop."""
    rng = np.random.default_rng(38)
    costs = np.minimum(rng.lognormal(5.5, 1.0, 20000).astype(int) + 1, 8192)
    plan = pack_units(costs, 8192)
    assert plan.fill() >= 0.99, plan.fill()
    runs = [1 + int((np.diff(plan.unit(u)) > 1).sum()) for u in range(len(plan))]
    assert np.mean(runs) < 3, np.mean(runs)
    spans = [int(plan.unit(u)[-1] - plan.unit(u)[0]) for u in range(len(plan))]
    assert np.median(spans) < 8 * len(costs) / len(plan)  # within ~8 packs' worth of samples
    monkeypatch.setattr(packing_module, "_c_plan", None)
    again = pack_units(costs, 8192)
    assert again.units() == plan.units()


def test_planned_errors(data):
    manifest, _ = data
    base = WebDataset(manifest, readers=4, remainder="drop")
    with pytest.raises(ValueError, match="add_meta"):
        list(base.pack(MAX, "tokens.npy"))
    with pytest.raises(ValueError, match="add_meta"):
        list(base.pack(MAX, len))
    with pytest.raises(ValueError, match="shuffle"):
        list(base.shuffle(10).pack(MAX, "tokens"))
    with pytest.raises(ValueError, match="carry"):
        list(WebDataset(manifest, readers=4, remainder="carry").pack(MAX, "tokens"))
    with pytest.raises(ValueError, match="oversize"):
        base.pack(MAX, "tokens", oversize="split")  # at once, not at iteration
    with pytest.raises(ValueError, match="max_tokens"):
        base.pack(0)
    with pytest.raises(ValueError, match="one size per bucket"):
        base.bucket("tokens", [10, 20], [1, 2])
    with pytest.raises(ValueError, match="fewer than readers"):
        list(WebDataset(manifest, readers=10_000, remainder="drop").pack(10**9, "tokens"))


def test_packs_read_on_their_turn_equal_the_streamed_ones(data, monkeypatch):
    """A reader parses each pack from its shards' maps on its own turn (local plain shards);
    without that (remote shards, views) it streams them: the same packs, the same samples."""
    manifest, _ = data
    reads = []
    orig = packing_module._UnitReads.units
    monkeypatch.setattr(
        packing_module._UnitReads, "units", lambda self: reads.append(1) or orig(self)
    )
    direct = [[(s["__key__"], s["tokens.npy"].tolist()) for s in u] for u in packed(manifest)]
    assert reads  # (the maps were read)
    # where the C scan declines every run (or is not built): the general reader, same packs
    monkeypatch.setattr(packing_module, "plain_run", lambda *a: None)
    general = [[(s["__key__"], s["tokens.npy"].tolist()) for s in u] for u in packed(manifest)]
    assert general == direct
    monkeypatch.setattr(packing_module, "_unit_runs", lambda *a: None)
    streamed = [[(s["__key__"], s["tokens.npy"].tolist()) for s in u] for u in packed(manifest)]
    assert direct == streamed


def test_a_damaged_shard_is_named(data, tmp_path):
    """A member header damaged in the middle of a shard: the pack's read raises an error that
    names the shard (the general reader reads the run the C scan declines)."""
    import shutil

    from tarshards import Manifest
    from tarshards.errors import TarshardsError

    manifest, _ = data
    shutil.copytree(Path(manifest).parent, tmp_path / "copy")
    copy = str(tmp_path / "copy" / "manifest.json")
    victim = packed(copy).table.urls[2]
    offset = int(Manifest.load(copy).load_index(2).sample_offsets[5])
    with open(victim, "r+b") as f:  # the header's name: its checksum no longer matches
        f.seek(offset)
        f.write(b"X")
    with pytest.raises(TarshardsError) as err:
        list(packed(copy))
    assert Path(victim).name in str(err.value), err.value


def test_plain_pipeline_packs_by_function_and_resumes(data):
    manifest, _ = data

    def make():
        return (
            WebDataset(manifest, shardshuffle=True, seed=1)
            .decode()
            .pack(MAX, lambda s: len(s["tokens.npy"]), window=3)
        )

    ref = check_resume(make, epochs=2)
    units = list(make())
    assert all(sum(len(s["tokens.npy"]) for s in u) <= MAX or len(u) == 1 for u in units)
    assert collections.Counter(k for u in units for k in _keys(u)) == collections.Counter(
        f"k{i:04d}" for i in range(N)
    )
    assert len(ref[0]) == len(units)


# ---- through WebLoader -------------------------------------------------------------------


@pytest.mark.parametrize("make", [packed, bucketed])
def test_webloader_two_workers_resumes_exactly(data, make):
    torch = pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    manifest, _ = data
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")

    def run():
        return WebLoader(make(manifest, torch_ds=True), batch_size=None, num_workers=2)

    def roundtrip(state):
        import io

        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    ref = check_resume(run, epochs=2, cuts=[(0, 5), (1, 3)], state_roundtrip=roundtrip)
    direct = check_resume(lambda: make(manifest), epochs=2, cuts=[])
    assert ref == direct  # the workers deliver the units of the plan, in its order
