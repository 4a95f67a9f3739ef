"""Turning member bytes into values and back.

``registry``  the codec registry (decode/encode by extension, optional codecs declared by name)
``images``    image decoding and modes, the JPEG fast paths
``crop``      random resized crops fused into JPEG decoding
``decoding``  the decode stage (and the fused ``decode`` + ``to_tuple`` pass)

Audio and video clips are :mod:`tarshards.media`.
"""

# The names of the module that ``tarshards.codecs`` was before the packages (``codecs.py``, now
# ``codecs/registry.py``) stay attributes of the package, imported on first use:
# ``from tarshards.codecs import X`` still works for them. Submodules are imported as such.

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = frozenset(["crop", "decoding", "images", "registry"])


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in _SUBMODULES:
        raise AttributeError(name)
    module = importlib.import_module("tarshards.codecs.registry")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'tarshards.codecs' has no attribute {name!r}") from None
