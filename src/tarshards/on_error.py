"""The one error policy: what a stage, a pipeline or a map does when one sample or shard fails.

``on_error`` is one of

* ``"raise"`` (the default): raise the error;
* ``"skip"``: skip the sample (or the rest of the shard) when the error is a *data error*;
* ``"warn"``: the same, with one :class:`~tarshards.errors.TarshardsWarning` per error naming
  shard, member and offset;
* a callable ``f(exn) -> bool``: called with *every* exception (data error or not); True skips
  the sample, False ends the stream, raising raises. webdataset's handler functions
  (:func:`reraise_exception`, :func:`warn_and_continue`, :func:`ignore_and_continue`,
  :func:`warn_and_stop`, :func:`ignore_and_stop`) are such callables, so code written for
  webdataset's ``handler=`` keeps working.

A data error is a :class:`~tarshards.errors.TarshardsError` about the data (a corrupt shard, a
missing field, undecodable bytes, an unreachable URL), not a set-up problem (a missing optional
package, ``pipe:`` not allowed, an unsafe codec not opted in) and not an exception from user code
(a bug in a ``map`` function is raised unless a callable ``on_error`` decides otherwise).

Ending a stream is never silent: when a callable returns False, a warning says which error ended
the stream (``ignore_and_stop`` included; ``warn_and_stop`` warns itself). Nothing here sleeps.
"""

from __future__ import annotations

import warnings
from typing import Callable, Literal, Union

from .errors import (
    DecodeError,
    MissingDependencyError,
    PipeNotAllowedError,
    TarshardsError,
    TarshardsWarning,
    UnsafeCodecError,
)

__all__ = [
    "ON_ERROR_MODES",
    "ErrorPolicy",
    "OnError",
    "error_policy",
    "ignore_and_continue",
    "ignore_and_stop",
    "is_data_error",
    "reraise_exception",
    "sample_context",
    "warn_and_continue",
    "warn_and_stop",
]

ON_ERROR_MODES = ("raise", "skip", "warn")
OnError = Union[Literal["raise", "skip", "warn"], Callable[[BaseException], bool], "ErrorPolicy"]

# errors of set-up, not of data: skipping them would silently skip every sample
_SETUP_ERRORS = (MissingDependencyError, PipeNotAllowedError, UnsafeCodecError)


def is_data_error(exn: BaseException) -> bool:
    """Whether ``exn`` is about the data (what ``on_error="skip"``/``"warn"`` skip)."""
    return isinstance(exn, TarshardsError) and not isinstance(exn, _SETUP_ERRORS)


def describe(exn: BaseException) -> str:
    """One line for a warning or a report: our errors as they are, others with their type."""
    text = str(exn)
    if not isinstance(exn, TarshardsError):
        text = f"{type(exn).__name__}: {text}"
    notes = getattr(exn, "__notes__", None)
    return f"{text} ({'; '.join(str(n) for n in notes)})" if notes else text


# ---------------------------------------------------------------------------------------------
# webdataset's handler functions (exn -> bool), accepted as ``on_error`` callables
# ---------------------------------------------------------------------------------------------


def reraise_exception(exn: BaseException) -> bool:
    """Handler: raise the exception (``on_error="raise"``)."""
    raise exn


def warn_and_continue(exn: BaseException) -> bool:
    """Handler: warn (naming shard, member and offset when known) and go on."""
    warnings.warn(f"skipped: {describe(exn)}", TarshardsWarning, stacklevel=2)
    return True


def ignore_and_continue(exn: BaseException) -> bool:
    """Handler: go on silently."""
    return True


def warn_and_stop(exn: BaseException) -> bool:
    """Handler: warn and end the stream."""
    warnings.warn(f"stopping: {describe(exn)}", TarshardsWarning, stacklevel=2)
    return False


def ignore_and_stop(exn: BaseException) -> bool:
    """Handler: end the stream. The stage that stops still warns once: tarshards never ends a
    stream silently."""
    return False


