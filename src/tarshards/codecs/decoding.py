"""The decode stage: fields decoded by extension through the codec registry
(:mod:`tarshards.codecs`), custom handlers first, and the fused ``decode`` + ``to_tuple`` pass
that a pipeline runs for ``.decode(...).to_tuple(...)``.

Both are generator functions like every stateless stage (:mod:`tarshards.pipeline.stages` re-exports
them); errors follow the pipeline's ``on_error`` policy (:mod:`tarshards.on_error`).
"""

from __future__ import annotations

import random
from operator import itemgetter
from typing import Any, Callable, Iterable, Iterator

from ..errors import DecodeError, MissingFieldError
from ..format.names import field_options, missing_field
from ..on_error import OnError, error_policy, sample_context
from .images import EXTRA_MODES, IMAGE_MODES, image_decoder, jpeg_into
from .registry import field_decoder

__all__ = ["decode", "handle_extension"]


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


def _decoders(handlers, only, size, allow_unsafe: bool, rng, sample_seed=None):
    """What :func:`decode` and :func:`decode_tuple` work with: ``(custom, seeded, base, only,
    cache, lookup)``, the custom handlers, which of them take a generator, the seed of the
    per-sample generators, the extensions to decode, and a cache of field decoders filled by
    ``lookup(ext)``."""
    image_mode = None
    custom = []
    for h in handlers:
        if isinstance(h, str):
            if h not in IMAGE_MODES and h not in EXTRA_MODES:
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
    # True: a generator from the stage's rng (seed, epoch, place); "sample": one from the
    # sample's seed alone (seed, epoch), the same whatever rank or worker reads the sample
    seeded = [
        "sample" if getattr(h, "wants_rng", False) == "sample" else bool(getattr(h, "wants_rng", 0))
        for h in custom
    ]
    base = None
    if any(seeded):
        place = (rng if rng is not None else random.Random()).getrandbits(64)
        own = "/".join(str(p) for p in sample_seed) if sample_seed is not None else place
        base = (place, own)

    def lookup(ext):
        dec = field_decoder(ext, image_mode=image_mode, size=size, allow_unsafe=allow_unsafe)
        cache[ext] = dec
        return dec

    return custom, seeded, base, only, cache, lookup


class BatchRows:
    """A batch's image columns decoded straight into the memory the batch leaves in, instead of
    decoded, then stacked there: what ``.decode("rgb8").to_tuple(...).batched(n)`` runs in a
    ``WebLoader`` worker, whose transport gives that memory (``allocate(shape, dtype)``, see
    :meth:`tarshards.torch.transport.Packer.allocate`).

    For a tuple position whose field is a JPEG decoded as ``rgb8`` or ``l8`` at its own size
    (:func:`tarshards.codecs.images.jpeg_into`), the first row of a batch allocates the whole
    column (n
    rows the size of that image) and each JPEG of that size is decoded into the next row; its
    value is that row: the pixels that decoding it alone gives. The collation
    (:func:`tarshards.pipeline.stages.default_collation_fn`) takes the column as it is
    (:meth:`take`)
    when the batch's values are those rows, in order, from the first. Anything else (an image
    of another size, a JPEG the C decoder declines, a row that the error policy dropped after
    its image was decoded) is decoded and stacked as always: the same batches either way."""

    def __init__(self, allocate: Callable, batchsize: int):
        self.allocate = allocate
        self.batchsize = batchsize
        self._columns: dict[int, list] = {}  # position -> [column, its rows handed out]
        self._decoders: dict[tuple, Callable] = {}

    def decoder(self, position: int, ext: str, dec: Callable, mode: str | None, size) -> Callable:
        """``dec`` (the field's decoder) for the JPEG at tuple ``position``, decoding into the
        batch's column where it can; ``dec`` itself where it cannot."""
        if mode is None or ext not in ("jpg", "jpeg"):
            return dec
        got = self._decoders.get((position, dec))
        if got is not None:
            return got
        into_mode = jpeg_into(mode, size)
        if into_mode is None:
            return dec
        channels, into, header = into_mode
        state = self._columns.setdefault(position, [None, []])
        allocate, batchsize = self.allocate, self.batchsize
        import numpy as np

        uint8 = np.uint8

        def decode(data):
            column, rows = state
            if column is None or len(rows) == len(column):
                got = header(data)
                if got is None:
                    return dec(data)
                shape = (batchsize, got[1], got[0], 3)[: 3 if channels == 1 else 4]
                column = allocate(shape, uint8)
                if column is None:
                    return dec(data)
                state[0] = column
                rows = state[1] = []
            row = column[len(rows)]
            if into(data, row):  # False: declined, or another size
                rows.append(row)
                return row
            return dec(data)

        self._decoders[(position, dec)] = decode
        return decode

    def take(self, position: int, values: list):
        """The batch's column at ``position``, as it lies in the transport's memory, when
        ``values`` are its first rows in order; else None (the caller stacks them). Either way
        the next batch starts a column of its own."""
        state = self._columns.get(position)
        if state is None:
            return None
        column, rows = state
        state[0], state[1] = None, []
        n = len(values)
        if column is None or n > len(rows) or any(v is not r for v, r in zip(values, rows)):
            return None
        return column if n == len(column) else column[:n]


