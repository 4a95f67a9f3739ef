"""Dataset spec files (issue 37, item 5): a YAML blend of sources (manifests, views, nested specs,
shard specs) with weights, subsets, repeats and named splits; ``WebDataset("train.yaml",
readers=V)`` is a planned mixture with exact quotas, exact and elastic resume, ``__source__``;
``tarshards info SPEC`` says what it holds."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

import tarshards
from tarshards import ShardWriter
from tarshards.curate.spec import read_spec, resolve_blend, spec_info
from tarshards.errors import MissingDependencyError, ShardSpecError
from tarshards.pipeline.dataset import WebDataset
from tarshards.testing import check_resume

SIZES = {"web": 60, "books": 40, "code": 20}  # samples; shards of 10


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    pytest.importorskip("yaml", reason="dataset spec files need PyYAML (tarshards[yaml])")
    d = tmp_path_factory.mktemp("blend")
    for name, n in SIZES.items():
        (d / name).mkdir()
        pattern = str(d / name / f"{name}-%04d.tar")
        manifest = str(d / name / "manifest.json") if name != "code" else None
        with ShardWriter(pattern, maxcount=10, manifest=manifest) as sink:
            for i in range(n):
                sink.write({"__key__": f"{name}{i:04d}", "txt": f"{name} {i}"})
    return d


def write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def keys_of(batches):
    return [k for b in batches for k in b[0]]


def sources_of(batches):
    return [s for b in batches for s in b[1]]


def run(spec, readers=2, batch=4, **kw):
    ds = WebDataset(spec, readers=readers, **kw).to_tuple("__key__", "__source__").batched(batch)
    return list(ds)


def test_without_pyyaml_a_spec_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "train.yaml"
    path.write_text("sources: [web/manifest.json]")
    monkeypatch.setitem(sys.modules, "yaml", None)  # (import yaml raises ImportError)
    with pytest.raises(MissingDependencyError, match=r"pip install 'tarshards\[yaml\]'"):
        WebDataset(str(path), readers=2)


# ---- parsing ------------------------------------------------------------------------------------


def test_a_spec_reads_as_written_with_paths_from_its_folder(root, tmp_path, monkeypatch):
    path = write(
        root,
        "specs/train.yaml",
        """
sources:
  - {name: web, data: ../web/manifest.json, weight: 3}
  - {name: books, data: ../books/manifest.json, weight: 1, subset: [0%, 50%], repeat: 2}
  - {data: "../code/code-{0000..0001}.tar", weight: 0.5}
