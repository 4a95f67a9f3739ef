"""The command-line tools through click's CliRunner (in process): options, outputs, errors."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import make_samples, write_shards
from PIL import Image

from tarshards.cli import main as cli
from tarshards.cli._common import parse_size
from tarshards.pipeline.dataset import shard_samples


def run(name, args, input=None):
    """Invoke subcommand ``name`` (or the group, for "tarshards") under its script's name."""
    if name == "tarshards":
        cmd, prog = cli.group, "tarshards"
    else:
        cmd, prog = cli.load_command(name), cli.COMMANDS[name][0] or f"tarshards {name}"
    return CliRunner().invoke(
        cmd, [str(a) for a in args], input=input, prog_name=prog, catch_exceptions=False
    )


def read(path) -> list[dict]:
    return list(shard_samples(str(path)))


def raw_tar(path, members) -> None:
    """A tar made by the standard library from ``(name, bytes)``, in the order given."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def fields(sample: dict) -> dict:
    """What a sample holds, not where it was read (``__url__``, ``__offset__``)."""
    return {k: v for k, v in sample.items() if k not in ("__url__", "__offset__")}


@pytest.fixture
def shards(tmp_path):
    return write_shards(tmp_path, 3, 20)


# ---------------------------------------------------------------------------------------------
# tarscat
# ---------------------------------------------------------------------------------------------


def test_cat_concatenates_with_skip_and_count(shards, tmp_path):
    _paths, samples = shards
    spec = str(tmp_path / "shard-{0000..0002}.tar")
    r = run("cat", [spec, "-s", 15, "-c", 10, "-o", tmp_path / "out.tar"])
    assert r.exit_code == 0, r.output
    assert [fields(s) for s in read(tmp_path / "out.tar")] == samples[15:25]


def test_cat_to_stdout_and_from_stdin(shards, tmp_path):
    paths, samples = shards
    r = run("cat", ["-c", 3], input=Path(paths[1]).read_bytes())
    assert r.exit_code == 0, r.stderr
    (tmp_path / "o.tar").write_bytes(r.stdout_bytes)
    assert [fields(s) for s in read(tmp_path / "o.tar")] == samples[20:23]


def test_cat_shuffle_is_a_seeded_permutation(shards, tmp_path):
    paths, samples = shards
    outs = []
    for seed in (1, 1, 2):
        out = tmp_path / f"s{seed}-{len(outs)}.tar"
        r = run("cat", [*paths, "--shuffle", 25, "--seed", seed, "-o", out])
        assert r.exit_code == 0, r.output
        outs.append([s["__key__"] for s in read(out)])
    assert outs[0] == outs[1] != outs[2]
    assert sorted(outs[0]) == [s["__key__"] for s in samples]
    assert outs[0] != sorted(outs[0])


def test_cat_files_from_list(shards, tmp_path):
    paths, samples = shards
    (tmp_path / "list.txt").write_text(f"# shards\n{paths[2]}\n{paths[0]}\n")
    r = run("cat", ["-T", tmp_path / "list.txt", "-o", tmp_path / "out.tar"])
    assert r.exit_code == 0, r.output
    assert [fields(s) for s in read(tmp_path / "out.tar")] == samples[40:60] + samples[0:20]


def test_cat_skip_bad_shard(shards, tmp_path):
    paths, samples = shards
    data = Path(paths[1]).read_bytes()
    (tmp_path / "bad.tar").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out.tar"
    r = run("cat", [paths[0], tmp_path / "bad.tar", paths[2], "-e", "skip", "-o", out])
    assert r.exit_code == 0
    assert "tarscat: warning: skipped the rest of a shard" in r.stderr
    assert "bad.tar" in r.stderr
    keys = [s["__key__"] for s in read(out)]
    assert keys[:20] == [s["__key__"] for s in samples[:20]]
    assert keys[-20:] == [s["__key__"] for s in samples[40:]]
    assert 20 < len(keys) < 60
    # the default stops, with the one-line error, and leaves no output file behind
    r = run("cat", [paths[0], tmp_path / "bad.tar", "-o", tmp_path / "o2.tar"])
    assert r.exit_code == 1
    assert r.stderr.startswith("tarscat: error: ") and "bad.tar" in r.stderr
    assert not (tmp_path / "o2.tar").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_usage_errors_exit_2(tmp_path):
    r = run("cat", ["-c", "-3", "x.tar"])
    assert r.exit_code == 2
    r = run("cat", [str(tmp_path / "*.nothing")])
    assert r.exit_code == 2 and "no shard matches" in r.stderr
    r = run("cat", ["-", "-"])
    assert r.exit_code == 2


def test_group_has_every_subcommand():
    r = run("tarshards", ["--help"])
    assert r.exit_code == 0
    for name in ("cat", "tsv", "split", "show", "proc", "pcat", "sort", "check"):
        assert f"  {name} " in r.output


# ---------------------------------------------------------------------------------------------
# tar2tsv
# ---------------------------------------------------------------------------------------------


def test_tsv_fields_alternatives_and_binary_sizes(tmp_path):
    raw_tar(
        tmp_path / "t.tar",
        [
            ("a.cls", b"3"),
            ("a.png", b"\x89PNG\r\n\x1a\n\x00\x00"),
            ("a.txt", b"x\ty\nz"),
            ("b.cls", b"4"),
            ("b.jpg", b"\xff\xd8\xff\xe0abc"),
            ("c.cls", b"5"),
        ],
    )
    r = run("tsv", ["-f", "jpg;png cls txt", tmp_path / "t.tar"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "__key__\tjpg;png\tcls\ttxt",
        "a\t10\t3\tx\\ty\\nz",
        "b\t7\t4\t",
        "c\t\t5\t",
    ]
    r = run("tsv", ["-f", "cls", "--nokey", "--noheader", "-c", 2, tmp_path / "t.tar"])
    assert r.stdout.splitlines() == ["3", "4"]


def test_tsv_default_fields_from_first_sample(shards):
    paths, samples = shards
    r = run("tsv", [paths[0], "-c", 2])
    lines = r.stdout.splitlines()
    assert lines[0] == "__key__\tcls\tjpg\tjson"
    assert lines[1] == "\t".join(
        [samples[0]["__key__"], "0", str(len(samples[0]["jpg"])), samples[0]["json"].decode()]
    )


# ---------------------------------------------------------------------------------------------
# tarsplit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [
        ("1e9", 10**9),
        ("500M", 500 * 10**6),
        ("2G", 2 * 10**9),
        ("1.5GB", 15 * 10**8),
        ("64KiB", 65536),
        ("1000", 1000),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12Q", "G", "-5M", "0", "1e9e9", "ten"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_split_by_count_never_splits_a_sample(shards, tmp_path):
    paths, samples = shards
    r = run("split", [*paths, "-n", 25, "-o", tmp_path / "p"])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in tmp_path.glob("p-*"))
    assert names == ["p-000000.tar", "p-000001.tar", "p-000002.tar"]
    got = [read(tmp_path / n) for n in names]
    assert [len(g) for g in got] == [25, 25, 10]
    assert [fields(s) for g in got for s in g] == samples
    assert "# writing" in r.stderr and "# done: 3 shards, 60 samples" in r.stderr


def test_split_by_size_and_compressed(shards, tmp_path):
    paths, samples = shards
    r = run("split", [*paths, "-s", "20k", "--zstd", "-q", "-o", tmp_path / "z"])
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    shards_out = sorted(tmp_path.glob("z-*.tar.zst"))
    assert len(shards_out) > 3
    got = [s for p in shards_out for s in read(p)]
    assert [fields(s) for s in got] == samples
    r = run("split", [paths[0], "-z", "--gzip", "-o", tmp_path / "g"])
    assert r.exit_code == 0
    assert len(read(tmp_path / "g-000000.tgz")) == 20
    assert (tmp_path / "g-000000.tgz").read_bytes()[:2] == b"\x1f\x8b"


def test_split_maxshards_stops_cleanly(shards, tmp_path):
    paths, samples = shards
    r = run("split", [*paths, "-n", 7, "--maxshards", 2, "-o", tmp_path / "m"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.glob("m-*")) == ["m-000000.tar", "m-000001.tar"]
    assert [fields(s) for s in read(tmp_path / "m-000001.tar")] == samples[7:14]
    assert "stopped after --maxshards 2: wrote 2 complete shards (14 samples)" in r.stderr


def test_split_bad_size_is_usage_error(tmp_path):
    r = run("split", ["-s", "lots", "x.tar"])
    assert r.exit_code == 2
    assert "'lots' is not a size" in r.stderr


# ---------------------------------------------------------------------------------------------
# tarshow
# ---------------------------------------------------------------------------------------------


def test_show_previews_and_contact_sheet(shards, tmp_path):
    paths, samples = shards
    grid = tmp_path / "grid.png"
    r = run("show", ["-c", 4, "-s", 1, "-w", 40, "--images", grid, paths[0]])
    assert r.exit_code == 0, r.output
    blocks = r.stdout.strip().split("\n\n")
    assert len(blocks) == 4
    assert blocks[0].splitlines()[0].split() == ["__key__", samples[1]["__key__"]]
    assert all(len(line) <= 11 + 40 for b in blocks for line in b.splitlines()[2:])
    with Image.open(grid) as img:
        assert img.width > 4 * 100 and img.height > 100
    assert "# 4 images in" in r.stderr


# ---------------------------------------------------------------------------------------------
# tarsort
# ---------------------------------------------------------------------------------------------


def test_sort_by_numeric_field_is_stable(shards, tmp_path):
    paths, samples = shards
    r = run("sort", [*paths, "-k", "cls", "-n", "-o", tmp_path / "o.tar"])
    assert r.exit_code == 0, r.output
    got = read(tmp_path / "o.tar")
    expect = sorted(samples, key=lambda s: int(s["cls"]))  # Python's sort is stable too
    assert [fields(s) for s in got] == expect


def test_sort_by_key_reverse_and_shuffle(shards, tmp_path):
    paths, samples = shards
    r = run("sort", [paths[2], paths[0], "-r", "-o", tmp_path / "r.tar"])
    assert r.exit_code == 0, r.output
    keys = [s["__key__"] for s in read(tmp_path / "r.tar")]
    assert keys == sorted(keys, reverse=True) and len(keys) == 40
    orders = []
    for seed in (5, 5, 6):
        out = tmp_path / f"sh{len(orders)}.tar"
        assert run("sort", [*paths, "--shuffle", "--seed", seed, "-o", out]).exit_code == 0
        orders.append([s["__key__"] for s in read(out)])
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == [s["__key__"] for s in samples]


def test_sort_errors(shards, tmp_path):
    paths, _ = shards
    r = run("sort", [paths[0], "-k", "nope", "-o", tmp_path / "o.tar"])
    assert r.exit_code == 1
    assert r.stderr.startswith("tarsort: error: sample has no field 'nope'")
    r = run("sort", [paths[0], "-k", "json", "-n", "-o", tmp_path / "o.tar"])
    assert r.exit_code == 1 and "is not a number" in r.stderr
    r = run("sort", [paths[0], "--shuffle", "-k", "cls"])
    assert r.exit_code == 2


# ---------------------------------------------------------------------------------------------
# tarcheck
# ---------------------------------------------------------------------------------------------


def test_check_good_shards(shards):
    paths, _ = shards
    r = run("check", paths)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["shard", "samples", "members", "payload", "extensions", "status"]
    assert "cls:20 jpg:20 json:20" in lines[2] and lines[2].endswith("ok")
    assert lines[-1].startswith("total (3 shards)")
    assert "cls:60 jpg:60 json:60" in lines[-1]


def test_check_finds_problems(shards, tmp_path):
    paths, _ = shards
    raw_tar(tmp_path / "split.tar", [("a.cls", b"1"), ("b.cls", b"2"), ("a.jpg", b"x")])
    raw_tar(tmp_path / "dup.tar", [("a.cls", b"1"), ("a.cls", b"2")])
    data = Path(paths[0]).read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:5000])
    (tmp_path / "nomarker.tar").write_bytes(data[:1024])  # one member, no end marker
    bad = ["split.tar", "dup.tar", "cut.tar", "nomarker.tar"]
    r = run("check", [paths[0]] + [tmp_path / b for b in bad])
    assert r.exit_code == 1
    problems = [ln for ln in r.stderr.splitlines() if ln.startswith("tarcheck: problem: ")]
    assert len(problems) == 4
    assert "key 'a' split across non-adjacent members" in problems[0]
    assert "split.tar" in problems[0] and "offset 2048" in problems[0]
    assert "repeated extension 'cls'" in problems[1] and "offset 1024" in problems[1]
    assert "truncated" in problems[2] and "cut.tar" in problems[2]
    assert "no end-of-archive marker" in problems[3]
    assert r.stderr.splitlines()[-1] == "tarcheck: error: 4 of 5 shard(s) have problems"
    assert "4 bad shard(s)" in r.stdout


# ---------------------------------------------------------------------------------------------
# tarpcat
# ---------------------------------------------------------------------------------------------


def test_pcat_interleaves_everything(shards, tmp_path):
    paths, samples = shards
    out = tmp_path / "o.tar"
    r = run("pcat", ["-p", 2, *paths, "-o", out])
    assert r.exit_code == 0, r.output
    got = read(out)
    assert sorted(s["__key__"] for s in got) == [s["__key__"] for s in samples]
    keys = [s["__key__"] for s in got]
    # round robin over the first two shards, then the third takes the place of the first
    assert keys[:4] == [
        samples[0]["__key__"],
        samples[20]["__key__"],
        samples[1]["__key__"],
        samples[21]["__key__"],
    ]
    by_key = {s["__key__"]: s for s in samples}
    assert all(fields(s) == by_key[s["__key__"]] for s in got)
    r2 = run("pcat", ["-p", 2, *paths, "-o", tmp_path / "o2.tar"])
    assert r2.exit_code == 0 and [s["__key__"] for s in read(tmp_path / "o2.tar")] == keys


def test_pcat_error(shards, tmp_path):
    paths, _ = shards
    r = run("pcat", ["-p", 2, paths[0], tmp_path / "missing.tar", "-o", tmp_path / "o"])
    assert r.exit_code == 1
    assert r.stderr.startswith("tarpcat: error: ") and "missing.tar" in r.stderr


# ---------------------------------------------------------------------------------------------
# tarproc
# ---------------------------------------------------------------------------------------------


def test_proc_files_key_and_order(tmp_path):
    samples = make_samples(12)
    for s in samples:  # keys with a directory part
        s["__key__"] = "dir/" + s["__key__"]
    from tarshards import TarWriter

    with TarWriter(str(tmp_path / "in.tar")) as w:
        for s in samples:
            w.write(s)
    cmd = (
        "n=$(echo $KEY | tail -c 2); sleep 0.0$(( (9 - n) % 4 )); "
        'l=$(ls); echo -n "$KEY" > seen.txt; echo "$l" > "$(basename $KEY).ls"; rm *.json'
    )
    r = run("proc", ["-p", 4, "-c", cmd, tmp_path / "in.tar", "-o", tmp_path / "o.tar"])
    assert r.exit_code == 0, r.output
    got = read(tmp_path / "o.tar")
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    for s, g in zip(samples, got):
        base = s["__key__"].rpartition("/")[2]
        assert set(g) == {"__key__", "__url__", "__offset__", "cls", "jpg", "ls", "seen.txt"}
        assert g["seen.txt"] == s["__key__"].encode()
        assert g["ls"].split() == [f"{base}.{e}".encode() for e in ("cls", "jpg", "json")]
        assert g["jpg"] == s["jpg"]


def test_proc_unordered_gives_all_samples(shards):
    paths, samples = shards
    r = run(
        "proc",
        [
            "-p",
            3,
            "--unordered",
            "-c",
            "true",
            paths[0],
            "-o",
            os.path.join(os.path.dirname(paths[0]), "u.tar"),
        ],
    )
    assert r.exit_code == 0, r.output
    got = read(os.path.join(os.path.dirname(paths[0]), "u.tar"))
    assert sorted(s["__key__"] for s in got) == [s["__key__"] for s in samples[:20]]


def test_proc_failures(shards, tmp_path):
    paths, samples = shards
    cmd = 'case $KEY in *03|*07) echo "bad sample $KEY" >&2; exit 4;; esac'
    r = run("proc", ["-e", "skip", "-p", 2, "-c", cmd, paths[0], "-o", tmp_path / "s.tar"])
    assert r.exit_code == 0
    keys = [s["__key__"] for s in read(tmp_path / "s.tar")]
    assert keys == [s["__key__"] for i, s in enumerate(samples[:20]) if i not in (3, 7)]
    assert "bad sample sample000003" in r.stderr and "2 sample(s) skipped" in r.stderr
    r = run("proc", ["-c", cmd, paths[0], "-o", tmp_path / "a.tar"])
    assert r.exit_code == 1
    assert "bad sample sample000003" in r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"tarproc: error: command exited with status 4 on sample 'sample000003' (shard {paths[0]})"
    )
    assert not (tmp_path / "a.tar").exists()


def test_map_subcommand_registered():
    from tarshards.cli.map_cmd import map_cmd

    assert cli.group.get_command(None, "map") is map_cmd


_BLAS_PROBE = """
import os, sys
from tarshards.cli.main import main
sys.argv = ["tarshards", "index", sys.argv[1], "-o", sys.argv[2], "-q"]
try:
    main()
except SystemExit as exn:
    assert not exn.code, exn.code
from threadpoolctl import threadpool_info
blas = [p["num_threads"] for p in threadpool_info() if p["internal_api"] == "openblas"]
print(blas, os.environ.get("OPENBLAS_NUM_THREADS"))
"""


@pytest.mark.parametrize("user", [None, "2"])
def test_index_loads_openblas_with_one_thread_unless_the_user_chose(shards, tmp_path, user):
    """`tarshards index` never calls BLAS: numpy's OpenBLAS is loaded with one thread (its
    others spin at load, taking a core from the hashing), the variable is gone again after the
    import (children inherit nothing), and a number the user set stands."""
    import subprocess
    import sys

    pytest.importorskip("threadpoolctl")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if user is not None:
        env["OPENBLAS_NUM_THREADS"] = user
    out = subprocess.run(
        [sys.executable, "-c", _BLAS_PROBE, shards[0][0], str(tmp_path / "m.json")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if out[0] == "[]":  # a numpy without OpenBLAS: nothing to check
        pytest.skip("numpy is not built with OpenBLAS here")
    assert out == (["[1]", "None"] if user is None else ["[2]", "2"])
    assert (tmp_path / "m.json").exists()
