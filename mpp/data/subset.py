"""Class-balanced, seeded subsets of a labeled shard set (fine-tuning on 1%, 10%, ... of labels).

The (key, label) pairs come from the manifest's label index (`labels.json`, written by
`writer.write_samples`: one small file instead of every shard, which at scale every rank would
read) or else from one pass over the shards that reads only their `cls` members (images are
skipped inside the tar). Exactly max(1, round(fraction * n_c)) keys of every class c are picked
with a seeded RNG, and the shard set is restricted to those keys with recomputed per-shard
counts, so batch counts stay exact. A development split (fine-tuning recipes are chosen on it,
never on test images) is drawn from that subset the same way: max(1, round(dev_fraction * m_c))
of every class's m_c subset keys, with its own seeded RNG, so the subset is the same with or
without it; `dev` picks the development split, otherwise the rest.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections import Counter, defaultdict

from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext

from mpp.data.decode import DataError, read_label
from mpp.data.sources import ShardSet, member_ext, tar_members
from mpp.specs import local_path

log = logging.getLogger(__name__)
_warned: set[tuple] = set()  # fractions that rounded to no sample of a class, warned about once per process

LABEL_BYTES_PER_SAMPLE = 4096  # a [key, label] pair of the label index: a long key path at most
_TWICE = "which a label subset cannot tell apart (both would go to the development split and the training part)"


def read_labels(url: str, num_classes: int | None) -> list[tuple[str, int]]:
    """(key, label) of every sample of a shard with a valid `cls` member. A shard that cannot be
    read to its end is a DataError: every rank draws the subset from its own pass, and ranks that
    read a shard differently (a transient failure) would get other subsets and batch counts. So is
    a key that comes twice (make_shards never writes one): a subset keeps samples by key, so both
    would go where either was drawn, into the development split and the training part alike."""
    out, errors, seen = [], [], set()
    for name, data in tar_members(url, errors, select=lambda name: member_ext(name) == "cls"):  # as the stream reads
        key, _ = base_plus_ext(name)
        if key is None:  # a name the stream ignores ('.cls' at the top)
            continue
        if key in seen:
            raise DataError(f"shard '{url}' holds two samples of key {key!r}, {_TWICE}; rewrite the shards "
                            "with unique keys (tools/make_shards.py)")
        seen.add(key)
        try:
            out.append((key, read_label(data, num_classes)))
        except (ValueError, UnicodeDecodeError):
            continue  # a bad label is skipped (and counted) by the stream as well
    if errors:
        raise DataError(f"the labels of shard '{url}' could not be read ({type(errors[0]).__name__}: {errors[0]}), "
                        "and a label subset needs every shard read alike on every rank: repair or leave out the "
                        "shard, or rewrite the data with tools/make_shards.py (its labels.json spares this pass)")
    return out


def read_label_index(shards: ShardSet) -> list[list[tuple[str, int]]]:
    """Per shard, the (key, label) pairs of the manifest's label index. DataError when it is
    unreadable, is not the index the manifest recorded (its SHA-256), or disagrees with the
    manifest: another number of shards or of samples in a shard, a label outside its classes; or
    lists a key twice in a shard (as `read_labels` refuses)."""
    fix = "rewrite the shards with tools/make_shards.py"
    path = local_path(shards.labels)
    if path is not None and not os.path.isfile(path):
        raise DataError(f"label index '{shards.labels}' is not a file; {fix}")
    most = LABEL_BYTES_PER_SAMPLE * shards.num_samples + 2**20  # untrusted: a bounded read
    try:
        with gopen(shards.labels, "rb") as f:
            raw = f.read(most + 1)
        if len(raw) > most:
            raise ValueError(f"more than {most} bytes for {shards.num_samples} samples")
        index = json.loads(raw)
        if not isinstance(index, list) or len(index) != len(shards.urls):
            raise ValueError(f"{len(index) if isinstance(index, list) else 'no'} shard entries for "
                             f"{len(shards.urls)} shards")
        index = [[(str(key), int(label)) for key, label in entry] for entry in index]
    except (OSError, ValueError, TypeError, ArithmeticError, RecursionError) as e:
        raise DataError(f"label index '{shards.labels}' is unreadable or does not match its manifest "
                        f"({type(e).__name__}: {e}); {fix}") from e
    if shards.labels_sha256 and hashlib.sha256(raw).hexdigest() != shards.labels_sha256:
        raise DataError(f"label index '{shards.labels}' is not the one its manifest recorded (another SHA-256): "
                        f"it changed since the shards were written; {fix}")
    n = len(shards.classes)
    for url, entry, count in zip(shards.urls, index, shards.counts):
        shard = url.rsplit("/", 1)[-1]
        if len(entry) != count:
            raise DataError(f"label index '{shards.labels}' lists {len(entry)} samples for shard {shard} but "
                            f"the manifest records {count}; {fix}")
        if (bad := next((label for _, label in entry if not 0 <= label < n), None)) is not None:
            raise DataError(f"label index '{shards.labels}' gives label {bad} in shard {shard} but the manifest "
                            f"lists {n} classes; {fix}")
        if twice := [key for key, count in Counter(key for key, _ in entry).items() if count > 1]:
            raise DataError(f"label index '{shards.labels}' lists key {twice[0]!r} twice in shard {shard}, {_TWICE}; "
                            f"{fix}")
    return index


def _labelled_keys(shards: ShardSet, unlabeled: str = "a class-balanced subset needs labeled shards with "
                   "'classes' in manifest.json") -> list[list[tuple[str, int]]]:
    """Per shard, its (key, label) pairs: from the manifest's label index, else one label pass;
    shards without classes are the DataError `unlabeled`."""
    if not shards.classes:
        raise DataError(unlabeled)
    if shards.labels:
        return read_label_index(shards)
    return [read_labels(url, len(shards.classes)) for url in shards.urls]


def _select(pairs: list[list[tuple[str, int]]], fraction: float, seed: int, dev_fraction: float,
            dev: bool) -> list[set]:
    """Per shard, the keys `select_subset` keeps."""
    if not 0 < fraction <= 1:
        raise DataError(f"subset fraction must be in (0, 1], got {fraction}")
    if not 0 <= dev_fraction < 1:
        raise DataError(f"development fraction must be in [0, 1), got {dev_fraction}")
    by_class: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for s, entry in enumerate(pairs):
        for key, label in entry:
            by_class[label].append((s, key))
    if (short := [label for label in sorted(by_class) if round(fraction * len(by_class[label])) < 1]) and \
            (fraction, tuple(short)) not in _warned:
        _warned.add((fraction, tuple(short)))
        log.warning("warning: a label fraction of %g rounds to no sample of %d of the %d classes (e.g. class %d, "
                    "%d samples); each keeps 1, so the subset is not %g of the data", fraction, len(short),
                    len(by_class), short[0], len(by_class[short[0]]), fraction)
    rng, dev_rng = random.Random(seed), random.Random(f"dev-{seed}")
    picked = {label: rng.sample(sorted(by_class[label]), max(1, round(fraction * len(by_class[label]))))
              for label in sorted(by_class)}
    keep: list[set] = [set() for _ in pairs]
    for label, members in picked.items():
        if dev_fraction:
            held = set(dev_rng.sample(sorted(members), max(1, round(dev_fraction * len(members)))))
            if len(held) == len(members):
                raise DataError(f"class {label} has {len(members)} sample(s) in the {fraction:g} label subset, and "
                                f"the development split (dev_fraction={dev_fraction:g}) would take them all, leaving "
                                "none to train on; use a larger label fraction or a smaller dev_fraction")
            members = [m for m in members if (m in held) == dev]
        for s, key in members:
            keep[s].add(key)
    return keep


def _restrict(shards: ShardSet, keep: list[set], what: str) -> ShardSet:
    if not any(keep):
        raise DataError(f"the {what} is empty; use more data or a smaller dev_fraction")
    idx = [s for s in range(len(shards.urls)) if keep[s]]
    return ShardSet([shards.urls[s] for s in idx], [len(keep[s]) for s in idx], shards.classes,
                    exact=True, keys=[frozenset(keep[s]) for s in idx])


def select_subset(shards: ShardSet, fraction: float, seed: int, dev_fraction: float = 0.0,
                  dev: bool = False) -> ShardSet:
    """`shards` restricted to a class-balanced seeded `fraction` of its samples; with
    `dev_fraction` > 0, to the development split of that subset (`dev`) or to the rest."""
    keep = _select(_labelled_keys(shards), fraction, seed, dev_fraction, dev)
    return _restrict(shards, keep, f"{'development split' if dev else 'training part'} of a {fraction:g} subset "
                                   f"with dev_fraction={dev_fraction:g}")


def withhold_splits(shards: ShardSet, splits) -> ShardSet:
    """`shards` without the development splits that fine-tunes draw from them with `select_subset`,
    one per (label_fraction, split_seed, dev_fraction) of `splits`: a pre-training on the fine-tunes'
    training set that withholds them never trains on the images their recipes are chosen on."""
    pairs = _labelled_keys(shards, "data.withhold leaves out development splits that are drawn class by class, "
                           "and these shards have no 'classes' in their manifest; withhold nothing "
                           "(data.withhold=[]) or train on the fine-tunes' labeled shards")
    held: list[set] = [set() for _ in pairs]
    for fraction, seed, dev_fraction in splits:
        if not 0 < dev_fraction < 1:
            raise DataError(f"a withheld development split needs dev_fraction in (0, 1), got {dev_fraction}")
        for s, keys in enumerate(_select(pairs, fraction, seed, dev_fraction, dev=True)):
            held[s] |= keys
    return _restrict(shards, [{key for key, _ in entry} - h for entry, h in zip(pairs, held)],
                     "training set left after withholding the development splits")
