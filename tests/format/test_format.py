"""The WebDataset naming rules: keys, extensions, skipped members, grouping into samples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tarshards.errors import DuplicateFieldError, ShardFormatError
from tarshards.format.names import group_samples, is_meta_key, parse_size, split_name


@pytest.mark.parametrize(
    "name, expected",
    [
        ("a.jpg", ("a", "jpg")),
        ("a.JPG", ("a", "jpg")),
        ("a.Seg.PNG", ("a", "seg.png")),
        ("dir/n03788365_17158.seg.png", ("dir/n03788365_17158", "seg.png")),
        ("a/b/c.jpg", ("a/b/c", "jpg")),
        ("a.b/c.d.e", ("a.b/c", "d.e")),  # dots in directories do not count
        ("./x/y.txt", ("x/y", "txt")),
        ("./y.txt", ("y", "txt")),
        ("k.tar.gz", ("k", "tar.gz")),
        ("noext", None),
        ("dir/noext", None),
        ("dir.with.dots/noext", None),
        ("__index__", None),
        ("__meta__.json", None),
        ("d/__meta__.json", None),
        (".hidden", None),
        ("d/.hidden.txt", None),
        ("trailing.", None),
        ("_single.txt", ("_single", "txt")),
    ],
)
def test_split_name(name, expected):
    assert split_name(name) == expected


@pytest.mark.parametrize(
    "name, expected",
    [
        ("a.b.c.jpg", ("a.b.c", "jpg")),
        ("dir/img.0001.PNG", ("dir/img.0001", "png")),
        ("x.y/z.txt", ("x.y/z", "txt")),
        ("./k.v.json", ("k.v", "json")),
        ("nodot", None),
        ("d/__x.y.z", None),
    ],
)
def test_split_name_last_dot(name, expected):
    assert split_name(name, last_dot=True) == expected


def members(*names):
    return [(n, n.encode(), i * 1024) for i, n in enumerate(names)]


def test_group_consecutive_members():
    got = list(group_samples(members("a.jpg", "a.cls", "b.jpg", "b.CLS", "a.txt"), "u.tar"))
    assert got == [
        {"__key__": "a", "__url__": "u.tar", "__offset__": 0, "jpg": b"a.jpg", "cls": b"a.cls"},
        {"__key__": "b", "__url__": "u.tar", "__offset__": 2048, "jpg": b"b.jpg", "cls": b"b.CLS"},
        # non-consecutive members with the same key form a new sample
        {"__key__": "a", "__url__": "u.tar", "__offset__": 4096, "txt": b"a.txt"},
    ]


def test_group_skips_and_prefixes():
    got = list(
        group_samples(
            members(
                "./d/a.jpg",
                "d/a.seg.png",
                "__index__",
                "d/__meta__.json",
                "noext",
                "d/a.cls",
                "d/b/c.jpg",
            ),
            None,
        )
    )
    assert got == [
        {
            "__key__": "d/a",
            "__url__": None,
            "__offset__": 0,  # the offset of the sample's first member
            "jpg": b"./d/a.jpg",
            "seg.png": b"d/a.seg.png",
            "cls": b"d/a.cls",
        },
        {"__key__": "d/b/c", "__url__": None, "__offset__": 6144, "jpg": b"d/b/c.jpg"},
    ]


def test_group_last_dot():
    got = list(
        group_samples(members("img.001.jpg", "img.001.json", "img.002.jpg"), "u", last_dot=True)
    )
    assert [(s["__key__"], sorted(k for k in s if not is_meta_key(k))) for s in got] == [
        ("img.001", ["jpg", "json"]),
        ("img.002", ["jpg"]),
    ]
    # the default splits at the first dot: all three share the key "img"
    with pytest.raises(DuplicateFieldError):
        list(group_samples(members("img.001.jpg", "img.002.jpg", "img.001.jpg"), "u"))


def test_duplicate_extension_names_both_members():
    with pytest.raises(DuplicateFieldError) as ei:
        list(group_samples(members("k.jpg", "k.cls", "k.JPG"), "shard-3.tar"))
    e = ei.value
    assert isinstance(e, ShardFormatError) and isinstance(e, ValueError)
    msg = str(e)
    assert "'k.jpg'" in msg and "'k.JPG'" in msg  # both members, as named in the tar
    assert "shard-3.tar" in msg and e.url == "shard-3.tar"
    assert e.member == "k.JPG" and e.offset == 2048 and "offset 2048" in msg


def test_duplicate_with_dot_slash_prefix_names_real_members():
    with pytest.raises(DuplicateFieldError) as ei:
        list(group_samples(members("./k.txt", "./k.cls", "./k.txt"), "s.tar"))
    assert "members './k.txt' and './k.txt'" in str(ei.value)
    assert ei.value.member == "./k.txt" and ei.value.offset == 2048


def test_meta_keys():
    assert is_meta_key("__key__") and is_meta_key("__url__") and not is_meta_key("jpg")
    assert is_meta_key("__offset__")


_key = st.from_regex(
    r"[a-z0-9_][a-z0-9_\-]{0,8}(/[a-z0-9_][a-z0-9_\-]{0,8}){0,2}", fullmatch=True
).filter(lambda k: not k.rpartition("/")[2].startswith("__"))
_ext = st.from_regex(r"[a-z0-9]{1,5}(\.[a-z0-9]{1,4})?", fullmatch=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_key, st.lists(_ext, min_size=1, max_size=4, unique=True)), max_size=10))
def test_grouping_property(samples):
    """Consecutive members of distinct keys always regroup into the samples they came from."""
    # adjacent samples must have distinct keys to stay apart
    dedup = []
    for key, exts in samples:
        if dedup and dedup[-1][0] == key:
            continue
        dedup.append((key, exts))
    mem = [(f"{k}.{e}", f"{k}|{e}".encode(), 0) for k, exts in dedup for e in exts]
    got = list(group_samples(mem, "u"))
    assert [(s["__key__"], {k: v for k, v in s.items() if not is_meta_key(k)}) for s in got] == [
        (k, {e: f"{k}|{e}".encode() for e in exts}) for k, exts in dedup
    ]
    for name, _, _ in mem:
        key, ext = split_name(name)
        assert f"{key}.{ext}" == name


# ---------------------------------------------------------------------------------------------
# parse_size: one reading of sizes for the cache, the writer and the CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [
        ("20GB", 20 * 10**9),
        ("20GiB", 20 * 2**30),
        ("20gb", 20 * 10**9),
        ("20G", 20 * 10**9),
        ("500M", 500 * 10**6),
        ("500MiB", 500 * 2**20),
        ("64KiB", 65536),
        ("64kB", 64000),
        ("1.5GB", 1_500_000_000),
        ("1.5 TiB", 3 * 2**39),
        ("3e9", 3 * 10**9),
        ("1000", 1000),
        ("1000B", 1000),
        ("2PB", 2 * 10**15),
        (" 7 ", 7),
        ("0", 0),
        (1000, 1000),
        (1.5e3, 1500),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "GiB", "12Q", "-5M", "1e9e9", "ten", "1 i", "5 GB s"])
def test_parse_size_rejects_text(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_parse_size_rejects_values():
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-1)
    with pytest.raises(ValueError, match="> 0"):
        parse_size("0", positive=True)
    with pytest.raises(ValueError, match="finite"):
        parse_size(float("inf"))
    for bad in (True, None, b"1GB", [1]):
        with pytest.raises(TypeError):
            parse_size(bad)


def test_one_parse_size_for_cache_and_cli(tmp_path):
    """``cache_size="20GB"`` and ``tarsplit -s 20GB`` mean the same number of bytes."""
    from tarshards.cli import _common
    from tarshards.storage import ShardCache

    for text in ("20GB", "20GiB", "1.5MB"):
        cli_bytes = _common.SIZE.convert(text, None, None)
        assert ShardCache(tmp_path / "c", max_bytes=text).max_bytes == cli_bytes
        assert cli_bytes == parse_size(text)


def test_grouping_holds_nothing_of_a_batch_while_the_next_is_read():
    """When the grouping asks for the next batch, it keeps neither the last batch nor the
    samples it handed on (the reader copies the next batch into the memory they free)."""
    import sys

    first = [("a.cls", b"1", 0), ("a.jpg", b"A" * 1000, 512), ("b.cls", b"2", 2048)]
    data = first[1][1]
    seen = []

    def batches():
        batch = first
        yield batch
        # each: in one variable here, in ``first`` (or its member tuple), and getrefcount's
        # argument
        seen.append((sys.getrefcount(batch), sys.getrefcount(data)))
        yield [("b.jpg", b"B", 2560)]

    it = group_samples(batches(), "u", batched=True)
    sample = next(it)
    assert sample["jpg"] is data
    del sample
    rest = list(it)
    assert [s["__key__"] for s in rest] == ["b"]
    assert seen == [(3, 3)]
