"""webdataset's curried pipeline filters, made from tarshards' stages.

``wds.shuffle(1000)`` is a :class:`Curried` value: called on an iterator it runs
``tarshards.pipeline.stages.shuffle(iterator, 1000)``; placed in a
:class:`~tarshards.compat.DataPipeline`
it becomes a stage of the pipeline, which hands it a random generator seeded from (seed, epoch,
rank, worker) and the pipeline's handler, as the fluent API does. The uncurried functions keep
webdataset's private names (``_shuffle``, ``_batched``...).

The few stages tarshards has no equivalent of (``rsample``, ``extract_keys``, ``rename_keys``,
``xdecode``, ``detshuffle``, ``Cached``...) are defined here, once.
"""

from __future__ import annotations

import io
import numbers
import pickle
import random
import sys
from fnmatch import fnmatch
from typing import Callable

from ..errors import MissingFieldError
from ..pipeline import stages as _st
from ..pipeline.stages import reraise_exception
from ..plan.shards import make_rng
from .utils import PipelineStage

__all__ = [
    "Cached",
    "Curried",
    "associate",
    "batched",
    "compose",
    "decode",
    "default_collation_fn",
    "detshuffle",
    "extract_keys",
    "getfirst",
    "identity",
    "info",
    "listed",
    "log_keys",
    "map",
    "map_dict",
    "map_tuple",
    "pipeline",
    "pipelinefilter",
    "rename",
    "rename_keys",
    "rsample",
    "select",
    "shuffle",
    "slice",
    "to_tuple",
    "transform_with",
    "unbatched",
    "unlisted",
    "xdecode",
]


class Curried:
    """A stage with its arguments, waiting for its upstream: ``Curried(f, args, kw)(src)`` is
    ``f(src, *args, **kw)``. Picklable when ``f`` is a module-level function."""

    __slots__ = ("args", "fn", "kwargs")

    def __init__(self, fn: Callable, args: tuple = (), kwargs: dict | None = None):
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})

    def __call__(self, src):
        return self.fn(src, *self.args, **self.kwargs)

    def __getstate__(self):
        return (self.fn, self.args, self.kwargs)

    def __setstate__(self, state):
        self.fn, self.args, self.kwargs = state

    def __repr__(self):
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{getattr(self.fn, '__name__', self.fn)}({', '.join(parts)})"


