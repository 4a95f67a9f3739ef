"""tarshards.KeyIndex: the key table (key -> shard and row) built from the shard indexes."""

from __future__ import annotations

import filecmp
import itertools
import json
import os
import pickle
from unittest import mock

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tarshards
from tarshards.curate import KeyIndex
from tarshards.curate import keyindex as keyindex_module
from tarshards.errors import DuplicateKeyError, IntegrityError, ShardFormatError
from tarshards.format.hashing import hash_rows
from tarshards.format.manifest import ManifestRecorder
from tarshards.pipeline.dataset import shard_samples


def write_set(folder, shards: list[list[str]], name="manifest.json"):
    """One shard per list of keys (written in order), the manifest and indexes beside them."""
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(name)[0]
    with ManifestRecorder(os.path.join(folder, name)) as recorder:
        for i, keys in enumerate(shards):
            path = os.path.join(folder, f"{stem}-{i:04d}.tar")
            with tarshards.TarWriter(path, index=True) as w:
                for k in keys:
                    w.write({"__key__": k, "txt": f"value of {k}"})
            recorder.add(path, w.index)
        recorder.save()
    return os.path.join(folder, name)


def read_order(manifest) -> list[tuple[str, str, int]]:
    """(key, shard url, row) of every sample, as a sequential read yields them."""
    out = []
    for url in tarshards.Manifest.load(manifest).shard_urls():
        for row, sample in enumerate(shard_samples(url)):
            out.append((sample["__key__"], url, row))
    return out


def table_files(path):
    return sorted(os.listdir(path))


def same_bytes(a, b) -> bool:
    names = table_files(a)
    return names == table_files(b) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


KEY = st.text(alphabet="abcxyz0189_-é中/", min_size=1, max_size=12).filter(
    lambda k: (
        not k.startswith("/")
        and not k.endswith("/")
        and "//" not in k
        and not k.rpartition("/")[2].startswith("__")
    )  # readers skip such members
)


@st.composite
def data_sets(draw):
    keys = draw(st.lists(KEY, min_size=0, max_size=60, unique=True))
    cuts = sorted(draw(st.lists(st.integers(0, len(keys)), min_size=0, max_size=4)))
    bounds = [0, *cuts, len(keys)]
    return [keys[a:b] for a, b in itertools.pairwise(bounds)]


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shards=data_sets(), missing=st.lists(KEY, max_size=10), bucket_keys=st.sampled_from([1, 3, 256])
)
def test_every_key_maps_to_its_shard_and_row(tmp_path_factory, shards, missing, bucket_keys):
    folder = tmp_path_factory.mktemp("set")
    manifest = write_set(folder, shards)
    truth = read_order(manifest)
    with mock.patch.object(keyindex_module, "_BUCKET_KEYS", bucket_keys):  # more buckets
        ki = KeyIndex.build(manifest, folder / "keys.tski", chunk_keys=16, group_keys=7)
    bits = ki.header["bucket_bits"]
    assert len(truth) >> bits <= bucket_keys and ki.buckets[-1] == len(truth)
    assert len(ki) == len(truth)
    for key, url, row in truth:
        assert ki[key] == (url, row)
        assert key in ki
    keys = [k for k, _, _ in truth]
    shard, row = ki.lookup(keys)
    urls = tarshards.Manifest.load(manifest).shard_urls()
    assert [(urls[s], int(r)) for s, r in zip(shard, row)] == [(u, r) for _, u, r in truth]
    absent = [k for k in missing if k not in set(keys)]
    for k in absent:
        assert ki.get(k) is None and k not in ki
        with pytest.raises(KeyError):
            ki[k]
    shard, row = ki.lookup(absent + keys[:3])
    assert shard[: len(absent)].tolist() == [-1] * len(absent)
    assert row[: len(absent)].tolist() == [-1] * len(absent)
    assert (shard[len(absent) :] >= 0).all()


def test_hash_rows_is_xxh3_of_each_row():
    rows = [b"", b"a", "é中".encode(), b"x" * 1000, b"key-0001"]
    blob = b"".join(rows)
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    got = np.frombuffer(hash_rows(blob, offsets), np.uint64).tolist()
    assert got == [xxhash.xxh3_64_intdigest(r) for r in rows]
    with pytest.raises(ValueError):
        hash_rows(blob, np.array([0, 5, 2], np.int64))
    with pytest.raises(ValueError):
        hash_rows(blob, np.array([0, len(blob) + 1], np.int64))


