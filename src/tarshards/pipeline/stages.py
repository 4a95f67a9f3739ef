"""Pipeline stages: plain generator functions over an iterable of samples.

Every stage takes the upstream iterable first and is configured by keyword arguments, so stages
compose by nesting calls (``batched(to_tuple(decode(samples, "pil"), "jpg", "cls"), 64)``) or
through the fluent API of :class:`tarshards.WebDataset`, which is a thin layer over these functions.

Stages that can fail on one sample (``decode``, ``map``, ``to_tuple``...) take ``on_error=``:
``"raise"``, ``"skip"`` or ``"warn"`` for data errors, or a function of the exception returning
True to skip the sample, False to stop, or raising (see :mod:`tarshards.on_error`; ``handler=`` is
its older name and takes webdataset's handler functions).
"""

from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from .._lazy import LazyModule, OptionalEntries
from ..codecs.decoding import decode, handle_extension
from ..errors import MissingFieldError
from ..format.names import field_options, missing_field
from ..on_error import (
    OnError,
    error_policy,
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    sample_context,
    warn_and_continue,
    warn_and_stop,
)
from ..plan.cursor import ShuffleCore

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")  # numpy is imported on first use

__all__ = [
    "CollateError",
    "batched",
    "collate_error",
    "decode",
    "default_collation_fn",
    "handle_extension",
    "ignore_and_continue",
    "ignore_and_stop",
    "map",
    "map_dict",
    "map_tuple",
    "register_collation",
    "rename",
    "reraise_exception",
    "select",
    "shuffle",
    "slice",
    "take",
    "to_tuple",
    "unbatched",
    "warn_and_continue",
    "warn_and_stop",
]


# ---------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------


def shuffle(
    samples: Iterable,
    bufsize: int = 1000,
    initial: int | None = None,
    rng: random.Random | None = None,
    seed: int | None = None,
) -> Iterator:
    """Shuffle with a buffer of ``bufsize`` samples; output starts once ``initial`` are held.

    ``rng`` (or ``seed``) makes the order reproducible; pipelines pass a generator seeded from
    (seed, epoch, rank, worker).
    """
    if bufsize < 0:
        raise ValueError(f"shuffle bufsize must be >= 0, got {bufsize}")
    if bufsize <= 1:
        yield from samples
        return
    if rng is None:
        rng = random.Random(seed)
    # one implementation with the resumable pipelines' buffer (tarshards.plan.cursor.ShuffleCore)
    yield from ShuffleCore(bufsize, initial, rng).run(iter(samples), prefetch=True)


def select(samples: Iterable, predicate: Callable[[Any], bool]) -> Iterator:
    """Keep the samples for which ``predicate(sample)`` is true."""
    for sample in samples:
        if predicate(sample):
            yield sample


def map(  # noqa: A001 - webdataset's name
    samples: Iterable,
    f: Callable,
    handler: Callable | None = None,
    *,
    on_error: OnError = "raise",
) -> Iterator:
    """Apply ``f`` to each sample; ``None`` results are dropped; dict results keep ``__key__``.

    An exception in ``f`` is raised (with a note naming the sample) unless ``on_error`` is a
    function that says otherwise: ``"skip"``/``"warn"`` skip data errors only.
    """
    policy = error_policy(on_error, handler)
    for sample in samples:
        try:
            result = f(sample)
        except Exception as exn:
            if policy(sample_context(exn, sample)):
                continue
            return
        if result is None:
            continue
        if isinstance(result, dict) and isinstance(sample, dict) and "__key__" in sample:
            result.setdefault("__key__", sample["__key__"])
        yield result


def map_dict(
    samples: Iterable[dict],
    handler: Callable | None = None,
    *,
    on_error: OnError = "raise",
    **fs: Callable,
) -> Iterator[dict]:
    """Apply ``fs[field]`` to the named fields of each sample dict."""
    policy = error_policy(on_error, handler)
    for sample in samples:
        try:
            sample = dict(sample)
            for k, f in fs.items():
                if k not in sample:
                    raise MissingFieldError(
                        f"map_dict: sample has no field {k!r} (fields: {', '.join(sorted(sample))})"
                    )
                sample[k] = f(sample[k])
        except Exception as exn:
            if policy(sample_context(exn, sample)):
                continue
            return
        yield sample


def map_tuple(
    samples: Iterable[tuple],
    *fs: Callable | None,
    on_error: OnError = "raise",
    handler: Callable | None = None,
) -> Iterator[tuple]:
    """Apply ``fs[i]`` to element ``i`` of each tuple (``None`` leaves it as it is)."""
    policy = error_policy(on_error, handler)
    for sample in samples:
        try:
            if len(fs) > len(sample):
                raise ValueError(
                    f"map_tuple got {len(fs)} functions for a tuple of {len(sample)} elements"
                )
            sample = tuple(
                f(x) if f is not None else x for f, x in itertools.zip_longest(fs, sample)
            )
        except Exception as exn:
            if policy(exn):
                continue
            return
        yield sample


