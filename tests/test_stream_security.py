"""mpp.data never decodes anything but images and labels, and skips bad data by kind without
crashing: pickle payloads, corrupt/truncated/oversized images, missing images, bad labels,
truncated tars."""
from __future__ import annotations

import builtins
import logging
import os
import pickle

import numpy as np
import pytest
import torch

from mpp.config import DataConfig
from mpp.data import make_loader
from shardutil import encode, write_shards


class Payload:
    """Unpickling this creates the file `path` (what a malicious .pyd member could do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def test_pickle_members_are_never_unpickled(tmp_path):
    canary = tmp_path / "proof.txt"
    pickle.loads(pickle.dumps(Payload(canary)))  # the payload is live: unpickling writes a file
    assert canary.exists()
    target = tmp_path / "pwned.txt"
    bomb = pickle.dumps(Payload(target))

    def extra(shard, j):
        if j == 0:  # a sample holding only pickles
            return {"png": None, "cls": None, "pyd": bomb, "pickle": bomb, "pth": bomb}
        return {"pyd": bomb, "pickle": bomb, "pth": bomb}  # next to a good image and label

    manifest, _ = write_shards(tmp_path / "shards", [4, 4, 4, 4], extra=extra)
    for train, workers in ((True, 2), (False, 0)):
        for labeled in (True, False):
            loader = make_loader(manifest, batch_size=3, img_size=8, train=train, labeled=labeled,
                                 data_cfg=DataConfig(num_workers=workers))
            n = sum(len(b["image"]) for b in loader.epoch(0))
            assert loader.counters()["missing_image"] == 4 and n == 12
    assert not target.exists()


def test_bad_samples_skipped_and_counted(tmp_path, caplog):
    rng = np.random.default_rng(0)
    jpeg = encode(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "jpeg")
    big = encode(np.zeros((64, 64, 3), dtype=np.uint8), "png")
    bad = {0: {"png": None, "jpg": os.urandom(300)},           # corrupt JPEG
           1: {"png": None, "jpg": jpeg[: len(jpeg) // 2]},    # truncated JPEG
           2: {"png": None, "txt": b"not an image"},           # non-image member only
           3: {"cls": b"3"},                                   # label out of range (3 classes: 0 to 2)
           4: {"cls": b"cat"},                                 # label not an integer
           7: {"cls": b"99999999999999999999"},                # no class index: damage (overflowed a long)
           5: {"png": big}}                                    # over data.max_pixels

    manifest, source = write_shards(tmp_path, [8, 8, 8, 8],
                                    extra=lambda s, j: bad.get(j, {}) if s == 1 else {})
    tar = tmp_path / "000002.tar"  # truncated tar: cut in the middle of the archive
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 2 + 100])
    caplog.set_level(logging.WARNING, logger="mpp.data")
    loader = make_loader(manifest, batch_size=4, img_size=16, train=False, labeled=True,
                         data_cfg=DataConfig(num_workers=2, eval_crop_pct=1.0, max_pixels=1000))
    for epoch in (0, 1):
        batches = list(loader.epoch(epoch))
        assert len(batches) < loader.batches_per_epoch  # the evaluation ends short: it repeats nothing
    table = {px.tobytes(): key for key, (_, px) in source.items()}
    keys = [table[img.permute(1, 2, 0).numpy().tobytes()] for b in batches for img in b["image"]]
    good = {k for k in source if not k.startswith(("s1_", "s2_"))} | {"s1_6"}
    assert good <= set(keys) and len(keys) == len(set(keys)) and "padded" not in loader.counters()
    assert {k for k in keys if k.startswith("s2_")} < {f"s2_{j}" for j in range(8)}
    c = loader.counters()
    assert (c["corrupt_image"], c["missing_image"], c["bad_label"], c["truncated_tar"]) == (6, 2, 6, 2)
    warned = [r.getMessage() for r in caplog.records]
    for kind in ("corrupt_image", "missing_image", "bad_label", "truncated_tar"):
        assert sum(kind in m for m in warned) == 1  # one warning line per kind, then only counts
    # skips do not break exact resumption (batch sizes are planned from reported skips)
    loader = make_loader(manifest, batch_size=3, img_size=8, train=True, labeled=True, seed=2,
                         data_cfg=DataConfig(num_workers=2, max_pixels=1000, shuffle_buffer=6))
    full, resumed = list(loader.epoch(1)), list(loader.epoch(1, start_batch=5))
    assert len(full) == loader.batches_per_epoch and len(resumed) == len(full) - 5
    for x, y in zip(full[5:], resumed):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])


def test_unreadable_shard_url_counted(tmp_path):
    manifest, _ = write_shards(tmp_path, [5, 5])
    loader = make_loader([f"pipe:cat {tmp_path}/000000.tar", f"pipe:cat {tmp_path}/missing.tar"],
                         batch_size=5, img_size=8, train=False, labeled=True, num_samples=10,
                         data_cfg=DataConfig(num_workers=0))
    batches = list(loader.epoch(0))  # an evaluation: the readable shard's 5 images, none twice
    assert [len(b["image"]) for b in batches] == [5] and loader.counters() == {"unreadable_shard": 1}


def test_manifest_cannot_run_commands(tmp_path):
    """A manifest is data from elsewhere: a shard or label-index name that is a pipe: command (or
    any opener but http(s)/file) stops the run with a clear error before anything is opened; the
    same pipe: written by the user in the data spec still works."""
    import json

    import pytest

    from mpp.data.decode import DataError
    from mpp.data.sources import resolve
    manifest, _ = write_shards(tmp_path / "shards", [3, 3])
    good = json.loads(open(manifest).read())
    canary = tmp_path / "ran.txt"
    shard = str(tmp_path / "shards" / "000000.tar")
    for field, name in (("shard", f"pipe:touch {canary}; cat {shard}"), ("labels", f"pipe:touch {canary}"),
                        ("shard", f"gs://bucket/{shard}"), ("shard", "PIPE:true"),
                        ("shard", f" gs://bucket/{shard}"), ("shard", f"\tscp://host/{shard}")):
        m = json.loads(json.dumps(good))
        if field == "shard":
            m["shards"][0]["name"] = name
        else:
            m["labels"] = name
        bad = tmp_path / "shards" / "bad.json"
        bad.write_text(json.dumps(m))
        with pytest.raises(DataError, match="never a command"):
            make_loader(str(bad), batch_size=2, img_size=8, train=False, labeled=True,
                        data_cfg=DataConfig(num_workers=0))
        assert not canary.exists()
    for name in ("http://example.invalid/000000.tar", f"file:{shard}"):  # plain URLs stay allowed
        m = json.loads(json.dumps(good))
        m["shards"][0]["name"] = name
        bad.write_text(json.dumps(m))
        assert resolve(str(bad)).urls[0] == name
    user = make_loader([f"pipe:cat {shard}"], batch_size=3, img_size=8, train=False, labeled=False,
                       data_cfg=DataConfig(num_workers=0), num_samples=3)
    assert sum(len(b["image"]) for b in user.epoch(0)) == 3


def test_a_manifest_read_through_pipe_cannot_extend_the_command(tmp_path):
    """The user may read a manifest through a pipe: command of their own (`pipe:curl -s
    https://host/d/manifest.json`); its relative names are appended to that command to open the
    shards, so a name holding shell syntax stops the run before anything is opened, while plain
    names still read their shards through the user's command."""
    import json

    import pytest

    from mpp.data.decode import DataError
    manifest, _ = write_shards(tmp_path / "shards", [3, 3])
    canary = tmp_path / "ran.txt"
    good = json.loads(open(manifest).read())
    for field, name in (("shard", f"000000.tar; touch {canary}; #"), ("shard", f"$(touch {canary})"),
                        ("labels", f"x`touch {canary}`"), ("shard", "0 0.tar")):
        m = json.loads(json.dumps(good))
        if field == "shard":
            m["shards"][0]["name"] = name
        else:
            m["labels"] = name
        (tmp_path / "shards" / "bad.json").write_text(json.dumps(m))
        with pytest.raises(DataError, match="part of its pipe: command"):
            make_loader(f"pipe:cat {tmp_path}/shards/bad.json", batch_size=2, img_size=8, train=False, labeled=True,
                        data_cfg=DataConfig(num_workers=0))
        assert not canary.exists()
    loader = make_loader(f"pipe:cat {manifest}", batch_size=3, img_size=8, train=False, labeled=True,
                         data_cfg=DataConfig(num_workers=0))
    assert loader.shards.urls[0] == f"pipe:cat {tmp_path}/shards/000000.tar"
    assert sum(len(b["image"]) for b in loader.epoch(0)) == 6