def test_hash_rows_without_the_c_module(monkeypatch):
    import tarshards.format.hashing as hashing

    rows = [b"", b"abc", "é".encode(), b"y" * 300]
    blob = b"".join(rows)
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    with_c = hash_rows(blob, offsets)
    monkeypatch.setattr(hashing, "_xxh3", None)
    assert hashing.hash_rows(blob, offsets) == with_c
    with pytest.raises(ValueError):
        hashing.hash_rows(blob, np.array([0, 3, 1], np.int64))


@pytest.fixture
def small_set(tmp_path):
    shards = [[f"s{s}-{i:03d}" for i in range(40)] for s in range(5)]
    return write_set(tmp_path / "d", shards), shards


def test_lookup_of_str_and_bytes_and_stored_order(small_set, tmp_path):
    manifest, shards = small_set
    ki = KeyIndex.build(manifest, tmp_path / "k.tski")
    assert ki.locate(b"s3-007") == (3, 7) == ki.locate("s3-007")
    assert (np.diff(ki.hashes.astype(np.float64)) >= 0).all()
    buckets = 8 * ((1 << ki.header["bucket_bits"]) + 1)
    assert ki.nbytes == 200 * (8 + 4 + 4 + 8) + 8 + sum(len(k) for s in shards for k in s) + buckets
    with pytest.raises(TypeError):
        ki.lookup("s0-000")  # one key: ki[key]
    with pytest.raises(TypeError):
        ki.get(3)
    shard, row = ki.lookup([])
    assert shard.shape == row.shape == (0,)


def test_memory_mapped_and_read_only(small_set, tmp_path):
    manifest, _ = small_set
    KeyIndex.build(manifest, tmp_path / "k.tski")
    ki = KeyIndex.open(tmp_path / "k.tski")
    for a in (ki.hashes, ki.shards, ki.rows, ki.key_offsets, ki.key_bytes):
        assert isinstance(a, np.memmap) and a.filename.startswith(str(tmp_path / "k.tski"))
        with pytest.raises(ValueError):
            a[0] = 1
    again = pickle.loads(pickle.dumps(ki))  # worker processes map the same files
    assert again["s4-039"] == ki["s4-039"] and isinstance(again.hashes, np.memmap)


def test_two_workers_equal_one_byte_for_byte(small_set, tmp_path, monkeypatch):
    manifest, _ = small_set
    monkeypatch.setattr(keyindex_module, "_BUCKET_KEYS", 4)
    one = KeyIndex.build(manifest, tmp_path / "one.tski", workers=1, group_keys=50)
    two = KeyIndex.build(manifest, tmp_path / "two.tski", workers=2, group_keys=50, chunk_keys=30)
    assert same_bytes(one.path, two.path)
    whole = KeyIndex.build(manifest, tmp_path / "whole.tski", group_keys=1 << 20)
    assert same_bytes(one.path, whole.path)
    assert one.header["bucket_bits"] == 6  # 200 keys, about 4 a bucket
    top = (one.hashes >> np.uint64(58)).astype(np.int64)
    assert one.buckets.tolist() == np.searchsorted(top, np.arange(65)).tolist()


def test_duplicate_keys(tmp_path):
    shards = [["a", "b", "c"], ["d", "b", "e"], ["f", "a", "g", "b"]]
    manifest = write_set(tmp_path / "d", shards)
    urls = tarshards.Manifest.load(manifest).shard_urls()
    with pytest.raises(DuplicateKeyError) as info:
        KeyIndex.build(manifest, tmp_path / "k.tski")
    assert "3 key(s)" in str(info.value) and info.value.member in ("a", "b")
    assert info.value.url in urls[1:]
    assert not os.path.exists(tmp_path / "k.tski")  # nothing left behind
    assert [p for p in os.listdir(tmp_path) if p.startswith("k.tski")] == []
    ki = KeyIndex.build(manifest, tmp_path / "k.tski", duplicates="first")
    assert ki.duplicates == 3 and len(ki) == 10 - 3
    assert ki["a"] == (urls[0], 0) and ki["b"] == (urls[0], 1) and ki["g"] == (urls[2], 2)
    first = ki.header["duplicates"]["first"]
    assert sorted(map(tuple, (tuple(x[1]) + tuple(x[2]) for x in first))) == sorted(
        [(0, 0, 2, 1), (0, 1, 1, 1), (0, 1, 2, 3)]
    )
    with pytest.raises(ValueError):
        KeyIndex.build(manifest, tmp_path / "x.tski", duplicates="last")


