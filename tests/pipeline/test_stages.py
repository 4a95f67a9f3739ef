"""The pipeline stages, one by one (plain generators, no torch needed)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tarshards.codecs import decoding
from tarshards.errors import DecodeError, TarshardsWarning, UnsafeCodecError
from tarshards.pipeline import stages


def _samples(n):
    return [
        {"__key__": f"k{i:03d}", "__url__": "mem", "cls": str(i).encode(), "txt": b"t%d" % i}
        for i in range(n)
    ]


@given(st.lists(st.integers(), max_size=300), st.integers(0, 50), st.integers(0, 2**32))
@settings(max_examples=60, deadline=None)
def test_shuffle_is_a_permutation(items, bufsize, seed):
    out = list(stages.shuffle(items, bufsize, rng=random.Random(seed)))
    assert sorted(out) == sorted(items)


def test_shuffle_is_deterministic_and_mixes():
    items = list(range(1000))
    a = list(stages.shuffle(items, 100, rng=random.Random(1)))
    b = list(stages.shuffle(items, 100, rng=random.Random(1)))
    c = list(stages.shuffle(items, 100, rng=random.Random(2)))
    assert a == b
    assert a != c
    assert a != items
    # a buffer of 100 moves an item at most ~100 positions early
    assert all(a.index(i) >= i - 100 for i in range(0, 1000, 50))


def test_shuffle_initial_starts_output_early():
    seen = []

    def source():
        for i in range(50):
            seen.append(i)
            yield i

    it = stages.shuffle(source(), 40, initial=5, rng=random.Random(0))
    next(it)
    assert len(seen) <= 6


def test_decode_basic_fields_and_cache():
    out = list(stages.decode(_samples(3)))
    assert out[2]["cls"] == 2 and out[2]["txt"] == "t2"
    assert out[0]["__key__"] == "k000"


def test_decode_only_and_custom_handler():
    s = _samples(1)
    out = next(stages.decode(s, only=["cls"]))
    assert out["cls"] == 0 and out["txt"] == b"t0"
    out = next(stages.decode(s, stages.handle_extension("txt", lambda b: b.upper())))
    assert out["txt"] == b"T0" and out["cls"] == 0
    out = next(stages.decode(s, lambda key, data: "X" if key == "cls" else None))
    assert out["cls"] == "X" and out["txt"] == "t0"


def test_decode_partial():
    s = [{"__key__": "a", "cls": 3}]
    with pytest.raises(DecodeError, match="already decoded"):
        list(stages.decode(s))
    assert next(stages.decode(s, partial=True))["cls"] == 3


def test_decode_errors_name_sample_and_handler_skips():
    s = _samples(3)
    s[1]["cls"] = b"not a number"
    with pytest.raises(DecodeError) as info:
        list(stages.decode(s))
    assert info.value.url == "mem" and info.value.member == "k001.cls"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = list(stages.decode(s, handler=stages.warn_and_continue))
    assert [x["__key__"] for x in out] == ["k000", "k002"]
    assert any("k001.cls" in str(x.message) for x in w)
    with pytest.warns(TarshardsWarning, match="stopping the stream"):
        assert list(stages.decode(s, handler=stages.ignore_and_stop)) == [
            {"__key__": "k000", "__url__": "mem", "cls": 0, "txt": "t0"}
        ]


def test_decode_refuses_pickle_unless_allowed():
    import pickle

    s = [{"__key__": "a", "pkl": pickle.dumps({"x": 1})}]
    with pytest.raises(UnsafeCodecError, match="allow_unsafe"):
        list(stages.decode(s))
    assert next(stages.decode(s, allow_unsafe=True))["pkl"] == {"x": 1}


def test_decode_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown decoding mode"):
        list(stages.decode(_samples(1), "nonsense"))


def test_select_map_map_dict():
    s = list(stages.decode(_samples(6)))
    even = list(stages.select(s, lambda x: x["cls"] % 2 == 0))
    assert [x["cls"] for x in even] == [0, 2, 4]
    mapped = list(stages.map(s, lambda x: None if x["cls"] == 1 else {"y": x["cls"] * 2}))
    assert [m["y"] for m in mapped] == [0, 4, 6, 8, 10]
    assert mapped[0]["__key__"] == "k000"
    md = list(stages.map_dict(s, cls=lambda c: c + 100))
    assert md[3]["cls"] == 103 and s[3]["cls"] == 3  # input not modified
    with pytest.raises(KeyError, match="nope"):
        list(stages.map_dict(s, nope=str))


def test_map_handler_gets_context():
    def boom(x):
        raise RuntimeError("bad")

    with pytest.raises(RuntimeError, match="bad") as info:
        list(stages.map(_samples(1), boom))
    assert "in sample 'k000' of shard mem" in info.value.__notes__
    assert list(stages.map(_samples(2), boom, handler=stages.ignore_and_continue)) == []


def test_to_tuple_alternatives_and_missing():
    s = [{"__key__": "a", "png": 1, "cls": 2}, {"__key__": "b", "jpg": 3, "cls": 4}]
    assert list(stages.to_tuple(s, "jpg;png", "cls")) == [(1, 2), (3, 4)]
    assert list(stages.to_tuple(s, "jpg;png cls")) == [(1, 2), (3, 4)]
    with pytest.raises(KeyError, match="none of 'jpg'"):
        list(stages.to_tuple(s, "jpg"))
    assert list(stages.to_tuple(s, "jpg", missing_is_error=False)) == [(None,), (3,)]


def test_map_tuple():
    s = [(1, 2, 3), (4, 5, 6)]
    assert list(stages.map_tuple(s, lambda x: x * 10, None, str)) == [(10, 2, "3"), (40, 5, "6")]
    with pytest.raises(ValueError, match="3 elements"):
        list(stages.map_tuple(s, None, None, None, None))


def test_rename():
    s = [{"__key__": "a", "png": 1, "cls": 2, "extra": 0}]
    out = next(stages.rename(s, image="jpg;png", label="cls"))
    assert out == {"__key__": "a", "image": 1, "label": 2, "extra": 0}
    out = next(stages.rename(s, keep=False, image="jpg;png"))
    assert out == {"__key__": "a", "image": 1}
    with pytest.raises(KeyError):
        list(stages.rename(s, x="nope"))


def test_batched_collation_and_unbatched():
    s = [(np.full((2, 2), i, dtype=np.uint8), i, float(i), f"s{i}") for i in range(5)]
    batches = list(stages.batched(s, 2))
    assert len(batches) == 3
    imgs, ints, floats, strs = batches[0]
    assert imgs.shape == (2, 2, 2) and imgs.dtype == np.uint8
    assert ints.dtype == np.int64 and list(ints) == [0, 1]
    assert floats.dtype == np.float64
    assert strs == ["s0", "s1"]
    assert len(list(stages.batched(s, 2, partial=False))) == 2
    back = list(stages.unbatched(batches))
    assert [int(b[1]) for b in back] == [0, 1, 2, 3, 4]
    dicts = list(stages.batched([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}], 2))
    assert list(dicts[0]["a"]) == [1, 2] and dicts[0]["b"] == ["x", "y"]
    assert [d["a"] for d in stages.unbatched(dicts)] == [1, 2]


def test_batched_stacks_tensors():
    torch = pytest.importorskip("torch")
    s = [(torch.ones(3, 4) * i, i) for i in range(4)]
    x, _y = next(stages.batched(s, 4))
    assert isinstance(x, torch.Tensor) and x.shape == (4, 3, 4)
    assert float(x[3, 0, 0]) == 3.0


def test_take_and_slice():
    assert list(stages.take(range(10), 3)) == [0, 1, 2]
    assert list(stages.slice(range(10), 2, 8, 3)) == [2, 5]
    assert list(stages.slice(range(10), 4)) == [0, 1, 2, 3]


def test_batched_keeps_no_reference_to_a_batch_it_handed_on():
    """A consumer that interleaves several pipelines (a planned pipeline's readers) frees a
    batch when it is done with it, not when this pipeline's next batch is asked for."""
    import weakref

    class Item:
        pass

    for collation in (None, list):
        alive = []

        def make(alive=alive):
            item = Item()
            alive.append(weakref.ref(item))
            return item

        def items(make=make):
            for _ in range(6):
                yield make()

        it = stages.batched(items(), 3, collation_fn=collation)
        batch = next(it)
        assert len(batch) == 3 and all(r() is not None for r in alive)
        del batch
        assert [r() is None for r in alive] == [True, True, True]
        assert len(next(it)) == 3
        it.close()


def test_batched_rejects_bad_size():
    with pytest.raises(ValueError):
        list(stages.batched([1], 0))


# ---------------------------------------------------------------------------------------------
# decode + to_tuple in one pass (what pipelines run for .decode(...).to_tuple(...))
# ---------------------------------------------------------------------------------------------


def _mixed_samples():
    import io

    from PIL import Image

    def png(v):
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 5, 3), v, np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    out = []
    for i in range(8):
        s = {"__key__": f"k{i}", "__url__": "mem", "cls": str(i).encode(), "json": b'{"a": %d}' % i}
        s["png" if i % 3 else "jpg.png"] = png(i)  # "jpg.png" decodes as png too
        if i % 4 == 0:
            s["txt"] = b"hello"
        out.append(s)
    return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, np.ndarray):
                np.testing.assert_array_equal(u, v)
            else:
                assert u == v


