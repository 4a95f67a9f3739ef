"""Weighted mixing of planned sources: exact per-epoch quotas, resumable and elastic.

``mix({"a": ds_a, "b": ds_b}, weights={"a": 0.7, "b": 0.3}, readers=V).batched(B)`` is a
planned pipeline (see :mod:`tarshards.source`) whose virtual reader ``v`` draws from reader
``v`` of every source. The composition of each batch is fixed, not drawn at random: source
``i`` gets ``floor(B w_i)`` or ``ceil(B w_i)`` samples of every batch (within one sample of its
weight), and the extra seats go to the sources that are furthest behind their share, so over
any number of batches each source is within one sample per source of ``w_i`` times the
samples delivered. Inside a batch the sources are interleaved by the same rule.

Stopping rules (``stop=``), per epoch:

- ``"first"``: the epoch ends before any source would run out (no sample twice);
- ``"all"``: it ends once every source has been seen entirely; sources that run out start a new
  pass (a new shuffle) until then;
- ``"cycle"``: the epoch has as many samples as all sources together, each source cycling at
  its weight.

Each source is a ``WebDataset`` with at most a leading ``.shuffle(n)`` and per-sample stages
(``decode``, ``map``, ``to_tuple``...), and no ``.batched()``: batching is the mixture's. Every
sample carries ``__source__`` (the source's name) and ``__pad__``.

``repeat={"a": 2}``: source ``a`` may be read twice (each pass a new shuffle) before it counts
as run out (``0.5``: half of one pass); the stopping rules above count in these budgets. A
``.shuffle(n)`` put first on the mixture itself (``mix(...).shuffle(n).batched(B)``) shuffles
each source that has no shuffle of its own, with the same buffer (rebuilt from positions on
resume, as a source's own).
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from . import stages as _stages
from .pipeline import DataPipeline, PlannedProgram, _bind, _explicit_rank
from .plan import PlanConfig, plan_for
from .source import ReaderStream, reader_rng
from .types import WorkerInfo

if TYPE_CHECKING:
    from .composition import _Stage
    from .pipeline import WebDataset
    from .planned import _PlannedIterator

__all__ = ["MixedDataset", "batch_quotas", "mix"]

STOPS = ("first", "all", "cycle")


def _apportion(
    weights: tuple[float, ...], batch_size: int
) -> tuple[list[int], list[Fraction], int]:
    fr = [Fraction(w) for w in weights]
    total = sum(fr)
    fr = [w / total for w in fr]
    base = [int(w * batch_size) for w in fr]  # floor (weights are positive)
    frac = [w * batch_size - b for w, b in zip(fr, base)]
    return base, frac, batch_size - sum(base)


def _next_quota(
    base: list[int], frac: list[Fraction], extra: int, b: int, given: list[Fraction]
) -> list[int]:
    """Batch ``b``'s counts: the extra seats go to the sources furthest behind."""
    if not extra:
        return list(base)
    deficit = [(b + 1) * f - e for f, e in zip(frac, given)]
    order = sorted(range(len(base)), key=lambda i: (-deficit[i], i))[:extra]
    out = list(base)
    for i in order:
        out[i] += 1
        given[i] += 1
    return out


@functools.lru_cache(maxsize=64)
def batch_quotas(
    weights: tuple[float, ...], batch_size: int, lengths: tuple[int, ...], stop: str
) -> tuple[tuple[int, ...], ...]:
    """The per-batch counts of each source for one reader: a tuple of tuples, one per batch.

    ``lengths`` are the samples each source's reader has per pass.
    """
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {', '.join(STOPS)}, got {stop!r}")
    base, frac, extra = _apportion(weights, batch_size)
    given = [Fraction(0)] * len(base)
    used = [0] * len(base)
    out: list[tuple[int, ...]] = []
    if stop == "cycle":
        nbatches = sum(lengths) // batch_size
    b = 0
    while True:
        if stop == "all" and all(u >= n for u, n in zip(used, lengths)):
            break
        if stop == "cycle" and b >= nbatches:
            break
        quota = _next_quota(base, frac, extra, b, given)
        if stop == "first" and any(u + c > n for u, c, n in zip(used, quota, lengths)):
            break
        out.append(tuple(quota))
        used = [u + c for u, c in zip(used, quota)]
        b += 1
    return tuple(out)


