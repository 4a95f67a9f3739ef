"""Fused random-resized-crop decoding: pick the crop first, then decode only what it needs.

``random_resized_crop(224)`` is a decode handler (``ds.decode(random_resized_crop(224))``) that
turns each image field into a random crop resized to ``size``, as torchvision's
``RandomResizedCrop`` followed by ``RandomHorizontalFlip`` would, with the same crop
distribution (:func:`crop_params` is torchvision's algorithm: ten tries at a random area and
log-uniform aspect ratio, then the central crop), but without decoding pixels it then throws away:

1. the JPEG header gives the image size (no decoding);
2. the crop is drawn from the sample's own random generator (seeded from the pipeline's seed,
   epoch and reader, and the sample's shard and key, so it does not depend on what the reader
   did before, and a resumed epoch draws the same crops);
3. the JPEG is decoded at the smallest of libjpeg-turbo's SIMD DCT scales (1/8, 1/4, 1/2, 1)
   at which the crop still has at least ``size`` pixels each way: a large crop of a large
   image decodes at 1/2 or 1/4 of the work;
4. the crop (a view, no copy) is resized with an antialiased bilinear filter to ``size`` and
   flipped with probability 1/2.

With the optional C decoder (``tarshards._jpeg``, built where libjpeg-turbo's headers are
installed: Debian's ``libjpeg-dev``) only the crop is decoded: the rows above it are skipped
without their inverse DCT, the rows below are never read, and only the crop's columns (to the
iMCU boundary) are inverse-transformed, upsampled and colour-converted: about 0.6 of a whole
decode for ImageNet-sized images at 224, the same pixels as the crop of a whole decode.
Without it, simplejpeg decodes the whole image (at the chosen DCT scale) and the crop is a view
of it: simplejpeg and Pillow's ``draft`` expose libjpeg-turbo's scaled decoding but not its
partial decoding (``jpeg_crop_scanline``/``jpeg_skip_scanlines``). Either way the rows down to
the crop's bottom are entropy-decoded, which bounds what is left; for crops smaller than
``size`` (most crops of ImageNet-sized images at 224) the scale is 1.

Images other than plain JPEGs (PNG, CMYK JPEGs...) are decoded fully by Pillow and cropped the
same way. Outputs: ``"torchrgb"`` (float CxHxW tensor in [0, 1], the default), ``"torchrgb8"``
(uint8 CxHxW tensor), ``"rgb8"`` (HxWx3 uint8 numpy array, no torch needed), ``"pil"``.
"""

from __future__ import annotations

import io
import math
import random
from typing import Any, Callable, Sequence

from .._lazy import LazyModule, OptionalEntries
from ..errors import MissingDependencyError
from .images import IMAGE_EXTENSIONS, _cjpeg, _rgbx_image_mapper, _simplejpeg

np = LazyModule("numpy", globals(), "np")  # numpy is imported on first use

__all__ = ["RandomResizedCrop", "crop_params", "random_resized_crop"]

_OUTPUTS = ("torchrgb", "torchrgb8", "rgb8", "pil")
_JPEG_EXTENSIONS = ("jpg", "jpeg")

# how a tensor output is made from the decoded HxWxC uint8 array:
# ``fn(arr, box, (height, width), flip, as_float)``. tarshards.torch registers "tensor" (torch
# is the only module that imports torch); the package declares it, so that this module never
# names a higher one.
_CROP_CONVERTERS: dict[str, Callable[..., Any]] = {}
OPTIONAL_CROP_CONVERTERS = OptionalEntries("crop output", "crop.OPTIONAL_CROP_CONVERTERS")


def register_crop_converter(name: str, fn: Callable[..., Any]) -> None:
    """Add (or replace) the converter ``name`` of crops:
    ``fn(uint8_array, box, (height, width), flip, as_float)``."""
    _CROP_CONVERTERS[name] = fn


def _tensor_crop(output: str) -> Callable[..., Any]:
    fn = _CROP_CONVERTERS.get("tensor")
    if fn is None:
        if "tensor" not in OPTIONAL_CROP_CONVERTERS:
            raise ValueError(f"random_resized_crop(output={output!r}): no tensor converter")
        try:
            OPTIONAL_CROP_CONVERTERS.load("tensor")
        except MissingDependencyError:
            raise MissingDependencyError(
                f"random_resized_crop(output={output!r}) needs torch: pip install "
                f"'tarshards[torch]' (or use output='rgb8' for numpy arrays)"
            ) from None
        fn = _CROP_CONVERTERS["tensor"]
    return fn


