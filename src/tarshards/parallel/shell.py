"""Shell commands run on samples (``tarproc -c``, ``tarshards map -c``): :class:`ShellSampleFn`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from typing import Any

from ..errors import CommandError, DuplicateFieldError

__all__ = ["ShellSampleFn", "shell_sample_fn"]


class ShellSampleFn:
    """Run a shell command on one sample, with the semantics of ``tarproc -c``.

    The sample's fields are written to a fresh temporary directory as ``BASE.EXT`` files (``BASE``
    is the last path component of ``__key__``); the command runs there with ``$KEY`` set to the
    full key. The files present afterwards form the output sample under the same key: ``BASE.EXT``
    becomes field ``EXT``, any other file ``NAME`` becomes field ``NAME``; hidden files, ``__*``
    files and subdirectories are not collected. No file left: ``None`` (the sample is dropped).
    A non-zero exit status raises :class:`~tarshards.errors.CommandError` (a ``RuntimeError``)
    naming the key, the shard and the command's stderr.
    Instances pickle, so they run in worker processes and on Dask workers.
    """

    def __init__(
        self,
        cmd: str,
        *,
        timeout: float | None = None,
        env: dict | None = None,
        verbose: bool = False,
        tmpdir: str | None = None,
    ):
        if not isinstance(cmd, str) or not cmd.strip():
            raise ValueError("the shell command is an empty string")
        self.cmd = cmd
        self.timeout = timeout
        self.env = dict(env) if env else None
        self.verbose = verbose
        self.tmpdir = tmpdir

    def __repr__(self):
        return f"ShellSampleFn({self.cmd!r})"

    def __call__(self, sample: dict) -> dict | None:
        key = sample.get("__key__")
        if not isinstance(key, str) or not key:
            raise ValueError(f"a sample needs a string '__key__', got {key!r}")
        base = key.rpartition("/")[2]
        with tempfile.TemporaryDirectory(prefix="tarshards-sample-", dir=self.tmpdir) as tmp:
            for ext, value in sample.items():
                if ext.startswith("__"):
                    continue
                if isinstance(value, str):
                    value = value.encode("utf-8")
                if not isinstance(value, (bytes, bytearray, memoryview)):
                    raise TypeError(
                        f"field {ext!r} is a {type(value).__name__}; a shell command "
                        "gets raw bytes (do not decode the samples)"
                    )
                with open(os.path.join(tmp, f"{base}.{ext}"), "wb") as f:
                    f.write(value)
            env = dict(os.environ)
            if self.env:
                env.update(self.env)
            env["KEY"] = key
            proc = subprocess.run(
                self.cmd,
                shell=True,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.timeout,
            )
            if proc.returncode != 0:
                tail = proc.stderr.decode("utf-8", "replace").strip()[-500:]
                raise CommandError(
                    f"command exited with status {proc.returncode} on sample {key!r}: "
                    f"{self.cmd}" + (f": {tail}" if tail else ""),
                    status=proc.returncode,
                    stderr=proc.stderr,
                    url=sample.get("__url__"),
                )
            if self.verbose and (proc.stdout or proc.stderr):
                with contextlib.suppress(Exception):
                    sys.stderr.write((proc.stdout + proc.stderr).decode("utf-8", "replace"))
            out: dict = {"__key__": key}
            if "__url__" in sample:
                out["__url__"] = sample["__url__"]
            prefix = base + "."
            for name in sorted(os.listdir(tmp)):
                path = os.path.join(tmp, name)
                if name.startswith((".", "__")) or not os.path.isfile(path):
                    continue
                ext = name[len(prefix) :] if name.startswith(prefix) else name
                if not ext:
                    continue
                if ext in out:
                    raise DuplicateFieldError(
                        f"the command left two files for field {ext!r} in sample {key!r}",
                        url=sample.get("__url__"),
                        member=name,
                    )
                with open(path, "rb") as f:
                    out[ext] = f.read()
        if len(out) == (2 if "__url__" in out else 1):
            return None
        return out


def shell_sample_fn(cmd: str, **options: Any) -> ShellSampleFn:
    """A picklable ``fn(sample) -> sample`` running ``cmd`` on each sample (see ShellSampleFn)."""
    return ShellSampleFn(cmd, **options)
