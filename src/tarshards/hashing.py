"""Content hashes for shards and members, and a reader that hashes what passes through it.

Shard hashes are written ``ALGORITHM:HEX``. The default is ``xxh3_64`` (the ``xxhash`` package,
about 7 GB/s on one core); ``sha256`` is always there (hashlib), ``blake3`` when the ``blake3``
package is installed. Without ``xxhash`` the shard default falls back to hashlib's ``blake2b``.

Member checksums (in the index) are unsigned 64-bit ints, by default ``wmix64`` (below): a
checksum made to be computed in the same C loop that reads or writes the tar headers, at memory
speed, with this module's numpy code as the reference (and the fallback without the C
extension). ``xxh3_64`` and ``crc32`` member checksums (indexes written before ``wmix64``) are
still read and verified: the algorithm is recorded beside every value.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, BinaryIO

from .errors import IntegrityError, MissingDependencyError

try:  # optional C accelerator (see _speedups.c); wmix64 below is the reference
    from ._speedups import wmix64 as _c_wmix64
    from ._speedups import wmix64_words as _c_wmix64_words
except ImportError:  # pragma: no cover - built by default
    _c_wmix64 = _c_wmix64_words = None

_xxhash: Any
try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - a core dependency; the fallbacks keep working
    _xxhash = None

__all__ = [
    "DEFAULT_HASH",
    "HASHES",
    "HashingReader",
    "MEMBER_HASH",
    "check_shard",
    "file_hasher",
    "member_checksum_fn",
    "split_hash",
    "wmix64",
]

DEFAULT_HASH = "xxh3_64" if _xxhash is not None else "blake2b"
MEMBER_HASH = "wmix64"
MEMBER_HASHES = ("wmix64", "xxh3_64", "crc32")
HASHES = ("xxh3_64", "blake3", "sha256", "blake2b", "md5")

# ---- wmix64, the index's member checksum --------------------------------------------------
_M64 = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15
_K2 = 0xBF58476D1CE4E5B9
_K3 = 0x94D049BB133111EB


def _wmix_sum(words, first: int) -> int:
    """The sum of the keyed words of ``words`` (a buffer of little-endian u64), the first at
    word ``first``."""
    if _c_wmix64_words is not None:
        return _c_wmix64_words(words, first)
    import numpy as np

    return _wmix_sum_reference(np.frombuffer(words, "<u8"), first)


def _wmix_sum_reference(words, first: int) -> int:
    """:func:`_wmix_sum` in numpy (``words``: a uint64 array), the definition."""
    import numpy as np

    if not len(words):
        return 0
    k1, low, shift = np.uint64(_K1), np.uint64(0xFFFFFFFF), np.uint64(32)
    x = words ^ (np.arange(first + 1, first + 1 + len(words), dtype=np.uint64) * k1)
    x = (x & low) * (x >> shift) + words
    return int(x.sum(dtype=np.uint64))


def _wmix_final(acc: int, n: int) -> int:
    h = (acc ^ (n * _K3)) & _M64
    h ^= h >> 30
    h = (h * _K2) & _M64
    h ^= h >> 27
    h = (h * _K3) & _M64
    return h ^ (h >> 31)


def _wmix64_reference(data) -> int:
    """wmix64 in numpy (the definition; the C extension computes the same)."""
    import numpy as np

    view = memoryview(data).cast("B")
    n = len(view)
    whole = n - n % 8
    acc = _wmix_sum_reference(np.frombuffer(view[:whole], "<u8"), 0)
    if whole < n:
        tail = bytes(view[whole:]) + bytes(8 - (n - whole))
        acc += _wmix_sum_reference(np.frombuffer(tail, "<u8"), whole // 8)
    return _wmix_final(acc & _M64, n)


def wmix64(data) -> int:
    """The ``wmix64`` checksum of ``data`` (bytes-like), an unsigned 64-bit int.

    The data, zero-padded to whole little-endian 64-bit words ``w[j]``: each word is keyed by its
    position, ``x = w[j] ^ (j + 1) * K1``; the sum of ``(x mod 2**32) * (x >> 32) + w[j]`` over
    all words (mod 2**64) is xored with ``len(data) * K3`` and passed through splitmix64's
    finaliser (constants in docs/format.md). The products are what SSE2 multiplies two at a
    time (as xxh3 does), so the C code runs at memory speed. Every single-bit error changes the
    checksum. Not a cryptographic hash: it finds damage, not tampering (the shard hash is for
    that).
    """
    if _c_wmix64 is not None:
        return _c_wmix64(data)
    return _wmix64_reference(data)


class Wmix64:
    """Incremental :func:`wmix64` (``update`` pieces of any length, then ``intdigest``)."""

    __slots__ = ("acc", "n", "carry")

    def __init__(self):
        self.acc = 0
        self.n = 0
        self.carry = b""

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if self.carry:
            need = 8 - len(self.carry)
            self.carry += bytes(view[:need])
            view = view[need:]
            if len(self.carry) < 8:
                return
            self.acc += _wmix_sum(self.carry, self.n // 8)
            self.n += 8
            self.carry = b""
        whole = len(view) - len(view) % 8
        if whole:
            self.acc += _wmix_sum(view[:whole], self.n // 8)
            self.n += whole
        self.carry = bytes(view[whole:])

    def intdigest(self) -> int:
        acc, n = self.acc, self.n
        if self.carry:
            tail = self.carry + bytes(8 - len(self.carry))
            acc += _wmix_sum(tail, n // 8)
            n += len(self.carry)
        return _wmix_final(acc & _M64, n)


class Crc32:
    """zlib's CRC-32 with the hashlib interface."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"

    def intdigest(self) -> int:
        return self.value


