"""Reading shards: shard specs, the plain path (samples of shards in turn), random access
(``IndexedDataset``) and sidecar column groups read beside their base.

``specs``     shard specs: brace ranges, globs, lists, manifests
``reading``   the samples of shards in turn, with the error policy and prefetching
``indexed``   random access to samples through the shard indexes
``sidecar``   sidecar column groups and joins, read row by row beside their base
"""
