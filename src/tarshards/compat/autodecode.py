"""webdataset's decoding names (``ImageHandler``, ``imagehandler``, ``Decoder``...) over
tarshards' one codec registry (:mod:`tarshards.codecs`) and one ``decode`` stage.

Differences on purpose: ``.pyd``/``.pickle``/``.pth`` fields are refused unless decoding is asked
with ``allow_unsafe=True`` (webdataset unpickles them by default), and errors are
:class:`~tarshards.errors.DecodeError` (``DecodingError`` here) naming shard, member and offset.
"""

from __future__ import annotations

from typing import Any, Callable

from ..codecs.registry import IMAGE_EXTENSIONS as _IMAGE_EXTENSIONS
from ..codecs.registry import IMAGE_MODES, field_decoder, image_decoder
from ..errors import DecodeError
from ..pipeline import stages as _st
from ..pipeline.stages import handle_extension

__all__ = [
    "Continue",
    "Decoder",
    "DecodingError",
    "IMAGE_EXTENSIONS",
    "ImageHandler",
    "basichandlers",
    "gzfilter",
    "handle_extension",
    "imagehandler",
    "imagespecs",
    "torch_loads",
]

DecodingError = DecodeError
IMAGE_EXTENSIONS = list(_IMAGE_EXTENSIONS)

# webdataset's table: spec -> (library, dtype, channels)
imagespecs = {
    name: (
        "pil" if kind == "pil" else "torch" if kind.startswith("torch") else "numpy",
        None if kind == "pil" else ("uint8" if kind.endswith("uint8") else "float"),
        (pil_mode or "RGB").lower(),
    )
    for name, (pil_mode, kind) in IMAGE_MODES.items()
}


class ImageHandler:
    """A decode handler for image fields: ``ImageHandler("rgb8")`` decodes ``jpg``/``png``...
    fields to HxWx3 uint8 arrays (``"torchrgb"``: float CxHxW tensors, ``"pil"``: PIL images;
    see ``imagespecs``). Other fields are left to the next handler."""

    def __init__(self, imagespec: str, extensions=IMAGE_EXTENSIONS):
        if imagespec not in IMAGE_MODES:
            raise ValueError(
                f"unknown image spec {imagespec!r}; choose one of {', '.join(sorted(IMAGE_MODES))}"
            )
        self.imagespec = imagespec
        self.extensions = {e.lower() for e in extensions}
        self._decode = image_decoder(imagespec)

    def __call__(self, key: str, data: bytes):
        ext = key.rpartition(".")[2].lower()
        if ext not in self.extensions:
            return None
        return self._decode(data, ext)

    def __repr__(self):
        return f"ImageHandler({self.imagespec!r})"


def imagehandler(imagespec: str, extensions=IMAGE_EXTENSIONS) -> ImageHandler:
    """An :class:`ImageHandler`."""
    return ImageHandler(imagespec, extensions)


def basichandlers(key: str, data: bytes):
    """Decode by extension with the codec registry, images excepted (``None`` when no codec)."""
    dec = field_decoder(key, image_mode=None)
    return None if dec is None else dec(data)


def gzfilter(key: str, data: bytes):
    """Decompress ``.gz`` fields and decode what is inside (the registry does this already)."""
    if not key.lower().endswith(".gz"):
        return None
    dec = field_decoder(key, image_mode=None)
    assert dec is not None  # a .gz field always has one (gzip.decompress at least)
    return dec(data)


class Continue:
    """A handler's result meaning: go on decoding ``data`` as if the field were ``key``."""

    def __init__(self, key, data):
        self.key = key
        self.data = data


def _resolve_continue(handler: Callable) -> Callable:
    def run(key, data):
        result = handler(key, data)
        if isinstance(result, Continue):
            dec = field_decoder(result.key, image_mode=None)
            return result.data if dec is None else dec(result.data)
        return result

    return run


def as_decode_args(args) -> list:
    """webdataset decode arguments -> tarshards.pipeline.stages.decode handlers (one decode
    stage)."""
    out: list = []
    for a in args:
        if isinstance(a, Decoder):
            out += a.args
        elif isinstance(a, str):
            if a not in IMAGE_MODES:
                raise ValueError(
                    f"unknown image spec {a!r}; choose one of {', '.join(sorted(IMAGE_MODES))}"
                )
            out.append(a)
        elif a is basichandlers or a is gzfilter:
            continue  # the registry's own behaviour, already the fallback
        elif callable(a):
            out.append(_resolve_continue(a))
        else:
            raise TypeError(f"decode: {a!r} is neither an image spec nor a handler f(key, data)")
    return out


class Decoder:
    """Decode one sample dict: ``Decoder([imagehandler("rgb")])(sample)``."""

    def __init__(
        self,
        handlers=(),
        pre=None,
        post=None,
        only=None,
        partial: bool = False,
        allow_unsafe: bool = False,
    ):
        self.args = as_decode_args(list(pre or []) + list(handlers) + list(post or []))
        self.only = only
        self.partial = partial
        self.allow_unsafe = allow_unsafe

    def decode(self, sample: dict) -> dict:
        (out,) = _st.decode(
            [sample],
            *self.args,
            only=self.only,
            partial=self.partial,
            allow_unsafe=self.allow_unsafe,
        )
        return out

    def __call__(self, sample: dict) -> dict:
        return self.decode(sample)


def torch_loads(data: bytes) -> Any:
    """``torch.load`` of bytes: runs code from the data, so only for data you trust."""
    import importlib

    return importlib.import_module("tarshards.torch.adapter").load_pth(data)


def unpickle_loads(data: bytes) -> Any:
    """``pickle.loads``: runs code from the data, so only for data you trust."""
    import pickle

    return pickle.loads(data)
