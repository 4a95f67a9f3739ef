"""Shard specs: the strings (and lists) that name a list of shards.

A *spec* is a string with brace ranges (``train-{0000..0147}.tgz``), several specs joined with
``::``, a glob over local or fsspec paths, a list of any of those, or a text file listing one
URL (or spec) per line (``@shards.txt``, or a local path ending in ``.txt``/``.shards``/``.list``).
A manifest (a ``.json`` path, or a :class:`~tarshards.format.manifest.Manifest`) names its shards
too: :func:`is_manifest_spec` tells it apart. List files and remote globs are read through
:mod:`tarshards.storage`, so this module sits just above it in the import order.

A directory (a local one, or a URL ending in ``/``) names the shards in it
(:func:`directory_shards`): files with a shard suffix, sorted, not recursive; sidecars (indexes,
manifests, ``.nv-meta/``) are left out. A folder that Megatron-Energon prepared
(``.nv-meta/split.yaml``) names the shards of its split parts, and ``split="train"`` (or
``"val"``, ``"test"``) one part.
"""

from __future__ import annotations

import glob as _glob
import os
import re
from typing import Any, Callable, Iterable

import braceexpand

from .._lazy import OptionalEntries
from ..errors import ShardNotFoundError, ShardSpecError
from ..storage.open import open_url
from ..storage.paths import filesystem, is_local, local_path, url_protocol

__all__ = ["directory_shards", "expand_urls", "is_manifest_spec"]

_LIST_SUFFIXES = (".txt", ".shards", ".list")


def expand_urls(
    spec, *, storage_options: dict | None = None, split: str | None = None
) -> list[str]:
    """Expand a shard spec into the list of URLs it names (order kept, no sorting of lists).

    A directory stands for its shards (:func:`directory_shards`; ``split``: a part of an
    Energon-prepared folder)."""
    if split is not None or _may_hold_directory(spec):
        return _with_directories(_expand(spec, storage_options), storage_options, split, spec)
    return _expand(spec, storage_options)


def _expand(spec, storage_options) -> list[str]:
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
            out.extend(_expand(item, storage_options))
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
    return type(spec).__name__ in ("Manifest", "View") and hasattr(spec, "shard_urls")


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


# ---------------------------------------------------------------------------------------------
# directories
# ---------------------------------------------------------------------------------------------

# the suffixes of shard files in a directory (plain tar and the compressions tarshards reads)
SHARD_SUFFIXES = (
    ".tar",
    ".tgz",
    ".tar.gz",
    ".tar.zst",
    ".tzst",
    ".tar.bz2",
    ".tbz2",
    ".tbz",
    ".tar.xz",
    ".txz",
    ".tar.lz4",
    ".tlz4",
)
ENERGON_META = ".nv-meta"
SPLIT_PARTS = ("train", "val", "test")


