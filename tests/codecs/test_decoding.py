"""The fused decode + to_tuple stage's row function (decoding.decode_tuple): the common case
taken in one small call per sample, and every sample it does not fit handed to the plan's loop,
so the values and errors are those of decode then to_tuple."""

from __future__ import annotations

import json

import pytest

from tarshards.codecs.decoding import decode_tuple
from tarshards.errors import DecodeError, MissingFieldError
from tarshards.pipeline import stages


def sample(i, **fields):
    s = {"__key__": f"k{i}", "__url__": "shard-3.tar", "cls": b"%d" % i, "json": b'{"i": %d}' % i}
    s.update(fields)
    return s


def both(samples, fields, *handlers, **kw):
    fused = list(decode_tuple(list(samples), fields, *handlers, **kw))
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
        list(decode_tuple(samples, ("txt", "cls")))


def test_decoded_values_and_partial():
    samples = [sample(0), sample(1, cls=1), sample(2)]
    with pytest.raises(DecodeError, match="already decoded"):
        list(decode_tuple(samples, ("cls", "json")))
    assert list(decode_tuple(samples, ("cls", "json"), partial=True)) == [
        (i, {"i": i}) for i in range(3)
    ]


@pytest.mark.parametrize("bad", ["cls", "json"])
def test_an_error_names_the_field_that_failed(bad):
    samples = [sample(i) for i in range(4)]
    samples[2][bad] = b"not valid"
    with pytest.raises(DecodeError) as fused:
        list(decode_tuple(samples, ("cls", "json")))
    with pytest.raises(DecodeError) as plain:
        list(stages.to_tuple(stages.decode(samples), "cls", "json"))
    assert str(fused.value) == str(plain.value)
    assert f"k2.{bad}" in str(fused.value) and "shard-3.tar" in str(fused.value)
    with pytest.warns(Warning):
        got = list(decode_tuple(samples, ("cls", "json"), on_error="warn"))
    assert got == [(i, {"i": i}) for i in (0, 1, 3)]


def test_custom_handlers_see_every_field_as_before():
    seen = []

    def handler(key, data):
        seen.append(key)
        return json.loads(data)["i"] * 10 if key == "json" else None

    samples = [sample(i) for i in range(3)]
    assert both(samples, ("cls", "json"), handler) == [(i, i * 10) for i in range(3)]
    assert seen[:2] == ["cls", "json"]


# ---- images decoded straight into a batch's memory (decoding.BatchRows) ----------------------


def _jpeg(seed, shape=(24, 32, 3), gray=False):
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels[..., 0] if gray else pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _batches(samples, mode, batchsize, allocate=None, on_error="raise", fields=("jpg", "cls")):
    """``.decode(mode).to_tuple(*fields).batched(batchsize)`` over ``samples``, with a loader
    transport's ``allocate`` given to the pipeline as a worker gives it."""
    from tarshards.codecs.decoding import BatchRows
    from tarshards.pipeline.composition import DataPipeline

    made = []

    class Counted(BatchRows):  # the batches' image columns this path decoded in
        def take(self, position, values):
            got = super().take(position, values)
            made.append(got is not None)
            return got

    pipe = (
        DataPipeline(samples, on_error=on_error).decode(mode).to_tuple(*fields).batched(batchsize)
    )
    if allocate is not None:
        pipe.attach_loader(allocate=allocate)
    import tarshards.codecs.decoding

    saved, tarshards.codecs.decoding.BatchRows = tarshards.codecs.decoding.BatchRows, Counted
    try:
        return list(pipe), made
    finally:
        tarshards.codecs.decoding.BatchRows = saved


@pytest.mark.parametrize("mode", ["rgb8", "l8"])
def test_batch_rows_decode_into_the_batch_memory(mode):
    """Each batch's image column is the very array the transport allocated (no stacking copy),
    holding what decoding each JPEG alone gives; labels are collated as always; the last,
    partial batch is a view of its allocation."""
    import numpy as np

    pytest.importorskip("tarshards._jpeg", reason="the C decoder is not built")
    samples = [
        {"__key__": f"k{i}", "jpg": _jpeg(i, gray=i % 3 == 0), "cls": b"%d" % i} for i in range(11)
    ]
    allocated = []

    def allocate(shape, dtype):
        out = np.empty(shape, dtype)
        allocated.append(out)
        return out

    got, made = _batches(samples, mode, 4, allocate)
    want, _ = _batches(samples, mode, 4)
    assert made == [True, False] * 3  # the images' column taken as it is; the labels stacked
    assert len(got) == len(want) == 3
    for (gi, gc), (wi, wc) in zip(got, want):
        assert gi.dtype == wi.dtype == np.uint8 and np.array_equal(gi, wi)
        assert np.array_equal(gc, wc)
    assert [g[0] is a for g, a in zip(got, allocated)] == [True, True, False]
    assert got[2][0].base is allocated[2] and len(got[2][0]) == 3
    assert len(allocated) == 3  # one per batch: the labels are not arrays of images


def test_batch_rows_fall_back_to_stacking_whatever_does_not_fit():
    """Images of another size, a damaged JPEG the error policy skips, a row dropped after its
    image was decoded, a PNG: the batches are those of the plain path."""
    import io

    import numpy as np
    from PIL import Image

    pytest.importorskip("tarshards._jpeg", reason="the C decoder is not built")
    png = io.BytesIO()
    Image.fromarray(np.zeros((24, 32, 3), np.uint8)).save(png, "PNG")
    samples = [{"__key__": f"k{i}", "jpg": _jpeg(i), "cls": b"%d" % i} for i in range(16)]
    samples[5]["jpg"] = samples[5]["jpg"][:200]  # damaged: skipped by the policy
    samples[9]["cls"] = b"not a number"  # its image decoded into a row, then the row dropped
    samples[12]["jpg"] = png.getvalue()  # not a JPEG: decoded by Pillow
    odd = [{"__key__": f"o{i}", "jpg": _jpeg(i, (8 + i, 32, 3)), "cls": b"1"} for i in range(3)]
    allocated = []

    def allocate(shape, dtype):
        out = np.empty(shape, dtype)
        allocated.append(out)
        return out

    for data in (samples, odd):
        kw = {"on_error": "skip"}
        size = 1 if data is odd else 4  # images of three sizes: one a batch, else no stack
        got, made = _batches(data, "rgb8", size, allocate, **kw)
        want, _ = _batches(data, "rgb8", size, **kw)
        assert len(got) == len(want)
        for (gi, gc), (wi, wc) in zip(got, want):
            assert np.array_equal(gi, wi) and np.array_equal(gc, wc)
        if data is odd:
            assert made == [True, False] * 3
        else:  # batches 0-3 and 4,6-8 (the damaged 5 skipped before taking a row) straight
            # in; 10-13 stacked (9's image took a row, then 9 was dropped; 12 is a PNG); 14-15 in
            assert made[::2] == [True, True, False, True]


def test_batch_rows_only_where_the_images_are_the_batch_column():
    """A custom handler, a size, or another mode: the plain path (no allocation for images)."""
    import numpy as np

    samples = [{"__key__": f"k{i}", "jpg": _jpeg(i), "cls": b"%d" % i} for i in range(4)]
    shapes = []

    def allocate(shape, dtype):
        shapes.append(shape)
        return np.empty(shape, dtype)

    _, made = _batches(samples, "rgb", 4, allocate)  # floats: stacked into the memory
    assert shapes == [(4, 24, 32, 3)] and made == [False, False]
