"""Mixing by tokens (``mix(..., unit="tokens")``) and weights that follow the step: the largest
deficit rule's bounds, planned from the manifests' metadata, exact and elastic resume."""

from __future__ import annotations

import itertools
import random
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tarshards import ShardWriter
from tarshards.errors import ResumeError
from tarshards.pipeline.dataset import WebDataset
from tarshards.plan.mixing import TokenDeficits, mix
from tarshards.testing import batch_digest, check_resume, run_epochs

# ---- the rule on its own -------------------------------------------------------------------


def _bound_checks(weights, streams, slots, batch):
    """Run the rule over ``slots`` slots of one row; check the prefix and per-batch bounds."""
    k = len(weights)
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    M = np.asarray([max(s) for s in streams], dtype=np.float64)
    rule = TokenDeficits(1, k)
    pos = [0] * k
    taken = np.zeros(k)
    at_batch = np.zeros(k)
    batch_total = 0.0
    eps = 1e-6 * float(M.sum())
    upper = [float(sum((1 - w[r]) * M[r] for r in range(k) if r != s)) for s in range(k)]
    per_batch = float(((1 - w) * M).sum())
    for t in range(slots):
        i = int(rule.pick(w[None, :])[0])
        assert w[i] > 0
        c = float(streams[i][pos[i] % len(streams[i])])
        pos[i] += 1
        rule.take(np.asarray([i]), np.asarray([c]), w[None, :])
        taken[i] += c
        total = taken.sum()
        d = w * total - taken
        assert np.allclose(d, rule.deficits[0], atol=eps)
        for s in range(k):  # never ahead by a sample of its own, behind by one of each other
            assert -(1 - w[s]) * M[s] - eps <= d[s] <= upper[s] + eps
        batch_total += c
        if (t + 1) % batch == 0:  # every batch within one sample (two sources: the largest)
            got = taken - at_batch
            err = np.abs(got - w * batch_total)
            assert (err <= per_batch + eps).all()
            if k == 2:
                assert (err <= M.max() + eps).all()
            at_batch = taken.copy()
            batch_total = 0.0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 20), min_size=2, max_size=4).flatmap(
        lambda ws: st.tuples(
            st.just(ws),
            st.lists(
                st.lists(st.integers(0, 3000), min_size=1, max_size=40),
                min_size=len(ws),
                max_size=len(ws),
            ),
        )
    ),
    st.integers(1, 16),
)
def test_token_shares_stay_within_one_sample(case, batch):
    weights, streams = case
    streams = [s if any(s) else [1] + s for s in streams]
    _bound_checks(weights, streams, 200, batch)


def test_rule_never_picks_a_weight_of_zero_and_ties_go_to_the_larger_weight():
    rule = TokenDeficits(2, 3)
    w = np.asarray([[0.0, 0.25, 0.75], [0.5, 0.5, 0.0]])
    assert rule.pick(w).tolist() == [2, 0]
    for _ in range(50):
        p = rule.pick(w)
        assert w[[0, 1], p].min() > 0
        rule.take(p, np.asarray([7.0, 3.0]), w)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(2, 4), st.integers(0, 40))
def test_the_c_loop_makes_the_picks_of_the_numpy_rule(data, rows, k, slots):
    import importlib.util

    if importlib.util.find_spec("tarshards._deficits") is None:
        pytest.skip("the C extension tarshards._deficits is not built")
    weights = np.asarray(
        [data.draw(st.lists(st.integers(0, 4), min_size=k, max_size=k)) for _ in range(rows)],
        dtype=np.float64,
    )
    weights[:, 0] += 1  # (a positive weight in every row)
    weights /= weights.sum(axis=1, keepdims=True)
    cap = slots + 2
    costs = np.asarray(  # small integers: many exact ties between deficits
        data.draw(st.lists(st.integers(0, 6), min_size=k * rows * cap, max_size=k * rows * cap)),
        dtype=np.float64,
    ).reshape(k, rows, cap)
    out = []
    for native in (False, True):
        rule = TokenDeficits(rows, k)
        pos = np.zeros((rows, k), dtype=np.int64)
        order = rule.fill(weights, costs, pos, slots, native=native)
        order2 = rule.fill(weights[::-1].copy()[::-1], costs, pos, 2 if slots else 0, native=native)
        out.append((order.tolist(), order2.tolist(), pos.tolist(), rule.deficits.tobytes()))
    assert out[0] == out[1]