def _may_hold_directory(spec) -> bool:
    """Whether a spec may name a directory (cheap: one name without a shard suffix, or a
    trailing slash, is looked at; lists of shard files are not)."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        return any(
            _dir_candidate(p.strip()) for p in spec.split("::") if p.strip() and "{" not in p
        )
    if isinstance(spec, (list, tuple)):
        return any(_may_hold_directory(item) for item in spec)
    return False


def _dir_candidate(url: str) -> bool:
    if url == "-" or url.startswith(("pipe:", "@")) or _has_glob(url):
        return False
    return url.endswith("/") or not url.lower().endswith(SHARD_SUFFIXES + _LIST_SUFFIXES)


def _is_directory(url: str, storage_options) -> bool:
    if is_local(url):
        return os.path.isdir(local_path(url))
    if not url.endswith("/"):  # a remote directory is named with its trailing slash
        return False
    fs, path = filesystem(url, storage_options)
    return bool(fs.isdir(path))


def _with_directories(urls: list[str], storage_options, split, spec) -> list[str]:
    out: list[str] = []
    dirs = 0
    for url in urls:
        if _dir_candidate(url) and _is_directory(url, storage_options):
            dirs += 1
            out.extend(directory_shards(url, split=split, storage_options=storage_options))
        else:
            out.append(url)
    if split is not None and not dirs:
        raise ValueError(
            f"split={split!r} selects a part of a directory that Megatron-Energon prepared "
            f"(.nv-meta/split.yaml); the spec {spec!r} names no directory"
        )
    return out


def directory_shards(
    url: str, *, split: str | None = None, storage_options: dict | None = None
) -> list[str]:
    """The shards a directory holds: its files with a shard suffix (``.tar``, ``.tgz``,
    ``.tar.zst``...), sorted by name, not recursive; index files, manifests and other sidecars
    are left out. Where ``.nv-meta/split.yaml`` exists (Megatron-Energon's ``energon
    prepare``), the shards of its ``split_parts`` (``train``, then ``val``, then ``test``, and
    any other part, less ``exclude``), or with ``split`` the shards of that part only. Without
    a ``split.yaml``, ``split`` raises ``ValueError``."""
    base = url.rstrip("/") or "/"
    meta = _read_split_yaml(base, storage_options)
    if meta is not None:
        return _split_shards(base, meta, split)
    if split is not None:
        raise ValueError(
            f"split={split!r}: the directory {url!r} has no {ENERGON_META}/split.yaml "
            "(an Energon-prepared folder) to say which shards that part holds"
        )
    if is_local(base):
        root = local_path(base)
        names = sorted(
            n
            for n in os.listdir(root)
            if n.lower().endswith(SHARD_SUFFIXES)
            and not n.startswith(".")
            and os.path.isfile(os.path.join(root, n))
        )
        found = [os.path.join(base, n) for n in names]
    else:
        fs, path = filesystem(base, storage_options)
        protocol = url_protocol(base)
        found = []
        for info in fs.ls(path, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if (
                info.get("type") != "directory"
                and name.lower().endswith(SHARD_SUFFIXES)
                and not name.startswith(".")
            ):
                found.append(f"{base}/{name}" if protocol else info["name"])
        found.sort()
    if not found:
        raise FileNotFoundError(
            f"the directory {url!r} holds no shards (files ending in "
            f"{', '.join(SHARD_SUFFIXES[:4])}...)"
        )
    return found


def _read_split_yaml(base: str, storage_options) -> dict | None:
    path = f"{base}/{ENERGON_META}/split.yaml"
    if is_local(base):
        if not os.path.isfile(local_path(path)):
            return None
    else:
        fs, fpath = filesystem(path, storage_options)
        if not fs.exists(fpath):
            return None
    with open_url(path, storage_options=storage_options) as f:
        text = f.read().decode("utf-8")
    meta = _load_yaml(text, path)
    if not isinstance(meta, dict) or not isinstance(meta.get("split_parts"), dict):
        raise ValueError(f"{path}: no split_parts mapping (is it Megatron-Energon's split.yaml?)")
    return meta


def _split_shards(base: str, meta: dict, split: str | None) -> list[str]:
    parts = meta["split_parts"]
    if split is not None:
        if split not in parts:
            raise ValueError(
                f"split={split!r} is not a part of {base}/{ENERGON_META}/split.yaml "
                f"(its parts: {', '.join(map(str, parts))})"
            )
        chosen = [split]
    else:
        chosen = [p for p in SPLIT_PARTS if p in parts] + [p for p in parts if p not in SPLIT_PARTS]
    exclude = {
        name for pattern in meta.get("exclude") or () for name in braceexpand.braceexpand(pattern)
    }
    out: list[str] = []
    seen: set[str] = set()
    for part in chosen:
        for pattern in parts[part] or ():
            for name in braceexpand.braceexpand(str(pattern)):
                if name in exclude or name in seen:
                    continue
                seen.add(name)
                out.append(f"{base}/{name}")
    return out


def _load_yaml(text: str, where: str):
    """YAML through PyYAML where installed; else the block mappings and lists of strings that
    ``energon prepare`` writes (``key:``, ``- item``, ``[]``), which is all split.yaml holds."""
    try:
        import yaml
    except ImportError:
        return _mini_yaml(text, where)
    return yaml.safe_load(text)


def _mini_yaml(text: str, where: str) -> dict:
    root: dict = {}
    stack: list[tuple[int, dict]] = [(-1, root)]
    last_key: tuple[dict, str] | None = None
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        item = line.strip()
        if item.startswith("- "):
            if last_key is None:
                raise ValueError(
                    f"{where}: cannot read this YAML without PyYAML (pip install pyyaml)"
                )
            owner, key = last_key
            if not isinstance(owner[key], list):
                owner[key] = []
            owner[key].append(_scalar(item[2:]))
            continue
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"{where}: cannot read this YAML without PyYAML (pip install pyyaml)")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        owner = stack[-1][1]
        key = _scalar(key)
        value = value.strip()
        if value == "[]":
            owner[key] = []
        elif value in ("", "{}"):
            owner[key] = {}
            stack.append((indent, owner[key]))
        else:
            owner[key] = _scalar(value)
        last_key = (owner, key)
    return root


def _scalar(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


# ---- dataset spec files: a YAML blend of sources, opened by tarshards.curate.spec ---------------

__all__ += ["DATASET_SPEC_OPENERS", "is_dataset_spec", "open_dataset_spec"]

DATASET_SPEC_SUFFIXES = (".yaml", ".yml")
#: suffix -> ``opener(cls, path, *args, **options)``: the dataset ``cls(path, ...)`` stands for
#: (``cls``: the ``WebDataset`` class called); filled by the module that implements it when it is
#: imported, which :data:`OPTIONAL_DATASET_SPECS` does on first use (the package declares it)
DATASET_SPEC_OPENERS: dict[str, Callable[..., Any]] = {}
OPTIONAL_DATASET_SPECS = OptionalEntries("dataset spec", "specs.OPTIONAL_DATASET_SPECS")


def is_dataset_spec(spec) -> bool:
    """Whether ``spec`` names a dataset spec file (a ``.yaml``/``.yml`` path or URL: sources,
    weights, subsets, splits; see :mod:`tarshards.curate.spec`) rather than shards."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    return (
        isinstance(spec, str)
        and "::" not in spec
        and "{" not in spec
        and spec.lower().endswith(DATASET_SPEC_SUFFIXES)
    )


def open_dataset_spec(cls, spec, *args, **options):
    """The dataset that ``cls(spec, *args, **options)`` stands for when ``spec`` is a dataset
    spec file (:func:`is_dataset_spec`)."""
    suffix = os.path.splitext(os.fspath(spec))[1].lower()
    if suffix not in DATASET_SPEC_OPENERS and suffix in OPTIONAL_DATASET_SPECS:
        OPTIONAL_DATASET_SPECS.load(suffix)
    if suffix not in DATASET_SPEC_OPENERS:
        raise ShardSpecError(f"no reader of dataset spec files ending in {suffix!r}")
    return DATASET_SPEC_OPENERS[suffix](cls, spec, *args, **options)
