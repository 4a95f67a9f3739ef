"""``tarshards view``, ``tarshards dedup``, ``tarshards split --into`` (issue 37), and the
commands that take a manifest taking a view file: ``tarscat`` reads only the view's samples,
``tarcheck`` checks the view's shards against its manifest."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
from click.testing import CliRunner

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
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        with ShardWriter("m-%04d.tar", maxcount=10, manifest="manifest.json") as sink:
            for i in range(30):
                # samples 20.. repeat the contents of samples 0.. under other keys
                j = i - 20 if i >= 20 and i % 2 == 0 else i
                sink.write({"__key__": f"k{i:04d}", "cls": j % 3, "txt": f"text {j}"})
    finally:
        os.chdir(old)
    return tmp_path


def keys_in_tar(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return list(dict.fromkeys(m.name.split(".")[0] for m in tf.getmembers()))


def test_view_by_keys_then_tarscat_reads_the_view(data):
    (data / "keep.txt").write_text("# a comment\nk0003\nk0017\n\nk0025\n")
    r = run("view", ["manifest.json", "--keys", "keep.txt", "-o", "keep.view.json"], data)
    assert r.exit_code == 0, r.output
    assert "3 of 30 samples" in r.output and "27 removed" in r.output
    assert len(View.load(data / "keep.view.json")) == 3
    r = run("cat", ["-q", "keep.view.json"], data)
    assert r.exit_code == 0, r.output
    assert keys_in_tar(r.stdout_bytes) == ["k0003", "k0017", "k0025"]
    (data / "drop.txt").write_text("k0017\n")
    r = run(
        "view", ["keep.view.json", "--exclude-keys", "drop.txt", "-o", "two.view.json", "-q"], data
    )
    assert r.exit_code == 0, r.output
    r = run("cat", ["-q", "two.view.json", "m-0000.tar", "-c", "4"], data)
    assert keys_in_tar(r.stdout_bytes) == ["k0003", "k0025", "k0000", "k0001"]


def test_view_by_function(data, tmp_path):
    (tmp_path / "vfilters.py").write_text(
        "def odd(sample):\n    return int(sample['cls']) % 2 == 1\n"
    )
    r = run(
        "view", ["manifest.json", "-f", "vfilters:odd", "-p", "1", "-o", "odd.view.json"], tmp_path
    )
    assert r.exit_code == 0, r.output
    v = View.load(tmp_path / "odd.view.json")
    assert 0 < len(v) < 30


def test_dedup_and_tarcheck_of_a_view(data):
    r = run("dedup", ["manifest.json", "-o", "unique.view.json"], data)
    assert r.exit_code == 0, r.output
    assert "25 of 30 samples, 5 removed" in r.output
    r = run("cat", ["-q", "unique.view.json"], data)
    assert keys_in_tar(r.stdout_bytes) == [
        f"k{i:04d}" for i in range(30) if not (i >= 20 and i % 2 == 0)
    ]
    r = run("dedup", ["manifest.json", "--by", "txt", "-p", "1", "-q", "-o", "t.view.json"], data)
    assert r.exit_code == 0 and len(View.load(data / "t.view.json")) == 25
    r = run("check", ["-q", "--manifest", "unique.view.json"], data)
    assert r.exit_code == 0, r.output
    with open(data / "m-0001.tar", "r+b") as f:  # other bytes: the view's base shard is named
        f.seek(700)
        f.write(b"X")
    r = run("check", ["-q", "unique.view.json"], data)
    assert r.exit_code == 1 and "m-0001.tar" in r.output and "hash" in r.output


def test_split_into_views(data):
    r = run("split", ["manifest.json", "--into", "train=80%,val=20%", "-O", "splits"], data)
    assert r.exit_code == 0, r.output
    train = View.load(data / "splits" / "train.view.json")
    val = View.load(data / "splits" / "val.view.json")
    assert len(train) + len(val) == 30 and len(val) > 0
    assert not set(train.global_rows().tolist()) & set(val.global_rows().tolist())
    r = run("split", ["manifest.json", "--into", "train", "-O", "x"], data)
    assert r.exit_code != 0 and "NAME=SHARE" in r.output
    r = run("split", ["manifest.json", "--into", "train=1"], data)
    assert r.exit_code != 0 and "--output-dir" in r.output


def test_commands_that_read_whole_shards_refuse_a_view_and_take_its_samples_piped(data):
    run("view", ["manifest.json", "--exclude-keys", "/dev/null", "-o", "all.view.json"], data)
    r = run("tsv", ["all.view.json", "-f", "txt"], data)
    assert r.exit_code == 2 and "is a view" in r.output and "tarscat all.view.json" in r.output
