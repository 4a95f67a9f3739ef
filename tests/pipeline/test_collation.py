"""collate_packed (the varlen attention layout) and collate_padded (padding with masks)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tarshards
from tarshards import collate_packed, collate_padded

lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=12)


def _pack(lengths, start=0):
    return [
        {"__key__": f"s{start + i}", "tokens": np.arange(n, dtype=np.int32) + 1000 * (start + i)}
        for i, n in enumerate(lengths)
    ]


@given(lengths=lengths_st)
@settings(max_examples=80, deadline=None)
def test_cu_seqlens_and_position_ids(lengths):
    pack = _pack(lengths)
    out = collate_packed(pack)
    cu = out["cu_seqlens"]
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == sum(lengths)
    assert np.diff(cu).tolist() == lengths
    assert out["max_seqlen"] == max(lengths)
    np.testing.assert_array_equal(out["tokens"], np.concatenate([s["tokens"] for s in pack]))
    assert out["tokens"].dtype == np.int32
    for i, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
        assert out["position_ids"][a:b].tolist() == list(range(b - a))  # restarts per sequence
        assert (out["tokens"][a:b] // 1000 == i).all()  # sequence i's own tokens
    assert out["mask"].all() and out["__key__"] == [s["__key__"] for s in pack]


@given(packs=st.lists(lengths_st, min_size=1, max_size=4), extra=st.integers(0, 9))
@settings(max_examples=60, deadline=None)
def test_several_packs_padded_to_a_fixed_length(packs, extra):
    pad_to = max(sum(p) for p in packs) + extra
    batch = [_pack(p, 100 * j) for j, p in enumerate(packs)]
    out = collate_packed(batch, "tokens", pad_to=pad_to, pad_id=-1)
    tokens = out["tokens"].reshape(len(packs), pad_to)  # one row a pack
    mask = out["mask"].reshape(len(packs), pad_to)
    cu = out["cu_seqlens"]
    for row, p in enumerate(packs):
        used = sum(p)
        assert mask[row, :used].all() and not mask[row, used:].any()
        assert (tokens[row, used:] == -1).all()
        assert row * pad_to in cu and (row + 1) * pad_to in cu  # no sequence crosses a row
    assert cu[-1] == len(packs) * pad_to
    seqs = [n for p in packs for n in p + ([pad_to - sum(p)] if sum(p) < pad_to else [])]
    assert np.diff(cu).tolist() == seqs
    starts = np.repeat(cu[:-1], seqs)
    np.testing.assert_array_equal(out["position_ids"], np.arange(cu[-1]) - starts)


def test_max_tokens_cuts_sequences_and_pad_to_refuses_overflow():
    pack = _pack([5, 12])
    out = collate_packed(pack, max_tokens=8)
    assert np.diff(out["cu_seqlens"]).tolist() == [5, 8]
    with pytest.raises(ValueError, match="pad_to"):
        collate_packed(pack, pad_to=10)


def test_sample_kinds():
    arrays = [np.arange(3), np.arange(2)]
    assert collate_packed(arrays)["cu_seqlens"].tolist() == [0, 3, 5]
    tuples = [(np.arange(4), "a"), (np.arange(1), "b")]
    assert collate_packed(tuples)["cu_seqlens"].tolist() == [0, 4, 5]
    lists = [[1, 2, 3], [4]]
    assert collate_packed(lists)["tokens"].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="field"):
        collate_packed([{"a": np.arange(2), "b": np.arange(3)}])
    out = collate_packed([{"a": np.arange(2), "b": np.arange(3)}], "b")
    assert out["b"].tolist() == [0, 1, 2] and len(out["a"]) == 1


def test_collate_padded_dicts_tuples_arrays():
    samples = [{"tokens": np.arange(3), "cls": 1}, {"tokens": np.arange(5), "cls": 2}]
    out = collate_padded(samples, pad_value=-1)
    assert out["tokens"].tolist() == [[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]]
    assert out["tokens_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert out["cls"].tolist() == [1, 2]
    images = [(np.ones((2, 3, 3)), 0), (np.ones((4, 2, 3)), 1)]
    x, cls, mask = collate_padded(images, mask_axes=2)
    assert x.shape == (2, 4, 3, 3) and mask.shape == (2, 4, 3) and cls.tolist() == [0, 1]
    assert mask[0].sum() == 6 and mask[1].sum() == 8 and x.sum() == (6 + 8) * 3
    x, mask = collate_padded([np.ones(3), np.ones(1)], multiple_of=8)
    assert x.shape == (2, 8) and mask.sum(1).tolist() == [3, 1]


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    pack = [{"tokens": torch.arange(3)}, {"tokens": torch.arange(2)}]
    out = collate_packed(pack)
    assert isinstance(out["tokens"], torch.Tensor)
    assert out["cu_seqlens"].dtype == torch.int32 and out["cu_seqlens"].tolist() == [0, 3, 5]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1]
    as_torch = collate_packed(_pack([2, 2]), tensors="torch")
    assert isinstance(as_torch["cu_seqlens"], torch.Tensor)
    x, mask = collate_padded([torch.ones(2), torch.ones(3)])
    assert isinstance(x, torch.Tensor) and mask.dtype == torch.bool


def test_exported():
    assert tarshards.collate_packed is collate_packed
    assert "collate_padded" in tarshards.__all__
