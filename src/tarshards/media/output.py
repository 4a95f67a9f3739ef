"""How decoded media leave the decoders: numpy arrays, or tensors where torch is present.

:mod:`tarshards.torch` (the only module that imports torch) registers the converter ``"tensor"``
(``torch.from_numpy``); the package declares it (:data:`OPTIONAL_MEDIA_CONVERTERS`), so the
decoders name no higher module. ``output="auto"`` gives tensors where torch is installed and
numpy arrays where it is not.
"""

from __future__ import annotations

from typing import Any, Callable

from .._lazy import OptionalEntries
from ..errors import MissingDependencyError

__all__ = ["OPTIONAL_MEDIA_CONVERTERS", "OUTPUTS", "media_converter", "register_media_converter"]

OUTPUTS = ("auto", "numpy", "torch")

_CONVERTERS: dict[str, Callable[[Any], Any]] = {}
OPTIONAL_MEDIA_CONVERTERS = OptionalEntries(
    "media output", "media.output.OPTIONAL_MEDIA_CONVERTERS"
)


def register_media_converter(name: str, fn: Callable[[Any], Any]) -> None:
    """Add (or replace) the converter ``name``: ``fn(numpy_array) -> value``."""
    _CONVERTERS[name] = fn


def _identity(x):
    return x


def media_converter(output: str) -> Callable[[Any], Any]:
    """The function that makes a decoder's value from a numpy array, for ``output`` ("auto":
    a tensor where torch is installed, else the array; "torch": a tensor or
    :class:`MissingDependencyError`; "numpy": the array)."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {', '.join(OUTPUTS)}, got {output!r}")
    if output == "numpy":
        return _identity
    fn = _CONVERTERS.get("tensor")
    if fn is not None:
        return fn
    try:
        OPTIONAL_MEDIA_CONVERTERS.load("tensor")
    except (MissingDependencyError, KeyError):
        if output == "torch":
            raise MissingDependencyError(
                "output='torch' needs torch: pip install 'tarshards[torch]' (or output='numpy')"
            ) from None
        return _identity
    return _CONVERTERS.get("tensor", _identity)
