"""The shared resume check (tarshards.testing.check_resume) over every stateful stage."""

from __future__ import annotations

import pytest

from tarshards.pipeline.stateful import Batch, Chain, Limit, ListSource, Shuffle, Unbatch
from tarshards.testing import check_resume, run_epochs

CHAINS = {
    "shuffle": lambda: Chain(ListSource(range(23)), Shuffle(5, seed=1)),
    "shuffle-initial": lambda: Chain(ListSource(range(23)), Shuffle(8, initial=2, seed=4)),
    "limit": lambda: Chain(ListSource(range(23)), Limit(11)),
    "batch": lambda: Chain(ListSource(range(23)), Batch(4, list)),
    "unbatch": lambda: Chain(ListSource([[i, i + 1, i + 2] for i in range(0, 21, 3)]), Unbatch()),
    "all": lambda: Chain(
        ListSource(range(40)),
        Shuffle(6, seed=2),
        Batch(3, list),
        Unbatch(),
        Limit(29),
        Batch(4, list),
    ),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_stateful_stage_resumes_exactly(name):
    make = CHAINS[name]
    ref = check_resume(make, epochs=2, resumes_in_one_epoch=3)
    assert ref[0] and ref[0] == ref[1]


def test_stages_do_what_they_say():
    (shuffled,) = [list(x) for x in [Chain(ListSource(range(23)), Shuffle(5, seed=1))]]
    assert sorted(shuffled) == list(range(23)) and shuffled != list(range(23))
    assert list(Chain(ListSource(range(23)), Limit(4))) == [0, 1, 2, 3]
    assert list(Chain(ListSource([[1, 2], [3]]), Unbatch())) == [1, 2, 3]
    assert list(Chain(ListSource(range(5)), Batch(2, list))) == [[0, 1], [2, 3], [4]]
    assert run_epochs(CHAINS["all"](), 1)[0]
