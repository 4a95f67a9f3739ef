"""The data-order ledger (``WebLoader(..., ledger=)``) and ``tarshards audit``.

A training on 2 real gloo ranks checkpoints, runs on past its checkpoint and dies; it resumes on
3 ranks from the checkpoint (elastic): the audit says every sample came exactly once, and names
what each step held exactly as the ranks saw it. A step deleted from a ledger, or written twice,
makes ``tarshards audit`` exit 1 naming the samples.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from conftest import free_port, run_ranks  # noqa: E402
from test_resume import write_uneven  # noqa: E402

import tarshards  # noqa: E402
from tarshards.cli import main as cli  # noqa: E402
from tarshards.plan.ledger import read_ledger, step_samples  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/
NUM_BATCHES = 48  # 73 samples, readers=12 x batch 2, remainder="pad": 4 batches a reader


def run_world(tmp, world, tag, **cfg):
    cfg = dict(cfg, port=free_port(), num_workers=cfg.get("num_workers", 0))
    return run_ranks(HERE / "audit_rank.py", cfg, world, tmp, tag)


def audit_cli(*args):
    cmd = cli.load_command("audit")
    return CliRunner().invoke(cmd, [str(a) for a in args], prog_name="tarshards audit")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 ranks: checkpoint after 5 steps, 3 more steps, killed; 3 ranks resume from it."""
    tmp = tmp_path_factory.mktemp("audit")
    urls = write_uneven(tmp)
    manifest = tmp / "manifest.json"
    tarshards.build_manifest(urls, str(manifest))
    ledger = tmp / "ledger"
    common = dict(data=str(manifest), ledger=str(ledger), save=str(tmp / "ckpt.pt"))
    first = run_world(tmp, 2, "first", save_at=5, stop=8, **common)
    second = run_world(tmp, 3, "second", load=str(tmp / "ckpt.pt"), **common)
    # what training kept: the first world's steps up to its checkpoint, then the second's
    steps = [[r[k] for r in first] for k in range(5)]
    steps += [[r[k] for r in second] for k in range(len(second[0]))]
    return tmp, manifest, ledger, steps, first


@pytest.mark.timeout(300)
def test_audit_of_a_resumed_elastic_training_says_every_sample_once(trained):
    tmp, manifest, ledger, steps, first = trained
    assert [len(r) for r in first] == [8, 8]  # the 3 steps after the checkpoint were lost
    assert len(steps) == 5 + 13  # (48 - 10) / 3: the last step has one batch of padding
    delivered = [k for step in steps for keys, pads in step for k, p in zip(keys, pads) if not p]
    assert sorted(delivered) == sorted(set(delivered)) and len(delivered) == 73

    report = tarshards.audit(ledger)  # the data: the manifest the ledger names
    assert report.ok, str(report)
    (epoch,) = report.epochs
    assert epoch.complete and epoch.num_batches == NUM_BATCHES
    assert epoch.world_sizes == [2, 3]
    assert epoch.delivered == NUM_BATCHES and epoch.padding == 1
    assert epoch.replayed == 3 * 2  # the lost steps, delivered again after the resume
    result = audit_cli(ledger, manifest)
    assert result.exit_code == 0, result.output
    assert "every sample exactly once" in result.output

    # what each step held, replayed from the plan, is what the ranks saw
    for k, step in enumerate(steps):
        got = step_samples(ledger, k, manifest)
        assert [r["rank"] for r in got["ranks"]] == list(range(len(step)))
        for r, (keys, pads) in zip(got["ranks"], step):
            assert [s["key"] for s in r["samples"]] == keys
            assert [s["pad"] for s in r["samples"]] == pads
    result = audit_cli(ledger, manifest, "--keys", 7)
    assert result.exit_code == 0, result.output
    for rank, (keys, _) in enumerate(steps[7]):
        for key in keys:
            assert f"{key}\trank {rank}\t" in result.output

    # one file for all ranks: the same answer
    merged = tmp / "all.jsonl"
    merged.write_text("".join(p.read_text() for p in sorted(ledger.glob("*.jsonl"))))
    assert tarshards.audit(merged, manifest).ok


