"""WebDataset's options as frozen values (ReadOptions, PlanOptions, SafetyOptions): a signature of
at most 16 parameters on the public class, every keyword of before still accepted and equal to
its grouped form, the values frozen and checked, datasets still pickled into workers."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import pydoc

import numpy as np
import pytest
from conftest import write_shards

import tarshards
from tarshards import split_by_node, split_by_worker, warn_and_continue
from tarshards.pipeline import dataset as core
from tarshards.types import EpochContext, PlanOptions, ReadOptions, SafetyOptions, WorkerInfo

GROUPS = {"read_options": ReadOptions, "plan_options": PlanOptions, "safety_options": SafetyOptions}


def _keep(urls):
    return list(urls)


# every keyword WebDataset.__init__ took before the options were grouped (31 of them), with a
# value other than its default; "needs": other keywords that value needs
BEFORE = {
    "extensions": ("jpg cls", {}),
    "decoder": ("pil", {}),
    "transforms": (None, {}),
    "shuffle": (10, {}),
    "shardshuffle": (True, {}),
    "resampled": (True, {}),
    "seed": (7, {}),
    "on_error": ("skip", {}),
    "handler": (warn_and_continue, {}),
    "nodesplitter": (_keep, {}),
    "workersplitter": (_keep, {}),
    "empty_check": (False, {}),
    "rank": (1, {"world_size": 2}),
    "world_size": (2, {}),
    "storage_options": ({"anon": True}, {}),
    "allow_pipe": (True, {}),
    "cache_dir": ("CACHE", {}),
    "cache_size": ("1GB", {"cache_dir": "CACHE"}),
    "retries": (2, {}),
    "last_dot": (True, {}),
    "decode_size": ((16, 12), {"decoder": "rgb"}),
    "allow_unsafe": (True, {}),
    "manifest": ("MANIFEST", {}),
    "verify": (True, {"manifest": "MANIFEST"}),
    "prefetch": (3, {}),
    "prefetch_bytes": (1 << 20, {}),
    "readers": (4, {}),
    "remainder": ("carry", {"readers": 4}),
    "equal": (True, {"readers": 4}),
    "copy": (False, {}),
    "split": ("train", {}),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    paths, samples = write_shards(root, 2, 5)
    manifest = str(root / "manifest.json")
    tarshards.build_manifest(paths, manifest)
    energon = root / "energon"
    (energon / ".nv-meta").mkdir(parents=True)
    write_shards(energon, 2, 3)
    (energon / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n    - shard-0000.tar\n  val:\n    - shard-0001.tar\n"
    )
    return {"paths": paths, "samples": samples, "manifest": manifest, "root": root, "en": energon}


def _value(x, data):
    if x == "MANIFEST":
        return data["manifest"]
    if x == "CACHE":
        return str(data["root"] / "cache")
    return x


def _make(cls, data, name, **kw):
    urls = str(data["en"]) if name == "split" else data["paths"]
    return cls(urls, **{k: _value(v, data) for k, v in kw.items()})


def _classes():
    out = [core.WebDataset]
    try:
        import tarshards.torch.adapter
    except ImportError:
        return out
    return out + [tarshards.WebDataset]


def test_every_keyword_of_before_is_listed():
    sig = inspect.signature(core.WebDataset).parameters
    flat = {n for n, p in sig.items() if p.kind is not p.VAR_KEYWORD} - set(GROUPS)
    fields = {f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)}
    # keywords added since, each in its group: fields= (sidecar columns, ReadOptions)
    since = {"fields"}
    assert flat | fields | {"urls", "handler"} == set(BEFORE) | {"urls"} | since


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__module__)
def test_signature_is_short_and_visible(cls):
    sig = inspect.signature(cls)
    assert len(sig.parameters) <= 16
    names = list(sig.parameters)
    assert names[:5] == ["urls", "extensions", "decoder", "transforms", "shuffle"]
    assert set(GROUPS) <= set(names)
    assert "args" not in names
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "read_options" in text and "plan_options" in text and "**options" in text


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__module__)
@pytest.mark.parametrize("name", sorted(BEFORE))
def test_every_keyword_of_before_works_and_equals_its_group(cls, data, name):
    value, needs = BEFORE[name]
    flat = _make(cls, data, name, **needs, **{name: value})
    group = next((g for g, c in GROUPS.items() if name in c.__dataclass_fields__), None)
    if group is None:  # still a parameter of its own, or handler= (on_error's older name)
        assert name in inspect.signature(cls).parameters or name == "handler"
        if name == "handler":
            same = _make(cls, data, name, on_error=value).on_error
            assert flat.on_error.mode == same.mode == "callable"
            assert repr(flat.on_error) == repr(same)
        return
    values = {}  # the same options given as values
    for k, v in {**needs, name: value}.items():
        g = next((g for g, c in GROUPS.items() if k in c.__dataclass_fields__), None)
        if g is None:
            values[k] = v
        else:
            values.setdefault(g, {})[k] = _value(v, data)
    grouped = _make(
        cls, data, name, **{k: (GROUPS[k](**v) if k in GROUPS else v) for k, v in values.items()}
    )
    for g in GROUPS:
        assert getattr(flat, g) == getattr(grouped, g)
    assert getattr(getattr(flat, group), name) == _value(value, data)
    assert getattr(flat, group) != getattr(_make(cls, data, name, **needs), group)
    if hasattr(flat, name):  # the flat attributes of before read the values' fields
        assert getattr(flat, name) == _value(value, data)


def test_grouped_and_flat_read_the_same(data):
    paths = data["paths"]
    flat = list(core.WebDataset(paths, shardshuffle=False, last_dot=True, prefetch=0, copy=False))
    grouped = list(
        core.WebDataset(
            paths,
            shardshuffle=False,
            read_options=ReadOptions(last_dot=True, prefetch=0, copy=False),
        )
    )
    assert [s["__key__"] for s in flat] == [s["__key__"] for s in grouped]
    assert [s["__key__"] for s in flat] == [s["__key__"] for s in data["samples"]]
    assert isinstance(grouped[0]["cls"], memoryview)


def test_unknown_and_doubled_keywords_raise(data):
    paths = data["paths"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'retires'"):
        core.WebDataset(paths, retires=3)
    with pytest.raises(TypeError, match="retries="):
        core.WebDataset(paths, read_options=ReadOptions(), retries=3)
    with pytest.raises(TypeError, match="plan_options must be a PlanOptions"):
        core.WebDataset(paths, plan_options=ReadOptions())
    # keywords of another group combine with a value
    ds = core.WebDataset(paths, read_options=ReadOptions(retries=3), readers=4)
    assert (ds.retries, ds.plan_options.readers) == (3, 4)


def test_setting_a_flat_attribute_replaces_the_value(data):
    ds = core.WebDataset(data["paths"])
    before = ds.read_options
    ds.retries = 1
    assert ds.read_options.retries == 1 and before.retries == 5
    assert dataclasses.replace(before, retries=1) == ds.read_options


@pytest.mark.parametrize("cls", [ReadOptions, PlanOptions, SafetyOptions, EpochContext])
def test_values_are_frozen(cls):
    value = cls()
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, None)


@pytest.mark.parametrize(
    "make, error, field",
    [
        (lambda: ReadOptions(retries=-1), ValueError, "retries"),
        (lambda: ReadOptions(retries="3"), TypeError, "retries"),
        (lambda: ReadOptions(storage_options=["anon"]), TypeError, "storage_options"),
        (lambda: ReadOptions(prefetch=-1), ValueError, "prefetch"),
        (lambda: ReadOptions(prefetch_bytes=0), ValueError, "prefetch_bytes"),
        (lambda: ReadOptions(cache_dir=3), TypeError, "cache_dir"),
        (lambda: ReadOptions(copy="no"), TypeError, "copy"),
        (lambda: SafetyOptions(verify="yes"), TypeError, "verify"),
        (lambda: SafetyOptions(empty_check=None), TypeError, "empty_check"),
        (lambda: PlanOptions(readers=4, equal="yes"), TypeError, "equal"),
        (lambda: PlanOptions(readers=0), ValueError, "readers"),
        (lambda: PlanOptions(readers=2.5), TypeError, "readers"),
        (lambda: PlanOptions(readers=4, remainder="keep"), ValueError, "remainder"),
        (lambda: PlanOptions(equal=True), ValueError, "readers"),
        (lambda: PlanOptions(readers=4, equal=False), ValueError, "readers"),
        (lambda: PlanOptions(rank=2, world_size=2), ValueError, "rank"),
        (lambda: PlanOptions(world_size=0), ValueError, "world_size"),
        (lambda: PlanOptions(nodesplitter="split"), TypeError, "nodesplitter"),
    ],
)
def test_bad_values_name_their_field(make, error, field):
    with pytest.raises(error, match=field):
        make()


def test_bad_flat_keyword_names_its_field(data):
    with pytest.raises(ValueError, match="retries"):
        core.WebDataset(data["paths"], retries=-1)


def test_numpy_integers_are_ints():
    value = PlanOptions(readers=np.int64(4), rank=np.int32(0), world_size=np.int64(2))
    assert value == PlanOptions(readers=4, rank=0, world_size=2)
    assert type(value.readers) is int
    flags = SafetyOptions(allow_unsafe=np.bool_(True), verify=1, empty_check=0)
    assert flags == SafetyOptions(allow_unsafe=True, verify=True, empty_check=False)
    copy = ReadOptions(storage_options={"anon": True})
    assert pickle.loads(pickle.dumps(copy)) == copy


def test_shard_list_takes_an_epoch_context(data):
    ds = core.WebDataset(
        data["paths"] * 2, nodesplitter=split_by_node, workersplitter=split_by_worker
    )
    for rank, worker in [(0, 0), (1, 1)]:
        place = WorkerInfo(rank=rank, world_size=2, worker=worker, num_workers=2)
        context = EpochContext(seed=3, epoch=1, worker=place)
        as_dict = {
            "seed": 3,
            "epoch": 1,
            "rank": rank,
            "world_size": 2,
            "worker": worker,
            "num_workers": 2,
        }
        got = list(ds.shard_list(context))
        assert got == list(ds.shard_list(as_dict))
        assert len(got) == 1


def test_datasets_with_values_pickle(data):
    ds = core.WebDataset(
        data["paths"],
        shardshuffle=False,
        read_options=ReadOptions(retries=2, last_dot=True),
        plan_options=PlanOptions(rank=0, world_size=1),
        safety_options=SafetyOptions(empty_check=False),
    )
    back = pickle.loads(pickle.dumps(ds))
    for g in GROUPS:
        assert getattr(back, g) == getattr(ds, g)
    assert [s["__key__"] for s in back] == [s["__key__"] for s in ds]


def test_spawned_loader_workers_get_the_values(data):
    torch = pytest.importorskip("torch")
    ds = tarshards.WebDataset(
        data["paths"],
        shardshuffle=False,
        read_options=ReadOptions(retries=2),
        safety_options=SafetyOptions(empty_check=False),
        rank=0,
        world_size=1,
    ).to_tuple("__key__")
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=120
    )
    got = sorted(k for (k,) in loader)
    assert got == sorted(s["__key__"] for s in data["samples"])
