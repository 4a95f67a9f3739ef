"""Packs over a mixture (``mix(..., unit="tokens").pack(max_tokens)``): every pack's token shares
within one sample of the weights, packs planned from the manifests' columns, exact and elastic
resume, through WebLoader, with weights that follow the step."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import TokenPools, write_token_set
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tarshards import Manifest
from tarshards.errors import ResumeError
from tarshards.pipeline.dataset import WebDataset
from tarshards.plan.mixing import _plan_packs, _Weights, mix
from tarshards.testing import batch_digest, check_resume, run_epochs

MAX = 2048
TABLE = [(0, {"web": 0.8, "code": 0.2}), (6, {"web": 0.3, "code": 0.7})]


# ---- the plan on its own (a pure function of the costs) ---------------------------------------


@st.composite
def plans(draw):
    k = draw(st.integers(2, 3))
    V = draw(st.integers(1, 3))
    weights = draw(st.lists(st.integers(1, 9), min_size=k, max_size=k))
    lengths = draw(st.lists(st.integers(1, 40), min_size=k, max_size=k))
    seed = draw(st.integers(0, 2**31))
    budget = draw(st.sampled_from([50, 300, 1000]))
    stop = draw(st.sampled_from(["first", "all", "cycle"]))
    oversize = draw(st.sampled_from(["truncate", "drop"]))
    return k, V, weights, lengths, seed, budget, stop, oversize


@given(plans())
@settings(max_examples=150, deadline=None)
def test_every_pack_within_one_sample_of_the_weights(case):
    k, V, weights, lengths, seed, budget, stop, oversize = case
    names = [f"s{i}" for i in range(k)]
    W = _Weights(dict(zip(names, weights)), names, schedule_id=None, interpolate="step")
    stream = TokenPools(seed, V, lengths, low=0)
    lay = _plan_packs(
        W, budget, oversize, V, lengths, stop, 0, 1, stream, by_tokens=True,
        largest=stream.largest(),
    )  # fmt: skip
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    eps = 1e-6
    bound = min(float(budget), max(stream.largest()))  # one sample: the largest
    for v in range(V):
        assert len(lay.offsets[v]) == lay.q + 1
        seen = set()
        for j in range(lay.q):
            src, pos = lay.pack(v, j)
            assert len(src)
            costs = np.asarray([stream.cost(v, s, p) for s, p in zip(src, pos)])
            clipped = np.minimum(costs, budget)
            assert clipped.sum() <= budget + eps  # the budget holds (an oversize one: alone)
            assert np.allclose(clipped, lay.tokens[v][lay.offsets[v][j] : lay.offsets[v][j + 1]])
            if oversize == "drop":
                assert (costs <= budget).all()
            T = clipped.sum()
            for s in range(k):
                got = clipped[src == s].sum()
                assert abs(got - w[s] * T) <= bound + eps, (v, j, s, got, T)
            for s, p in zip(src.tolist(), pos.tolist()):
                assert (s, p) not in seen  # a sample of a source's stream at most once
                seen.add((s, p))
        if stop == "first":  # nothing past a source's end
            assert all(p < lengths[s] for s, p in seen)


# ---- through the pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixpacks")
    return {
        "web": write_token_set(
            d, "web", 600, lambda r: min(3000, int(r.pareto(1.2) * 60) + 1), 1, 70
        ),
        "code": write_token_set(d, "code", 300, lambda r: int(r.integers(100, 700)), 2, 50),
    }


def make(sets, weights=None, *, torch_ds=False, readers=4, max_tokens=MAX, **kw):
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as WDS
        from tarshards.torch.adapter import mix as mixer
    else:
        WDS, mixer = WebDataset, mix
    sources = {n: WDS(sets[n], shardshuffle=True, seed=0) for n in ("web", "code")}
    sources["web"] = sources["web"].shuffle(8)
    kw.setdefault("stop", "all")
    kw.setdefault("unit", "tokens")
    return mixer(sources, weights or {"web": 2, "code": 1}, readers=readers, seed=5, **kw).pack(
        max_tokens
    )


def _tokens(pack, name):
    return sum(int(s["tok"]) for s in pack if s["__source__"] == name)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(1, 9), min_size=2, max_size=2),
    st.sampled_from(["first", "all", "cycle"]),
    st.sampled_from([1024, 4096]),
)
def test_token_shares_per_pack_through_the_pipeline(sets, ws, stop, budget):
    weights = {"web": ws[0], "code": ws[1]}
    ds = make(sets, weights, stop=stop, max_tokens=budget)
    packs = list(ds)
    prog = ds.epoch_program(0)
    assert len(packs) == prog.num_batches > 0
    w = {n: x / sum(ws) for n, x in weights.items()}
    M = {n: min(budget, float(Manifest.load(sets[n]).meta("tokens").max())) for n in w}
    bound = max(M.values())  # one sample: the largest
    for g, pack in enumerate(packs):
        total = sum(min(int(s["tok"]), budget) for s in pack)
        assert total <= budget
        assert [(s["__source__"], s["__key__"]) for s in pack] == [
            (n, s["__key__"]) for (n, _), s in zip(prog.unit_members(g), pack)
        ]
        for n in w:
            got = sum(min(int(s["tok"]), budget) for s in pack if s["__source__"] == n)
            assert abs(got - w[n] * total) <= bound + 1e-6, (g, n, got, total)
    keys = [s["__key__"] for p in packs for s in p]
    if stop == "first":
        assert len(keys) == len(set(keys))
    if stop == "all":  # every sample of every source at least once
        assert len(set(keys)) == 900


def test_packs_over_a_mixture_fill_and_beat_sample_weights(sets):
    """Equal token weights give equal tokens per pack (sample weights would not)."""
    ds = make(sets, {"web": 1, "code": 1}, stop="cycle", readers=2)
    packs = list(ds)
    web = sum(_tokens(p, "web") for p in packs)
    code = sum(_tokens(p, "code") for p in packs)
    assert 0.9 < web / code < 1.1
    assert ds.epoch_program(0).layout.fill(MAX) > 0.92  # (small: 900 samples, 2 readers)


def test_mixture_packs_resume_exactly(sets):
    check_resume(lambda: make(sets), epochs=2, cuts=[(0, 3), (0, "end"), (1, 5)])


def test_mixture_packs_schedule_honoured_across_a_resume_through_webloader(sets):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")

    def run():
        return WebLoader(make(sets, TABLE, torch_ds=True), batch_size=None, num_workers=2)

    ref = check_resume(run, epochs=2, cuts=[(0, 9), (1, 3)])
    assert ref == run_epochs(make(sets, TABLE), 2)
    # the packs after step 6 follow the new weights
    packs = list(make(sets, TABLE))
    late = packs[6:]
    web = sum(_tokens(p, "web") for p in late)
    code = sum(_tokens(p, "code") for p in late)
    assert code > web


@pytest.mark.parametrize("workers", [None, 2])
def test_mixture_packs_after_a_world_size_change(sets, workers):
    """2 ranks for 3 steps, then 3 ranks: every global pack is the one the uninterrupted run
    delivers at that position; every sample of the plan once (stop='first')."""
    if workers is not None:
        pytest.importorskip("torch")
        from tarshards.torch.adapter import WebLoader

        warnings.filterwarnings("ignore", message=".*worker processes in total.*")

    def rank(r, n):
        ds = make(sets, stop="first", readers=6, rank=r, world_size=n, torch_ds=bool(workers))
        return ds if workers is None else WebLoader(ds, batch_size=None, num_workers=workers)

    whole = [batch_digest(p) for p in make(sets, stop="first", readers=6)]
    got: dict[int, str] = {}
    saved = None
    for r in range(2):
        run = rank(r, 2)
        it = iter(run)
        for k in range(3):
            got[k * 2 + r] = batch_digest(next(it))
        if r == 0:
            saved = run.state_dict()
        del it
    assert saved is not None
    for r in range(3):
        run = rank(r, 3)
        run.load_state_dict(saved)
        for k, p in enumerate(run):
            g = 6 + k * 3 + r
            if g < len(whole):
                got[g] = batch_digest(p)
            else:
                assert all(s["__pad__"] for s in p)
    assert [got[g] for g in range(len(whole))] == whole


def test_mixture_pack_refusals(sets):
    with pytest.raises(ValueError, match="mixture's column"):
        list(
            mix({n: WebDataset(sets[n]) for n in sets}, unit="tokens", readers=2).pack(MAX, "words")
        )
    with pytest.raises(ValueError, match="batched or packed"):
        list(
            mix({n: WebDataset(sets[n]) for n in sets}, unit="tokens", readers=2)
            .batched(4)
            .pack(MAX)
        )
    with pytest.raises(ValueError, match="window= does not apply"):
        list(mix({n: WebDataset(sets[n]) for n in sets}, readers=2).pack(MAX, window=4))
    packed = make(sets)
    batched = mix(
        {n: WebDataset(sets[n], shardshuffle=True, seed=0) for n in sets},
        unit="tokens",
        readers=4,
        seed=5,
    ).batched(8)
    with pytest.raises(ResumeError):
        packed.load_state_dict(batched.state_dict())
    with pytest.raises(ResumeError):
        make(sets, max_tokens=1024).load_state_dict(packed.state_dict())


def test_packs_of_a_mixture_by_samples_keep_sample_shares(sets):
    """unit="samples": the rule counts samples (the budget is still tokens): every pack within
    one sample of the weights by count."""
    packs = list(make(sets, {"web": 3, "code": 1}, unit="samples", stop="first"))
    assert packs
    for pack in packs:
        web = sum(s["__source__"] == "web" for s in pack)
        assert abs(web - 0.75 * len(pack)) <= 1 + 1e-9
        assert sum(min(int(s["tok"]), MAX) for s in pack) <= MAX


def test_a_ledger_of_mixture_packs_is_audited_pack_by_pack(sets, tmp_path):
    pytest.importorskip("torch")
    import tarshards
    from tarshards.torch.adapter import WebLoader

    ds = make(sets, torch_ds=True).map(lambda pack: [len(pack), pack[0]["__source__"]])
    loader = WebLoader(ds, batch_size=None, ledger=tmp_path / "l")
    steps = 0
    for n, source in loader:  # (the stages after .pack() apply to each pack)
        steps += 1
        assert n >= 1 and source in ("web", "code")
    report = tarshards.audit(tmp_path / "l")
    assert report.ok and report.epochs[0].delivered == steps == ds.epoch_program(0).num_batches
