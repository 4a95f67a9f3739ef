"""map_samples, map_shards and map_shard_files on local worker processes; the map command."""

from __future__ import annotations

import functools
import os
import pickle

import pytest
from click.testing import CliRunner
from conftest import write_shards

from tarshards import TarWriter, shard_samples
from tarshards.errors import MissingFieldError, TarshardsError, TarshardsWarning
from tarshards.parallel import (
    Engine,
    format_summary,
    map_samples,
    map_shard_files,
    map_shards,
    shell_sample_fn,
    summarize,
)
from tarshards.pipeline.stages import ignore_and_stop, warn_and_continue

# functions run in worker processes live at module level (picklable by reference)


def label_plus(sample):
    i = int(sample["cls"])
    return {"__key__": sample["__key__"], "cls": str(i + 100).encode(), "jpg": sample["jpg"]}


def square(x):
    return x * x


def fail_on_7(sample):
    if sample["__key__"].endswith("07"):
        raise ZeroDivisionError("seven")
    return label_plus(sample)


def always_die(sample):
    os._exit(5)


def die_on_5(x):
    if x == 5:
        os._exit(7)
    return x


def die_once(sample, marker):
    """Kill this worker process the first time (the marker file says it happened)."""
    if sample["__key__"].endswith("5") and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return label_plus(sample)


def expected(samples):
    return {s["__key__"]: str(int(s["cls"]) + 100).encode() for s in samples}


def read_all(paths):
    out = {}
    for p in paths:
        for s in shard_samples(p):
            assert s["__key__"] not in out, f"duplicate {s['__key__']}"
            out[s["__key__"]] = s["cls"]
    return out


def temp_files(directory):
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------
# map_samples
# ---------------------------------------------------------------------------------------------


def test_map_samples_two_processes_equal_single_process(shards):
    paths, samples = shards
    source = [s for p in paths for s in shard_samples(p)]
    single = list(map_samples(label_plus, source, processes=0))
    for chunksize in (1, 3):
        multi = list(map_samples(label_plus, iter(source), processes=2, chunksize=chunksize))
        assert multi == single
    assert [s["cls"] for s in single] == [str(int(s["cls"]) + 100).encode() for s in samples]


def test_map_samples_unordered_is_a_permutation():
    got = list(map_samples(square, range(50), processes=2, ordered=False, chunksize=2))
    assert sorted(got) == [x * x for x in range(50)]


def test_map_samples_lambda_and_none_dropped():
    pytest.importorskip("cloudpickle", reason="lambdas reach worker processes through cloudpickle")
    got = list(map_samples(lambda x: None if x % 2 else x, range(10), processes=2))
    assert got == [0, 2, 4, 6, 8]


def test_map_samples_error_names_the_sample_key(shards):
    paths, _ = shards
    with pytest.raises(ZeroDivisionError) as info:
        list(map_samples(fail_on_7, shard_samples(paths[0]), processes=2))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "sample000007" in notes and paths[0] in notes
    assert "ZeroDivisionError: seven" in str(info.value.__cause__)  # the worker's traceback


def test_map_samples_handler_skips_or_stops(shards):
    paths, samples = shards
    with pytest.warns(TarshardsWarning, match="seven") as caught:
        got = list(
            map_samples(fail_on_7, shard_samples(paths[0]), processes=2, handler=warn_and_continue)
        )
    assert len(caught) == 1
    keys = [s["__key__"] for s in got]
    assert keys == [s["__key__"] for s in samples[:25] if s["__key__"] != "sample000007"]
    with pytest.warns(TarshardsWarning, match="stopping the stream.*seven"):
        got = list(
            map_samples(
                fail_on_7,
                shard_samples(paths[0]),
                processes=2,
                chunksize=2,
                handler=ignore_and_stop,
            )
        )
    assert [s["__key__"] for s in got] == [f"sample{i:06d}" for i in range(7)]


def test_map_samples_worker_death_is_one_sample_error():
    with pytest.raises(TarshardsError, match="worker process died"):
        list(map_samples(die_on_5, range(10), processes=2, chunksize=3))
    with pytest.warns(TarshardsWarning, match="exit code 7"):
        got = list(
            map_samples(die_on_5, range(12), processes=2, chunksize=3, handler=warn_and_continue)
        )
    assert got == [x for x in range(12) if x != 5]


def test_map_samples_arguments():
    with pytest.raises(TypeError):
        map_samples(42, [])
    with pytest.raises(ValueError):
        map_samples(square, [], processes=-1)
    with pytest.raises(ValueError):
        map_samples(square, [], chunksize=0)