def test_resampled_shards_that_never_decode_fail_instead_of_hanging(tmp_path):
    """Resampled mode draws shards forever: where none gives a sample that decodes (here every shard
    is random bytes), the loader raises a DataError instead of waiting for its first batch forever;
    one readable shard among bad ones keeps it going."""
    import pytest

    from mpp.data.decode import DataError
    for i in range(2):
        (tmp_path / f"bad{i}.tar").write_bytes(os.urandom(4096))
    data = DataConfig(num_workers=0, resampled=True, epoch_samples=8, shuffle_buffer=0)
    loader = make_loader(str(tmp_path / "bad{0..1}.tar"), batch_size=4, img_size=8, train=True, labeled=True,
                         data_cfg=data, num_samples=8)
    with pytest.raises(DataError, match="shard draws in a row gave no sample that decodes.*corrupt_tar"):
        next(iter(loader.epoch(0)))
    write_shards(tmp_path / "good", [4])
    mixed = [str(tmp_path / "good" / "000000.tar")] + [str(tmp_path / f"bad{i}.tar") for i in range(2)]
    loader = make_loader(mixed, batch_size=4, img_size=8, train=True, labeled=True, data_cfg=data, num_samples=8)
    assert [len(b["image"]) for b in loader.epoch(0)] == [4, 4] and loader.counters()["corrupt_tar"] > 0


