"""Every codec round-trips; image modes give the right types; unsafe codecs are refused."""

from __future__ import annotations

import gzip
import io
import pickle

import numpy as np
import pytest
from PIL import Image

from tarshards.codecs.registry import (
    IMAGE_EXTENSIONS,
    IMAGE_MODES,
    codec_for,
    decode_value,
    encode_value,
    field_decoder,
)
from tarshards.errors import DecodeError, UnsafeCodecError

try:
    import torch
except ImportError:  # pragma: no cover - CI installs torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@pytest.mark.parametrize("ext", ["txt", "text"])
def test_text(ext):
    data = encode_value("héllo wörld", ext)
    assert isinstance(data, bytes) and data == "héllo wörld".encode()
    assert decode_value(data, ext) == "héllo wörld"


@pytest.mark.parametrize("ext", ["cls", "cls2", "index", "id"])
@pytest.mark.parametrize("value", [0, 7, -3, 123456789, np.int64(42)])
def test_int(ext, value):
    data = encode_value(value, ext)
    assert data == str(int(value)).encode()
    got = decode_value(data, ext)
    assert got == int(value) and type(got) is int


def test_int_rejects_non_ints():
    with pytest.raises(DecodeError):
        encode_value([1, 2], "cls")
    with pytest.raises(DecodeError):
        encode_value(1.5, "cls")
    with pytest.raises(ValueError):
        decode_value(b"not a number", "cls")


@pytest.mark.parametrize("ext", ["json", "jsn"])
def test_json(ext):
    value = {"a": [1, 2.5, None, "x"], "b": {"c": True}, "n": np.int32(4), "arr": np.arange(3)}
    got = decode_value(encode_value(value, ext), ext)
    assert got == {"a": [1, 2.5, None, "x"], "b": {"c": True}, "n": 4, "arr": [0, 1, 2]}


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([1, 2, 3], dtype=np.uint8),
        np.zeros((0, 5), dtype=np.int64),
        np.array(3.5),
    ],
)
def test_npy(arr):
    got = decode_value(encode_value(arr, "npy"), "npy")
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