# ---------------------------------------------------------------------------------------------
# map_shards, processes engine
# ---------------------------------------------------------------------------------------------


def test_map_shards_processes_and_rerun(tmp_path):
    paths, samples = write_shards(tmp_path, 4, 10)
    outs = [str(tmp_path / f"out-{i}.tar") for i in range(4)]
    reports = map_shards(label_plus, paths, outs, workers=2)
    assert [r.status for r in reports] == ["done"] * 4
    assert [(r.input, r.output, r.samples_in, r.samples_out) for r in reports] == [
        (p, o, 10, 10) for p, o in zip(paths, outs)
    ]
    assert read_all(outs) == expected(samples)
    # a lost output is redone, the others are skipped
    os.unlink(outs[2])
    with pytest.warns(TarshardsWarning, match="3 of 4 outputs exist already and were kept"):
        reports = map_shards(label_plus, paths, outs, workers=2)
    assert [r.status for r in reports] == ["skipped", "skipped", "done", "skipped"]
    assert read_all(outs) == expected(samples)
    reports = map_shards(label_plus, paths, outs, workers=2, overwrite=True)
    assert [r.status for r in reports] == ["done"] * 4
    assert summarize(reports)["samples_out"] == 40
    assert "done" in format_summary(reports, 1.0)


def test_map_shards_failures_then_rerun_does_only_the_rest(tmp_path):
    paths, samples = write_shards(tmp_path, 4, 10)  # keys ...07 are in shard 0 only
    outs = str(tmp_path / "out-{0..3}.tar")
    with pytest.warns(TarshardsWarning, match="1 of 4 shards failed"):
        reports = map_shards(fail_on_7, paths, outs, workers=2)
    assert [r.status for r in reports] == ["failed", "done", "done", "done"]
    assert "sample000007" in reports[0].error and "ZeroDivisionError" in reports[0].error
    assert not os.path.exists(tmp_path / "out-0.tar")  # never a partial output
    assert temp_files(tmp_path) == []
    with pytest.warns(TarshardsWarning, match="3 of 4 outputs exist already and were kept"):
        reports = map_shards(label_plus, paths, outs, workers=2)
    assert [r.status for r in reports] == ["done", "skipped", "skipped", "skipped"]
    assert read_all([str(tmp_path / f"out-{i}.tar") for i in range(4)]) == expected(samples)


