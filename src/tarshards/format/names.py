"""The WebDataset format rules, in one place.

A shard is a tar archive; members whose names share a *key* and sit next to each other form one
*sample*. For ``dir/n03788365_17158.seg.png`` the key is ``dir/n03788365_17158`` (the path up to the
first dot of the base name) and the extension is ``seg.png`` (the rest, lower-cased). With
``last_dot=True`` keys may contain dots and the extension is what follows the last dot.

Skipped members: names with no extension, and names whose base name starts with ``__`` (metadata
such as ``__index__``). A leading ``./`` (as written by ``tar -C DIR .``) is removed.

Sizes (shard size limits, cache sizes) are read by one function, :func:`parse_size`: decimal units
``kB``, ``MB``, ``GB``, ``TB`` are powers of 1000 and binary units ``KiB``, ``MiB``, ``GiB``,
``TiB`` powers of 1024.
"""

from __future__ import annotations

import decimal
import re
import sys
from typing import Any, Generator, Iterable, Iterator

from ..errors import CompressionError, DuplicateFieldError, MissingFieldError, TruncatedShardError

try:  # optional C accelerator (_speedups, see _c/); the Python loop below is the reference
    from .._speedups import group_members as _group_members
except ImportError:  # pragma: no cover - built by default; pure Python works the same
    _group_members = None

__all__ = ["META_KEYS", "group_samples", "is_meta_key", "parse_size", "split_name"]

META_KEYS = ("__key__", "__url__", "__offset__", "__index__")


def is_meta_key(field: str) -> bool:
    """True for bookkeeping fields such as ``__key__`` and ``__url__``."""
    return field.startswith("__")


