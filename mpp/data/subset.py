"""Class-balanced, seeded subsets of a labeled shard set (fine-tuning on 1%, 10%, ... of labels).

One pass reads only the `cls` members (images are skipped inside the tar), picks exactly
max(1, round(fraction * n_c)) keys of every class c with a seeded RNG, and returns the shard set
restricted to those keys with recomputed per-shard counts, so batch counts stay exact.
"""
from __future__ import annotations

import random
from collections import defaultdict

from webdataset.tariterators import base_plus_ext

from mpp.data.decode import DataError, read_label
from mpp.data.sources import ShardSet, tar_members


def read_labels(url: str, num_classes: int | None) -> list[tuple[str, int]]:
    """(key, label) of every sample of a shard with a valid `cls` member."""
    out = []
    for name, data in tar_members(url, [], select=lambda name: name.endswith(".cls")):
        key, _ = base_plus_ext(name)
        try:
            out.append((key, read_label(data, num_classes)))
        except (ValueError, UnicodeDecodeError):
            continue  # a bad label is skipped (and counted) by the stream as well
    return out


def select_subset(shards: ShardSet, fraction: float, seed: int) -> ShardSet:
    """`shards` restricted to a class-balanced seeded `fraction` of its samples."""
    if not 0 < fraction <= 1:
        raise DataError(f"subset fraction must be in (0, 1], got {fraction}")
    if not shards.classes:
        raise DataError("a class-balanced subset needs labeled shards with 'classes' in manifest.json")
    by_class: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for s, url in enumerate(shards.urls):
        for key, label in read_labels(url, len(shards.classes)):
            by_class[label].append((s, key))
    rng = random.Random(seed)
    keep: list[set] = [set() for _ in shards.urls]
    for label in sorted(by_class):
        members = sorted(by_class[label])
        for s, key in rng.sample(members, max(1, round(fraction * len(members)))):
            keep[s].add(key)
    idx = [s for s in range(len(shards.urls)) if keep[s]]
    return ShardSet([shards.urls[s] for s in idx], [len(keep[s]) for s in idx], shards.classes,
                    exact=True, keys=[frozenset(keep[s]) for s in idx])
