"""Where samples come from: a data spec resolved to shards with sample counts, the balanced
assignment of shards to rank x worker slots, and raw (undecoded) samples read from one shard.

Specs: a `manifest.json` (or a directory holding one; exact per-shard counts), a list of shard
paths/URLs, or a brace pattern such as `/data/train/{000000..000099}.tar`. Without a manifest the
total `num_samples` must be given and is assumed spread evenly over the shards (the documented
fallback; a rank's surplus is then dropped or its shortfall padded, both counted). URLs are opened
with webdataset's gopen: local paths, `file:`, `http(s)://`, and `pipe:` where the user wrote it.
A manifest is data from elsewhere: the names it lists may only be paths or http(s)/file URLs
(`MANIFEST_SCHEMES`), never a command or another opener; read through a pipe: command, its relative
names (appended to that command) may hold no shell syntax. Before any work a manifest is checked
against itself and its local shards: its total count against the shards', its classes for
duplicates, and each shard's size against the one recorded when it was written (`_check_sizes`);
the label index is checked where it is read (`subset.read_label_index`).
"""
from __future__ import annotations

import gzip
import heapq
import json
import logging
import lzma
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import braceexpand
from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext, url_opener

from mpp.data.decode import IMAGE_EXTS, DataError
from mpp.data.tarstream import BLOCK, CorruptTar, TruncatedTar, compression, tar_files
from mpp.specs import is_url, local_path, name_key

META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, not samples
USED = frozenset((*IMAGE_EXTS, "cls"))  # the members decoding reads; others are kept empty
MANIFEST_SCHEMES = ("http", "https", "file")  # what a manifest may name besides plain paths
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# a relative name that a manifest read through pipe: may give: it is appended to that command
SHELL_PLAIN = re.compile(r"[A-Za-z0-9._+%/-]+")
log = logging.getLogger(__name__)
_unchecked: set[str] = set()  # manifests without shard sizes, warned about once per process


@dataclass
class ShardSet:
    """Shards with their sample counts; `keys` (per shard) restricts them to a subset; `labels`:
    the URL of the manifest's label index (`writer.LABELS`), if it has one, and `labels_sha256`
    its digest as the manifest recorded it."""
    urls: list[str]
    counts: list[int]
    classes: list[str] | None = None
    exact: bool = True
    keys: list[frozenset] | None = field(default=None, repr=False)
    labels: str | None = None
    labels_sha256: str | None = None

    @property
    def num_samples(self) -> int:
        return sum(self.counts)


