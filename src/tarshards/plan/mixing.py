"""Weighted mixing of planned sources: exact per-epoch quotas, resumable and elastic.

``mix({"a": ds_a, "b": ds_b}, weights={"a": 0.7, "b": 0.3}, readers=V).batched(B)`` is a
planned pipeline (see :mod:`tarshards.plan.cursor`) whose virtual reader ``v`` draws from reader
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

**Mixing by tokens** (``unit="tokens"``, ``cost="tokens"``: a per-sample metadata column of each
source's manifest, see :meth:`tarshards.format.manifest.Manifest.meta`). The weights are shares of
*tokens*, not of samples. Batches keep ``B`` samples; their composition follows the largest
deficit rule: every slot of reader ``v``'s stream goes to the source ``s`` whose deficit
``d_s = (w_s x tokens delivered) - tokens of s delivered`` is largest (ties: the larger weight,
then the first source; a source of weight 0 is never picked), and the next sample of that
source (in its planned, shuffled order) fills it. The plan reads the column only (no data): each
source reader's order is the plan's and its shuffle buffer replayed on positions, the same
order the reader delivers. Bounds, for every prefix of a reader's stream (so at every batch
boundary), with ``M_s`` the largest sample of source ``s``:

- ``d_s >= -(1 - w_s) M_s``: a source is never ahead of its share by a whole sample of its own
  (it is picked only with ``d_s >= 0``, since the deficits sum to 0, and a pick lowers
  ``d_s`` by ``(1 - w_s) c``; otherwise ``d_s`` only grows);
- ``d_s <= sum over r != s of (1 - w_r) M_r`` (the deficits sum to 0): behind by at most one
  sample of each other source, i.e. ``M = max M_r`` with two sources.

A batch's share is the difference of two prefixes: ``|t_s - w_s T| <= sum_r (1 - w_r) M_r`` in
every batch (``T`` its tokens, ``t_s`` those of ``s``), which is at most ``M = max_r M_r`` with
two sources (a convex combination): every batch is within one sample of the weights, and a
reader's stream never drifts (the whole run's error is at most ``V`` times a reader's bound,
however long it runs; with weights that change, the same holds with ``M`` for ``(1 - w) M``).
:class:`TokenDeficits` is the rule on its own (rows of independent streams).

**Within one sample, any number of sources.** With three or more sources the bound above can
exceed ``M`` (equal weights and sizes: ``(k - 1) M``; measured, rarely, up to 1.13 ``M``). So a
batch (or pack) of the rule whose own deficits ``x_s = w_s T - t_s`` leave ``[-M, M]`` is
composed again from its start by :class:`BoundedComposition`, and the carried deficits go on
from the batch actually made:

1. *Rule A* (the largest deficit rule on the carried deficits, as before) takes each slot as
   long as the batch stays in ``S = {sum_s max(x_s, 0) <= M and x_s >= -M for all s}``.
2. At the first pick that would leave ``S``, each source that is ahead (``x_s < 0``) is forgiven
   up to ``cap_s = M - (1 - w_s) M_s`` of its lead (``a_s = min(0, x_s + cap_s)``, and
   ``a_s = x_s`` for the others); from then on *rule B* takes, among the sources with
   ``a_s >= 0``, the one whose next sample would finish first if each source were served
   continuously at the rate of its weight: the smallest ``(c_s - a_s) / w_s`` (worst-case fair
   weighted fair queueing, WF2Q). ``a`` advances as ``x`` does.

Why every prefix of the batch is then within ``M``. Rule A's part stays in ``S``, so
``|x_s| <= M`` there. For rule B, picture the fluid schedule in which, from the switch (its
clock ``tau`` = tokens delivered since), source ``s`` is served at rate ``w_s`` starting from
``a_s``; sample ``p`` of ``s`` occupies the interval ``[S_p, F_p]`` of that clock, and ``s`` can
be picked exactly when its next sample has started (``a_s >= 0``). Lead: a pick needs
``a_s >= 0`` and lowers ``a_s`` by ``(1 - w_s) c <= (1 - w_s) M_s``, so
``x_s >= min(x_s at the switch, -(1 - w_s) M_s - cap_s) >= -M``. Lag: let ``p`` be ``s``'s
next sample at a slot boundary ``tau``, so that ``a_s = w_s (tau - S_p)``. If some sample ``q``
with ``F_q > F_p`` was picked after the switch, take the last, picked at ``sigma``: every
sample picked in ``[sigma + c_q, tau)`` has ``F <= F_p`` and had not started at ``sigma`` (it,
or the earlier sample of its source, would have been picked in place of ``q``), and neither
had ``p``; their intervals and ``p``'s lie in ``(sigma, F_p]``, where the fluid serves
``F_p - sigma`` tokens, so ``tau - sigma - c_q <= F_p - sigma - c_p`` and
``a_s <= (1 - w_s) c_p + w_s c_q <= M``. If there is no such ``q``, the same count from the
switch gives ``tau + c_p <= F_p + sum_r max(a_r, 0)`` at the switch ``<= F_p + M`` (in ``S``),
and ``a_s <= (1 - w_s) c_p + w_s M <= M``. Forgiveness only lowers ``x_s`` below ``a_s``,
by at most ``cap_s``. Hence ``-M <= x_s <= M`` at every slot: **every batch and every pack of
any number of sources is within one sample (``M``) of the weights**. The forgiven lead keeps
what rule A gave a source behind on the whole stream (rule B alone, from a batch's start,
would leave a small source's rare large samples out batch after batch: its share would
drift). Measured (``bench/bench_mix_bound.py``: 300 adversarial mixtures of 3-6 sources, packs
of a few largest samples): the rule's stream cut next-fit leaves packs over one sample in 60 of
them (up to 1.25 ``M``), the plan (with fill-in, below) none; the whole stream's error stays
within 3.1 ``M`` (median 0.89; next-fit: 1.27), and the packs fill 0.995 (median; next-fit
0.953).
With two sources rule A's batches are always within ``M`` and nothing changes. States and
ledgers of mixtures of three or more sources by tokens, and of every mixture of packs (below),
name their rule (``rule=``); those made before it are refused rather than replayed with other
batches.

**Packs over a mixture** (``mix(..., unit="tokens").pack(max_tokens)``, in place of
``.batched(B)``). Each reader's packs are filled slot by slot by the largest deficit rule (as
above, the weights those of the pack's step): the source owed most gives its next sample (in its
planned order). When that sample does not fit in the open pack, the source owed most among those
whose next sample fits and that are not ahead of their share by more than half a sample
(``d_s >= -M / 2``) gives its sample instead (*fill-in*: each source's order is kept, only the
interleaving changes); when no such sample fits, the pack closes and the rule's sample opens
the next one (a sample over the budget is a pack of its own, counted at ``max_tokens``;
``oversize="drop"`` leaves it out, uncounted; ``"raise"``). A source passed over is owed more
and goes first in the next pack. A fill-in pick lowers ``d_s`` from ``>= -M / 2`` by at most
``(1 - w_s) M_s``, so the carried deficits stay within the rule's bounds widened by half a
sample a source, and the stream does not drift (without that condition, a source of small
samples would take the end of every pack: its share grew without bound in a test). Fill-in takes the
fill of a long-tailed 3-source mixture from 0.88 (cutting the rule's stream next-fit, as before)
to 0.99 (``bench/bench_mix_bound.py --time-only``). A pack filled in is no longer a run of the
rule's stream, so each pack (with two sources too) is checked when it closes and, off by more
than one sample, composed again from its start as above (without fill-in: the proof is for the
composition's own order): every pack is within one sample (``M``) of the weights. The packs
are planned from the manifests' columns alone (no data read), each reader's in its own stream;
global pack ``g`` is reader ``g % V``'s pack ``g // V``, so a position counts packs and exact
and elastic resume, workers and ledgers work as for batches. Every reader has ``q`` packs:
``stop="first"``, as many as the reader that first reaches the end of a source has closed;
``"all"``, as many as the last reader needs to see every source entirely (the others go on in
their sources' next passes); ``"cycle"``, as many as the fewest a reader closes before it has
delivered as many samples as its sources hold.

**Weights that follow the step.** ``weights=`` also takes a table ``[(step, weights), ...]``
(steps increasing from 0; ``weights`` a mapping by source name or a sequence in the sources'
order; each applies from its step on, or ``interpolate="linear"`` between the points), or a
function ``step -> weights`` with ``schedule_id="..."`` (a name for the function: a function
cannot be compared across processes, so a saved state records the id and the table, and a state
saved under another schedule is refused). The step of global batch ``g`` of epoch ``e`` is
``(g + global batches of the epochs before e) // batches_per_step``: a pure function of the plan,
the same on any number of ranks, so an exact or elastic resume continues with the weights of its
step. (With R ranks a trainer step takes R global batches: ``batches_per_step=R`` counts the
table in trainer steps; it is part of the plan.) With a schedule the composition of each
reader's batches is its own; with ``stop="first"``/``"all"`` an epoch's length depends on its
weights, so epoch ``e``'s plan follows the plans of the epochs before it (cached).

``repeat={"a": 2}``: source ``a`` may be read twice (each pass a new shuffle) before it counts
as run out (``0.5``: half of one pass); the stopping rules above count in these budgets. A
``.shuffle(n)`` put first on the mixture itself (``mix(...).shuffle(n).batched(B)``) shuffles
each source that has no shuffle of its own, with the same buffer (rebuilt from positions on
resume, as a source's own).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import weakref
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from .._lazy import LazyModule
from ..errors import ResumeError, TarshardsError
from ..pipeline import stages as _stages
from ..pipeline.dataset import DataPipeline, PlannedProgram, bound_args, explicit_rank
from ..types import WorkerInfo
from . import packing as _packing
from .cursor import ReaderStream, ShuffleCore, reader_rng
from .epoch import PlanConfig, ShardTable, plan_for

np = LazyModule("numpy", globals(), "np")

try:  # optional C loop of the largest deficit rule (see _c/deficits.c); numpy is the reference
    from .._deficits import fill as _fill
except ImportError:  # pragma: no cover - without the extension
    _fill = None

if TYPE_CHECKING:
    from ..pipeline.dataset import WebDataset
    from ..pipeline.fusion import Stage
    from .planned import PlannedIterator

__all__ = ["BoundedComposition", "MixedDataset", "TokenDeficits", "batch_quotas", "mix"]

STOPS = ("first", "all", "cycle")
UNITS = ("samples", "tokens")
INTERPOLATIONS = ("step", "linear")


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


# ---------------------------------------------------------------------------------------------
# weights: constant, a table by step, or a named function of the step
# ---------------------------------------------------------------------------------------------


class _Weights:
    """The mixture's weights as a function of the step (normalized rows, one per step)."""

    def __init__(
        self,
        weights: Any,
        names: list[str],
        *,
        schedule_id: str | None,
        interpolate: str,
    ):
        self.names = names
        self.fn: Callable[[int], Any] | None = None
        self.table: list[tuple[int, tuple[float, ...]]] | None = None
        self.schedule_id = schedule_id
        if interpolate not in INTERPOLATIONS:
            raise ValueError(
                f"interpolate must be one of {', '.join(INTERPOLATIONS)}, got {interpolate!r}"
            )
        self.interpolate = interpolate
        self.constant: tuple[float, ...] | None = None
        if weights is None or isinstance(weights, Mapping):
            w = dict(weights) if weights is not None else {n: 1 for n in names}
            if set(w) != set(names):
                raise ValueError(f"weights name {sorted(w)}, sources {sorted(names)}")
            if any(not float(v) > 0 for v in w.values()):
                raise ValueError("weights must be positive")
            self.constant = tuple(float(w[n]) for n in names)
            if interpolate != "step":
                raise ValueError("interpolate= applies to a weights table [(step, weights), ...]")
        elif callable(weights):
            if not isinstance(schedule_id, str) or not schedule_id:
                raise ValueError(
                    "weights given as a function of the step need schedule_id='a name' (a "
                    "function cannot be compared across processes: a saved state records the "
                    "id), or give a table [(step, weights), ...]"
                )
            if interpolate != "step":
                raise ValueError("interpolate= applies to a weights table [(step, weights), ...]")
            self.fn = weights
        else:
            try:
                points = [(int(step), self._row(w, f"step {step}")) for step, w in weights]
            except (TypeError, ValueError) as exn:
                raise type(exn)(
                    "weights: a mapping {source: weight}, a table [(step, weights), ...] or a "
                    f"function of the step with schedule_id= ({exn})"
                ) from None
            if not points or points[0][0] != 0:
                raise ValueError("a weights table starts at step 0: [(0, weights), ...]")
            if any(b[0] <= a[0] for a, b in itertools.pairwise(points)):
                raise ValueError("the steps of a weights table increase")
            if schedule_id is not None:
                raise ValueError("schedule_id= names a function of the step; a table is its own id")
            if len(points) == 1 and min(points[0][1]) > 0:  # (a weight of 0: the plan's guards)
                self.constant = points[0][1]
            else:
                self.table = points

    def _row(self, w: Any, where: str) -> tuple[float, ...]:
        if isinstance(w, Mapping):
            if set(w) != set(self.names):
                raise ValueError(f"{where}: weights name {sorted(w)}, sources {sorted(self.names)}")
            row = [float(w[n]) for n in self.names]
        else:
            row = [float(x) for x in w]
            if len(row) != len(self.names):
                raise ValueError(f"{where}: {len(row)} weights for {len(self.names)} sources")
        if any(not x >= 0 for x in row) or not sum(row) > 0:
            raise ValueError(f"{where}: weights are >= 0 and not all 0, got {row}")
        return tuple(row)

    def last_step(self) -> int | None:
        """The step from which the weights stay as they are (None: a function's)."""
        if self.constant is not None:
            return 0
        if self.table is not None:
            return self.table[-1][0]
        return None

    @property
    def scheduled(self) -> bool:
        return self.constant is None

    def first(self) -> tuple[float, ...]:
        """The weights of step 0 (the constant weights)."""
        if self.constant is not None:
            return self.constant
        return tuple(self.at(np.zeros(1, dtype=np.int64))[0])

    def identity(self) -> Any:
        """What a saved state records of the weights (constant: the list, as before)."""
        if self.constant is not None:
            return list(self.constant)
        if self.table is not None:
            return {
                "table": [[step, list(row)] for step, row in self.table],
                "interpolate": self.interpolate,
            }
        return {"schedule_id": self.schedule_id}

    def at(self, steps):
        """The normalized weights (a float64 array ``(len(steps), k)``) of the steps."""
        steps = np.asarray(steps, dtype=np.int64)
        if self.constant is not None:
            rows = np.broadcast_to(
                np.asarray(self.constant, dtype=np.float64), (len(steps), len(self.names))
            )
        elif self.table is not None:
            at = np.asarray([p for p, _ in self.table], dtype=np.int64)
            tab = np.asarray([r for _, r in self.table], dtype=np.float64)
            i = np.searchsorted(at, steps, side="right") - 1
            rows = tab[i]
            if self.interpolate == "linear":
                nxt = np.minimum(i + 1, len(at) - 1)
                span = np.maximum(at[nxt] - at[i], 1)
                t = np.where(nxt > i, (steps - at[i]) / span, 0.0)[:, None]
                rows = rows + t * (tab[nxt] - rows)
        else:
            fn = self.fn
            assert fn is not None
            cache: dict[int, tuple[float, ...]] = {}
            out = []
            for step in steps.tolist():
                row = cache.get(step)
                if row is None:
                    row = cache[step] = self._row(fn(step), f"weights({step})")
                out.append(row)
            rows = np.asarray(out, dtype=np.float64).reshape(len(steps), len(self.names))
        return rows / rows.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# the largest deficit rule (token shares)
