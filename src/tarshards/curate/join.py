"""Joins of two data sets with different shard layouts, by key: :func:`join`.

``tarshards.join(left, right, on="__key__", how="inner", output="pairs/manifest.json")`` pairs
each left sample with the right sample whose key is the left's key (``on="__key__"``) or the
value of one of its fields (``on="img_key.txt"``: a text set naming images kept in another set).
Nothing is copied: the right side's key table (:class:`~tarshards.KeyIndex`, built beside the
output or given) finds each left row's right sample, and the output stores, per row of the join,
``(left row, right shard, right row)`` as an ``int32`` numpy array (12 bytes a row,
memory-mapped when read), beside a manifest that lists the left shards (the rows' order), the
right shards, and the two manifests it came from::

    {"format": "tarshards.manifest", ..., "shards": [...the left shards...],
     "base": {"manifest": "../captions/manifest.json", "checksum": "sha256:..."},
     "join": {"how": "inner", "on": "__key__", "prefix": "", "counts": [..rows per left shard..],
              "pointers": "manifest.pointers.npy", "identity": "...",
              "right": {"manifest": "../images/manifest.json", "checksum": "sha256:...",
                        "shards": [...the right shards, with their indexes...]}}}

Reading it (``WebDataset``, ``IndexedDataset``, ``readers=V`` plans and resume) streams the left
shards and reads each row's right sample by random access (nearby rows in one request). The
row's fields are the left's and the right's; the right's are renamed ``prefix + name``, and a
name that both sides hold is refused when the join is made (pass ``prefix="right."``: a right
``jpg`` becomes ``right.jpg``, which still decodes as a JPEG). ``how="inner"`` keeps the left
rows that found a right sample; ``how="left"`` keeps every left row (those without one have no
right fields).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import ShardFormatError, TarshardsError
from ..format.manifest import Manifest, as_manifest, resolve_url
from ..read.reading import shard_samples
from ..read.sidecar import layout_for
from ..storage import AtomicOutput
from .columns import moved_to, rel_url
from .keyindex import KeyIndex

__all__ = ["JOIN_HOWS", "join"]

JOIN_HOWS = ("inner", "left")


def join(
    left: Any,
    right: Any,
    *,
    on: str = "__key__",
    how: str = "inner",
    output: str | os.PathLike,
    prefix: str = "",
    keyindex: Any = None,
    engine: Any = "processes",
    workers: int | None = None,
    storage_options: dict | None = None,
) -> Manifest:
    """Join ``left`` and ``right`` (manifests: paths, URLs or :class:`~tarshards.Manifest`;
    the right one's shards need indexes) by key and write the join's manifest to ``output``
    (see the module docstring); returns it.

    ``on``: ``"__key__"`` (the left key is the right key) or a field of the left samples whose
    value (text) is a right key (the left shards are read for it; only the column group holding
    it where the left has sidecar columns). ``how``: ``"inner"`` or ``"left"``. ``prefix``:
    prepended to the right fields' names; a field name both sides hold is a ``ValueError``.
    ``keyindex``: the right side's :class:`~tarshards.KeyIndex` (or its path); by default one is
    built beside ``output`` (``OUTPUT.keys/``) on ``engine`` with ``workers`` and kept for the
    next join. A right key held twice is an error (:class:`~tarshards.errors.DuplicateKeyError`).
    """
    if how not in JOIN_HOWS:
        raise ValueError(f"how must be one of {', '.join(JOIN_HOWS)}, not {how!r}")
    if not isinstance(on, str) or not on:
        raise TypeError(f"on is '__key__' or a field name, not {on!r}")
    L = as_manifest(left, storage_options)
    R = as_manifest(right, storage_options)
    if L.join or R.join or R.columns:
        raise ValueError(
            "join takes a left manifest (with sidecar columns or not) and a plain right one"
        )
    if L.columns:
        raise ValueError(
            "the left side has sidecar columns: join its base manifest, then add the columns "
            "to the join with add_columns"
        )
    missing = [r.url for r in R.shards if r.index is None]
    if missing:
        raise ShardFormatError(
            f"the right side's shards need indexes (none for {missing[0]}): make them with "
            "tarshards index",
            url=R.url,
        )
    output = os.fspath(output)
    if any(m.url and os.path.abspath(m.url) == os.path.abspath(output) for m in (L, R)):
        raise ValueError("output= is one of the joined manifests: give the join another path")
    out_base = Manifest((), url=output).base
    if "://" not in output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if keyindex is None:
        ki_path = output + ".keys"
        try:
            ki = KeyIndex.open(ki_path, manifest=R)
        except (TarshardsError, OSError):  # none yet, or built from another right side
            ki = KeyIndex.build(
                R, ki_path, engine=engine, workers=workers, storage_options=storage_options
            )
    elif isinstance(keyindex, KeyIndex):
        ki = keyindex
    else:
        ki = KeyIndex.open(keyindex, manifest=R)
    _check_names(L, R, prefix, on)
    rows_l, shards_r, rows_r, counts = [], [], [], []
    for i in range(len(L.shards)):
        keys = _left_keys(L, i, on, storage_options)
        s, r = ki.lookup(keys)
        pick = np.arange(len(keys), dtype=np.int64)
        if how == "inner":
            pick = np.flatnonzero(s >= 0)
        rows_l.append(pick)
        shards_r.append(s[pick])
        rows_r.append(r[pick])
        counts.append(len(pick))
    if not sum(counts) and how == "inner":
        raise ValueError("the join is empty: no left row found its key on the right side")
    table = np.stack(
        [np.concatenate(rows_l), np.concatenate(shards_r), np.concatenate(rows_r)], axis=1
    ).astype(np.int32)
    digest = hashlib.sha256(table.tobytes()).hexdigest()
    pointers = output.rsplit(".json", 1)[0] + ".pointers.npy"
    with AtomicOutput(pointers, storage_options=storage_options) as out:
        np.save(out.stream, table, allow_pickle=False)
    right_moved = moved_to(R, out_base)
    identity = hashlib.sha256(
        json.dumps([R.fingerprint, digest, how, on, prefix]).encode()
    ).hexdigest()
    spec = {
        "how": how,
        "on": on,
        "prefix": prefix,
        "counts": counts,
        "pointers": rel_url(pointers, out_base),
        "identity": identity,
        "right": {
            "manifest": rel_url(R.url, out_base) if R.url else None,
            "checksum": R.checksum,
            "shards": [r.to_json() for r in right_moved.shards],
        },
    }
    moved = moved_to(L, out_base)
    base_ref = {"manifest": rel_url(L.url, out_base), "checksum": L.checksum} if L.url else None
    result = replace(moved, base_ref=base_ref, join=spec, url=None, _indexes={})
    return result.save(output, storage_options=storage_options)


def _left_keys(L: Manifest, i: int, on: str, storage_options) -> list[str]:
    """The right keys the rows of left shard ``i`` name."""
    if on == "__key__":
        return list(L.load_index(i).keys)
    layout = layout_for(L, [on], storage_options=storage_options)
    samples = (
        layout.iter_shard(i)
        if layout is not None
        else shard_samples(L.shard_urls()[i], storage_options=storage_options)
    )
    out = []
    for sample in samples:
        value = sample.get(on)
        if value is None:
            raise ShardFormatError(
                f"join(on={on!r}): sample {sample['__key__']!r} has no field {on!r}",
                url=sample.get("__url__"),
                offset=sample.get("__offset__"),
            )
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value).decode("utf-8")
        out.append(str(value).strip())
    return out


def _check_names(L: Manifest, R: Manifest, prefix: str, on: str) -> None:
    """A field name both sides hold (the right's with ``prefix``) is refused, from the fields
    their indexes list (no data read)."""

    def names(m: Manifest) -> set[str]:
        got: set[str] = set()
        for i, r in enumerate(m.shards):
            if r.index is not None:
                got.update(e.lower() for e in m.load_index(i).extensions)
        for g in m.columns:
            got.update(g.fields)
        return got

    clash = sorted(names(L) & {prefix + n for n in names(R)})
    if clash:
        raise ValueError(
            f"field(s) {', '.join(map(repr, clash))} on both sides of the join: pass "
            f"prefix='right.' (right fields renamed right.EXT) or another prefix"
        )


def pointers_of(manifest: Manifest):
    """The join's pointer table of a join manifest (rows of (left row, right shard, right
    row))."""
    from ..read.sidecar import load_pointers

    if not manifest.join:
        raise ValueError("not a join manifest")
    return load_pointers(resolve_url(manifest.join["pointers"], manifest.base))