def _interleave(quota: Sequence[int]) -> list[int]:
    """The order of sources inside one batch (smooth weighted round robin)."""
    total = sum(quota)
    credit = [0] * len(quota)
    left = list(quota)
    order: list[int] = []
    for _ in range(total):
        for i, c in enumerate(quota):
            credit[i] += c
        i = max((i for i in range(len(quota)) if left[i]), key=lambda i: (credit[i], -i))
        credit[i] -= total
        left[i] -= 1
        order.append(i)
    return order


def _pass_epoch(epoch: int, npass: int) -> int:
    return epoch if npass == 0 else (epoch + 1) * 1_000_003 + npass


class MixedDataset(DataPipeline):
    """A weighted mixture of planned sources (see :func:`mix`)."""

    _plan_config: dict[str, Any]  # always set: the mixture is planned

    def __init__(
        self,
        sources: Mapping[str, WebDataset],
        weights: Mapping[str, float] | None = None,
        *,
        readers: int = 60,
        stop: str = "first",
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        repeat: Mapping[str, float] | None = None,
    ):
        # ignore: no source of its own (each epoch's _MixProgram reads the sources)
        super().__init__(None, seed=seed)  # type: ignore[arg-type]
        if not sources:
            raise ValueError("mix() needs at least one source")
        self.names = list(sources)
        weights = dict(weights) if weights is not None else {n: 1 for n in self.names}
        if set(weights) != set(self.names):
            raise ValueError(f"weights name {sorted(weights)}, sources {sorted(self.names)}")
        if any(w <= 0 for w in weights.values()):
            raise ValueError("weights must be positive")
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {', '.join(STOPS)}, got {stop!r}")
        self.weights = tuple(float(weights[n]) for n in self.names)
        self.sources = [_as_source(sources[n], seed) for n in self.names]
        for name, src in zip(self.names, self.sources):
            if not hasattr(src, "table") or not hasattr(src, "_stages"):
                raise TypeError(f"source {name!r} is not a WebDataset")
            if any(st.fn is _stages.batched for st in src._stages):
                raise ValueError(
                    f"source {name!r} batches; batch the mixture instead (mix(...).batched(B))"
                )
            if any(st.fn is _stages.shuffle for st in src._stages[1:]):
                raise ValueError(f"source {name!r}: put .shuffle(n) before its other stages")
        repeat = dict(repeat) if repeat is not None else {}
        if set(repeat) - set(self.names):
            raise ValueError(f"repeat names {sorted(set(repeat) - set(self.names))}, not sources")
        if any(not float(r) > 0 for r in repeat.values()):
            raise ValueError("repeat counts must be positive")
        #: passes of each source that count before it runs out (1: one pass)
        self.repeats = tuple(float(repeat.get(n, 1)) for n in self.names)
        self.stop = stop
        self.rank = rank
        self.world_size = world_size
        self._plan_config = {"readers": int(readers), "remainder": "drop"}
        PlanConfig(readers=readers)

    # ---- what the plan depends on ------------------------------------------------------------
    def source_config(self, i: int) -> tuple[PlanConfig, list[_Stage]]:
        src = self.sources[i]
        stages = src._stages
        bufsize, initial, rest = 0, None, stages
        if stages and stages[0].fn is _stages.shuffle:
            args = _bind(stages[0])
            bufsize, initial, rest = int(args["bufsize"]), args["initial"], stages[1:]
        elif self._stages and self._stages[0].fn is _stages.shuffle:  # the mixture's: each source's
            args = _bind(self._stages[0])
            if args.get("rng") is not None or args.get("seed") is not None:
                raise ValueError(
                    "the mixture's shuffle is seeded from the plan: leave out rng=/seed="
                )
            bufsize, initial = int(args["bufsize"]), args["initial"]
        seed = reader_rng(self.seed, 0, i).randrange(1 << 62)
        cfg = PlanConfig(
            seed=seed,
            readers=self._plan_config["readers"],
            batch_size=1,
            remainder="drop",
            shardshuffle=src.shardshuffle,
            bufsize=bufsize,
            initial=None if initial is None else int(initial),
        )
        return cfg, rest

    def mix_parts(self) -> tuple[int, list[_Stage], _Stage, list[_Stage]]:
        stages = self._stages
        at = [i for i, st in enumerate(stages) if st.fn is _stages.batched]
        if not at:
            raise ValueError("batch the mixture: mix(...).batched(B) (loader batch_size=None)")
        bi = at[0]
        pre = stages[:bi]
        if pre and pre[0].fn is _stages.shuffle:  # each source's shuffle (_source_config)
            pre = pre[1:]
        return int(_bind(stages[bi])["batchsize"]), pre, stages[bi], stages[bi + 1 :]

    def plan_identity(self) -> dict:
        B = self.mix_parts()[0]
        parts = []
        for i, name in enumerate(self.names):
            cfg, _ = self.source_config(i)
            parts.append(
                [
                    name,
                    self.sources[i].table.fingerprint,
                    cfg.bufsize,
                    cfg.initial,
                    cfg.shardshuffle,
                ]
            )
        return {
            "fingerprint": "mix",
            "seed": self.seed,
            "readers": self._plan_config["readers"],
            "batch_size": B,
            "remainder": self.stop,
            "shardshuffle": None,
            "bufsize": None,
            "initial": None,
            "sources": parts,
            "weights": list(self.weights),
            **({"repeat": list(self.repeats)} if any(r != 1 for r in self.repeats) else {}),
        }

    def fingerprint_aliases(self) -> dict:
        aliases: dict = {}
        for src in self.sources:
            aliases.update(src.table.aliases)
        return aliases

    def epoch_program(self, epoch: int) -> "_MixProgram":
        return _MixProgram(self, epoch)

    def worker_info(self) -> WorkerInfo:
        return _explicit_rank(super().worker_info(), self.rank, self.world_size)

    def source_counts(self, epoch: int | None = None) -> dict[str, int]:
        """The samples each source gives in ``epoch`` (default: the next), all ranks and
        readers together."""
        prog = self.epoch_program(self.next_epoch() if epoch is None else int(epoch))
        return {
            name: prog.readers * sum(q[i] for q in prog.quotas) for i, name in enumerate(self.names)
        }

    def __len__(self):
        """``with_length(n)`` when set; else the batches this rank yields an epoch."""
        if self._length is not None:
            return self._length
        return self.steps_per_epoch()

    def _source_repr(self) -> str:
        parts = ", ".join(f"{n}: {w:g}" for n, w in zip(self.names, self.weights))
        return f"mix({{{parts}}}, stop={self.stop!r})"