# ---------------------------------------------------------------------------------------------


class TokenDeficits:
    """The largest deficit rule over ``k`` sources for ``rows`` independent streams at once
    (the readers of a mixture; a packer's streams).

    ``deficits[r, s]`` is the tokens source ``s`` is owed in row ``r``: its weight times the
    tokens delivered minus its own tokens delivered. :meth:`pick` names, per row, the source
    with the largest deficit (ties: the larger weight, then the first source; never a source of
    weight 0); :meth:`take` delivers a sample of ``costs[r]`` tokens from source ``picks[r]``.
    Weights are rows of shares summing to 1 (they may change between calls). The deficits sum
    to 0 and stay in ``[-(1 - w_s) M_s, sum over r != s of (1 - w_r) M_r]`` (``M``: the
    largest sample of a source), see :mod:`tarshards.plan.mixing`. Pure float64 arithmetic in a
    fixed order: the same picks on every machine.
    """

    def __init__(self, rows: int, k: int):
        self.deficits = np.zeros((rows, k), dtype=np.float64)
        self._rows = np.arange(rows)

    def pick(self, weights) -> Any:
        key = np.where(weights > 0, self.deficits, -np.inf)
        top = key.max(axis=1, keepdims=True)
        # the largest deficit; among equal ones the largest weight; then the first source
        tied = np.where(key == top, weights, -1.0)
        return tied.argmax(axis=1)

    def take(self, picks, costs, weights) -> None:
        d = self.deficits
        d += weights * costs[:, None]
        d[self._rows, picks] -= costs

    def fill(self, weights, costs: Sequence[Any], pos, slots: int, *, native: bool = True):
        """Run the rule over ``slots`` slots of every row: ``costs[s][r]`` are source ``s``'s
        costs in row ``r`` in delivery order (one ``(rows, n_s)`` float64 array a source),
        ``pos`` (``(rows, k)`` int64) their next positions, advanced here. Returns the source
        of each slot (``(rows, slots)`` int16). In one C loop where the extension is built
        (``native``), with the same picks as :meth:`pick` and :meth:`take` (the reference)."""
        rows = self._rows
        weights = np.ascontiguousarray(weights, dtype=np.float64)
        order = np.empty((len(rows), slots), dtype=np.int16)
        costs = [np.ascontiguousarray(c, dtype=np.float64) for c in costs]
        if native and _fill is not None:
            _fill(self.deficits, weights, tuple(costs), pos, order, slots)
            return order
        c = np.empty(len(rows), dtype=np.float64)
        for t in range(slots):
            picks = self.pick(weights)
            for i, col in enumerate(costs):
                r = rows[picks == i]
                c[r] = col[r, pos[r, i]]
            self.take(picks, c, weights)
            pos[rows, picks] += 1
            order[:, t] = picks
        return order


