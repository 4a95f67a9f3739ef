"""The fused decode + to_tuple stage's row function (decoding._decode_tuple): the common case
taken in one small call per sample, and every sample it does not fit handed to the plan's loop,
so the values and errors are those of decode then to_tuple."""

from __future__ import annotations

import json

import pytest

from tarshards import stages
from tarshards.decoding import _decode_tuple
from tarshards.errors import DecodeError, MissingFieldError


def sample(i, **fields):
    s = {"__key__": f"k{i}", "__url__": "shard-3.tar", "cls": b"%d" % i, "json": b'{"i": %d}' % i}
    s.update(fields)
    return s


def both(samples, fields, *handlers, **kw):
    fused = list(_decode_tuple(list(samples), fields, *handlers, **kw))
    plain = list(stages.to_tuple(stages.decode(list(samples), *handlers), *fields, **kw))
    assert fused == plain
    return fused


def test_streams_that_leave_and_rejoin_the_common_case():
    samples = [
        sample(0),
        sample(1, txt=b"extra field"),  # other fields: the row still fits
        sample(2, cls=memoryview(b"2")),  # a memoryview member decodes like bytes
        sample(3, cls=bytearray(b"3")),
        {"__key__": "k4", "__url__": "shard-3.tar", "json": b'{"i": 4}'},  # no cls
        sample(5),
    ]
    assert both(samples, ("cls", "json"), missing_is_error=False) == [
        (0, {"i": 0}),
        (1, {"i": 1}),
        (2, {"i": 2}),
        (3, {"i": 3}),
        (None, {"i": 4}),
        (5, {"i": 5}),
    ]
    assert both(samples, ("cls",), missing_is_error=False) == [
        (0,),
        (1,),
        (2,),
        (3,),
        (None,),
        (5,),
    ]
    # three fields and more: the same
    assert both(samples[:4], ("cls", "json", "cls")) == [(i, {"i": i}, i) for i in range(4)]
    assert both(samples[:4], ("cls", "json", "__key__", "cls")) == [
        (i, {"i": i}, f"k{i}", i) for i in range(4)
    ]


def test_alternatives_take_the_first_present_field():
    samples = [
        sample(0, txt=b"a"),
        sample(1, text=b"b"),  # only the second alternative: the plan's loop
        sample(2, txt=b"c", text=b"not this one"),
        sample(3, text=b"d"),
    ]
    assert both(samples, ("txt;text", "cls")) == [("a", 0), ("b", 1), ("c", 2), ("d", 3)]
    with pytest.raises(MissingFieldError, match="k1"):
        list(_decode_tuple(samples, ("txt", "cls")))


def test_decoded_values_and_partial():
    samples = [sample(0), sample(1, cls=1), sample(2)]
    with pytest.raises(DecodeError, match="already decoded"):
        list(_decode_tuple(samples, ("cls", "json")))
    assert list(_decode_tuple(samples, ("cls", "json"), partial=True)) == [
        (i, {"i": i}) for i in range(3)
    ]


@pytest.mark.parametrize("bad", ["cls", "json"])
def test_an_error_names_the_field_that_failed(bad):
    samples = [sample(i) for i in range(4)]
    samples[2][bad] = b"not valid"
    with pytest.raises(DecodeError) as fused:
        list(_decode_tuple(samples, ("cls", "json")))
    with pytest.raises(DecodeError) as plain:
        list(stages.to_tuple(stages.decode(samples), "cls", "json"))
    assert str(fused.value) == str(plain.value)
    assert f"k2.{bad}" in str(fused.value) and "shard-3.tar" in str(fused.value)
    with pytest.warns(Warning):
        got = list(_decode_tuple(samples, ("cls", "json"), on_error="warn"))
    assert got == [(i, {"i": i}) for i in (0, 1, 3)]


def test_custom_handlers_see_every_field_as_before():
    seen = []

    def handler(key, data):
        seen.append(key)
        return json.loads(data)["i"] * 10 if key == "json" else None

    samples = [sample(i) for i in range(3)]
    assert both(samples, ("cls", "json"), handler) == [(i, i * 10) for i in range(3)]
    assert seen[:2] == ["cls", "json"]
