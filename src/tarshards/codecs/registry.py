"""One registry of codecs: for each extension, how to encode a value and how to decode bytes.

Decoding is chosen by the *last* component of a field's extension (``seg.png`` decodes as ``png``);
a final ``.gz`` is decompressed first (``seg.png.gz``). Images decode according to a *mode* with
webdataset's names (``pil``, ``rgb8``, ``torchrgb``...). Codecs that can run arbitrary code (pickle,
``torch.load``) are marked unsafe and refuse to decode unless the caller opts in.

The image codecs and modes live in :mod:`tarshards.codecs.images` (re-exported here). Heavy or
optional libraries (PIL, msgpack, simplejpeg, torch) are imported on first use. The parts
that need torch (the ``torch*`` image modes, ``.pth``) are *optional entries*: their names are
declared here by the package (:data:`OPTIONAL_CODECS`, :data:`OPTIONAL_ARRAY_KINDS`) and
:mod:`tarshards.torch` registers them when first used; without torch they raise
:class:`~tarshards.errors.MissingDependencyError` with the install command.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .._lazy import LazyModule, OptionalEntries
from ..errors import DecodeError, MissingDependencyError, UnsafeCodecError
from .images import (
    IMAGE_EXTENSIONS,
    IMAGE_MODES,
    OPTIONAL_ARRAY_KINDS,
    _dec_image_pil,
    _enc_image,
    image_decoder,
    image_field_decoder,
    register_array_kind,
    register_image_mode,
)

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")  # numpy is imported on first use

__all__ = [
    "AUDIO_RATE",
    "Codec",
    "IMAGE_EXTENSIONS",
    "audio_value",
    "IMAGE_MODES",
    "codec_for",
    "decode_value",
    "encode_sample",
    "encode_value",
    "field_decoder",
    "OPTIONAL_ARRAY_KINDS",
    "OPTIONAL_CODECS",
    "image_decoder",
    "register_array_kind",
    "register_codec",
    "register_image_mode",
]


@dataclass(frozen=True)
class Codec:
    """How one family of extensions is written and read.

    ``encode(value, ext) -> bytes`` and ``decode(data, ext) -> value``; ``safe=False`` marks codecs
    that may execute code when decoding. ``decode`` takes any bytes-like ``data``: ``bytes``, or
    the read-only ``memoryview`` a zero-copy reader (``copy=False``) hands out.
    """

    extensions: tuple[str, ...]
    encode: Callable[[Any, str], bytes]
    decode: Callable[[bytes, str], Any]
    safe: bool = True
    image: bool = False


_REGISTRY: dict[str, Codec] = {}
# extensions whose codec an optional module registers on first use (``safe=`` known before)
OPTIONAL_CODECS = OptionalEntries("codec", "codecs.OPTIONAL_CODECS")


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
    return str(data, "utf-8")  # bytes or any buffer (a zero-copy memoryview)


def _enc_int(value, ext):
    if type(value) is int:  # the usual class label: numpy (for its scalars) not imported for it
        return str(value).encode("ascii")
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
    # json.loads takes str, bytes and bytearray (it detects UTF-16/32 in bytes), not memoryview
    return json.loads(data if isinstance(data, (bytes, bytearray)) else bytes(data))


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
    return importlib.import_module("tarshards.format.tenbin")  # numpy, imported on first use


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


# audio (.wav, .flac): arrays written through soundfile; decoding keeps the bytes (the audio
# decoder, tarshards.audio(), reads them)
AUDIO_RATE = 16000  # the sample rate of an array given without one
_AUDIO_FORMATS = {"wav": "WAV", "flac": "FLAC"}


def audio_value(value, default_rate: int | None = AUDIO_RATE):
    """``(array, rate)`` of an audio field's value: an array (numpy, or anything with
    ``.detach().cpu().numpy()``: a torch tensor) or ``(array, rate)`` (what
    :func:`tarshards.audio` gives). The array comes back as soundfile takes it: ``(samples,)``
    or ``(samples, channels)``; a 2-D array whose first dimension is the smaller (at most 16)
    is read as ``(channels, samples)``, the layout of tarshards.audio and torchaudio, and
    transposed."""
    rate = default_rate
    if isinstance(value, tuple) and len(value) == 2 and not hasattr(value[1], "shape"):
        value, rate = value
        rate = int(rate)
    if hasattr(value, "detach"):  # a torch tensor (torch itself is not imported here)
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim == 2 and arr.shape[0] < arr.shape[1] and arr.shape[0] <= 16:
        arr = arr.T
    if arr.ndim not in (1, 2) or arr.size == 0:
        raise ValueError(f"audio is a 1-D or 2-D array of samples, got shape {arr.shape}")
    return arr, rate


def _enc_audio(value, ext):
    sf = _lazy("soundfile", f"writing .{ext} audio", "av")
    arr, rate = audio_value(value)
    if rate is None or rate <= 0:
        raise ValueError(f"bad sample rate {rate!r}")
    if arr.dtype.kind == "f":
        arr = arr.astype(np.float32, copy=False)
    elif arr.dtype not in (np.int16, np.int32):
        arr = arr.astype(np.int32) if arr.dtype.itemsize > 2 else arr.astype(np.int16)
    subtype = "PCM_24" if arr.dtype == np.int32 and ext == "flac" else None
    if arr.dtype == np.int32 and ext == "wav":
        subtype = "PCM_32"
    buf = io.BytesIO()
    sf.write(buf, arr, rate, format=_AUDIO_FORMATS[ext], subtype=subtype)
    return buf.getvalue()


def _dec_audio(data, ext):
    return data  # audio stays bytes: tarshards.audio() decodes it


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
    Codec(("wav", "flac"), _enc_audio, _dec_audio),
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
        return image_field_decoder(image_mode, size, last)
    if not codec.safe and not allow_unsafe:
        return _refuse(ext)
    dec = codec.decode
    if dec is _dec_audio:
        return None  # kept as bytes, as before there was an encoder
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