def test_collisions_are_told_apart_by_the_keys(small_set, tmp_path, monkeypatch):
    """With a hash of 3 bits every key shares its hash with dozens: lookups stay exact."""
    manifest, _shards = small_set

    def weak_rows(blob, offsets):
        return (np.frombuffer(hash_rows(blob, offsets), np.uint64) & np.uint64(7)).tobytes()

    monkeypatch.setattr(keyindex_module, "hash_rows", weak_rows)
    monkeypatch.setattr(
        keyindex_module,
        "member_checksum_fn",
        lambda name: lambda b: xxhash.xxh3_64_intdigest(b) & 7,
    )
    ki = KeyIndex.build(manifest, tmp_path / "k.tski", chunk_keys=20, workers=1)
    assert ki.header["collisions"] == 200 and set(ki.hashes.tolist()) <= set(range(8))
    stored = list(zip(ki.hashes.tolist(), ki.shards.tolist(), ki.rows.tolist()))
    assert stored == sorted(stored)  # ties in (shard, row) order
    truth = read_order(manifest)
    urls = tarshards.Manifest.load(manifest).shard_urls()
    for key, url, row in truth[::7]:
        assert ki[key] == (url, row)
    shard, row = ki.lookup([k for k, _, _ in truth] + ["nope", "s0-0000"])
    assert [(urls[s], int(r)) for s, r in zip(shard[:-2], row[:-2])] == [
        (u, r) for _, u, r in truth
    ]
    assert shard[-2:].tolist() == [-1, -1] and ki.get("s9-000") is None


def test_a_hash_match_alone_is_not_a_hit(small_set, tmp_path):
    manifest, _ = small_set
    ki = KeyIndex.build(manifest, tmp_path / "k.tski")
    j = int(np.flatnonzero(ki.key_offsets[1:] - ki.key_offsets[:-1] == 6)[0])
    a = int(ki.key_offsets[j])
    key = ki.key_bytes[a : a + 6].tobytes().decode()
    assert key in ki
    with open(tmp_path / "k.tski" / "keys.bin", "r+b") as f:  # the stored key changed
        f.seek(a)
        f.write(b"Z")
    ki = KeyIndex.open(tmp_path / "k.tski")
    assert key not in ki and ki.lookup([key])[0].tolist() == [-1]


def test_stale_manifest_refused(tmp_path):
    manifest = write_set(tmp_path / "d", [["a", "b"], ["c"]])
    KeyIndex.build(manifest, tmp_path / "k.tski")
    assert KeyIndex.open(tmp_path / "k.tski", manifest=manifest)["c"][1] == 0
    write_set(tmp_path / "d", [["a", "b"], ["c", "d"]])  # shard 1 and the manifest rewritten
    with pytest.raises(IntegrityError, match="another version of the data set"):
        KeyIndex.open(tmp_path / "k.tski", manifest=manifest)
    ki = KeyIndex.build(manifest, tmp_path / "k.tski")  # rebuilt in place
    assert ki.fingerprint == tarshards.Manifest.load(manifest).fingerprint and "d" in ki
    assert KeyIndex.open(tmp_path / "k.tski", manifest=manifest)["d"][1] == 1


def test_same_names_and_counts_other_keys_refused(tmp_path):
    """The data's fingerprint (names, counts) is the same; the manifest's checksum (sizes,
    hashes) is not, and a key table is about the keys: refused."""
    manifest = write_set(tmp_path / "d", [["a", "b"], ["c"]])
    KeyIndex.build(manifest, tmp_path / "k.tski")
    before = tarshards.Manifest.load(manifest)
    write_set(tmp_path / "d", [["a", "b"], ["x"]])
    after = tarshards.Manifest.load(manifest)
    assert after.fingerprint == before.fingerprint and after.checksum != before.checksum
    with pytest.raises(IntegrityError, match="another version of the data set"):
        KeyIndex.open(tmp_path / "k.tski", manifest=manifest)


