"""Shards -> exactly sized uint8 batches on every rank (see mpp.data.stream), plus transforms."""
from mpp.data.decode import DataError
from mpp.data.stream import ShardLoader, make_loader
from mpp.data.transforms import normalize, to_float01

__all__ = ["DataError", "ShardLoader", "make_loader", "normalize", "to_float01"]
