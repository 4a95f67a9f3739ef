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

from ._lazy import LazyModule, OptionalEntries
from .codecs import IMAGE_MODES, _EXTRA_MODES, field_decoder, image_decoder
from .errors import DecodeError, MissingFieldError, TarshardsError
from .on_error import (
    OnError,
    error_policy,
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from .source import ShuffleCore

if TYPE_CHECKING:
    import numpy as np
else:
    np = LazyModule("numpy", globals(), "np")  # numpy is imported on first use

__all__ = [
    "batched",
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


def _context(exn: Exception, sample, field=None, wrap: bool = False) -> Exception:
    """Attach the sample's shard URL and member name to an error.

    Our own errors get the context as attributes; with ``wrap`` (decoding) other errors become a
    :class:`DecodeError` caused by them; otherwise they keep their type and get a note.
    """
    if not isinstance(sample, dict):
        return exn
    url = sample.get("__url__")
    key = sample.get("__key__")
    member = f"{key}.{field}" if (key is not None and field) else key
    if isinstance(exn, TarshardsError):
        return exn.with_context(url=url, member=member)
    if wrap:
        wrapped = DecodeError(f"{type(exn).__name__}: {exn}", url=url, member=member)
        wrapped.__cause__ = exn
        return wrapped
    if hasattr(exn, "add_note"):
        exn.add_note(f"in sample {key!r} of shard {url}")
    return exn


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
    # one implementation with the resumable pipelines' buffer (tarshards.source.ShuffleCore)
    yield from ShuffleCore(bufsize, initial, rng).run(iter(samples))


_END = object()


class _Handler:
    """A decoder handler for one extension (webdataset's ``handle_extension``)."""

    def __init__(self, extensions: str, fn: Callable[[bytes], Any]):
        self.extensions = [e.lower() for e in extensions.split()]
        self.fn = fn

    def __call__(self, key: str, data: bytes):
        ext = key.lower()
        for e in self.extensions:
            if ext == e or ext.endswith("." + e):
                return self.fn(data)
        return None


def handle_extension(extensions: str, fn: Callable[[bytes], Any]) -> Callable:
    """A decode handler: ``fn(data)`` for fields with one of the space-separated extensions."""
    return _Handler(extensions, fn)


_BYTES_LIKE = (bytes, bytearray, memoryview)


def _decoders(handlers, only, size, allow_unsafe: bool, rng):
    """What :func:`decode` and :func:`_decode_tuple` work with: ``(custom, seeded, base, only,
    cache, lookup)``, the custom handlers, which of them take a generator, the seed of the
    per-sample generators, the extensions to decode, and a cache of field decoders filled by
    ``lookup(ext)``."""
    image_mode = None
    custom = []
    for h in handlers:
        if isinstance(h, str):
            if h not in IMAGE_MODES and h not in _EXTRA_MODES:
                raise ValueError(
                    f"unknown decoding mode {h!r}; choose one of "
                    f"{', '.join(sorted(IMAGE_MODES))} or pass a function"
                )
            image_mode = h
        elif callable(h):
            custom.append(h)
        else:
            raise TypeError(f"decode handlers are mode names or functions, not {h!r}")
    if isinstance(only, str):
        only = only.split()
    only = None if only is None else {e.lower() for e in only}
    if image_mode is not None:
        image_decoder(image_mode, size)  # a mode whose package is missing fails here, once
    cache: dict[str, Callable | None] = {}
    seeded = [bool(getattr(h, "wants_rng", False)) for h in custom]
    base = None
    if any(seeded):
        base = (rng if rng is not None else random.Random()).getrandbits(64)

    def lookup(ext):
        dec = field_decoder(ext, image_mode=image_mode, size=size, allow_unsafe=allow_unsafe)
        cache[ext] = dec
        return dec

    return custom, seeded, base, only, cache, lookup


def _already_decoded(k: str, v) -> DecodeError:
    return DecodeError(
        f"field {k!r} is already decoded ({type(v).__name__}); use partial=True to allow this"
    )


def _handled(custom, seeded, base, sample, sample_rng, k: str, v):
    """``(value or None, sample_rng)``: the first custom handler's value for field ``k``;
    handlers that want one get the sample's generator (made on first use, from ``base`` and
    the sample's ``__url__`` and ``__key__``)."""
    for h, wants_rng in zip(custom, seeded):
        if wants_rng:
            if sample_rng is None:
                sample_rng = random.Random(
                    f"{base}/{sample.get('__url__')}/{sample.get('__key__')}"
                )
            value = h(k, v, rng=sample_rng)
        else:
            value = h(k, v)
        if value is not None:
            return value, sample_rng
    return None, sample_rng


def decode(
    samples: Iterable[dict],
    *handlers,
    only=None,
    partial: bool = False,
    size=None,
    allow_unsafe: bool = False,
    on_error: OnError = "raise",
    handler: Callable | None = None,
    rng: random.Random | None = None,
) -> Iterator[dict]:
    """Decode the fields of each sample by extension.

    ``handlers`` are image modes (``"pil"``, ``"rgb8"``, ``"torchrgb"``...; the last one wins) and
    functions ``f(extension, data)`` that return a value or ``None`` to pass (tried first, in
    order). With no image mode, images stay bytes. ``only`` limits decoding to some extensions.
    ``size=(w, h)`` decodes images at that size (JPEGs at reduced scale, much faster).
    ``partial=True`` passes fields that are already decoded; otherwise those are an error.
    ``on_error``: what a field that does not decode does (:mod:`tarshards.on_error`).

    Handlers with a true ``wants_rng`` attribute (random augmentations such as
    :func:`tarshards.random_resized_crop`) are called as ``f(extension, data, rng=r)`` with a
    generator of the sample's own, seeded from ``rng`` (pipelines pass one seeded from seed,
    epoch and reader) and the sample's ``__url__`` and ``__key__``: a sample's draws do not
    depend on the samples before it, so a resumed epoch draws the same.
    """
    policy = error_policy(on_error, handler)
    custom, seeded, base, only, cache, lookup = _decoders(handlers, only, size, allow_unsafe, rng)

    # Samples of a dataset mostly share one set of fields: the (field, decoder) pairs to apply
    # are worked out once per set of fields (a plan), so the per-sample work is a dict copy and
    # one call per decoded field. Custom handlers, or too many distinct field sets, take the
    # general loop.
    plans: dict[tuple, list] = {}

    def plan_for(keys):
        plan = []
        for k in keys:
            if (k[:2] == "__") or (only is not None and k not in only):
                continue
            plan.append((k, cache[k] if k in cache else lookup(k)))
        if len(plans) < 64:
            plans[keys] = plan
        return plan

    for sample in samples:
        k = None
        sample_rng = None
        try:
            if not custom and type(sample) is dict:
                keys = tuple(sample)
                plan = plans.get(keys)
                if plan is None:
                    plan = plan_for(keys)
                out = sample.copy()
                for k, dec in plan:
                    v = out[k]
                    if type(v) is not bytes and not isinstance(v, _BYTES_LIKE):
                        if partial:
                            continue
                        raise _already_decoded(k, v)
                    if dec is not None:
                        out[k] = dec(v)
                yield out
                continue
            out = {}
            for k, v in sample.items():
                if k[0] == "_" and k[:2] == "__":
                    out[k] = v
                    continue
                if only is not None and k not in only:
                    out[k] = v
                    continue
                if not isinstance(v, (bytes, bytearray, memoryview)):
                    if partial:
                        out[k] = v
                        continue
                    raise _already_decoded(k, v)
                value, sample_rng = _handled(custom, seeded, base, sample, sample_rng, k, v)
                if value is not None:
                    out[k] = value
                else:
                    dec = cache[k] if k in cache else lookup(k)
                    out[k] = v if dec is None else dec(v)
        except Exception as exn:
            if policy(_context(exn, sample, k, wrap=True)):
                continue
            return
        yield out


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
            if policy(_context(exn, sample)):
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
            if policy(_context(exn, sample)):
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


def _fields(spec) -> list[list[str]]:
    return [s.split(";") for s in spec]


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
    options = _fields(fields)
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
                        raise MissingFieldError(
                            f"to_tuple: sample {sample.get('__key__')!r} has none of "
                            f"{';'.join(alts)!r} (fields: "
                            f"{', '.join(k for k in sample if not k.startswith('__'))})"
                        )
                    out.append(None)
        except Exception as exn:
            if policy(_context(exn, sample)):
                continue
            return
        yield tuple(out)


def _decode_tuple(
    samples: Iterable[dict],
    fields: tuple,
    *handlers,
    missing_is_error: bool = True,
    only=None,
    partial: bool = False,
    size=None,
    allow_unsafe: bool = False,
    on_error: OnError = "raise",
    handler: Callable | None = None,
    rng: random.Random | None = None,
) -> Iterator[tuple]:
    """``to_tuple(decode(samples, *handlers, ...), *fields)`` in one pass: what a pipeline runs
    for ``.decode(...).to_tuple(...)`` (one policy for both).

    The same values and errors, less the per-sample work in between: no decoded copy of the
    sample dict, no second stage; only the fields the tuple takes are decoded (of ``"jpg;png"``,
    the one present first), and which those are, with their decoders, is worked out once per
    set of field names.
    """
    if len(fields) == 1 and " " in fields[0]:
        fields = tuple(fields[0].split())
    options = _fields(fields)
    policy = error_policy(on_error, handler)
    custom, seeded, base, only, cache, lookup = _decoders(handlers, only, size, allow_unsafe, rng)
    plans: dict[tuple, list[tuple[str | None, bool, Callable | None]]] = {}

    def plan_for(sample, keys) -> list[tuple[str | None, bool, Callable | None]]:
        """Per tuple position: (field or None when missing, whether to check and decode it,
        its decoder)."""
        plan: list[tuple[str | None, bool, Callable | None]] = []
        for alts in options:
            for f in alts:
                if f in sample:
                    decoded = f[:2] != "__" and (only is None or f in only)
                    plan.append(
                        (f, decoded, (cache[f] if f in cache else lookup(f)) if decoded else None)
                    )
                    break
            else:
                if missing_is_error:
                    raise MissingFieldError(
                        f"to_tuple: sample {sample.get('__key__')!r} has none of "
                        f"{';'.join(alts)!r} (fields: "
                        f"{', '.join(k for k in sample if not k.startswith('__'))})"
                    )
                plan.append((None, False, None))
        if len(plans) < 64:
            plans[keys] = plan
        return plan

    for sample in samples:
        k = None
        try:
            keys = tuple(sample)
            plan = plans.get(keys)
            if plan is None:
                plan = plan_for(sample, keys)
            out: list = []
            sample_rng = None
            for k, decoded, dec in plan:
                if k is None:
                    out.append(None)
                    continue
                v = sample[k]
                if decoded:
                    if type(v) is not bytes and not isinstance(v, _BYTES_LIKE):
                        if not partial:
                            raise _already_decoded(k, v)
                    elif custom:
                        value, sample_rng = _handled(custom, seeded, base, sample, sample_rng, k, v)
                        if value is not None:
                            v = value
                        elif dec is not None:
                            v = dec(v)
                    elif dec is not None:
                        v = dec(v)
                out.append(v)
        except MissingFieldError as exn:
            if policy(_context(exn, sample)):
                continue
            return
        except Exception as exn:
            if policy(_context(exn, sample, k, wrap=True)):
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
            if policy(_context(exn, sample)):
                continue
            return
        yield out


def default_collation_fn(samples: list) -> Any:
    """Collate a list of samples into a batch.

    Tuples/lists are collated element-wise; dicts key-wise. Tensors are stacked (torch), arrays
    stacked (numpy), numbers become arrays, everything else becomes a list.
    """
    first = samples[0]
    if isinstance(first, dict):
        return {k: _collate_column([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        return tuple(_collate_column(list(col)) for col in zip(*samples))
    return _collate_column(samples)


# how a column of values of one type is collated, beyond numbers and arrays: registered by the
# module of the type (tarshards.torch for torch.Tensor); optional types are declared by name
# ("module.QualName") and their module is imported when such a column is first met
_COLLATE: dict[type, Callable[[list], Any]] = {}
OPTIONAL_COLLATION = OptionalEntries("collation of")


def register_collation(cls: type, fn: Callable[[list], Any]) -> None:
    """Collate columns whose first value is a ``cls`` (or a subclass) with ``fn(column)``."""
    _COLLATE[cls] = fn


def _registered_collation(x) -> Callable[[list], Any] | None:
    for cls in type(x).__mro__:
        fn = _COLLATE.get(cls)
        if fn is not None:
            return fn
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in OPTIONAL_COLLATION:
            OPTIONAL_COLLATION.load(name)
            return _COLLATE.get(cls)
    return None


def _collate_column(col: list) -> Any:
    x = col[0]
    if isinstance(x, (bool, np.bool_)):
        return np.array(col, dtype=bool)
    if isinstance(x, (int, np.integer)):
        return np.array(col, dtype=np.int64)
    if isinstance(x, (float, np.floating)):
        return np.array(col, dtype=np.float64 if isinstance(x, float) else x.dtype)
    if isinstance(x, np.ndarray):
        return np.stack(col)
    fn = _registered_collation(x) if _COLLATE or OPTIONAL_COLLATION else None
    return list(col) if fn is None else fn(col)


def batched(
    samples: Iterable,
    batchsize: int,
    collation_fn: Callable | None = default_collation_fn,
    partial: bool = True,
) -> Iterator:
    """Group samples into batches of ``batchsize``; the last smaller one only when ``partial``."""
    if batchsize < 1:
        raise ValueError(f"batchsize must be >= 1, got {batchsize}")
    batch = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batchsize:
            yield collation_fn(batch) if collation_fn is not None else batch
            batch = []
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