def file_hasher(name: str = DEFAULT_HASH):
    """A new hash object (``update``/``hexdigest``) for the algorithm ``name``."""
    if name == "xxh3_64":
        if _xxhash is None:
            raise MissingDependencyError("the xxh3_64 hash needs xxhash: pip install xxhash")
        return _xxhash.xxh3_64()
    if name == "blake3":
        try:
            import blake3
        except ImportError:
            raise MissingDependencyError(
                "the blake3 hash needs blake3: pip install blake3"
            ) from None
        return blake3.blake3()
    if name in ("sha256", "blake2b", "md5"):
        return hashlib.new(name)
    if name == "crc32":
        return Crc32()
    raise ValueError(f"unknown hash {name!r}; choose one of {', '.join(HASHES)}")


def member_hasher_factory(name: str):
    """A function making incremental member hashers with ``update`` and ``intdigest``."""
    if name == "wmix64":
        return Wmix64
    if name == "xxh3_64":
        if _xxhash is None:
            raise MissingDependencyError("xxh3_64 member checksums need xxhash: pip install xxhash")
        return _xxhash.xxh3_64
    if name == "crc32":
        return Crc32
    raise ValueError(f"unknown member checksum {name!r} ({', '.join(MEMBER_HASHES)})")


def member_checksum_fn(name: str = MEMBER_HASH):
    """The one-shot member checksum ``bytes -> int`` of algorithm ``name``."""
    if name == "wmix64":
        return wmix64
    if name == "xxh3_64":
        if _xxhash is None:
            raise MissingDependencyError("xxh3_64 member checksums need xxhash: pip install xxhash")
        return _xxhash.xxh3_64_intdigest
    if name == "crc32":
        return zlib.crc32
    raise ValueError(f"unknown member checksum {name!r} ({', '.join(MEMBER_HASHES)})")


def split_hash(value: str) -> tuple[str, str]:
    """``"xxh3_64:abcd..."`` -> ``("xxh3_64", "abcd...")``."""
    algo, sep, digest = str(value).partition(":")
    if not sep or not digest:
        raise ValueError(f"a hash is written ALGORITHM:HEX, got {value!r}")
    return algo, digest


class HashingReader:
    """A binary stream that hashes (and counts) every byte read through it.

    ``read``/``read1``/``readinto`` pass through to ``stream``; :meth:`finish` reads what is
    left, so the digest covers the whole file even when the tar reader stopped at the end of
    the archive.
    """

    def __init__(self, stream: BinaryIO, algorithm: str = DEFAULT_HASH):
        self.stream = stream
        self.algorithm = algorithm
        self.hasher = file_hasher(algorithm)
        self.nbytes = 0
        inner = getattr(stream, "readinto1", None) or getattr(stream, "readinto", None)
        if inner is not None:
            self._inner_readinto = inner
        else:
            self.readinto = None  # type: ignore[method-assign,assignment]  # tar reader: read()

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        if data:
            self.hasher.update(data)
            self.nbytes += len(data)
        return data

    def read1(self, n: int = -1) -> bytes:
        data = (getattr(self.stream, "read1", None) or self.stream.read)(n)
        if data:
            self.hasher.update(data)
            self.nbytes += len(data)
        return data

    def readinto(self, view) -> int:
        n = self._inner_readinto(view) or 0
        if n:
            self.hasher.update(memoryview(view)[:n])
            self.nbytes += n
        return n

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def finish(self) -> None:
        """Read (and hash) the rest of the stream."""
        while self.read1(1 << 20):
            pass

    @property
    def digest(self) -> str:
        """``ALGORITHM:HEX`` of what was read so far."""
        return f"{self.algorithm}:{self.hasher.hexdigest()}"


def check_shard(
    url,
    *,
    expected_hash: str | None,
    expected_nbytes: int | None,
    got_hash: str | None,
    got_nbytes: int,
    expected_samples: int | None = None,
    got_samples: int | None = None,
) -> None:
    """Raise :class:`IntegrityError` naming ``url`` when size, hash or sample count differ."""
    if expected_nbytes is not None and got_nbytes != expected_nbytes:
        raise IntegrityError(
            f"the shard has {got_nbytes} bytes, the manifest says {expected_nbytes}", url=url
        )
    if expected_hash is not None and got_hash is not None and got_hash != expected_hash:
        raise IntegrityError(
            f"the shard's hash is {got_hash}, the manifest says {expected_hash}", url=url
        )
    if expected_samples is not None and got_samples is not None and got_samples != expected_samples:
        raise IntegrityError(
            f"the shard has {got_samples} samples, the manifest says {expected_samples}", url=url
        )