def _read_manifest(path: str) -> tuple[ShardSet, list[int | None]]:
    """The manifest's shard set and the size in bytes it recorded per shard (None: not recorded)."""
    try:
        with gopen(path, "rb") as f:
            m = json.load(f)
        shards = m["shards"]
        names = [s["name"] for s in shards]
        counts = [s["num_samples"] for s in shards]
        if (bad := next((c for c in counts if not _whole(c)), None)) is not None:
            raise ValueError(f"a shard's num_samples is {bad!r}, not a whole number")
        sizes = [None if s.get("bytes") is None else int(s["bytes"]) for s in shards]
        if min(counts, default=0) < 0 or min((b for b in sizes if b is not None), default=0) < 0:
            raise ValueError("a shard's num_samples or bytes is negative")
        classes = m.get("classes") or None
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise TypeError("'classes' is not a list of names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError, RecursionError) as e:
        raise DataError(f"manifest '{path}' is unreadable or lacks 'shards' [{{name, num_samples}}] "
                        f"({type(e).__name__}: {e}); rewrite it with tools/make_shards.py") from e
    base = path.rsplit("/", 1)[0] if "/" in path else "."
    labels = m.get("labels") if isinstance(m.get("labels"), str) else None
    for name in names + ([labels] if labels else []):
        _check_manifest_name(path, name)
    fix = "the manifest does not describe its shards; re-run tools/make_shards.py"
    if "num_samples" in m and not _whole(m["num_samples"]):
        raise DataError(f"{path}: num_samples must be a whole number, got {m['num_samples']!r}; {fix}")
    if "num_samples" in m and m["num_samples"] != sum(counts):
        raise DataError(f"{path}: num_samples is {m['num_samples']!r} but its shards hold {sum(counts)}; {fix}")
    if classes is not None and len(set(classes)) < len(classes):
        twice = next(c for c in classes if classes.count(c) > 1)
        raise DataError(f"{path}: class {twice!r} is listed twice in 'classes'; {fix}")
    urls = [_beside(base, n) for n in names]
    seen: set = set()
    for name, url in zip(names, urls):  # ranks and workers would read its samples twice
        if url in seen:
            raise DataError(f"{path}: shard {name!r} is listed twice in 'shards'; {fix}")
        seen.add(url)
    digest = m.get("labels_sha256") if labels else None
    return ShardSet(urls, counts, classes, exact=True, labels=_beside(base, labels) if labels else None,
                    labels_sha256=digest), sizes


def _whole(n) -> bool:
    """Whether a manifest's count is a JSON whole number (not a string, a fraction, NaN or a bool)."""
    return isinstance(n, int) and not isinstance(n, bool)


def _check_sizes(manifest: str, shards: ShardSet, sizes: list[int | None]) -> None:
    """A local shard whose size differs from the one its manifest recorded was changed (rewritten,
    truncated, replaced) after the manifest: its counts and label index no longer describe it.
    One whose count is more than its size can hold (a plain tar member takes a 512-byte header and
    a 512-byte block at the least) would pad every training epoch with that many missing samples.
    One stat per shard; manifests written before sizes were recorded are trusted, with a warning."""
    if all(size is None for size in sizes) and manifest not in _unchecked:
        _unchecked.add(manifest)
        log.warning("warning: %s records no shard sizes (written by an older mpp): shards changed since it was "
                    "written go unnoticed; re-run tools/make_shards.py to record them", manifest)
    for url, size, count in zip(shards.urls, sizes, shards.counts):
        if (path := local_path(url)) is None:
            continue
        actual = os.path.getsize(path)
        if size is not None and actual != size:
            raise DataError(f"{manifest}: shard {url.rsplit('/', 1)[-1]} is {actual} bytes but the manifest "
                            f"recorded {size}; the shards changed since the manifest was written; re-run "
                            "tools/make_shards.py (or restore the shards)")
        if count > actual // (2 * BLOCK) and not _compressed(path):
            raise DataError(f"{manifest}: shard {url.rsplit('/', 1)[-1]} is said to hold {count} samples, more than "
                            f"its {actual} bytes can (1024 a sample at the least): it was cut short, or the manifest "
                            "does not describe it; re-run tools/make_shards.py (or restore the shard)")


def _compressed(path: str) -> bool:
    """Whether a local shard is a compressed tar (whose size bounds no count)."""
    with open(path, "rb") as f:
        return compression(f.read(10)) is not None


def _check_manifest_name(manifest: str, name) -> None:
    """A manifest names files, never commands: a plain path or an http(s)/file URL, without the
    surrounding spaces or control characters that URL parsers strip before reading the scheme. A
    manifest the user reads through a pipe: command (or another opener) has its relative names
    appended to that command (`_beside`), so they may hold no shell syntax either."""
    scheme = SCHEME.match(name) if isinstance(name, str) else None
    if not isinstance(name, str) or not name or name != name.strip() or any(c < " " or c == "\x7f" for c in name) \
            or (scheme and scheme.group(1).lower() not in MANIFEST_SCHEMES):
        raise DataError(f"manifest '{manifest}' names {name!r}: a manifest may name only paths and "
                        f"{'/'.join(MANIFEST_SCHEMES)} URLs, never a command; if you trust a pipe: "
                        "source, write it in data.train yourself")
    opener = SCHEME.match(manifest.strip())
    if opener and opener.group(1).lower() not in MANIFEST_SCHEMES and not (scheme or os.path.isabs(name)) \
            and not SHELL_PLAIN.fullmatch(name):
        raise DataError(f"manifest '{manifest}' names {name!r}, which would become part of its pipe: command: "
                        "a manifest read through pipe: may name relative files with letters, digits and . _ + % - / "
                        "only; rename the shards (tools/make_shards.py) or list them in data.train yourself")


def _beside(base: str, name: str) -> str:
    """A file named in a manifest: URLs and absolute paths as they are, others next to it."""
    return name if (is_url(name) or os.path.isabs(name)) else f"{base}/{name}"


class CountNeeded(DataError):
    """Shards named without a manifest.json and without their sample count (a tool with its own
    count option names that option instead of the config keys)."""


def resolve(spec, num_samples: int = 0, count_key: str = "data.num_samples / data.val_num_samples") -> ShardSet:
    """A ShardSet for a manifest path, a shard list, or a brace pattern (+ num_samples, which
    `count_key` names where it is missing)."""
    if isinstance(spec, (list, tuple)) and len(spec) == 1:
        spec = spec[0]
    if not spec:
        raise DataError("no data given: set a manifest.json, a shard list or a brace pattern (e.g. data.train)")
    if isinstance(spec, str):
        local = local_path(spec)
        if local is not None and os.path.isdir(local):
            spec, local = f"{spec.rstrip('/')}/manifest.json", os.path.join(local, "manifest.json")
        elif local is not None and "{" not in spec and not os.path.exists(local):
            raise DataError(f"data '{spec}' does not exist; check the path (a shard directory, its manifest.json, "
                            "a shard list or a brace pattern)")
        if spec.endswith(".json"):
            if local is not None and not os.path.isfile(local):
                raise DataError(f"manifest '{spec}' does not exist; write shards with tools/make_shards.py")
            shards, sizes = _read_manifest(spec)
            _check_local(shards.urls)
            _check_sizes(spec, shards, sizes)
            return shards
        urls = list(braceexpand.braceexpand(spec))
    else:
        if manifests := [s for s in spec if str(s).endswith(".json")]:
            raise DataError(f"data spec {list(spec)!r} lists {manifests[0]!r}, a manifest: a list names shards; "
                            "give one manifest.json (or its folder), or list the shards' tar files")
        urls = [u for s in spec for u in braceexpand.braceexpand(s)]
    if num_samples <= 0:
        raise CountNeeded(f"data spec {spec!r} is not a manifest.json: give its total sample count ({count_key})")
    _check_local(urls)
    n = len(urls)
    counts = [num_samples // n + (i < num_samples % n) for i in range(n)]
    return ShardSet(urls, counts, None, exact=False)


def check_distinct(spec, shards: ShardSet) -> None:
    """Refuse a shard list or pattern that names a shard twice (overlapping brace ranges, one file
    by two paths): ranks and workers would read its samples twice in an epoch, as a manifest's own
    check says. Not for a resampled stream, which draws shards at random and where repeating one
    weights it."""
    seen: dict[str, str] = {}
    for url in shards.urls:
        same = name_key(url)
        if same in seen:
            also = f" (as {seen[same]!r} before)" if seen[same] != url else ""
            raise DataError(f"data spec {spec!r} names shard {url!r} twice{also}: no sample may be read twice in an "
                            "epoch; give each shard once (check overlapping brace ranges), or data.resampled=true "
                            "to weight it")
        seen[same] = url


def class_count(spec, num_samples: int, labels) -> int:
    """The number of classes of the labeled data `spec`: its manifest's list where it has one (a
    class its images lack still counts; test labels never decide it), else one past the largest
    of its `labels` (more classes than labels is refused: a stray label, not a class list)."""
    classes = resolve(spec, num_samples or 1).classes
    if classes:
        return len(classes)
    count = int(labels.max()) + 1
    if count > len(labels):  # a stray large label: a head (and one-hot targets) of that many classes
        raise DataError(f"{spec!r} has no manifest listing its classes, and its largest label, {count - 1}, would make "
                        f"{count} classes for {len(labels)} labeled images; give labels 0..C-1, or shards written by "
                        "tools/make_shards.py (their manifest.json lists the classes)")
    return count


def check_same_classes(train_spec, val_spec, val_num_samples: int = 0,
                       names: tuple[str, str] = ("data.train", "data.val")) -> None:
    """Labels index `classes`, so evaluating on `val_spec` means something only when its manifest
    lists the same classes in the same order as `train_spec`'s (specs without a manifest have no
    list to compare). A manifest without `classes` on either side holds unlabeled shards: refused
    here, before any training, not when the evaluation first reads them. `names`: the config keys
    of the two specs, for the message. Raises DataError naming the first difference; warns where
    the two share a shard."""
    train_set, val_set = resolve(train_spec, 1), resolve(val_spec, val_num_samples or 1)
    held_out = f"held-out labeled shards of {names[0]}'s label set"
    for shards, spec, name, fix in ((train_set, train_spec, names[0], "labeled shards"),
                                    (val_set, val_spec, names[1], held_out)):
        if shards.exact and not shards.classes:
            raise DataError(f"{name} {spec!r} has no 'classes' in its manifest: these shards look unlabeled, "
                            f"but the evaluation needs labels; give {fix}")
    warn_shared(train_set, val_set, names)  # a lone tool's; a comparison refuses it
    train, val = train_set.classes, val_set.classes
    if train is None or val is None or list(train) == list(val):
        return
    diff = next((i for i, (a, b) in enumerate(zip(train, val)) if a != b), min(len(train), len(val)))
    at = lambda c: repr(c[diff]) if diff < len(c) else "nothing"  # noqa: E731
    raise DataError(f"{names[1]} {val_spec!r} has other classes than {names[0]} {train_spec!r} ({len(val)} vs "
                    f"{len(train)}; class {diff} is {at(val)} vs {at(train)}): labels would not match; "
                    "evaluate on held-out shards of the same label set")


def warn_shared(train_set: ShardSet, test_set: ShardSet, names: tuple[str, str]) -> None:
    """Warn where a set figures are taken on (`names[1]`) shares a shard with one a run learns from."""
    if shared := shard_names(train_set) & shard_names(test_set):
        log.warning("warning: %s shares %d shard(s) with %s (%s): its figures are of images the run trains on, not "
                    "held-out ones", names[1], len(shared), names[0], sorted(shared)[0])


def shard_names(shards: ShardSet) -> set[str]:
    """One spelling of each shard of a set (`mpp.specs.name_key`), to find two sets that share one."""
    return {name_key(u) for u in shards.urls}


def _check_local(urls: list[str]) -> None:
    for url in urls:
        path = local_path(url)
        if path is not None and not os.path.isfile(path):
            if os.path.exists(path):  # a FIFO would block its reader; a directory is no tar
                raise DataError(f"shard '{url}' is not a regular file (a directory, FIFO or device); name the "
                                "shards' tar files, or a pipe: command to stream one")
            raise DataError(f"shard '{url}' does not exist; check the data path or rewrite the shards")


def assign(counts: list[int], order: list[int], bins: int, largest_first: bool = True) -> list[list[int]]:
    """Shards (taken in `order`) each go to the bin with the fewest samples so far. With
    `largest_first` (stable sort by count: LPT) the bin totals depend only on the counts, not on
    `order`, so every epoch's shuffle gives the same totals and hence the same batch count."""
    out: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0, b) for b in range(bins)]
    for i in (sorted(order, key=lambda i: -counts[i]) if largest_first else order):
        total, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (total + counts[i], b))
    return out


