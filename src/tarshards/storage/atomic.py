"""Outputs that appear under their final name only when complete, and their temporary files.

:class:`AtomicOutput` writes a local file under a temporary name beside its final one and renames
it on commit (remote URLs: a local temporary uploaded on commit); :func:`remove_stale_temporaries`
removes the temporaries that writers which died left behind, never those of a running writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import time
from typing import cast

try:  # POSIX: a lock on the temporary file tells a running writer from a dead one
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

try:  # buffers written by a thread of their own (AtomicOutput.write_behind)
    from .._speedups import WriteBehind as _WriteBehind
except ImportError:  # pragma: no cover - the C accelerator not built: written inline
    _WriteBehind = None

from ..errors import PipeNotAllowedError, StorageError
from .open import PipeStream
from .paths import filesystem, is_local, local_path

__all__ = [
    "STALE_AFTER",
    "AtomicOutput",
    "is_stale_temporary",
    "remove_stale_temporaries",
    "temporary_directory",
    "temporary_name",
]

logger = logging.getLogger(__name__)


# A temporary file is named ``.NAME.PID-HOST-START-RANDOM.tmp`` beside its final name NAME: PID is
# the writing process, HOST a hash of its host name, START the process's start time (clock ticks
# since boot, 0 where unknown: it tells a reused PID apart), RANDOM makes the name unique. The
# writer also holds an exclusive flock on the file while it writes. A temporary is stale, and may
# be removed by anyone, only when nobody holds that lock and its writer is known to be gone: on
# the same host the PID is dead (or belongs to a younger process); from another host (a shared
# file system) the file has not been touched for STALE_AFTER seconds.
_TEMP_SUFFIX = ".tmp"
_TEMP_RE = re.compile(
    r"\.(?P<base>.+)\.(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-(?P<start>\d+)-"
    r"[0-9a-f]{8}\.tmp"
)
STALE_AFTER = 600.0
_UPLOAD_BASE = "tarshards-upload"


def _host_tag() -> str:
    if hasattr(os, "uname"):  # what socket.gethostname() gives, without importing socket
        host = os.uname().nodename
    else:  # pragma: no cover - not POSIX
        import socket

        host = socket.gethostname()
    return hashlib.sha1(host.encode("utf-8", "replace")).hexdigest()[:8]


def _process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (Linux); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _pid_alive(pid: int, start: int) -> bool:
    if os.name != "posix":
        return True  # no safe liveness probe (os.kill would terminate it): keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    except OSError:
        return True
    if start:
        now = _process_start(pid)
        if now and now != start:
            return False  # the PID was reused by a younger process: the writer is gone
    if _is_zombie(pid):
        return False  # killed, not yet reaped (an init that does not reap): it writes no more
    return True


def _is_zombie(pid: int) -> bool:
    """Whether process ``pid`` has exited and awaits reaping (Linux; False when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def _try_lock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False when someone holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks: decide on the other evidence
        return True
    return True


# this process's part of a temporary name (pid, host, start time), by pid: worked out once per
# process (a forked child has its own pid), not once per file
_PROCESS_TAGS: dict[int, str] = {}


def temporary_name(directory: str, base: str) -> str:
    """A fresh temporary path for the final name ``base`` in ``directory`` (see _TEMP_RE)."""
    pid = os.getpid()
    tag = _PROCESS_TAGS.get(pid)
    if tag is None:
        tag = _PROCESS_TAGS[pid] = f"{pid}-{_host_tag()}-{_process_start(pid)}"
    return os.path.join(directory, f".{base}.{tag}-{os.urandom(4).hex()}{_TEMP_SUFFIX}")


def _create_temporary(directory: str, base: str, buffering: int = 1 << 20):
    """Create and lock a new temporary file; returns ``(path, binary writer)`` (``buffering``
    as :func:`open`'s: 0 gives an unbuffered writer)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = temporary_name(directory, base)
        try:
            fd = os.open(path, flags, 0o666)
        except FileExistsError:  # pragma: no cover - 32 random bits
            continue
        break
    try:
        _try_lock(fd)  # held until the file is closed
        return path, os.fdopen(fd, "wb", buffering=buffering)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def is_stale_temporary(path: str, *, now: float | None = None) -> bool:
    """Whether ``path`` is a tarshards temporary file whose writer is gone (see above)."""
    m = _TEMP_RE.fullmatch(os.path.basename(path))
    if m is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not _try_lock(fd):
            return False  # its writer is at work
        if m["host"] == _host_tag():
            pid = int(m["pid"])
            return pid != os.getpid() and not _pid_alive(pid, int(m["start"]))
        age = (time.time() if now is None else now) - os.fstat(fd).st_mtime
        return age > STALE_AFTER
    finally:
        os.close(fd)  # releases the lock


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files that writers which died (kill -9, power loss) left in
    ``directory``; never those of a writer still running. Returns the paths removed."""
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not (entry.startswith(".") and entry.endswith(_TEMP_SUFFIX)):
            continue
        path = os.path.join(directory, entry)
        if is_stale_temporary(path):
            try:
                os.unlink(path)
            except OSError:
                continue
            removed.append(path)
            logger.info("removed %s, left by a writer that died", path)
    return removed


def temporary_directory(dest) -> str | None:
    """Where :class:`AtomicOutput` puts the temporary file for ``dest`` (None: no file)."""
    if hasattr(dest, "write"):
        return None
    dest = os.fspath(dest)
    if dest == "-" or dest.startswith("pipe:"):
        return None
    if is_local(dest):
        return os.path.dirname(os.path.abspath(local_path(dest)))
    import tempfile

    return tempfile.gettempdir()


_SYNC_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writeback of the range's dirty pages, no waiting
_SYNC_FILE_RANGE: list = []  # [the libc function, or None], looked up once


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None (other systems, or no ctypes)."""
    if not _SYNC_FILE_RANGE:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (ImportError, OSError, AttributeError):
                fn = None
        _SYNC_FILE_RANGE.append(fn)
    return _SYNC_FILE_RANGE[0]


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (where the platform allows opening directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicOutput:
    """A destination that appears under its final name only when complete.

    Local paths are written to a temporary name in the same directory (``.NAME.<owner>.tmp``,
    locked while it is written) and, on :meth:`commit`, flushed to disk (fsync), renamed, and the
    directory synced, so a crash or ``kill -9`` at any moment leaves either nothing or the whole
    file under the final name. Opening first removes the stale temporaries that writers which
    died left in that directory (``remove_stale=False`` skips that; see
    :func:`remove_stale_temporaries`). A temporary file is written through a 1 MB buffer
    (``buffering=``, as :func:`open`'s: 0 for none, where whole files are written at once).
    Remote URLs are written to a local temporary file and uploaded through fsspec on commit;
    ``-`` writes to stdout; a file object is written to directly. ``pipe:CMD`` (only with
    ``allow_pipe=True``) writes to the stdin of a shell command and checks its exit status on
    commit: what the command writes is not atomic. :meth:`abort` (or an exception in the
    ``with`` block) removes the temporary file (or kills the command).
    """

    def __init__(
        self,
        dest,
        *,
        storage_options: dict | None = None,
        allow_pipe: bool = False,
        remove_stale: bool = True,
        buffering: int = 1 << 20,
    ):
        self.dest = dest
        self.storage_options = storage_options
        self._tmp = None
        self._owned = False
        self._pipe = None
        self._behind = None  # the write_behind() under way
        self._written_out = 0  # bytes start_writeback() handed to the kernel's writeback
        self.done = False
        if hasattr(dest, "write"):
            self.stream = dest
            self.name = getattr(dest, "name", "<stream>")
            return
        dest = os.fspath(dest)
        self.name = dest
        if dest == "-":
            self.stream = sys.stdout.buffer
        elif dest.startswith("pipe:"):
            if not allow_pipe:
                raise PipeNotAllowedError(
                    "pipe: outputs run shell commands and are off by default; pass "
                    "allow_pipe=True (TarWriter(..., allow_pipe=True)) if you trust the command",
                    url=dest,
                )
            self._pipe = PipeStream(dest[5:], "wb")
            self.stream = self._pipe.stream
        else:
            local = is_local(dest)
            base = os.path.basename(local_path(dest)) if local else _UPLOAD_BASE
            if not base:
                raise StorageError("the output is a directory name, not a file name", url=dest)
            d = cast(str, temporary_directory(dest))  # a file name: never None
            os.makedirs(d, exist_ok=True)
            if remove_stale:
                remove_stale_temporaries(d)
            self._tmp, self.stream = _create_temporary(d, base, buffering)
            self._owned = True
            # looked up once per process (2-4 ms, ctypes), here: a process that forks workers
            # after writing a file (a conversion's plan) hands them the lookup made
            _sync_file_range()

    @property
    def temporary_path(self) -> str | None:
        """The local file being written until :meth:`commit` (also for an upload), else None
        (stdout, a pipe, a file object; and once committed or aborted)."""
        return self._tmp

    @property
    def can_write_back(self) -> bool:
        """Whether :meth:`start_writeback` does anything here (a temporary file, on Linux)."""
        return self._owned and self._tmp is not None and _sync_file_range() is not None

    def start_writeback(self) -> None:
        """Have the kernel start writing what was written so far to the disk, without waiting
        (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the disk works while the
        writer goes on and :meth:`commit`'s fsync waits only for the last part (measured on
        this host, 115 MB in 1 MB writes: fsync 40-50 ms after the writes, 6-12 ms with this
        every 8 MB). Nothing where the output is not a temporary file or the call is missing."""
        if not self.can_write_back or self._behind is not None:
            return
        self.stream.flush()
        fd = self.stream.fileno()
        end = os.lseek(fd, 0, os.SEEK_CUR)
        if end > self._written_out:
            sync = _sync_file_range()
            sync(fd, self._written_out, end - self._written_out, _SYNC_WRITE)
            self._written_out = end

    def write_behind(self, parts) -> None:
        """Write the buffers ``parts`` (the whole output) on a thread of its own where the output
        is a temporary file and the C accelerator is built (``_speedups.WriteBehind``: written and
        synced without the GIL), else here and now. :meth:`commit` waits for it (and raises its
        error); nothing else may be written to this output. What it is for: a writer that saves
        many small files (an index per shard) goes on while the kernel makes their pages."""
        if self._behind is not None:  # two writers of one file at once
            raise ValueError(f"{self.name}: write_behind() while one is under way")
        if self._owned and self._tmp is not None and _WriteBehind:
            self.stream.flush()
            fd = self.stream.fileno()
            self._behind = _WriteBehind(fd, os.lseek(fd, 0, os.SEEK_CUR), parts, self.name)
        else:
            self.stream.writelines(parts)

    def _wait_behind(self) -> bool:
        """Wait for :meth:`write_behind`'s thread; True where it wrote and synced the file."""
        behind, self._behind = self._behind, None
        if behind is None:
            return False
        behind.wait()
        return True

    def commit(self) -> None:
        """Publish the output under its final name (or finish the command / the upload)."""
        if self.done:
            return
        self.done = True
        try:
            synced = self._wait_behind()  # its thread fsynced the file after the last write
        except BaseException:
            self._discard()
            raise
        if self._pipe is not None:
            self._pipe.close()  # StorageError when the command failed
            return
        if not self._owned:
            self.stream.flush()
            return
        try:
            self.stream.flush()
            if not synced:
                os.fsync(self.stream.fileno())
        except BaseException:
            self._discard()
            raise
        self.stream.close()  # releases the lock: the data is complete
        if is_local(self.name):
            path = local_path(self.name)
            try:
                os.replace(cast(str, self._tmp), path)
            except BaseException:
                self._discard()
                raise
            self._tmp = None
            _fsync_directory(os.path.dirname(os.path.abspath(path)))
            return
        fs, path = filesystem(self.name, self.storage_options)
        try:
            fs.put_file(self._tmp, path)
        except Exception as exc:
            raise StorageError(f"upload failed: {exc}", url=self.name) from exc
        finally:
            self._discard()

    def _discard(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # its failure: the file is discarded
            self._wait_behind()
        with contextlib.suppress(OSError, ValueError):
            self.stream.close()
        if self._tmp:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None

    def abort(self) -> None:
        """Discard what was written: nothing appears under the final name."""
        if self.done:
            return
        self.done = True
        if self._pipe is not None:
            self._pipe.kill()
        elif self._owned:
            self._discard()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False
