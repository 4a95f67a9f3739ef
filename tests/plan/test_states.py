"""Typed resume states (tarshards.plan.epoch.PlanState, StreamState): what pipelines save is their
saved form, and reading it back gives the same value."""

from __future__ import annotations

import dataclasses

import pytest

import tarshards
from tarshards.errors import ResumeError
from tarshards.plan.epoch import PlanState, StreamState


def _data(tmp_path, n=40, shards=4):
    pattern = str(tmp_path / "s-%02d.tar")
    with tarshards.ShardWriter(pattern, maxcount=n // shards) as w:
        for i in range(n):
            w.write({"__key__": f"{i:04d}", "cls": str(i).encode()})
    return str(tmp_path / f"s-{{00..{shards - 1:02d}}}.tar")


def test_plan_state_round_trip_and_frozen():
    st = PlanState({"fingerprint": "f", "seed": 3, "readers": 2}, 1, 8, 4, 2, False)
    d = st.to_dict()
    assert d["kind"] == "plan" and d["fingerprint"] == "f" and d["position"] == 8
    assert PlanState.from_dict(d) == st
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.epoch = 2  # type: ignore[misc]
    w = PlanState({"seed": 0}, 0, None, 0, 1, False, worker=1, num_workers=2, next_step=5)
    assert PlanState.from_dict(w.to_dict()) == w
    with pytest.raises(ResumeError, match="planned"):
        PlanState.from_dict(StreamState(0, 1).to_dict())


def test_stream_state_round_trip():
    st = StreamState(7, 2, 11, {"rank": 0, "world_size": 1, "worker": 0, "num_workers": 1})
    assert StreamState.from_dict(st.to_dict()) == st
    with pytest.raises(ResumeError, match="stream"):
        StreamState.from_dict({"format": "tarshards.resume/1", "kind": "plan"})


@pytest.mark.parametrize("planned", [False, True])
def test_pipelines_save_the_typed_states(tmp_path, planned):
    spec = _data(tmp_path)
    kw = {"readers": 2} if planned else {}
    ds = tarshards.WebDataset(spec, shuffle=False, **kw).to_tuple("__key__").batched(4)
    it = iter(ds)
    next(it)
    next(it)
    state = ds.state_dict()
    typed = (PlanState if planned else StreamState).from_dict(state)
    assert typed.to_dict() == state
    assert typed.epoch == 0 and (typed.position or 0) > 0
    rest = [b for b in it]
    again = tarshards.WebDataset(spec, shuffle=False, **kw).to_tuple("__key__").batched(4)
    again.load_state_dict(typed.to_dict())
    assert [list(b[0]) for b in again] == [list(b[0]) for b in rest]
    assert rest


@pytest.mark.parametrize("planned", [False, True])
def test_one_iterator_for_both_paths(tmp_path, planned):
    """``iter(pipeline)`` is a PipelineIterator on both paths: it owns the epoch and the place,
    says where it is as a typed, frozen state, and the pipeline's state_dict is that state."""
    from tarshards.pipeline.composition import DataPipeline
    from tarshards.pipeline.dataset import WebDataset
    from tarshards.pipeline.iteration import PipelineIterator
    from tarshards.types import WorkerInfo

    kw = {"readers": 2} if planned else {}
    ds = WebDataset(_data(tmp_path), shuffle=5, seed=3, **kw).batched(4)
    assert isinstance(ds, DataPipeline)
    it = iter(ds)
    assert isinstance(it, PipelineIterator)
    assert it.epoch == 0 and it.info == WorkerInfo(0, 1, 0, 1)
    first = [next(it) for _ in range(3)]
    state = it.state()
    assert isinstance(state, PlanState if planned else StreamState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.epoch = 5  # type: ignore[misc]
    assert ds.state_dict() == state.to_dict() == it.state_dict()
    rest = list(it)
    assert it.finished and len(first) + len(rest) == 10
    again = WebDataset(_data(tmp_path), shuffle=5, seed=3, **kw).batched(4)
    again.load_state_dict(state.to_dict())
    resumed = list(iter(again))
    assert [b["__key__"] for b in resumed] == [b["__key__"] for b in rest]
    # after the pass: the next epoch from its start (a plan says "epoch 0 finished")
    nxt = ds.state_dict()
    if planned:
        assert (nxt["epoch"], nxt["finished"]) == (0, True)
    else:
        assert (nxt["epoch"], nxt["position"]) == (1, 0)


def test_a_chain_of_stateful_stages_hands_out_the_same_iterator():
    from tarshards.pipeline.iteration import ChainState, PipelineIterator
    from tarshards.pipeline.stateful import Batch, Chain, ListSource, Shuffle

    make = lambda: Chain(ListSource(range(20)), Shuffle(4, seed=1), Batch(3, list))  # noqa: E731
    chain = make()
    it = iter(chain)
    assert isinstance(it, PipelineIterator)
    head = [next(it) for _ in range(2)]
    state = it.state()
    assert isinstance(state, ChainState) and not state.fresh
    with pytest.raises(TypeError):
        state.stages["upstream"] = {}  # type: ignore[index]  # read-only
    assert chain.state_dict() == state.to_dict()
    rest = list(it)
    assert it.finished and chain.state_dict() == {"fresh": True}
    again = make()
    again.load_state_dict(state.to_dict())
    assert list(again) == rest
    assert sorted(x for b in head + rest for x in b) == list(range(20))


def test_the_counting_base_in_c_equals_its_python_reference():
    """StreamIterator's base counts in C where _speedups is built; the Python class is the
    reference: the same items, positions and end, and an error passes through unfinished."""
    from tarshards.pipeline import iteration

    speedups = pytest.importorskip("tarshards._speedups", reason="the C extension is not built")
    assert iteration.StreamIterator.__mro__[1] is speedups.Counted

    def failing():
        yield 1
        raise ValueError("bad sample")

    for cls in (speedups.Counted, iteration._Counted):
        it = cls(range(5))
        assert iter(it) is it
        assert (next(it), it.position, it.finished) == (0, 1, False)
        assert list(it) == [1, 2, 3, 4] and (it.position, it.finished) == (5, True)
        assert list(it) == [] and it.position == 5
        bad = cls(failing())
        assert next(bad) == 1
        with pytest.raises(ValueError, match="bad sample"):
            next(bad)
        assert (bad.position, bad.finished) == (1, False)
