"""``tarshards columns`` and ``tarshards join``: add_columns and join from the command line."""

from __future__ import annotations

import os

from click.testing import CliRunner

from tarshards import ShardWriter, WebDataset
from tarshards.cli import main as cli


def run(name, args, cwd):
    cmd = cli.load_command(name)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cmd, [str(a) for a in args], prog_name=f"tarshards {name}")
    finally:
        os.chdir(old)


def test_columns_and_join_commands(tmp_path):
    os.chdir(tmp_path)
    try:
        with ShardWriter("a-%04d.tar", maxcount=4, manifest="a.json") as sink:
            for i in range(10):
                sink.write({"__key__": f"k{i}", "txt": f"text {i}"})
        with ShardWriter("b-%04d.tar", maxcount=3, manifest="b.json") as sink:
            for i in range(0, 10, 2):
                sink.write({"__key__": f"k{i}", "cls": i})
    finally:
        os.chdir(os.path.dirname(tmp_path))
    (tmp_path / "colfns.py").write_text(
        "def upper(sample):\n    return {'up.txt': bytes(sample['txt']).upper()}\n"
    )
    r = run("columns", ["a.json", "-f", "colfns:upper", "-o", "cols/m.json", "-p", "1"], tmp_path)
    assert r.exit_code == 0, r.output
    assert "column group 'columns' (up.txt) over 10 samples in 3 shards" in r.output
    got = list(WebDataset(str(tmp_path / "cols" / "m.json"), fields=["up.txt"]))
    assert [s["up.txt"] for s in got] == [f"TEXT {i}".encode() for i in range(10)]
    r = run("join", ["a.json", "b.json", "-o", "j/m.json", "--how", "inner", "-p", "1"], tmp_path)
    assert r.exit_code == 0, r.output
    assert "5 rows (inner join on __key__)" in r.output
    rows = list(WebDataset(str(tmp_path / "j" / "m.json")))
    assert [(s["__key__"], s["cls"]) for s in rows] == [
        (f"k{i}", str(i).encode()) for i in range(0, 10, 2)
    ]
    r = run("join", ["a.json", "a.json", "-o", "j/x.json", "-p", "1"], tmp_path)
    assert r.exit_code == 2 and "prefix" in r.output
    r = run("columns", ["a.json", "-f", "colfns:nope", "-o", "c2/m.json"], tmp_path)
    assert r.exit_code == 2 and "no attribute" in r.output
