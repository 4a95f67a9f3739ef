"""The exception and warning hierarchy of tarshards.

Every error raised by the library derives from :class:`TarshardsError` and also from the builtin
exception that fits, so ``except ValueError`` keeps working for callers that do not know us.
Data errors carry their context (shard URL, member name, byte offset) as attributes and in the
message, so a log line alone tells where the problem is.
"""

from __future__ import annotations

import tarfile as _tarfile

__all__ = [
    "CommandError",
    "CompressionError",
    "DecodeError",
    "DuplicateFieldError",
    "DuplicateKeyError",
    "EncodeError",
    "HeaderError",
    "IntegrityError",
    "MissingDependencyError",
    "MissingFieldError",
    "PipeNotAllowedError",
    "ResumeError",
    "ShardFormatError",
    "ShardNotFoundError",
    "ShardSpecError",
    "ShardWriteError",
    "StallError",
    "StallWarning",
    "StorageError",
    "TarshardsError",
    "TarshardsWarning",
    "TruncatedShardError",
    "UnsafeCodecError",
]


class TarshardsError(Exception):
    """Base class of every tarshards error.

    ``url``, ``member`` and ``offset`` say where a data error happened (``None`` when unknown).
    """

    def __init__(self, message: str, *, url=None, member=None, offset=None):
        self.reason = message
        self.url = url
        self.member = member
        self.offset = offset
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.url is not None:
            where.append(f"shard {self.url!s}")
        if self.member is not None:
            where.append(f"member {self.member!r}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        if not where:
            return self.reason
        return f"{self.reason} ({', '.join(where)})"

    def with_context(self, *, url=None, member=None, offset=None):
        """Fill in context that was unknown where the error was raised; returns self."""
        if url is not None and self.url is None:
            self.url = url
        if member is not None and self.member is None:
            self.member = member
        if offset is not None and self.offset is None:
            self.offset = offset
        self.args = (self._format(),)
        return self

    def __reduce__(self):  # keep context across pickling (worker processes)
        return (_rebuild, (type(self), self.reason, self.url, self.member, self.offset))


def _rebuild(cls, reason, url, member, offset):
    return cls(reason, url=url, member=member, offset=offset)


class ShardFormatError(TarshardsError, ValueError, _tarfile.ReadError):
    """A shard is not a valid tar stream: truncated, bad header, bad compression.

    Also a ``tarfile.ReadError`` (and ``ValueError``), so code written for ``tarfile`` or
    webdataset that catches those keeps working. The subclasses tell the causes apart.
    """


class TruncatedShardError(ShardFormatError, EOFError):
    """The shard ends before its data does (inside a header, a member or the compression).

    ``member_whole`` is True when the data of ``member`` was read whole and only what comes
    after it is missing (the stream ends inside its zero padding): the sample it belongs to is
    complete.
    """

    member_whole = False


class HeaderError(ShardFormatError):
    """A tar header is malformed: bad checksum, bad number field, bad pax/GNU extension."""


class CompressionError(ShardFormatError):
    """The gzip/zstd layer is corrupt (bad data, bad checksum, bad trailer)."""


class IntegrityError(ShardFormatError):
    """A shard or member does not match what the manifest/index recorded (hash, size, count)."""


class DuplicateFieldError(ShardFormatError):
    """Two members of one sample have the same extension."""


class DuplicateKeyError(ShardFormatError):
    """Two samples of a data set have the same key where keys must name one sample (the key
    table, :class:`tarshards.KeyIndex`); ``url`` and ``member``: the later sample's shard and
    key."""


class DecodeError(TarshardsError, ValueError):
    """A field's bytes could not be decoded."""


class EncodeError(TarshardsError, ValueError):
    """A sample's value could not be encoded for writing (no codec, wrong type...)."""


class MissingFieldError(TarshardsError, KeyError, ValueError):
    """A stage asked for a field that the sample does not have (also a ``KeyError`` and a
    ``ValueError``)."""

    def __str__(self):  # KeyError would quote the message
        return self.args[0] if self.args else ""


class ResumeError(TarshardsError, ValueError):
    """A saved state does not fit this pipeline or data (other data, seed or plan)."""


class UnsafeCodecError(TarshardsError, PermissionError):
    """A codec that can run arbitrary code (pickle, torch.load) was used without opting in."""


class ShardSpecError(TarshardsError, ValueError):
    """A shard spec that cannot name shards as written (braces that do not expand or balance)."""


class StorageError(TarshardsError, OSError):
    """A URL could not be opened, read or written."""


class ShardNotFoundError(StorageError, FileNotFoundError):
    """A shard (or manifest, index) does not exist at its URL."""


class ShardWriteError(TarshardsError, OSError):
    """Writing or committing a shard failed."""


class PipeNotAllowedError(TarshardsError, PermissionError):
    """A ``pipe:`` URL was given but running shell commands was not allowed."""


class CommandError(TarshardsError, RuntimeError):
    """A shell command run on a sample (``tarproc -c``, ``shell_sample_fn``) failed.

    ``status`` is its exit status and ``stderr`` what it wrote there (bytes).
    """

    def __init__(self, message: str, *, status: int | None = None, stderr: bytes = b"", **context):
        self.status = status
        self.stderr = stderr
        super().__init__(message, **context)

    def __reduce__(self):
        return (
            _rebuild_command,
            (self.reason, self.status, self.stderr, self.url, self.member, self.offset),
        )


def _rebuild_command(reason, status, stderr, url, member, offset):
    return CommandError(reason, status=status, stderr=stderr, url=url, member=member, offset=offset)


class MissingDependencyError(TarshardsError, ImportError):
    """An optional dependency is needed for this feature; the message says what to install."""


class TarshardsWarning(UserWarning):
    """Warnings issued by tarshards (skipped shards, fewer shards than workers...)."""


class StallError(StorageError, TimeoutError):
    """A loader worker made no progress for the watchdog's time (``WebLoader(...,
    watchdog=SECONDS, on_stall="raise")``): ``url`` and ``offset`` say where it was stuck,
    ``rank`` and ``worker`` who (``worker`` ``None``: the main process)."""

    def __init__(self, message: str, *, rank=None, worker=None, seconds=None, **context):
        self.rank = rank
        self.worker = worker
        self.seconds = seconds
        super().__init__(message, **context)

    def __reduce__(self):
        return (
            _rebuild_stall,
            (self.reason, self.rank, self.worker, self.seconds, self.url, self.member, self.offset),
        )


def _rebuild_stall(reason, rank, worker, seconds, url, member, offset):
    return StallError(
        reason, rank=rank, worker=worker, seconds=seconds, url=url, member=member, offset=offset
    )


class StallWarning(TarshardsWarning):
    """The watchdog's report of a stall (rank, worker, shard URL and byte offset in its text);
    the stalled read is retried from that offset."""