# ---- data sets with a token column ---------------------------------------------------------


def _tokens(sample):
    return int(sample["tok"])


def _write(d, prefix, n, draw, seed, per_shard):
    rng = random.Random(seed)
    with ShardWriter(
        str(d / f"{prefix}-%03d.tar"),
        maxcount=per_shard,
        manifest=str(d / f"{prefix}.json"),
        meta={"tokens": _tokens},
    ) as w:
        for i in range(n):
            w.write({"__key__": f"{prefix}{i:05d}", "tok": str(draw(rng)).encode()})
    return str(d / f"{prefix}.json")


@pytest.fixture(scope="module")
def token_sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokmix")
    long_tail = lambda r: min(4000, int(r.paretovariate(1.2) * 20))  # noqa: E731
    return {
        "web": _write(d, "web", 420, long_tail, 1, 70),
        "code": _write(d, "code", 240, lambda r: r.randint(200, 900), 2, 50),
        "chat": _write(d, "chat", 300, lambda r: r.randint(5, 60), 3, 64),
    }


def make_tok(sets, weights, *, names=("web", "code"), torch_ds=False, B=8, readers=4, **kw):
    if torch_ds:
        from tarshards.torch.adapter import WebDataset as WDS
        from tarshards.torch.adapter import mix as mixer
    else:
        WDS, mixer = WebDataset, mix
    sources = {}
    for n in names:
        ds = WDS(sets[n], shardshuffle=True, seed=0)
        sources[n] = ds.shuffle(6) if n == "web" else ds
    kw.setdefault("unit", "tokens")
    return (
        mixer(sources, weights, readers=readers, seed=5, **kw)
        .to_tuple("__key__", "__source__", "tok", "__pad__")
        .batched(B)
    )


def _shares(batch, names):
    toks = [int(t) for t in batch[2]]
    per = {n: sum(t for s, t in zip(batch[1], toks) if s == n) for n in names}
    return per, sum(toks)


def _largest(sets, names):
    from tarshards import Manifest

    return {n: float(Manifest.load(sets[n]).meta("tokens").max()) for n in names}


def _reference_order(weights, streams, slots):
    """The largest deficit rule in plain Python (one reader; the weights normalized as the
    plan does, so that exact ties fall alike)."""
    total = sum(weights)
    w = [x / total for x in weights]
    d = [0.0] * len(w)
    pos = [0] * len(w)
    out = []
    for _ in range(slots):
        best = max(range(len(w)), key=lambda i: (d[i] if w[i] > 0 else -np.inf, w[i], -i))
        c = streams[best][pos[best]]
        pos[best] += 1
        for r in range(len(w)):
            d[r] += w[r] * c
        d[best] -= c
        out.append(best)
    return out


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(1, 9), min_size=3, max_size=3),
    st.sampled_from([4, 8, 16]),
    st.sampled_from(["first", "all", "cycle"]),
)
def test_token_mix_shares_per_batch_through_the_pipeline(token_sets, ws, B, stop):
    names = ("web", "code", "chat")
    weights = dict(zip(names, ws))
    batches = list(make_tok(token_sets, weights, names=names, B=B, stop=stop))
    assert batches and all(len(b[0]) == B for b in batches)
    w = {n: x / sum(ws) for n, x in weights.items()}
    M = _largest(token_sets, names)
    bound = sum((1 - w[n]) * M[n] for n in names)
    V = 4
    readers: list[list] = [[] for _ in range(V)]
    for g, b in enumerate(batches):  # one process: global batch g is reader g % V's
        per, total = _shares(b, names)
        for n in names:
            assert abs(per[n] - w[n] * total) <= bound + 1e-6, (g, n, per, total)
        readers[g % V].append(b)
    # each reader's delivered sources are exactly the rule run on the tokens each source
    # delivered, in order: the plan's costs are those of the samples the readers read
    for got in readers:
        seq = [s for b in got for s in b[1]]
        streams = [[int(t) for b in got for s, t in zip(b[1], b[2]) if s == n] for n in names]
        ref = _reference_order([float(weights[n]) for n in names], streams, len(seq))
        assert [names[i] for i in ref] == seq
    keys = [k for b in batches for k in b[0]]
    if stop == "first":  # nothing twice
        assert len(set(keys)) == len(keys)