def to_tuple(
    samples: Iterable[dict],
    *fields: str,
    missing_is_error: bool = True,
    on_error: OnError = "raise",
    handler: Callable | None = None,
) -> Iterator[tuple]:
    """Turn sample dicts into tuples of the named fields; ``"jpg;png"`` takes the first present.

    A single string with spaces is split (``to_tuple("jpg cls")``).
    """
    if len(fields) == 1 and " " in fields[0]:
        fields = tuple(fields[0].split())
    options = field_options(fields)
    policy = error_policy(on_error, handler)
    for sample in samples:
        try:
            out = []
            for alts in options:
                for f in alts:
                    if f in sample:
                        out.append(sample[f])
                        break
                else:
                    if missing_is_error:
                        raise missing_field(sample, alts)
                    out.append(None)
        except Exception as exn:
            if policy(sample_context(exn, sample)):
                continue
            return
        yield tuple(out)


def rename(
    samples: Iterable[dict],
    keep: bool = True,
    handler: Callable | None = None,
    *,
    on_error: OnError = "raise",
    **names: str,
) -> Iterator[dict]:
    """Rename fields: ``rename(image="jpg;png", label="cls")``; ``keep=False`` drops the rest."""
    options = {new: old.split(";") for new, old in names.items()}
    policy = error_policy(on_error, handler)
    for sample in samples:
        try:
            if keep:
                out = dict(sample)
            else:
                out = {k: v for k, v in sample.items() if k.startswith("__")}
            for new, alts in options.items():
                for old in alts:
                    if old in sample:
                        value = sample[old]
                        out.pop(old, None)
                        out[new] = value
                        break
                else:
                    raise MissingFieldError(
                        f"rename: sample {sample.get('__key__')!r} has none of {';'.join(alts)!r}"
                    )
        except Exception as exn:
            if policy(sample_context(exn, sample)):
                continue
            return
        yield out


def default_collation_fn(samples: list, allocate: Callable | None = None, rows=None) -> Any:
    """Collate a list of samples into a batch.

    Tuples/lists are collated element-wise; dicts key-wise. Tensors are stacked (torch), arrays
    stacked (numpy), numbers become arrays, everything else becomes a list.

    ``allocate(shape, dtype)``, when given, returns the empty array that a column of arrays of
    one shape and dtype is stacked into (or ``None``: a new one); a loader's transport gives
    its shared memory this way (:meth:`tarshards.torch.transport.Packer.allocate`). ``rows`` (a
    :class:`tarshards.codecs.decoding.BatchRows`): tuple columns whose images were decoded straight
    into such memory, taken as they lie where they are.
    """
    first = samples[0]
    if isinstance(first, dict):
        return {k: _collate_column([s[k] for s in samples], allocate) for k in first}
    if isinstance(first, (tuple, list)):
        if rows is None:
            return tuple(_collate_column(list(col), allocate) for col in zip(*samples))
        out = []
        for i, col in enumerate(zip(*samples)):
            values = list(col)
            got = rows.take(i, values)
            out.append(_collate_column(values, allocate) if got is None else got)
        return tuple(out)
    return _collate_column(samples, allocate)


# how a column of values of one type is collated, beyond numbers and arrays: registered by the
# module of the type (tarshards.torch for torch.Tensor); optional types are declared by name
# ("module.QualName") and their module is imported when such a column is first met
_COLLATE: dict[type, Callable[[list], Any]] = {}
OPTIONAL_COLLATION = OptionalEntries("collation of", "stages.OPTIONAL_COLLATION")


_COLLATE_INTO: dict[type, Callable[[list, Callable], Any]] = {}


def register_collation(
    cls: type, fn: Callable[[list], Any], into: Callable[[list, Callable], Any] | None = None
) -> None:
    """Collate columns whose first value is a ``cls`` (or a subclass) with ``fn(column)``.

    ``into(column, allocate)``, if given, collates into memory from ``allocate(shape, dtype)``
    (see :func:`default_collation_fn`), returning ``None`` where it cannot (then ``fn`` does).
    """
    _COLLATE[cls] = fn
    if into is not None:
        _COLLATE_INTO[cls] = into
    else:
        _COLLATE_INTO.pop(cls, None)


def _registered_collation(x) -> type | None:
    """The registered class that a column of ``x`` is collated as."""
    for cls in type(x).__mro__:
        if cls in _COLLATE:
            return cls
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in OPTIONAL_COLLATION:
            OPTIONAL_COLLATION.load(name)
            return cls if cls in _COLLATE else None
    return None