def _already_decoded(k: str, v) -> DecodeError:
    return DecodeError(
        f"field {k!r} is already decoded ({type(v).__name__}); use partial=True to allow this"
    )


def _handled(custom, seeded, base, sample, sample_rng, k: str, v):
    """``(value or None, sample_rng)``: the first custom handler's value for field ``k``;
    handlers that want one get the sample's generator (made on first use, from ``base`` and
    the sample's ``__url__`` and ``__key__``)."""
    for h, wants_rng in zip(custom, seeded):
        if wants_rng == "sample":  # a fresh generator per field: fields of a sample draw alike
            own = random.Random(f"{base[1]}/{sample.get('__url__')}/{sample.get('__key__')}")
            value = h(k, v, rng=own)
        elif wants_rng:
            if sample_rng is None:
                sample_rng = random.Random(
                    f"{base[0]}/{sample.get('__url__')}/{sample.get('__key__')}"
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
    sample_seed: tuple | None = None,
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
    depend on the samples before it, so a resumed epoch draws the same. Handlers whose
    ``wants_rng`` is ``"sample"`` (:func:`tarshards.video`, :func:`tarshards.audio`) get one
    seeded from ``sample_seed`` (pipelines pass their seed and epoch) and the sample's
    ``__url__`` and ``__key__`` alone: the same draws whichever rank or worker reads the sample
    (without ``sample_seed``, from ``rng``), a fresh one for each field.
    """
    policy = error_policy(on_error, handler)
    custom, seeded, base, only, cache, lookup = _decoders(
        handlers, only, size, allow_unsafe, rng, sample_seed
    )

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
            if policy(sample_context(exn, sample, k, wrap=True)):
                continue
            return
        yield out


def decode_tuple(
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
    rows: BatchRows | None = None,
    sample_seed: tuple | None = None,
) -> Iterator[tuple]:
    """``to_tuple(decode(samples, *handlers, ...), *fields)`` in one pass: what a pipeline runs
    for ``.decode(...).to_tuple(...)`` (one policy for both). With ``rows`` (a pipeline whose
    next stage is the batching of a loader's transport), JPEG images are decoded into the
    batch's memory (:class:`BatchRows`).

    The same values and errors, less the per-sample work in between: no decoded copy of the
    sample dict, no second stage; only the fields the tuple takes are decoded (of ``"jpg;png"``,
    the one present first), and which those are, with their decoders, is worked out once per
    set of field names.
    """
    if len(fields) == 1 and " " in fields[0]:
        fields = tuple(fields[0].split())
    options = field_options(fields)
    policy = error_policy(on_error, handler)
    custom, seeded, base, only, cache, lookup = _decoders(
        handlers, only, size, allow_unsafe, rng, sample_seed
    )
    modes = [h for h in handlers if isinstance(h, str)]
    if custom or len(modes) != 1:
        rows = None  # custom handlers come first, and decide per sample
    Plan = list[tuple[str | None, bool, Callable | None]]
    plans: dict[tuple, Plan] = {}

    def plan_for(sample, keys) -> Plan:
        """Per tuple position: (field or None when missing, whether to check and decode it,
        its decoder)."""
        plan: Plan = []
        for alts in options:
            for f in alts:
                if f in sample:
                    decoded = f[:2] != "__" and (only is None or f in only)
                    dec = (cache[f] if f in cache else lookup(f)) if decoded else None
                    if rows is not None and dec is not None:
                        ext = f.rpartition(".")[2].lower()
                        dec = rows.decoder(len(plan), ext, dec, modes[0], size)
                    plan.append((f, decoded, dec))
                    break
            else:
                if missing_is_error:
                    raise missing_field(sample, alts)
                plan.append((None, False, None))
        if len(plans) < 64:
            plans[keys] = plan
        return plan

    # The common case (no custom handlers; every position one field, decoded, the first of its
    # alternatives) has a loop of its own once a sample shows it: values looked up and decoded
    # inline, no key tuple, no plan lookup and no call but the decoders'. A sample lacking a
    # field, with a field already decoded, or whose decoding fails goes through row() (the plan's
    # loop), which decides, names the field of an error and applies the policy.
    fast_plan: Plan | None = None

    def row(sample):
        """The sample's tuple, or _SKIP / _STOP (what the policy says of its error)."""
        nonlocal fast_plan
        k = None
        try:
            keys = tuple(sample)
            plan = plans.get(keys)
            if plan is None:
                plan = plan_for(sample, keys)
                if (
                    fast_plan is None
                    and not custom
                    and all(
                        f == alts[0] and decoded and dec is not None
                        for (f, decoded, dec), alts in zip(plan, options)
                    )
                ):
                    fast_plan = plan
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
            return tuple(out)
        except MissingFieldError as exn:
            return _SKIP if policy(sample_context(exn, sample)) else _STOP
        except Exception as exn:
            return _SKIP if policy(sample_context(exn, sample, k, wrap=True)) else _STOP

    it = iter(samples)
    for sample in it:
        first = row(sample)
        if first is _SKIP:
            continue
        if first is _STOP:
            return
        yield first
        if fast_plan is not None:
            break
    else:
        return
    # the rest in the common case's loop (one generator: no frame more per sample)
    names = tuple(f for f, _, _ in fast_plan)
    decs: tuple[Callable, ...] = tuple(dec for _, _, dec in fast_plan if dec is not None)
    raw = _RAW
    got: Any
    if len(names) == 2:
        (k0, k1), (d0, d1) = names, decs
        for sample in it:
            try:
                v0 = sample[k0]
                v1 = sample[k1]
                got = (d0(v0), d1(v1)) if type(v0) in raw and type(v1) in raw else None
            except Exception:  # noqa: BLE001 - row() decodes it again, to name the field
                got = None
            if got is None:
                got = row(sample)
                if got is _SKIP:
                    continue
                if got is _STOP:
                    return
            yield got
        return
    if len(names) == 1:
        ((k0,), (d0,)) = names, decs
        for sample in it:
            try:
                v0 = sample[k0]
                got = (d0(v0),) if type(v0) in raw else None
            except Exception:  # noqa: BLE001 - row() decodes it again, to name the field
                got = None
            if got is None:
                got = row(sample)
                if got is _SKIP:
                    continue
                if got is _STOP:
                    return
            yield got
        return
    get = itemgetter(*names)
    for sample in it:
        try:
            vals = get(sample)
            got = None
            for v in vals:
                if type(v) not in raw:
                    break
            else:
                got = tuple([d(v) for d, v in zip(decs, vals)])
        except Exception:  # noqa: BLE001 - row() decodes it again, to name the field
            got = None
        if got is None:
            got = row(sample)
            if got is _SKIP:
                continue
            if got is _STOP:
                return
        yield got


_SKIP = object()  # row(): the policy skips the sample
_STOP = object()  # row(): the policy ends the stage

_RAW = frozenset((bytes, bytearray, memoryview))  # what the common case's loop decodes
