"""Writing shards: ``TarWriter`` (one tar) and ``ShardWriter`` (a sequence of shards, with their
indexes and a manifest recorded while writing). The member writer is :mod:`tarshards.tario`."""
