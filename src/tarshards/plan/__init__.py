"""Which samples each reader reads, in which order: pure functions of data, seed and epoch.

``shards``   the plain split of a shard list by node and worker (no plan)
``epoch``    the epoch plan (``ShardTable``, ``EpochPlan``) and its typed state
``cursor``   the cursor that reads one virtual reader's part of an epoch
``planned``  the planned iteration (positions by arithmetic on the plan)
``packing``  packs and buckets planned from metadata columns
``mixing``   mixtures of data sets (by samples or by tokens, weights by step)
``ledger``   the data-order ledger and its audit (replays the plans)
"""
