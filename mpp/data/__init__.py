"""Shards -> uint8 batches, the same number on every rank (see mpp.data.stream), plus transforms."""
from mpp.data.decode import DataError
from mpp.data.stream import ShardLoader, make_loader, shield_workers
from mpp.data.transforms import normalize, to_float01

__all__ = ["DataError", "ShardLoader", "make_loader", "normalize", "shield_workers", "to_float01"]