@pytest.mark.parametrize(
    "fields,kw",
    [
        (("png;jpg.png", "cls"), {}),
        (("__key__", "json", "cls"), {}),
        (("png;jpg.png txt",), {"missing_is_error": False}),
        (("cls", "txt"), {"missing_is_error": False}),
    ],
)
@pytest.mark.parametrize("mode", ["rgb8", "l8", None])
def test_fuseddecode_tuple_is_decode_then_to_tuple(fields, kw, mode):
    handlers = (mode,) if mode else ()
    want = list(stages.to_tuple(stages.decode(_mixed_samples(), *handlers), *fields, **kw))
    got = list(decoding.decode_tuple(_mixed_samples(), fields, *handlers, **kw))
    _same(got, want)


def test_fuseddecode_tuple_errors_as_the_two_stages():
    samples = _mixed_samples()
    samples[2]["cls"] = b"not a number"
    del samples[5]["cls"]
    for policy in ("skip", "raise"):

        def run(fused, policy=policy):
            if fused:
                return list(decoding.decode_tuple(samples, ("cls", "json"), on_error=policy))
            return list(
                stages.to_tuple(
                    stages.decode(samples, on_error=policy), "cls", "json", on_error=policy
                )
            )

        if policy == "skip":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert run(True) == run(False) == [(i, {"a": i}) for i in (0, 1, 3, 4, 6, 7)]
        else:
            with pytest.raises(DecodeError) as fused:
                run(True)
            with pytest.raises(DecodeError) as plain:
                run(False)
            assert str(fused.value) == str(plain.value) and "k2.cls" in str(fused.value)
    samples = _mixed_samples()
    del samples[5]["cls"]
    from tarshards.errors import MissingFieldError

    with pytest.raises(MissingFieldError, match="k5"):
        list(decoding.decode_tuple(samples, ("cls",)))
    # already decoded fields: an error unless partial=True, as decode says
    samples = _mixed_samples()
    samples[1]["cls"] = 1
    with pytest.raises(DecodeError, match="already decoded"):
        list(decoding.decode_tuple(samples, ("cls",)))
    assert [c for (c,) in decoding.decode_tuple(samples, ("cls",), partial=True)] == list(range(8))


