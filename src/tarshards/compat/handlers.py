"""webdataset's error handlers: tarshards' own (they never sleep; warnings name the shard,
member and offset)."""

from ..pipeline.stages import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,  # noqa: F401
    warn_and_continue,
    warn_and_stop,
)

__all__ = [
    "ignore_and_continue",
    "ignore_and_stop",
    "reraise_exception",
    "warn_and_continue",
    "warn_and_stop",
]