# warn_and_continue's warning is raised in the worker process, which inherits the test's
# filters when it forks: there it must stay a warning (the report keeps its message)
@pytest.mark.filterwarnings("always:skipped:tarshards.errors.TarshardsWarning")
def test_map_shards_handler_skips_samples(tmp_path):
    paths, samples = write_shards(tmp_path, 2, 10)
    outs = [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    reports = map_shards(fail_on_7, paths, outs, workers=1, handler=warn_and_continue)
    assert [r.samples_skipped for r in reports] == [1, 0]
    assert "sample000007" in reports[0].messages[0]
    want = {k: v for k, v in expected(samples).items() if k != "sample000007"}
    assert read_all(outs) == want


def test_map_shards_worker_death_is_retried(tmp_path):
    paths, samples = write_shards(tmp_path, 4, 10)
    outs = [str(tmp_path / f"out-{i}.tar") for i in range(4)]
    fn = functools.partial(die_once, marker=str(tmp_path / "marker"))
    reports = map_shards(fn, paths, outs, workers=2)
    assert [r.status for r in reports] == ["done"] * 4
    assert max(r.attempts for r in reports) == 2
    assert read_all(outs) == expected(samples)
    assert temp_files(tmp_path) == []
    # a function that always kills its worker fails after 1 + retries attempts
    with pytest.warns(TarshardsWarning, match="1 of 1 shards failed"):
        reports = map_shards(
            always_die, [paths[0]], [str(tmp_path / "x.tar")], workers=1, retries=1
        )
    assert reports[0].status == "failed" and "died (exit code 5) 2 time(s)" in reports[0].error
    assert not os.path.exists(tmp_path / "x.tar") and temp_files(tmp_path) == []


def test_map_shards_results_lists_and_none_and_decode(tmp_path):
    pytest.importorskip("cloudpickle", reason="closures reach worker processes through cloudpickle")
    paths, _samples = write_shards(tmp_path, 1, 6)

    def split(sample):  # a closure: sent with cloudpickle
        i = int(sample["cls"])
        if i == 0:
            return None
        return [
            {
                "__key__": f"{sample['__key__']}_{j}",
                "txt": f"{i}:{j}",
                "png": sample["jpg"].resize((4, 4)),
            }
            for j in range(2)
        ]

    out = str(tmp_path / "out.tar")
    [r] = map_shards(split, paths, [out], workers=1, decode="pil")
    assert (r.samples_in, r.samples_out) == (6, 10)
    got = list(shard_samples(out))
    assert [s["__key__"] for s in got][:2] == ["sample000001_0", "sample000001_1"]
    assert got[0]["txt"] == b"1:0" and got[0]["png"][:4] == b"\x89PNG"


def test_map_shards_arguments(tmp_path):
    paths, _ = write_shards(tmp_path, 2, 2)
    with pytest.raises(ValueError, match="2 input shards but 1"):
        map_shards(label_plus, paths, [str(tmp_path / "o.tar")])
    with pytest.raises(ValueError, match="engine"):
        map_shards(label_plus, paths, str(tmp_path / "o{1,2}.tar"), engine="spark")
    with pytest.raises(ValueError, match="same shard"):
        map_shards(label_plus, paths, [str(tmp_path / "o.tar")] * 2)
    with pytest.raises(ValueError, match="address"):
        map_shards(label_plus, paths, str(tmp_path / "o{1,2}.tar"), address="tcp://x:1")


def test_map_shard_files(tmp_path):
    paths, samples = write_shards(tmp_path, 3, 4)
    pairs = [(p, str(tmp_path / f"copy-{i}.tar")) for i, p in enumerate(paths)]
    reports = map_shard_files(copy_shard, pairs, workers=2)
    assert [(r.status, r.samples_out) for r in reports] == [("done", 4)] * 3
    assert [s["__key__"] for p in pairs for s in shard_samples(p[1])] == [
        s["__key__"] for s in samples
    ]
    with pytest.warns(TarshardsWarning, match="3 of 3 outputs exist already and were kept"):
        assert [r.status for r in map_shard_files(copy_shard, pairs)] == ["skipped"] * 3


def copy_shard(inp, out):
    n = 0
    with TarWriter(out) as w:
        for s in shard_samples(inp):
            w.write(s)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# shell commands and the CLI
# ---------------------------------------------------------------------------------------------


def test_shell_sample_fn_semantics():
    fn = pickle.loads(
        pickle.dumps(
            shell_sample_fn(
                'test "$KEY" = d/k1 && tr a-z A-Z < k1.txt > k1.up && echo x > other && rm k1.txt'
            )
        )
    )
    assert fn({"__key__": "d/k1", "txt": b"hello"}) == {
        "__key__": "d/k1",
        "up": b"HELLO",
        "other": b"x\n",
    }
    assert shell_sample_fn("rm *")({"__key__": "k", "txt": b"h"}) is None
    with pytest.raises(RuntimeError, match=r"status 3 on sample 'k'.*oops"):
        shell_sample_fn("echo oops >&2; exit 3")({"__key__": "k", "txt": b"h"})


def test_cli_map_command_and_function(tmp_path, monkeypatch):
    from tarshards.cli.map_cmd import map_cmd

    write_shards(tmp_path, 3, 5)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(
        map_cmd,
        [
            "-c",
            "cat $(basename $KEY).cls > $(basename $KEY).copy",
            "shard-{0000..0002}.tar",
            "-o",
            "c-{0..2}.tar",
            "-p",
            "2",
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "done" in res.output and "15" in res.output
    s = next(shard_samples(str(tmp_path / "c-1.tar")))
    assert s["copy"] == s["cls"] == b"5"
    # -f module:function, rerun skips
    (tmp_path / "mymod.py").write_text(
        "def f(s):\n    return {'__key__': s['__key__'], 'txt': s['jpg'].size}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [
        "-f",
        "mymod:f",
        "--decode",
        "pil",
        "shard-{0000..0002}.tar",
        "-o",
        "f-{0..2}.tar",
        "-p",
        "1",
        "-q",
    ]
    res = runner.invoke(map_cmd, args)
    assert res.exit_code == 0, res.output
    assert next(shard_samples(str(tmp_path / "f-0.tar")))["txt"] == b"(32, 24)"
    res = runner.invoke(map_cmd, args)
    assert res.exit_code == 0, res.output
    assert [ln.split()[1] for ln in res.output.splitlines() if ln.startswith("skipped")] == ["3"]
    # a failing command: exit 1, the failure named, nothing under the final name
    res = runner.invoke(
        map_cmd, ["-c", "exit 4", "shard-0000.tar", "-o", "e.tar", "-q", "--retries", "0"]
    )
    assert res.exit_code == 1
    assert "status 4" in res.output and not os.path.exists(tmp_path / "e.tar")
    # usage errors
    assert runner.invoke(map_cmd, ["shard-0000.tar", "-o", "x.tar"]).exit_code == 2
    assert (
        runner.invoke(map_cmd, ["-c", "true", "shard-{0000..0001}.tar", "-o", "x.tar"]).exit_code
        == 2
    )
    assert (
        runner.invoke(map_cmd, ["-f", "nomodule_zz:f", "shard-0000.tar", "-o", "x.tar"]).exit_code
        == 2
    )


def test_cli_map_registered():
    from tarshards.cli.main import group

    assert "map" in group.commands


def test_inline_processes_zero_needs_no_pickling():
    local = []
    got = list(map_samples(lambda x: local.append(x) or x, range(3), processes=0))
    assert got == [0, 1, 2] and local == [0, 1, 2]


@pytest.mark.parametrize("engine, module", [("dask", "distributed"), ("ray", "ray")])
def test_cluster_engine_missing_gives_install_hint(tmp_path, monkeypatch, engine, module):
    import sys

    from tarshards.errors import MissingDependencyError

    paths, _ = write_shards(tmp_path, 1, 2)
    monkeypatch.setitem(sys.modules, module, None)  # import distributed -> ImportError
    with pytest.raises(MissingDependencyError, match=rf"pip install 'tarshards\[{engine}\]'"):
        map_shards(label_plus, paths, [str(tmp_path / "o.tar")], engine=engine)


# ---------------------------------------------------------------------------------------------
# engines and the error policy
# ---------------------------------------------------------------------------------------------


def missing_on_7(sample):  # a data error (the sample lacks what the function needs)
    if sample["__key__"].endswith("07"):
        raise MissingFieldError("no field 'txt'")
    return label_plus(sample)


class InlineEngine:
    """An engine of our own: the shard jobs in this process, in order."""

    name = "inline"

    def __init__(self):
        self.ran = []

    def run(self, job, pairs, todo, finished):
        for i in todo:
            self.ran.append(i)
            finished(i, job(*pairs[i]))


def test_map_shards_on_an_engine_object(tmp_path):
    paths, samples = write_shards(tmp_path, 3, 4)
    outs = [str(tmp_path / f"out-{i}.tar") for i in range(3)]
    map_shards(label_plus, paths[:1], outs[:1], workers=1)  # the first output exists already
    engine = InlineEngine()
    assert isinstance(engine, Engine)
    with pytest.warns(TarshardsWarning, match="1 of 3 outputs exist already and were kept"):
        reports = map_shards(label_plus, paths, outs, engine=engine)
    assert engine.ran == [1, 2]
    assert [r.status for r in reports] == ["skipped", "done", "done"]
    assert read_all(outs) == expected(samples)
    with pytest.raises(ValueError, match="engine must be one of"):
        map_shards(label_plus, paths, outs, engine="threads")
    with pytest.raises(ValueError, match="retries"):
        map_shards(label_plus, paths, outs, retries=-1)


def test_map_shards_on_error_modes(tmp_path):
    paths, _samples = write_shards(tmp_path, 1, 10)
    out = str(tmp_path / "a.tar")
    with pytest.warns(TarshardsWarning, match="1 of 1 shards failed"):
        [r] = map_shards(missing_on_7, paths, [out], engine=InlineEngine())
    assert r.status == "failed" and "no field 'txt'" in r.error and not os.path.exists(out)
    [r] = map_shards(missing_on_7, paths, [out], engine=InlineEngine(), on_error="skip")
    assert (r.status, r.samples_skipped) == ("done", 1)
    assert "sample000007" in r.messages[0]
    # "skip" is for data errors: a bug in the function still fails the shard
    with pytest.warns(TarshardsWarning, match="1 of 1 shards failed"):
        [r] = map_shards(
            fail_on_7, paths, [str(tmp_path / "b.tar")], engine=InlineEngine(), on_error="skip"
        )
    assert r.status == "failed" and "ZeroDivisionError: seven" in r.error


def test_map_samples_on_error_skip_is_for_data_errors(shards):
    paths, _samples = shards
    got = list(map_samples(missing_on_7, shard_samples(paths[0]), processes=2, on_error="skip"))
    assert len(got) == 24
    with pytest.raises(ZeroDivisionError):
        list(map_samples(fail_on_7, shard_samples(paths[0]), processes=2, on_error="skip"))