def test_fuseddecode_tuple_runs_handlers_with_the_same_generators():
    seen = {}

    def draw(key, data, rng):
        return (key, rng.random())

    draw.wants_rng = True

    def run(fused):
        handlers = (draw, "rgb8")
        if fused:
            it = decoding.decode_tuple(
                _mixed_samples(), ("cls", "json"), *handlers, rng=random.Random(5)
            )
        else:
            it = stages.to_tuple(
                stages.decode(
                    _mixed_samples(), *handlers, only=["cls", "json"], rng=random.Random(5)
                ),
                "cls",
                "json",
            )
        return list(it)

    seen["fused"], seen["plain"] = run(True), run(False)
    assert seen["fused"] == seen["plain"]
    assert seen["fused"][0][0][0] == "cls" and seen["fused"][0][0] != seen["fused"][1][0]


def test_pipelines_fuse_decode_and_to_tuple(tmp_path):
    from tarshards import TarWriter, WebDataset

    path = str(tmp_path / "s.tar")
    with TarWriter(path) as w:
        for s in _mixed_samples():
            w.write(s)
    ds = WebDataset(path).decode("rgb8").to_tuple("png;jpg.png", "cls", "__key__")
    want = list(
        stages.to_tuple(stages.decode(WebDataset(path), "rgb8"), "png;jpg.png", "cls", "__key__")
    )
    _same(list(ds), want)
    # with a policy of its own, to_tuple is not fused: the same values still
    ds2 = (
        WebDataset(path).decode("rgb8").to_tuple("png;jpg.png", "cls", "__key__", on_error="raise")
    )
    _same(list(ds2), want)


def test_collation_stacks_into_the_memory_allocate_gives():
    given_out = []

    def allocate(shape, dtype):
        out = np.zeros(shape, dtype)
        given_out.append(out)
        return out

    rows = [(np.full((2, 3), i, np.uint8), i) for i in range(4)]
    images, labels = stages.default_collation_fn(rows, allocate=allocate)
    assert images is given_out[0] and images.shape == (4, 2, 3)
    assert [int(v) for v in images[:, 0, 0]] == [0, 1, 2, 3] and list(labels) == [0, 1, 2, 3]
    # a column of mixed dtypes is stacked as np.stack has it (promoted), not cast into `out`
    mixed = [np.zeros(3, np.uint8), np.full(3, 300, np.int16)]
    stacked = stages.default_collation_fn(mixed, allocate=allocate)
    assert stacked.dtype == np.int16 and stacked is not given_out[-1]
    # shapes that differ raise as without an allocation
    with pytest.raises(ValueError):
        stages.default_collation_fn([np.zeros(2), np.zeros(3)], allocate=allocate)
    # no memory given: a new array
    assert stages.default_collation_fn(rows, allocate=lambda s, d: None)[0].shape == (4, 2, 3)