def test_the_plan_is_the_same_without_the_c_loop(token_sets, monkeypatch):
    import tarshards.plan.mixing as mixing

    def run():
        mixing._LAYOUTS.clear()
        ds = make_tok(token_sets, TABLE, stop="all")
        return [batch_digest(b) for b in ds]

    native = run()
    monkeypatch.setattr(mixing, "_fill", None)  # the numpy rule (the reference)
    assert run() == native


def test_sample_weights_give_token_ratios_far_from_the_weights(token_sets):
    """Why: equal sample weights over a long-tailed and a short source give the tokens of the
    long one; equal token weights give equal tokens."""
    names = ("code", "chat")
    eq = {"code": 1, "chat": 1}
    by_samples = list(make_tok(token_sets, eq, names=names, unit="samples", stop="cycle"))
    by_tokens = list(make_tok(token_sets, eq, names=names, stop="cycle"))

    def ratio(batches):
        tot = {n: 0 for n in names}
        for b in batches:
            per, _ = _shares(b, names)
            for n in names:
                tot[n] += per[n]
        return tot["code"] / tot["chat"]

    assert ratio(by_samples) > 8
    assert 0.9 < ratio(by_tokens) < 1.1


def test_token_mix_resumes_exactly(token_sets):
    make = lambda: make_tok(token_sets, {"web": 2, "code": 1}, stop="all")  # noqa: E731
    check_resume(make, epochs=2, cuts=[(0, 3), (0, "end"), (1, 2)])


def test_token_mix_refusals(token_sets, tmp_path):
    with pytest.raises(ValueError, match="unit must be"):
        make_tok(token_sets, None, unit="bytes")
    # a source without the column: named, with how to record one
    with ShardWriter(str(tmp_path / "p-%03d.tar"), manifest=str(tmp_path / "p.json")) as w:
        for i in range(40):
            w.write({"__key__": f"p{i:03d}", "tok": b"3"})
    sets = dict(token_sets, chat=str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match=r"source 'chat' has no metadata column 'tokens'"):
        list(make_tok(sets, None, names=("web", "chat")))
    with pytest.raises(ValueError, match="no metadata column 'words'"):
        list(make_tok(token_sets, None, cost="words"))
    # a state saved by samples does not load into a mix by tokens (nor the reverse)
    by_samples = make_tok(token_sets, None, unit="samples")
    by_tokens = make_tok(token_sets, None)
    with pytest.raises(ResumeError, match="unit"):
        by_tokens.load_state_dict(by_samples.state_dict())
    with pytest.raises(ResumeError, match="unit"):
        by_samples.load_state_dict(by_tokens.state_dict())


# ---- weights that follow the step ----------------------------------------------------------

TABLE = [(0, {"web": 0.9, "code": 0.1}), (10, {"web": 0.2, "code": 0.8})]


def _weight_at(step, table=TABLE):
    row = [w for s, w in table if s <= step][-1]
    return {n: x / sum(row.values()) for n, x in row.items()}


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_schedule_is_followed_over_epochs(token_sets, unit):
    names = ("web", "code")
    epochs = run_epochs_batches(lambda: make_tok(token_sets, TABLE, unit=unit, stop="cycle"), 2)
    flat = [b for e in epochs for b in e]
    assert len(flat) > 20
    M = _largest(token_sets, names)
    for g, b in enumerate(flat):  # the step counts on over epochs
        w = _weight_at(g)
        if unit == "samples":
            n_web = list(b[1]).count("web")
            assert int(8 * w["web"]) <= n_web <= int(8 * w["web"]) + 1, (g, n_web)
        else:
            per, total = _shares(b, names)
            bound = M["web"] + M["code"]  # (weights that change: M for (1 - w) M)
            assert abs(per["web"] - w["web"] * total) <= bound
    # after the switch, by tokens: the code share is near 0.8 over the batches
    per_all = {"web": 0, "code": 0}
    for b in flat[20:]:
        per, _ = _shares(b, names)
        for n in names:
            per_all[n] += per[n]
    if unit == "tokens":
        assert abs(per_all["code"] / sum(per_all.values()) - 0.8) < 0.05


def run_epochs_batches(make, epochs):
    ds = make()
    return [list(ds) for _ in range(epochs)]


