"""Image codecs: encoding arrays and PIL images, decoding in webdataset's image modes (``pil``,
``rgb8``, ``torchrgb``...), the JPEG fast paths (simplejpeg, the optional C decoder
``tarshards._jpeg``, PIL's draft mode) and the image-mode registry (:data:`IMAGE_MODES`,
:func:`register_image_mode`, :func:`register_array_kind`).

The codec registry (:mod:`tarshards.codecs`) registers these under the image extensions; the torch
modes' array kinds are optional entries that :mod:`tarshards.torch` fills.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import re
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .._lazy import LazyModule, OptionalEntries
from ..errors import MissingDependencyError

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")  # numpy is imported on first use

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_MODES",
    "image_decoder",
    "image_field_decoder",
    "register_array_kind",
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

EXTRA_MODES: dict[str, Callable[[bytes, str], Any]] = {}


def register_image_mode(name: str, fn: Callable[[bytes, str], Any]) -> None:
    """Add an image decoding mode: ``fn(data, ext) -> value``."""
    EXTRA_MODES[name] = fn


@dataclass(frozen=True)
class ArrayKind:
    """What a kind of :data:`IMAGE_MODES` makes of the decoded HxWxC (or HxW) uint8 array:
    ``convert(array, size)``. With ``resizes``, ``convert`` resizes to ``size=(w, h)`` itself, so
    JPEGs are decoded at the smallest reduced scale that is at least ``size``. ``wrap``, when
    given, is what ``convert(array, None)`` gives, made from the array's CxHxW view (HxW for one
    channel) instead: images decoded at their own size are built as that view directly
    (``torch.from_numpy`` for the torch kinds). ``from_dlpack``, when given, is what ``wrap``
    gives, made from a DLPack capsule of that view (no array object in between): what the C
    decoder's JPEGs are built with (``torch.from_dlpack`` for the torch kinds)."""

    convert: Callable[[Any, Any], Any]
    resizes: bool = False
    wrap: Callable[[Any], Any] | None = None
    from_dlpack: Callable[[Any], Any] | None = None


_ARRAY_KINDS: dict[str, ArrayKind] = {}
# kinds that an optional module registers on first use ("torch-uint8", "torch-float")
OPTIONAL_ARRAY_KINDS = OptionalEntries("image mode kind", "images.OPTIONAL_ARRAY_KINDS")


def register_array_kind(
    kind: str,
    convert: Callable[[Any, Any], Any],
    *,
    resizes: bool = False,
    wrap: Callable[[Any], Any] | None = None,
    from_dlpack: Callable[[Any], Any] | None = None,
) -> None:
    """Add (or replace) the kind ``kind`` of image modes: ``convert(uint8_array, size)`` (see
    :class:`ArrayKind` for ``resizes``, ``wrap`` and ``from_dlpack``)."""
    _ARRAY_KINDS[kind] = ArrayKind(convert, resizes, wrap, from_dlpack)


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
    """The optional C decoder over libjpeg-turbo (``tarshards._jpeg``, on the system's library it
    was linked with), or ``None`` where it was not built: whole images (``image``) and
    a crop's rows and columns (``decode``), whole images as DLPack capsules (``dlpack``), and a
    JPEG field's value in one call: an array (``array_value``), a tensor from a capsule
    (``dlpack_value``), a PIL image (``pil_image``)."""
    try:
        from .._jpeg import decode, header, image
    except ImportError:
        return None
    from .. import _jpeg

    return types.SimpleNamespace(
        decode=decode,
        header=header,
        image=image,
        # None in a module built before them
        dlpack=getattr(_jpeg, "dlpack", None),
        dlpack_value=getattr(_jpeg, "dlpack_value", None),
        array_value=getattr(_jpeg, "array_value", None),
        pil_image=getattr(_jpeg, "pil_image", None),
        into=getattr(_jpeg, "into", None),
        library=getattr(_jpeg, "library", lambda: None),
    )