class _Filter:
    """What ``pipelinefilter(f)`` returns: called with arguments, it gives a :class:`Curried`."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "filter").lstrip("_")
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs) -> Curried:
        return Curried(self.fn, args, kwargs)

    def __repr__(self):
        return f"pipelinefilter({self.__name__})"


def pipelinefilter(f: Callable) -> _Filter:
    """Curry a stage ``f(src, *args, **kw)``: ``pipelinefilter(f)(*args, **kw)(src)``."""
    return _Filter(f)


def identity(x):
    return x


def compose2(f, g):
    return lambda x: g(f(x))


def compose(*fs):
    """The function applying ``fs`` in order."""

    def composed(x):
        for f in fs:
            x = f(x)
        return x

    return composed


def pipeline(source, *stages):
    """Apply curried stages to an iterable in turn."""
    for stage in stages:
        source = stage(source)
    return source


# ---- stages that are tarshards' own -----------------------------------------------------------


def _shuffle(data, bufsize: int = 1000, initial: int = 100, rng=None, seed=None):
    """Buffer shuffle (tarshards.pipeline.stages.shuffle); seeded by the pipeline, or by
    ``seed``/``rng``."""
    return _st.shuffle(data, bufsize, initial=initial, rng=rng, seed=seed)


def _map(data, f, handler=reraise_exception):
    return _st.map(data, f, handler=handler)


def _select(data, predicate):
    return _st.select(data, predicate)


def _map_dict(data, handler=reraise_exception, **kw):
    return _st.map_dict(data, handler=handler, **kw)


def _map_tuple(data, *args, handler=reraise_exception):
    return _st.map_tuple(data, *args, handler=handler)


def _rename(data, handler=reraise_exception, keep=True, **kw):
    return _st.rename(data, keep=keep, handler=handler, **kw)


def _to_tuple(data, *args, handler=reraise_exception, missing_is_error=True, none_is_error=None):
    """tarshards.pipeline.stages.to_tuple; ``none_is_error`` (default: as ``missing_is_error``) also
    refuses fields whose value is ``None``."""
    if none_is_error is None:
        none_is_error = missing_is_error
    out = _st.to_tuple(data, *args, missing_is_error=missing_is_error, handler=handler)
    if not none_is_error:
        return out
    return _no_nones(out, args, handler)


def _no_nones(tuples, fields, handler):
    for t in tuples:
        if any(x is None for x in t):
            missing = [f for f, x in zip(fields, t) if x is None]
            if handler(MissingFieldError(f"to_tuple: field(s) {', '.join(missing)} are None")):
                continue
            return
        yield t


def default_collation_fn(samples: list, combine_tensors: bool = True, combine_scalars: bool = True):
    """tarshards' collation; with ``combine_tensors``/``combine_scalars`` off, those columns
    stay lists (webdataset's options)."""
    if combine_tensors and combine_scalars:
        return _st.default_collation_fn(samples)
    first = samples[0]
    if isinstance(first, dict):
        return {
            k: _column([s[k] for s in samples], combine_tensors, combine_scalars) for k in first
        }
    if isinstance(first, (tuple, list)):
        return tuple(_column(list(c), combine_tensors, combine_scalars) for c in zip(*samples))
    return _column(list(samples), combine_tensors, combine_scalars)


def _column(col, tensors, scalars):
    x = col[0]
    if isinstance(x, numbers.Number):
        return _st.default_collation_fn(col) if scalars else list(col)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return _st.default_collation_fn(col) if tensors else list(col)
    return list(col)


def _batched(data, batchsize: int = 20, collation_fn=default_collation_fn, partial: bool = True):
    return _st.batched(data, batchsize, collation_fn=collation_fn, partial=partial)


def _unbatched(data):
    """Rows of each batch; as in webdataset a list batch is a list of columns (what a
    DataLoader's collation gives), like a tuple."""
    return _st.unbatched(tuple(b) if isinstance(b, list) else b for b in data)


def _listed(data, batchsize: int = 20, partial: bool = True):
    return _st.batched(data, batchsize, collation_fn=None, partial=partial)


def _unlisted(data):
    for batch in data:
        yield from batch


def _slice(data, *args):
    return _st.slice(data, *args)


_IMAGE_MODES = None


def _decode(
    data,
    *args,
    handler=reraise_exception,
    only=None,
    partial=False,
    pre=None,
    post=None,
    allow_unsafe: bool = False,
    size=None,
    **kw,
):
    """tarshards.pipeline.stages.decode with webdataset's arguments: image specs (``"rgb"``,
    ``"torch"``...),
    handlers ``f(key, data)``, ``Decoder`` objects; ``pre``/``post`` handler lists."""
    from .autodecode import as_decode_args

    handlers = as_decode_args((pre or []) + list(args) + (post or []))
    return _st.decode(
        data,
        *handlers,
        only=only,
        partial=partial,
        size=size,
        allow_unsafe=allow_unsafe,
        handler=handler,
    )


def getfirst(sample: dict, keys, default=None, missing_is_error: bool = True):
    """The value of the first of ``keys`` (a list or ``"a;b"``) present in ``sample``."""
    if isinstance(keys, str):
        keys = keys.split(";")
    for k in keys:
        if k in sample:
            return sample[k]
    if missing_is_error:
        raise MissingFieldError(
            f"none of {';'.join(keys)!r} in sample (fields: {', '.join(sample)})"
        )
    return default


def transform_with(sample, transformers):
    """Apply ``transformers[i]`` to ``sample[i]`` (``None``: identity; the last one repeats)."""
    if transformers is None or len(transformers) == 0:
        return sample
    result = list(sample)
    for i in range(len(result)):
        f = transformers[i] if i < len(transformers) else transformers[-1]
        if f is not None:
            result[i] = f(result[i])
    return result


# ---- stages only webdataset has -------------------------------------------------------------


def _info(data, fmt=None, n=3, every=-1, width=50, stream=sys.stderr, name=""):
    """Print the first ``n`` samples (and every ``every``-th) to ``stream``; pass them on."""
    for i, sample in enumerate(data):
        if i < n or (every > 0 and (i + 1) % every == 0):
            if fmt is None:
                text = (
                    " ".join(f"{k}:{repr(v)[:width]}" for k, v in sample.items())
                    if isinstance(sample, dict)
                    else repr(sample)[:width]
                )
            else:
                text = fmt.format(**sample)
            print(f"{name} {i} {text}", file=stream)
        yield sample


def _log_keys(data, logfile=None):
    """Append each sample's ``__key__`` (and ``__url__``) to ``logfile`` when given."""
    if logfile is None:
        yield from data
        return
    with open(logfile, "a") as stream:
        for i, sample in enumerate(data):
            print(
                i,
                sample.get("__worker__"),
                sample.get("__rank__"),
                sample.get("__key__"),
                sample.get("__url__"),
                file=stream,
            )
            yield sample


def _rsample(data, p: float = 0.5, rng=None):
    """Keep each sample with probability ``p`` (seeded by the pipeline)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"rsample: p must be in [0, 1], got {p}")
    rng = random.Random() if rng is None else rng
    uniform = rng.random
    for sample in data:
        if uniform() < p:
            yield sample


def _patterns(pattern) -> list[str]:
    return pattern.split(";") if isinstance(pattern, str) else list(pattern)


def _extract_keys(source, *patterns, duplicate_is_error=True, ignore_missing=False):
    """Tuples of the fields matching glob patterns (``"*.png;*.jpg"``); ``.ext`` matches too."""
    compiled = [_patterns(p) for p in patterns]
    for sample in source:
        out = []
        for alts in compiled:
            hits = [k for k in sample if any(fnmatch(k, p) or fnmatch("." + k, p) for p in alts)]
            if not hits:
                if ignore_missing:
                    continue
                raise MissingFieldError(
                    f"extract_keys: no field matches {';'.join(alts)!r} "
                    f"(fields: {', '.join(sample)})"
                )
            if len(hits) > 1 and duplicate_is_error:
                raise ValueError(f"extract_keys: fields {hits} all match {';'.join(alts)!r}")
            out.append(sample[hits[0]])
        yield tuple(out)


def _rename_keys(
    source, *args, keep_unselected=False, must_match=True, duplicate_is_error=True, **kw
):
    """Rename fields by glob patterns: ``rename_keys(image="*.png")`` or ``("image", "*.png")``
    pairs; later patterns win; fields matching none are dropped unless ``keep_unselected``."""
    renamings = [(pattern, new) for new, pattern in args] + [(p, n) for n, p in kw.items()]
    for sample in source:
        out = {}
        matched = set()
        for path, value in sample.items():
            fname = path.rpartition("/")[2].lower()
            new = None
            for pattern, name in reversed(renamings):
                if fnmatch(fname, pattern):
                    matched.add(pattern)
                    new = name
                    break
            if new is None:
                if keep_unselected or path.startswith("__"):
                    out[path] = value
                continue
            if new in out:
                if duplicate_is_error:
                    raise ValueError(f"rename_keys: two fields of {list(sample)} become {new!r}")
                continue
            out[new] = value
        if must_match and len(matched) < len({p for p, _ in renamings}):
            missing = [p for p, _ in renamings if p not in matched]
            raise MissingFieldError(
                f"rename_keys: no field matches {missing} (fields: {', '.join(sample)})"
            )
        yield out


def _read_bytes(stream):
    return stream.read()


def _read_text(stream):
    return stream.read().decode("utf-8")


def _read_pickle(stream):  # only reachable when the caller passes it explicitly
    return pickle.load(stream)


default_decoders = [("*.bin", _read_bytes), ("*.txt", _read_text)]


def _find_decoder(decoders, path):
    fname = path.rpartition("/")[2].lower()
    for pattern, fun in reversed(decoders):
        if fnmatch(fname, pattern) or fnmatch("." + fname, pattern):
            return fun
    return None


def _xdecode(source, *args, must_decode=True, defaults=default_decoders, **kw):
    """Decode fields with functions of a binary stream chosen by glob pattern:
    ``xdecode(("*.png", imread), cls=lambda s: int(s.read()))``. Unlike webdataset, ``.pyd``
    has no default decoder (pickle runs code): pass one explicitly."""
    decoders = list(defaults) + list(args) + [("*." + k, v) for k, v in kw.items()]
    for sample in source:
        out = {}
        for path, data in sample.items():
            if path.startswith("__"):
                out[path] = data
                continue
            dec = _find_decoder(decoders, path)
            if dec is None or dec is False:
                if dec is None and must_decode:
                    raise ValueError(
                        f"xdecode: no decoder for field {path!r} "
                        "(pass must_decode=False to keep it as it is)"
                    )
                out[path] = data
                continue
            out[path] = dec(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data)
        yield out


def _associate(data, associator, **kw):
    """Merge ``associator(key)`` (a function, or a dict by key) into each sample."""
    for sample in data:
        extra = (
            associator(sample["__key__"])
            if callable(associator)
            else associator.get(sample["__key__"], {})
        )
        sample = dict(sample)
        sample.update(extra)
        yield sample


class detshuffle(PipelineStage):
    """A buffer shuffle seeded from ``seed`` and an epoch counted per pass (webdataset's)."""

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: int = 0, epoch: int = -1):
        self.bufsize = bufsize
        self.initial = initial
        self.seed = seed
        self.epoch = epoch

    def run(self, src):
        self.epoch += 1
        return _st.shuffle(
            src,
            self.bufsize,
            initial=self.initial,
            rng=make_rng("detshuffle", self.seed, self.epoch),
        )


class Cached(PipelineStage):
    """Keep the samples of the first pass in memory and replay them afterwards."""

    def __init__(self):
        self.cached = None

    def run(self, source):
        if self.cached is not None:
            yield from self.cached
            return
        collected = []
        for sample in source:
            collected.append(sample)
            yield sample
        self.cached = collected


shuffle = pipelinefilter(_shuffle)
map = pipelinefilter(_map)  # noqa: A001 - webdataset's name
select = pipelinefilter(_select)
map_dict = pipelinefilter(_map_dict)
map_tuple = pipelinefilter(_map_tuple)
rename = pipelinefilter(_rename)
to_tuple = pipelinefilter(_to_tuple)
batched = pipelinefilter(_batched)
unbatched = pipelinefilter(_unbatched)
listed = pipelinefilter(_listed)
unlisted = pipelinefilter(_unlisted)
slice = pipelinefilter(_slice)  # noqa: A001 - webdataset's name
decode = pipelinefilter(_decode)
info = pipelinefilter(_info)
log_keys = pipelinefilter(_log_keys)
rsample = pipelinefilter(_rsample)
extract_keys = pipelinefilter(_extract_keys)
rename_keys = pipelinefilter(_rename_keys)
xdecode = pipelinefilter(_xdecode)
associate = pipelinefilter(_associate)