def test_members_decoding_never_reads_are_not_held_in_memory(tmp_path):
    """A shard whose samples carry large members that are neither an image nor a label (a 2 MiB
    .npy each, highly compressible in a .tar.gz): up to a shuffle buffer of raw samples waits in
    memory, so those members keep their name (a sample of nothing else still counts as
    missing_image) but no bytes; the images and labels come through whole."""
    from mpp.data.sources import read_shard
    big = bytes(2 << 20)
    only_npy = {"png": None, "cls": None}  # the first sample: nothing else
    manifest, source = write_shards(tmp_path / "shards", [3, 3],
                                    extra=lambda s, j: {"npy": big, **(only_npy if (s, j) == (0, 0) else {})})
    skips: dict = {}
    samples = [x for url in sorted((tmp_path / "shards").glob("*.tar")) for x in read_shard(str(url), skips)]
    assert len(samples) == 6 and not skips
    assert all(x["npy"] == b"" for x in samples) and sum(len(v) for x in samples for v in x.values()
                                                         if isinstance(v, bytes)) < 6 * 4096
    assert all(x["png"] == encode(source[x["__key__"]][1], "png") for x in samples if "png" in x)
    loader = make_loader(manifest, batch_size=5, img_size=8, train=False, labeled=True,
                         data_cfg=DataConfig(num_workers=0))
    assert sum(len(b["image"]) for b in loader.epoch(0)) == 5 and loader.counters() == {"missing_image": 1}