def tar_members(url: str, errors: list[Exception], select=None,
                unread: bool = False) -> Iterator[tuple[str, bytes | None]]:
    """(name, bytes) of the regular-file members of one tar except webdataset's metadata, opened
    with webdataset's gopen but read with `tarstream.tar_files` (several times faster than
    tarfile, and it detects truncation); with `select` and `unread`, (name, None) for those it
    skips. Read errors are appended to `errors` (the shard then just ends)."""
    for source in url_opener([{"url": url}], handler=lambda e: errors.append(e) or False):
        stream = source["stream"]
        try:
            for name, data in tar_files(stream, select, unread=unread):
                if not META.match(name):
                    yield name, data
        except Exception as e:  # noqa: BLE001 - any read error ends this shard, counted by the caller
            errors.append(e)
        finally:
            try:
                stream.close()
            except Exception as e:  # noqa: BLE001 - e.g. a pipe: command that exited non-zero
                errors.append(e)


def _error_kind(errors: list[Exception]) -> str:
    """The skip counter for a shard that ended with these errors."""
    if all(isinstance(e, (TruncatedTar, EOFError)) for e in errors):
        return "truncated_tar"
    if all(isinstance(e, (TruncatedTar, EOFError, CorruptTar, gzip.BadGzipFile, zlib.error, lzma.LZMAError))
           for e in errors):
        return "corrupt_tar"
    return "unreadable_shard"