def _edited(ledger: Path, out: Path, edit) -> Path:
    out.mkdir()
    for p in ledger.glob("*.jsonl"):
        lines = p.read_text().splitlines(keepends=True)
        (out / p.name).write_text("".join(edit(p.name, lines)))
    return out


def _step_line(lines, world, step):
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if rec.get("world_size") == world and rec.get("step") == step and "batch" in rec:
            return i
    raise AssertionError(f"no step {step} of world {world}")


def test_audit_names_the_samples_of_a_deleted_step(trained, tmp_path):
    _tmp, manifest, ledger, steps, _ = trained

    def drop(name, lines):
        if name == "rank-1.jsonl":
            i = _step_line(lines, 3, 3)  # the second world's step 3 on rank 1
            lines = lines[:i] + lines[i + 1 :]
        return lines

    bad = _edited(ledger, tmp_path / "bad", drop)
    result = audit_cli(bad, manifest)
    assert result.exit_code == 1, result.output
    keys, pads = steps[5 + 3][1]
    missing = [k for k, p in zip(keys, pads) if not p]
    assert missing
    for key in missing:
        assert f"never: {key} " in result.output
    assert "twice:" not in result.output
    report = tarshards.audit(bad, manifest)
    assert not report.ok
    assert sorted(s["key"] for s in report.epochs[0].missing_samples) == sorted(missing)
    # the shards themselves as SPEC: their sidecar indexes give the same names
    result = audit_cli(bad, manifest.parent / "part-{00..07}.tar")
    assert result.exit_code == 1, result.output
    assert all(f"never: {key} " in result.output for key in missing)


def test_audit_names_the_samples_of_a_step_written_twice(trained, tmp_path):
    _tmp, manifest, ledger, steps, _ = trained

    def again(name, lines):
        if name == "rank-0.jsonl":
            lines = [*lines, lines[_step_line(lines, 2, 2)]]  # the first world's step 2, again
        return lines

    bad = _edited(ledger, tmp_path / "bad", again)
    result = audit_cli(bad, manifest, "--json")
    assert result.exit_code == 1, result.output
    (epoch,) = json.loads(result.output)["epochs"]
    keys, pads = steps[2][0]
    assert sorted(s["key"] for s in epoch["duplicate_samples"]) == sorted(
        k for k, p in zip(keys, pads) if not p
    )
    assert epoch["never"] == []


# ---- in one process ---------------------------------------------------------------------------


@pytest.fixture
def data(tmp_path):
    urls = write_uneven(tmp_path)
    tarshards.build_manifest(urls, str(tmp_path / "manifest.json"))
    return tmp_path / "manifest.json"


def _dataset(manifest, **kw):
    from tarshards.torch.adapter import WebDataset

    return (
        WebDataset(str(manifest), shardshuffle=True, seed=1, readers=6, remainder="carry", **kw)
        .shuffle(5)
        .to_tuple("__key__")
        .batched(3)
    )


def test_a_loader_restarted_without_its_state_shows_as_samples_twice(data, tmp_path):
    from tarshards.torch.adapter import WebLoader

    ledger = tmp_path / "ledger-{rank}.jsonl"
    loader = WebLoader(_dataset(data), batch_size=None, ledger=ledger)
    seen = [k for (keys,) in loader for k in keys]
    assert tarshards.audit(tmp_path / "ledger-0.jsonl").ok
    # the classic bug: the model resumed from a checkpoint, the data from the epoch's start
    again = WebLoader(_dataset(data), batch_size=None, ledger=ledger)
    first = [list(keys) for (keys,) in itertools.islice(again, 2)]
    report = tarshards.audit(tmp_path / "ledger-0.jsonl")
    assert not report.ok
    assert sorted(s["key"] for s in report.epochs[0].duplicate_samples) == sorted(
        k for keys in first for k in keys
    )
    assert set(seen) >= {k for keys in first for k in keys}


