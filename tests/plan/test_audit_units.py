"""``tarshards audit`` over packed and bucketed plans and over plans of a view: the audit replays
the units from the metadata column (no sample read) and names their samples; a deleted step
makes it exit 1 naming the samples of that pack; ``--keys`` lists what a step held. The gloo
test: a packed training over a view on 2 real ranks, killed, resumed on 3: every sample once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

import tarshards  # noqa: E402
from tarshards import ShardWriter, View  # noqa: E402
from tarshards.cli import main as cli  # noqa: E402
from tarshards.plan.ledger import step_samples  # noqa: E402

MAX = 256


def audit_cli(*args):
    cmd = cli.load_command("audit")
    return CliRunner().invoke(cmd, [str(a) for a in args], prog_name="tarshards audit")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Uneven shards of token arrays with a ``tokens`` column; a view keeping 4 samples in 5."""
    d = tmp_path_factory.mktemp("auditunits")
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(3.7, 0.9, 150).astype(int) + 1, 300)
    with ShardWriter(
        str(d / "part-%04d.tar"),
        maxcount=23,
        manifest=str(d / "manifest.json"),
        meta={"tokens": lambda s: len(s["tokens.npy"])},
    ) as sink:
        for i, n in enumerate(lengths):
            sink.write({"__key__": f"k{i:04d}", "tokens.npy": np.zeros(n, dtype=np.int16)})
    manifest = tarshards.Manifest.load(str(d / "manifest.json"))
    keep = [i for i in range(150) if i % 5 != 2]
    View.from_positions(manifest, keep).save(str(d / "keep.view.json"))
    return d / "manifest.json", d / "keep.view.json"


def make(spec, unit, decode=False, **kw):
    from tarshards.torch.adapter import WebDataset

    ds = WebDataset(str(spec), shardshuffle=True, seed=4, readers=4, remainder="pad", **kw)
    if decode:
        ds = ds.decode()
    if unit == "pack":
        return ds.pack(MAX, "tokens", window=4)
    return ds.bucket("tokens", [24, 64], [8, 4, 2])


def train(spec, unit, ledger, workers=0):
    from tarshards.torch.adapter import WebLoader

    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    loader = WebLoader(make(spec, unit), batch_size=None, num_workers=workers, ledger=ledger)
    return [[(s["__key__"], bool(s["__pad__"])) for s in unit_] for unit_ in loader]


def _without_step(ledger: Path, out: Path, step: int) -> Path:
    out.mkdir()
    for p in ledger.glob("*.jsonl"):
        lines = p.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if json.loads(ln).get("step") != step or "batch" not in ln]
        assert len(kept) == len(lines) - 1
        (out / p.name).write_text("".join(kept))
    return out