def test_linear_interpolation_and_batches_per_step(token_sets):
    table = [(0, [1.0, 0.0]), (8, [0.0, 1.0])]
    batches = list(
        make_tok(token_sets, table, unit="samples", interpolate="linear", stop="cycle", B=8)
    )
    got = [list(b[1]).count("web") for b in batches[:12]]
    assert got[0] == 8 and got[4] == 4 and got[8:] == [0, 0, 0, 0]
    assert all(a >= b for a, b in itertools.pairwise(got))  # web's share falls step by step
    halves = list(
        make_tok(
            token_sets,
            table,
            unit="samples",
            interpolate="linear",
            stop="cycle",
            B=8,
            batches_per_step=2,
        )
    )
    slow = [list(b[1]).count("web") for b in halves[:16]]
    assert slow[0] == slow[1] == 8 and slow[8] == 4 and slow[9] in (4, 5) and slow[16:] == []


def test_schedule_of_a_function_needs_an_id_and_is_checked(token_sets):
    def fn(step):
        return {"web": 1.0, "code": 1.0 + step}

    with pytest.raises(ValueError, match="schedule_id"):
        make_tok(token_sets, fn, unit="samples")
    a = make_tok(token_sets, fn, unit="samples", schedule_id="ramp-v1", stop="cycle")
    b = make_tok(token_sets, fn, unit="samples", schedule_id="ramp-v2", stop="cycle")
    batches = list(a)
    assert list(batches[0][1]).count("web") == 4 and list(batches[30][1]).count("web") == 0
    with pytest.raises(ResumeError, match="weights"):
        b.load_state_dict(a.state_dict())
    # a table is its own identity: another table is refused, the same one loads
    t1 = make_tok(token_sets, TABLE, unit="samples")
    t2 = make_tok(token_sets, [(0, [0.9, 0.1]), (11, [0.2, 0.8])], unit="samples")
    with pytest.raises(ResumeError, match="weights"):
        t2.load_state_dict(t1.state_dict())
    make_tok(token_sets, TABLE, unit="samples").load_state_dict(t1.state_dict())
    for bad, msg in [
        ([(1, [1, 1])], "starts at step 0"),
        ([(0, [1, 1]), (0, [1, 2])], "increase"),
        ([(0, [1, 1, 1])], "3 weights for 2 sources"),
        ([(0, [0, 0])], "not all 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            make_tok(token_sets, bad)
    with pytest.raises(ValueError, match="interpolate= applies to a weights table"):
        make_tok(token_sets, {"web": 1, "code": 1}, interpolate="linear")
    with pytest.raises(ValueError, match="schedule_id= names a function"):
        make_tok(token_sets, TABLE, schedule_id="x")
    # a source of weight 0 for good: "first" and "cycle" run, "all" cannot end and says so
    zero = [(0, [1, 0])]
    for stop in ("first", "cycle"):
        assert {s for b in make_tok(token_sets, zero, stop=stop) for s in b[1]} == {"web"}
    with pytest.raises(ValueError, match="never reaches its end"):
        list(make_tok(token_sets, zero, unit="samples", stop="all"))


def _quiet():
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_schedule_honoured_across_a_resume_through_webloader(token_sets, unit):
    pytest.importorskip("torch")
    from tarshards.torch.adapter import WebLoader

    _quiet()

    def make():
        ds = make_tok(token_sets, TABLE, unit=unit, stop="all", torch_ds=True)
        return WebLoader(ds, batch_size=None, num_workers=2)

    ref = check_resume(make, epochs=2, cuts=[(0, 12), (1, 3)])
    # the cut at 12 lies past the switch at step 10: the resumed batches follow the new weights
    plain = run_epochs(make_tok(token_sets, TABLE, unit=unit, stop="all"), 2)
    assert ref == plain


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_schedule_and_tokens_after_a_world_size_change(token_sets, unit):
    """2 ranks for 4 steps, then 3 ranks: every global batch is the one the uninterrupted run
    delivers at that position (so its weights are those of its step)."""

    def make(**kw):
        return make_tok(token_sets, TABLE, unit=unit, stop="all", readers=6, **kw)

    whole = [batch_digest(b) for b in make()]
    got: dict[int, str] = {}
    saved = None
    for r in range(2):
        ds = make(rank=r, world_size=2)
        it = iter(ds)
        for k in range(4):
            got[k * 2 + r] = batch_digest(next(it))
        if r == 0:
            saved = ds.state_dict()
    assert saved is not None and saved["position"] == 8
    for r in range(3):
        ds = make(rank=r, world_size=3)
        ds.load_state_dict(saved)
        for k, b in enumerate(ds):
            g = 8 + k * 3 + r
            if g < len(whole):
                got[g] = batch_digest(b)
            else:
                assert all(b[3])  # padding past the end
    assert [got[g] for g in range(len(whole))] == whole