def test_npy_refuses_object_arrays():
    data = io.BytesIO()
    np.save(data, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        decode_value(data.getvalue(), "npy")


def test_npz():
    value = {"x": np.arange(5), "y": np.ones((2, 2), dtype=np.float16)}
    got = decode_value(encode_value(value, "npz"), "npz")
    assert sorted(got) == ["x", "y"]
    for k in value:
        np.testing.assert_array_equal(got[k], value[k])
        assert got[k].dtype == value[k].dtype


def test_msgpack():
    pytest.importorskip("msgpack")
    value = {"a": [1, 2, 3], "b": "text", "c": b"\x00\x01", "d": {"e": 1.5}}
    assert decode_value(encode_value(value, "msgpack"), "msgpack") == value


def test_bytes_and_str_pass_through():
    assert encode_value(b"\x00raw", "jpg") == b"\x00raw"
    assert encode_value("text", "json") == b"text"
    assert encode_value(bytearray(b"ab"), "whatever") == b"ab"
    assert encode_value(memoryview(b"cd"), "npy") == b"cd"
    with pytest.raises(TypeError):
        encode_value(object(), "unknownext")
    assert field_decoder("unknownext") is None
    assert decode_value(b"abc", "unknownext") == b"abc"


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------


def rgb_image(w=40, h=30):
    x = np.linspace(0, 255, w, dtype=np.float32)
    y = np.linspace(0, 255, h, dtype=np.float32)
    arr = np.stack([np.add.outer(y, x) / 2, np.add.outer(y * 0, x), np.add.outer(y, x * 0)], -1)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


LOSSLESS = ("png", "ppm", "pnm", "bmp", "tif", "tiff")


@pytest.mark.parametrize("ext", IMAGE_EXTENSIONS)
def test_image_roundtrip(ext):
    img = rgb_image()
    data = encode_value(img, ext)
    assert codec_for(ext).image
    back = decode_value(data, ext, image_mode="pil")
    assert isinstance(back, Image.Image) and back.size == img.size
    want = np.asarray(img.convert("RGB")).astype(int)
    got = np.asarray(back.convert("RGB")).astype(int)
    if ext in LOSSLESS:
        np.testing.assert_array_equal(got, want)
    elif ext == "pgm":
        np.testing.assert_array_equal(np.asarray(back), np.asarray(img.convert("L")))
    elif ext == "pbm":
        assert back.mode == "1"
    elif ext == "webp" and back.mode in ("RGB", "RGBA"):
        assert np.abs(got - want).mean() < 20
    else:  # jpeg, gif (palette) are lossy
        assert np.abs(got - want).mean() < 20


@pytest.mark.parametrize("ext", ["png", "jpg"])
def test_image_from_arrays(ext):
    arr = np.asarray(rgb_image())
    for value in (arr, arr.transpose(2, 0, 1), arr.astype(np.float32) / 255):
        got = decode_value(encode_value(value, ext), ext, image_mode="rgb8")
        assert got.shape == arr.shape
        assert np.abs(got.astype(int) - arr.astype(int)).mean() < (0.6 if ext == "png" else 5)


def test_image_rejects_non_images():
    with pytest.raises(DecodeError):
        encode_value({"not": "an image"}, "png")


def test_gz_member_compression():
    img = rgb_image()
    data = encode_value(img, "seg.png.gz")
    raw = gzip.decompress(data)
    assert raw.startswith(b"\x89PNG")
    got = decode_value(data, "seg.png.gz", image_mode="rgb8")
    np.testing.assert_array_equal(got, np.asarray(img))
    assert decode_value(encode_value({"a": 1}, "json.gz"), "json.gz") == {"a": 1}
    # str is never gzip data: it is compressed (bytes pass through, taken as compressed already)
    assert decode_value(encode_value("héllo", "txt.gz"), "txt.gz") == "héllo"
    assert encode_value(b"\x1f\x8bxyz", "txt.gz") == b"\x1f\x8bxyz"
    assert decode_value(gzip.compress(b"7"), "cls.gz") == 7
    assert decode_value(gzip.compress(b"raw"), "gz") == b"raw"
    # images stay bytes (decompressed) when there is no image mode
    assert decode_value(data, "seg.png.gz", image_mode=None) == raw


def _expected_mode(mode):
    pil_mode, kind = IMAGE_MODES[mode]
    return pil_mode, kind


@pytest.mark.parametrize("mode", sorted(IMAGE_MODES))
@pytest.mark.parametrize("ext", ["png", "jpg"])
def test_image_modes(mode, ext):
    pil_mode, kind = IMAGE_MODES[mode]
    img = rgb_image(40, 30)
    data = encode_value(img, ext)
    if kind.startswith("torch") and torch is None:
        pytest.skip("torch is not installed")
    got = decode_value(data, ext, image_mode=mode)
    channels = {"L": None, "RGB": 3, "RGBA": 4, None: 3}[pil_mode]
    if kind == "pil":
        assert isinstance(got, Image.Image)
        assert got.mode == (pil_mode or "RGB") and got.size == (40, 30)
        return
    if kind in ("uint8", "float"):
        assert isinstance(got, np.ndarray)
        assert got.shape == ((30, 40) if channels is None else (30, 40, channels))
        assert got.flags.writeable  # callers may augment in place
        if kind == "uint8":
            assert got.dtype == np.uint8
        else:
            assert got.dtype == np.float32 and got.min() >= 0 and got.max() <= 1
            assert got.max() > 0.5  # scaled to [0, 1], not left in [0, 255] or [0, 1/255]
        return
    assert isinstance(got, torch.Tensor)
    assert got.shape == ((30, 40) if channels is None else (channels, 30, 40))  # CHW
    if kind == "torch-uint8":
        assert got.dtype == torch.uint8
    else:
        assert got.dtype == torch.float32
        assert float(got.min()) >= 0 and float(got.max()) <= 1 and float(got.max()) > 0.5


@needs_torch
def test_torch_mode_matches_rgb8():
    data = encode_value(rgb_image(), "png")
    t = decode_value(data, "png", image_mode="torch")
    arr = decode_value(data, "png", image_mode="rgb8")
    np.testing.assert_allclose(t.permute(1, 2, 0).numpy() * 255, arr, atol=1e-3)


def test_grayscale_jpeg_in_rgb_modes():
    img = rgb_image().convert("L")
    data = encode_value(img, "jpg")
    assert decode_value(data, "jpg", image_mode="rgb8").shape == (30, 40, 3)
    assert decode_value(data, "jpg", image_mode="l8").shape == (30, 40)


@pytest.mark.parametrize("ext", ["jpg", "png", "webp"])
@pytest.mark.parametrize("mode", ["pil", "rgb8", "l8", "rgb", "torchrgb"])
@pytest.mark.parametrize("size", [(20, 15), (10, 10), (64, 48)])
def test_reduced_size_decoding(ext, mode, size):
    if mode.startswith("torch") and torch is None:
        pytest.skip("torch is not installed")
    data = encode_value(rgb_image(80, 60), ext)
    got = decode_value(data, ext, image_mode=mode, size=size)
    w, h = size
    if mode == "pil":
        assert got.size == (w, h)
    elif mode == "torchrgb":
        assert tuple(got.shape) == (3, h, w)
    elif mode == "l8":
        assert got.shape == (h, w)
    else:
        assert got.shape == (h, w, 3)


def test_unknown_image_mode():
    with pytest.raises(ValueError, match="unknown image decoding mode"):
        field_decoder("jpg", image_mode="nonsense")


# ---------------------------------------------------------------------------------------------
# unsafe codecs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["pyd", "pkl", "pickle"])
def test_pickle_refused_unless_allowed(ext):
    value = {"a": [1, 2], "b": (3, 4)}
    data = encode_value(value, ext)
    assert pickle.loads(data) == value
    with pytest.raises(UnsafeCodecError) as ei:
        decode_value(data, ext)
    assert isinstance(ei.value, PermissionError)
    assert "allow_unsafe=True" in str(ei.value) and "arbitrary code" in str(ei.value)
    assert decode_value(data, ext, allow_unsafe=True) == value
    assert not codec_for(ext).safe


def test_pickle_refused_inside_gz():
    data = gzip.compress(pickle.dumps([1]))
    with pytest.raises(UnsafeCodecError):
        decode_value(data, "pkl.gz")
    assert decode_value(data, "pkl.gz", allow_unsafe=True) == [1]


@needs_torch
def test_pth_refused_unless_allowed():
    value = {"w": torch.arange(4.0)}
    data = encode_value(value, "pth")
    with pytest.raises(UnsafeCodecError, match="allow_unsafe"):
        decode_value(data, "pth")
    got = decode_value(data, "pth", allow_unsafe=True)
    assert torch.equal(got["w"], value["w"])


def test_refusal_does_not_run_the_payload(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    data = pickle.dumps(Evil())
    with pytest.raises(UnsafeCodecError):
        decode_value(data, "pkl")
    assert not marker.exists()


def test_pil_jpegs_over_the_decoded_buffer_behave_as_pillows_own():
    """RGB JPEGs come back as images over simplejpeg's RGBX buffer (no copy): the same pixels as
    Pillow's decoder, and every Pillow operation works on them as on any image."""
    pytest.importorskip("simplejpeg")
    rng = np.random.default_rng(3)
    img = Image.fromarray((rng.random((30, 41, 3)) * 255).astype(np.uint8))
    data = encode_value(img, "jpg")
    got = decode_value(data, "jpg", image_mode="pil")
    own = Image.open(io.BytesIO(data))
    own.load()
    assert got.mode == "RGB" and got.size == (41, 30) and got.format == "JPEG"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(own))
    assert got.tobytes() == own.tobytes()
    back = pickle.loads(pickle.dumps(got))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(own))
    np.testing.assert_array_equal(np.asarray(got.convert("L")), np.asarray(own.convert("L")))
    np.testing.assert_array_equal(
        np.asarray(got.resize((20, 15))), np.asarray(own.resize((20, 15)))
    )
    assert got.convert("RGBA").getpixel((3, 4))[3] == 255
    other = decode_value(data, "jpg", image_mode="pil")
    got.putpixel((0, 0), (1, 2, 3))  # copy-on-write: the next image is not touched
    assert got.getpixel((0, 0)) == (1, 2, 3)
    assert other.getpixel((0, 0)) == own.getpixel((0, 0))
    buf = io.BytesIO()
    got.save(buf, "PNG")
    assert Image.open(buf).size == (41, 30)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_uint8_images_are_views_and_batch_contiguously():
    from tarshards.torch.adapter import stack

    data = encode_value(rgb_image(40, 30), "jpg")
    t = decode_value(data, "jpg", image_mode="torchrgb8")
    arr = decode_value(data, "jpg", image_mode="rgb8")
    assert tuple(t.shape) == (3, 30, 40) and not t.is_contiguous()  # a CxHxW view, no copy
    np.testing.assert_array_equal(t.permute(1, 2, 0).numpy(), arr)
    batch = stack([t, t.clone(), t])
    assert tuple(batch.shape) == (3, 3, 30, 40) and batch.is_contiguous()
    assert torch.equal(batch[1], t) and torch.equal(batch[0], t)
    f = decode_value(data, "jpg", image_mode="torchrgb")
    np.testing.assert_allclose(f.permute(1, 2, 0).numpy() * 255, arr, atol=1e-3)