def test_a_torn_last_record_is_ignored_and_epochs_in_progress_are_not_missing(data, tmp_path):
    from tarshards.torch.adapter import WebLoader

    loader = WebLoader(_dataset(data), batch_size=None, num_workers=2, ledger=tmp_path / "l")
    for n, _ in enumerate(loader):
        if n == 4:
            break
    path = tmp_path / "l" / "rank-0.jsonl"
    with open(path, "a") as f:
        f.write('{"plan":"abc","epoch":0,"st')  # killed mid-write
    report = tarshards.audit(tmp_path / "l", data)
    assert report.ok and report.torn == 1
    (epoch,) = report.epochs
    assert not epoch.complete and epoch.delivered == 5


def test_ledger_needs_a_planned_dataset(data, tmp_path):
    from tarshards.torch.adapter import WebDataset, WebLoader

    with pytest.raises(ValueError, match="readers="):
        WebLoader(WebDataset(str(data)).batched(2), batch_size=None, ledger=tmp_path / "l")


def test_audit_without_data_checks_batches_and_reads_no_shard(data, tmp_path):
    from tarshards.torch.adapter import WebLoader

    loader = WebLoader(_dataset(data), batch_size=None, ledger=tmp_path / "l")
    for _ in range(2):  # two epochs (carry: the second starts with the first's rest)
        list(loader)
    for p in data.parent.glob("*.tar"):
        p.unlink()  # the audit never reads a shard: keys come from the indexes
    report = tarshards.audit(tmp_path / "l")
    assert report.ok and [e.epoch for e in report.epochs] == [0, 1]
    assert read_ledger(tmp_path / "l").steps["epoch"].tolist().count(1) == len(loader)
    got = step_samples(tmp_path / "l", len(loader) + 1)  # epoch 1's second step
    assert got["epoch"] == 1 and all(s["key"] for r in got["ranks"] for s in r["samples"])


def test_records_rewritten_by_other_tools_read_the_same(data, tmp_path):
    """The reader's fast path (the writer's own lines) and its JSON path agree."""
    from tarshards.torch.adapter import WebLoader

    loader = WebLoader(_dataset(data), batch_size=None, ledger=tmp_path / "l")
    for n, _ in enumerate(loader):
        if n == 6:
            break
    mine = read_ledger(tmp_path / "l")
    lines = (tmp_path / "l" / "rank-0.jsonl").read_text().splitlines()
    other = tmp_path / "other.jsonl"  # re-dumped: spaces, keys sorted, records reversed
    other.write_text(
        "".join(json.dumps(json.loads(ln), sort_keys=True) + "\n" for ln in lines[::-1])
    )
    theirs = read_ledger(other)
    assert len(mine) == len(theirs) == 7
    order = theirs.steps["time"].argsort()
    for k, v in mine.steps.items():
        assert v.tolist() == theirs.steps[k][order].tolist(), k
    assert tarshards.audit(other, data).ok


def test_a_mixture_is_audited_batch_by_batch(tmp_path):
    from test_resume import make_mix

    from tarshards.torch.adapter import WebLoader

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sets = (
        write_uneven(tmp_path / "a", [20, 15, 25], prefix="a"),
        write_uneven(tmp_path / "b", [9, 11], prefix="b"),
    )
    loader = WebLoader(make_mix(sets, torch_ds=True), batch_size=None, ledger=tmp_path / "l")
    steps = len(list(loader))
    report = tarshards.audit(tmp_path / "l")
    assert report.ok and report.epochs[0].delivered == steps
    lines = (tmp_path / "l" / "rank-0.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "l" / "rank-0.jsonl").write_text("".join(lines[:2] + lines[3:]))
    report = tarshards.audit(tmp_path / "l")
    assert report.epochs[0].never == [1] and "mixture" in str(report)


def test_samples_left_out_by_remainder_drop_are_declared_not_missing(data, tmp_path):
    from tarshards.torch.adapter import WebDataset, WebLoader

    ds = WebDataset(str(data), seed=2, readers=6, remainder="drop").to_tuple("__key__").batched(3)
    list(WebLoader(ds, batch_size=None, ledger=tmp_path / "l"))
    report = tarshards.audit(tmp_path / "l")
    (epoch,) = report.epochs
    assert report.ok and epoch.dropped == 73 - 72 == ds.dropped_samples(0)
    assert "left out by remainder='drop'" in str(report)