class BoundedComposition:
    """One batch or pack of one stream, composed so that every source's tokens are within one
    sample of its weight (the rule that stands in for the largest deficit rule where that rule's
    batch, of three or more sources, or pack, filled in, would not be; see
    :mod:`tarshards.plan.mixing`, "Within one sample, any number of sources").

    ``deficits``: the stream's carried deficits before the batch (the largest deficit rule's
    state, advanced here the same way); ``largest``: each source's largest sample ``M_s``;
    ``M = max M_s``. Call :meth:`pick` with the next cost of every source, then :meth:`take`
    with the source taken and the cost counted.

    It follows the largest deficit rule while the batch's own deficits ``x`` (``w_s T - t_s``
    over the batch so far) stay in ``S = {sum_s max(x_s, 0) <= M, x_s >= -M}``; from the first
    pick that would leave ``S`` on, it takes, among the sources with ``x_s >= 0``, the one whose
    next sample would finish first at the rate of its weight (smallest ``(c_s - x_s) / w_s``),
    after forgiving every source that is ahead by up to ``cap_s = M - (1 - w_s) M_s`` of its
    lead. Every prefix of the batch, so its end, then has ``|t_s - w_s T| <= M``.
    """

    def __init__(self, weights, deficits, largest):
        self.w = np.asarray(weights, dtype=np.float64)
        self.deficits = np.array(deficits, dtype=np.float64)
        big = np.asarray(largest, dtype=np.float64)
        self.M = float(big.max()) if len(big) else 0.0
        self.cap = self.M - (1 - self.w) * big
        self.x = np.zeros(len(self.w))  # the batch's own deficits (as the second rule counts)
        self.forgiven = np.zeros(len(self.w))
        self.fair = False
        self._tol = 1e-9 * max(self.M, 1.0)

    def pick(self, costs) -> int:
        """The source of the next slot, given every source's next cost."""
        w, x = self.w, self.x
        c = np.asarray(costs, dtype=np.float64)
        if not self.fair:
            key = np.where(w > 0, self.deficits, -np.inf)
            top = key.max()
            s = int(np.where(key == top, w, -1.0).argmax())
            after = x + w * c[s]
            after[s] -= c[s]
            if np.maximum(after, 0).sum() <= self.M + self._tol and after[s] >= -self.M - self._tol:
                return s
            # leave the largest deficit rule: forgive each lead up to cap_s
            a = np.where(x >= 0, x, np.minimum(0.0, x + self.cap))
            self.forgiven = x - a
            self.x = x = a
            self.fair = True
        ok = (w > 0) & (x >= -self._tol)
        if not ok.any():  # (rounding only: the batch's deficits sum to >= 0)
            ok = (w > 0) & (x == x[w > 0].max())
        finish = np.where(ok, (c - x) / np.where(w > 0, w, 1.0), np.inf)
        first = finish.min()
        return int(np.where(finish == first, w, -1.0).argmax())

    def take(self, s: int, cost: float) -> None:
        self.x += self.w * cost
        self.x[s] -= cost
        self.deficits += self.w * cost
        self.deficits[s] -= cost

    def error(self) -> Any:
        """``w_s T - t_s`` over the batch so far, per source."""
        return self.x + self.forgiven


def _spread(window: Sequence[Any], cap: float) -> int:
    """How many of the smallest positive costs of the first passes make the largest (counted at
    most ``cap``), at least 1: the slots an epoch may take per sample grow with it (a backstop
    against a source that never ends, not a bound that binds)."""
    positive = [w[w > 0] for w in window]
    positive = [x for x in positive if len(x)]
    if not positive:
        return 1
    small = min(float(x.min()) for x in positive)
    big = min(cap, max(float(x.max()) for x in positive))
    return max(1, min(1 << 20, int(np.ceil(big / small))))


# fill-in takes a source at most this many largest samples ahead of its share (d >= -lead M):
# the carried deficits stay in the rule's bounds widened by as much, so the stream does not
# drift (0.5 against 1: the same fill, about half the stream's largest error, in
# bench_mix_bound's mixtures)
_FILL_LEAD = 0.5


def _fits(deficits, weights, window: Sequence[Any], pos, room, rows, lead) -> tuple[Any, Any]:
    """Per row (``rows`` of the windows): the source of largest deficit (ties: the larger
    weight, then the first) among those of weight > 0 and deficit >= ``-lead`` whose next cost
    is at most ``room``, and that cost; -1 where none."""
    n, k = deficits.shape
    nxt = np.full((n, k), np.inf)
    for i, col in enumerate(window):
        have = pos[:, i] < col.shape[1]
        nxt[have, i] = col[rows[have], pos[have, i]]
    key = np.where((weights > 0) & (deficits >= -lead) & (nxt <= room[:, None]), deficits, -np.inf)
    top = key.max(axis=1)
    alt = np.where(key == top[:, None], weights, -1.0).argmax(axis=1)
    alt[~(top > -np.inf)] = -1
    return alt, nxt[np.arange(n), np.maximum(alt, 0)]


def _off_by_more(delta, bound: float) -> Any:
    """The rows whose batch (or pack) deficits ``delta`` leave ``[-bound, bound]``."""
    return np.flatnonzero(np.abs(delta).max(axis=1) > bound * (1 + 1e-9))


def _cost_digest(costs) -> str:
    return (
        "sha256:" + hashlib.sha256(np.ascontiguousarray(costs, dtype="<f8").tobytes()).hexdigest()
    )


# a source's cost column, read from its manifest once per table object (not pickled to workers)
_COSTS: "weakref.WeakKeyDictionary[ShardTable, dict[str, tuple[Any, str]]]" = (
    weakref.WeakKeyDictionary()
)
# the global batches of each epoch of a scheduled mixture, by the plan's identity
_EPOCH_BATCHES: dict[str, list[int]] = {}
# the layouts of recent epochs, by the plan's identity and epoch
_LAYOUTS: "collections.OrderedDict[str, Any]" = collections.OrderedDict()


