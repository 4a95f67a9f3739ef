"""Views and layouts through the commands and readers that take a manifest (issue 37):
``tarshards index VIEW`` refuses with its reason, ``tarcheck`` checks a join's right shards
too, ``bench_pipeline`` over a view reads the view's samples."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

import tarshards
from tarshards import ShardWriter, View
from tarshards.cli import main as cli


def run(name, args, cwd):
    cmd, prog = cli.load_command(name), cli.COMMANDS[name][0] or f"tarshards {name}"
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cmd, [str(a) for a in args], prog_name=prog)
    finally:
        os.chdir(old)


@pytest.fixture
def data(tmp_path):
    with ShardWriter(
        str(tmp_path / "m-%04d.tar"), maxcount=10, manifest=str(tmp_path / "manifest.json")
    ) as sink:
        for i in range(30):
            sink.write({"__key__": f"k{i:04d}", "cls": i % 3, "ref.txt": f"r{i % 12:04d}"})
    with ShardWriter(
        str(tmp_path / "r-%04d.tar"), maxcount=4, manifest=str(tmp_path / "right.json")
    ) as sink:
        for i in range(12):
            sink.write({"__key__": f"r{i:04d}", "bin": bytes([i]) * 600})
    View.from_positions(
        tarshards.Manifest.load(str(tmp_path / "manifest.json")), range(0, 30, 4)
    ).save(str(tmp_path / "v.view.json"))
    return tmp_path


def test_index_of_a_view_is_refused_with_its_reason(data):
    r = run("index", ["v.view.json", "-o", "x.json"], data)
    assert r.exit_code == 2 and "is a view" in r.output and "nothing to index" in r.output
    assert not (data / "x.json").exists()


def test_tarcheck_names_a_corrupted_right_shard_of_a_join_and_a_view_of_it(data):
    j = tarshards.join(
        str(data / "manifest.json"),
        str(data / "right.json"),
        on="ref.txt",
        prefix="r.",
        output=str(data / "j.json"),
        workers=1,
    )
    View.from_positions(j, range(0, 30, 5)).save(str(data / "jv.view.json"))
    assert run("check", ["-q", "j.json"], data).exit_code == 0
    with open(data / "r-0001.tar", "r+b") as f:
        f.seek(700)
        f.write(b"X")
    for target in ("j.json", "jv.view.json"):
        r = run("check", ["-q", "--manifest", target], data)
        assert r.exit_code == 1 and "r-0001.tar" in r.output and "hash" in r.output


def test_bench_pipeline_over_a_view_reads_its_samples(data):
    from tarshards.benchmark import bench_pipeline

    view = str(data / "v.view.json")
    report = bench_pipeline(view, max_samples=100, seconds_per_stage=2, workers=0)
    assert report["stages"][-1]["samples"] == len(View.load(view)) == 8
    assert report["shards"] == 3