class _Cursor:
    """Source ``i``'s samples for reader ``v`` at any position of its endless passes."""

    def __init__(self, mixds: MixedDataset, i: int, reader: int, epoch: int, cfg: PlanConfig):
        self.src = mixds.sources[i]
        self.cfg, self.reader, self.epoch = cfg, reader, epoch
        self.length = plan_for(self.src.table, cfg, epoch).segment_length
        self.npass: int | None = None
        self.stream: ReaderStream | None = None

    def read(self, position: int, n: int) -> Iterator[dict]:
        while n:
            npass, p = divmod(position, self.length)
            if npass != self.npass:
                if self.stream is not None:
                    self.stream.close()
                plan = plan_for(self.src.table, self.cfg, _pass_epoch(self.epoch, npass))
                make: Any = ReaderStream
                layout = getattr(self.src, "layout", None)
                if layout is not None:  # sidecar columns, a join: the rows merged
                    make = layout.reader_stream
                self.stream = make(
                    self.src.table,
                    plan,
                    self.reader,
                    opener=self.src.open_shard,
                    range_opener=self.src.range_opener(),
                    last_dot=self.src.last_dot,
                )
                self.npass = npass
            s = self.stream
            assert s is not None  # made above on its first pass
            if p != s.position:
                gap = p - s.position
                if s.position == 0 or gap < 0 or gap > 2 * self.cfg.bufsize:
                    s.seek(p)
                else:
                    s.skip(gap)
            take = min(n, self.length - p)
            yield from s.take(take)
            position += take
            n -= take

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class _MixProgram(PlannedProgram):
    def __init__(self, ds: MixedDataset, epoch: int):
        self.ds, self.epoch = ds, epoch
        self.B, self.pre, self.bstage, self.post = ds.mix_parts()
        self.configs = [ds.source_config(i) for i in range(len(ds.sources))]
        lengths = tuple(
            plan_for(src.table, cfg, epoch).segment_length
            for src, (cfg, _) in zip(ds.sources, self.configs)
        )
        if min(lengths) == 0:
            raise ValueError("a source has fewer samples than readers")
        # what each source gives before it counts as run out (repeat=: passes of it)
        budgets = tuple(
            int(n * Fraction(r).limit_denominator(1 << 20)) for n, r in zip(lengths, ds.repeats)
        )
        self.quotas = batch_quotas(ds.weights, self.B, budgets, ds.stop)
        self.readers = ds._plan_config["readers"]
        q = len(self.quotas)
        if q == 0:
            raise ValueError("the mixture's epoch has no full batch per reader")
        self.num_batches = self.readers * q
        starts: list[tuple[int, ...]] = []
        acc = [0] * len(ds.sources)
        for quota in self.quotas:
            starts.append(tuple(acc))
            acc = [a + c for a, c in zip(acc, quota)]
        self.starts = starts

    def chain(
        self, it: _PlannedIterator, reader: int, batches: list[int], pad: bool = False
    ) -> Iterator[Any]:
        ds = self.ds
        k = len(ds.sources)
        cursors = [_Cursor(ds, i, reader, self.epoch, self.configs[i][0]) for i in range(k)]
        ctx = dict(it.ctx, reader=reader)

        def feeder(i: int) -> Iterator[dict]:
            name = ds.names[i]
            for j in batches:
                for sample in cursors[i].read(self.starts[j][i], self.quotas[j][i]):
                    sample["__source__"] = name
                    if pad:
                        sample["__pad__"] = True
                    yield sample

        per_source = [
            iter(ds.sources[i].run_stages(feeder(i), self.configs[i][1], ctx, ("mix", i, reader)))
            for i in range(k)
        ]

        def mixed() -> Iterator[dict]:
            try:
                for j in batches:
                    for i in _interleave(self.quotas[j]):
                        yield next(per_source[i])
            finally:
                for c in cursors:
                    c.close()

        data = ds.run_stages(mixed(), self.pre, ctx, ("reader", reader))
        return iter(ds.run_stages(data, [self.bstage], ctx, ("reader", reader)))

    def pad_chain(self, it: _PlannedIterator) -> Iterator[Any]:
        return self.chain(it, 0, [0], pad=True)


def _as_source(src: Any, seed: int) -> Any:
    """A mixture's source: a ``WebDataset``, or a manifest or view (:class:`~tarshards.
    selection.View`, or the path of either), read as ``WebDataset(src, seed=seed)``."""
    import os

    if isinstance(src, (str, os.PathLike)) or type(src).__name__ in ("Manifest", "View"):
        from .pipeline import WebDataset as _WebDataset

        return _WebDataset(src, seed=seed)
    return src


def mix(
    sources: Mapping[str, WebDataset],
    weights: Mapping[str, float] | None = None,
    *,
    readers: int = 60,
    stop: str = "first",
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    repeat: Mapping[str, float] | None = None,
) -> MixedDataset:
    """Mix planned sources with exact per-epoch quotas (see the module's documentation)."""
    return MixedDataset(
        sources,
        weights,
        readers=readers,
        stop=stop,
        seed=seed,
        rank=rank,
        world_size=world_size,
        repeat=repeat,
    )
