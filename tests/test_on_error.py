"""One error policy (``on_error=``) across stages and pipelines, and the fluent signatures."""

from __future__ import annotations

import inspect
import pickle
import warnings

import pytest
from conftest import write_shards

from tarshards.errors import (
    DecodeError,
    MissingDependencyError,
    MissingFieldError,
    TarshardsWarning,
    UnsafeCodecError,
)
from tarshards.on_error import (
    error_policy,
    ignore_and_continue,
    ignore_and_stop,
    is_data_error,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from tarshards.pipeline import stages
from tarshards.pipeline.dataset import DataPipeline, WebDataset


def _samples(n=4, bad=(1,)):
    return [
        {"__key__": f"k{i}", "__url__": "mem", "cls": b"x" if i in bad else str(i).encode()}
        for i in range(n)
    ]


def _keys(items):
    return [s["__key__"] for s in items]


def test_modes_skip_data_errors_only():
    assert _keys(stages.decode(_samples(), on_error="skip")) == ["k0", "k2", "k3"]
    with pytest.warns(TarshardsWarning, match=r"skipped: .*member 'k1.cls'"):
        assert _keys(stages.decode(_samples(), on_error="warn")) == ["k0", "k2", "k3"]
    with pytest.raises(DecodeError, match=r"k1.cls"):
        list(stages.decode(_samples(), on_error="raise"))

    def bug(sample):  # a bug in user code is not a data error
        raise ZeroDivisionError("user bug")

    for mode in ("skip", "warn"):
        with pytest.raises(ZeroDivisionError):
            list(stages.map(_samples(), bug, on_error=mode))
    # a missing field is about the data
    s = [{"__key__": "a", "jpg": 1}, {"__key__": "b", "png": 2}]
    assert list(stages.to_tuple(s, "jpg", on_error="skip")) == [(1,)]
    with pytest.raises(MissingFieldError):
        list(stages.rename(s, image="jpg"))
    assert _keys(stages.rename(s, image="png", on_error="skip")) == ["b"]
    assert _keys(stages.map_dict(s, jpg=str, on_error="skip")) == ["a"]


def test_setup_errors_are_not_data_errors():
    assert is_data_error(DecodeError("x"))
    assert not is_data_error(MissingDependencyError("x"))
    assert not is_data_error(UnsafeCodecError("x"))
    assert not is_data_error(ValueError("x"))
    s = [{"__key__": "a", "pkl": pickle.dumps(1)}]
    with pytest.raises(UnsafeCodecError):  # not skipped: every sample would be
        list(stages.decode(s, on_error="skip"))


def test_callables_see_every_error_and_decide():
    seen = []

    def policy(exn):
        seen.append(type(exn).__name__)
        return True

    assert _keys(
        stages.map(
            _samples(3, bad=()), lambda s: 1 / 0 if s["__key__"] == "k1" else s, on_error=policy
        )
    ) == ["k0", "k2"]
    assert seen == ["ZeroDivisionError"]
    # webdataset's handlers keep their meaning, through handler= or on_error=
    assert _keys(stages.decode(_samples(), handler=ignore_and_continue)) == ["k0", "k2", "k3"]
    with pytest.warns(TarshardsWarning, match="skipped"):
        assert _keys(stages.decode(_samples(), on_error=warn_and_continue)) == ["k0", "k2", "k3"]
    with pytest.raises(DecodeError):
        list(stages.decode(_samples(), handler=reraise_exception))


@pytest.mark.parametrize("handler", [ignore_and_stop, warn_and_stop, lambda exn: False])
def test_stopping_is_never_silent(handler):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _keys(stages.decode(_samples(), on_error=handler)) == ["k0"]
    messages = [str(w.message) for w in caught if issubclass(w.category, TarshardsWarning)]
    assert len(messages) == 1 and "stopping" in messages[0] and "k1.cls" in messages[0]


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="on_error must be one of"):
        error_policy("ignore")
    with pytest.raises(TypeError):
        error_policy(42)
    with pytest.raises(TypeError, match="not both"):
        error_policy("skip", warn_and_continue)
    with pytest.warns(TarshardsWarning, match="skipped: x"):  # the older name wins
        assert error_policy("raise", warn_and_continue)(DecodeError("x")) is True
    assert pickle.loads(pickle.dumps(error_policy("warn"))).mode == "warn"


def test_pipelines_pass_their_policy_to_stages(tmp_path):
    paths, _ = write_shards(tmp_path, 2, 3)
    with open(tmp_path / "broken.tar", "wb") as f:
        f.write(b"\0" * 100 + b"not a tar archive" * 40)
    urls = [str(tmp_path / "broken.tar"), *paths]
    with pytest.warns(TarshardsWarning, match="broken.tar"):
        assert len(list(WebDataset(urls, on_error="warn"))) == 6  # the shard error
    ds = WebDataset(paths, on_error="skip").map_dict(cls=lambda c: c).to_tuple("cls", "txt")
    assert list(ds) == []  # no .txt in any sample: each is skipped
    with pytest.raises(MissingFieldError):
        next(iter(WebDataset(paths).to_tuple("txt")))
    # a stage's own on_error= wins over the pipeline's
    with pytest.raises(MissingFieldError):
        next(iter(WebDataset(paths, on_error="skip").to_tuple("txt", on_error="raise")))
    dp = DataPipeline(_samples(), on_error="skip").decode()
    assert _keys(dp) == ["k0", "k2", "k3"]
    with pytest.raises(TypeError, match="not both"):
        DataPipeline([], on_error="skip", handler=warn_and_continue)


# ---- fluent methods: the stage's signature and docstring ----------------------------------


def test_fluent_signatures_are_the_stages():
    sig = inspect.signature(WebDataset.shuffle)
    assert str(sig) == (
        "(self, bufsize: 'int' = 1000, initial: 'int | None' = None, *, "
        "seed: 'int | None' = None) -> 'DataPipeline'"
    )
    assert list(inspect.signature(WebDataset.map).parameters) == ["self", "f", "on_error"]
    assert inspect.signature(WebDataset.map).parameters["on_error"].default is None
    batched = inspect.signature(DataPipeline.batched)
    assert list(batched.parameters) == ["self", "batchsize", "collation_fn", "partial"]
    for name in ("shuffle", "decode", "map", "to_tuple", "batched", "rename", "map_dict"):
        method = getattr(WebDataset, name)
        assert method.__doc__ == getattr(stages, name).__doc__
        params = inspect.signature(method).parameters
        assert "samples" not in params and "rng" not in params and "handler" not in params


def test_fluent_arguments_are_checked_when_composed(tmp_path):
    paths, _ = write_shards(tmp_path, 1, 2)
    ds = WebDataset(paths)
    with pytest.raises(TypeError, match=r"\.shuffle\(\)"):
        ds.shuffle(10, 5, 7)  # seed is keyword-only: a third positional would be the rng
    with pytest.raises(TypeError, match=r"\.batched\(\)"):
        ds.batched(4, bogus=1)
    # hidden parameters stay accepted for older code
    assert len(list(ds.map(lambda s: 1 / 0, handler=ignore_and_continue))) == 0
    assert len(list(ds.shuffle(10, seed=3))) == 2