class CollateError(ValueError, RuntimeError):
    """A column of a batch that cannot be stacked (values of different shapes), with a hint;
    a ``ValueError`` as numpy's error is, and a ``RuntimeError`` as torch's is."""


def _shape(x) -> tuple | None:
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else None


def collate_error(samples: list, exn: BaseException) -> CollateError | None:
    """A :class:`CollateError` with a hint for ``exn``, raised while collating ``samples``, when
    a column of them (the samples themselves, a tuple position, a dict key) holds values of
    different shapes; ``None`` otherwise."""
    if not samples:
        return None
    first = samples[0]
    if isinstance(first, dict):
        columns = [[s.get(k) for s in samples] for k in first]
    elif isinstance(first, (tuple, list)):
        columns = [list(c) for c in zip(*samples)]
    else:
        columns = [samples]
    for col in columns:
        shape = _shape(col[0])
        if shape is None:
            continue
        odd = next((i for i, v in enumerate(col) if _shape(v) != shape), None)
        if odd is None:
            continue
        images = len(shape) == 3 and 3 in (shape[0], shape[-1])
        what = "images of different sizes" if images else "arrays of different shapes"
        err = CollateError(
            f"cannot stack a batch column of {what}: {shape} at row 0, {_shape(col[odd])} at "
            f"row {odd}. Give them one size before batching: decode at a size "
            f'(.decode("rgb8", size=(w, h)) or decode_size=), crop with '
            f"tarshards.random_resized_crop(size), resize in a .map(), or batch them with a "
            f"collation that pads (.batched(n, collation_fn=...), or the loader's collate_fn) "
            f"({type(exn).__name__}: {exn})"
        )
        err.__cause__ = exn
        return err
    return None


def _stacked(stack: Callable, col: list) -> Any:
    """``stack(col)``, its failure on values of different shapes told with what to do."""
    try:
        return stack(col)
    except (ValueError, RuntimeError) as exn:
        err = collate_error(col, exn)
        if err is None:
            raise
        raise err from exn


def _collate_column(col: list, allocate: Callable | None = None) -> Any:
    x = col[0]
    if isinstance(x, (bool, np.bool_)):
        return np.array(col, dtype=bool)
    if isinstance(x, (int, np.integer)):
        return np.array(col, dtype=np.int64)
    if isinstance(x, (float, np.floating)):
        return np.array(col, dtype=np.float64 if isinstance(x, float) else x.dtype)
    if isinstance(x, np.ndarray):
        if allocate is not None and not x.dtype.hasobject:
            out = allocate((len(col), *x.shape), x.dtype)
            if out is not None:
                try:  # the same shape and dtype all through, else as np.stack has it
                    return np.stack(col, out=out, casting="no")
                except (TypeError, ValueError):
                    pass
        return _stacked(np.stack, col)
    cls = _registered_collation(x) if _COLLATE or OPTIONAL_COLLATION else None
    if cls is None:
        return list(col)
    if allocate is not None:
        into = _COLLATE_INTO.get(cls)
        if into is not None:
            out = into(col, allocate)
            if out is not None:
                return out
    return _stacked(_COLLATE[cls], col)


def batched(
    samples: Iterable,
    batchsize: int,
    collation_fn: Callable | None = default_collation_fn,
    partial: bool = True,
) -> Iterator:
    """Group samples into batches of ``batchsize``; the last smaller one only when ``partial``."""
    if batchsize < 1:
        raise ValueError(f"batchsize must be >= 1, got {batchsize}")
    batch: list = []
    full: list = []  # the full batch, handed on from here: no reference to it stays behind
    for sample in samples:
        batch.append(sample)
        if len(batch) == batchsize:
            del sample
            full.append(batch)
            batch = []
            yield collation_fn(full.pop()) if collation_fn is not None else full.pop()
    if batch and partial:
        yield collation_fn(batch) if collation_fn is not None else batch


def unbatched(samples: Iterable) -> Iterator:
    """Undo ``batched``: yield the samples of each batch (tuples of columns are transposed)."""
    for batch in samples:
        if isinstance(batch, dict):
            keys = list(batch)
            for row in zip(*(batch[k] for k in keys)):
                yield dict(zip(keys, row))
        elif isinstance(batch, tuple):
            yield from zip(*batch)
        else:
            yield from batch


def take(samples: Iterable, n: int) -> Iterator:
    """The first ``n`` samples."""
    yield from itertools.islice(samples, n)


def slice(samples: Iterable, *args) -> Iterator:  # noqa: A001 - webdataset's name
    """``slice(stop)`` or ``slice(start, stop[, step])`` over the stream."""
    yield from itertools.islice(samples, *args)
