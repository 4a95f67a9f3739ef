"""Test helpers shipped with tarshards: the one resume check every stateful part must pass.

:func:`check_resume` takes a factory of *runs* (anything iterated once per epoch with
``state_dict()`` / ``load_state_dict()``: a dataset, a ``WebLoader``, a ``StatefulDataLoader``)
and requires that a run saved at any point and restored into a fresh object yields exactly the
batches an uninterrupted run yields from that point on, compared batch by batch through
:func:`batch_digest`.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import random
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from .types import Stateful

__all__ = [
    "batch_digest",
    "check_resume",
    "run_epochs",
    "standard_cuts",
    "write_member_per_sample_gzip",
]


class Resumable(Stateful, Protocol):
    """What :func:`check_resume` drives: iterated once per epoch, with a state to save and load
    (:class:`tarshards.types.Stateful`, the one saveable-state protocol)."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


Cut = tuple[int, int | str]  # (epoch, batches handed out in it, or "end")


def _canonical(x: Any) -> tuple[Any, ...]:
    if isinstance(x, dict):
        return ("d", tuple((k, _canonical(v)) for k, v in sorted(x.items())))
    if isinstance(x, (list, tuple)):
        return ("l", tuple(_canonical(v) for v in x))
    if isinstance(x, (bytes, bytearray, memoryview)):
        return ("b", bytes(x))
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        x = x.detach().cpu().numpy()
        mod = "numpy"
    if mod == "numpy":
        import numpy as np

        arr = np.asarray(x)
        if arr.dtype == object:
            return ("l", tuple(_canonical(v) for v in arr.tolist()))
        return ("a", str(arr.dtype), arr.shape, arr.tobytes())
    if isinstance(x, bool):
        return ("B", x)
    return ("v", x)


def batch_digest(batch: Any) -> str:
    """A hash of a batch's content (tensors, arrays, lists and tuples alike: a tuple and the
    list a DataLoader makes of it hash the same)."""
    return hashlib.sha256(pickle.dumps(_canonical(batch), protocol=4)).hexdigest()[:16]


def run_epochs(run: Iterable[Any], epochs: int) -> list[list[str]]:
    """Iterate ``run`` for ``epochs`` epochs; the digests of each epoch's batches."""
    return [[batch_digest(b) for b in run] for _ in range(epochs)]


def standard_cuts(epoch_lengths: Sequence[int], seed: int = 0) -> list[Cut]:
    """Where to cut: before anything, at a random step, after the last batch (before
    ``StopIteration``), after the epoch ended, and at a random step inside epoch 2."""
    rng = random.Random(seed)
    n0 = epoch_lengths[0]
    cuts: list[Cut] = [
        (0, 0),
        (0, rng.randrange(1, max(2, n0))),
        (0, n0),
        (0, "end"),
    ]
    if len(epoch_lengths) > 1:
        cuts.append((1, rng.randrange(1, max(2, epoch_lengths[1]))))
    return cuts


def _run_until(run: Resumable, epoch: int, step: int | str, sink: list[list[str]]) -> Any:
    """Iterate ``run`` to the cut; returns the state there. ``sink`` gets the digests seen."""
    for e in range(epoch + 1):
        it = iter(run)
        sink.append([])
        if e < epoch:
            for b in it:
                sink[-1].append(batch_digest(b))
            continue
        if step == "end":
            for b in it:
                sink[-1].append(batch_digest(b))
            return run.state_dict()
        if step == 0:
            state = run.state_dict()
            del it
            return state
        for i, b in enumerate(it):
            sink[-1].append(batch_digest(b))
            if i + 1 == step:
                return run.state_dict()
        return run.state_dict()
    raise AssertionError("unreachable")


