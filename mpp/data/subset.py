"""Class-balanced, seeded subsets of a labeled shard set (fine-tuning on 1%, 10%, ... of labels).

The (key, label) pairs come from the manifest's label index (`labels.json`, written by
`writer.write_samples`: one small file instead of every shard, which at scale every rank would
read) or else from one pass over the shards that reads only their `cls` members (images are
skipped inside the tar). Exactly max(1, round(fraction * n_c)) keys of every class c are picked
with a seeded RNG, and the shard set is restricted to those keys with recomputed per-shard
counts, so batch counts stay exact.
"""
from __future__ import annotations

import json
import random
from collections import defaultdict

from webdataset.gopen import gopen
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


def read_label_index(shards: ShardSet) -> list[list[tuple[str, int]]]:
    """Per shard, the (key, label) pairs of the manifest's label index with a label in range (as
    `read_labels` gives them); DataError when it is unreadable or does not match the manifest's
    shards."""
    try:
        with gopen(shards.labels, "rb") as f:
            index = json.load(f)
        if not isinstance(index, list) or len(index) != len(shards.urls):
            raise ValueError(f"{len(index) if isinstance(index, list) else 'no'} shard entries for "
                             f"{len(shards.urls)} shards")
        n = len(shards.classes)
        return [[(str(key), int(label)) for key, label in entry if 0 <= int(label) < n] for entry in index]
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"label index '{shards.labels}' is unreadable or does not match its manifest "
                        f"({type(e).__name__}: {e}); rewrite the shards with tools/make_shards.py") from e


def select_subset(shards: ShardSet, fraction: float, seed: int) -> ShardSet:
    """`shards` restricted to a class-balanced seeded `fraction` of its samples."""
    if not 0 < fraction <= 1:
        raise DataError(f"subset fraction must be in (0, 1], got {fraction}")
    if not shards.classes:
        raise DataError("a class-balanced subset needs labeled shards with 'classes' in manifest.json")
    index = read_label_index(shards) if shards.labels else None
    by_class: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for s, url in enumerate(shards.urls):
        for key, label in index[s] if index is not None else read_labels(url, len(shards.classes)):
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
