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
