"""One registry of codecs: for each extension, how to encode a value and how to decode bytes.

Decoding is chosen by the *last* component of a field's extension (``seg.png`` decodes as ``png``);
a final ``.gz`` is decompressed first (``seg.png.gz``). Images decode according to a *mode* with
webdataset's names (``pil``, ``rgb8``, ``torchrgb``...). Codecs that can run arbitrary code (pickle,
``torch.load``) are marked unsafe and refuse to decode unless the caller opts in.

Heavy or optional libraries (PIL, msgpack, simplejpeg, torch) are imported on first use. The parts
that need torch (the ``torch*`` image modes, ``.pth``) are *optional entries*: their names are
declared here by the package (:data:`OPTIONAL_CODECS`, :data:`OPTIONAL_ARRAY_KINDS`) and
:mod:`tarshards.torch` registers them when first used; without torch they raise
:class:`~tarshards.errors.MissingDependencyError` with the install command.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import io
import json
import pickle
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ._lazy import LazyModule, OptionalEntries
from .errors import DecodeError, MissingDependencyError, UnsafeCodecError

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")  # numpy is imported on first use

__all__ = [
    "Codec",
    "IMAGE_EXTENSIONS",
    "IMAGE_MODES",
    "codec_for",
    "decode_value",
    "encode_sample",
    "encode_value",
    "field_decoder",
    "register_array_kind",
    "register_codec",
    "register_image_mode",
]

IMAGE_EXTENSIONS = (
    "jpg",
    "jpeg",
    "png",
    "ppm",
    "pgm",
    "pbm",
    "pnm",
    "bmp",
    "tif",
    "tiff",
    "webp",
    "gif",
)
_JPEG = ("jpg", "jpeg")


@dataclass(frozen=True)
class Codec:
    """How one family of extensions is written and read.

    ``encode(value, ext) -> bytes`` and ``decode(data, ext) -> value``; ``safe=False`` marks codecs
    that may execute code when decoding.
    """

    extensions: tuple[str, ...]
    encode: Callable[[Any, str], bytes]
    decode: Callable[[bytes, str], Any]
    safe: bool = True
    image: bool = False


_REGISTRY: dict[str, Codec] = {}
# extensions whose codec an optional module registers on first use (``safe=`` known before)
OPTIONAL_CODECS = OptionalEntries("codec")


def register_codec(codec: Codec) -> None:
    """Add (or replace) a codec for its extensions."""
    for ext in codec.extensions:
        _REGISTRY[ext.lower()] = codec


def _optional_codec(last: str) -> Codec | None:
    """The codec of an optional extension, its module imported now (``None``: not one)."""
    if last not in OPTIONAL_CODECS:
        return None
    OPTIONAL_CODECS.load(last)
    return _REGISTRY[last]


def codec_for(ext: str) -> Codec | None:
    """The codec for an extension (by its last component), or ``None``."""
    last = ext.rpartition(".")[2].lower()
    return _REGISTRY.get(last) or _optional_codec(last)


def _lazy(module: str, purpose: str, extra: str | None = None):
    try:
        return importlib.import_module(module)
    except ImportError:
        hint = f"pip install 'tarshards[{extra}]'" if extra else f"pip install {module}"
        raise MissingDependencyError(f"{purpose} needs the {module} package: {hint}") from None


# ---------------------------------------------------------------------------------------------
# plain codecs
# ---------------------------------------------------------------------------------------------


def _enc_text(value, ext):
    return str(value).encode("utf-8")


def _dec_text(data, ext):
    return data.decode("utf-8")


def _enc_int(value, ext):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer, str)):
        if hasattr(value, "item"):
            value = value.item()
        else:
            raise TypeError(f"a .{ext} field holds an int, got {type(value).__name__}")
    return str(int(value)).encode("ascii")


def _dec_int(data, ext):
    return int(data)


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _enc_json(value, ext):
    return json.dumps(value, default=_json_default, separators=(",", ":")).encode("utf-8")


def _dec_json(data, ext):
    return json.loads(data)


def _enc_npy(value, ext):
    buf = io.BytesIO()
    np.save(buf, np.asarray(value), allow_pickle=False)
    return buf.getvalue()


def _dec_npy(data, ext):
    return np.load(io.BytesIO(data), allow_pickle=False)


def _enc_npz(value, ext):
    if not isinstance(value, dict):
        raise TypeError(f"a .{ext} field holds a dict of arrays, got {type(value).__name__}")
    buf = io.BytesIO()
    arrays: dict[str, Any] = {k: np.asarray(v) for k, v in value.items()}
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _dec_npz(data, ext):
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _enc_msgpack(value, ext):
    return _lazy("msgpack", "the .msgpack codec", "msgpack").packb(value, use_bin_type=True)


def _dec_msgpack(data, ext):
    return _lazy("msgpack", "the .msgpack codec", "msgpack").unpackb(data, raw=False)


def _enc_pickle(value, ext):
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _dec_pickle(data, ext):
    return pickle.loads(data)


def _tenbin():
    return importlib.import_module("tarshards.tenbin")  # numpy, imported on first use


def _enc_tenbin(value, ext):
    return _tenbin().encode_buffer(value if isinstance(value, (list, tuple)) else [value])


def _dec_tenbin(data, ext):
    return _tenbin().decode_buffer(data)


def _enc_gz(value, ext):
    inner = ext.rpartition(".")[0] if "." in ext else ""
    raw = encode_value(value, inner) if inner else _as_bytes(value, ext)
    return gzip.compress(raw, mtime=0)


def _dec_gz(data, ext):
    return gzip.decompress(data)


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------

_PIL_FORMATS = {
    "jpg": "JPEG",
    "jpeg": "JPEG",
    "png": "PNG",
    "ppm": "PPM",
    "pgm": "PPM",
    "pbm": "PPM",
    "pnm": "PPM",
    "bmp": "BMP",
    "tif": "TIFF",
    "tiff": "TIFF",
    "webp": "WEBP",
    "gif": "GIF",
}


def _enc_image(value, ext):
    from PIL import Image

    fmt = _PIL_FORMATS[ext]
    if isinstance(value, np.ndarray):
        arr = value
        if arr.dtype != np.uint8:
            if np.issubdtype(arr.dtype, np.floating):
                arr = np.clip(arr * 255.0 + 0.5, 0, 255)
            arr = arr.astype(np.uint8)
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[2] not in (1, 3, 4):
            arr = arr.transpose(1, 2, 0)  # CHW -> HWC
        if arr.ndim == 3 and arr.shape[2] == 1:
            arr = arr[:, :, 0]
        value = Image.fromarray(arr)
    if not isinstance(value, Image.Image):
        raise TypeError(
            f"a .{ext} field holds an image (PIL or ndarray), got {type(value).__name__}"
        )
    if fmt == "JPEG" and value.mode not in ("RGB", "L", "CMYK"):
        value = value.convert("RGB")
    if ext == "pgm" and value.mode != "L":
        value = value.convert("L")
    if ext == "pbm" and value.mode != "1":
        value = value.convert("1")
    buf = io.BytesIO()
    if fmt == "JPEG":
        value.save(buf, format=fmt, quality=90)
    else:
        value.save(buf, format=fmt)
    return buf.getvalue()


def _dec_image_pil(data, ext):
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img


# mode -> (PIL mode or None, array kind): kind is "pil", "uint8", "float", or a lazy module name
IMAGE_MODES: dict[str, tuple[str | None, str]] = {
    "pil": (None, "pil"),
    "pilrgb": ("RGB", "pil"),
    "pilrgba": ("RGBA", "pil"),
    "pill": ("L", "pil"),
    "l8": ("L", "uint8"),
    "rgb8": ("RGB", "uint8"),
    "rgba8": ("RGBA", "uint8"),
    "l": ("L", "float"),
    "rgb": ("RGB", "float"),
    "rgba": ("RGBA", "float"),
    "torchl8": ("L", "torch-uint8"),
    "torchrgb8": ("RGB", "torch-uint8"),
    "torchrgba8": ("RGBA", "torch-uint8"),
    "torchl": ("L", "torch-float"),
    "torchrgb": ("RGB", "torch-float"),
    "torchrgba": ("RGBA", "torch-float"),
    "torch": ("RGB", "torch-float"),
}

_EXTRA_MODES: dict[str, Callable[[bytes, str], Any]] = {}


def register_image_mode(name: str, fn: Callable[[bytes, str], Any]) -> None:
    """Add an image decoding mode: ``fn(data, ext) -> value``."""
    _EXTRA_MODES[name] = fn


@dataclass(frozen=True)
class ArrayKind:
    """What a kind of :data:`IMAGE_MODES` makes of the decoded HxWxC (or HxW) uint8 array:
    ``convert(array, size)``. With ``resizes``, ``convert`` resizes to ``size=(w, h)`` itself, so
    JPEGs are decoded at the smallest reduced scale that is at least ``size``."""

    convert: Callable[[Any, Any], Any]
    resizes: bool = False


_ARRAY_KINDS: dict[str, ArrayKind] = {}
# kinds that an optional module registers on first use ("torch-uint8", "torch-float")
OPTIONAL_ARRAY_KINDS = OptionalEntries("image mode kind")


def register_array_kind(
    kind: str, convert: Callable[[Any, Any], Any], *, resizes: bool = False
) -> None:
    """Add (or replace) the kind ``kind`` of image modes: ``convert(uint8_array, size)``."""
    _ARRAY_KINDS[kind] = ArrayKind(convert, resizes)


def _array_kind(kind: str, mode: str) -> ArrayKind:
    found = _ARRAY_KINDS.get(kind)
    if found is None:
        if kind not in OPTIONAL_ARRAY_KINDS:
            raise ValueError(f"image mode {mode!r}: no converter for its kind {kind!r}")
        try:
            OPTIONAL_ARRAY_KINDS.load(kind)
        except MissingDependencyError as exn:
            raise MissingDependencyError(f"the image mode {mode!r}: {exn}") from None
        found = _ARRAY_KINDS[kind]
    return found


@functools.cache
def _cjpeg():
    """The optional C decoder over the system's libjpeg-turbo (``tarshards._jpeg``), or
    ``None`` where it was not built: it decodes a crop's rows and columns only."""
    try:
        from ._jpeg import decode, header
    except ImportError:
        return None
    return types.SimpleNamespace(decode=decode, header=header)