def crop_params(
    rng: random.Random,
    width: int,
    height: int,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """A random crop ``(top, left, height, width)`` of a ``width`` x ``height`` image.

    torchvision's ``RandomResizedCrop.get_params``: up to ten tries at an area drawn uniformly
    in ``scale`` (fractions of the image's area) and an aspect ratio (w/h) drawn log-uniformly
    in ``ratio``; the first that fits is placed uniformly at random. When none fits, the
    central crop of the whole image, with its aspect ratio clamped to ``ratio``.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    uniform = rng.uniform
    for _ in range(10):
        target_area = area * uniform(scale[0], scale[1])
        aspect = math.exp(uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _dct_scale(crop_w: int, crop_h: int, out_w: int, out_h: int) -> int:
    """The largest divisor d in (8, 4, 2, 1) with the crop at 1/d still >= the output."""
    d = 8
    while d > 1 and (crop_w < out_w * d or crop_h < out_h * d):
        d //= 2
    return d


class RandomResizedCrop:
    """A decode handler: image fields -> a random crop resized to ``size`` (see the module).

    ``size``: an int (square) or ``(height, width)``, as in torchvision. ``flip``: a horizontal
    flip with probability 1/2. ``fast``: libjpeg-turbo's fast integer inverse DCT and plain
    (not "fancy") chroma upsampling (about 10-30% less decoding time; pixel values within a few
    levels of the exact decode, which the resize then averages), off by default.
    ``extensions``: the fields it decodes (default: every image extension); other fields fall
    through to the other decoders.

    Random choices come from the generator the decode stage passes for each sample
    (``rng=``); called without one, it uses a fresh unseeded generator.
    """

    wants_rng = True  # the decode stage passes a per-sample generator

    def __init__(
        self,
        size: int | Sequence[int] = 224,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        flip: bool = True,
        output: str = "torchrgb",
        fast: bool = False,
        extensions: Sequence[str] | str | None = None,
    ):
        if isinstance(size, int):
            size = (size, size)
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"size must be an int or (height, width) >= 1, got {size!r}")
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"scale must be (min, max) with 0 < min <= max, got {scale!r}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {ratio!r}")
        if output not in _OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(_OUTPUTS)}, got {output!r}")
        self.height, self.width = int(size[0]), int(size[1])
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip = bool(flip)
        self.output = output
        self.fast = bool(fast)
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.extensions = frozenset(e.lower() for e in (extensions or IMAGE_EXTENSIONS))
        self._to_tensor = _tensor_crop(output) if output.startswith("torch") else None

    def __repr__(self):
        return (
            f"random_resized_crop(size=({self.height}, {self.width}), scale={self.scale}, "
            f"ratio={self.ratio}, flip={self.flip}, output={self.output!r})"
        )

    def __call__(self, key: str, data: bytes, rng: random.Random | None = None) -> Any:
        ext = key.rpartition(".")[2].lower()
        if ext not in self.extensions:
            return None
        if rng is None:
            rng = random.Random()
        return self.decode(data, rng, jpeg=ext in _JPEG_EXTENSIONS)

    # ---- the work ----------------------------------------------------------------------------
    def decode(self, data: bytes, rng: random.Random, jpeg: bool = True) -> Any:
        """Decode one image's bytes to a random resized crop drawn from ``rng``."""
        if jpeg:
            cj = _cjpeg()
            if cj is not None:
                head = cj.header(data)
                if head is not None and head[2] in (1, 3):
                    out = self._decode_region(cj, data, rng, head[0], head[1])
                    if out is not None:
                        return out[0] if out[1] is None else self._decode_sj(data, rng, out[1])
        return self._decode_sj(data, rng) if jpeg else self._decode_pil(data, rng)

    def _decode_region(self, cj, data: bytes, rng: random.Random, width: int, height: int):
        """Decode only the crop's rows and iMCU columns, at the DCT scale the crop allows.

        ``(result, None)``, or ``(None, drawn)`` when the C decoder declines (the crop drawn,
        for the other decoders to use)."""
        top, left, ch, cw = crop_params(rng, width, height, self.scale, self.ratio)
        flip = self.flip and rng.random() < 0.5
        d = _dct_scale(cw, ch, self.width, self.height)
        sw, sh = -(-width // d), -(-height // d)  # the scaled image (libjpeg rounds up)
        sx, sy = sw / width, sh / height
        box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
        if self._to_tensor is not None:
            # the tensor resize reads exactly the box rounded to whole pixels
            x0, y0 = int(round(box[0])), int(round(box[1]))
            x1, y1 = max(int(round(box[2])), x0 + 1), max(int(round(box[3])), y0 + 1)
        else:
            # Pillow's filter reads past the box by up to the reduction (+ rounding)
            m = int(max(box[2] - box[0], box[3] - box[1]) / min(self.width, self.height)) + 2
            x0, y0 = max(int(box[0]) - m, 0), max(int(box[1]) - m, 0)
            x1, y1 = min(int(box[2]) + m + 1, sw), min(int(box[3]) + m + 1, sh)
        x1, y1 = min(x1, sw), min(y1, sh)
        # PIL outputs: RGBX, the buffer an RGB image can share (no copy)
        channels = 4 if self._to_tensor is None and _rgbx_image_mapper() is not None else 3
        got = cj.decode(data, channels, d, self.fast, x0, y0, x1, y1)
        if got is None:
            return None, (top, left, ch, cw, flip)
        buf, w, h, xoff = got
        arr = np.frombuffer(buf, np.uint8).reshape(h, w, channels)
        rel = (box[0] - xoff, box[1] - y0, box[2] - xoff, box[3] - y0)
        if self._to_tensor is not None:
            rel = (x0 - xoff, 0, x1 - xoff, y1 - y0)
        return self._finish(arr, rel, flip), None

    def _decode_sj(self, data: bytes, rng: random.Random, drawn=None) -> Any:
        """The whole JPEG decoded by simplejpeg (at the crop's DCT scale), then cropped."""
        sj = _simplejpeg()
        if sj is not None:
            try:
                height, width = sj.decode_jpeg_header(data)[:2]
            except (ValueError, RuntimeError):
                sj = None  # not something simplejpeg reads: Pillow decides
        if sj is None:
            return self._decode_pil(data, rng, drawn)
        if drawn is None:
            top, left, ch, cw = crop_params(rng, width, height, self.scale, self.ratio)
            flip = self.flip and rng.random() < 0.5
        else:
            top, left, ch, cw, flip = drawn
        d = _dct_scale(cw, ch, self.width, self.height)
        kw = {} if d == 1 else {"min_width": -(-width // d), "min_height": -(-height // d)}
        # PIL outputs resize an RGB image over simplejpeg's RGBX buffer (no copy)
        rgbx = self._to_tensor is None and _rgbx_image_mapper() is not None
        try:
            arr = sj.decode_jpeg(
                data,
                colorspace="RGBX" if rgbx else "RGB",
                fastdct=self.fast,
                fastupsample=self.fast,
                **kw,
            )
        except (ValueError, RuntimeError):  # CMYK, broken markers...: Pillow has a go
            return self._decode_pil(data, rng, (top, left, ch, cw, flip))
        box = (left, top, left + cw, top + ch)
        if d != 1:  # the crop in the scaled image's pixels
            sy, sx = arr.shape[0] / height, arr.shape[1] / width
            box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
        return self._finish(arr, box, flip)

    def _decode_pil(self, data: bytes, rng: random.Random, drawn=None) -> Any:
        from PIL import Image

        img: Any = Image.open(io.BytesIO(data))
        img.load()
        if img.mode != "RGB":
            img = img.convert("RGB")
        if drawn is None:
            top, left, ch, cw = crop_params(rng, img.width, img.height, self.scale, self.ratio)
            flip = self.flip and rng.random() < 0.5
        else:
            top, left, ch, cw, flip = drawn
        box = (left, top, left + cw, top + ch)
        if self._to_tensor is None:
            return self._finish_pil(img, box, flip)
        return self._finish(np.asarray(img), box, flip)

    def _finish(self, arr, box, flip: bool) -> Any:
        """Resize the crop ``box`` (left, upper, right, lower; may be fractional) of an HxWx3
        (or RGBX HxWx4) uint8 array to the output size, flip, convert."""
        if self._to_tensor is not None:
            return self._to_tensor(
                arr, box, (self.height, self.width), flip, self.output == "torchrgb"
            )
        from PIL import Image

        wrap = _rgbx_image_mapper() if arr.shape[2] == 4 else None
        img = wrap(arr) if wrap is not None else Image.fromarray(arr)
        return self._finish_pil(img, box, flip)

    def _finish_pil(self, img, box, flip: bool) -> Any:
        from PIL import Image

        out = img.resize((self.width, self.height), Image.Resampling.BILINEAR, box=box)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.output == "pil":
            return out
        return np.asarray(out).copy()  # writable


def random_resized_crop(
    size: int | Sequence[int] = 224,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    flip: bool = True,
    output: str = "torchrgb",
    fast: bool = False,
    extensions: Sequence[str] | str | None = None,
) -> RandomResizedCrop:
    """A decode handler for training crops: ``ds.decode(random_resized_crop(224))``.

    See :class:`RandomResizedCrop` and the module's description.
    """
    return RandomResizedCrop(
        size, scale=scale, ratio=ratio, flip=flip, output=output, fast=fast, extensions=extensions
    )