def test_table_from_before_the_checksum_opens(tmp_path):
    """A header written before it had ``checksum`` holds the manifest's checksum (the old
    fingerprint) under ``fingerprint``: it opens with the same manifest, not with another."""
    manifest = write_set(tmp_path / "d", [["a", "b"], ["c"]])
    KeyIndex.build(manifest, tmp_path / "k.tski")
    head = tmp_path / "k.tski" / "keyindex.json"
    header = json.loads(head.read_text())
    header["manifest"]["fingerprint"] = header["manifest"].pop("checksum")
    head.write_text(json.dumps(header))
    assert KeyIndex.open(tmp_path / "k.tski", manifest=manifest)["c"][1] == 0
    write_set(tmp_path / "d", [["a", "b"], ["x"]])
    with pytest.raises(IntegrityError, match="another version of the data set"):
        KeyIndex.open(tmp_path / "k.tski", manifest=manifest)


def test_index_not_matching_the_manifest_refused(tmp_path):
    old = tarshards.Manifest.load(write_set(tmp_path / "d", [["a", "b"], ["c"]]))
    write_set(tmp_path / "d", [["a", "b"], ["c", "d"]])  # the index of shard 1 rewritten
    with pytest.raises(IntegrityError, match="does not match the manifest"):
        KeyIndex.build(old, tmp_path / "k.tski")


def test_data_set_moved_as_a_whole(small_set, tmp_path):
    manifest, _ = small_set
    KeyIndex.build(manifest, tmp_path / "d" / "keys.tski")
    os.rename(tmp_path / "d", tmp_path / "moved")
    ki = KeyIndex.open(tmp_path / "moved" / "keys.tski")
    assert ki["s2-005"] == (str(tmp_path / "moved" / "manifest-0002.tar"), 5)
    ki = KeyIndex.open(
        tmp_path / "moved" / "keys.tski", manifest=tmp_path / "moved" / "manifest.json"
    )
    assert ki["s2-005"][0] == str(tmp_path / "moved" / "manifest-0002.tar")


def test_shard_spec_source(small_set, tmp_path):
    _manifest, _ = small_set
    spec = str(tmp_path / "d" / "manifest-{0000..0004}.tar")
    ki = KeyIndex.build(spec, tmp_path / "k.tski", workers=1)
    assert ki["s1-001"] == (str(tmp_path / "d" / "manifest-0001.tar"), 1)
    assert KeyIndex.open(tmp_path / "k.tski", manifest=spec)["s4-000"][1] == 0


def test_bad_paths_and_files(small_set, tmp_path):
    manifest, _ = small_set
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="not a key index"):
        KeyIndex.build(manifest, tmp_path / "taken")
    with pytest.raises(ValueError, match="local directory"):
        KeyIndex.build(manifest, "s3://bucket/keys.tski")
    with pytest.raises(ShardFormatError):
        KeyIndex.open(tmp_path / "taken")
    KeyIndex.build(manifest, tmp_path / "k.tski")
    with open(tmp_path / "k.tski" / "rows.u32", "r+b") as f:
        f.truncate(12)
    with pytest.raises(IntegrityError, match=r"rows.u32"):
        KeyIndex.open(tmp_path / "k.tski")
    header = json.loads((tmp_path / "k.tski" / "keyindex.json").read_text())
    header["version"] = 99
    (tmp_path / "k.tski" / "keyindex.json").write_text(json.dumps(header))
    with pytest.raises(ShardFormatError, match="version 99"):
        KeyIndex.open(tmp_path / "k.tski")


def test_empty_data_set(tmp_path):
    manifest = write_set(tmp_path / "d", [[]])
    ki = KeyIndex.build(manifest, tmp_path / "k.tski")
    assert len(ki) == 0 and "a" not in ki and ki.lookup(["a"])[0].tolist() == [-1]


def test_exported_lazily():
    assert tarshards.KeyIndex is KeyIndex
    assert tarshards.DuplicateKeyError is DuplicateKeyError


@pytest.mark.parametrize(
    "rows",
    [
        [b"abcd", b"efgh", b"ijkl", b"mnop"],  # one width: rows copied whole
        [b"a", b"", "é中".encode(), b"xyz", b"0123456789"],  # padded to the widest
        [b"k%d" % i for i in range(300)] + [b"L" * 5000],  # one long row: a byte index
    ],
)
def test_reorder_rows(rows):
    blob = np.frombuffer(b"".join(rows), np.uint8)
    lengths = np.array([len(r) for r in rows], np.int64)
    perm = np.random.default_rng(0).permutation(len(rows))[: len(rows) - 1]  # a selection too
    out, offsets = keyindex_module._reorder_rows(blob, lengths, perm)
    want = [rows[i] for i in perm]
    assert out.tobytes() == b"".join(want)
    assert np.diff(offsets).tolist() == [len(r) for r in want]
