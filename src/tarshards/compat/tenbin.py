"""webdataset's ``tenbin`` module: tarshards' implementation (:mod:`tarshards.format.tenbin`)."""

from ..format.tenbin import MAGIC, decode_buffer, encode_buffer, load, read, save, write  # noqa: F401

__all__ = ["decode_buffer", "encode_buffer", "load", "read", "save", "write"]
