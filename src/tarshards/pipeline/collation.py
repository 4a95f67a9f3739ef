"""Collations for variable-length samples: packs in the layout of varlen attention kernels
(:func:`collate_packed`) and padded batches with masks (:func:`collate_padded`).

Both compute in numpy. Columns of another array type (``torch.Tensor``) come back as that type:
the type's module registers how to convert (:func:`register_array_type`; ``tarshards.torch``
does for torch, declared by name in the package so that this module never imports torch), and
``tensors="torch"`` asks for it whatever the input is.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .._lazy import LazyModule, OptionalEntries
from .stages import default_collation_fn

np = LazyModule("numpy", globals(), "np")

__all__ = ["collate_packed", "collate_padded", "register_array_type"]

# name -> (class, to numpy (None: not convertible), from numpy); the optional ones ("torch",
# "torch.Tensor") are declared in tarshards/__init__.py and registered by tarshards.torch
_TYPES: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}
OPTIONAL_ARRAY_TYPES = OptionalEntries("array type", "collation.OPTIONAL_ARRAY_TYPES")


def register_array_type(
    name: str, cls: type, to_numpy: Callable[[Any], Any], from_numpy: Callable[[Any], Any]
) -> None:
    """Columns of ``cls`` values (and ``tensors=name``) collate through numpy: ``to_numpy(x)``
    in, ``from_numpy(array)`` out."""
    entry = (cls, to_numpy, from_numpy)
    _TYPES[name] = entry
    _TYPES[f"{cls.__module__}.{cls.__qualname__}"] = entry


def _type_of(x) -> str | None:
    """The registered array type of ``x`` (``None``: numpy, a list, a number...)."""
    if isinstance(x, np.ndarray):
        return None
    for cls in type(x).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in _TYPES:
            return name
        if name in OPTIONAL_ARRAY_TYPES:
            OPTIONAL_ARRAY_TYPES.load(name)
            return name if name in _TYPES else None
    return None


def _converter(tensors: str | None, sample_value) -> Callable[[Any], Any]:
    name = tensors if tensors not in (None, "numpy", "np") else None
    if tensors is None:
        name = _type_of(sample_value)
    if name is None:
        return lambda a: a
    if name not in _TYPES:
        if name in OPTIONAL_ARRAY_TYPES:
            OPTIONAL_ARRAY_TYPES.load(name)
        if name not in _TYPES:
            raise ValueError(f"tensors= is 'numpy' or a registered array type, not {name!r}")
    return _TYPES[name][2]


def _as_array(x):
    name = _type_of(x)
    if name is not None:
        return _TYPES[name][1](x)
    return np.asarray(x)


def _field_of(sample, field):
    if isinstance(sample, dict):
        if field is None:
            found = [
                k
                for k, v in sample.items()
                if not k.startswith("__") and (hasattr(v, "shape") or isinstance(v, list))
            ]
            if len(found) != 1:
                raise ValueError(
                    "collate_packed: name the field that holds the tokens (field=...): the "
                    f"sample has {'these array fields: ' + ', '.join(found) if found else 'none'}"
                )
            field = found[0]
        return field, sample[field]
    if isinstance(sample, tuple):
        i = 0 if field is None else field
        if not isinstance(i, int):
            raise TypeError(f"a tuple sample's field is a position (int), not {field!r}")
        return i, sample[i]
    return None, sample


def collate_packed(
    packs_or_samples: Sequence,
    field: str | int | None = None,
    *,
    max_tokens: int | None = None,
    pad_to: int | None = None,
    pad_id: int = 0,
    tensors: str | None = None,
) -> dict:
    """Concatenate the token sequences of a pack (or of several) for varlen attention.

    ``packs_or_samples``: a pack (a list of samples, as ``.pack()`` yields) or a list of
    packs; a sample is a dict (``field``: the key of its tokens; left out, its one array
    field), a tuple (``field``: a position, default 0) or the token array itself. Returns a
    dict of ``tokens`` (the sequences one after the other, 1-D), ``cu_seqlens`` (int32, the
    offsets of the sequences' starts and of the end: ``[0, n0, n0 + n1, ...]``, as
    ``flash_attn_varlen_func`` takes), ``position_ids`` (int64, restarting at 0 in every
    sequence), ``max_seqlen`` (an int), ``mask`` (bool, False on padding) and, for dict
    samples, each other field as a list (``__key__``...).

    ``max_tokens``: cut every sequence to at most that many tokens (a pack of one oversize
    sample under ``.pack(oversize="truncate")``). ``pad_to``: pad each pack to that many tokens
    with ``pad_id`` (a fixed shape for compiled models); the padding is a sequence of its own in
    ``cu_seqlens`` (its positions count from 0) and ``False`` in ``mask``; with several packs the
    result reshapes to ``(packs, pad_to)``. Numpy arrays by default; torch tensors when the tokens
    are tensors or ``tensors="torch"``.
    """
    items = list(packs_or_samples)
    if items and isinstance(items[0], list) and not _is_token_list(items[0]):
        packs = [list(p) for p in items]
    else:
        packs = [items]
    samples = [x for p in packs for x in p]
    if not samples:
        raise ValueError("collate_packed: no samples")
    bounds = [len(p) for p in packs]  # sequences per pack
    first = samples[0]
    name, first_value = _field_of(first, field)
    if isinstance(first, (dict, tuple)):
        values = [x[name] for x in samples]
    else:
        values = samples
    if isinstance(first_value, np.ndarray):  # the common case, without a call per sample
        seqs = [v if v.ndim == 1 else v.reshape(-1) for v in values]
    else:
        seqs = [_as_array(v).reshape(-1) for v in values]
    if max_tokens is not None:
        seqs = [v[:max_tokens] for v in seqs]
    extra: dict[Any, list] = {}
    if isinstance(first, dict):
        for k in first:
            if k != name:
                extra[k] = [x.get(k) for x in samples]
    convert = _converter(tensors, first_value)
    dtype = np.result_type(*{s.dtype for s in seqs})
    seq_lengths = [len(v) for v in seqs]
    if pad_to is None:
        parts, lengths, real = seqs, seq_lengths, [True] * len(seqs)
    else:
        parts, lengths, real = [], [], []
        i = 0
        for n in bounds:
            used = sum(seq_lengths[i : i + n])
            parts += seqs[i : i + n]
            lengths += seq_lengths[i : i + n]
            real += [True] * n
            i += n
            if used > pad_to:
                raise ValueError(
                    f"a pack of {used} tokens does not fit pad_to={pad_to} (pass max_tokens= "
                    "to cut oversize sequences)"
                )
            if used < pad_to:
                parts.append(np.full(pad_to - used, pad_id, dtype=dtype))
                lengths.append(pad_to - used)
                real.append(False)
    tokens = np.concatenate(parts).astype(dtype, copy=False)
    lens = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    starts = np.repeat(cu[:-1].astype(np.int64), lens)
    position_ids = np.arange(len(tokens), dtype=np.int64) - starts
    mask = np.repeat(np.asarray(real, dtype=bool), lens)
    out: dict[str, Any] = {
        name if isinstance(name, str) else "tokens": convert(tokens),
        "cu_seqlens": convert(cu),
        "position_ids": convert(position_ids),
        "max_seqlen": int(lens.max()) if len(lens) else 0,
        "mask": convert(mask),
    }
    for k, v in extra.items():
        out.setdefault(k, v)
    return out


def _is_token_list(x: list) -> bool:
    """A list of numbers (one sample's tokens given as a list), not a pack of samples."""
    return bool(x) and isinstance(x[0], (int, np.integer))


def collate_padded(
    samples: Sequence,
    pad_value: Any = 0,
    *,
    fields: Sequence[str | int] | None = None,
    mask_axes: int = 1,
    multiple_of: int | None = None,
    tensors: str | None = None,
) -> Any:
    """Batch samples whose arrays differ in size: each array column padded with ``pad_value``
    to the largest size in the batch, with a boolean mask (True on real values).

    ``samples``: dicts (a padded field ``k`` comes with ``k + "_mask"``), tuples (the padded
    columns, then their masks in column order) or arrays (``(padded, mask)``). ``fields``: the
    columns to pad (default: every array column of one or more dimensions); the others are
    collated as :func:`tarshards.default_collation_fn` does. ``mask_axes``: the leading axes the
    mask covers (1: ``(B, T)`` for sequences, 2: ``(B, H, W)`` for images of different sizes).
    ``multiple_of``: round the padded sizes of those axes up to a multiple. Numpy arrays by
    default; torch tensors when the column holds tensors or ``tensors="torch"``.
    """
    rows = list(samples)
    if not rows:
        raise ValueError("collate_padded: no samples")
    first = rows[0]

    def padded(col: list):
        convert = _converter(tensors, col[0])
        arrs = [_as_array(v) for v in col]
        nd = arrs[0].ndim
        if any(a.ndim != nd for a in arrs):
            raise ValueError("collate_padded: arrays of one column have different dimensions")
        if nd < mask_axes:
            raise ValueError(f"collate_padded: {nd}-d arrays, mask_axes={mask_axes}")
        shape = [max(a.shape[d] for a in arrs) for d in range(nd)]
        if multiple_of:
            for d in range(mask_axes):
                shape[d] = -(-shape[d] // multiple_of) * multiple_of
        dtype = np.result_type(*[a.dtype for a in arrs])
        out = np.full((len(arrs), *shape), pad_value, dtype=dtype)
        mask = np.zeros((len(arrs), *shape[:mask_axes]), dtype=bool)
        for i, a in enumerate(arrs):
            out[(i,) + tuple(slice(0, n) for n in a.shape)] = a
            mask[(i,) + tuple(slice(0, n) for n in a.shape[:mask_axes])] = True
        return convert(out), convert(mask)

    def wanted(name, value) -> bool:
        if fields is not None:
            return name in fields
        return _type_of(value) is not None or (isinstance(value, np.ndarray) and value.ndim >= 1)

    if isinstance(first, dict):
        out: dict[str, Any] = {}
        for k in first:
            col = [s[k] for s in rows]
            if wanted(k, first[k]):
                out[k], out[f"{k}_mask"] = padded(col)
            else:
                out[k] = default_collation_fn(col)
        return out
    if isinstance(first, tuple):
        cols, masks = [], []
        for i, column in enumerate(zip(*rows)):
            if wanted(i, column[0]):
                arr, mask = padded(list(column))
                cols.append(arr)
                masks.append(mask)
            else:
                cols.append(default_collation_fn(list(column)))
        return (*cols, *masks)
    return padded(rows)
