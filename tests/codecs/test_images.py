"""The image modes' whole-image JPEG path through the optional C decoder (``tarshards._jpeg``):
the same values as the simplejpeg and Pillow paths it stands in front of (pixels, dtype, shape,
strides, PIL mode/size/format/info), and what it declines goes to them as before."""

from __future__ import annotations

import functools
import io
import types

import numpy as np
import pytest
from PIL import Image

from tarshards.codecs import images
from tarshards.codecs.decoding import decode_tuple
from tarshards.errors import DecodeError

_jpeg = pytest.importorskip("tarshards._jpeg", reason="the C JPEG decoder was not built")
from test_cjpeg import jpeg  # noqa: E402

try:
    import torch
except ImportError:  # the torch modes are skipped
    torch = None


def png(width, height) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(width * height * 3, dtype=np.uint8).reshape(height, width, 3)).save(
        buf, "PNG"
    )
    return buf.getvalue()


def _exif_jpeg() -> bytes:
    img = Image.open(io.BytesIO(jpeg(40, 30, seed=7)))
    exif = Image.Exif()
    exif[0x010E] = "a description"  # ImageDescription
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


IMAGES = {
    "420 64x64": (jpeg(64, 64, quality=90), "jpg"),
    "444 odd": (jpeg(33, 21, seed=1, subsampling=0), "jpeg"),
    "422": (jpeg(48, 40, seed=2, subsampling=1), "jpg"),
    "progressive": (jpeg(57, 43, seed=3, progressive=True), "jpg"),
    "grey": (jpeg(30, 20, seed=4, mode="L"), "jpg"),
    "cmyk": (jpeg(24, 16, seed=5, mode="CMYK"), "jpg"),
    "exif": (_exif_jpeg(), "jpg"),
    "png": (png(12, 9), "png"),
}

MODES = ["pil", "pilrgb", "rgb8", "l8", "rgb", "l"]
if torch is not None:
    MODES += ["torchrgb8", "torchl8", "torchrgb", "torchl"]


def _without_c(monkeypatch):
    monkeypatch.setattr(images, "_cjpeg", lambda: None)


def _counting_c(monkeypatch) -> list:
    """The C decoder, with its ``image`` and ``dlpack`` calls (and whether they decoded)
    recorded."""
    real = images._cjpeg()
    calls: list = []

    def image(data, channels, plain):
        got = real.image(data, channels, plain)
        calls.append(got is not None)
        return got

    def dlpack(data, channels):
        got = real.dlpack(data, channels)
        calls.append(got is not None)
        return got

    def counted(fn):
        """``fn(..., fallback, data)`` counted: whether it decoded (not its fallback)"""

        def call(*args):
            declined: list = []
            fallback = args[-2]
            got = fn(*args[:-2], lambda d: declined.append(1) or fallback(d), args[-1])
            calls.append(not declined)
            return got

        return call

    ns = types.SimpleNamespace(
        decode=real.decode,
        header=real.header,
        image=image,
        dlpack=dlpack,
        pil_image=counted(real.pil_image),
        dlpack_value=counted(real.dlpack_value),
        array_value=counted(real.array_value),
    )
    monkeypatch.setattr(images, "_cjpeg", lambda: ns)
    return calls


