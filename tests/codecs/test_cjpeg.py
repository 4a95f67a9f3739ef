"""The optional C JPEG decoder (``tarshards._jpeg``, over the system's libjpeg-turbo): a region of
the image decoded alone is the same pixels as that region of a full decode, at every DCT scale,
for the subsamplings and kinds of JPEG seen in datasets; anything unusual is declined (None)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image, ImageFilter

_jpeg = pytest.importorskip("tarshards._jpeg", reason="the C JPEG decoder was not built")
simplejpeg = pytest.importorskip("simplejpeg")


def jpeg(width, height, seed=0, mode="RGB", **save) -> bytes:
    gen = np.random.default_rng(seed)
    arr = (gen.random((height, width, 3)) * 255).astype(np.uint8)
    img = Image.fromarray(arr).filter(ImageFilter.GaussianBlur(2)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", **save)
    return buf.getvalue()


KINDS = {
    "420": jpeg(500, 375, quality=90),
    "444 odd size": jpeg(333, 257, quality=80, subsampling=0),
    "422 odd size": jpeg(301, 199, subsampling=1),
    "progressive": jpeg(640, 480, progressive=True),
    "grey": jpeg(257, 300, mode="L"),
    "tiny": jpeg(23, 17, subsampling=2),
}


def pixels(got, channels=3) -> np.ndarray:
    buf, w, h, _x0 = got
    return np.frombuffer(buf, np.uint8).reshape(h, w, channels)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_whole_image_is_simplejpegs_decode(kind):
    data = KINDS[kind]
    w, h, comps, _space = _jpeg.header(data)
    assert (h, w) == simplejpeg.decode_jpeg_header(data)[:2]
    assert comps == (1 if kind == "grey" else 3)
    for denom in (1, 2, 4, 8):
        ref = simplejpeg.decode_jpeg(
            data, "RGB", min_width=-(-w // denom), min_height=-(-h // denom)
        )
        got = _jpeg.decode(data, 3, denom, False, 0, 0, 0, 0)
        assert got[3] == 0
        np.testing.assert_array_equal(pixels(got), ref)
    grey = simplejpeg.decode_jpeg(data, "GRAY")
    np.testing.assert_array_equal(pixels(_jpeg.decode(data, 1, 1, False, 0, 0, 0, 0), 1), grey)
    rgbx = pixels(_jpeg.decode(data, 4, 1, False, 0, 0, 0, 0), 4)
    np.testing.assert_array_equal(rgbx[..., :3], simplejpeg.decode_jpeg(data, "RGB"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_region_is_that_region_of_a_full_decode(kind):
    data = KINDS[kind]
    width, height = _jpeg.header(data)[:2]
    rng = random.Random(kind)
    for denom in (1, 2, 4, 8):
        full = simplejpeg.decode_jpeg(
            data, "RGB", min_width=-(-width // denom), min_height=-(-height // denom)
        )
        sh, sw = full.shape[:2]
        boxes = [(0, 0, sw, sh), (0, 0, 1, 1), (sw - 1, sh - 1, sw, sh)]
        boxes += [
            (x0, y0, rng.randrange(x0 + 1, sw + 1), rng.randrange(y0 + 1, sh + 1))
            for x0, y0 in ((rng.randrange(sw), rng.randrange(sh)) for _ in range(25))
        ]
        for x0, y0, x1, y1 in boxes:
            got = _jpeg.decode(data, 3, denom, False, x0, y0, x1, y1)
            x = got[3]
            arr = pixels(got)
            # the decoded columns cover the asked ones; the rows are exactly those asked
            assert x <= x0 and x + arr.shape[1] >= x1 and arr.shape[0] == y1 - y0
            np.testing.assert_array_equal(arr[:, x0 - x : x1 - x], full[y0:y1, x0:x1])


def test_fast_mode_is_close():
    data = KINDS["420"]
    exact = pixels(_jpeg.decode(data, 3, 1, False, 0, 0, 0, 0)).astype(int)
    fast = pixels(_jpeg.decode(data, 3, 1, True, 0, 0, 0, 0)).astype(int)
    assert fast.shape == exact.shape
    assert np.abs(fast - exact).mean() < 2.0


def test_what_it_declines():
    data = KINDS["420"]
    cmyk = jpeg(64, 48, mode="CMYK")
    assert _jpeg.header(cmyk)[2] == 4
    assert _jpeg.decode(cmyk, 3, 1, False, 0, 0, 0, 0) is None  # Pillow decides CMYK
    assert _jpeg.decode(data[: len(data) // 2], 3, 1, False, 0, 0, 0, 0) is None  # truncated
    assert _jpeg.decode(b"not a jpeg", 3, 1, False, 0, 0, 0, 0) is None
    assert _jpeg.header(b"not a jpeg") is None
    assert _jpeg.header(b"") is None
    assert _jpeg.decode(data, 3, 3, False, 0, 0, 0, 0) is None  # not a SIMD scale
    assert _jpeg.decode(data, 2, 1, False, 0, 0, 0, 0) is None  # no 2-channel output
    assert _jpeg.decode(data, 3, 1, False, 10, 10, 10, 20) is None  # empty box
    assert _jpeg.decode(data, 3, 1, False, 0, 0, 501, 10) is None  # outside the image
    # and after all that, the kept decompressors still work
    np.testing.assert_array_equal(
        pixels(_jpeg.decode(data, 3, 1, False, 0, 0, 0, 0)), simplejpeg.decode_jpeg(data)
    )


def test_threads_share_the_decoder():
    from concurrent.futures import ThreadPoolExecutor

    data = KINDS["progressive"]
    ref = simplejpeg.decode_jpeg(data)
    with ThreadPoolExecutor(8) as pool:  # more threads than kept decompressors
        outs = list(pool.map(lambda _: _jpeg.decode(data, 3, 1, False, 0, 0, 0, 0), range(32)))
    for got in outs:
        np.testing.assert_array_equal(pixels(got), ref)


# ---------------------------------------------------------------------------------------------
# image(data, channels, plain): the whole image, the per-sample call of the image modes
# ---------------------------------------------------------------------------------------------


def sj_jpeg(width, height, seed, subsampling) -> bytes:
    """A JPEG at a subsampling Pillow does not write (simplejpeg's encoder: libjpeg-turbo's)."""
    gen = np.random.default_rng(seed)
    arr = np.asarray(
        Image.fromarray((gen.random((height, width, 3)) * 255).astype(np.uint8)).filter(
            ImageFilter.GaussianBlur(2)
        )
    )
    return simplejpeg.encode_jpeg(np.ascontiguousarray(arr), 85, "RGB", subsampling)


WHOLE = dict(
    KINDS,
    **{
        "440": sj_jpeg(64, 64, 1, "440"),
        "411 odd size": sj_jpeg(67, 33, 2, "411"),
        "small 64x64 q90": jpeg(64, 64, seed=3, quality=90),
        "progressive 444 odd": jpeg(31, 45, seed=4, progressive=True, subsampling=0),
        "1x1": jpeg(1, 1, seed=5),
    },
)


def image_pixels(got, channels) -> np.ndarray:
    buf, w, h = got
    assert isinstance(buf, bytearray) and len(buf) == w * h * channels
    return np.frombuffer(buf, np.uint8).reshape(h, w, channels)


@pytest.mark.parametrize("kind", sorted(WHOLE))
def test_image_is_simplejpegs_decode(kind):
    data = WHOLE[kind]
    grey = kind == "grey"
    for channels, space in ((3, "RGB"), (1, "GRAY"), (4, "RGBX")):
        ref = simplejpeg.decode_jpeg(data, space, fastdct=False, fastupsample=False)
        if channels == 4:
            ref = ref[..., :3]
        got = image_pixels(_jpeg.image(data, channels, False), channels)
        np.testing.assert_array_equal(got[..., :3] if channels == 4 else got, ref)
        plain = _jpeg.image(data, channels, True)
        if grey == (channels == 1):  # plain: the components match the output
            np.testing.assert_array_equal(image_pixels(plain, channels), got)
        else:
            assert plain is None


def _with_app_marker(data: bytes, marker: int, payload: bytes) -> bytes:
    """``data`` with an APPn segment inserted after SOI."""
    seg = bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload
    return data[:2] + seg + data[2:]


def test_image_plain_declines_what_pillow_would_put_in_info():
    data = WHOLE["small 64x64 q90"]
    exif = _with_app_marker(data, 0xE1, b"Exif\x00\x00" + bytes(20))
    icc = _with_app_marker(data, 0xE2, b"ICC_PROFILE\x00" + bytes(20))
    comment = _with_app_marker(data, 0xEE, b"other app data")  # not in info: still plain
    ref = simplejpeg.decode_jpeg(data)
    for marked in (exif, icc):
        assert _jpeg.image(marked, 4, True) is None
        np.testing.assert_array_equal(image_pixels(_jpeg.image(marked, 3, False), 3), ref)
    np.testing.assert_array_equal(image_pixels(_jpeg.image(comment, 4, True), 4)[..., :3], ref)


def test_image_declines_the_unusual():
    data = WHOLE["420"]
    cmyk = jpeg(64, 48, mode="CMYK")
    for channels in (1, 3, 4):
        for plain in (False, True):
            assert _jpeg.image(cmyk, channels, plain) is None  # Pillow decides CMYK
            assert _jpeg.image(data[: len(data) // 2], channels, plain) is None  # truncated
            assert _jpeg.image(b"not a jpeg", channels, plain) is None
            assert _jpeg.image(b"", channels, plain) is None
    assert _jpeg.image(data, 2, False) is None  # no 2-channel output
    with pytest.raises(TypeError):
        _jpeg.image(data, 3)
    with pytest.raises(TypeError):
        _jpeg.image("text", 3, False)
    # and after all that, the kept decompressors still work, from several threads at once
    from concurrent.futures import ThreadPoolExecutor

    ref = simplejpeg.decode_jpeg(data)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: _jpeg.image(data, 3, False), range(32)))
    for got in outs:
        np.testing.assert_array_equal(image_pixels(got, 3), ref)


def test_small_jpegs_truncated_or_followed_by_bytes():
    """A small single-scan JPEG's entropy-coded data is decoded from a padded copy (libjpeg-turbo's
    fast Huffman decoder wants KBs left in its buffer): the same pixels, with restart markers
    too; truncated at any point it is still declined, and a lost EOI is not made up."""
    data = WHOLE["small 64x64 q90"]
    ref = simplejpeg.decode_jpeg(data)
    buf = io.BytesIO()
    Image.fromarray(ref).save(buf, "JPEG", quality=90, restart_marker_blocks=2)
    restarts = buf.getvalue()
    assert b"\xff\xd0" in restarts
    for jpg in (data, restarts, WHOLE["tiny"], WHOLE["1x1"], WHOLE["440"]):
        want = simplejpeg.decode_jpeg(jpg, fastdct=False, fastupsample=False)
        for _ in range(3):  # a kept decompressor and its kept copy, used again
            np.testing.assert_array_equal(image_pixels(_jpeg.image(jpg, 3, False), 3), want)
        h, w = want.shape[:2]
        got = _jpeg.decode(jpg, 3, 1, False, 0, h // 2, w, h)  # rows skipped, then decoded
        np.testing.assert_array_equal(pixels(got)[:, : w - got[3]], want[h // 2 :, got[3] :])
        for cut in range(len(jpg) - 1, 1, -max(1, len(jpg) // 200)):
            assert _jpeg.image(jpg[:cut], 3, False) is None, cut
        # bytes after the EOI are not read (such a JPEG is not padded: read as it is)
        np.testing.assert_array_equal(image_pixels(_jpeg.image(jpg + b"\0" * 9, 3, False), 3), want)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_into_writes_what_image_gives(kind):
    """into(channels, data, out): the pixels image() gives, written into out; another size, a
    JPEG declined or damaged: False (the caller decodes another way)."""
    data = KINDS[kind]
    for channels in (3, 1):
        got = _jpeg.image(data, channels, False)
        if got is None:
            out = np.empty((8, 8, 3) if channels == 3 else (8, 8), np.uint8)
            assert _jpeg.into(channels, data, out) is False
            continue
        px, w, h = got
        want = np.frombuffer(px, np.uint8).reshape((h, w, 3) if channels == 3 else (h, w))
        out = np.zeros(want.shape, np.uint8)
        assert _jpeg.into(channels, data, out) is True
        assert np.array_equal(out, want)
        rows = np.zeros((2, *want.shape), np.uint8)
        assert _jpeg.into(channels, data, rows[1]) is True  # a row of a batch
        assert np.array_equal(rows[1], want) and not rows[0].any()
        other = np.zeros((h + 1, w, 3)[: 3 if channels == 3 else 2], np.uint8)
        assert _jpeg.into(channels, data, other) is False
    assert _jpeg.into(3, data[: len(data) // 2], np.empty((1, 1, 3), np.uint8)) is False


def test_into_refuses_memory_of_another_kind():
    data = KINDS["420"]
    for bad in (
        np.empty((375, 500, 3), np.float32),
        np.empty((375, 500, 4), np.uint8),
        np.empty((375, 500), np.uint8),  # channels 3 wants (h, w, 3)
        np.empty((375, 1000, 3), np.uint8)[:, ::2],  # not contiguous
    ):
        with pytest.raises((ValueError, BufferError)):
            _jpeg.into(3, data, bad)
    with pytest.raises(BufferError):
        _jpeg.into(3, data, b"\0" * (375 * 500 * 3))  # read-only
    assert _jpeg.into(4, data, np.empty((375, 500, 4), np.uint8)) is False


# ---- which libjpeg decodes: the one the module was linked with ------------------------------


def test_the_linked_libjpeg_decodes_and_nothing_else_is_loaded():
    """The C decoder calls the libjpeg-turbo it was linked with (the system's); loading the one a
    Pillow wheel bundles (found by globbing Pillow's files) was weighed and removed (issue 36,
    item 7: under 3 % on its row, bench/NOTES.md), and with it the means to switch."""
    import os

    from tarshards.codecs import images

    assert not hasattr(_jpeg, "use_library")
    images._cjpeg()  # its first use: nothing chosen, nothing loaded
    linked = _jpeg.library()
    assert linked is not None and os.path.exists(linked)
    pillows = images._pillow_libjpeg()
    if pillows is not None:
        assert not os.path.samefile(linked, pillows)
    assert images.jpeg_decoder()["libjpeg"] == linked
    got = _jpeg.decode(KINDS["420"], 3, 1, False, 0, 0, 0, 0)
    np.testing.assert_array_equal(pixels(got), simplejpeg.decode_jpeg(KINDS["420"], "RGB"))
