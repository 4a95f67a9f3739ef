"""Dataset spec files: a YAML blend of sources (manifests, views, other specs, shard specs) with
weights, row subsets, repetitions and named splits, read as one planned mixture.

A spec (``train.yaml``)::

    sources:
      - {name: web, data: web/manifest.json, weight: 3}
      - {name: books, data: books/clean.view.json, weight: 1, subset: [0%, 80%]}
      - {name: code, data: "code/shard-{0000..0009}.tar", weight: 1, repeat: 2}
    stop: first            # optional: first (default) | all | cycle
    unit: samples          # optional: samples (default) | tokens (with cost: COLUMN)

or with named splits, each a blend of its own::

    splits:
      train: {sources: [...]}
      val:   {sources: [...]}

``WebDataset("train.yaml", readers=V).batched(B)`` (``split="val"`` with splits) is a
:func:`tarshards.mix` of the sources: exact quotas per batch, exact and elastic resume, and
``__source__`` (the source's name) on every sample. Each source entry:

- ``data`` (required): a manifest (``.json``), a view (``.view.json``), another spec (``.yaml``,
  nested: its sources become ``outer/inner``, weights multiply through), or a shard spec (a
  brace pattern, a URL, a list of them). Relative paths are taken from the spec file's folder.
- ``name``: ``__source__`` of its samples (default: the file's name without suffixes, or the
  folder's name for ``manifest.json``); unique within a blend.
- ``weight``: the source's share of every batch, relative to the others'. Give every source of
  a blend a weight or none: without weights the shares follow the sizes (each source's samples
  after subset and repeat), so an epoch reads every source ``repeat`` times, interleaved.
- ``subset: [lo%, hi%]``: rows ``[floor(n lo), floor(n hi))`` of the source in manifest order
  (``[0%, 80%]`` and ``[80%, 100%]`` are disjoint and cover it); numbers in ``[0, 1]`` are
  fractions. On a nested spec it applies to each of its sources.
- ``repeat``: passes of the source (each a new shuffle) before it counts as run out (``2``;
  ``0.5``: half a pass); on a nested spec it multiplies its sources' repeats.
- ``split``: the split of a nested spec to read (default: the split being read).

A source may be written as its ``data`` alone (``- web/manifest.json``), and a split as the list
of its sources (``val: [web/manifest.json]``). ``WebDataset``'s other options (``shuffle=``,
``shardshuffle=``, ``decoder=``, read and safety options) go to every source, and a
``.shuffle(n)`` put first on the mixture shuffles each source with its own buffer.

``stop`` says when the epoch ends (see :mod:`tarshards.plan.mixing`): ``first``, once a source
would go past its budget (samples after subset, times repeat); ``all``, once every source has
given its budget (those done start over); ``cycle``, after as many samples as the budgets
together. ``unit: tokens`` (with ``cost: COLUMN``, default ``tokens``: a per-sample metadata
column of every source's manifest) makes the weights shares of tokens rather than of samples
(:mod:`tarshards.plan.mixing`: each batch within one sample of them); every source then has a weight
and no ``repeat``. Only the opened spec's ``stop``, ``unit`` and ``cost`` count (a nested
spec's are not used).
"""

from __future__ import annotations

import math
import os
import posixpath
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Mapping

from ..errors import MissingDependencyError, ShardSpecError
from ..pipeline import stages as _stages
from ..pipeline.dataset import WebDataset
from ..plan.mixing import STOPS, MixedDataset
from ..read.specs import DATASET_SPEC_OPENERS, DATASET_SPEC_SUFFIXES, is_dataset_spec
from ..storage import is_local, local_path, open_url, url_protocol

__all__ = [
    "Blend",
    "BlendSource",
    "DatasetSpec",
    "SourceEntry",
    "open_spec",
    "parse_spec",
    "read_spec",
    "resolve_blend",
    "spec_info",
]

SPEC_KEYS = ("sources", "splits", "stop", "unit", "cost")
BLEND_KEYS = ("sources", "stop", "unit", "cost")
UNITS = ("samples", "tokens")
SOURCE_KEYS = ("name", "data", "weight", "subset", "repeat", "split")
VIEW_SUFFIX = ".view.json"


