"""``tarshards browse``: a data set in a web browser, served from this machine.

:func:`serve` starts a small read-only web application (the standard library's HTTP server, plain
HTML, plots drawn as SVG on the server, no JavaScript, every asset in the package) over a manifest
or a shard spec: a paged grid of samples with image thumbnails, audio players and video poster
frames, a page per sample with every field's size, shard, offset and checksum, search by key
prefix, statistics, and a JSON API (``/api/sample/I``; a field's bytes with byte ranges, so a
player seeks). Everything is read through the index's random access, so page 1000 costs what page 1
does. See ``docs/browse.md``.

    with tarshards.web.serve("train.json") as server:
        print(server.url)
"""

from __future__ import annotations

from .data import BadRequest, BrowseData, NotFound, SampleInfo
from .server import CSP, BrowseApp, BrowseServer, is_loopback, serve

__all__ = [
    "CSP",
    "BadRequest",
    "BrowseApp",
    "BrowseData",
    "BrowseServer",
    "NotFound",
    "SampleInfo",
    "is_loopback",
    "serve",
]