def _assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, Image.Image):
        assert (got.mode, got.size, got.format, got.info) == (
            want.mode,
            want.size,
            want.format,
            want.info,
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        return
    if torch is not None and isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride()
        assert torch.equal(got, want)
        return
    assert got.dtype == want.dtype and got.shape == want.shape and got.strides == want.strides
    assert got.flags.writeable == want.flags.writeable
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", sorted(IMAGES))
@pytest.mark.parametrize("mode", MODES)
def test_the_c_path_gives_what_the_other_paths_give(mode, kind, monkeypatch):
    data, ext = IMAGES[kind]
    with monkeypatch.context() as m:
        _without_c(m)
        want = images.image_decoder(mode)(data, ext)
    calls = _counting_c(monkeypatch)
    got = images.image_decoder(mode)(data, ext)
    _assert_same(got, want)
    # which images the C decoder took: plain JPEGs (for pil, RGB ones without EXIF/ICC)
    took = any(calls)
    if ext == "png" or kind == "cmyk":
        assert not took
    elif mode in ("pil", "pilrgb"):
        assert took == (kind not in ("grey", "exif"))
    else:
        assert took


@pytest.mark.parametrize("mode", ["rgb8", "l8", "pilrgb"])
def test_the_c_path_gives_pillows_pixels(mode):
    """Without simplejpeg in between: the C decoder's pixels are Pillow's own decode's."""
    pil_mode = {"rgb8": "RGB", "l8": "L", "pilrgb": "RGB"}[mode]
    for kind in ("420 64x64", "444 odd", "422", "progressive", "grey"):
        data, ext = IMAGES[kind]
        own = np.asarray(Image.open(io.BytesIO(data)).convert(pil_mode))
        got = np.asarray(images.image_decoder(mode)(data, ext))
        np.testing.assert_array_equal(got, own)


def test_arrays_own_writable_memory_and_pil_images_copy_on_write():
    data = IMAGES["420 64x64"][0]
    a = images.image_decoder("rgb8")(data, "jpg")
    b = images.image_decoder("rgb8")(data, "jpg")
    want = b[0, 0].copy()
    a[0, 0] = want + 1  # each decode has its own buffer
    np.testing.assert_array_equal(b[0, 0], want)
    np.testing.assert_array_equal(a[1:], b[1:])
    img = images.image_decoder("pil")(data, "jpg")
    before = img.getpixel((0, 0))
    img.putpixel((0, 0), (9, 9, 9))
    assert img.getpixel((0, 0)) == (9, 9, 9) and before != (9, 9, 9)
    assert img.copy().getpixel((0, 0)) == (9, 9, 9)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("mode", ["torchrgb8", "torchl8", "torchrgb"])
def test_torch_modes_build_their_tensors_from_dlpack_capsules(mode, monkeypatch):
    """JPEGs the C decoder takes become tensors over its pixels through a DLPack capsule (no
    numpy array in between): the tensor the numpy path gives, and one that owns its memory."""
    import pickle

    calls: list = []
    real = images._cjpeg()
    ns = types.SimpleNamespace(**vars(real))
    ns.image = lambda *a: calls.append("image") or real.image(*a)
    ns.dlpack_value = lambda *a: calls.append("dlpack") or real.dlpack_value(*a)
    monkeypatch.setattr(images, "_cjpeg", lambda: ns)
    dec = images.image_field_decoder(mode, None, "jpg")
    ns.dlpack_value = None  # the same decoder built without the capsule path: numpy's
    want_dec = images.image_field_decoder(mode, None, "jpg")
    for kind in ("420 64x64", "444 odd", "422", "grey"):
        data = IMAGES[kind][0]
        calls.clear()
        got = dec(data)
        assert calls == ["dlpack"]
        calls.clear()
        want = want_dec(data)
        assert calls == ["image"]
        _assert_same(got, want)
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size()
        back = pickle.loads(pickle.dumps(got))
        assert torch.equal(back, want)
        got.zero_()  # writable, its own memory
        assert not torch.equal(got, want) and torch.equal(back, want)
        del got, back  # the pixels go with the tensor (the DLPack deleter)
    # what the C decoder declines (CMYK) still goes to Pillow
    cmyk = IMAGES["cmyk"][0]
    calls.clear()
    _assert_same(dec(cmyk), want_dec(cmyk))


def test_an_unconsumed_capsule_frees_its_pixels():
    data = IMAGES["420 64x64"][0]
    for channels in (1, 3):
        for _ in range(1000):  # each capsule dropped unconsumed: freed by its destructor
            assert _jpeg.dlpack(data, channels) is not None
    assert _jpeg.dlpack(data, 4) is None and _jpeg.dlpack(b"not a jpeg", 3) is None
    with pytest.raises(TypeError):
        _jpeg.dlpack(data)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_uint8_is_the_chw_view_of_the_rgb8_array():
    data = IMAGES["444 odd"][0]
    t = images.image_decoder("torchrgb8")(data, "jpg")
    arr = images.image_decoder("rgb8")(data, "jpg")
    assert tuple(t.shape) == (3, 21, 33) and t.stride() == (1, 33 * 3, 3)
    np.testing.assert_array_equal(t.permute(1, 2, 0).numpy(), arr)
    t[0, 0, 0] = 7  # writable, like torch.from_numpy of any decoded array
    assert int(t[0, 0, 0]) == 7
    g = images.image_decoder("torchl8")(data, "jpg")
    assert tuple(g.shape) == (21, 33) and g.is_contiguous()


@pytest.mark.parametrize("mode", ["pil", "rgb8"] + (["torchrgb8"] if torch is not None else []))
def test_a_broken_jpeg_fails_as_before_naming_shard_and_member(mode, monkeypatch):
    good = IMAGES["420 64x64"][0]
    samples = [
        {"__key__": f"k{i}", "__url__": "shard-0.tar", "jpg": good, "cls": b"%d" % i}
        for i in range(4)
    ]
    samples[2]["jpg"] = good[: len(good) // 3]  # truncated

    def run():
        with pytest.raises(DecodeError) as info:
            list(decode_tuple(samples, ("jpg", "cls"), mode))
        return str(info.value)

    msg = run()
    assert "k2.jpg" in msg and "shard-0.tar" in msg
    _without_c(monkeypatch)
    assert run() == msg


def test_pil_images_are_made_in_c_with_this_pillow():
    """With the Pillow installed here the template of a PIL image's attributes passes its checks,
    so a JPEG field's ``pil`` decoder is the C call itself; the image is an ordinary one."""
    dec = images.image_field_decoder("pil", None, "jpg")
    assert isinstance(dec, functools.partial) and dec.func is _jpeg.pil_image, (
        "the PIL template was refused: check images._templated against this Pillow"
    )
    data = IMAGES["420 64x64"][0]
    img = dec(data)
    want = Image.open(io.BytesIO(data))
    want.load()
    assert type(img) is Image.Image and (img.mode, img.size, img.format) == (
        "RGB",
        (64, 64),
        "JPEG",
    )
    np.testing.assert_array_equal(np.asarray(img), np.asarray(want))
    assert img.info == {} and img.readonly
    other = dec(data)
    assert other.info is not img.info  # nothing mutable shared between images
    img.info["x"] = 1
    assert other.info == {}
    assert np.asarray(img.resize((8, 8))).shape == (8, 8, 3)
    assert np.asarray(img.convert("L")).shape == (64, 64)