_TURBO_VERSION = re.compile(rb"libjpeg-turbo version (\d+)\.(\d+)\.(\d+)")


def _turbo_version(path: str | None) -> tuple[int, ...] | None:
    """The libjpeg-turbo version a shared library's file names (the string every build of it
    holds), or ``None``."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            found = _TURBO_VERSION.search(f.read())
    except OSError:
        return None
    return None if found is None else tuple(int(g) for g in found.groups())


def _pillow_libjpeg() -> str | None:
    """The libjpeg-turbo a Pillow wheel ships beside its modules (``pillow.libs`` on Linux,
    ``PIL/.dylibs`` on macOS), or ``None`` (a Pillow built against the system's, or a layout
    this does not know): only reported by :func:`jpeg_decoder` where Pillow decodes, never
    loaded."""
    import glob

    try:
        import PIL

        base = os.path.dirname(PIL.__file__ or "")
    except (ImportError, TypeError):  # no Pillow, or a namespace package without a file
        return None
    if not base:
        return None
    for pattern in (
        os.path.join(base, os.pardir, "pillow.libs", "libjpeg*.so*"),
        os.path.join(base, ".dylibs", "libjpeg*.dylib"),
    ):
        found = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
        if found:
            return os.path.normpath(found[0])
    return None


def jpeg_decoder() -> dict:
    """What decodes a JPEG at its own size in the image modes here: ``{"decoder": ...,
    "libjpeg": path or None, "libjpeg_turbo": "X.Y.Z" or None}``, the decoder being
    ``"tarshards._jpeg"`` (the C decoder, on the system's libjpeg-turbo it was linked with),
    ``"simplejpeg"`` (libjpeg-turbo linked into it) or ``"Pillow"``."""
    cj = _cjpeg()
    if cj is not None:
        decoder, path = "tarshards._jpeg", cj.library()
    elif (sj := _simplejpeg()) is not None:
        decoder, path = "simplejpeg", getattr(getattr(sj, "_jpeg", None), "__file__", None)
    else:
        decoder, path = "Pillow", _pillow_libjpeg()
    version = _turbo_version(path)
    return {
        "decoder": decoder,
        "libjpeg": path,
        "libjpeg_turbo": None if version is None else ".".join(map(str, version)),
    }


def jpeg_into(mode: str, size=None):
    """For an image mode whose value is a plain uint8 array at the image's own size (``rgb8``:
    HxWx3, ``l8``: HxW), what decodes a JPEG straight into given memory: ``(channels, into,
    header)``, ``into(data, out) -> bool`` writing the pixels ``image_decoder(mode)`` gives into
    ``out`` (a C-contiguous uint8 array of the image's shape; False where the C decoder declines
    the JPEG or its size is another: ``out`` then holds anything), ``header(data)`` the JPEG's
    ``(width, height, components, color space)`` or None. None for other modes, with a ``size``,
    or where the C decoder is missing."""
    channels = {"rgb8": 3, "l8": 1}.get(mode)
    cj = _cjpeg()
    if channels is None or size is not None or cj is None or cj.into is None:
        return None
    return channels, functools.partial(cj.into, channels), cj.header


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


def _rgbx_buffer_mapper() -> Callable[[Any, int, int], Any] | None:
    """``wrap(buf, width, height)``: an RGB PIL image over the memory of ``buf`` (see
    :func:`_rgbx_mapping`), or ``None``."""
    mapping = _rgbx_mapping()
    return None if mapping is None else mapping[0]


@functools.cache
def _rgbx_mapping() -> tuple[Callable[[Any, int, int], Any], tuple | None] | None:
    """``wrap(buf, width, height)``: an RGB PIL image over the memory of ``buf`` (height x width
    RGBX pixels: a bytearray, an HxWx4 uint8 array), or ``None``.

    Pillow keeps RGB pixels in 4 bytes (the 4th is padding), which is exactly the RGBX output of
    simplejpeg and of ``tarshards._jpeg``, so the image can share the decoded buffer: no copy and
    no unpacking (for RGB, ``Image.frombuffer`` falls back to a copying ``frombytes``). This maps
    the buffer through Pillow's own buffer mapper (what ``frombuffer`` uses for RGBX) under the
    RGB mode; the image is read-only, so Pillow copies it before any in-place change. Checked
    once on a probe image; when this Pillow does not give the expected pixels, ``None`` (the
    copying path).

    Returns ``(wrap, parts)``: ``parts`` are those of :func:`_templated` (``None`` when wrap is
    the plain one).
    """
    from PIL import Image

    try:
        map_buffer = Image.core.map_buffer
        image_class = Image.Image
        args = ("RGB", 0, 1)

        def wrap_plain(buf, width, height):
            size = (width, height)
            img = image_class()  # what Image._new does, less its palette and info copies
            img.im = map_buffer(buf, size, "raw", 0, args)
            img._mode = "RGB"
            img._size = size
            img.readonly = 1
            return img

        templated = _templated(wrap_plain, image_class, map_buffer, args)
        wrap, parts = (wrap_plain, None) if templated is None else templated
        for probe in (
            np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
            bytearray(range(2 * 3 * 4)),
        ):
            pixels = np.frombuffer(probe, np.uint8).reshape(2, 3, 4).copy()
            img = wrap(probe, 3, 2)
            ok = (
                img.mode == "RGB"
                and img.size == (3, 2)
                and img.getpixel((2, 1)) == (20, 21, 22)
                and np.array_equal(np.asarray(img), pixels[..., :3])
                and img.convert("RGBA").getpixel((1, 0)) == (4, 5, 6, 255)
            )
            img.putpixel((0, 0), (9, 9, 9))  # copy-on-write: the probe stays as it was
            ok = ok and img.getpixel((0, 0)) == (9, 9, 9) and bytes(probe)[0] == 0
            if not ok:
                return None
    except Exception:  # noqa: BLE001 - any failure means: use the public, copying path
        return None
    return wrap, parts


_IMMUTABLE = (type(None), bool, int, float, str, bytes)


def _templated(wrap_plain, image_class, map_buffer, args):
    """:func:`_rgbx_buffer_mapper`'s ``wrap`` in fewer steps, or ``None``: the attributes of an
    image that ``wrap_plain`` made, copied from a template dict, with the mapped core, the size
    and a new ``info`` dict put in; no ``Image.__init__`` and no property setters per image
    (about a microsecond less each). ``None`` when that image's attributes are not what this
    expects (one holding the core, one the size, an empty ``info``, the rest immutable), so
    that an image is never made to share anything but immutable values with another.

    Returns ``(wrap, (image_class, template, core_key, size_key, map_buffer, args))``: the
    parts are what ``tarshards._jpeg.pil_image`` makes the same image from.
    """
    buf = bytearray(4 * 3 * 2)
    img = wrap_plain(buf, 3, 2)
    core = img.im
    template = dict(vars(img))
    core_keys = [k for k, v in template.items() if v is core]
    size_keys = [k for k, v in template.items() if v == (3, 2) and type(v) is tuple]
    if len(core_keys) != 1 or len(size_keys) != 1 or template.get("info") != {}:
        return None
    core_key, size_key = core_keys[0], size_keys[0]
    for k, v in template.items():
        if k not in (core_key, size_key, "info") and type(v) not in _IMMUTABLE:
            return None
    new = object.__new__
    if image_class.__new__ is not new:
        return None
    template[core_key] = template[size_key] = None  # set per image (not the probe's, kept)

    def wrap(buf, width, height):
        size = (width, height)
        img = new(image_class)
        attrs = template.copy()
        attrs[core_key] = map_buffer(buf, size, "raw", 0, args)
        attrs[size_key] = size
        attrs["info"] = {}
        img.__dict__ = attrs
        return img

    made = wrap(buf, 3, 2)
    if vars(made).keys() != template.keys() or made.mode != "RGB" or made.size != (3, 2):
        return None
    return wrap, (image_class, template, core_key, size_key, map_buffer, args)


@functools.cache
def _rgbx_image_mapper() -> Callable[[Any], Any] | None:
    """``wrap(arr)``: :func:`_rgbx_buffer_mapper` over an HxWx4 RGBX uint8 array, or ``None``."""
    wrap_buffer = _rgbx_buffer_mapper()
    if wrap_buffer is None:
        return None

    def wrap(arr):
        return wrap_buffer(arr, arr.shape[1], arr.shape[0])

    return wrap


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
    if mode in EXTRA_MODES:
        return EXTRA_MODES[mode]
    if mode not in IMAGE_MODES:
        raise ValueError(
            f"unknown image decoding mode {mode!r}; choose one of {', '.join(sorted(IMAGE_MODES))}"
        )
    pil_mode, kind = IMAGE_MODES[mode]
    if size is not None:
        if isinstance(size, int):
            size = (size, size)
        size = (int(size[0]), int(size[1]))
    plain = size is None and pil_mode in ("RGB", "L")  # the image's own size, 3 or 1 channels
    if kind == "pil":
        sj = _simplejpeg() if size is None and pil_mode in (None, "RGB") else None
        wrap = _rgbx_image_mapper() if sj is not None else None
        if sj is not None and wrap is not None:  # the common case in as few steps as possible
            fallback = functools.partial(
                _pil_plain,
                decode_jpeg=sj.decode_jpeg,
                wrap=wrap,
                memo=_HeaderMemo(),
                pil_mode=pil_mode,
            )
        else:
            fallback = functools.partial(
                _pil_open, pil_mode=pil_mode, size=size, memo=_HeaderMemo()
            )
        if size is None and pil_mode in (None, "RGB"):
            return _pil_cjpeg(fallback) or fallback
        return fallback
    if kind == "uint8":
        return _plain_array_decoder(pil_mode) if plain else _sized_array_decoder(pil_mode, size)
    if kind == "float":
        to_uint8 = _plain_array_decoder(pil_mode) if plain else _sized_array_decoder(pil_mode, size)
        float32, scale = np.float32, np.float32(255)

        def dec_float(data, ext):
            return to_uint8(data, ext).astype(float32) / scale

        jpeg_uint8 = getattr(to_uint8, "jpeg", None)
        if jpeg_uint8 is None:
            return dec_float

        def jpeg_float(data):
            return jpeg_uint8(data).astype(float32) / scale

        return _by_extension(jpeg_float, dec_float)
    # other kinds (torch tensors: registered by tarshards.torch) convert the uint8 array
    found = _array_kind(kind, mode)
    if plain:
        return _plain_array_decoder(pil_mode, found)
    # with a converter that resizes: decode at a reduced JPEG scale, let it resize (faster
    # than PIL for torch)
    resize = size is not None and found.resizes
    return functools.partial(
        _converted_image, convert=found.convert, pil_mode=pil_mode, size=size, resize=resize
    )


# Per-sample decoders are closures, not partials with keywords: a partial's keywords are
# merged into a new dict at every call (about 0.4 us, a percent of a small JPEG's decode).


def _sized_array_decoder(pil_mode: str | None, size) -> Callable[[bytes, str], Any]:
    def dec(data, ext):
        return _image_array(data, ext, pil_mode, size)

    return dec


def _by_extension(jpeg: Callable[[Any], Any], fallback: Callable[[Any, str], Any]):
    """``dec(data, ext)``: ``jpeg(data)`` for a JPEG extension, ``fallback(data, ext)`` for the
    rest. ``dec.jpeg`` is ``jpeg`` itself: what a JPEG field's decoder is
    (:func:`image_field_decoder`), one call per sample."""

    def dec(data, ext):
        if ext in _JPEG:
            return jpeg(data)
        return fallback(data, ext)

    dec.jpeg = jpeg  # type: ignore[attr-defined]
    return dec


def image_field_decoder(mode: str, size=None, ext: str = "jpg") -> Callable[[Any], Any]:
    """``decode(data) -> image`` for a field of extension ``ext`` (lower case) in ``mode``: what
    ``image_decoder(mode, size)(data, ext)`` gives, with the JPEG paths through the C decoder
    called directly (no wrapper per sample)."""
    dec = image_decoder(mode, size)
    if ext in _JPEG:
        jpeg = getattr(dec, "jpeg", None)
        if jpeg is not None:
            return jpeg
    if type(dec) is functools.partial:
        return functools.partial(dec, ext=ext)  # flattened: one C-level call
    return lambda data: dec(data, ext)


def _plain_array_decoder(pil_mode: str | None, kind: ArrayKind | None = None):
    """``(data, ext) -> value`` at the image's own size for ``pil_mode`` ``"RGB"`` or ``"L"``:
    the HxWx3 (HxW) uint8 array, or with an array ``kind`` its value (``kind.wrap`` of the CxHxW
    view when it has one, else ``kind.convert(array, None)``).

    JPEGs go through the C decoder (``tarshards._jpeg``, a kept decompressor, straight into the
    array's buffer; the pixels simplejpeg gives), then simplejpeg, then Pillow, as each declines.
    """
    sj = _simplejpeg()
    decode_jpeg = None if sj is None else sj.decode_jpeg

    def to_array(data, ext):
        if decode_jpeg is not None:
            return _image_array_plain(data, ext, decode_jpeg=decode_jpeg, pil_mode=pil_mode)
        return _image_array(data, ext, pil_mode, None)

    convert = None if kind is None else kind.convert
    wrap = None if kind is None else kind.wrap

    def fallback(data, ext):
        if convert is None:
            return to_array(data, ext)
        return convert(to_array(data, ext), None)

    cj = _cjpeg()
    if cj is None:
        return fallback
    image, ndarray, uint8 = cj.image, np.ndarray, np.uint8
    channels = 1 if pil_mode == "L" else 3

    # what the C decoder declines goes to the fallback as a JPEG: "jpg" and "jpeg" are one to it
    def declined(data):
        return fallback(data, "jpg")

    # a JPEG field's decoder in one C call: a tensor from a DLPack capsule of the pixels, or the
    # array over them
    dlpack_value = getattr(cj, "dlpack_value", None)
    from_dlpack = None if kind is None else kind.from_dlpack
    if dlpack_value is not None and from_dlpack is not None:
        return _by_extension(
            functools.partial(dlpack_value, from_dlpack, channels, declined), fallback
        )
    array_value = getattr(cj, "array_value", None)
    if array_value is not None and kind is None:
        return _by_extension(
            functools.partial(array_value, ndarray, uint8, channels, declined), fallback
        )

    if pil_mode == "L":

        def grey(data):
            got = image(data, 1, False)
            if got is not None:
                px, w, h = got
                arr = ndarray((h, w), uint8, px)
                if wrap is not None:
                    return wrap(arr)
                return arr if convert is None else convert(arr, None)
            return fallback(data, "jpg")

        return _by_extension(grey, fallback)

    if wrap is not None:

        def rgb_chw(data):
            got = image(data, 3, False)
            if got is not None:
                px, w, h = got
                return wrap(ndarray((3, h, w), uint8, px, 0, (1, 3 * w, 3)))
            return fallback(data, "jpg")

        return _by_extension(rgb_chw, fallback)

    if convert is None:

        def rgb(data):
            got = image(data, 3, False)
            if got is not None:
                px, w, h = got
                return ndarray((h, w, 3), uint8, px)
            return fallback(data, "jpg")

        return _by_extension(rgb, fallback)

    def rgb_converted(data):
        got = image(data, 3, False)
        if got is not None:
            px, w, h = got
            return convert(ndarray((h, w, 3), uint8, px), None)
        return fallback(data, "jpg")

    return _by_extension(rgb_converted, fallback)


def _pil_cjpeg(fallback) -> Callable[[bytes, str], Any] | None:
    """``pil``/``pilrgb`` at the image's own size: a plain RGB JPEG (3 components, no EXIF or ICC
    profile before its frame header: what :class:`_HeaderMemo` lets through) decoded by the C
    decoder into RGBX and wrapped as a PIL image over that buffer; anything else to
    ``fallback``. ``None`` without the C decoder or Pillow's buffer mapping.

    Where the image's attributes come from a template (:func:`_templated`), the C decoder makes
    the image itself (``_jpeg.pil_image``, the same attributes; checked here on a probe JPEG):
    one C call per sample."""
    cj = _cjpeg()
    wrap = _rgbx_buffer_mapper()
    if cj is None or wrap is None:
        return None
    image = cj.image

    def pil(data):
        got = image(data, 4, True)
        if got is not None:
            img = wrap(*got)
            img.format = "JPEG"
            return img
        return fallback(data, "jpg")

    pil_image = getattr(cj, "pil_image", None)
    parts = _pil_image_template()
    if pil_image is None or parts is None:
        return _by_extension(pil, fallback)

    def declined(data):
        return fallback(data, "jpg")

    return _by_extension(functools.partial(pil_image, *parts, declined), fallback)


# a 5x3 RGB JPEG (Pillow's, optimized tables: 286 bytes), the probe of _pil_image_template (made
# here once: encoding one would load Pillow's plugins, some 20 ms in every new process)
_PROBE_JPEG = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAFA3PEY8MlBGQUZaVVBfeMiCeG5uePWvuZHI//////////////////////"
    "//////////////////////////////2wBDAVVaWnhpeOuCguv///////////////////////////////////////"
    "//////////////////////////////////wAARCAADAAUDASIAAhEBAxEB/8QAFQABAQAAAAAAAAAAAAAAAAAAAAP/"
    "xAAUEAEAAAAAAAAAAAAAAAAAAAAA/8QAFQEBAQAAAAAAAAAAAAAAAAAAAAT/xAAUEQEAAAAAAAAAAAAAAAAAAAAA/9oA"
    "DAMBAAIRAxEAPwCYAof/2Q=="
)


@functools.cache
def _pil_image_template() -> tuple | None:
    """``(image_class, template, core_key, size_key, map_buffer, args)``: the first arguments of
    ``tarshards._jpeg.pil_image`` for ``pil``'s image of a plain RGB JPEG (then what it declines
    goes to, and the data); ``None`` without the C decoder, without a template
    (:func:`_templated`), or when the image it makes of a probe JPEG is not the one the Python
    wrap makes."""
    try:
        from .._jpeg import image, pil_image
    except ImportError:
        return None
    mapping = _rgbx_mapping()
    if mapping is None:
        return None
    wrap, found = mapping
    if found is None:
        return None
    image_class, template, core_key, size_key, map_buffer, args = found
    parts = (image_class, dict(template, format="JPEG"), core_key, size_key, map_buffer, args)
    try:
        probe = base64.b64decode(_PROBE_JPEG)
        a = pil_image(*parts, lambda data: None, probe)
        b = wrap(*image(probe, 4, True))
        b.format = "JPEG"
        if not (
            type(a) is type(b)
            and vars(a).keys() == vars(b).keys()
            and (a.mode, a.size, a.format, a.info, a.readonly) == (b.mode, b.size, "JPEG", {}, 1)
            and a.tobytes() == b.tobytes()
        ):
            return None
    except Exception:  # noqa: BLE001 - any failure means: the Python wrap
        return None
    return parts


def _converted_image(data: bytes, ext: str, *, convert, pil_mode: str | None, size, resize: bool):
    if resize:
        return convert(_image_array(data, ext, pil_mode, size, exact=False), size)
    return convert(_image_array(data, ext, pil_mode, size), None)
