"""What each DataLoader worker streams: `ShardStream`, the dataset of `mpp.data.loader.ShardLoader`.

Per epoch e (identical computation on every rank and worker):
1. shards are shuffled with a seed of (seed, e) (train only) and packed into one bin per rank by
   largest-first greedy (`sources.assign`): the bin totals depend only on the shard counts, so they
   are the same every epoch; in training the rank bins are then permuted with the same seed. A
   rank's shards are split over its DataLoader workers greedily in the shuffled order. Fewer shards
   than ranks x workers: fewer workers per rank (logged); fewer training shards than ranks: an error;
2. each DataLoader worker reads its bin's shards (a train set that fits `data.cache_mb` per worker
   is kept raw in every worker's memory from the first epoch's end on, so small sets read many
   times skip the shard reading at every epoch start), drops samples outside a subset, shuffles raw
   (undecoded) samples in a buffer bounded in count and bytes (`shuffle`), decodes them a batch at
   a time (`decode.decode_batch`) and
   yields uint8 batches of `batch_size` (channels-last memory format, `transforms.stack`), in
   shared-memory slots it reuses (`slots.BatchSlots`; batches for CUDA are pinned by the consumer,
   `mpp.prefetch`), together with its cumulative skip counters;
the main process then makes of them, in training, exactly the same number of batches on every rank
(mpp.data.loader).
Resampled mode: each worker draws shards with replacement, forever. A worker whose draws stop
giving samples that decode (100 + 10 per shard + the shuffle buffer's size of them in a row)
raises a DataError rather than wait forever. Shuffling and augmentation use Python RNGs seeded
from (seed, epoch, rank, worker), so a worker's stream is the same whenever it is asked for.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import multiprocessing
import os
import random
import signal
import warnings
from typing import Iterator

import psutil
from torch.utils.data import IterableDataset, get_worker_info

from mpp.data.decode import DataError, decode_batch
from mpp.data.slots import BatchSlots
from mpp.data.sources import ShardSet, assign, read_shard
from mpp.data.transforms import stack

# set while a trainer's loop handles SIGTERM: every data worker of this process (the training
# loader's, an evaluator's) then leaves it to the trainer (`_worker_sigterm`)
_SHIELD = multiprocessing.RawValue("b", 0)

# the most items a worker of a following stream sends in an epoch while it pads (`ShardStream._ticks`):
# beyond it, the items of workers that still send batches (only where a worker holds more than this
# many batches an epoch) are no longer matched one to one, and a worker runs ahead by the difference
TICK_ITEMS = 10_000


def shield_workers(on: bool) -> None:
    """While on, this process's data workers ignore SIGTERM: the trainer's loop handles it."""
    _SHIELD.value = int(on)


def _worker_sigterm(shield, signum, frame) -> None:
    """A data worker's SIGTERM: left to the trainer while its loop handles it (`shield_workers`: a
    scheduler signals the whole process group, and a worker it ended would stop the trainer
    before its checkpoint, mpp.train); otherwise the worker ends of it as by default (torch stops a
    worker that does not finish with SIGTERM). A handler, not SIG_IGN, which would outlast the
    loop; so the commands a worker starts (pipe:, curl) have the default action: a group's
    SIGTERM ends them, and the shards they were reading count as cut short. A worker that ends
    ends them too (`_end_descendants`): torch ends a worker that a stalled read holds (data.timeout)
    with this signal, and its pipe: command, hung, outlived the run."""
    if not shield.value:
        try:
            _end_descendants()
        finally:  # the worker ends, whatever happened there: an error raised here would go on in its read
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _end_descendants() -> None:
    """SIGTERM to every process this one started, their own children included (a pipe: command runs
    in a shell, and a pipeline's commands are the shell's children)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            child.terminate()


def raw_bytes(sample: dict) -> int:
    """The bytes a raw sample holds (its members' contents)."""
    return sum(len(v) for v in sample.values() if isinstance(v, bytes))