def _source_costs(table: ShardTable, column: str, name: str) -> tuple[Any, str]:
    got = _COSTS.setdefault(table, {}).get(column)
    if got is not None:
        return got
    try:
        costs = np.asarray(table.meta(column), dtype=np.float64)
    except KeyError:
        raise ValueError(
            f"source {name!r} has no metadata column {column!r}: mixing by tokens plans from "
            "the sources' manifests (record the column with ShardWriter(..., meta=...) or "
            "tarshards.add_meta, and give the source as its manifest)"
        ) from None
    bad = ~(costs >= 0)  # NaN or negative
    if bad.any():
        raise ValueError(
            f"source {name!r}: {int(bad.sum())} samples have no (or a negative) {column!r} "
            f"value, the first at position {int(np.argmax(bad))} in manifest order"
        )
    if len(costs) and not (costs > 0).any():
        raise ValueError(
            f"source {name!r}: every sample has {column!r} 0, so no share of {column!r} can be "
            "given to it (mix it by samples, or give it a column with its cost)"
        )
    got = (costs, _cost_digest(costs))
    _COSTS[table][column] = got
    return got


class _SharedLayout:
    """Constant weights by samples: every reader's batches have the same quotas (as before)."""

    def __init__(self, quotas: tuple[tuple[int, ...], ...]):
        self.quotas = quotas
        self.q = len(quotas)
        starts: list[tuple[int, ...]] = []
        acc = [0] * (len(quotas[0]) if quotas else 0)
        for quota in quotas:
            starts.append(tuple(acc))
            acc = [a + c for a, c in zip(acc, quota)]
        self.starts = starts

    def quota(self, reader: int, j: int) -> Sequence[int]:
        return self.quotas[j]

    def start(self, reader: int, j: int) -> Sequence[int]:
        return self.starts[j]

    def order(self, reader: int, j: int) -> list[int]:
        return _interleave(self.quotas[j])


class _ReaderLayout:
    """Each reader's own batches: counts ``(q, V, k)``, their starts, and (tokens) the order of
    the sources inside each batch ``(q, V, B)``."""

    def __init__(self, counts, orders=None):
        self.counts = counts
        self.q = counts.shape[0]
        self.starts = np.cumsum(counts, axis=0) - counts
        self.orders = orders

    def quota(self, reader: int, j: int) -> Sequence[int]:
        return self.counts[j, reader].tolist()

    def start(self, reader: int, j: int) -> Sequence[int]:
        return self.starts[j, reader].tolist()

    def order(self, reader: int, j: int) -> list[int]:
        if self.orders is not None:
            return self.orders[j, reader].tolist()
        return _interleave(self.quotas_of(reader, j))

    def quotas_of(self, reader: int, j: int) -> list[int]:
        return self.counts[j, reader].tolist()


def _stream_costs(table: ShardTable, costs, cfg: PlanConfig, epoch: int, npass: int, readers: int):
    """The costs of each reader's samples of one pass, in the order the reader delivers them
    (the plan's runs, through the shuffle buffer replayed on positions): ``(V, L)``."""
    plan = plan_for(table, cfg, _pass_epoch(epoch, npass))
    starts = np.concatenate([[0], np.cumsum(table.counts)])
    L = plan.segment_length
    out = np.empty((readers, L), dtype=np.float64)
    for v in range(readers):
        idx = np.concatenate(
            [np.arange(starts[s] + a, starts[s] + b) for s, a, b, _ in plan.segment_runs(v)]
            or [np.zeros(0, dtype=np.int64)]
        )
        if cfg.bufsize > 1:
            core = ShuffleCore(cfg.bufsize, cfg.initial, reader_rng(cfg.seed, plan.epoch, v))
            perm = np.fromiter(core.run(iter(range(L)), prefetch=True), dtype=np.int64, count=L)
            idx = idx[perm]
        out[v] = costs[idx]
    return out


