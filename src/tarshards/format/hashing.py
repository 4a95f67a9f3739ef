"""Content hashes for shards and members, and a reader that hashes what passes through it.

Shard hashes are written ``ALGORITHM:HEX``. The default is ``xxh3_64`` (the ``xxhash`` package,
about 7 GB/s on one core); ``sha256`` is always there (hashlib), ``blake3`` when the ``blake3``
package is installed. Without ``xxhash`` the shard default falls back to hashlib's ``blake2b``.

Member checksums (in the index) are unsigned 64-bit ints, ``xxh3_64`` (xxhash's
``xxh3_64_intdigest``), or zlib's ``crc32`` where xxhash is missing; the algorithm is recorded
beside the values. The C loops of the indexer and the writer call the same function (the one
:func:`member_checksum_fn` returns) per member, so both paths give the same values.

Where the optional C module ``_xxh3`` was built (against the system's libxxhash: Debian's
``libxxhash-dev``), xxh3_64 is computed there: the same values, vectorised at run time (AVX2 where
the CPU has it, about twice the speed of the xxhash package's SSE2 build) and without the GIL for
buffers of 64 KiB and more, so that threads hash in parallel (:data:`HASHING_RELEASES_GIL`).
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from typing import Any, BinaryIO

from ..errors import IntegrityError, MissingDependencyError

_xxh3: Any
try:  # optional C module over libxxhash (see _c/xxh3_module.c); the xxhash package is the reference
    from .. import _xxh3 as _xxh3_module

    _xxh3 = _xxh3_module
except ImportError:  # pragma: no cover - built where libxxhash-dev is installed
    _xxh3 = None


def _xxhash_package() -> Any:
    """The ``xxhash`` package (imported on first use: where ``_xxh3`` is built, the hashes do
    not need it, and the tools start without loading it), or None where it is missing."""
    global _xxhash
    if _xxhash is _UNSET:
        try:
            import xxhash as package
        except ImportError:  # pragma: no cover - a core dependency; the fallbacks keep working
            package = None  # type: ignore[assignment]
        _xxhash = package
    return _xxhash


_UNSET: Any = object()
_xxhash: Any = _UNSET
_HAVE_XXH3 = _xxh3 is not None or _xxhash_package() is not None

# whether the default hashes (xxh3_64 of shards and members) run without the GIL
HASHING_RELEASES_GIL = _xxh3 is not None

__all__ = [
    "DEFAULT_HASH",
    "HASHES",
    "HASHING_RELEASES_GIL",
    "HashingReader",
    "MEMBER_HASH",
    "background_hasher",
    "check_shard",
    "file_hasher",
    "hash_rows",
    "member_checksum_c",
    "member_checksum_fn",
    "split_hash",
]

DEFAULT_HASH = "xxh3_64" if _HAVE_XXH3 else "blake2b"
MEMBER_HASH = "xxh3_64" if _HAVE_XXH3 else "crc32"
MEMBER_HASHES = ("xxh3_64", "crc32")
HASHES = ("xxh3_64", "blake3", "sha256", "blake2b", "md5")


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
        if _xxh3 is not None:
            return _xxh3.Xxh3()
        package = _xxhash_package()
        if package is None:
            raise MissingDependencyError("the xxh3_64 hash needs xxhash: pip install xxhash")
        return package.xxh3_64()
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


def member_checksum_fn(name: str = MEMBER_HASH):
    """The one-shot member checksum ``bytes -> int`` of algorithm ``name``."""
    if name == "xxh3_64":
        if _xxh3 is not None:
            return _xxh3.xxh3_64_intdigest
        package = _xxhash_package()
        if package is None:
            raise MissingDependencyError("xxh3_64 member checksums need xxhash: pip install xxhash")
        return package.xxh3_64_intdigest
    if name == "crc32":
        return zlib.crc32
    raise ValueError(f"unknown member checksum {name!r} ({', '.join(MEMBER_HASHES)})")


def member_checksum_c(name: str = MEMBER_HASH):
    """The member checksum for the C loops of ``_speedups`` (``Recorder``,
    ``index_members``): a capsule holding ``_xxh3``'s C function where that module is built
    (called there without a Python call per member), else :func:`member_checksum_fn`'s
    callable. The same values either way."""
    if name == "xxh3_64" and _xxh3 is not None:
        return _xxh3.checksum64
    return member_checksum_fn(name)


def hash_rows(blob, offsets) -> bytes:
    """The xxh3_64 of each row ``blob[offsets[i]:offsets[i + 1]]`` (``offsets``: n + 1 native
    int64 values, bytes-like), as n native uint64 values: the key table hashes a shard index's
    key blob in one call (``_xxh3.hash_rows``, without the GIL), else row by row with the
    xxhash package (the same values)."""
    if _xxh3 is not None and hasattr(_xxh3, "hash_rows"):
        return _xxh3.hash_rows(blob, offsets)
    package = _xxhash_package()
    if package is None:
        raise MissingDependencyError("xxh3_64 key hashes need xxhash: pip install xxhash")
    import array

    view = memoryview(blob).cast("B")
    offs = memoryview(offsets).cast("B").cast("q").tolist()
    if any(b < a for a, b in itertools.pairwise(offs)) or (
        offs and (offs[0] < 0 or offs[-1] > len(view))
    ):
        raise ValueError("hash_rows: offsets out of order or past the blob")
    digest = package.xxh3_64_intdigest
    return array.array("Q", [digest(view[a:b]) for a, b in itertools.pairwise(offs)]).tobytes()


def background_hasher(
    path,
    file_hash: str = DEFAULT_HASH,
    member_hash: str = MEMBER_HASH,
    *,
    members: bool = True,
    index: bool = False,
):
    """A thread that reads the file at ``path`` back while a writer appends to it and hashes it
    (``_xxh3.Background``: the file's xxh3_64 and, with ``members``, each tar member's, in
    order; with ``index``, the index's rows as well), so that the writing thread does not; None
    where the hashes are not xxh3_64, ``_xxh3`` is not built or no thread can be had (the writer
    then hashes and records inline)."""
    members = members or index
    if _xxh3 is None or file_hash != "xxh3_64" or (members and member_hash != "xxh3_64"):
        return None
    try:
        return _xxh3.Background(path, members=members, index=index)
    except (OSError, RuntimeError, NotImplementedError):  # pragma: no cover - no thread, the
        return None  # file not readable, or a big-endian host (index=True)


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
