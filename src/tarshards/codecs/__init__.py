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

from .._lazy import names_of

__getattr__ = names_of(
    "tarshards.codecs",
    "tarshards.codecs.registry",
    ["crop", "decoding", "images", "registry"],
)