# ---------------------------------------------------------------------------------------------
# the spec as written (parsed and checked, nothing read but the file)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceEntry:
    """One entry of a blend's ``sources``, checked, its paths resolved.

    ``kind``: ``"manifest"``, ``"view"``, ``"spec"`` or ``"shards"``; ``data``: the path or URL
    (a tuple of them for a list of shard specs); ``where``: the entry named for messages
    (``train.yaml: splits.val.sources[1] (books)``)."""

    name: str
    data: str | tuple[str, ...]
    kind: str
    weight: Fraction | None = None
    subset: tuple[Fraction, Fraction] | None = None
    repeat: Fraction = Fraction(1)
    split: str | None = None
    where: str = ""


@dataclass(frozen=True)
class Blend:
    """The sources of one split (or of a spec without splits) and its stopping rule."""

    sources: tuple[SourceEntry, ...]
    stop: str = "first"
    unit: str = "samples"  # "tokens": the weights are shares of the metadata column ``cost``
    cost: str = "tokens"


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset spec file, read and checked (:func:`read_spec`): its blends by split name
    (``None``: a spec without splits)."""

    path: str
    blends: Mapping[str | None, Blend] = field(default_factory=dict)

    @property
    def splits(self) -> list[str]:
        """The split names (empty for a spec without splits)."""
        return [s for s in self.blends if s is not None]

    def blend(self, split: str | None = None) -> Blend:
        """The blend of ``split`` (``None``: the spec's only blend)."""
        if split is None:
            if None in self.blends:
                return self.blends[None]
            raise ValueError(
                f"{self.path} has splits {', '.join(self.splits)}: pass split= (e.g. "
                f"WebDataset({self.path!r}, split={self.splits[0]!r}))"
            )
        if split not in self.blends:
            if None in self.blends:
                raise ValueError(f"{self.path} has no splits (split={split!r} was asked for)")
            raise ValueError(
                f"{self.path} has no split {split!r} (its splits: {', '.join(self.splits)})"
            )
        return self.blends[split]


def _load_yaml(text: str, path: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise MissingDependencyError(
            f"reading the dataset spec {path} needs PyYAML: pip install 'tarshards[yaml]'"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ShardSpecError(f"{path}: not valid YAML: {exc}") from None


def _base_of(path: str) -> str:
    if is_local(path):
        return os.path.dirname(os.path.abspath(local_path(path)))
    return path.rsplit("/", 1)[0] + "/"


def _resolve(url: str, base: str) -> str:
    if url.startswith("@"):  # a list file: its path is taken from the spec's folder
        return "@" + _resolve(url[1:], base)
    if url_protocol(url) is not None or url.startswith(("/", "file:", "pipe:")) or url == "-":
        return url
    if url_protocol(base) is None:
        return os.path.normpath(os.path.join(base, os.path.expanduser(url)))
    return base.rstrip("/") + "/" + posixpath.normpath(url)


def read_spec(path, *, storage_options: dict | None = None) -> DatasetSpec:
    """Read and check the dataset spec file ``path`` (a local path or URL); its relative paths
    are resolved against its folder. Nothing it names is read (:func:`resolve_blend` does)."""
    path = os.fspath(path)
    if is_local(path) and not os.path.exists(local_path(path)):
        raise FileNotFoundError(f"no dataset spec at {path}")
    with open_url(path, storage_options=storage_options) as f:
        text = f.read().decode("utf-8")
    return parse_spec(_load_yaml(text, path), path)


def parse_spec(obj: Any, path: str) -> DatasetSpec:
    """Check a spec's parsed YAML (``obj``); ``path``: the file (for messages and relative
    paths)."""
    if not isinstance(obj, dict):
        raise ShardSpecError(
            f"{path}: a dataset spec is a mapping with 'sources:' (or 'splits:'), not "
            f"{type(obj).__name__}"
        )
    _no_unknown(obj, SPEC_KEYS, path, "the spec")
    base = _base_of(path)
    if ("sources" in obj) == ("splits" in obj):
        raise ShardSpecError(
            f"{path}: a dataset spec has either 'sources:' (one blend) or 'splits:' "
            "(a blend per split name), " + ("not both" if "sources" in obj else "found neither")
        )
    if "sources" in obj:
        return DatasetSpec(path, {None: _parse_blend(obj, path, base, "")})
    splits = obj["splits"]
    if not isinstance(splits, dict) or not splits:
        raise ShardSpecError(f"{path}: 'splits:' maps split names to blends ({{sources: [...]}})")
    for key in ("stop", "unit", "cost"):
        if key in obj:
            raise ShardSpecError(f"{path}: with splits, '{key}:' goes in each split")
    blends: dict[str | None, Blend] = {}
    for name, body in splits.items():
        where = f"splits.{name}"
        if isinstance(body, list):  # splits: {val: [sources...]}
            body = {"sources": body}
        if not isinstance(body, dict):
            raise ShardSpecError(f"{path}: {where} is a blend ({{sources: [...]}})")
        blends[str(name)] = _parse_blend(body, path, base, where + ".")
    return DatasetSpec(path, blends)


def _no_unknown(obj: dict, known: Iterable[str], path: str, what: str) -> None:
    unknown = [str(k) for k in obj if k not in known]
    if unknown:
        raise ShardSpecError(
            f"{path}: {what} has unknown key(s) {', '.join(map(repr, unknown))} (known: "
            f"{', '.join(known)})"
        )


def _parse_blend(obj: dict, path: str, base: str, prefix: str) -> Blend:
    _no_unknown(obj, BLEND_KEYS, path, prefix.rstrip(".") or "the spec")
    sources = obj.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ShardSpecError(f"{path}: {prefix}sources is a non-empty list of sources")
    stop = obj.get("stop", "first")
    if stop not in STOPS:
        raise ShardSpecError(f"{path}: {prefix}stop is one of {', '.join(STOPS)}, not {stop!r}")
    unit, cost = obj.get("unit", "samples"), obj.get("cost", "tokens")
    if unit not in UNITS:
        raise ShardSpecError(f"{path}: {prefix}unit is one of {', '.join(UNITS)}, not {unit!r}")
    if not isinstance(cost, str) or not cost:
        raise ShardSpecError(f"{path}: {prefix}cost names a metadata column, not {cost!r}")
    entries = [
        _parse_source(item, path, base, f"{prefix}sources[{i}]") for i, item in enumerate(sources)
    ]
    names = [e.name for e in entries]
    for name in names:
        if names.count(name) > 1:
            dup = [e.where for e in entries if e.name == name]
            raise ShardSpecError(
                f"{path}: two sources are named {name!r} ({', '.join(dup)}): give each a "
                "unique name"
            )
    weighted = [e.weight is not None for e in entries]
    if any(weighted) and not all(weighted):
        missing = [e.where for e in entries if e.weight is None]
        raise ShardSpecError(
            f"{path}: {', '.join(missing)} has no weight while others have one: weight every "
            "source of a blend, or none (then the shares follow the sizes)"
        )
    if unit == "tokens":
        if not all(weighted):
            raise ShardSpecError(
                f"{path}: {prefix}unit: tokens makes the weights shares of tokens: weight every "
                "source"
            )
        for e in entries:
            if e.repeat != 1:
                raise ShardSpecError(f"{e.where}: repeat counts passes of samples (unit: samples)")
    return Blend(tuple(entries), stop, unit, cost)


def _kind(data: str) -> str:
    low = data.lower()
    if low.endswith(VIEW_SUFFIX):
        return "view"
    if is_dataset_spec(data):
        return "spec"
    if low.endswith(".json") and "{" not in data and "::" not in data:
        return "manifest"
    return "shards"


def _default_name(data: str) -> str:
    tail = data.rstrip("/").replace("\\", "/").rsplit("/", 1)
    name = tail[-1]
    if name.lower() in ("manifest.json", "shardindex.json") and len(tail) > 1:
        name = tail[0].rsplit("/", 1)[-1]
    for suffix in (VIEW_SUFFIX, *DATASET_SPEC_SUFFIXES, ".json"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name.split("{", 1)[0].rstrip("-_.") or name


def _parse_source(item: Any, path: str, base: str, where: str) -> SourceEntry:
    if isinstance(item, str):  # a bare path: {data: path}
        item = {"data": item}
    if not isinstance(item, dict):
        raise ShardSpecError(f"{path}: {where} is a mapping ({{name, data, weight...}})")
    named = f"{where} ({item['name']})" if isinstance(item.get("name"), str) else where
    _no_unknown(item, SOURCE_KEYS, path, named)
    data = item.get("data")
    if isinstance(data, str) and data.strip():
        kind = _kind(data)
        resolved: str | tuple[str, ...] = "::".join(
            _resolve(p.strip(), base) for p in data.split("::") if p.strip()
        )
    elif isinstance(data, list) and data and all(isinstance(d, str) for d in data):
        kind = "shards"
        resolved = tuple(_resolve(d, base) for d in data)
    else:
        raise ShardSpecError(
            f"{path}: {named} needs 'data:': a manifest, a view (.view.json), a spec (.yaml) "
            "or a shard spec (a brace pattern or a list of URLs)"
        )
    name = item.get("name")
    if name is None:
        name = _default_name(data if isinstance(data, str) else data[0])
    if not isinstance(name, str) or not name or "/" in name:
        raise ShardSpecError(f"{path}: {named}: name is a non-empty string without '/'")
    named = f"{where} ({name})"
    weight = None
    if item.get("weight") is not None:
        weight = _number(item["weight"], path, named, "weight")
        if weight <= 0:
            raise ShardSpecError(f"{path}: {named}: weight must be positive, not {weight}")
    repeat = Fraction(1)
    if item.get("repeat") is not None:
        repeat = _number(item["repeat"], path, named, "repeat")
        if repeat <= 0:
            raise ShardSpecError(f"{path}: {named}: repeat must be positive, not {repeat}")
    subset = None
    if item.get("subset") is not None:
        subset = _subset(item["subset"], path, named)
    split = item.get("split")
    if split is not None and kind != "spec":
        raise ShardSpecError(f"{path}: {named}: split: selects a split of a nested spec (.yaml)")
    return SourceEntry(
        name=name,
        data=resolved,
        kind=kind,
        weight=weight,
        subset=subset,
        repeat=repeat,
        split=None if split is None else str(split),
        where=f"{path}: {named}",
    )


def _number(value: Any, path: str, where: str, what: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ShardSpecError(f"{path}: {where}: {what} is a number, not {value!r}")
    try:
        out = Fraction(str(value))
    except ValueError:
        raise ShardSpecError(f"{path}: {where}: {what} is a number, not {value!r}") from None
    return out


def _fraction(value: Any, path: str, where: str) -> Fraction:
    bad = ShardSpecError(
        f"{path}: {where}: subset is [lo%, hi%] (e.g. [0%, 80%]; or fractions [0, 0.8]), "
        f"{value!r} is not a bound"
    )
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return Fraction(value.strip()[:-1].strip()) / 100
        except ValueError:
            raise bad from None
    if isinstance(value, (int, float)):
        return Fraction(str(value))
    raise bad


def _subset(value: Any, path: str, where: str) -> tuple[Fraction, Fraction]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ShardSpecError(
            f"{path}: {where}: subset is [lo%, hi%] (two bounds, e.g. [0%, 80%]), not {value!r}"
        )
    lo, hi = (_fraction(v, path, where) for v in value)
    if not 0 <= lo < hi <= 1:
        raise ShardSpecError(
            f"{path}: {where}: subset {list(value)} is not a range 0% <= lo < hi <= 100%"
        )
    return lo, hi


# ---------------------------------------------------------------------------------------------
# the blend resolved: one planned source per leaf, with its share and budget
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlendSource:
    """One source of a resolved blend (nested specs flattened).

    ``name``: ``__source__`` (``outer/inner`` for a nested spec's source); ``share``: its part of
    every batch (the shares sum to 1); ``repeat``: passes per epoch (nested repeats multiplied);
    ``subset``: the rows ``[lo, hi)`` of ``samples`` read (``selected`` of them); ``nbytes``:
    the bytes of those rows where known; ``dataset``: the planned source read."""

    name: str
    kind: str
    data: str | tuple[str, ...]
    share: Fraction
    repeat: Fraction
    subset: tuple[Fraction, Fraction] | None
    samples: int
    selected: int
    nbytes: int | None
    weight: Fraction | None
    dataset: Any = field(repr=False, compare=False, default=None)

    @property
    def budget(self) -> int:
        """The samples it gives in an epoch before it counts as run out."""
        return math.floor(self.selected * self.repeat)


def _rows(n: int, subset: tuple[Fraction, Fraction] | None) -> tuple[int, int]:
    if subset is None:
        return 0, n
    lo, hi = subset
    return math.floor(n * lo), math.floor(n * hi)


def _compose(
    outer: tuple[Fraction, Fraction] | None, inner: tuple[Fraction, Fraction] | None
) -> tuple[Fraction, Fraction] | None:
    """``outer`` (a nested spec entry's subset) applied to the range ``inner`` selects."""
    if outer is None:
        return inner
    if inner is None:
        return outer
    span = inner[1] - inner[0]
    return inner[0] + span * outer[0], inner[0] + span * outer[1]


class _Resolver:
    def __init__(self, make: _Maker, storage_options: dict | None):
        self.make = make
        self.storage_options = storage_options
        self.stack: list[str] = []

    def blend(
        self,
        spec: DatasetSpec,
        split: str | None,
        subset: tuple[Fraction, Fraction] | None,
        prefix: str,
    ) -> tuple[list[BlendSource], Fraction]:
        """The leaves of ``spec``'s blend and the blend's size (samples an epoch reads under
        ``stop: first``, the size a weightless parent shares by)."""
        blend = spec.blend(split)
        parts: list[tuple[SourceEntry, list[BlendSource], Fraction]] = []
        for entry in blend.sources:
            if entry.kind == "spec":
                data = str(entry.data)
                key = os.path.abspath(data) if is_local(data) else data
                if key in self.stack:
                    raise ShardSpecError(
                        f"{entry.where}: the spec {data} includes itself "
                        f"({' -> '.join([*self.stack, key])})"
                    )
                nested = read_spec(data, storage_options=self.storage_options)
                inner_split = entry.split
                if inner_split is None:
                    if None in nested.blends:
                        pass
                    elif split in nested.blends:
                        inner_split = split
                    else:
                        raise ShardSpecError(
                            f"{entry.where}: the nested spec has splits "
                            f"{', '.join(nested.splits)}: say which with 'split:'"
                        )
                elif None in nested.blends:
                    raise ShardSpecError(f"{entry.where}: the nested spec has no splits")
                elif inner_split not in nested.blends:
                    raise ShardSpecError(
                        f"{entry.where}: the nested spec has no split {inner_split!r} "
                        f"(its splits: {', '.join(nested.splits)})"
                    )
                self.stack.append(key)
                try:
                    leaves, size = self.blend(
                        nested,
                        inner_split,
                        _compose(subset, entry.subset),
                        f"{prefix}{entry.name}/",
                    )
                finally:
                    self.stack.pop()
                leaves = [_replace(leaf, repeat=leaf.repeat * entry.repeat) for leaf in leaves]
                parts.append((entry, leaves, size * entry.repeat))
            else:
                leaf = self.leaf(entry, _compose(subset, entry.subset), prefix)
                parts.append((entry, [leaf], Fraction(leaf.budget)))
        weights = [e.weight if e.weight is not None else size for e, _, size in parts]
        total = sum(weights)
        if total <= 0:
            where = spec.path if split is None else f"{spec.path} (split {split})"
            raise ShardSpecError(f"{where}: its sources select no samples")
        out: list[BlendSource] = []
        for w, (_, leaves, _) in zip(weights, parts):
            out.extend(_replace(leaf, share=leaf.share * w / total) for leaf in leaves)
        epoch = min(
            (Fraction(leaf.budget) / leaf.share for leaf in out if leaf.share), default=Fraction(0)
        )
        return out, epoch

    def leaf(
        self, entry: SourceEntry, subset: tuple[Fraction, Fraction] | None, prefix: str
    ) -> BlendSource:
        ds = self.make(entry)
        table = ds.table
        n = table.num_samples
        lo, hi = _rows(n, subset)
        if hi <= lo:
            bounds = ", ".join(f"{float(b * 100):g}%" for b in subset or ())
            raise ShardSpecError(f"{entry.where}: subset [{bounds}] keeps none of its {n} samples")
        if subset is not None:
            ds = self.make.subset(ds, lo, hi, entry)
        return BlendSource(
            name=prefix + entry.name,
            kind=entry.kind,
            data=entry.data,
            share=Fraction(1),
            repeat=entry.repeat,
            subset=subset,
            samples=n,
            selected=hi - lo,
            nbytes=_row_bytes(ds),
            weight=entry.weight,
            dataset=ds,
        )


def _replace(leaf: BlendSource, **changes: Any) -> BlendSource:
    import dataclasses

    return dataclasses.replace(leaf, **changes)


class _Maker:
    """Makes the planned source (a ``WebDataset``) of a source entry: ``cls(data, *args,
    **options)``, and the subset of one."""

    def __init__(self, cls: type, args: tuple = (), options: dict | None = None):
        self.cls, self.args, self.options = cls, args, dict(options or {})

    def _new(self, entry: SourceEntry, data: Any, **more: Any) -> Any:
        try:
            return self.cls(data, *self.args, **self.options, **more)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{entry.where}: {exc}") from exc
        except ValueError as exc:
            raise ShardSpecError(f"{entry.where}: {exc}") from exc

    def __call__(self, entry: SourceEntry) -> Any:
        return self._new(entry, list(entry.data) if isinstance(entry.data, tuple) else entry.data)

    def subset(self, ds: Any, lo: int, hi: int, entry: SourceEntry) -> Any:
        """Rows ``[lo, hi)`` of ``ds`` in manifest order (of the rows it reads: a view's rows
        of rows), as a planned source over a :class:`~tarshards.format.selection.View`."""
        from ..format.selection import View

        base = ds.view if ds.view is not None else ds.manifest
        if base is None:  # shards without a manifest: the record their scan made
            base = ds.table.manifest
        return self._new(entry, View.from_positions(base, range(lo, hi)))


def _row_bytes(ds: Any) -> int | None:
    """The bytes of the rows ``ds`` reads: whole shards by their size, the rows a view keeps of
    a shard by its sample offsets (or in proportion to the rows)."""
    table = ds.table
    manifest = table.manifest
    sizes: list[int | None]
    if ds.manifest is not None:
        sizes = [r.nbytes for r in manifest.shards]
    else:
        sizes = [
            os.path.getsize(local_path(u))
            if is_local(u) and os.path.exists(local_path(u))
            else None
            for u in table.urls
        ]
    total = 0
    for i, size in enumerate(sizes):
        rows, n = table.selected_rows(i), table.base_counts[i]
        if rows is not None and len(rows) == 0:
            continue
        if size is None:
            return None
        if rows is None:
            total += size
            continue
        offs = table.sample_offsets(i)
        if offs is not None and len(offs) == n:
            ends = list(offs[1:]) + [size]
            total += sum(int(ends[r]) - int(offs[r]) for r in rows)
        else:
            total += size * len(rows) // n
    return total


def resolve_blend(
    spec,
    split: str | None = None,
    *,
    storage_options: dict | None = None,
    _make: _Maker | None = None,
) -> list[BlendSource]:
    """The sources of a spec's blend (nested specs flattened), each with its share of every
    batch, repeat, subset rows, sample and byte counts, and the planned source that reads it
    (``dataset``). ``spec``: a path or a :class:`DatasetSpec`."""
    if not isinstance(spec, DatasetSpec):
        spec = read_spec(spec, storage_options=storage_options)
    make = _make or _Maker(WebDataset, (), {"storage_options": storage_options})
    resolver = _Resolver(make, storage_options)
    resolver.stack.append(os.path.abspath(spec.path) if is_local(spec.path) else spec.path)
    leaves, _ = resolver.blend(spec, split, None, "")
    return leaves


# ---------------------------------------------------------------------------------------------
# WebDataset("train.yaml"): the planned mixture
# ---------------------------------------------------------------------------------------------

#: WebDataset options that do not apply to a spec's mixture, with what to do instead
_NOT_FOR_SPECS = {
    "remainder": "a mixture's epoch ends by the spec's stop: (first, all, cycle) or stop=",
    "nodesplitter": "a mixture is split over ranks by its plan (readers=V)",
    "workersplitter": "a mixture is split over workers by its plan (readers=V)",
    "resampled": "a mixture's epoch is planned; use repeat: in the spec",
    "manifest": "each source of the spec names its own data",
}


def _mixed_class(cls: type) -> type:
    """The mixture class that goes with the ``WebDataset`` class ``cls`` (the torch adapter's
    ``MixedDataset`` for ``tarshards.torch.WebDataset``)."""
    if any(c.__module__ == "tarshards.torch.adapter" for c in cls.__mro__):
        from ..torch import adapter as _torch

        return _torch.MixedDataset
    return MixedDataset


def open_spec(
    cls: type,
    path,
    *args: Any,
    split: str | None = None,
    seed: int = 0,
    stop: str | None = None,
    **options: Any,
) -> MixedDataset:
    """The planned mixture a dataset spec file describes: what ``WebDataset(path, ...)`` returns
    for a ``.yaml`` path (``cls``: the ``WebDataset`` class called).

    ``split``: the split to read (a spec with ``splits:``). ``readers``, ``rank``,
    ``world_size`` (or ``plan_options``): the mixture's plan; ``seed``; ``stop``: overrides the
    spec's. Every other argument (``shuffle=``, ``shardshuffle=``, ``decoder=``,
    ``extensions=``, read and safety options...) goes to each source's ``WebDataset``, so a
    shuffle buffer is per source (rebuilt from positions on resume)."""
    plan = options.pop("plan_options", None)
    planned = {
        k: options.pop(k, None) for k in ("readers", "rank", "world_size", "remainder", "equal")
    }
    if plan is not None:
        for k in ("readers", "rank", "world_size", "remainder", "nodesplitter", "workersplitter"):
            if getattr(plan, k) is not None:
                if k in planned:
                    planned[k] = getattr(plan, k)
                else:
                    options[k] = getattr(plan, k)
    if planned.pop("remainder") is not None:
        options["remainder"] = True
    planned.pop("equal")  # a mixture's batches are equal on every rank anyway
    for key, instead in _NOT_FOR_SPECS.items():
        if options.get(key) not in (None, False):
            raise ValueError(f"{key}= does not apply to the dataset spec {path}: {instead}")
        options.pop(key, None)
    storage_options = options.get("storage_options")
    if storage_options is None and options.get("read_options") is not None:
        storage_options = options["read_options"].storage_options
    spec = read_spec(path, storage_options=storage_options)
    blend = spec.blend(split)
    leaves = resolve_blend(
        spec,
        split,
        storage_options=storage_options,
        _make=_Maker(cls, args, dict(options, seed=seed)),
    )
    kw: dict[str, Any] = {
        "stop": stop or blend.stop,
        "seed": seed,
        "rank": planned["rank"],
        "world_size": planned["world_size"],
        "repeat": {leaf.name: float(leaf.repeat) for leaf in leaves if leaf.repeat != 1},
    }
    if blend.unit != "samples":  # weights that are shares of a metadata column (tokens)
        kw.update(unit=blend.unit, cost=blend.cost)
    if planned["readers"] is not None:
        kw["readers"] = planned["readers"]
    mixed = _mixed_class(cls)(
        {leaf.name: leaf.dataset for leaf in leaves},
        {leaf.name: float(leaf.share) for leaf in leaves},
        **kw,
    )
    mixed.dataset_spec = spec  # what it was read from
    mixed.spec_split = split
    return mixed


for _suffix in DATASET_SPEC_SUFFIXES:
    DATASET_SPEC_OPENERS[_suffix] = open_spec


# ---------------------------------------------------------------------------------------------
# tarshards info: what a spec (or a manifest, a view, shards) holds
# ---------------------------------------------------------------------------------------------


def _epoch_counts(leaves: list[BlendSource], stop: str) -> list[int]:
    """Samples of each source an epoch reads (one reader, batches of one: the ideal that
    ``readers=V`` and ``.batched(B)`` round to whole batches per reader)."""
    budgets = [leaf.budget for leaf in leaves]
    shares = [leaf.share for leaf in leaves]
    if stop == "cycle":
        total = Fraction(sum(budgets))
    elif stop == "all":
        total = max(Fraction(b) / s for b, s in zip(budgets, shares))
    else:
        total = min(Fraction(b) / s for b, s in zip(budgets, shares))
    return [math.floor(s * total) for s in shares]


def spec_info(
    source,
    *,
    split: str | None = None,
    readers: int | None = None,
    batch_size: int | None = None,
    storage_options: dict | None = None,
) -> dict:
    """What ``source`` holds, as a dict (``tarshards info --json``): for a dataset spec its
    sources (kind, data, samples, subset, selected samples and bytes, weight, repeat, share of
    every batch, samples an epoch) and totals; a manifest, a view or a shard spec is one
    source.

    The samples an epoch are those of one reader taking one sample at a time; with ``readers``
    and ``batch_size`` they are the exact counts of ``WebDataset(SPEC,
    readers=readers).batched(batch_size)``'s first epoch (each source's quota of whole batches
    on every reader), and ``"batches"`` says how many global batches that epoch has."""
    if (readers is None) != (batch_size is None):
        raise ValueError("give readers and batch_size together (the exact epoch of a plan)")
    if is_dataset_spec(source):
        spec = read_spec(source, storage_options=storage_options)
        if split is None and None not in spec.blends:
            return {
                "spec": spec.path,
                "splits": {
                    name: spec_info(
                        source,
                        split=name,
                        readers=readers,
                        batch_size=batch_size,
                        storage_options=storage_options,
                    )
                    for name in spec.splits
                },
            }
        blend = spec.blend(split)
        stop, unit, cost = blend.stop, blend.unit, blend.cost
        leaves = resolve_blend(spec, split, storage_options=storage_options)
        what = spec.path
    else:
        if split is not None:
            raise ValueError(f"split={split!r}: {source} is not a dataset spec with splits")
        data = os.fspath(source) if isinstance(source, os.PathLike) else source
        entry = SourceEntry(
            name=_default_name(data if isinstance(data, str) else str(data[0])),
            data=data if isinstance(data, str) else tuple(data),
            kind=_kind(data) if isinstance(data, str) else "shards",
            where=str(data),
        )
        make = _Maker(WebDataset, (), {"storage_options": storage_options})
        leaves = [_Resolver(make, storage_options).leaf(entry, None, "")]
        stop, unit, cost, what = "first", "samples", "tokens", str(data)
    # (by tokens, how many samples an epoch reads depends on the plan: known with readers)
    epoch: list[int | None] = (
        list(_epoch_counts(leaves, stop)) if unit == "samples" else [None] * len(leaves)
    )
    batches = None
    if readers is not None and batch_size is not None:
        mixed = MixedDataset(
            {leaf.name: leaf.dataset for leaf in leaves},
            {leaf.name: float(leaf.share) for leaf in leaves},
            readers=readers,
            stop=stop,
            repeat={leaf.name: float(leaf.repeat) for leaf in leaves},
            unit=unit,
            cost=cost,
        ).compose(_stages.batched, batch_size)
        counts = mixed.source_counts(epoch=0)
        epoch = [counts[leaf.name] for leaf in leaves]
        batches = mixed.steps_per_epoch(epoch=0, world_size=1)
    rows = []
    for leaf, n in zip(leaves, epoch):
        rows.append(
            {
                "name": leaf.name,
                "kind": leaf.kind,
                "data": leaf.data if isinstance(leaf.data, str) else list(leaf.data),
                "shards": sum(1 for c in leaf.dataset.table.counts if c),  # (read from)
                "samples": leaf.samples,
                "subset": None
                if leaf.subset is None
                else [f"{float(b * 100):g}%" for b in leaf.subset],
                "selected": leaf.selected,
                "bytes": leaf.nbytes,
                "weight": None if leaf.weight is None else float(leaf.weight),
                "repeat": float(leaf.repeat),
                "share": float(leaf.share),
                "epoch_samples": n,
            }
        )
    known = [r["bytes"] for r in rows]
    return {
        "spec": what,
        "split": split,
        "stop": stop,
        "unit": unit,
        "sources": rows,
        "samples": sum(r["selected"] for r in rows),
        "bytes": None if None in known else sum(known),
        "epoch_samples": None if None in epoch else sum(n or 0 for n in epoch),
        **(
            {}
            if batches is None
            else {"readers": readers, "batch_size": batch_size, "batches": batches}
        ),
    }
