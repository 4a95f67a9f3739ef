"""What every command-line tool shares: options, error reporting, exit codes, inputs, progress.

Exit codes: 0 success, 1 data error (one line ``PROG: error: MESSAGE`` on stderr, the message
naming shard, member and offset), 2 usage error (click's own message). A closed stdout
(``tarscat big.tar | head -c 100``) ends the tool quietly with status 0.

The options that several tools take are defined here once (``inputs_argument``,
``output_option``, ``on_error_option``...), so each is spelled and explained the same everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from typing import (
    IO,
    Any,
    Callable,
    ClassVar,
    Generator,
    Iterable,
    Iterator,
    Literal,
    NoReturn,
    TypeVar,
)

import click

from ..errors import ShardFormatError, TarshardsError, TruncatedShardError
from ..format.names import parse_size as _parse_size
from ..read.specs import check_local_shards, expand_urls, is_manifest_spec
from ..storage import open_url

__all__ = [
    "CONTEXT_SETTINGS",
    "DataError",
    "ON_ERROR",
    "as_text",
    "SIZE",
    "Progress",
    "collect_inputs",
    "error_handler",
    "examples",
    "files_from_option",
    "handle_errors",
    "inputs_argument",
    "members_of",
    "on_error_option",
    "output_option",
    "parse_size",
    "print_err",
    "quiet_option",
    "read_samples",
    "shard_reader",
    "shuffle_options",
]

F = TypeVar("F", bound=Callable[..., Any])  # a command callback, decorated
T = TypeVar("T")

EPILOG_WIDTH = 100
CONTEXT_SETTINGS = {
    "help_option_names": ["-h", "--help"],
    "max_content_width": EPILOG_WIDTH,
    "terminal_width": EPILOG_WIDTH,
}


class DataError(click.ClickException):
    """A data or storage error: printed as one line ``PROG: error: MESSAGE``, exit status 1."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        ctx = click.get_current_context(silent=True)
        self.prog = ctx.command_path if ctx is not None else "tarshards"

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"{self.prog}: error: {self.format_message()}", file=file or sys.stderr)


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy, when imported inside this, loads OpenBLAS with one thread: the commands never
    call BLAS, and at load OpenBLAS starts a thread per core that spins for a while (measured:
    0.12-0.13 s of CPU per process on a 2-core host), taking a core from the hashing threads.
    A choice of the user's (``OPENBLAS_NUM_THREADS`` set) stands; the variable is removed again
    at once, so that processes the command starts inherit nothing."""
    key = "OPENBLAS_NUM_THREADS"
    if key in os.environ or "numpy" in sys.modules:
        yield
        return
    os.environ[key] = "1"
    try:
        yield
    finally:
        os.environ.pop(key, None)


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


def handle_errors(fn: F) -> F:
    """Decorator for command callbacks: data errors -> :class:`DataError`, EPIPE -> quiet exit."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            _quiet_exit_on_broken_pipe()
        except TarshardsError as exn:
            raise DataError(str(exn)) from None
        except (MemoryError, OverflowError) as exn:  # defensive: the reader should not raise these
            raise DataError(str(as_data_error(exn))) from None
        except OSError as exn:
            if isinstance(exn, BrokenPipeError) or getattr(exn, "errno", None) == 32:
                _quiet_exit_on_broken_pipe()
            where = f" ({exn.filename})" if getattr(exn, "filename", None) else ""
            raise DataError(f"{exn.strerror or exn}{where}") from None

    return wrapper  # type: ignore[return-value]  # functools.wraps: fn's signature


def as_data_error(exn: BaseException, url: str | None = None) -> TarshardsError:
    """A MemoryError/OverflowError out of the reader as a data error naming the shard."""
    if isinstance(exn, TarshardsError):
        return exn.with_context(url=url)
    return ShardFormatError(
        f"cannot read: {type(exn).__name__}{': ' if str(exn) else ''}{exn} "
        "(a member may declare an impossible size)",
        url=url,
    )


def examples(*lines: str) -> str:
    """An ``--help`` epilog listing example command lines (``\\b`` keeps click from rewrapping)."""
    return "\b\nExamples:\n" + "\n".join(f"  {ln}" for ln in lines)


# ---------------------------------------------------------------------------------------------
# the shared options
# ---------------------------------------------------------------------------------------------


