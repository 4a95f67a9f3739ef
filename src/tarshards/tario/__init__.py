"""Reading and writing tar streams, fast (the ``tario`` package).

The reader is a header parser of our own over large buffered reads: it never seeks, so it works on
files, pipes, stdin and network streams alike, and it holds at most one chunk plus the member being
read. It understands ustar, GNU long names/links, GNU sparse members (old GNU and pax 0.0, 0.1 and
1.0: rebuilt with their holes as zeros) and pax extended and global headers, skips everything that
is not a regular file, and detects gzip and zstd compression by the first bytes of the stream
(:mod:`tarshards.format.compression`).

What the reader accepts and refuses (the same at every read size, in C and in Python):

* a stream that stops on a block boundary after a complete member, without the end-of-archive
  marker, is accepted (as tar and tarfile do); a stream cut anywhere else (inside a header, inside
  a member's data, or inside the zero padding after the last member's data) raises
  :class:`~tarshards.errors.TruncatedShardError` once every complete member has been yielded;
* a 0-byte shard is not a tar archive (:class:`~tarshards.errors.TruncatedShardError`);
* a lone zero block followed by more headers does not end the archive: a
  :class:`~tarshards.errors.TarshardsWarning` says so and the reader goes on (GNU tar's
  ``--ignore-zeros``), so the members after it are not lost; two zero blocks end the archive;
* a declared size is never allocated before its bytes have arrived, so a header that claims a
  terabyte costs no more memory than the bytes that are really there.

The writer emits deterministic ustar headers (fixed mtime, owner and mode) and only adds a pax
header where a name or a size does not fit, so equal samples always give byte-identical shards.

The modules: :mod:`.headers` (header fields, checksums, pax records, names), :mod:`.buffer` (byte
sources and the reader's buffer, memory-mapped for local plain files), :mod:`.reader` (the member
reader, C fast path and Python reference), :mod:`.sparse` (GNU sparse members) and :mod:`.writer`
(the member writer). Grouping members into samples is :func:`tarshards.format.names.group_samples`.
"""

from __future__ import annotations

from ..format.compression import decompressed_chunks, is_compressed_name, open_compressed_writer
from .buffer import PlainStream, read_chunks, tar_byte_source
from .headers import BLOCK, CHUNK_SIZE
from .reader import _scan_members as _scan_members  # the C fast path, for tests
from .reader import iter_tar, iter_tar_batches, open_tar_bytes
from .writer import (
    DEFAULT_MODE,
    DEFAULT_MTIME,
    TarMemberWriter,
    header_number,
    header_size,
    tar_header,
)
from .writer import _ustar_parts as _ustar_parts  # the C writer loop, for tests

__all__ = [
    "BLOCK",
    "CHUNK_SIZE",
    "DEFAULT_MODE",
    "DEFAULT_MTIME",
    "PlainStream",
    "TarMemberWriter",
    "decompressed_chunks",
    "header_number",
    "header_size",
    "is_compressed_name",
    "iter_tar",
    "iter_tar_batches",
    "open_compressed_writer",
    "open_tar_bytes",
    "read_chunks",
    "tar_byte_source",
    "tar_header",
]