def test_the_samples_a_broken_shard_loses_are_counted(tmp_path):
    """A shard whose header breaks half-way counted the shard, not the samples after the break:
    a tenth of an epoch could go untrained and unreported. They are `lost_samples` now (the
    manifest's count less those read), and the rank's batches shrink by them."""
    import tarfile
    manifest, _ = write_shards(tmp_path, [10, 10])
    with tarfile.open(tmp_path / "000001.tar") as tar:
        offset = tar.getmembers()[9].offset  # the 5th sample's second member: 4 samples read before it
    data = bytearray((tmp_path / "000001.tar").read_bytes())
    data[offset + 100] ^= 0xFF  # a bad header checksum; the file keeps its size, as the manifest records
    (tmp_path / "000001.tar").write_bytes(bytes(data))
    loader = make_loader(manifest, batch_size=4, img_size=8, train=False, labeled=True,
                         data_cfg=DataConfig(num_workers=0))
    images = sum(len(b["image"]) for b in loader.epoch(0))
    assert loader.counters() == {"corrupt_tar": 1, "lost_samples": 6} and images == 14


def test_a_shard_read_that_stalls_ends_in_one_error_after_data_timeout(tmp_path):
    """A shard that blocks its reader (a FIFO here; a hung mount or stream in life) held the run
    forever, SIGTERM noted but never acted on: the wait for a batch is bounded by data.timeout."""
    import time
    from mpp.data.decode import DataError
    manifest, _ = write_shards(tmp_path, [4, 4])
    loader = make_loader(manifest, batch_size=4, img_size=8, train=True, labeled=True,
                         data_cfg=DataConfig(num_workers=1, timeout=2, shuffle_buffer=0))
    (tmp_path / "000000.tar").unlink()
    os.mkfifo(tmp_path / "000000.tar")  # after the start's checks, as a mount hangs mid-run
    start = time.perf_counter()
    try:
        with pytest.raises(DataError, match=r"read nothing and gave no batch in data.timeout=2 s: a shard read"):
            list(loader.epoch(0))
        assert time.perf_counter() - start < 30
    finally:  # the worker waits in open(): a writer that comes and goes lets it go
        os.close(os.open(tmp_path / "000000.tar", os.O_WRONLY | os.O_NONBLOCK))
        loader.close()


def test_a_stalled_pipe_command_ends_with_the_run(tmp_path):
    """A pipe: command that hangs (here a shell that sleeps) made the stall error, but outlived the
    run: torch ends the worker reading it, and the shell and its children were left behind."""
    import subprocess
    import sys
    import time
    write_shards(tmp_path, [4, 4])
    marker = f"{time.time_ns() % 10**9}.25"  # a sleep no other process runs
    script = f"""
from mpp.config import DataConfig
from mpp.data import make_loader
from mpp.data.decode import DataError
urls = ["pipe:sleep {marker}; cat {tmp_path}/000000.tar", "pipe:cat {tmp_path}/000001.tar"]
loader = make_loader(urls, batch_size=4, img_size=8, train=True, labeled=True, num_samples=8,
                     data_cfg=DataConfig(num_workers=1, timeout=1, shuffle_buffer=0))
try:
    list(loader.epoch(0))
except DataError:
    print("stalled")
"""
    with open(tmp_path / "stderr", "w") as err:  # a file: a command left behind would hold a pipe open
        run = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True, timeout=60)
    assert run.stdout.strip() == "stalled", (tmp_path / "stderr").read_text()
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.split()
    for pid in left:
        os.kill(int(pid), 9)
    assert not left


