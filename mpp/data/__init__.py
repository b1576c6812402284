"""Shards -> uint8 batches, in training the same number on every rank (see mpp.data.loader), plus
transforms."""
from mpp.data.decode import DataError
from mpp.data.loader import ShardLoader, make_loader
from mpp.data.stream import shield_workers
from mpp.data.transforms import normalize, to_float01

__all__ = ["DataError", "ShardLoader", "make_loader", "normalize", "shield_workers", "to_float01"]