def check_resume(
    make: Callable[[], Resumable],
    *,
    epochs: int = 2,
    cuts: Iterable[Cut] | None = None,
    resumes_in_one_epoch: int = 0,
    state_roundtrip: Callable[[Any], Any] | None = None,
    reference: list[list[str]] | None = None,
) -> list[list[str]]:
    """Require exact resumption of the runs ``make()`` builds; returns the reference digests.

    For each cut ``(epoch, step)`` (``step`` batches handed out, ``"end"``: after the
    epoch's ``StopIteration``): a run is iterated to the cut, its state saved (through
    ``state_roundtrip``, e.g. ``torch.save``/``torch.load``), a fresh run loads it, and what it
    yields from there through epoch ``epochs - 1`` must equal the uninterrupted run. With
    ``resumes_in_one_epoch=n`` the first epoch is also cut and resumed ``n`` times in a row.
    """
    roundtrip = state_roundtrip or (lambda s: pickle.loads(pickle.dumps(s)))
    ref = reference if reference is not None else run_epochs(make(), epochs)
    flat_ref = [(e, d) for e, ds in enumerate(ref) for d in ds]
    if cuts is None:
        cuts = standard_cuts([len(x) for x in ref])
    for epoch, step in cuts:
        seen: list[list[str]] = []
        state = roundtrip(_run_until(make(), epoch, step, seen))
        fresh = make()
        fresh.load_state_dict(state)
        # what is left: the rest of the cut epoch (empty after "end": the next iter() is the
        # next epoch), then the following epochs
        rest_epochs = epochs - epoch - (1 if step == "end" else 0)
        got = run_epochs(fresh, rest_epochs)
        done = sum(len(x) for x in seen)
        want = flat_ref[done:]
        have: list[tuple[int, str]] = []
        first_epoch = epoch + (1 if step == "end" else 0)
        for i, ds in enumerate(got):
            have.extend((first_epoch + i, d) for d in ds)
        if have != want:
            raise AssertionError(_explain(epoch, step, have, want))
    if resumes_in_one_epoch:
        n0 = len(ref[0])
        rng = random.Random(len(ref[0]))
        points = sorted(rng.sample(range(1, max(2, n0)), min(resumes_in_one_epoch, n0 - 1)))
        digests: list[str] = []
        run = make()
        it = iter(run)
        last = 0
        for p in points:
            for _ in range(p - last):
                digests.append(batch_digest(next(it)))
            last = p
            state = roundtrip(run.state_dict())
            del it
            run = make()
            run.load_state_dict(state)
            it = iter(run)
        digests.extend(batch_digest(b) for b in it)
        if digests != ref[0]:
            raise AssertionError(
                f"resumed {len(points)} times in one epoch at {points}: "
                + _explain(0, points, digests, ref[0])
            )
    return ref


def _explain(epoch: int, step: object, have: Sequence[object], want: Sequence[object]) -> str:
    for i, (a, b) in enumerate(zip(have, want)):
        if a != b:
            return (
                f"cut at epoch {epoch} step {step}: batch {i} after the cut differs "
                f"({a} != {b}); {len(have)} batches after resuming, {len(want)} expected"
            )
    return (
        f"cut at epoch {epoch} step {step}: {len(have)} batches after resuming, "
        f"{len(want)} expected"
    )


def write_member_per_sample_gzip(path: str, samples: Iterable[dict]) -> None:
    """Write ``samples`` as a sample-aligned ``.tgz`` in the layout tarshards wrote before the
    one-member layout: each sample's tar bytes (and the end-of-archive blocks) a gzip member of
    its own (level 6, no name, mtime 0). Streaming readers (``tarfile`` mode ``r|*``,
    webdataset) see only its first sample; tarshards reads all of it and ``tarcheck`` warns.
    For tests and benchmarks of that layout."""
    import io

    from .format.compression import GZIP
    from .write.writer import TarWriter

    plain = io.BytesIO()
    with TarWriter(plain, encoder=False, index=True) as w:
        for s in samples:
            w.write(s)
    data = plain.getvalue()
    index = w.index
    assert index is not None  # index=True
    cuts = [int(x) for x in index.tar_offsets] + [int(index.sample_ends[-1]), len(data)]
    member = GZIP.frame(None)
    with open(path, "wb") as f:
        for a, b in itertools.pairwise(cuts):
            f.write(member(data[a:b]))
