"""Which samples each reader reads, in which order: pure functions of data, seed and epoch.

``shards``   the plain split of a shard list by node and worker (no plan)
``epoch``    the epoch plan (``ShardTable``, ``EpochPlan``) and its typed state
``cursor``   the cursor that reads one virtual reader's part of an epoch
``planned``  the planned iteration (positions by arithmetic on the plan)
``packing``  packs and buckets planned from metadata columns
``mixing``   mixtures of data sets (by samples or by tokens, weights by step)
``ledger``   the data-order ledger and its audit (replays the plans)
"""

# The names of the module that ``tarshards.plan`` was before the packages (``plan.py``, now
# ``plan/epoch.py``) stay attributes of the package, imported on first use:
# ``from tarshards.plan import X`` still works for them. Submodules are imported as such.

from __future__ import annotations

from .._lazy import names_of

__getattr__ = names_of(
    "tarshards.plan",
    "tarshards.plan.epoch",
    ["cursor", "epoch", "ledger", "mixing", "packing", "planned", "shards"],
)