def test_workers_that_read_slowly_are_no_stall(tmp_path):
    """The wait for a batch counts towards data.timeout only while the workers read nothing: a
    worker filling its cache from every shard of the rank at its first epoch's end (here slow
    shards, 1 s each, under a 3 s timeout) made the run stop as stalled."""
    manifest, _ = write_shards(tmp_path, [4] * 6)
    slow = [f"pipe:sleep 1; cat {tmp_path}/{i:06d}.tar" for i in range(6)]
    loader = make_loader(slow, batch_size=4, img_size=8, train=True, labeled=True, num_samples=24,
                         data_cfg=DataConfig(num_workers=2, timeout=3, shuffle_buffer=0, cache_mb=64))
    try:
        assert [sum(len(b["image"]) for b in loader.epoch(e)) for e in (0, 1)] == [24, 24]
    finally:
        loader.close()


def test_a_broken_shard_leaves_the_batches_of_an_endless_stream_whole(tmp_path):
    """Resampled, the stream never ends: a broken shard's lost samples (counted per draw) must not
    shrink the batches, which ran down to 1 sample where the skips were taken off what was left."""
    import tarfile
    manifest, _ = write_shards(tmp_path, [40, 40, 40, 40])
    for shard in ("000001.tar", "000002.tar", "000003.tar"):  # each broken after its first sample
        with tarfile.open(tmp_path / shard) as tar:
            offset = tar.getmembers()[3].offset
        data = bytearray((tmp_path / shard).read_bytes())
        data[offset + 100] ^= 0xFF
        (tmp_path / shard).write_bytes(bytes(data))
    loader = make_loader(manifest, batch_size=8, img_size=8, train=True, labeled=True,
                         data_cfg=DataConfig(num_workers=0, resampled=True, epoch_samples=160, shuffle_buffer=0))
    sizes = [len(b["image"]) for b in loader.epoch(0)]
    assert sizes == [8] * 20 and loader.counters()["lost_samples"] >= 39


def test_a_restart_of_the_workers_waits_the_whole_timeout(tmp_path, monkeypatch):
    """An endless stream restarts its workers at every epoch, and each answers once it has sent
    what it was asked for: a wait cut at one watch stopped a run whose shard reads take longer."""
    import mpp.data.loader
    monkeypatch.setattr(mpp.data.loader, "WATCH_S", 1)
    write_shards(tmp_path, [4] * 3)
    slow = [f"pipe:sleep 2; cat {tmp_path}/{i:06d}.tar" for i in range(3)]
    loader = make_loader(slow, batch_size=4, img_size=8, train=True, labeled=True, num_samples=12,
                         data_cfg=DataConfig(num_workers=1, timeout=8, shuffle_buffer=0, resampled=True,
                                             epoch_samples=8, cache_mb=0))
    try:
        assert [sum(len(b["image"]) for b in loader.epoch(e)) for e in range(3)] == [8, 8, 8]
    finally:
        loader.close()


def test_every_shell_metacharacter_in_a_piped_manifests_shard_name_is_refused_and_runs_nothing(tmp_path):
    """A manifest read through the user's pipe: command has its relative shard names appended to that
    command: each shell metacharacter alone (`;`, `|`, `&`, `$`, backticks, quotes, redirections, spaces,
    newlines...) in front of a script's path would run it, so each is refused and the script never runs."""
    import json

    from mpp.data.decode import DataError
    manifest, _ = write_shards(tmp_path / "shards", [3, 3])
    marker = tmp_path / "ran.txt"
    script = tmp_path / "payload.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    good = json.loads(open(manifest).read())
    bad = tmp_path / "shards" / "bad.json"
    for c in ";|&$`<>()'\"\\*?!#~{} \t\n":
        m = json.loads(json.dumps(good))
        m["shards"][0]["name"] = f"000000.tar{c}{script}"
        bad.write_text(json.dumps(m))
        message = "never a command" if c in "\t\n" else "part of its pipe: command"
        with pytest.raises(DataError, match=message):
            loader = make_loader(f"pipe:cat {bad}", batch_size=3, img_size=8, train=False, labeled=True,
                                 data_cfg=DataConfig(num_workers=0))
            list(loader.epoch(0))  # (only where the name got through: its command runs here)
        assert not marker.exists(), repr(c)