def shuffle(samples: Iterator[dict], size: int, max_bytes: int, rng: random.Random) -> Iterator[dict]:
    """webdataset's sample shuffle (a buffer of `size` raw samples, filled before the first goes
    out, then one random pick per sample read: the same draws, so the same order) with the
    buffer's bytes bounded too: past `max_bytes` it stops growing and hands out samples until it is
    under the bound again, so that large images (a 4 MB photo, 256 MiB members) hold fewer samples
    instead of exhausting memory."""
    buf, held = [], 0

    def pick() -> dict:
        nonlocal held
        k = rng.randint(0, len(buf) - 1)
        buf[k], buf[-1] = buf[-1], buf[k]
        held -= raw_bytes(buf[-1])
        return buf.pop()

    for sample in samples:
        buf.append(sample)
        held += raw_bytes(sample)
        if len(buf) < size and held < max_bytes:  # grows by two a step until full, as webdataset's
            if (more := next(samples, None)) is not None:
                buf.append(more)
                held += raw_bytes(more)
        while buf and (len(buf) >= size or held >= max_bytes):  # one a step, more while over the bytes
            yield pick()
    while buf:
        yield pick()


class _EpochPlan:
    """Which shards each of this rank's workers reads in one epoch, and their sample count."""

    def __init__(self, shards: ShardSet, epoch: int, *, seed: int, train: bool, rank: int,
                 world_size: int, workers: int):
        order = list(range(len(shards.urls)))
        rng = random.Random(f"{seed}:{epoch}:shards")
        if train:
            rng.shuffle(order)
        ranks = assign(shards.counts, order, world_size)
        if train:
            rng.shuffle(ranks)  # permuting whole rank bins keeps their totals (and so K) intact
        position = {s: i for i, s in enumerate(order)}
        mine = sorted(ranks[rank], key=position.__getitem__)  # this epoch's shuffled order
        self.bins = assign(shards.counts, mine, workers, largest_first=False)
        self.num_samples = sum(shards.counts[i] for i in mine)


