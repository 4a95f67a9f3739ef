"""Shard specs: the strings (and lists) that name a list of shards.

A *spec* is a string with brace ranges (``train-{0000..0147}.tgz``), several specs joined with
``::``, a glob over local or fsspec paths, a list of any of those, or a text file listing one
URL (or spec) per line (``@shards.txt``, or a local path ending in ``.txt``/``.shards``/``.list``).
A manifest (a ``.json`` path, or a :class:`~tarshards.manifest.Manifest`) names its shards too:
:func:`is_manifest_spec` tells it apart. List files and remote globs are read through
:mod:`tarshards.storage`, so this module sits just above it in the import order.
"""

from __future__ import annotations

import glob as _glob
import os
from typing import Iterable

import braceexpand

from .storage.open import open_url
from .storage.paths import filesystem, is_local, local_path, url_protocol

__all__ = ["expand_urls", "is_manifest_spec"]

_LIST_SUFFIXES = (".txt", ".shards", ".list")


def expand_urls(spec, *, storage_options: dict | None = None) -> list[str]:
    """Expand a shard spec into the list of URLs it names (order kept, no sorting of lists)."""
    if spec is None:
        raise ValueError("no shards given (urls=None)")
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        out = []
        for part in spec.split("::"):
            part = part.strip()
            if not part:
                continue
            out.extend(_expand_one(part, storage_options))
        return out
    if isinstance(spec, Iterable):
        out = []
        for item in spec:
            out.extend(expand_urls(item, storage_options=storage_options))
        return out
    raise TypeError(
        f"a shard spec is a string, a path or a list of them, not {type(spec).__name__}"
    )


def is_manifest_spec(spec) -> bool:
    """Whether ``spec`` names a manifest (a ``.json`` path or a Manifest) rather than shards."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        return "::" not in spec and "{" not in spec and spec.lower().endswith(".json")
    return type(spec).__name__ == "Manifest" and hasattr(spec, "shard_urls")


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _expand_one(part: str, storage_options) -> list[str]:
    if part == "-":
        return [part]
    if part.startswith("pipe:"):  # as in webdataset: pipe:curl -s http://h/a-{000..009}.tar
        return list(braceexpand.braceexpand(part))
    if part.startswith("@"):
        return _read_list(part[1:], storage_options)
    if (
        part.lower().endswith(_LIST_SUFFIXES)
        and is_local(part)
        and os.path.isfile(local_path(part))
    ):
        return _read_list(part, storage_options)
    out = []
    for url in braceexpand.braceexpand(part):
        if _has_glob(url):
            out.extend(_glob_url(url, storage_options))
        else:
            out.append(url)
    return out


def _read_list(path: str, storage_options) -> list[str]:
    with open_url(path, storage_options=storage_options) as f:
        text = f.read().decode("utf-8")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.extend(_expand_one(line, storage_options))
    return out


def _glob_url(url: str, storage_options) -> list[str]:
    if is_local(url):
        found = sorted(_glob.glob(local_path(url)))
    else:
        fs, _ = filesystem(url, storage_options)
        protocol = url_protocol(url)
        found = sorted(f"{protocol}://{p}" if "://" not in p else p for p in fs.glob(url))
    if not found:
        raise FileNotFoundError(f"no shard matches the pattern {url!r}")
    return found
