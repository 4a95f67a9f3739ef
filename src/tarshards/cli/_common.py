"""What every command-line tool shares: error reporting, exit codes, input lists, output, progress.

Exit codes: 0 success, 1 data error (one line ``PROG: error: MESSAGE`` on stderr, the message
naming shard, member and offset), 2 usage error (click's own message). A closed stdout
(``tarscat big.tar | head -c 100``) ends the tool quietly with status 0.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Iterable, Iterator

import click

from ..errors import TarshardsError
from ..urls import expand_urls, open_url

__all__ = [
    "DataError",
    "SIZE",
    "Progress",
    "collect_inputs",
    "handle_errors",
    "members_of",
    "parse_size",
    "print_err",
]

EPILOG_WIDTH = 100
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": EPILOG_WIDTH,
                    "terminal_width": EPILOG_WIDTH}


class DataError(click.ClickException):
    """A data or storage error: printed as one line ``PROG: error: MESSAGE``, exit status 1."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        ctx = click.get_current_context(silent=True)
        self.prog = ctx.command_path if ctx is not None else "tarshards"

    def show(self, file=None) -> None:
        click.echo(f"{self.prog}: error: {self.format_message()}", file=file or sys.stderr)


def print_err(message: str) -> None:
    """A line on stderr (what the tool is doing, warnings)."""
    click.echo(message, file=sys.stderr)


def _quiet_exit_on_broken_pipe() -> None:
    # Python's documented recipe (library/signal.html, "Note on SIGPIPE"): point stdout at
    # devnull so the interpreter's final flush does not raise a second BrokenPipeError.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(0)


def handle_errors(fn):
    """Decorator for command callbacks: data errors -> :class:`DataError`, EPIPE -> quiet exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            _quiet_exit_on_broken_pipe()
        except TarshardsError as exn:
            raise DataError(str(exn)) from None
        except OSError as exn:
            if isinstance(exn, BrokenPipeError) or getattr(exn, "errno", None) == 32:
                _quiet_exit_on_broken_pipe()
            where = f" ({exn.filename})" if getattr(exn, "filename", None) else ""
            raise DataError(f"{exn.strerror or exn}{where}") from None

    return wrapper


# ---------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_size(text: str) -> int:
    """``1e9``, ``500M``, ``2G``, ``1.5GB``, ``64KiB`` -> bytes. Raises ValueError."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 1e9, 500M, 2G, 64KiB)")
    number, unit, suffix = m.groups()
    factor = _UNITS[unit.lower()]
    if suffix and suffix.lower() == "ib" and unit:
        factor = 1024 ** ("kmgt".index(unit.lower()) + 1)
    value = int(float(number) * factor)
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


class _SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return int(value)
        try:
            return parse_size(value)
        except ValueError as exn:
            self.fail(str(exn), param, ctx)


SIZE = _SizeType()


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def collect_inputs(inputs: Iterable[str], listfile: str | None = None) -> list[str]:
    """Expand brace specs and ``-T FILE`` lists into URLs; no input means stdin (``-``)."""
    urls: list[str] = []
    specs = list(inputs)
    if listfile is not None:
        try:
            with open_url(listfile) as f:
                text = f.read().decode("utf-8")
        except TarshardsError as exn:
            raise DataError(f"cannot read the input list: {exn}") from None
        specs += [ln.strip() for ln in text.splitlines()
                  if ln.strip() and not ln.strip().startswith("#")]
    if not specs:
        specs = ["-"]
    for spec in specs:
        try:
            found = expand_urls(spec)
        except (ValueError, FileNotFoundError) as exn:
            raise click.BadParameter(str(exn), param_hint="INPUTS") from None
        if not found:
            raise click.BadParameter(f"{spec!r} names no shards", param_hint="INPUTS")
        urls.extend(found)
    if urls.count("-") > 1:
        raise click.BadParameter("stdin ('-') can be read only once", param_hint="INPUTS")
    return urls


def members_of(sample: dict) -> list[tuple[str, bytes]]:
    """The raw ``(member name, bytes)`` of a sample, in the order they were read."""
    key = sample["__key__"]
    return [(f"{key}.{ext}", data) for ext, data in sample.items()
            if not ext.startswith("__")]


def output_dest(output: str):
    """What to give :class:`~tarshards.writer.TarWriter` for ``-o OUTPUT``.

    For stdout, a writer over file descriptor 1 with a 1 MiB buffer (Python's default 8 KiB
    means one pipe write per 8 KiB); anything else is passed on as it is.
    """
    if output != "-":
        return output
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced stdout (tests, notebooks)
        return "-"
    sys.stdout.flush()
    return open(fd, "wb", buffering=1 << 20, closefd=False)


def check_stdout_not_tty(output: str) -> None:
    if output == "-" and sys.stdout.isatty():
        raise click.UsageError("refusing to write a tar stream to a terminal; "
                               "redirect stdout or use -o FILE")


# ---------------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on stderr when stderr is a terminal and not ``--quiet``; otherwise nothing."""

    def __init__(self, quiet: bool, desc: str, unit: str = "samples", total=None):
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit=unit, total=total, file=sys.stderr,
                            dynamic_ncols=True, leave=False)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def wrap(self, items: Iterable) -> Iterator:
        if self.bar is None:
            yield from items
            return
        update = self.bar.update
        for item in items:
            update(1)
            yield item

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