class ShardStream(IterableDataset):
    """One rank's worker side: per worker, its shards -> raw shuffle -> decode -> uint8 batches."""

    def __init__(self, shards: ShardSet, transform, *, batch_size: int, labeled: bool,
                 max_pixels: int, shuffle_buffer: int, shuffle_bytes: int, resampled: bool, seed: int,
                 train: bool, rank: int, world_size: int, workers: int, cache_bytes: int = 0):
        self.shards, self.transform = shards, transform
        self.batch_size, self.labeled, self.max_pixels = batch_size, labeled, max_pixels
        self.shuffle_buffer, self.shuffle_bytes = shuffle_buffer, shuffle_bytes
        self.resampled, self.seed, self.train = resampled, seed, train
        self.rank, self.world_size, self.workers = rank, world_size, workers
        # each epoch streams into the next (see __iter__); only where the counts are exact, as a worker
        # that makes more batches than they say would run ahead by the surplus every epoch (see _ticks)
        self.follow = train and not resampled and shards.exact
        # the epoch to start from: set by ShardLoader before it (re)starts its persistent workers
        self.epoch = multiprocessing.RawValue("q", 0)
        self.beats = multiprocessing.RawValue("Q", 0)  # moved by the workers at every shard and sample they read
        self.shield = _SHIELD  # shared with the workers, set by `shield_workers`
        self.slots: BatchSlots | None = None  # set by ShardLoader when its workers may use slots
        # raw samples by shard id, kept by each persistent worker across epochs (see _read_keep)
        self.cache: dict[int, list[dict]] | None = {} if cache_bytes > 0 else None
        self.cache_limit, self.cache_bytes = cache_bytes, 0
        self.broken: set[int] = set()  # shards that counted a skip in this worker: never cached
        # resampled mode draws forever: shard draws since a sample last decoded, and how many in a
        # row mean that none will (every shard corrupt, unreadable or without labels), an error then
        # instead of a run that waits forever for its first batch
        self.dry, self.dry_limit = 0, 100 + 10 * len(shards.urls) + shuffle_buffer

    def plan(self, epoch: int) -> _EpochPlan:
        return _EpochPlan(self.shards, epoch, seed=self.seed, train=self.train, rank=self.rank,
                          world_size=self.world_size, workers=self.workers)

    def _shard_ids(self, epoch: int, worker: int, rng: random.Random) -> Iterator[int]:
        if self.resampled:
            while True:
                yield rng.randrange(len(self.shards.urls))
        yield from self.plan(epoch).bins[worker]

    def _raw(self, epoch: int, worker: int, skips: dict) -> Iterator[dict]:
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}:order")
        for s in self._shard_ids(epoch, worker, rng):
            if self.resampled:
                self.dry += 1
                if self.dry > self.dry_limit:
                    raise DataError(f"{self.dry_limit} shard draws in a row gave no sample that decodes ({skips}); "
                                    "check the shards")
            if self.cache is not None and s in self.cache:
                yield from self.cache[s]
                continue
            yield from self._read_keep(s, skips)
        if self.cache is not None:  # the rank's other shards too, as the shuffle hands them to every
            for s in itertools.chain(*self.plan(epoch).bins):  # worker in turn (a broken one is not read again)
                if self.cache is not None and s not in self.cache and s not in self.broken:
                    for _ in self._read_keep(s, {}):
                        pass

    def _read(self, shard: int, broke: dict) -> Iterator[dict]:
        """The raw samples of a shard that belong to the subset (all without one). A shard that
        breaks (`read_shard` counts it in `broke`, a dict of this read's own) loses the samples after
        the break: counted there as `lost_samples` where the manifest's counts are exact."""
        keys = self.shards.keys[shard] if self.shards.keys is not None else None
        read = 0
        self.beats.value += 1  # alive, for the main process's watchdog (`ShardLoader._next_item`)
        for sample in read_shard(self.shards.urls[shard], broke):
            self.beats.value += 1
            if keys is None or sample["__key__"] in keys:
                read += 1
                yield sample
        if broke and self.shards.exact:
            held = len(keys) if keys is not None else self.shards.counts[shard]
            if held > read:
                broke["lost_samples"] = broke.get("lost_samples", 0) + held - read

    def _read_keep(self, shard: int, skips: dict) -> Iterator[dict]:
        """`_read`, caching a completely read shard's raw samples in this worker while the worker's
        total stays within data.cache_mb; a set that outgrows it is not cached at all (the cache is
        for small sets read many times, where each epoch would re-read the shards: a 10% label
        subset reads all of them), and what it held is freed at once, so that a worker holds no
        more than the cache's limit on top of its shuffle buffer. A shard that counted a skip is
        read again next time, so its counters repeat (the fill at an epoch's end skips it)."""
        kept, size, broke = [], 0, {}  # the shard's own counts, apart from the images decoded meanwhile
        for sample in self._read(shard, broke):
            if kept is not None and self.cache is not None:
                kept.append(sample)
                size += raw_bytes(sample)
                if self.cache_bytes + size > self.cache_limit:
                    kept = None  # not cached: free what was kept now
            yield sample
        for kind, n in broke.items():
            skips[kind] = skips.get(kind, 0) + n
        if broke:
            self.broken.add(shard)
        elif self.cache is not None:
            if kept is None:
                self.cache = None  # the set does not fit: free what was kept, stop caching
            else:
                self.cache[shard] = kept
                self.cache_bytes += size

    def __iter__(self):
        """This worker's items from the epoch set in `self.epoch` on: its batches, then an end item
        with the epoch's final skip counts; every item names its worker and epoch. A training
        stream that is not resampled goes on into the next epochs (`follow`), so the DataLoader's
        prefetch already holds the next epoch's first batches when the main process reaches them."""
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:  # a worker process: corrupt images are counted, not warned about by PIL
            warnings.filterwarnings("ignore", module="PIL")
            signal.signal(signal.SIGTERM, functools.partial(_worker_sigterm, self.shield))
        if self.slots is not None:  # what this worker sent in an abandoned epoch was dropped unread
            self.slots.reclaim(worker)
        epoch = self.epoch.value
        while (yield from self._epoch(epoch, worker)) and self.follow:
            epoch += 1

    def _epoch(self, epoch: int, worker: int) -> Iterator[dict]:
        """One epoch of this worker's items (see `__iter__`); returns False after an error item."""
        skips: dict[str, int] = {}
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}:augment")
        samples = self._raw(epoch, worker, skips)
        if self.shuffle_buffer > 0:
            samples = shuffle(samples, self.shuffle_buffer, self.shuffle_bytes,
                              random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}:buffer"))
        num_classes = len(self.shards.classes) if self.shards.classes else None
        # a following worker sends no more than its ticks (see _ticks): where a manifest undercounts
        # its shards, the surplus is dropped and counted, not held by the main process ever longer
        most = self._ticks(epoch) if self.follow else math.inf
        images, labels, sent = [], [], 0
        try:  # decode only as many samples as the batch still needs: batches stay in stream order
            while chunk := list(itertools.islice(samples, self.batch_size - len(images))):
                if sent == most:
                    skips["dropped"] = skips.get("dropped", 0) + len(chunk) + sum(1 for _ in samples)
                    break
                got = decode_batch(chunk, self.transform, rng, labeled=self.labeled, num_classes=num_classes,
                                   max_pixels=self.max_pixels, skips=skips)
                images += got[0]
                labels += got[1]
                self.dry = 0 if got[0] else self.dry
                if len(images) == self.batch_size:
                    yield self._batch(images, labels, worker, epoch, skips)
                    images, labels, sent = [], [], sent + 1
        except DataError as e:  # sent as an item so the main process raises it with a clean message
            yield {"worker": worker, "epoch": epoch, "skips": dict(skips), "error": str(e)}
            return False
        if images:
            yield self._batch(images, labels, worker, epoch, skips)
            sent += 1
        while self.follow and sent < most:  # one tick an item up to TICK_ITEMS items, then one for the rest
            n = 1 if sent < min(most, TICK_ITEMS) - 1 else most - sent
            yield {"worker": worker, "epoch": epoch, "ticks": n}
            sent += n
        yield {"worker": worker, "epoch": epoch, "skips": dict(skips), "end": True}  # the final counts
        return True

    def _ticks(self, epoch: int) -> int:
        """How many items every worker of a following stream sends in `epoch` before its end item:
        the most batches any of this rank's workers can make, a worker with fewer filling up with
        empty ticks. The DataLoader takes items from its workers strictly in turn, so a worker with
        fewer batches would otherwise run ahead into later epochs by that many items every epoch,
        and the main process would hold ever more of its batches (memory, shared-memory files).
        Past TICK_ITEMS items a worker's remaining ticks go as one item carrying their count: a
        manifest that overcounts a shard a millionfold (a remote one, whose size is not checked)
        pads the epoch at once instead of keeping the loader busy with ticks for hours."""
        counts = self.shards.counts
        return max(math.ceil(sum(counts[s] for s in b) / self.batch_size) for b in self.plan(epoch).bins)

    def _batch(self, images, labels, worker, epoch, skips) -> dict:
        out = {"worker": worker, "epoch": epoch, "skips": dict(skips)}
        slot = self.slots.acquire(worker) if self.slots is not None else None
        if slot is None:
            out["image"] = stack(images)
        else:  # stacked into a reused shared-memory slot: only its number travels
            stack(images, slot[1])
            out["slot"], out["size"] = slot[0], len(images)
        if self.labeled:  # a list: pickled inline, while each tensor costs the main process a
            out["label"] = labels  # shared-memory file to receive
        return out