def _plan_layout(
    weights: _Weights,
    B: int,
    V: int,
    lengths: Sequence[int],
    stop: str,
    step0: int,
    batches_per_step: int,
    stream: Callable[[int, int], Any] | None,
    largest: Sequence[float] | None = None,
) -> _ReaderLayout:
    """Each reader's batches of one epoch (see the module's documentation): by samples with a
    schedule (``stream`` None), or by tokens (``stream(i, npass)``: source ``i``'s costs of
    that pass, ``(V, L_i)``; ``largest``: each source's largest cost, by default the largest of
    its first pass). With three or more sources, a batch of the largest deficit rule off by
    more than the largest sample is composed again by :class:`BoundedComposition`."""
    k = len(lengths)
    L = np.asarray(lengths, dtype=np.int64)
    rows = np.arange(V)
    tokens = stream is not None
    if stop == "cycle":
        limit = int(L.sum()) // B
    else:  # (a source of weight 0 for good never ends an epoch stopped by "all")
        limit = max(1, 64 * int(L.sum()) // B + 64)
    counts: list[Any] = []
    orders: list[Any] = []
    pos = np.zeros((V, k), dtype=np.int64)
    get: Callable[[int, int], Any] = stream if stream is not None else lambda i, n: None
    if tokens:
        deficits = TokenDeficits(V, k)
        # source i's costs in a window of its passes (what every row has consumed let go of),
        # and the positions in that window; "first" stops at a source's end: B zeros after it
        pad = np.zeros((V, B if stop == "first" else 0), dtype=np.float64)
        window = [np.concatenate([get(i, 0), pad], axis=1) for i in range(k)]
        npasses = [1] * k
        rel = np.zeros((V, k), dtype=np.int64)
        if largest is None:
            largest = [float(window[i].max(initial=0.0)) for i in range(k)]
        bound = max(largest, default=0.0)
        if stop != "cycle":  # a source of small samples takes many slots per large one
            limit = max(1, 64 * int(L.sum()) * _spread(window, bound) // B + 64)
    else:
        fracsum = np.zeros((V, k), dtype=np.float64)
        given = np.zeros((V, k), dtype=np.int64)
    j = 0
    while True:
        if stop == "all" and (pos >= L).all():
            break
        if j >= limit:
            if stop == "cycle":
                break
            raise ValueError(
                "stop='all': a source never reaches its end (its weight stays 0 in the schedule)"
            )
        steps = (step0 + j * V + rows) // batches_per_step
        W = weights.at(steps)
        last = weights.last_step()
        if stop == "all" and last is not None and int(steps.min()) >= last:
            starved = (W == 0) & (pos < L)  # weight 0 from here on, and not seen entirely
            if starved.any(axis=0).any():
                raise ValueError(
                    "stop='all': a source never reaches its end (its weight stays 0 in the "
                    "schedule)"
                )
        if tokens:
            # every source has B more samples in the buffer (passes after the first for "all"
            # and "cycle"; zeros past the end for "first", which stops there)
            for i in range(k):
                if stop == "first" or int(rel[:, i].max()) + B <= window[i].shape[1]:
                    continue
                done = int(rel[:, i].min())  # (what every row has consumed is let go of)
                parts = [window[i][:, done:]]
                width = parts[0].shape[1]
                while int(rel[:, i].max()) - done + B > width:
                    parts.append(get(i, npasses[i]))
                    npasses[i] += 1
                    width += L[i]
                window[i] = np.concatenate(parts, axis=1)
                rel[:, i] -= done
            before = rel.copy()
            d0 = deficits.deficits.copy()
            order = deficits.fill(W, window, rel, B)
            if k >= 3:  # (two sources: the rule's batches are within one sample, proven)
                for v in _off_by_more(deficits.deficits - d0, bound):
                    rel[v] = before[v]
                    comp = BoundedComposition(W[v], d0[v], largest)
                    for t in range(B):
                        c = [float(window[i][v, rel[v, i]]) for i in range(k)]
                        s = comp.pick(c)
                        comp.take(s, c[s])
                        rel[v, s] += 1
                        order[v, t] = s
                    deficits.deficits[v] = comp.deficits
            quota = rel - before
            pos = pos + quota
        else:
            x = W * B
            base = np.floor(x).astype(np.int64)
            fracsum += x - base
            extra = B - base.sum(axis=1)
            deficit = np.where(W > 0, fracsum - given, -np.inf)
            rank = np.argsort(np.argsort(-deficit, axis=1, kind="stable"), axis=1, kind="stable")
            more = rank < extra[:, None]
            given += more
            quota = base + more
            pos = pos + quota
        if stop == "first" and (pos > L).any():
            break
        counts.append(quota)
        if tokens:
            orders.append(order)
        j += 1
    shape = (len(counts), V, k)
    c = np.asarray(counts, dtype=np.int64).reshape(shape)
    o = np.asarray(orders, dtype=np.int16).reshape(len(counts), V, B) if tokens else None
    return _ReaderLayout(c, o)


class _PackLayout:
    """Each reader's packs of one epoch over a mixture: reader ``v``'s samples in delivery
    order (``src[v]``: the source of each, ``pos[v]``: its position in that source's stream for
    the reader, passes counted on), cut into ``q`` packs at ``offsets[v]``; ``tokens[v]``: each
    sample's cost (counted at most ``max_tokens``)."""

    def __init__(self, src: list, pos: list, offsets: list, tokens: list, left_out: int):
        self.src, self.pos, self.offsets, self.tokens = src, pos, offsets, tokens
        self.q = len(offsets[0]) - 1 if offsets else 0
        self.left_out = int(left_out)

    def pack(self, reader: int, j: int) -> tuple[Any, Any]:
        """(sources, positions) of reader ``reader``'s pack ``j``."""
        a, b = self.offsets[reader][j], self.offsets[reader][j + 1]
        return self.src[reader][a:b], self.pos[reader][a:b]

    def fill(self, max_tokens: float) -> float:
        """Mean fill of the packs (their tokens over ``packs x max_tokens``)."""
        total = sum(float(t[: o[-1]].sum()) for t, o in zip(self.tokens, self.offsets))
        n = self.q * len(self.offsets)
        return total / (n * max_tokens) if n else float("nan")


def _plan_packs(
    weights: _Weights,
    max_tokens: float,
    oversize: str,
    V: int,
    lengths: Sequence[int],
    stop: str,
    step0: int,
    batches_per_step: int,
    stream: Callable[[int, int], Any],
    by_tokens: bool,
    largest: Sequence[float] | None = None,
) -> _PackLayout:
    """Each reader's packs of one epoch (see the module's documentation): the largest deficit
    rule slot by slot in every reader at once (:class:`TokenDeficits`, one row a reader), filled
    in where the rule's sample does not fit (:func:`_fits`); with two or more sources, a pack
    off by more than the largest sample is composed again from its start by
    :class:`BoundedComposition`.
    ``stream(i, npass)``: source ``i``'s costs of that pass in each reader's delivery order,
    ``(V, L_i)``; ``by_tokens``: the rule counts tokens (else samples: every sample counts 1);
    ``largest``: each source's largest cost (by default the largest of its first pass)."""
    k = len(lengths)
    L = np.asarray(lengths, dtype=np.int64)
    rows = np.arange(V)
    rule = TokenDeficits(V, k)
    window = [np.asarray(stream(i, 0), dtype=np.float64) for i in range(k)]
    npasses = [1] * k
    pos = np.zeros((V, k), dtype=np.int64)
    room = np.full(V, float(max_tokens))
    npk = np.zeros(V, dtype=np.int64)  # the open pack of each row (= the packs it closed)
    cnt = np.zeros(V, dtype=np.int64)  # samples in the open pack
    active = np.ones(V, dtype=bool)
    done_at = np.full(V, -1, dtype=np.int64)  # the packs of a row when it stopped
    delivered = np.zeros(V, dtype=np.int64)
    target = -1  # ("all") the packs every row makes, once every row has seen every source
    total = int(L.sum())
    limit = 64 * (total // V + 1) * max(1, k) * _spread(window, float(max_tokens)) + 64
    left_out = np.zeros(V, dtype=np.int64)
    # per slot: (rows, source, position, pack, cost, attempt); a pack composed again leaves its
    # first attempt's slots behind (``void``)
    rec: list[tuple[Any, ...]] = []
    last = weights.last_step()
    check = k >= 2  # (packs filled in are not runs of the rule's stream: checked)
    if by_tokens:
        if largest is None:
            largest = [float(window[i].max(initial=0.0)) for i in range(k)]
        big = np.minimum(np.asarray(largest, dtype=np.float64), float(max_tokens))
    else:
        big = np.ones(k)
    bound = float(big.max(initial=0.0))
    if oversize == "drop":  # (the rule would take such a source's next sample for ever)
        for i in range(k):
            if window[i].size and float(window[i].min()) > max_tokens:
                raise ValueError(
                    f"every sample of source {i} costs more than max_tokens={max_tokens:g}: "
                    "oversize='drop' would leave all of it out"
                )
    # each row's open pack: where it began (to compose it again) and its attempt
    d0, pos0 = rule.deficits.copy(), pos.copy()
    delivered0, left0 = delivered.copy(), left_out.copy()
    attempt = np.zeros(V, dtype=np.int64)
    void: list[int] = []

    def weights_of(packs):
        return weights.at((step0 + packs * V + rows) // batches_per_step)

    def widen(i: int, upto: int) -> None:
        """(``"all"``, ``"cycle"``) the next passes of source ``i`` until position ``upto``."""
        while upto >= window[i].shape[1]:
            window[i] = np.concatenate([window[i], stream(i, npasses[i])], axis=1)
            npasses[i] += 1

    def again(r: int) -> bool:
        """Compose row ``r``'s open pack again from its start (its first attempt closed off by
        more than one sample); False when the row stopped inside it."""
        void.append((r << 32) + int(attempt[r]))
        attempt[r] += 1
        rule.deficits[r], pos[r] = d0[r], pos0[r]
        delivered[r], left_out[r] = delivered0[r], left0[r]
        comp = BoundedComposition(W[r], d0[r], big)
        free, n = float(max_tokens), 0
        for _ in range(limit):
            if stop == "first":
                nxt = [
                    float(window[i][r, pos[r, i]]) if pos[r, i] < L[i] else 0.0 for i in range(k)
                ]
            else:
                for i in range(k):
                    widen(i, int(pos[r, i]))
                nxt = [float(window[i][r, pos[r, i]]) for i in range(k)]
            if by_tokens:
                s = comp.pick([min(c, float(max_tokens)) for c in nxt])
            else:
                s = comp.pick([1.0] * k)
            if stop == "first" and pos[r, s] >= L[s]:
                done_at[r] = npk[r]
                active[r] = False
                break
            c = nxt[s]
            if c > max_tokens and oversize == "raise":
                raise ValueError(
                    f"a sample costs {c:g} > max_tokens={max_tokens:g} "
                    "(oversize='truncate' gives it a pack of its own, 'drop' leaves it out)"
                )
            if c > max_tokens and oversize == "drop":
                pos[r, s] += 1
                left_out[r] += 1
                continue
            cc = min(c, float(max_tokens))
            if n > 0 and cc > free:
                rule.deficits[r] = comp.deficits
                return True
            rec.append(tuple(np.asarray([x]) for x in (r, s, pos[r, s], npk[r], cc, attempt[r])))
            comp.take(s, cc if by_tokens else 1.0)
            pos[r, s] += 1
            free -= cc
            n += 1
            delivered[r] += 1
            if stop == "cycle" and delivered[r] >= total:
                done_at[r] = npk[r]
                active[r] = False
                break
        else:
            raise ValueError(
                f"stop={stop!r}: a source never reaches its end (its weight stays 0 in the "
                "schedule)"
            )
        rule.deficits[r] = comp.deficits
        return False

    W = weights_of(npk)
    t = 0
    while active.any():
        t += 1
        if t > limit:
            raise ValueError(
                f"stop={stop!r}: a source never reaches its end (its weight stays 0 in the "
                "schedule)"
            )
        p = rule.pick(W)
        if stop == "first":  # a row stops before a source would run out
            out = active & (pos[rows, p] >= L[p])
            done_at[out] = npk[out]
            active &= ~out
            if not active.any():
                break
        else:
            for i in range(k):  # the next pass of a source whose window a row reached
                widen(i, int(pos[:, i].max()))
        c = np.zeros(V, dtype=np.float64)
        for i in range(k):
            m = active & (p == i)
            c[m] = window[i][rows[m], pos[m, i]]
        take = active.copy()
        over = take & (c > max_tokens)
        if over.any():
            if oversize == "raise":
                raise ValueError(
                    f"a sample costs {float(c[over].max()):g} > max_tokens={max_tokens:g} "
                    "(oversize='truncate' gives it a pack of its own, 'drop' leaves it out)"
                )
            if oversize == "drop":  # passed over: no pack, no tokens delivered
                r = np.flatnonzero(over)
                pos[r, p[r]] += 1
                left_out[r] += 1
                take &= ~over
        cc = np.minimum(c, max_tokens)
        tight = np.flatnonzero(take & (cnt > 0) & (cc > room))
        if len(tight):
            # the rule's pick does not fit: the source owed most whose next sample fits (its
            # order kept) goes in, before the pack closes
            alt, nxt = _fits(
                rule.deficits[tight],
                W[tight],
                window,
                pos[tight],
                room[tight],
                tight,
                _FILL_LEAD * bound,
            )
            ok = alt >= 0  # (stop="first": the windows hold one pass, so a source at its end
            p[tight[ok]] = alt[ok]  # has no next sample there and is never the one that fits)
            cc[tight[ok]] = nxt[ok]
        close = take & (cnt > 0) & (cc > room)
        if close.any():
            if check:  # a pack off by more than one sample is composed again
                shut = np.flatnonzero(close)
                for r in shut[_off_by_more(rule.deficits[shut] - d0[shut], bound)]:
                    take[r] = False  # (this slot's pick was the first attempt's)
                    if not again(int(r)):
                        close[r] = False
            npk[close] += 1
            room[close] = max_tokens
            cnt[close] = 0
            attempt[close] += 1
            if target >= 0:  # ("all") a row that closed its last pack stops
                end = close & (npk >= target)
                done_at[end] = npk[end]
                active &= ~end
                take &= ~end
            if weights.scheduled:  # a new pack's step: the rows whose weights change pick again
                Wn = weights_of(npk)
                changed = close & (Wn != W).any(axis=1)
                W = Wn
                take &= ~changed
            d0[close], pos0[close] = rule.deficits[close], pos[close]
            delivered0[close], left0[close] = delivered[close], left_out[close]
        if take.any():
            r = np.flatnonzero(take)
            rec.append((r, p[r], pos[r, p[r]], npk[r], cc[r], attempt[r]))
            rule.take(p, np.where(take, cc if by_tokens else 1.0, 0.0), W)
            pos[r, p[r]] += 1
            room[r] -= cc[r]
            cnt[r] += 1
            delivered[r] += 1
        if stop == "cycle":  # a row stops once it has delivered as many samples as it holds
            end = active & (delivered >= total)
            done_at[end] = npk[end]
            active &= ~end
        elif stop == "all" and target < 0:
            seen = (pos >= L).all(axis=1)
            if seen.all():
                target = int((npk + (cnt > 0)).max())
                end = active & (npk >= target)
                done_at[end] = npk[end]
                active &= ~end
            elif (
                last is not None
                and int(((step0 + npk * V + rows) // batches_per_step).min()) >= last
            ):
                starved = (W == 0) & (pos < L)
                if starved.any():
                    raise ValueError(
                        "stop='all': a source never reaches its end (its weight stays 0 in "
                        "the schedule)"
                    )
    q = int(done_at.min()) if V else 0
    if rec:
        cols = [np.concatenate([x[j] for x in rec]) for j in range(6)]
        keep = ~np.isin((cols[0] << 32) + cols[5], np.asarray(void, dtype=np.int64))
        r_all, s_all, p_all, k_all, c_all = (x[keep] for x in cols[:5])
    else:
        r_all = np.zeros(0, dtype=np.int64)
        s_all = p_all = k_all = c_all = np.zeros(0, dtype=np.int64)
    order = np.argsort(r_all, kind="stable")  # by row, each in delivery order
    r_all = r_all[order]
    s_all, p_all, k_all, c_all = (x[order] for x in (s_all, p_all, k_all, c_all))
    bounds = np.searchsorted(r_all, np.arange(V + 1))
    src, poss, offsets, tokens = [], [], [], []
    for v in range(V):
        a, b = int(bounds[v]), int(bounds[v + 1])
        packs = k_all[a:b]
        off = np.searchsorted(packs, np.arange(q + 1))
        src.append(s_all[a:b].astype(np.int16))
        poss.append(p_all[a:b].astype(np.int64))
        offsets.append(off.astype(np.int64))
        tokens.append(c_all[a:b].astype(np.float64))
    return _PackLayout(src, poss, offsets, tokens, int(left_out.sum()))


class MixedDataset(DataPipeline):
    """A weighted mixture of planned sources (see :func:`mix`)."""

    _plan_config: dict[str, Any]  # always set: the mixture is planned

    def __init__(
        self,
        sources: Mapping[str, WebDataset],
        weights: Any = None,
        *,
        readers: int = 60,
        stop: str = "first",
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        unit: str = "samples",
        cost: str = "tokens",
        schedule_id: str | None = None,
        interpolate: str = "step",
        batches_per_step: int = 1,
        repeat: Mapping[str, float] | None = None,
    ):
        # ignore: no source of its own (each epoch's _MixProgram reads the sources)
        super().__init__(None, seed=seed)  # type: ignore[arg-type]
        if not sources:
            raise ValueError("mix() needs at least one source")
        self.names = list(sources)
        self.schedule = _Weights(
            weights, self.names, schedule_id=schedule_id, interpolate=interpolate
        )
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {', '.join(STOPS)}, got {stop!r}")
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
        if not isinstance(cost, str):
            raise TypeError(f"cost= names a metadata column (a str), got {type(cost).__name__}")
        if int(batches_per_step) < 1:
            raise ValueError(f"batches_per_step must be >= 1, got {batches_per_step}")
        self.unit, self.cost = unit, cost
        self.batches_per_step = int(batches_per_step)
        self.weights = self.schedule.first()  # (the weights of step 0)
        self.sources = [_as_source(sources[n], seed) for n in self.names]
        for name, src in zip(self.names, self.sources):
            if not hasattr(src, "table") or not hasattr(src, "_stages"):
                raise TypeError(f"source {name!r} is not a WebDataset")
            if any(st.fn is _stages.batched for st in src.stage_list):
                raise ValueError(
                    f"source {name!r} batches; batch the mixture instead (mix(...).batched(B))"
                )
            if any(st.fn is _stages.shuffle for st in src.stage_list[1:]):
                raise ValueError(f"source {name!r}: put .shuffle(n) before its other stages")
        repeat = dict(repeat) if repeat is not None else {}
        if set(repeat) - set(self.names):
            raise ValueError(f"repeat names {sorted(set(repeat) - set(self.names))}, not sources")
        if any(not float(r) > 0 for r in repeat.values()):
            raise ValueError("repeat counts must be positive")
        #: passes of each source that count before it runs out (1: one pass)
        self.repeats = tuple(float(repeat.get(n, 1)) for n in self.names)
        if unit == "tokens" and any(r != 1 for r in self.repeats):
            raise ValueError("repeat= counts passes of samples: it does not apply to unit='tokens'")
        self.stop = stop
        self.rank = rank
        self.world_size = world_size
        self._plan_config = {"readers": int(readers), "remainder": "drop"}
        PlanConfig(readers=readers)

    # ---- what the plan depends on ------------------------------------------------------------
    def source_config(self, i: int) -> tuple[PlanConfig, list[Stage]]:
        src = self.sources[i]
        stages = list(src.stage_list)
        bufsize, initial, rest = 0, None, stages
        if stages and stages[0].fn is _stages.shuffle:
            args = bound_args(stages[0])
            bufsize, initial, rest = int(args["bufsize"]), args["initial"], stages[1:]
        elif self._stages and self._stages[0].fn is _stages.shuffle:  # the mixture's: each source's
            args = bound_args(self._stages[0])
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

    def pack_parts(self) -> tuple[Any, list[Stage], list[Stage]] | None:
        """(the pack's spec, the stages before ``.pack()``, those after it) of a mixture of
        packs (``mix(...).pack(max_tokens)``); ``None`` for a mixture of batches."""
        stages = self._stages
        i = _packing.unit_stage(stages)
        if i is None:
            return None
        st = stages[i]
        if st.fn is not _packing.pack:
            raise ValueError("a mixture groups its samples with .batched(B) or .pack(max_tokens)")
        if any(other.fn is _stages.batched for other in stages[:i]):
            raise ValueError("a mixture is either batched or packed: .pack() with no .batched()")
        args = bound_args(st)
        cost = args["cost"]
        if cost != self.cost:
            raise ValueError(
                f".pack(cost={cost!r}) of a mixture packs by the mixture's column "
                f"(mix(..., cost={self.cost!r})): name the same column in both"
            )
        # (the arguments were checked when .pack() was called)
        if any(r != 1 for r in getattr(self, "repeats", ())):  # (mix(..., repeat=) where it exists)
            raise ValueError("repeat= does not apply to a mixture of packs (yet)")
        if args["window"] is not None:
            raise ValueError(
                "a mixture's packs are cut next-fit in the order of the largest deficit rule "
                "(which keeps every pack's shares within one sample): window= does not apply"
            )
        spec = _packing.PackSpec(float(args["max_tokens"]), cost, None, args["oversize"])
        return spec, list(stages[:i]), list(stages[i + 1 :])

    def mix_parts(self) -> tuple[int, list[Stage], Stage, list[Stage]]:
        stages = self._stages
        at = [i for i, st in enumerate(stages) if st.fn is _stages.batched]
        if not at:
            raise ValueError("batch the mixture: mix(...).batched(B) (loader batch_size=None)")
        bi = at[0]
        pre = stages[:bi]
        if pre and pre[0].fn is _stages.shuffle:  # each source's shuffle (source_config)
            pre = pre[1:]
        return int(bound_args(stages[bi])["batchsize"]), pre, stages[bi], stages[bi + 1 :]

    def plan_identity(self) -> dict:
        packs = self.pack_parts()
        B = self.mix_parts()[0] if packs is None else None
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
            "weights": self.schedule.identity(),
            **self._token_identity(),
            **({"repeat": list(self.repeats)} if any(r != 1 for r in self.repeats) else {}),
        }

    def _token_identity(self) -> dict:
        """(Mixing by tokens) the unit, the column and a digest of each source's column; a
        schedule's step unit; (packs) their budget. Left out otherwise: states of before load as
        they did."""
        out: dict[str, Any] = {}
        if self.unit == "tokens":
            out.update(
                unit="tokens",
                cost=self.cost,
                costs=[self._costs(i)[1] for i in range(len(self.sources))],
            )
        if self.schedule.scheduled and self.batches_per_step != 1:
            out["batches_per_step"] = self.batches_per_step
        packs = self.pack_parts()
        if packs is not None:  # a mixture of packs: their budget (in place of a batch size)
            out["pack"] = packs[0].identity()
        if packs is not None and len(self.sources) >= 2:
            # packs filled in past the rule's pick, each composed again where it is off by more
            # than one sample (plans made before are refused, not replayed)
            out["rule"] = "fill-in,within-one-sample/1"
        elif len(self.sources) >= 3 and self.unit == "tokens":
            # batches composed again where the largest deficit rule's is off by one sample
            out["rule"] = "within-one-sample/1"
        return out

    def check_plan_state(self, state: dict) -> dict:
        state = super().check_plan_state(state)
        # the keys only a mix by tokens (or a schedule counted in steps of several batches)
        # records: a state that has them does not load into a mix without them either
        mine = self._token_identity()
        diffs = [
            f"{k}: saved {state.get(k, d)!r}, here {mine.get(k, d)!r}"
            for k, d in (
                ("unit", "samples"),
                ("cost", None),
                ("batches_per_step", None),
                ("pack", None),
                ("rule", None),
            )
            if state.get(k, d) != mine.get(k, d)
        ]
        if diffs:
            raise ResumeError("the saved state does not fit this pipeline: " + "; ".join(diffs))
        return state

    def _costs(self, i: int) -> tuple[Any, str]:
        return _source_costs(self.sources[i].table, self.cost, self.names[i])

    def _batch_layout(self, epoch: int, lengths: tuple[int, ...]) -> _SharedLayout | _ReaderLayout:
        """The composition of every reader's batches in ``epoch`` (cached by plan and epoch)."""
        B = self.mix_parts()[0]
        if self.unit == "samples" and not self.schedule.scheduled:
            return _SharedLayout(batch_quotas(self.weights, B, lengths, self.stop))
        key = json.dumps([self.plan_identity(), int(epoch)], sort_keys=True, default=str)
        got = _LAYOUTS.get(key)
        if got is not None:
            _LAYOUTS.move_to_end(key)
            return got
        V = self._plan_config["readers"]
        step0 = self._epoch_origin(epoch) if self.schedule.scheduled else 0
        stream = None
        largest: list[float] | None = None
        if self.unit == "tokens":
            configs = [self.source_config(i)[0] for i in range(len(self.sources))]
            costs = [self._costs(i)[0] for i in range(len(self.sources))]

            def stream(i: int, npass: int):
                return _stream_costs(self.sources[i].table, costs[i], configs[i], epoch, npass, V)

            largest = [float(c.max(initial=0.0)) for c in costs]
        got = _plan_layout(
            self.schedule, B, V, lengths, self.stop, step0, self.batches_per_step, stream, largest
        )
        _LAYOUTS[key] = got
        while len(_LAYOUTS) > 16:
            _LAYOUTS.popitem(last=False)
        return got

    def _pack_layout(self, epoch: int, lengths: tuple[int, ...]) -> _PackLayout:
        """Every reader's packs in ``epoch`` (a mixture of packs; cached by plan and epoch)."""
        packs = self.pack_parts()
        assert packs is not None
        key = json.dumps([self.plan_identity(), int(epoch)], sort_keys=True, default=str)
        got = _LAYOUTS.get(key)
        if got is not None:
            _LAYOUTS.move_to_end(key)
            return got
        V = self._plan_config["readers"]
        step0 = self._epoch_origin(epoch) if self.schedule.scheduled else 0
        configs = [self.source_config(i)[0] for i in range(len(self.sources))]
        costs = [self._costs(i)[0] for i in range(len(self.sources))]

        def stream(i: int, npass: int):
            return _stream_costs(self.sources[i].table, costs[i], configs[i], epoch, npass, V)

        spec = packs[0]
        got = _plan_packs(
            self.schedule,
            spec.max_tokens,
            spec.oversize,
            V,
            lengths,
            self.stop,
            step0,
            self.batches_per_step,
            stream,
            by_tokens=self.unit == "tokens",
            largest=[float(c.max(initial=0.0)) for c in costs],
        )
        _LAYOUTS[key] = got
        while len(_LAYOUTS) > 16:
            _LAYOUTS.popitem(last=False)
        return got

    def _epoch_origin(self, epoch: int) -> int:
        """The global batches of the epochs before ``epoch`` (the steps of a schedule count on
        over epochs)."""
        if epoch <= 0:
            return 0
        V = self._plan_config["readers"]
        if self.stop == "cycle" and self.pack_parts() is None:  # every epoch has as many batches
            B = self.mix_parts()[0]
            lengths = self._lengths(0)
            return int(epoch) * V * (sum(lengths) // B)
        key = json.dumps(self.plan_identity(), sort_keys=True, default=str)
        known = _EPOCH_BATCHES.setdefault(key, [])  # global batches of epochs 0, 1, ...
        while len(known) < epoch:
            known.append(self.epoch_program(len(known)).num_batches)
        return sum(known[: int(epoch)])

    def _lengths(self, epoch: int) -> tuple[int, ...]:
        return self._budgets(
            tuple(
                plan_for(src.table, self.source_config(i)[0], epoch).segment_length
                for i, src in enumerate(self.sources)
            )
        )

    def _budgets(self, lengths: tuple[int, ...]) -> tuple[int, ...]:
        """What each source's reader gives before it counts as run out: ``repeat`` passes of
        its ``lengths``."""
        return tuple(
            int(n * Fraction(r).limit_denominator(1 << 20)) for n, r in zip(lengths, self.repeats)
        )

    def fingerprint_aliases(self) -> dict:
        aliases: dict = {}
        for src in self.sources:
            aliases.update(src.table.aliases)
        return aliases

    def epoch_program(self, epoch: int) -> "_MixProgram | _MixPackProgram":
        if self.pack_parts() is not None:
            return _MixPackProgram(self, epoch)
        return _MixProgram(self, epoch)

    def worker_info(self) -> WorkerInfo:
        return explicit_rank(super().worker_info(), self.rank, self.world_size)

    def source_counts(self, epoch: int | None = None) -> dict[str, int]:
        """The samples each source gives in ``epoch`` (default: the next), all ranks and
        readers together."""
        prog = self.epoch_program(self.next_epoch() if epoch is None else int(epoch))
        layout = prog.layout
        if isinstance(layout, _SharedLayout):
            totals = [
                prog.readers * sum(q[i] for q in layout.quotas) for i in range(len(self.names))
            ]
        elif isinstance(layout, _PackLayout):  # .pack() over the mixture: the packs' samples
            k = len(self.names)
            sums = np.zeros(k, dtype=np.int64)
            for v, cuts in enumerate(layout.offsets):
                src = np.asarray(layout.src[v])[int(cuts[0]) : int(cuts[layout.q])]
                sums += np.bincount(src.astype(np.int64), minlength=k)[:k]
            totals = [int(x) for x in sums]
        else:
            totals = [int(x) for x in layout.counts.sum(axis=(0, 1))]
        return dict(zip(self.names, totals))

    def __len__(self):
        """``with_length(n)`` when set; else the batches this rank yields an epoch."""
        if self._length is not None:
            return self._length
        return self.steps_per_epoch()

    def _source_repr(self) -> str:
        parts = ", ".join(f"{n}: {w:g}" for n, w in zip(self.names, self.weights))
        more = ", scheduled" if self.schedule.scheduled else ""
        if self.unit != "samples":
            more += f", unit={self.unit!r}, cost={self.cost!r}"
        return f"mix({{{parts}}}, stop={self.stop!r}{more})"


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
        self.layout = ds._batch_layout(epoch, ds._budgets(lengths))
        config = ds.plan_config
        assert config is not None  # a planned mixture
        self.readers = config["readers"]
        q = self.layout.q
        if q == 0:
            raise ValueError("the mixture's epoch has no full batch per reader")
        self.num_batches = self.readers * q

    def chain(
        self, it: PlannedIterator, reader: int, batches: list[int], pad: bool = False
    ) -> Iterator[Any]:
        ds = self.ds
        k = len(ds.sources)
        cursors = [_Cursor(ds, i, reader, self.epoch, self.configs[i][0]) for i in range(k)]
        ctx = dict(it.ctx, reader=reader)

        def feeder(i: int) -> Iterator[dict]:
            name = ds.names[i]
            layout = self.layout
            for j in batches:
                n = layout.quota(reader, j)[i]
                if not n:
                    continue
                for sample in cursors[i].read(layout.start(reader, j)[i], n):
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
                    for i in self.layout.order(reader, j):
                        yield next(per_source[i])
            finally:
                for c in cursors:
                    c.close()

        data = ds.run_stages(mixed(), self.pre, ctx, ("reader", reader))
        return iter(ds.run_stages(data, [self.bstage], ctx, ("reader", reader)))

    def pad_chain(self, it: PlannedIterator) -> Iterator[Any]:
        return self.chain(it, 0, [0], pad=True)


_MIX_READ = 32  # the samples of a source taken from its stream at once (packs of a mixture)


class _MixPackProgram(PlannedProgram):
    """An epoch of a mixture of packs: reader ``v``'s pack ``j`` is global batch ``j V + v``;
    each source read in its stream's order, its samples through its own stages, then the
    mixture's, then grouped into the plan's packs."""

    def __init__(self, ds: MixedDataset, epoch: int):
        self.ds, self.epoch = ds, epoch
        parts = ds.pack_parts()
        assert parts is not None
        self.spec, self.pre, self.post = parts
        self.configs = [ds.source_config(i) for i in range(len(ds.sources))]
        lengths = tuple(
            plan_for(src.table, cfg, epoch).segment_length
            for src, (cfg, _) in zip(ds.sources, self.configs)
        )
        if min(lengths) == 0:
            raise ValueError("a source has fewer samples than readers")
        self.layout = ds._pack_layout(epoch, lengths)
        config = ds.plan_config
        assert config is not None  # a planned mixture
        self.readers = config["readers"]
        q = self.layout.q
        if q == 0:
            raise ValueError("the mixture's epoch has no full pack per reader")
        self.num_batches = self.readers * q

    def unit_members(self, g: int) -> list[tuple[str, int]]:
        """``(source name, position in its stream for the reader)`` of each sample of global
        pack ``g``, in delivery order, from the plan alone."""
        if not 0 <= g < self.num_batches:
            raise ValueError(f"global pack {g} outside the epoch's {self.num_batches}")
        src, pos = self.layout.pack(g % self.readers, g // self.readers)
        return [(self.ds.names[s], p) for s, p in zip(src.tolist(), pos.tolist())]

    def chain(
        self, it: PlannedIterator, reader: int, batches: list[int], pad: bool = False
    ) -> Iterator[Any]:
        ds = self.ds
        k = len(ds.sources)
        lay = self.layout
        off = lay.offsets[reader]
        sel = np.concatenate(
            [np.arange(off[j], off[j + 1]) for j in batches] or [np.zeros(0, dtype=np.int64)]
        )
        seq = lay.src[reader][sel]
        positions = lay.pos[reader][sel]
        sizes = [int(off[j + 1] - off[j]) for j in batches]
        cursors = [_Cursor(ds, i, reader, self.epoch, self.configs[i][0]) for i in range(k)]
        ctx = dict(it.ctx, reader=reader)

        def feeder(i: int) -> Iterator[dict]:
            name = ds.names[i]
            mine = positions[seq == i]  # ascending: a source's samples go out in its order
            if not len(mine):
                return
            # runs of consecutive positions, read a few lists at a time (a whole run taken at
            # once would hold the reader's samples of the source until they are used)
            cuts = np.flatnonzero(np.diff(mine) != 1) + 1
            starts = np.concatenate(([0], cuts)).tolist()
            ends = [*cuts.tolist(), len(mine)]
            for a, b in zip(starts, ends):
                for at in range(a, b, _MIX_READ):
                    n = min(_MIX_READ, b - at)
                    for sample in cursors[i].read(int(mine[at]), n):
                        sample["__source__"] = name
                        if pad:
                            sample["__pad__"] = True
                        yield sample

        per_source = [
            iter(ds.sources[i].run_stages(feeder(i), self.configs[i][1], ctx, ("mix", i, reader)))
            for i in range(k)
        ]

        # the samples in the plan's order: the next of each slot's source (no frame a sample)
        mixed = map(next, [per_source[i] for i in seq.tolist()])
        data = iter(ds.run_stages(mixed, self.pre, ctx, ("reader", reader)))
        try:
            for n in sizes:
                got = list(itertools.islice(data, n))
                if len(got) < n:
                    raise TarshardsError(
                        f"a pack of epoch {self.epoch} (reader {reader}) lost samples: a stage "
                        "before .pack() dropped samples (a planned pipeline needs each of them; "
                        "flag bad samples instead)"
                    )
                yield got
        finally:
            for c in cursors:
                c.close()

    def pad_chain(self, it: PlannedIterator) -> Iterator[Any]:
        return self.chain(it, 0, [0], pad=True)


def _as_source(src: Any, seed: int) -> Any:
    """A mixture's source: a ``WebDataset``, or a manifest or view (:class:`~tarshards.
    selection.View`, or the path of either), read as ``WebDataset(src, seed=seed)``."""
    import os

    if isinstance(src, (str, os.PathLike)) or type(src).__name__ in ("Manifest", "View"):
        from ..pipeline.dataset import WebDataset as _WebDataset

        return _WebDataset(src, seed=seed)
    return src


def mix(
    sources: Mapping[str, WebDataset],
    weights: Any = None,
    *,
    readers: int = 60,
    stop: str = "first",
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    unit: str = "samples",
    cost: str = "tokens",
    schedule_id: str | None = None,
    interpolate: str = "step",
    batches_per_step: int = 1,
    repeat: Mapping[str, float] | None = None,
) -> MixedDataset:
    """Mix planned sources with exact per-epoch quotas (see the module's documentation).

    ``weights``: ``{source: weight}`` (default: equal), a table ``[(step, weights), ...]`` or a
    function of the step with ``schedule_id=``. ``unit="tokens"``: the weights are shares of the
    per-sample metadata column ``cost`` (each source's manifest has it), each batch within one
    sample of them. ``interpolate="linear"``: a table's weights change linearly between its
    steps. ``batches_per_step``: global batches per step of the schedule.
    """
    return MixedDataset(
        sources,
        weights,
        readers=readers,
        stop=stop,
        seed=seed,
        rank=rank,
        world_size=world_size,
        unit=unit,
        cost=cost,
        schedule_id=schedule_id,
        interpolate=interpolate,
        batches_per_step=batches_per_step,
        repeat=repeat,
    )