stop: all
""",
    )
    monkeypatch.chdir(tmp_path)  # elsewhere: relative paths are the spec's, not the cwd's
    spec = read_spec(path)
    assert spec.splits == []
    blend = spec.blend()
    assert blend.stop == "all"
    web, books, code = blend.sources
    assert (web.name, web.kind, web.data) == ("web", "manifest", str(root / "web/manifest.json"))
    assert float(web.weight) == 3 and web.subset is None and web.repeat == 1
    assert books.subset == (0, 0.5) and books.repeat == 2
    assert code.name == "code" and code.kind == "shards"
    assert code.data == str(root / "code/code-{0000..0001}.tar")
    leaves = resolve_blend(path)
    assert [(x.name, x.samples, x.selected) for x in leaves] == [
        ("web", 60, 60),
        ("books", 40, 20),
        ("code", 20, 20),
    ]
    assert [float(x.share) for x in leaves] == [3 / 4.5, 1 / 4.5, 0.5 / 4.5]


BAD = [
    ("[1, 2]", "a dataset spec is a mapping"),
    ("sources: []", "sources is a non-empty list"),
    ("{}", "found neither"),
    ("sources: [{data: web/manifest.json}]\nsplits: {}", "not both"),
    ("sources: [{data: web/manifest.json}]\nshuffle: 3", "unknown key(s) 'shuffle'"),
    ("sources: [{name: web, data: web/manifest.json, wieght: 3}]", "sources[0] (web) has unknown"),
    ("sources: [{name: web}]", "sources[0] (web) needs 'data:'"),
    ("sources: [{name: web, data: web/manifest.json, weight: -1}]", "weight must be positive"),
    ("sources: [{name: web, data: web/manifest.json, weight: x}]", "weight is a number"),
    ("sources: [{name: web, data: web/manifest.json, repeat: 0}]", "repeat must be positive"),
    ("sources: [{name: w, data: web/manifest.json, subset: [80%, 20%]}]", "not a range"),
    ("sources: [{name: w, data: web/manifest.json, subset: [0%]}]", "two bounds"),
    ("sources: [{name: w, data: web/manifest.json, subset: [0%, 8x%]}]", "'8x%' is not a bound"),
    ("sources: [{name: w, data: web/manifest.json, subset: [0, 120%]}]", "not a range"),
    (
        "sources:\n  - {name: a, data: web/manifest.json, weight: 1}\n"
        "  - {name: b, data: books/manifest.json}",
        "sources[1] (b) has no weight while others have one",
    ),
    (
        "sources:\n  - {name: a, data: web/manifest.json}\n"
        "  - {name: a, data: books/manifest.json}",
        "two sources are named 'a' (",
    ),
    ("sources: [{data: web/manifest.json, split: val}]", "split: selects a split of a nested"),
    ("sources: [{data: web/manifest.json}]\nstop: never", "stop is one of first, all, cycle"),
    ("sources: [{data: web/manifest.json}]\nunit: bytes", "unit is one of samples, tokens"),
    ("sources: [{data: web/manifest.json}]\nunit: tokens", "weight every source"),
    ("splits: {train: 3}", "splits.train is a blend"),
    ("splits: {train: {sources: [{data: web/manifest.json}]}}\nstop: all", "goes in each split"),
    ("sources: [{data: web/manifest.json, name: a/b}]", "without '/'"),
    ("sources: [\n  - {", "not valid YAML"),
]


@pytest.mark.parametrize("text, said", BAD)
def test_bad_specs_name_the_file_and_the_entry(root, text, said):
    path = write(root, "bad.yaml", text)
    with pytest.raises(ShardSpecError) as exc:
        read_spec(path)
    assert said in str(exc.value) and str(exc.value).startswith(path), str(exc.value)


def test_errors_of_the_data_name_the_entry(root):
    path = write(root, "missing.yaml", "sources: [{name: gone, data: nowhere/manifest.json}]")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml: sources\[0\] \(gone\)"):
        WebDataset(path, readers=2)
    path = write(root, "braces.yaml", "sources: [{name: b, data: 'web/web-{0000...0005}.tar'}]")
    with pytest.raises(ShardSpecError, match=r"braces\.yaml: sources\[0\] \(b\).*three"):
        WebDataset(path, readers=2)
    path = write(root, "loop.yaml", "sources: [{name: me, data: loop.yaml}]")
    with pytest.raises(ShardSpecError, match="includes itself"):
        WebDataset(path, readers=2)
    path = write(root, "none.yaml", "sources: [{name: n, data: 'code/*.tar', subset: [0%, 4%]}]")
    with pytest.raises(ShardSpecError, match=r"\(n\): subset \[0%, 4%\] keeps none of its 20"):
        WebDataset(path, readers=2)
    path = write(root, "plain.yaml", "sources: [web/manifest.json]")
    with pytest.raises(ValueError, match="remainder= does not apply"):
        WebDataset(path, readers=2, remainder="pad")


# ---- the mixture -------------------------------------------------------------------------------


def test_weights_are_exact_quotas_of_every_batch(root):
    path = write(
        root,
        "weights.yaml",
        "sources:\n  - {name: web, data: web/manifest.json, weight: 3}\n"
        "  - {name: books, data: books/manifest.json, weight: 1}\n",
    )
    batches = run(path, readers=2, batch=8)
    assert batches and all(list(b[1]).count("web") == 6 for b in batches)
    for key, source in zip(keys_of(batches), sources_of(batches)):
        assert key.startswith(source)  # __source__ on every sample, the right one
    keys = keys_of(batches)
    assert len(set(keys)) == len(keys)  # stop: first: nothing twice
    # the mixture's public count agrees with the batches
    ds = WebDataset(path, readers=2).batched(8)
    assert len(ds) == len(batches)
    assert ds.source_counts() == dict(collections.Counter(sources_of(batches)))


def test_without_weights_the_shares_follow_the_sizes_and_repeat_counts(root):
    path = write(
        root,
        "sizes.yaml",
        "sources:\n  - {name: web, data: web/manifest.json}\n"
        "  - {name: books, data: books/manifest.json, repeat: 2}\n"
        "  - {name: code, data: 'code/code-{0000..0001}.tar', repeat: 0.5}\n",
    )
    leaves = resolve_blend(path)
    assert [x.budget for x in leaves] == [60, 80, 10]
    assert [float(x.share) for x in leaves] == [60 / 150, 80 / 150, 10 / 150]
    batches = run(path, readers=2, batch=15)
    count = collections.Counter(keys_of(batches))
    web = [k for k in count if k.startswith("web")]
    books = [k for k in count if k.startswith("books")]
    code = [k for k in count if k.startswith("code")]
    assert len(web) == 60 and all(count[k] == 1 for k in web)  # once
    assert len(books) == 40 and all(count[k] == 2 for k in books)  # every sample twice
    assert len(code) == 10 and all(count[k] == 1 for k in code)  # half a pass
    assert all(sorted(collections.Counter(b[1]).values()) == [1, 6, 8] for b in batches)


def test_subset_rows_in_manifest_order(root):
    path = write(
        root,
        "subset.yaml",
        "sources:\n  - {name: a, data: books/manifest.json, subset: [0%, 50%]}\n"
        "  - {name: b, data: books/manifest.json, subset: [50%, 100%]}\n",
    )
    batches = run(path, readers=2, batch=4)
    by = collections.defaultdict(set)
    for k, s in zip(keys_of(batches), sources_of(batches)):
        by[s].add(k)
    assert by["a"] == {f"books{i:04d}" for i in range(20)}
    assert by["b"] == {f"books{i:04d}" for i in range(20, 40)}  # disjoint, covering
    info = spec_info(path)
    assert [s["selected"] for s in info["sources"]] == [20, 20]
    assert info["bytes"] == spec_info(str(root / "books/manifest.json"))["bytes"]


def test_subset_rows_of_a_shard_of_a_view_and_of_scanned_shards(root):
    from tarshards import Manifest, View

    path = write(
        root, "rows.yaml", "sources: [{name: a, data: books/manifest.json, subset: [0%, 33%]}]"
    )
    assert sorted(keys_of(run(path, readers=1, batch=1))) == [f"books{i:04d}" for i in range(13)]
    # a view: a subset is rows of its rows
    books = Manifest.load(str(root / "books/manifest.json"))
    View.from_positions(books, range(1, 40, 2)).save(str(root / "books/odd.view.json"))
    path = write(
        root, "view.yaml", "sources: [{name: odd, data: books/odd.view.json, subset: [0%, 50%]}]"
    )
    leaves = resolve_blend(path)
    assert (leaves[0].kind, leaves[0].samples, leaves[0].selected) == ("view", 20, 10)
    assert sorted(keys_of(run(path, readers=1, batch=1))) == [
        f"books{i:04d}" for i in range(1, 20, 2)
    ]
    # the bytes of the rows kept: the samples' spans in their shards
    whole = spec_info(str(root / "books/manifest.json"))["bytes"]
    assert 0 < spec_info(path)["bytes"] < whole // 3
    # shards without a manifest: rows in the order of the scan
    path = write(root, "scan.yaml", "sources: [{name: c, data: 'code/*.tar', subset: [25%, 75%]}]")
    assert sorted(keys_of(run(path, readers=1, batch=1))) == [f"code{i:04d}" for i in range(5, 15)]


def test_nested_specs_multiply_weights_and_repeats(root):
    write(
        root,
        "inner/text.yaml",
        "sources:\n  - {name: web, data: ../web/manifest.json, weight: 1}\n"
        "  - {name: books, data: ../books/manifest.json, weight: 1}\n",
    )
    path = write(
        root,
        "outer.yaml",
        "sources:\n  - {name: text, data: inner/text.yaml, weight: 1}\n"
        "  - {name: code, data: 'code/*.tar', weight: 1, repeat: 2}\n",
    )
    leaves = resolve_blend(path)
    assert [(x.name, float(x.share)) for x in leaves] == [
        ("text/web", 0.25),
        ("text/books", 0.25),
        ("code", 0.5),
    ]
    batches = run(path, readers=2, batch=4)
    assert all(sorted(b[1]) == ["code", "code", "text/books", "text/web"] for b in batches)
    # code (20 samples, 2 passes: 40 at a half) runs out first: 80 samples, every code twice
    count = collections.Counter(keys_of(batches))
    assert len(keys_of(batches)) == 80
    assert all(count[f"code{i:04d}"] == 2 for i in range(20))
    # a repeat on the nested entry multiplies through; a subset applies to each of its sources
    path = write(
        root,
        "outer2.yaml",
        "sources: [{name: t, data: inner/text.yaml, repeat: 2, subset: [50%, 100%]}]",
    )
    leaves = resolve_blend(path)
    assert [(x.name, x.repeat, x.selected) for x in leaves] == [
        ("t/web", 2, 30),
        ("t/books", 2, 20),
    ]


def test_named_splits(root):
    path = write(
        root,
        "splits.yaml",
        "splits:\n"
        "  train:\n"
        "    sources:\n"
        "      - {name: web, data: web/manifest.json, subset: [0%, 50%]}\n"
        "      - {name: books, data: books/manifest.json, subset: [0%, 50%]}\n"
        "  val:\n"
        "    sources: [{name: web, data: web/manifest.json, subset: [50%, 100%]}]\n",
    )
    assert read_spec(path).splits == ["train", "val"]
    train = set(keys_of(run(path, batch=5, split="train")))
    val = set(keys_of(run(path, batch=5, split="val")))
    assert len(train) == 50 and len(val) == 30 and not train & val
    with pytest.raises(ValueError, match=r"has splits train, val: pass split="):
        WebDataset(path, readers=2)
    with pytest.raises(ValueError, match=r"no split 'test' \(its splits: train, val\)"):
        WebDataset(path, readers=2, split="test")
    # a nested spec with splits: the same split, or the one its entry names
    outer = write(
        root,
        "outer_splits.yaml",
        "splits:\n  train: [{name: s, data: splits.yaml}]\n"
        "  val: [{name: s, data: splits.yaml, split: train}]\n",
    )
    assert set(keys_of(run(outer, batch=5, split="train"))) == train
    assert set(keys_of(run(outer, batch=5, split="val"))) == train
    info = spec_info(path)
    assert set(info["splits"]) == {"train", "val"}
    assert info["splits"]["val"]["samples"] == 30


def test_a_spec_of_one_source_is_that_source(root):
    path = write(root, "one.yaml", "sources: [web/manifest.json]")
    batches = run(path, readers=3, batch=4)
    plain = WebDataset(str(root / "web/manifest.json"), readers=3).to_tuple("__key__").batched(4)
    assert sorted(keys_of(batches)) == sorted(k for b in plain for k in b[0])
    assert set(sources_of(batches)) == {"web"}
    # a list of shards (no manifest: scanned), from a pathlib.Path
    lst = write(
        root, "list.yaml", "sources: [{name: c, data: [code/code-0000.tar, code/code-0001.tar]}]"
    )
    keys = keys_of(run(pathlib.Path(lst), readers=2, batch=5))
    assert sorted(keys) == [f"code{i:04d}" for i in range(20)]


def test_a_shuffle_on_the_spec_shuffles_each_source_and_resumes(root):
    path = write(
        root,
        "shuffled.yaml",
        "sources:\n  - {name: web, data: web/manifest.json, weight: 3}\n"
        "  - {name: code, data: 'code/*.tar', weight: 1, repeat: 3}\n",
    )

    def make():
        return (
            WebDataset(path, readers=2, shardshuffle=True, seed=1)
            .shuffle(6)
            .to_tuple("__key__", "__source__")
            .batched(4)
        )

    batches = list(make())
    assert all(list(b[1]).count("web") == 3 for b in batches)
    assert keys_of(batches) != sorted(keys_of(batches))  # shuffled
    assert keys_of(list(make())) == keys_of(batches)  # the same order again
    check_resume(make, epochs=2, cuts=[(0, 1), (0, 7), (1, 2)])


def test_mix_repeat_and_a_shuffle_on_the_mixture(root):
    from tarshards.plan.mixing import mix

    def make(shuffle=0, weights=(3, 1), **kw):
        web = WebDataset(str(root / "web/manifest.json"))
        code = WebDataset(str(root / "code/code-{0000..0001}.tar"))
        ds = mix({"web": web, "code": code}, dict(zip(("web", "code"), weights)), readers=2, **kw)
        if shuffle:
            ds = ds.shuffle(shuffle)
        return ds.to_tuple("__key__", "__source__").batched(4)

    # half and half: code's 20 samples, read twice, last as long as 40 of web's 60
    count = collections.Counter(keys_of(make(weights=(1, 1), repeat={"code": 2})))
    assert sum(count.values()) == 80 and all(count[f"code{i:04d}"] == 2 for i in range(20))
    with pytest.raises(ValueError, match="repeat names"):
        make(repeat={"nope": 2})
    plain, shuffled = keys_of(make()), keys_of(make(shuffle=5))
    assert sorted(plain) == sorted(shuffled) and plain != shuffled
    assert all(list(b[1]).count("web") == 3 for b in make(shuffle=5))  # still exact quotas
    check_resume(lambda: make(shuffle=5), epochs=2, cuts=[(0, 3), (1, 1)])


def _tokens(sample):
    return int(sample["tok"])


def test_weights_by_tokens_are_the_token_mix(root):
    from tarshards.plan.mixing import mix

    for name, n, per in (("short", 60, 10), ("long", 30, 10)):
        with ShardWriter(
            str(root / f"{name}-%03d.tar"),
            maxcount=per,
            manifest=str(root / f"{name}.json"),
            meta={"tokens": _tokens},
        ) as w:
            for i in range(n):
                tok = 5 + i % 7 if name == "short" else 50 + (i * 37) % 90
                w.write({"__key__": f"{name}{i:04d}", "tok": str(tok)})
    path = write(
        root,
        "tokens.yaml",
        "sources:\n  - {name: short, data: short.json, weight: 1}\n"
        "  - {name: long, data: long.json, weight: 1}\n"
        "unit: tokens\n",
    )

    def tuples(ds):
        return [(list(k), list(s)) for k, s in ds.to_tuple("__key__", "__source__").batched(6)]

    got = tuples(WebDataset(path, readers=2, seed=4))
    want = tuples(
        mix(
            {
                "short": WebDataset(str(root / "short.json")),
                "long": WebDataset(str(root / "long.json")),
            },
            {"short": 0.5, "long": 0.5},
            readers=2,
            seed=4,
            unit="tokens",
        )
    )
    assert got == want and len(got) > 3
    info = spec_info(path, readers=2, batch_size=6)
    assert info["unit"] == "tokens" and info["batches"] == len(got)
    assert spec_info(path)["epoch_samples"] is None  # (by tokens: known with a plan)
    bad = write(
        root,
        "tokens_bad.yaml",
        "sources: [{name: a, data: short.json, weight: 1, repeat: 2}]\nunit: tokens\n",
    )
    with pytest.raises(ShardSpecError, match=r"sources\[0\] \(a\): repeat counts passes"):
        read_spec(bad)


def test_resume_through_a_loader_with_workers_and_elastic(root):
    torch_mod = pytest.importorskip("tarshards.torch")
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    path = write(
        root,
        "loader.yaml",
        "sources:\n  - {name: web, data: web/manifest.json, weight: 2}\n"
        "  - {name: books, data: books/manifest.json, weight: 1, repeat: 2, subset: [5%, 95%]}\n"
        "stop: all\n",
    )

    def make(**kw):
        return (
            torch_mod.WebDataset(path, readers=4, shardshuffle=True, shuffle=3, seed=5, **kw)
            .to_tuple("__key__", "__source__", "__pad__")
            .batched(6)
        )

    assert isinstance(make(), torch_mod.MixedDataset)
    check_resume(
        lambda: torch_mod.WebLoader(make(), batch_size=None, num_workers=2),
        epochs=1,
        cuts=[(0, 3)],
    )
    # 2 ranks -> 4 ranks from a saved state: every remaining batch once
    first = []
    saved = None
    for r in range(2):
        ds = make(rank=r, world_size=2)
        it = iter(ds)
        first += [next(it), next(it)]
        if r == 0:
            saved = ds.state_dict()
    after = []
    for r in range(4):
        ds = make(rank=r, world_size=4)
        ds.load_state_dict(saved)
        after.append(list(ds))
    assert len({len(x) for x in after}) == 1
    got = sorted(k for b in first + [b for x in after for b in x] for k in b[0])
    whole = sorted(k for b in make() for k in b[0])
    assert got == whole


# ---- tarshards info ----------------------------------------------------------------------------


def _cli(args, cwd):
    env = dict(os.environ)
    where = os.path.dirname(os.path.dirname(os.path.abspath(tarshards.__file__)))
    env["PYTHONPATH"] = where + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "tarshards.cli.main", "info", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_tarshards_info(root):
    write(
        root,
        "info.yaml",
        "sources:\n  - {name: web, data: web/manifest.json, weight: 3}\n"
        "  - {name: books, data: books/manifest.json, weight: 1, subset: [0%, 50%], repeat: 2}\n",
    )
    p = _cli(["info.yaml", "--json"], root)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    web, books = info["sources"]
    assert (web["samples"], web["selected"], web["shards"]) == (60, 60, 6)
    assert (books["samples"], books["selected"], books["subset"]) == (40, 20, ["0%", "50%"])
    assert books["repeat"] == 2 and web["share"] == 0.75 and books["share"] == 0.25
    # books' budget (40 = 20 x 2) at a quarter allows 160, web's 60 at three quarters 80
    assert (web["epoch_samples"], books["epoch_samples"]) == (60, 20)
    sizes = sum(os.path.getsize(root / "web" / f"web-{i:04d}.tar") for i in range(6))
    assert web["bytes"] == sizes and info["bytes"] == sizes + books["bytes"]
    p = _cli(["info.yaml"], root)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("info.yaml: 2 source(s), 80 samples")
    assert lines[2].split()[:4] == ["web", "manifest", "6", "60"]
    assert "0%-50%" in lines[3] and "25.0%" in lines[3]
    # the exact epoch of a plan: what WebDataset(SPEC, readers=V).batched(B) reads
    p = _cli(["info.yaml", "--json", "--readers", "3", "--batch-size", "4"], root)
    exact = json.loads(p.stdout)
    batches = run(str(root / "info.yaml"), readers=3, batch=4)
    assert exact["batches"] == len(batches)
    got = collections.Counter(sources_of(batches))
    assert {s["name"]: s["epoch_samples"] for s in exact["sources"]} == got
    p = _cli(["info.yaml", "--readers", "3"], root)
    assert p.returncode == 2 and "--readers and --batch-size go together" in p.stderr
    # a manifest, a shard spec: one source
    p = _cli(["web/manifest.json", "--json"], root)
    assert json.loads(p.stdout)["sources"][0]["samples"] == 60
    p = _cli(["code/code-{0000..0001}.tar"], root)
    assert p.returncode == 0 and " 20 " in p.stdout.splitlines()[2]
    # a bad spec: one line naming it, exit 1
    write(root, "broken.yaml", "sources: [{name: x}]")
    p = _cli(["broken.yaml"], root)
    assert p.returncode == 1 and "broken.yaml: sources[0] (x) needs 'data:'" in p.stderr
    assert "Traceback" not in p.stderr