def member_ext(name: str) -> str:
    """A member's field as a sample holds it: its extension after the base name's first dot, as
    `base_plus_ext` splits it (without its regular expression: this runs for every member), lower-cased."""
    return name.rpartition("/")[2].partition(".")[2].lower()


def _used(name: str) -> bool:
    """Whether decoding reads the member `name`: its field (`member_ext`) in USED."""
    return member_ext(name) in USED


def read_shard(url: str, skips: dict[str, int]) -> Iterator[dict]:
    """Raw samples ({'__key__', '__url__', ext: bytes}) of one shard: consecutive members with the
    same key (the name up to the first dot of its base name; names without one are ignored) form
    one sample, their lower-cased extensions its fields, as webdataset's group_by_keys does (here
    without its per-member dicts and handler calls). A truncated, unreadable or
    malformed (e.g. a member twice in a sample) shard ends there, is counted in `skips` and its
    last (possibly incomplete) sample dropped; no retry, no sleep. Members decoding never reads
    (not an image, not 'cls') keep their name but no bytes, and are skipped unread: up to a shuffle
    buffer of samples waits in memory, and those would hold any size for nothing (a video beside
    an image may exceed what a member read may hold)."""
    errors: list[Exception] = []
    members = tar_members(url, errors, select=_used, unread=True)
    sample: dict | None = None
    for name, data in members:
        key, ext = base_plus_ext(name)
        if key is None:
            continue
        ext = ext.lower()
        if sample is None or key != sample["__key__"]:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        elif ext in sample:
            errors.append(ValueError(f"{name}: member twice in sample '{key}' of {url}"))
            members.close()
            break
        sample[ext] = data if ext in USED else b""
    if errors:
        kind = _error_kind(errors)
        skips[kind] = skips.get(kind, 0) + 1
    elif sample is not None:
        yield sample
