"""The ``tenbin`` tensor format (``.ten`` fields), as written by webdataset and tensorcom.

A ``.ten`` value is a list of arrays. The bytes are a sequence of chunks, each an 8-byte magic
``~TenBin~``, the payload length (int64, little-endian) and the payload padded with zeros to a
multiple of 64 bytes. Every array takes two chunks: a header (int64 words: the dtype's short
code as 8 ASCII bytes, an 8-byte info string, the number of dimensions, the dimensions) and the
raw C-ordered data. Decoded arrays are read-only views of the buffer (no copy).

This module sits at the bottom of the import order (numpy only); :mod:`tarshards.codecs`
registers it for the ``ten``, ``tb`` and ``tenbin`` extensions.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import IO, TYPE_CHECKING, Literal, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["decode_buffer", "encode_buffer", "load", "read", "save", "write"]

MAGIC = b"~TenBin~"
_ALIGN = 64
_CODES = {
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
}
_DTYPES = {code: np.dtype(name) for name, code in _CODES.items()}
_LEN = struct.Struct("<q")

Arrays = list[np.ndarray]
# ``infos=True``: the arrays and their info strings
ArraysInfos = tuple[list[np.ndarray], list[str]]
Infos = Sequence[object] | None  # one info per array (``str()`` of each), or none


def _word(text: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > 8:
        raise ValueError(f"tenbin: {text!r} is longer than 8 characters")
    return raw.ljust(8, b"\0")


def _unword(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("ascii")


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _header(a: np.ndarray, info: str) -> bytes:
    code = _CODES.get(a.dtype.name)
    if code is None:
        raise ValueError(f"tenbin: unsupported dtype {a.dtype} (use one of {', '.join(_CODES)})")
    if a.ndim >= 10:
        raise ValueError(f"tenbin: {a.ndim} dimensions (at most 9)")
    dims = np.array([a.ndim, *a.shape], dtype="<i8").tobytes()
    return _word(code) + _word(info) + dims


def _arrays(arrays: Sequence[npt.ArrayLike], infos: Infos) -> list[tuple[np.ndarray, str]]:
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, (list, tuple)):
        raise ValueError("tenbin encodes a list of arrays")
    if infos is None:
        infos = [""] * len(arrays)
    elif len(infos) != len(arrays):
        raise ValueError(f"tenbin: {len(infos)} infos for {len(arrays)} arrays")
    return [(np.ascontiguousarray(a), str(i)) for a, i in zip(arrays, infos)]


def _chunks(arrays: Sequence[npt.ArrayLike], infos: Infos) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    for a, info in _arrays(arrays, infos):
        out.append(_header(a, info))
        out.append(a.data.cast("B") if a.size else b"")  # a.data: memoryview(a)
    return out


def encode_buffer(arrays: Sequence[npt.ArrayLike], infos: Infos = None) -> bytes:
    """The ``.ten`` bytes of a list of arrays (``infos``: optional strings of <= 8 characters)."""
    parts: list[bytes | memoryview] = []
    for chunk in _chunks(arrays, infos):
        n = len(chunk)
        parts += [MAGIC, _LEN.pack(n), chunk, bytes(_padded(n) - n)]
    return b"".join(parts)


def _split(buf: ReadableBuffer) -> list[memoryview]:
    view = memoryview(buf).cast("B")
    chunks: list[memoryview] = []
    offset, total = 0, len(view)
    while offset < total:
        if view[offset : offset + 8] != MAGIC:
            raise ValueError(f"tenbin: bad magic at byte {offset}")
        if offset + 16 > total:
            raise ValueError(f"tenbin: truncated chunk header at byte {offset}")
        (n,) = _LEN.unpack_from(view, offset + 8)
        if n < 0 or offset + 16 + n > total:
            raise ValueError(f"tenbin: chunk of {n} bytes at byte {offset} overruns the buffer")
        chunks.append(view[offset + 16 : offset + 16 + n])
        offset += 16 + _padded(n)
    return chunks


def _decode(chunks: Sequence[memoryview], infos: bool) -> Arrays | ArraysInfos:
    if len(chunks) % 2:
        raise ValueError("tenbin: a header without its data")
    arrays: Arrays = []
    names: list[str] = []
    for raw, data in zip(chunks[::2], chunks[1::2]):
        header = bytes(raw)
        dtype = _DTYPES.get(_unword(header[:8]))
        if dtype is None:
            raise ValueError(f"tenbin: unknown dtype code {header[:8]!r}")
        (ndim,) = _LEN.unpack_from(header, 16)
        shape = tuple(int(d) for d in np.frombuffer(header, "<i8", ndim, 24))
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > len(data):
            raise ValueError(f"tenbin: {len(data)} data bytes for shape {shape} of {dtype}")
        arrays.append(np.frombuffer(data, dtype, count).reshape(shape))
        names.append(_unword(header[8:16]))
    return (arrays, names) if infos else arrays


@overload
def decode_buffer(buf: ReadableBuffer, infos: Literal[False] = ...) -> Arrays: ...
@overload
def decode_buffer(buf: ReadableBuffer, infos: Literal[True]) -> ArraysInfos: ...
@overload
def decode_buffer(buf: ReadableBuffer, infos: bool) -> Arrays | ArraysInfos: ...
def decode_buffer(buf: ReadableBuffer, infos: bool = False) -> Arrays | ArraysInfos:
    """The list of arrays in ``.ten`` bytes (with ``infos=True``: ``(arrays, infos)``)."""
    return _decode(_split(buf), infos)


def write(stream: IO[bytes], arrays: Iterable[npt.ArrayLike], infos: Infos = None) -> None:
    """Write arrays to a binary stream in the tenbin format."""
    stream.write(encode_buffer(list(arrays), infos))


@overload
def read(stream: IO[bytes], n: int = ..., infos: Literal[False] = ...) -> Arrays: ...
@overload
def read(stream: IO[bytes], n: int = ..., *, infos: Literal[True]) -> ArraysInfos: ...
@overload
def read(stream: IO[bytes], n: int = ..., infos: bool = ...) -> Arrays | ArraysInfos: ...
def read(stream: IO[bytes], n: int = sys.maxsize, infos: bool = False) -> Arrays | ArraysInfos:
    """Read up to ``n`` arrays from a binary stream written by :func:`write`."""
    chunks: list[memoryview] = []
    while len(chunks) < 2 * n:
        head = stream.read(16)
        if not head:
            break
        if len(head) < 16 or head[:8] != MAGIC:
            raise ValueError("tenbin: bad or truncated chunk header")
        (size,) = _LEN.unpack_from(head, 8)
        data = stream.read(_padded(size))
        if size < 0 or len(data) < size:
            raise ValueError("tenbin: truncated chunk")
        chunks.append(memoryview(data)[:size])
    return _decode(chunks, infos)


def save(
    fname: str | os.PathLike[str],
    *arrays: npt.ArrayLike,
    infos: Infos = None,
    nocheck: bool = False,
) -> None:
    """Save arrays to a ``.ten`` file."""
    if not nocheck and not str(fname).endswith(".ten"):
        raise ValueError(f"tenbin file names end in .ten: {fname}")
    with open(fname, "wb") as stream:
        write(stream, list(arrays), infos)


@overload
def load(
    fname: str | os.PathLike[str], infos: Literal[False] = ..., nocheck: bool = ...
) -> Arrays: ...
@overload
def load(
    fname: str | os.PathLike[str], infos: Literal[True], nocheck: bool = ...
) -> ArraysInfos: ...
@overload
def load(
    fname: str | os.PathLike[str], infos: bool, nocheck: bool = ...
) -> Arrays | ArraysInfos: ...
def load(
    fname: str | os.PathLike[str], infos: bool = False, nocheck: bool = False
) -> Arrays | ArraysInfos:
    """Load the arrays of a ``.ten`` file."""
    if not nocheck and not str(fname).endswith(".ten"):
        raise ValueError(f"tenbin file names end in .ten: {fname}")
    with open(fname, "rb") as stream:
        return read(stream, infos=infos)
