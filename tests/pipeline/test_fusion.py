"""The one rewrite of a stage list (tarshards.pipeline.fusion): which calls it makes, and that
running the rewritten list gives what the stages as written give."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tarshards.codecs import decoding
from tarshards.pipeline import stages
from tarshards.pipeline.fusion import Stage, rewrite

PIL = pytest.importorskip("PIL.Image")


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(np.full((4, 5, 3), value, np.uint8)).save(buf, format="png")
    return buf.getvalue()


def _samples(n=6):
    return [
        {"__key__": f"k{i}", "png": _png(i * 20), "cls": str(i).encode(), "txt": b"x" * i}
        for i in range(n)
    ]


def _run_as_written(stage_list, data):
    for st in stage_list:
        data = st.fn(data, *st.args, **st.kwargs)
    return list(data)


def _run_calls(calls, data):
    for c in calls:
        data = c.fn(data, *c.args, **c.kwargs)
    return list(data)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, np.ndarray):
                np.testing.assert_array_equal(u, v)
            else:
                assert u == v


def test_decode_then_to_tuple_is_one_call_with_the_same_values():
    lst = [
        Stage(stages.decode, ("rgb8",), {}),
        Stage(stages.to_tuple, ("png", "cls"), {}),
    ]
    calls = rewrite(lst, first=3)
    assert [c.fn for c in calls] == [decoding.decode_tuple]
    assert calls[0].number == 3 and calls[0].decodes  # seeded as the decode stage
    _same(_run_calls(calls, _samples()), _run_as_written(lst, _samples()))


def test_to_tuple_with_options_prunes_the_decode():
    lst = [
        Stage(stages.decode, ("rgb8",), {}),
        Stage(stages.to_tuple, ("png", "cls"), {"on_error": "raise"}),  # its own policy
    ]
    calls = rewrite(lst)
    assert [c.fn for c in calls] == [stages.decode, stages.to_tuple]
    assert calls[0].kwargs["only"] == ["png", "cls"]
    _same(_run_calls(calls, _samples()), _run_as_written(lst, _samples()))


def test_batching_into_a_transport_only_when_it_ends_the_pipeline():
    got = []

    def allocate(shape, dtype):
        arr = np.empty(shape, dtype)
        got.append(arr)
        return arr

    lst = [
        Stage(stages.decode, ("rgb8",), {}),
        Stage(stages.to_tuple, ("png", "cls"), {}),
        Stage(stages.batched, (3,), {}),
    ]
    plain = rewrite(lst)
    assert plain[-1].kwargs == {}  # no transport: the list as written
    calls = rewrite(lst, allocate=allocate)
    assert calls[0].kwargs.get("rows") is not None  # images decoded into the batch's rows
    assert calls[-1].kwargs["collation_fn"].keywords["allocate"] is allocate
    _same(_run_calls(calls, _samples()), _run_as_written(lst, _samples()))
    assert got  # the batches were stacked into the given memory

    custom = [Stage(stages.batched, (3,), {"collation_fn": list})]
    assert rewrite(custom, allocate=allocate)[0].kwargs == {"collation_fn": list}


def test_other_stages_pass_through_unchanged():
    def double(data):
        for s in data:
            yield dict(s, n=2)

    lst = [Stage(stages.map, (double,), {}), Stage(stages.decode, ("rgb8",), {})]
    calls = rewrite(lst, first=1)
    assert [(c.fn, c.args, c.number) for c in calls] == [
        (stages.map, (double,), 1),
        (stages.decode, ("rgb8",), 2),
    ]
    assert [c.decodes for c in calls] == [False, True]