@functools.cache
def _simplejpeg():
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _pow2_scale_dims(data: bytes, sj, size) -> dict:
    """simplejpeg arguments for the smallest 1/1, 1/2, 1/4 or 1/8 scale at least ``size``.

    libjpeg-turbo has SIMD inverse DCTs for these scales only; a 5/8 scale can be slower than
    a full decode, and the resize after it (in torch) costs about the same either way.
    """
    h, w = sj.decode_jpeg_header(data)[:2]
    s = 8
    while s > 1 and (w // s < size[0] or h // s < size[1]):
        s //= 2
    return {"min_width": -(-w // s), "min_height": -(-h // s)}


def _image_array(
    data: bytes, ext: str, pil_mode: str | None, size, exact: bool = True
) -> np.ndarray:
    """Decode to an HxW or HxWxC uint8 array, at ``size=(w, h)`` when given.

    ``exact=False``: JPEGs come back at a reduced scale no smaller than ``size`` (the caller
    resizes); other images at their own size.
    """
    if ext in _JPEG and pil_mode in ("RGB", "L"):
        sj = _simplejpeg()
        if sj is not None:
            try:
                kw: dict = {}
                if size is not None:
                    kw = (
                        {"min_width": size[0], "min_height": size[1]}
                        if exact
                        else _pow2_scale_dims(data, sj, size)
                    )
                arr = sj.decode_jpeg(
                    data,
                    colorspace="GRAY" if pil_mode == "L" else "RGB",
                    fastdct=False,
                    fastupsample=False,
                    **kw,
                )
                if pil_mode == "L":
                    arr = arr[:, :, 0]
                if exact and size is not None and (arr.shape[1], arr.shape[0]) != tuple(size):
                    from PIL import Image

                    arr = np.array(
                        Image.fromarray(arr).resize(tuple(size), Image.Resampling.BILINEAR)
                    )
                return arr
            except (ValueError, RuntimeError):
                pass  # unusual JPEGs (CMYK, broken markers): let Pillow have a go
    img = _pil_open(data, ext, pil_mode, size if exact else None)
    return np.array(img)  # writable (asarray over PIL bytes is read-only)


def _image_array_plain(data, ext, *, decode_jpeg, pil_mode) -> np.ndarray:
    """:func:`_image_array` at the image's own size, RGB or L, simplejpeg installed."""
    if ext in _JPEG:
        try:
            arr = decode_jpeg(data, "RGB" if pil_mode == "RGB" else "GRAY", False, False)
        except (ValueError, RuntimeError):
            pass  # unusual JPEGs (CMYK, broken markers): let Pillow have a go
        else:
            return arr if pil_mode == "RGB" else arr[:, :, 0]
    return _image_array(data, ext, pil_mode, None)


# components of plain JPEGs that simplejpeg decodes exactly as Pillow does -> (simplejpeg, PIL)
_SJ_NATIVE_BY_COMPONENTS = {3: ("RGB", "RGB"), 1: ("GRAY", "L")}


def _jpeg_frame(data) -> tuple[int, int]:
    """``(components, offset of the frame header)`` of a JPEG without EXIF (APP1) or an ICC
    profile (APP2) before its frame header; ``(0, 0)`` when it has them or the markers are not
    what we expect (Pillow then decides)."""
    pos, n = 2, len(data)
    while pos + 9 < n and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker in (0xE1, 0xE2) or marker == 0xDA:
            return 0, 0
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return data[pos + 9], pos  # start of frame: precision, height, width, components
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return 0, 0


def _jpeg_plain_components(data) -> int:
    return _jpeg_frame(data)[0]


class _HeaderMemo:
    """The bytes before the frame header of the last plain JPEG seen, and where it starts.

    The JPEGs of a dataset mostly come from one encoder at one quality, so they share those
    bytes (APP0, quantization tables): a file that starts with the same bytes up to and
    including its frame marker has the same marker layout, and the check is one compare of
    a few hundred bytes instead of a walk over the markers in Python.
    """

    __slots__ = ("last",)

    def __init__(self):
        # one tuple, replaced whole: safe to share between threads
        self.last: tuple[bytes | None, int] = (None, 0)

    def components(self, data) -> int:
        prefix, sof = self.last
        if prefix is not None and data[: len(prefix)] == prefix and len(data) > sof + 9:
            return data[sof + 9]
        comps, sof = _jpeg_frame(data)
        if comps:
            self.last = (bytes(data[: sof + 2]), sof)
        return comps


def _pil_jpeg_fast(data: bytes, pil_mode: str | None, size, memo: _HeaderMemo | None = None):
    """A PIL image of a plain JPEG decoded by simplejpeg (pixel-identical to Pillow, ~40% less
    time for small images), or ``None`` to let Pillow do it (no simplejpeg, CMYK, a mode change,
    EXIF/ICC metadata that callers may read from ``img.info``)."""
    sj = _simplejpeg()
    if sj is None:
        return None
    comps = memo.components(data) if memo is not None else _jpeg_plain_components(data)
    native = _SJ_NATIVE_BY_COMPONENTS.get(comps)
    if native is None or (pil_mode is not None and pil_mode != native[1]):
        return None
    wrap = _rgbx_image_mapper() if native[1] == "RGB" and size is None else None
    try:
        kw = {} if size is None else {"min_width": size[0], "min_height": size[1]}
        arr = sj.decode_jpeg(
            data,
            colorspace="RGBX" if wrap is not None else native[0],
            fastdct=False,
            fastupsample=False,
            **kw,
        )
    except (ValueError, RuntimeError):
        return None
    if wrap is not None:
        img = wrap(arr)
        img.format = "JPEG"
        return img
    from PIL import Image

    if native[1] == "L":
        arr = np.ascontiguousarray(arr[:, :, 0])
    # L shares the array's memory (read-only image: Pillow copies it before any change); RGB is
    # unpacked into Pillow's 4-byte pixels
    img = Image.frombuffer(native[1], (arr.shape[1], arr.shape[0]), arr, "raw", native[1], 0, 1)
    img.format = "JPEG"
    if size is not None and img.size != tuple(size):
        img = img.resize(tuple(size), Image.Resampling.BILINEAR)
    return img


@functools.cache
def _rgbx_image_mapper() -> Callable[[Any], Any] | None:
    """``wrap(arr)``: an RGB PIL image over the memory of an HxWx4 RGBX uint8 array, or ``None``.

    Pillow keeps RGB pixels in 4 bytes (the 4th is padding), which is exactly simplejpeg's RGBX
    output, so the image can share the decoded buffer: no copy and no unpacking (for RGB,
    ``Image.frombuffer`` falls back to a copying ``frombytes``). This maps the buffer through
    Pillow's own buffer mapper (what ``frombuffer`` uses for RGBX) under the RGB mode; the image
    is read-only, so Pillow copies it before any in-place change. Checked once on a probe
    image; when this Pillow does not give the expected pixels, ``None`` (the copying path).
    """
    from PIL import Image

    try:
        map_buffer = Image.core.map_buffer
        new_image = Image.Image
        args = ("RGB", 0, 1)

        def wrap(arr):
            size = (arr.shape[1], arr.shape[0])
            img = new_image()  # what Image._new does, less its palette and info copies
            img.im = map_buffer(arr, size, "raw", 0, args)
            img._mode = "RGB"
            img._size = size
            img.readonly = 1
            return img

        probe = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
        probe[..., 3] = 255
        img = wrap(probe)
        ok = (
            img.mode == "RGB"
            and img.size == (3, 2)
            and img.getpixel((2, 1)) == (20, 21, 22)
            and np.array_equal(np.asarray(img), probe[..., :3])
            and img.convert("RGBA").getpixel((1, 0)) == (4, 5, 6, 255)
        )
        img.putpixel((0, 0), (9, 9, 9))  # copy-on-write: the probe stays as it was
        ok = ok and img.getpixel((0, 0)) == (9, 9, 9) and probe[0, 0, 0] == 0
    except Exception:  # noqa: BLE001 - any failure means: use the public, copying path
        return None
    return wrap if ok else None


def _pil_plain(data: bytes, ext: str, *, decode_jpeg, wrap, memo: _HeaderMemo, pil_mode):
    """:func:`_pil_open` at the image's own size for ``pil``/``pilrgb``, simplejpeg installed:
    an RGB JPEG straight into an image over the decoded RGBX buffer."""
    if ext in _JPEG and memo.components(data) == 3:
        try:
            arr = decode_jpeg(data, "RGBX", False, False)
        except (ValueError, RuntimeError):
            pass  # Pillow has a go
        else:
            img = wrap(arr)
            img.format = "JPEG"
            return img
    return _pil_open(data, ext, pil_mode, None, memo)


def _pil_open(data: bytes, ext: str, pil_mode: str | None, size, memo: _HeaderMemo | None = None):
    if ext in _JPEG:
        img = _pil_jpeg_fast(data, pil_mode, size, memo)
        if img is not None:
            return img
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if size is not None and ext in _JPEG:
        img.draft(pil_mode or img.mode, tuple(size))
    img.load()
    if pil_mode is not None and img.mode != pil_mode:
        img = img.convert(pil_mode)
    if size is not None and img.size != tuple(size):
        img = img.resize(tuple(size), Image.Resampling.BILINEAR)
    return img


def image_decoder(mode: str, size=None) -> Callable[[bytes, str], Any]:
    """A function ``(data, ext) -> image`` for a decoding mode (see :data:`IMAGE_MODES`)."""
    if mode in _EXTRA_MODES:
        return _EXTRA_MODES[mode]
    if mode not in IMAGE_MODES:
        raise ValueError(
            f"unknown image decoding mode {mode!r}; choose one of {', '.join(sorted(IMAGE_MODES))}"
        )
    pil_mode, kind = IMAGE_MODES[mode]
    if size is not None:
        if isinstance(size, int):
            size = (size, size)
        size = (int(size[0]), int(size[1]))
    # partials (not lambdas): field_decoder binds ``ext`` into the same partial, one call less
    if kind == "pil":
        sj = _simplejpeg() if size is None and pil_mode in (None, "RGB") else None
        wrap = _rgbx_image_mapper() if sj is not None else None
        if sj is not None and wrap is not None:  # the common case in as few steps as possible
            return functools.partial(
                _pil_plain,
                decode_jpeg=sj.decode_jpeg,
                wrap=wrap,
                memo=_HeaderMemo(),
                pil_mode=pil_mode,
            )
        return functools.partial(_pil_open, pil_mode=pil_mode, size=size, memo=_HeaderMemo())
    if kind == "uint8":
        sj = _simplejpeg() if size is None and pil_mode in ("RGB", "L") else None
        if sj is not None:  # the common case in as few Python steps as possible
            return functools.partial(
                _image_array_plain, decode_jpeg=sj.decode_jpeg, pil_mode=pil_mode
            )
        return functools.partial(_image_array, pil_mode=pil_mode, size=size)
    if kind == "float":

        def dec_float(data, ext):
            return _image_array(data, ext, pil_mode, size).astype(np.float32) / np.float32(255)

        return dec_float
    # other kinds (torch tensors: registered by tarshards.torch) convert the uint8 array;
    # partials, as above (one C-level call once field_decoder binds ``ext``)
    found = _array_kind(kind, mode)
    # with a converter that resizes: decode at a reduced JPEG scale, let it resize (faster
    # than PIL for torch)
    resize = size is not None and found.resizes
    sj = _simplejpeg() if size is None and pil_mode in ("RGB", "L") else None
    if sj is not None:
        return functools.partial(
            _converted_plain, convert=found.convert, decode_jpeg=sj.decode_jpeg, pil_mode=pil_mode
        )
    return functools.partial(
        _converted_image, convert=found.convert, pil_mode=pil_mode, size=size, resize=resize
    )


def _converted_plain(data: bytes, ext: str, *, convert, decode_jpeg, pil_mode):
    return convert(_image_array_plain(data, ext, decode_jpeg=decode_jpeg, pil_mode=pil_mode), None)


def _converted_image(data: bytes, ext: str, *, convert, pil_mode: str | None, size, resize: bool):
    if resize:
        return convert(_image_array(data, ext, pil_mode, size, exact=False), size)
    return convert(_image_array(data, ext, pil_mode, size), None)


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------

for _codec in (
    Codec(("txt", "text", "transcript"), _enc_text, _dec_text),
    Codec(("cls", "cls2", "index", "id", "inx"), _enc_int, _dec_int),
    Codec(("json", "jsn"), _enc_json, _dec_json),
    Codec(("npy",), _enc_npy, _dec_npy),
    Codec(("npz",), _enc_npz, _dec_npz),
    Codec(("msgpack", "mp", "mpk"), _enc_msgpack, _dec_msgpack),
    Codec(("pyd", "pkl", "pickle"), _enc_pickle, _dec_pickle, safe=False),
    Codec(("gz",), _enc_gz, _dec_gz),
    Codec(("ten", "tb", "tenbin"), _enc_tenbin, _dec_tenbin),
    Codec(IMAGE_EXTENSIONS, _enc_image, _dec_image_pil, image=True),
):
    register_codec(_codec)


def _as_bytes(value, ext):
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(
        f"no codec for extension {ext!r} and value of type {type(value).__name__}; "
        f"pass bytes or str, or register a codec"
    )


def encode_value(value, ext: str) -> bytes:
    """Encode one field value for extension ``ext``; bytes and str pass through unchanged."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        if ext[-3:].lower() == ".gz" or ext.lower() == "gz":  # text can never be gzip data
            return gzip.compress(value.encode("utf-8"), mtime=0)
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    last = ext.rpartition(".")[2].lower()
    codec = _REGISTRY.get(last) or _optional_codec(last)
    if codec is None:
        return _as_bytes(value, ext)
    try:
        return codec.encode(value, ext.lower() if last == "gz" else last)
    except (TypeError, ValueError, OSError) as exc:
        raise DecodeError(f"cannot encode a {type(value).__name__} as .{ext}: {exc}") from exc


def encode_sample(sample: dict) -> dict:
    """Encode every non-meta field of a sample dict to bytes (keys stay as they are)."""
    out = {}
    for k, v in sample.items():
        if k.startswith("__"):
            out[k] = v
        else:
            out[k] = encode_value(v, k)
    return out


def field_decoder(
    ext: str, *, image_mode: str | None = "pil", size=None, allow_unsafe: bool = False
) -> Callable[[bytes], Any] | None:
    """Return ``decode(data) -> value`` for extension ``ext``, or ``None`` to keep bytes.

    ``image_mode=None`` leaves images as bytes. Unsafe codecs raise :class:`UnsafeCodecError` at
    decode time unless ``allow_unsafe``.
    """
    ext = ext.lower()
    parts = ext.split(".")
    if parts[-1] == "gz":
        inner = ".".join(parts[:-1])
        inner_dec = (
            field_decoder(inner, image_mode=image_mode, size=size, allow_unsafe=allow_unsafe)
            if inner
            else None
        )
        if inner_dec is None:
            return gzip.decompress
        return lambda data: inner_dec(gzip.decompress(data))
    last = parts[-1]
    codec = _REGISTRY.get(last)
    if codec is None and last in OPTIONAL_CODECS:
        if not OPTIONAL_CODECS.info(last).get("safe", True) and not allow_unsafe:
            return _refuse(ext)  # refused before its module (torch...) is even imported
        codec = _optional_codec(last)
    if codec is None:
        return None
    if codec.image:
        if image_mode is None:
            return None
        img = image_decoder(image_mode, size)
        if type(img) is functools.partial:
            return functools.partial(img, ext=last)  # flattened: one C-level call
        return lambda data: img(data, last)
    if not codec.safe and not allow_unsafe:
        return _refuse(ext)
    dec = codec.decode
    if dec is _dec_int:
        return int  # what _dec_int does, one call less per sample
    return lambda data: dec(data, last)


def _refuse(ext: str) -> Callable[[bytes], Any]:
    def refuse(data):
        raise UnsafeCodecError(
            f"refusing to decode a .{ext} field: this codec can run arbitrary code. If you "
            f"trust the data, opt in with allow_unsafe=True (e.g. .decode('pil', "
            f"allow_unsafe=True)), or keep the raw bytes with .decode(only=[...])"
        )

    return refuse


def decode_value(data: bytes, ext: str, **options) -> Any:
    """Decode one field (convenience; pipelines cache :func:`field_decoder` per extension)."""
    dec = field_decoder(ext, **options)
    return data if dec is None else dec(data)