@pytest.mark.parametrize(
    "unit,on_view", [("pack", False), ("bucket", False), ("pack", True)], ids=str
)
def test_audit_names_the_samples_of_packs_buckets_and_views(data, tmp_path, unit, on_view):
    manifest, view = data
    spec = view if on_view else manifest
    ledger = tmp_path / "ledger"
    steps = train(spec, unit, ledger, workers=2 if on_view else 0)
    keys = [k for st in steps for k, p in st if not p]
    assert len(keys) == len(set(keys))  # (the plan: every sample once)
    if on_view:
        assert len(set(keys)) == 120 and not any(int(k[1:]) % 5 == 2 for k in keys)

    report = tarshards.audit(ledger)  # the data: what the ledger names (the view's file)
    assert report.ok, str(report)
    (epoch,) = report.epochs
    assert epoch.complete and epoch.delivered == len(steps)
    assert audit_cli(ledger, spec).exit_code == 0
    # what each step held, replayed from the plan and the column, is what the loader gave
    for k in (0, len(steps) // 2, len(steps) - 1):
        got = step_samples(ledger, k, spec)
        (rank,) = got["ranks"]
        assert [(s["key"], s["pad"]) for s in rank["samples"]] == steps[k]
    result = audit_cli(ledger, spec, "--keys", 3)
    assert result.exit_code == 0, result.output
    assert [ln.split("\t")[0] for ln in result.output.splitlines()[1:]] == [k for k, _ in steps[3]]

    # a lost step: exit 1, naming exactly the samples of that unit (and their rows in the shard)
    bad = _without_step(ledger, tmp_path / "bad", 3)
    result = audit_cli(bad, spec)
    assert result.exit_code == 1, result.output
    missing = [k for k, p in steps[3] if not p]
    for key in missing:
        assert f"never: {key} " in result.output
    report = tarshards.audit(bad, spec)
    (epoch,) = report.epochs
    assert sorted(s["key"] for s in epoch.missing_samples) == sorted(missing)
    for s in epoch.missing_samples:  # the row is the sample's row in its shard (not the view's)
        assert s["row"] == int(s["key"][1:]) % 23


def test_audit_refuses_other_data_or_another_column(data, tmp_path):
    manifest, view = data
    ledger = tmp_path / "ledger"
    train(view, "pack", ledger)
    result = audit_cli(ledger, manifest)  # the view's plan, the whole manifest given
    assert result.exit_code == 2 and "not the data" in result.output


def test_audit_refuses_packs_of_an_earlier_rule(data, tmp_path):
    """A ledger whose plan's packs another rule made (an earlier tarshards' names no rule) is
    not replayed over this rule's packs (they hold other samples)."""
    manifest, _ = data
    ledger = tmp_path / "ledger"
    train(manifest, "pack", ledger)
    old = tmp_path / "old"
    old.mkdir()
    for p in ledger.glob("*.jsonl"):
        records = [json.loads(ln) for ln in p.read_text().splitlines()]
        for rec in records:
            if isinstance(rec.get("identity"), dict):
                assert rec["identity"].pop("packs")
        (old / p.name).write_text("".join(json.dumps(r) + "\n" for r in records))
    result = audit_cli(old, manifest)
    assert result.exit_code == 2 and "earlier tarshards" in result.output, result.output


def test_packs_over_a_view_read_the_column_at_the_rows_it_keeps(data):
    """The plan's costs are those of the view's samples (not of the manifest's first rows)."""
    _, view = data
    ds = make(view, "pack", decode=True)
    prog = ds.epoch_program(0)
    for g, pack in enumerate(ds):
        tokens = [len(s["tokens.npy"]) for s in pack if not s["__pad__"]]
        assert sum(tokens) <= MAX
        u = g % 4 * prog.q + g // 4  # global pack g is reader g % 4's pack g // 4
        if u < len(prog.units):
            assert sum(tokens) == prog.units.costs[u] > 0


@pytest.mark.timeout(300)
def test_packed_training_over_a_view_on_2_then_3_gloo_ranks(data, tmp_path):
    """2 real gloo ranks train on packs over a view, checkpoint at step 3, run on and die at
    step 5; 3 ranks resume from the checkpoint: every sample of the view exactly once, and
    the audit (from the ledgers and the view's index, no sample read) agrees."""
    from test_ledger import run_world

    _, view = data
    common = dict(data=str(view), ledger=str(tmp_path / "ledger"), save=str(tmp_path / "c.pt"))
    first = run_world(tmp_path, 2, "first", pack=MAX, save_at=3, stop=5, **common)
    second = run_world(tmp_path, 3, "second", pack=MAX, load=str(tmp_path / "c.pt"), **common)
    steps = [[r[k] for r in first] for k in range(3)]
    steps += [[r[k] for r in second] for k in range(len(second[0]))]
    assert len({len(r) for r in second}) == 1  # every rank the same number of steps
    got = [k for step in steps for keys, pads in step for k, p in zip(keys, pads) if not p]
    assert len(got) == len(set(got)) == 120  # the view's samples, each once
    report = tarshards.audit(tmp_path / "ledger")
    assert report.ok, str(report)
    (epoch,) = report.epochs
    assert epoch.world_sizes == [2, 3] and epoch.replayed == 2 * 2
    for k in (2, 3, len(steps) - 1):  # the steps replayed from the plan are the ranks' packs
        held = step_samples(tmp_path / "ledger", k)
        assert [[s["key"] for s in r["samples"]] for r in held["ranks"]] == [
            keys for keys, _ in steps[k]
        ]
