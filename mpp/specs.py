"""A data spec read as text, before any shard is opened (the comparison plans with it before it
shards the data, and without importing torch): which names are local paths, and one spelling per
set of shards."""
from __future__ import annotations

import json
import os
import re


DATA_KEYS = ("data.train", "data.val", "fewshot.train", "fewshot.test")  # config keys that name shards


def is_url(s: str) -> bool:
    return "://" in s or s.startswith(("pipe:", "file:"))


def local_path(url: str) -> str | None:
    """The file a name means (a `file:` URL's too); None for any other URL."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("file:"):
        return url[len("file:"):]
    return None if is_url(url) else url


def name_key(s):
    """One spelling of one name of a data spec (a shard, a manifest, a pattern): a local path
    absolute, normalised and through its symbolic links, a shard directory and its manifest.json
    alike; a URL as written."""
    local = local_path(s) if isinstance(s, str) and s else None
    if local is None:
        return s
    folder, name = os.path.split(os.path.abspath(local))
    return os.path.realpath(folder if name == "manifest.json" else os.path.join(folder, name))


def data_key(spec) -> str:
    """One spelling of a data spec (`name_key` of each name), so that two configs naming the same
    shards in other words compare equal (a comparison withholds its development splits by it)."""
    spec = spec[0] if isinstance(spec, (list, tuple)) and len(spec) == 1 else spec
    return json.dumps([name_key(s) for s in spec] if isinstance(spec, (list, tuple)) else name_key(spec))


def names_manifest(spec) -> bool:
    """Whether a data spec names a manifest (its file or folder), as `mpp.data.sources.resolve`
    reads it, not a shard list or pattern (said from the spelling: the data may not be made yet)."""
    if isinstance(spec, (list, tuple)):
        spec = spec[0] if len(spec) == 1 else ""
    return bool(spec) and isinstance(spec, str) and "{" not in spec and not re.search(
        r"\.(tar(\.\w+)?|tgz)$", spec)


def val_key(val, val_num_samples) -> tuple:
    """One spelling of the test images a run is scored on: `data_key` of its data.val and its
    data.val_num_samples (another count of a shard pattern is another set; a manifest counts its
    own). Two runs whose gaps the report gives must have the same; a comparison checks its stages'
    before the first starts."""
    return data_key(val), None if names_manifest(val) else val_num_samples


def two_test_sets(scored) -> tuple | None:
    """Of `scored` ((data.val, data.val_num_samples, name) of each probe and final fine-tune), the
    first two on different test sets (`val_key`), as ((spelling, name), (spelling, name)); None
    when all share one."""
    first: dict = {}
    for val, num, name in scored:
        first.setdefault(val_key(val, num), name)
    if len(first) < 2:
        return None
    (a, where_a), (b, where_b) = list(first.items())[:2]
    return (a[0], where_a), (b[0], where_b)


def dev_split(fraction, seed, dev_fraction) -> tuple:
    """A development split as (label_fraction, split_seed, dev_fraction), in one spelling (a YAML
    1 and 1.0 alike), as data.withhold lists them."""
    return float(fraction), int(seed), float(dev_fraction)