class ErrorPolicy:
    """``on_error`` resolved once: calling it with an exception returns True (skip), returns
    False (stop; a warning has been issued) or raises."""

    __slots__ = ("_fn", "mode")

    def __init__(self, mode: str, fn: Callable[[BaseException], bool] | None = None):
        self.mode = mode  # "raise", "skip", "warn" or "callable"
        self._fn = fn

    def __call__(self, exn: BaseException) -> bool:
        mode = self.mode
        if mode == "raise":
            raise exn
        fn = self._fn
        if fn is not None:  # a callable decides, for every exception
            if fn(exn):
                return True
            if fn is not warn_and_stop:
                warnings.warn(
                    f"stopping the stream: the error handler "
                    f"{getattr(fn, '__name__', fn)!s} ended it after "
                    f"{describe(exn)}",
                    TarshardsWarning,
                    stacklevel=3,
                )
            return False
        if not is_data_error(exn):
            raise exn
        if mode == "warn":
            warnings.warn(f"skipped: {describe(exn)}", TarshardsWarning, stacklevel=3)
        return True

    def observed(self, observe: Callable[[BaseException], object]) -> ErrorPolicy:
        """This policy, calling ``observe(exn)`` first (to count or keep what it sees)."""
        return _ObservedPolicy(self, observe)

    def __repr__(self):
        if self.mode == "callable":
            return f"ErrorPolicy({getattr(self._fn, '__name__', self._fn)})"
        return f"ErrorPolicy({self.mode!r})"

    def __reduce__(self):  # picklable for worker processes (module-level handlers)
        return (ErrorPolicy, (self.mode, self._fn))


class _ObservedPolicy(ErrorPolicy):
    __slots__ = ("_inner", "_observe")

    def __init__(self, inner: ErrorPolicy, observe: Callable[[BaseException], object]):
        super().__init__(inner.mode, inner._fn)
        self._inner = inner
        self._observe = observe

    def __call__(self, exn: BaseException) -> bool:
        self._observe(exn)
        return self._inner(exn)


_RAISE = ErrorPolicy("raise")


def error_policy(on_error: OnError | None = None, handler: Callable | None = None) -> ErrorPolicy:
    """The :class:`ErrorPolicy` for an ``on_error=`` value (or the older ``handler=``; give at
    most one). ``None`` for both means ``"raise"``."""
    if handler is not None:
        if on_error not in (None, "raise", handler):
            raise TypeError("give on_error= or handler= (its older name), not both")
        on_error = handler
    if on_error is None or on_error is reraise_exception:
        return _RAISE
    if isinstance(on_error, ErrorPolicy):
        return on_error
    if isinstance(on_error, str):
        if on_error not in ON_ERROR_MODES:
            raise ValueError(
                f"on_error must be one of {', '.join(map(repr, ON_ERROR_MODES))} or "
                f"a function exn -> bool, not {on_error!r}"
            )
        return _RAISE if on_error == "raise" else ErrorPolicy(on_error)
    if callable(on_error):
        return ErrorPolicy("callable", on_error)
    raise TypeError(f"on_error must be 'raise', 'skip', 'warn' or a function, not {on_error!r}")


def sample_context(exn: Exception, sample, field=None, wrap: bool = False) -> Exception:
    """Attach the sample's shard URL and member name to an error.

    Our own errors get the context as attributes; with ``wrap`` (decoding) other errors become a
    :class:`DecodeError` caused by them; otherwise they keep their type and get a note.
    """
    if not isinstance(sample, dict):
        return exn
    url = sample.get("__url__")
    key = sample.get("__key__")
    member = f"{key}.{field}" if (key is not None and field) else key
    offset = sample.get("__offset__") if field else None  # where the sample starts
    if isinstance(exn, TarshardsError):
        return exn.with_context(url=url, member=member, offset=offset)
    if wrap:
        wrapped = DecodeError(f"{type(exn).__name__}: {exn}", url=url, member=member, offset=offset)
        wrapped.__cause__ = exn
        return wrapped
    if hasattr(exn, "add_note"):
        exn.add_note(f"in sample {key!r} of shard {url}")
    return exn