_SIZE_RE = re.compile(
    r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([kmgtp])(i)?)?(b)?\s*", re.IGNORECASE
)
_SIZE_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: int | float | str, *, positive: bool = False) -> int:
    """Bytes from a number or a string: ``"20GB"`` is 20 * 10**9, ``"20GiB"`` 20 * 2**30.

    Units are case-insensitive; ``k``/``M``/``G``/``T``/``P`` with or without ``B`` are decimal,
    with ``i`` (``KiB``, ``GiB``...) binary; no unit (or ``B``) means bytes, and numbers may have
    a fraction or an exponent (``"1.5GB"``, ``"3e9"``). Numbers pass through (as ints).
    Raises ``ValueError`` for anything else, for negative sizes, and for 0 when ``positive``;
    ``TypeError`` for values that are neither numbers nor strings.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"a size is a number of bytes or a string like '20GB', not {value!r}")
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m is None:
            raise ValueError(f"{value!r} is not a size (examples: 3e9, 500MB, 20GB, 64KiB)")
        number, unit, binary, _ = m.groups()
        power = _SIZE_POWERS[unit.lower()] if unit else 0
        size = int(decimal.Decimal(number) * ((1024 if binary else 1000) ** power))
    else:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"a size must be finite, got {value!r}")
        size = int(value)
    if size < 0 or (positive and size == 0):
        raise ValueError(f"a size must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return size


def split_name(name: str, last_dot: bool = False) -> tuple[str, str] | None:
    """Split a member name into ``(key, extension)``; ``None`` when the member is skipped."""
    if name.startswith("./"):
        name = name[2:]
    slash = name.rfind("/") + 1
    if name.startswith("__", slash):
        return None
    dot = name.rfind(".", slash) if last_dot else name.find(".", slash)
    if dot < 0 or dot == slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1 :].lower()


def group_samples(
    members: Iterable,
    url=None,
    *,
    last_dot: bool = False,
    batched: bool = False,
    accelerate: bool = True,
) -> Generator[dict, None, None]:
    """Group consecutive tar members with the same key into sample dicts.

    ``members`` yields ``(name, data, offset)``, or lists of them with ``batched=True`` (as
    :func:`tarshards.tario.iter_tar_batches` gives). Each sample is ``{"__key__": key,
    "__url__": url, "__offset__": offset, ext: bytes, ...}``, where ``offset`` is the offset of
    the first member's first header block in the (uncompressed) tar stream, as the member
    reader reports it: seeking there and reading one sample gives the same sample. A repeated
    extension within one sample raises :class:`DuplicateFieldError` naming both members. With
    ``accelerate`` (default) batches are grouped in C when the extension is built.

    A shard that is cut short (:class:`TruncatedShardError`, :class:`CompressionError`) yields
    every sample that lies wholly before the damage, the last one included when the error shows
    that the damage lies outside it (it names a member of another sample, or the stream ends just
    after the sample's last member), and then raises the error.
    """
    if batched and accelerate and _group_members is not None:
        return _group_fast(members, url, last_dot)
    return _group(members if batched else (members,), url, last_dot)


def group_run(members: list, url, last_dot: bool = False) -> list[dict] | None:
    """The samples of ``members`` (a list of ``(name, data, offset)`` that ends where a sample
    ends) grouped in one C call, as :func:`group_samples` groups them; ``None`` without the C
    extension or where the reference loop must decide (a repeated extension: it raises)."""
    if _group_members is None:
        return None
    samples, sample, _key, stop = _group_members(members, 0, url, last_dot, None, None)
    if stop >= 0:
        return None
    if sample is not None:
        samples.append(sample)
    return samples


def _damage_after(exn: Exception, key: str | None, last_dot: bool) -> bool:
    """Whether a reading error shows that the sample being assembled (``key``) is complete:
    the stream was cut (not corrupted) in a member of another sample, or just after the whole
    data of this sample's last member."""
    if not isinstance(exn, (TruncatedShardError, CompressionError)) or exn.member is None:
        return False
    parts = split_name(exn.member, last_dot)
    if parts is None:  # a member grouping skips: the sample could go on after it
        return False
    return parts[0] != key or (isinstance(exn, TruncatedShardError) and exn.member_whole)


def _group_fast(batches: Iterable[list], url, last_dot: bool) -> Generator[dict, None, None]:
    sample = None
    key = None
    try:
        for batch in batches:
            if type(batch) is not list:
                batch = list(batch)
            samples, sample, key, stop = _group_members(batch, 0, url, last_dot, sample, key)
            if stop >= 0:  # a repeated extension: the reference loop raises the error
                yield from samples
                for _ in _group(([batch[stop]],), url, last_dot, sample, key):
                    pass
                raise RuntimeError("internal error: C and Python grouping disagree")
            # nothing of this batch is held while the next one is read (its members are copied
            # into memory the consumer freed: see tario.buffer.COPY_WINDOW)
            del batch
            yield from samples
            del samples
    except (TruncatedShardError, CompressionError) as exn:
        if sample is not None and _damage_after(exn, key, last_dot):
            yield sample
        raise
    if sample is not None:
        yield sample


def _group(
    batches: Iterable, url, last_dot: bool, sample: Any = None, key: str | None = None
) -> Generator[dict, None, None]:
    """The reference grouping loop (state ``sample``/``key`` carried in from a caller)."""
    state = [sample, key]  # the sample being assembled, for the error path
    try:
        yield from _group_loop(batches, url, last_dot, state)
    except (TruncatedShardError, CompressionError) as exn:
        if state[0] is not None and _damage_after(exn, state[1], last_dot):
            yield state[0]
        raise


def _group_loop(batches: Iterable, url, last_dot: bool, state: list) -> Iterator[dict]:
    sample, key = state
    for batch in batches:
        for member, data, offset in batch:
            # inlined split_name (hot path)
            name = member[2:] if member.startswith("./") else member
            slash = name.rfind("/") + 1
            if name.startswith("__", slash):
                continue
            dot = name.rfind(".", slash) if last_dot else name.find(".", slash)
            if dot <= slash or dot == len(name) - 1:
                continue
            k = name[:dot]
            # one str a process per extension (as the C loops give): equal samples pickle alike
            ext = name[dot + 1 :]
            ext = sys.intern(ext if ext.islower() else ext.lower())
            if k != key:
                if sample is not None:
                    yield sample
                key = k
                sample = {"__key__": k, "__url__": url, "__offset__": offset, ext: data}
                state[0] = sample
                state[1] = k
            else:
                if ext in sample:
                    # the first member's name is rebuilt (same ./ prefix as the second one)
                    first = f"{member[: len(member) - len(name)]}{k}.{ext}"
                    raise DuplicateFieldError(
                        f"repeated extension {ext!r} in sample {k!r}: members {first!r} and "
                        f"{member!r}",
                        url=url,
                        member=member,
                        offset=offset,
                    )
                sample[ext] = data
    if sample is not None:
        yield sample


def field_options(spec) -> list[list[str]]:
    """``("jpg;png", "cls")`` as ``[["jpg", "png"], ["cls"]]``: each field's alternatives, the
    first present one chosen (``to_tuple``'s and ``decode``'s field specs)."""
    return [s.split(";") for s in spec]


def missing_field(sample: dict, alts: list[str]) -> MissingFieldError:
    """``to_tuple``'s error for a sample that has none of one field's alternatives."""
    fields = ", ".join(k for k in sample if not k.startswith("__"))
    return MissingFieldError(
        f"to_tuple: sample {sample.get('__key__')!r} has none of {';'.join(alts)!r} "
        f"(fields: {fields})"
    )
