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
import re
from typing import Iterable

import braceexpand

from .errors import ShardNotFoundError, ShardSpecError
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


# ---- braces that do not expand; local shards that do not exist ----------------------------------

__all__ += ["check_local_shards", "missing_local_shards"]

# (braceexpand's stubs do not name it; a ValueError in every version)
_UNBALANCED: type[Exception] = getattr(braceexpand, "UnbalancedBracesError", ValueError)
_LEFT_BRACES = re.compile(r"(?<!\$)\{([^{}]*)\}")  # not ${VAR}: an environment variable


def _braces(part: str, check: bool = True) -> list[str]:
    """``braceexpand`` of one spec, its errors ours: unbalanced braces, and (``check``) braces
    left in a URL because they were neither a range ``{A..B}`` nor a list ``{a,b}`` (unless a
    local file has that very name)."""
    try:
        urls = list(braceexpand.braceexpand(part))
    except _UNBALANCED as exn:
        raise ShardSpecError(
            f"unbalanced braces in the shard spec {part!r}: every '{{' needs its '}}' (a range "
            "is written {000000..000003}, a list {train,val})"
        ) from exn
    if check:
        for url in urls:
            left = _LEFT_BRACES.search(url)
            if left is None or (is_local(url) and os.path.exists(local_path(url))):
                continue
            inner = left.group(1)
            if re.fullmatch(r"\w*\.{3,}\w*", inner):
                why = "a range has two dots ({A..B}), not three"
            elif re.fullmatch(r"\w*\.\w*", inner):
                why = "a range has two dots ({A..B}), not one"
            else:
                why = "it is neither a range {A..B} nor a list {a,b}"
            raise ShardSpecError(
                f"the braces {{{inner}}} in the shard spec {part!r} did not expand: {why} "
                f"(as written it names the one file {url!r})"
            )
    return urls


def missing_local_shards(urls: Iterable[str]) -> list[str]:
    """The local shards of ``urls`` that do not exist (one ``stat`` each; remote URLs, stdin
    and pipes are not looked at)."""
    missing = []
    for url in urls:
        if url == "-" or url.startswith("pipe:") or not is_local(url):
            continue
        if not os.path.exists(local_path(url)):
            missing.append(url)
    return missing


def check_local_shards(urls: Iterable[str], spec=None) -> None:
    """Raise :class:`~tarshards.errors.ShardNotFoundError` listing every local shard of
    ``urls`` that does not exist (before the first sample is read, not after the others)."""
    urls = list(urls)
    missing = missing_local_shards(urls)
    if not missing:
        return
    listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    named = f" named by {spec!r}" if isinstance(spec, str) else ""
    raise ShardNotFoundError(
        f"{len(missing)} of the {len(urls)} shards{named} do not exist: {listed}"
    )


def _expand_one(part: str, storage_options) -> list[str]:
    if part == "-":
        return [part]
    if part.startswith("pipe:"):  # as in webdataset: pipe:curl -s http://h/a-{000..009}.tar
        return _braces(part, check=False)
    if part.startswith("@"):
        return _read_list(part[1:], storage_options)
    if (
        part.lower().endswith(_LIST_SUFFIXES)
        and is_local(part)
        and os.path.isfile(local_path(part))
    ):
        return _read_list(part, storage_options)
    out = []
    for url in _braces(part):
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