class _OnErrorType(click.ParamType):
    """``raise`` or ``skip``; the older spellings (``abort``, ``fail``, ``warn``) still work."""

    name = "on-error"
    choices = ("raise", "skip")
    aliases: ClassVar[dict[str, str]] = {
        "abort": "raise",
        "fail": "raise",
        "stop": "raise",
        "warn": "skip",
    }

    def get_metavar(
        self, param: click.Parameter, *args: Any, **kwargs: Any
    ) -> str:  # click 8.2 adds ctx=
        return "[raise|skip]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        text = self.aliases.get(text, text)
        if text not in self.choices:
            self.fail(f"{value!r} is not one of 'raise', 'skip'", param, ctx)
        return text


ON_ERROR = _OnErrorType()


def on_error_option(what: str = "a bad shard", skip: str = "skip its rest") -> Callable[[F], F]:
    """``-e/--on-error raise|skip``: stop with the error (exit 1), or warn on stderr and go on.

    ``what`` names the error, ``skip`` what skipping it drops (both short: one help line)."""
    return click.option(
        "-e",
        "--on-error",
        type=ON_ERROR,
        default="raise",
        help=f"On {what}: stop (raise; default) or {skip} (skip).",
    )


def inputs_argument(fn: F) -> F:
    return click.argument("inputs", nargs=-1, metavar="[INPUTS]...")(fn)


def output_option(what: str = "file or URL") -> Callable[[F], F]:
    return click.option(
        "-o", "--output", default="-", show_default=True, help=f"Output {what}; - is stdout."
    )


def files_from_option(fn: F) -> F:
    return click.option(
        "-T",
        "--files-from",
        "listfile",
        default=None,
        metavar="FILE",
        help="Read input URLs from FILE, one per line.",
    )(fn)


def quiet_option(help: str = "No progress bar.") -> Callable[[F], F]:
    return click.option("-q", "--quiet", is_flag=True, help=help)


def shuffle_options(fn: F) -> F:
    fn = click.option(
        "--seed", type=int, default=0, show_default=True, help="Random seed for --shuffle."
    )(fn)
    return click.option(
        "--shuffle",
        type=click.IntRange(min=0),
        default=0,
        metavar="N",
        help="Shuffle with a buffer of N samples.",
    )(fn)


def count_option(verb: str = "Write", *names: str) -> Callable[[F], F]:
    return click.option(
        *(names or ("-c", "--count")),
        "count",
        type=click.IntRange(min=0),
        default=None,
        help=f"{verb} at most N samples.",
    )


def skip_option(fn: F) -> F:
    return click.option(
        "-s", "--skip", type=click.IntRange(min=0), default=0, help="Skip the first N samples."
    )(fn)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def error_handler(on_error: str, prog: str | None = None) -> Callable[[BaseException], bool]:
    """The handler for ``--on-error``: ``raise`` re-raises, ``skip`` warns on stderr, goes on."""
    if on_error == "raise":

        def reraise(exn: BaseException) -> NoReturn:
            raise exn

        return reraise
    if prog is None:
        ctx = click.get_current_context(silent=True)
        prog = ctx.command_path if ctx is not None else "tarshards"

    def skip(exn: BaseException) -> bool:
        from ..read.reading import skipped_rest  # here: the commands start faster

        lost = skipped_rest(exn) if isinstance(exn, TarshardsError) else None  # bytes, offset
        print_err(
            f"{prog}: warning: skipped the rest of a shard: {exn}" + (f" ({lost})" * bool(lost))
        )
        return True

    return skip


class _Counted:
    """A read stream that counts the bytes read through it (to tell a 0-byte input)."""

    def __init__(self, stream):
        self._stream = stream
        self.nbytes = 0
        for name in ("read", "read1"):
            if getattr(stream, name, None) is not None:
                setattr(self, name, self._reader(getattr(stream, name)))
        for name in ("readinto", "readinto1"):
            if getattr(stream, name, None) is not None:
                setattr(self, name, self._reader_into(getattr(stream, name)))

    def _reader(self, fn):
        def read(*args):
            data = fn(*args)
            self.nbytes += len(data)
            return data

        return read

    def _reader_into(self, fn):
        def readinto(buf):
            n = fn(buf)
            self.nbytes += n or 0
            return n

        return readinto

    def __getattr__(self, name):
        return getattr(self._stream, name)


def shard_reader(url: str) -> Generator[dict, None, None]:
    """The samples of one input, fields as raw bytes; every failure a TarshardsError naming it.

    An input of 0 bytes is an error (as for tar itself), not an empty dataset.
    """
    from ..pipeline.dataset import (
        shard_samples,
    )  # here: the commands that read no samples start faster

    counted = []

    @contextlib.contextmanager
    def opener(u):
        with open_url(u) as stream:
            c = _Counted(stream)
            counted.append(c)
            yield c

    try:
        yield from shard_samples(url, opener=opener)
    except (MemoryError, OverflowError) as exn:
        raise as_data_error(exn, url) from None
    if counted and counted[0].nbytes == 0:
        raise TruncatedShardError("empty input (0 bytes): not a tar archive", url=url, offset=0)


def read_samples(urls: Iterable[str], on_error: str = "raise") -> Generator[dict, None, None]:
    """Samples of ``urls`` in turn, fields as raw bytes; bad inputs as ``--on-error`` says."""
    handler = error_handler(on_error)
    for url in urls:
        try:
            yield from shard_reader(url)
        except TarshardsError as exn:
            if not handler(exn):
                return


# ---------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------


def parse_size(text: str | int | float) -> int:
    """A size given on the command line: :func:`tarshards.format.names.parse_size`, and not 0."""
    return _parse_size(text, positive=True)


class _SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except ValueError as exn:
            self.fail(str(exn), param, ctx)


SIZE = _SizeType()


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def collect_inputs(
    inputs: Iterable[str], listfile: str | None = None, *, exist: bool = True
) -> list[str]:
    """Expand brace specs, manifests and ``-T FILE`` lists into URLs; no input means stdin
    (``-``). With ``exist``, local shards that do not exist are listed (an error) before any is
    read."""
    urls: list[str] = []
    specs = list(inputs)
    if not specs and listfile is None:
        specs = ["-"]
    for spec in specs:
        if spec.lower().endswith(".view.json"):  # (tarscat and tarcheck take views)
            raise click.BadParameter(
                f"{spec} is a view (a selection of a data set's samples), and this command "
                f"reads whole shards: pipe the view's samples in (tarscat {spec} | ...)",
                param_hint="INPUTS",
            )
        try:
            if is_manifest_spec(spec):  # a manifest names its shards, as in Python
                from ..format.manifest import spec_urls  # here: no manifest, no import

                found = spec_urls(spec)
            else:
                found = expand_urls(spec)
        except (ValueError, FileNotFoundError) as exn:
            raise click.BadParameter(str(exn), param_hint="INPUTS") from None
        if not found:
            raise click.BadParameter(f"{spec!r} names no shards", param_hint="INPUTS")
        urls.extend(found)
    if listfile is not None:  # read as the spec "@FILE": one spec per line, "#" comments
        try:
            urls.extend(expand_urls("@" + listfile))
        except (TarshardsError, OSError, ValueError) as exn:
            raise DataError(f"cannot read the input list: {exn}") from None
    if urls.count("-") > 1:
        raise click.BadParameter("stdin ('-') can be read only once", param_hint="INPUTS")
    if exist:
        check_local_shards(urls, specs[0] if len(specs) == 1 else None)
    return urls


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def as_text(data: bytes) -> str | None:
    """The bytes as text when they are printable UTF-8, else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _CONTROL.search(text):
        return None
    return text


def members_of(sample: dict) -> list[tuple[str, bytes]]:
    """The raw ``(member name, bytes)`` of a sample, in the order they were read."""
    key = sample["__key__"]
    return [(f"{key}.{ext}", data) for ext, data in sample.items() if not ext.startswith("__")]


def output_dest(output: str) -> str | IO[bytes]:
    """What to give :class:`~tarshards.write.writer.TarWriter` for ``-o OUTPUT``.

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
        raise click.UsageError(
            "refusing to write a tar stream to a terminal; redirect stdout or use -o FILE"
        )


# ---------------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on stderr when stderr is a terminal and not ``--quiet``; otherwise nothing."""

    def __init__(self, quiet: bool, desc: str, unit: str = "samples", total: int | None = None):
        self.bar: Any = None  # a tqdm bar
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                desc=desc, unit=unit, total=total, file=sys.stderr, dynamic_ncols=True, leave=False
            )

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def wrap(self, items: Iterable[T]) -> Iterator[T]:
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

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False
