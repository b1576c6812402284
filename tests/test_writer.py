"""Image folder / tar -> shards: content, labels, manifest, shuffling, limits, bad files, CLI."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

import mpp.fileio
from mpp.data.writer import ShardError, sample_keys, write_shards

def _tool_main(name: str):
    """`main` of tools/NAME.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


CLASSES = ["a_cls", "b_cls", "c_cls"]


def _image_bytes(seed: int, fmt: str = "JPEG", size: tuple[int, int] = (12, 10)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """3 classes x 6 images (one PNG, one nested, one with dots in its name) plus 4 bad files."""
    root = tmp_path / "src"
    for c, name in enumerate(reversed(CLASSES)):  # created out of order: labels come from sorting
        for i in range(6):
            path = root / name / (f"sub/{i:03d}.jpg" if i == 5 else f"{i:03d}.v1.jpg" if i == 4 else f"{i:03d}.jpg")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_image_bytes(10 * c + i))
        (root / name / "005.png").write_bytes(_image_bytes(100 + c, "PNG"))
    good = _image_bytes(999)
    (root / "a_cls" / "trunc.jpg").write_bytes(good[: len(good) // 2])
    (root / "a_cls" / "garbage.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4)
    (root / "b_cls" / "notes.txt").write_text("not an image")
    (root / "loose.jpg").write_bytes(good)  # outside any class folder
    return root


def _source_samples(root: Path) -> dict[str, tuple[bytes, str]]:
    """relative path -> (bytes, class) of the good images."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.relative_to(root).parts[0])
            for p in root.rglob("*") if p.suffix in (".jpg", ".png") and p.parent != root
            and p.name not in ("trunc.jpg", "garbage.jpg")}


def _read_shards(out: Path) -> list[list[tuple[str, dict[str, bytes]]]]:
    """Per shard, in order: (key, {ext: bytes}) read with plain tarfile."""
    manifest = json.loads((out / "manifest.json").read_text())
    shards = []
    for s in manifest["shards"]:
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(out / s["name"]) as tar:
            for m in tar.getmembers():
                key, ext = m.name.rsplit(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
        shards.append(list(samples.items()))
    return shards


def _check_round_trip(out: Path, root: Path, manifest: dict) -> None:
    source = _source_samples(root)
    shards = _read_shards(out)
    assert manifest["classes"] == CLASSES
    assert [s["num_samples"] for s in manifest["shards"]] == [len(s) for s in shards]
    assert manifest["num_samples"] == len(source) == sum(len(s) for s in shards)
    assert [s["name"] for s in manifest["shards"]] == [f"{i:06d}.tar" for i in range(len(shards))]
    written = {key: fields for shard in shards for key, fields in shard}
    keys = dict(zip(sorted(source), sample_keys(sorted(source))))
    for rel, (data, cls) in source.items():
        fields = written[keys[rel]]
        ext = "png" if rel.endswith(".png") else "jpg"
        assert set(fields) == {ext, "cls"}
        assert fields[ext] == data  # bytes as in the source, never re-encoded
        assert int(fields["cls"]) == CLASSES.index(cls)


def test_folder_round_trip(folder: Path, tmp_path: Path):
    out = tmp_path / "out"
    m = write_shards(folder, out, samples_per_shard=5, seed=0, progress=False)
    _check_round_trip(out, folder, m)
    assert all(s["num_samples"] <= 5 for s in m["shards"]) and len(m["shards"]) == 5
    assert m["formats"] == {"jpg": 18, "png": 3}
    # bad files and the loose file are reported and never written
    assert m["skipped"]["count"] == 4
    reasons = "\n".join(m["skipped"]["examples"])
    for name in ("trunc.jpg", "garbage.jpg", "notes.txt: not an image", "loose.jpg: outside any class folder"):
        assert name in reasons
    assert not any(k.endswith(("trunc", "garbage", "notes", "loose")) for s in _read_shards(out) for k, _ in s)
    assert m["made"]["seed"] == 0 and m["made"]["source"] == str(folder.resolve()) and "created" in m["made"]
    # the label index lists each shard's (key, label) pairs in shard order
    assert m["labels"] == "labels.json"
    assert json.loads((out / "labels.json").read_text()) == [
        [[key, int(fields["cls"])] for key, fields in shard] for shard in _read_shards(out)]


def test_subsets_read_the_label_index_not_the_shards(folder: Path, tmp_path: Path, monkeypatch):
    from mpp.data import subset
    from mpp.data.decode import DataError
    from mpp.data.sources import resolve

    out = tmp_path / "out"
    write_shards(folder, out, samples_per_shard=5, seed=0, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    scanned = subset.select_subset(resolve(str(out / "manifest.json")), 0.5, seed=3)
    (out / "bare.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "labels"}))
    assert resolve(str(out / "bare.json")).labels is None

    def no_shard_reads(*args, **kwargs):
        raise AssertionError("a shard was read")

    monkeypatch.setattr(subset, "tar_members", no_shard_reads)
    indexed = subset.select_subset(resolve(str(out / "manifest.json")), 0.5, seed=3)
    assert indexed == scanned and indexed.num_samples == 12  # 3 classes x round(0.5 x 7)
    with pytest.raises(AssertionError, match="a shard was read"):
        subset.select_subset(resolve(str(out / "bare.json")), 0.5, seed=3)
    (out / "labels.json").write_text("[[]]")
    with pytest.raises(DataError, match="label index .* does not match its manifest"):
        subset.select_subset(resolve(str(out / "manifest.json")), 0.5, seed=3)


def test_manifest_label_index_and_shards_agree_or_the_reader_says_so(folder: Path, tmp_path: Path, caplog):
    """The manifest records each shard's size and the label index's digest; a shard rewritten after
    it, a swapped or edited index, or a manifest whose counts or classes disagree is one DataError
    naming the file and the fix, before any work. Old manifests (no sizes) load with a warning."""
    from mpp.data.decode import DataError
    from mpp.data.sources import resolve
    from mpp.data.subset import select_subset

    out = tmp_path / "out"
    m = write_shards(folder, out, samples_per_shard=5, seed=0, progress=False)
    assert [s["bytes"] for s in m["shards"]] == [(out / s["name"]).stat().st_size for s in m["shards"]]
    manifest, index = out / "manifest.json", json.loads((out / "labels.json").read_text())
    good = select_subset(resolve(str(manifest)), 0.5, seed=3)

    def rewrite(path: Path, edit):
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))

    # a shard changed since the manifest (here: one byte longer) is refused by name
    shard = out / "000002.tar"
    shard.write_bytes(shard.read_bytes() + b"\0")
    with pytest.raises(DataError, match=rf"shard 000002.tar is {m['shards'][2]['bytes'] + 1} bytes but the "
                                        rf"manifest recorded {m['shards'][2]['bytes']}; the shards changed"):
        resolve(str(out))
    shard.write_bytes(shard.read_bytes()[:-1])
    # the manifest's total, its classes, the label index's digest, counts and labels must agree
    for edit, message in [
        (lambda d: d.update(num_samples=d["num_samples"] + 1), "num_samples is 22 but its shards hold 21"),
        (lambda d: d.update(num_samples="21"), "num_samples must be a whole number, got '21'"),
        (lambda d: d.update(num_samples=float("nan")), "num_samples must be a whole number, got nan"),
        (lambda d: d["shards"][0].update(num_samples=5.9), "a shard's num_samples is 5.9, not a whole number"),
        (lambda d: d.update(classes=["a_cls", "b_cls", "a_cls"]), "class 'a_cls' is listed twice"),
    ]:
        rewrite(manifest, edit)
        with pytest.raises(DataError, match=message):
            resolve(str(manifest))
        manifest.write_text(json.dumps(m, indent=1))
    (out / "labels.json").write_text(json.dumps(index) + " ")
    with pytest.raises(DataError, match="not the one its manifest recorded"):
        select_subset(resolve(str(manifest)), 0.5, seed=3)
    rewrite(manifest, lambda d: d.pop("labels_sha256"))  # an older manifest: counts and labels still checked
    assert select_subset(resolve(str(manifest)), 0.5, seed=3) == good
    for entry, message in [(index[1][:-1], "lists 4 samples for shard 000001.tar but the manifest records 5"),
                           ([[k, 3] for k, _ in index[1]], "gives label 3 in shard 000001.tar but the manifest "
                                                            "lists 3 classes")]:
        (out / "labels.json").write_text(json.dumps([index[0], entry, *index[2:]]))
        with pytest.raises(DataError, match=message):
            select_subset(resolve(str(manifest)), 0.5, seed=3)
    # the index is untrusted input: read only when it is a file, and only so far
    (out / "labels.json").write_text(json.dumps(index) + " " * 2**21)
    with pytest.raises(DataError, match=r"more than \d+ bytes for 21 samples"):
        select_subset(resolve(str(manifest)), 0.5, seed=3)
    (out / "labels.json").unlink()
    os.mkfifo(out / "labels.json")  # reading it would wait forever
    with pytest.raises(DataError, match="labels.json' is not a file"):
        select_subset(resolve(str(manifest)), 0.5, seed=3)
    (out / "labels.json").unlink()
    (out / "labels.json").write_text(json.dumps(index))
    # a manifest without sizes still loads, with one warning per manifest
    rewrite(manifest, lambda d: [s.pop("bytes") for s in d["shards"]])
    shard.write_bytes(shard.read_bytes() + b"\0")
    with caplog.at_level("WARNING"):
        assert resolve(str(manifest)).counts == resolve(str(manifest)).counts == [5, 5, 5, 5, 1]
    assert [r.getMessage() for r in caplog.records].count(
        f"warning: {manifest} records no shard sizes (written by an older mpp): shards changed since it was written go "
        "unnoticed; re-run tools/make_shards.py to record them") == 1


def test_shuffled_across_shards_seeded_and_reproducible(folder: Path, tmp_path: Path):
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        write_shards(folder, tmp_path / name, samples_per_shard=7, seed=seed, progress=False)
        runs[name] = [(tmp_path / name / f"{i:06d}.tar").read_bytes() for i in range(3)]
    assert runs["a"] == runs["b"]  # same seed: byte-identical shards
    assert runs["a"] != runs["c"]
    for shard in _read_shards(tmp_path / "a"):
        assert len({fields["cls"] for _, fields in shard}) > 1  # not one class per shard


def test_keys_unique_and_readable_by_webdataset(folder: Path, tmp_path: Path):
    assert sample_keys(["x/a.jpg", "x/a.png", "x/a.b.jpg", "x/a_b.jpg", "y.z/c.jpg"]) == \
        ["x/a", "x/a_2", "x/a_b", "x/a_b_2", "y.z/c"]
    # keys webdataset would take for metadata members ('__x__...') are changed, not dropped
    assert sample_keys(["__background__/3.jpg", "__init__.png", "__a__b/c.jpg"]) == \
        ["x__background__/3", "x__init__", "__a__b/c"]
    out = tmp_path / "out"
    m = write_shards(folder, out, samples_per_shard=100, progress=False)
    ds = wds.WebDataset(str(out / "000000.tar"), shardshuffle=False)
    samples = list(ds)
    assert len(samples) == m["num_samples"]
    assert all(len([k for k in s if not k.startswith("__")]) == 2 for s in samples)


def test_tar_sources_plain_compressed_and_with_top_folder(folder: Path, tmp_path: Path):
    (folder / "loose.jpg").unlink()  # a tar with a top folder has no loose files at the folder's root
    ref = write_shards(folder, tmp_path / "ref", seed=3, progress=False)
    for mode in ("w", "w:gz"):
        src = tmp_path / f"src_{mode[-2:]}.tar"
        with tarfile.open(src, mode) as tar:
            if mode == "w":  # the folder's content at the archive's root
                tar.add(folder, arcname=".")
            else:            # inside one top folder 'train/CLASS/...', which is taken as the root
                tar.add(folder, arcname="train")
        out = tmp_path / f"out_{mode[-2:]}"
        m = write_shards(src, out, seed=3, progress=False)
        _check_round_trip(out, folder, m)
        assert _read_shards(out) == _read_shards(tmp_path / "ref")  # same keys and order as the folder
        assert m["skipped"]["count"] == ref["skipped"]["count"] == 3
    src = tmp_path / "stray.tar"  # a stray file beside the class folders leaves 'train/' the root
    with tarfile.open(src, "w") as tar:
        tar.add(folder, arcname="train")
        info = tarfile.TarInfo("train/.DS_Store")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"\0\0\0\1"))
    m = write_shards(src, tmp_path / "out_stray", seed=3, progress=False)
    assert m["classes"] == CLASSES and m["num_samples"] == ref["num_samples"]
    assert any(e.startswith(".DS_Store") for e in m["skipped"]["examples"]), m["skipped"]
    # macOS archives: 'train/' and '__MACOSX/train/' beside it, whose top folder made 'train' the one class of
    # every image; an image in a hidden folder did too, and so did a file such as a README beside 'train/'
    for i, junk in enumerate((f"__MACOSX/train/{CLASSES[0]}/._000.jpg", ".thumbnails/t.jpg", "README.txt")):
        src = tmp_path / f"junk{i}.tar"
        with tarfile.open(src, "w") as tar:
            tar.add(folder, arcname="train")
            info = tarfile.TarInfo(junk)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"\0\5\26\7"))
        m = write_shards(src, tmp_path / f"out_junk{i}", seed=3, progress=False)
        _check_round_trip(tmp_path / f"out_junk{i}", folder, m)
    assert any(e.startswith("README.txt") for e in m["skipped"]["examples"]), m["skipped"]


def test_a_source_of_one_class_folder_is_warned_of(folder: Path, tmp_path: Path, caplog):
    """A folder that holds the class folders one level down (SRC/train/CLASS/...) is read as one
    class, every label 0: written, as a set may be meant so, but said."""
    (folder / "loose.jpg").unlink()
    (tmp_path / "up").mkdir()
    folder.rename(tmp_path / "up/train")
    m = write_shards(tmp_path / "up", tmp_path / "out", progress=False)
    assert m["classes"] == ["train"]
    assert "one class folder, 'train'" in caplog.text
    caplog.clear()
    write_shards(tmp_path / "up/train", tmp_path / "out2", progress=False)
    assert "one class folder" not in caplog.text


def test_unlabeled(folder: Path, tmp_path: Path):
    m = write_shards(folder, tmp_path / "out", unlabeled=True, progress=False)
    assert m["classes"] is None and m["num_samples"] == 22  # 21 class images + the loose one
    shards = _read_shards(tmp_path / "out")
    assert all("cls" not in fields for s in shards for _, fields in s)
    assert "loose" in {k for s in shards for k, _ in s}


def test_bytes_per_shard_limit(folder: Path, tmp_path: Path):
    limit = 40 * 1024
    m = write_shards(folder, tmp_path / "out", bytes_per_shard=limit, progress=False)
    sizes = [(tmp_path / "out" / s["name"]).stat().st_size for s in m["shards"]]
    assert len(sizes) > 1 and max(sizes) <= limit
    assert m["num_samples"] == 21
    # long and non-ASCII names take extended headers, counted too
    for i in range(12):
        (folder / "a_cls" / f"{'é' * 15}{'n' * 60}{i}.png").write_bytes(_image_bytes(200 + i, "PNG"))
    m = write_shards(folder, tmp_path / "out", bytes_per_shard=limit, overwrite=True, progress=False)
    sizes = [(tmp_path / "out" / s["name"]).stat().st_size for s in m["shards"]]
    assert max(sizes) <= limit and m["num_samples"] == 33


def test_refuses_non_empty_output_and_overwrite_removes_stale_shards(folder: Path, tmp_path: Path):
    out = tmp_path / "out"
    write_shards(folder, out, samples_per_shard=2, progress=False)
    with pytest.raises(ShardError, match="not empty"):
        write_shards(folder, out, progress=False)
    m = write_shards(folder, out, samples_per_shard=100, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["000000.tar", "labels.json", "manifest.json"]
    assert m["num_samples"] == 21
    write_shards(folder, out, unlabeled=True, overwrite=True, progress=False)  # no stale label index
    assert sorted(p.name for p in out.iterdir()) == ["000000.tar", "manifest.json"]


def test_a_failed_overwrite_leaves_the_old_data_set(folder: Path, tmp_path: Path, monkeypatch):
    """--overwrite writes the new set apart and replaces the old one only when complete: a
    source without a readable image, an interrupt mid-write or a failed move leaves OUT's shards,
    label index, manifest and other files as they were, and no temporary folder behind."""
    out = tmp_path / "out"
    write_shards(folder, out, samples_per_shard=5, progress=False)
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    empty = tmp_path / "empty"
    (empty / "c").mkdir(parents=True)
    (empty / "c" / "bad.jpg").write_bytes(b"junk")
    with pytest.raises(ShardError, match="no readable images"):
        write_shards(empty, out, overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def fail_at(n: int, real, error: BaseException):
        calls = []

        def call(*args):
            calls.append(args)
            if len(calls) == n:
                raise error
            return real(*args)
        return call

    with monkeypatch.context() as m:  # Ctrl-C at the 7th sample
        m.setattr(wds.TarWriter, "write", fail_at(7, wds.TarWriter.write, KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            write_shards(folder, out, samples_per_shard=2, overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with monkeypatch.context() as m:  # the 9th move fails: 7 old files out, 1 of 3 new ones in
        m.setattr(os, "rename", fail_at(9, os.rename, OSError("disk gone")))
        with pytest.raises(OSError, match="disk gone"):
            write_shards(folder, out, samples_per_shard=100, overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["empty", "out", "src"]  # no temporary folder left
    write_shards(folder, out, samples_per_shard=100, overwrite=True, progress=False)
    assert sorted(os.listdir(out)) == ["000000.tar", "labels.json", "manifest.json", "notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["empty", "out", "src"]


def test_shards_manifest_and_their_folder_reach_the_disk_before_the_data_set_counts(folder: Path, tmp_path: Path,
                                                                                    monkeypatch):
    """A power cut must not leave a manifest vouching for shards still in the page cache: every
    shard and the manifest are flushed (fsync) before the manifest is renamed into place, and the
    folder's entries after it, so a run reading the set after a crash reads the set written."""
    events, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), rename(a, b)))
    out = tmp_path / "out"
    m = write_shards(folder, out, samples_per_shard=8, progress=False)
    flushed = [Path(p).name for kind, p in events if kind == "fsync"]
    assert {s["name"] for s in m["shards"]} | {".manifest.json.tmp%d.%s" % (os.getpid(), mpp.fileio._WHERE)} <= set(flushed)
    manifest_in_place = events.index(("rename", str(out / "manifest.json")))
    assert all(events.index(("fsync", p)) < manifest_in_place for kind, p in events if kind == "fsync"
               and Path(p).name.endswith(".tar"))
    assert events[-1] == ("fsync", str(out.resolve()))  # the renames into OUT, last


def test_a_killed_writers_staging_folder_is_no_data_and_goes(folder: Path, tmp_path: Path):
    """kill -9 mid-write leaves the staging folder (no cleanup runs): the next write to OUT removes
    it, OUT with only it counts as empty, and a source that holds one gets no class for it."""
    out = tmp_path / "out"
    (out / ".mpp-staging.dead" / "new").mkdir(parents=True)
    (out / ".mpp-staging.dead" / "new" / "000000.tar").write_bytes(b"partial")
    write_shards(folder, out, samples_per_shard=100, progress=False)  # no --overwrite needed
    assert sorted(os.listdir(out)) == ["000000.tar", "labels.json", "manifest.json"]
    (folder / ".mpp-staging.dead" / "x").mkdir(parents=True)
    shutil.copy(next(folder.rglob("*.jpg")), folder / ".mpp-staging.dead" / "x" / "a.jpg")
    assert write_shards(folder, tmp_path / "out2", progress=False)["classes"] == sorted(
        p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    (tmp_path / "empty_src" / "c").mkdir(parents=True)
    (tmp_path / "empty_src" / "c" / "bad.jpg").write_bytes(b"junk")
    with pytest.raises(ShardError, match="no readable images"):  # a new OUT that fails: no folder left
        write_shards(tmp_path / "empty_src", tmp_path / "new" / "deeper", progress=False)
    assert not (tmp_path / "new").exists()


def test_bad_sources(tmp_path: Path):
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "x.jpg").write_bytes(_image_bytes(0))
    with pytest.raises(ShardError, match="no class sub-folders"):
        write_shards(flat, tmp_path / "o1", progress=False)
    with pytest.raises(ShardError, match="does not exist"):
        write_shards(tmp_path / "missing", tmp_path / "o2", progress=False)
    (tmp_path / "not.tar").write_bytes(b"hello")
    with pytest.raises(ShardError, match="neither a folder nor a readable tar"):
        write_shards(tmp_path / "not.tar", tmp_path / "o3", progress=False)
    (flat / "c").mkdir()
    (flat / "c" / "bad.jpg").write_bytes(b"junk")
    for out in (tmp_path / "o4", tmp_path / "o5/deeper/o6"):  # nothing made, not even the folder
        with pytest.raises(ShardError, match="no readable images"):
            write_shards(flat, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["flat", "not.tar"]
    huge = bytearray(tarfile.TarInfo("c/h.jpg").tobuf(tarfile.USTAR_FORMAT))  # size field: base-256, past any offset
    huge[124:136] = b"\x80\x7f" + b"\xff" * 10
    huge[148:156] = b" " * 8
    huge[148:156] = b"%06o\0 " % sum(huge)
    (tmp_path / "huge.tar").write_bytes(bytes(huge) + bytes(10240))
    with pytest.raises(ShardError, match="neither a folder nor a readable tar|is damaged"):
        write_shards(tmp_path / "huge.tar", tmp_path / "o7", progress=False)


def test_folders_that_are_no_classes_take_no_label_and_an_empty_class_keeps_its_own(folder: Path, tmp_path: Path,
                                                                                  caplog):
    """A zip's __MACOSX folder (its '._x.jpg' are no images) sorts first: as a class it took label 0
    and shifted every real class's label by one; it and hidden folders are no classes. A class
    whose folder holds no image (a test split's) keeps its label, with a warning."""
    for junk in ("__MACOSX", ".ipynb_checkpoints"):
        (folder / junk / CLASSES[0]).mkdir(parents=True)
        (folder / junk / CLASSES[0] / "._000.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    manifest = write_shards(folder, tmp_path / "out", progress=False)
    assert manifest["classes"] == sorted(CLASSES)
    for junk in ("__MACOSX", ".ipynb_checkpoints"):
        assert [e for e in manifest["skipped"]["examples"] if e.startswith(f"{junk}/")] == [
            f"{junk}/{CLASSES[0]}/._000.jpg: outside any class folder"]
    shutil.rmtree(folder / CLASSES[1])
    (folder / CLASSES[1]).mkdir()
    (folder / CLASSES[1] / ".DS_Store").write_bytes(b"\0Bud1")
    manifest = write_shards(folder, tmp_path / "out2", progress=False)
    assert manifest["classes"] == sorted(CLASSES) and {lab for s in json.loads(
        (tmp_path / "out2" / "labels.json").read_text()) for _, lab in s} == {0, 2}
    assert f"class folder(s) '{CLASSES[1]}' hold no readable image (1 files skipped there)" in caplog.text


def test_a_phones_jpeg_and_long_file_names_are_written(tmp_path: Path):
    """A JPEG with a multi-picture segment (Pillow's MPO, what phones write as .jpg) was a KeyError
    that stopped the run, and names past the 100 bytes of a ustar header were skipped as
    unreadable; the shards are PAX tars, which hold any name, and both come out of the loader."""
    from PIL import Image
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
    mpo = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 0, 0)).save(mpo, "MPO", save_all=True,
                                                  append_images=[Image.new("RGB", (16, 16), (0, 200, 0))])
    assert Image.open(io.BytesIO(mpo.getvalue())).format == "MPO"
    (src / "a" / "phone.jpg").write_bytes(mpo.getvalue())
    (src / "b" / ("photo_taken_at_the_beach_" * 6 + ".jpg")).write_bytes(_image_bytes(1))
    m = write_shards(src, tmp_path / "out", progress=False)
    assert m["num_samples"] == 2 and m["skipped"]["count"] == 0, m["skipped"]
    from mpp.config import DataConfig
    from mpp.data import make_loader
    loader = make_loader(str(tmp_path / "out" / "manifest.json"), batch_size=2, img_size=16, train=False,
                         labeled=True, data_cfg=DataConfig(num_workers=0, eval_crop_pct=1.0))
    batches = list(loader.epoch(0))
    assert len(batches) == 1 and sorted(batches[0]["label"].tolist()) == [0, 1]
    assert batches[0]["image"][batches[0]["label"].tolist().index(0)].float().mean((1, 2)).argmax() == 0  # red: frame 1


def test_cli(folder: Path, tmp_path: Path, capsys):
    make_shards_main = _tool_main("make_shards")
    make_shards_main([str(folder), str(tmp_path / "out"), "--samples-per-shard", "10", "--seed", "5"])
    assert "wrote 21 samples in 3 shards, 3 classes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        make_shards_main([str(folder), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: output folder") and "not empty" in err and err.count("\n") == 1
    write_shards(folder, tmp_path / "ref", samples_per_shard=10, seed=5, progress=False)  # the options reach the writer
    assert _read_shards(tmp_path / "out") == _read_shards(tmp_path / "ref")
    write_shards(folder, tmp_path / "seed0", samples_per_shard=10, progress=False)
    assert _read_shards(tmp_path / "out") != _read_shards(tmp_path / "seed0")
    make_shards_main([str(folder), str(tmp_path / "unlabeled"), "--unlabeled"])  # reaches the writer too
    assert not json.loads((tmp_path / "unlabeled" / "manifest.json").read_text())["classes"]
    make_shards_main([str(folder), str(tmp_path / "small"), "--bytes-per-shard", str(40 * 1024)])
    small = json.loads((tmp_path / "small" / "manifest.json").read_text())["shards"]
    assert len(small) > 1 and max((tmp_path / "small" / s["name"]).stat().st_size for s in small) <= 40 * 1024
    make_shards_main([str(folder), str(tmp_path / "small"), "--overwrite"])  # a non-empty OUT replaced
    assert len(json.loads((tmp_path / "small" / "manifest.json").read_text())["shards"]) == 1


def test_the_tools_defaults_reach_the_writer(tmp_path: Path, monkeypatch, capsys):
    """A bare make_shards writes with the defaults its --help names (seed 0, no overwrite)."""
    from mpp.data.writer import BYTES_PER_SHARD, SAMPLES_PER_SHARD
    from mpp.tools import make_shards
    seen = []
    monkeypatch.setattr(make_shards, "write_shards", lambda src, out, **kw: seen.append(kw) or dict(
        classes=[], num_samples=0, shards=[], skipped=dict(count=0)))
    make_shards.main([str(tmp_path / "src"), str(tmp_path / "out")])
    assert seen == [dict(unlabeled=False, samples_per_shard=SAMPLES_PER_SHARD, bytes_per_shard=BYTES_PER_SHARD,
                         seed=0, overwrite=False)]
    with pytest.raises(SystemExit):
        make_shards.main(["--help"])
    assert "across shards (default 0)" in " ".join(capsys.readouterr().out.split())


def test_every_written_format_is_one_the_loader_decodes():
    from mpp.data import decode
    from mpp.data.writer import FORMAT_EXT
    assert set(FORMAT_EXT) <= set(decode.PIL_FORMATS) and set(FORMAT_EXT.values()) <= set(decode.IMAGE_EXTS)


CLASS_NAMES = ["__background__", "k1", "k2"]  # the first as webdataset names metadata members


def test_folder_to_shards_to_batches(tmp_path: Path):
    """The issue's round trip: lossless source images come out of the loader with their labels,
    a class folder named like a webdataset metadata member ('__background__') included."""
    from mpp.config import DataConfig
    from mpp.data import make_loader
    source = []
    for c in range(3):
        for i in range(7):
            arr = np.random.default_rng(10 * c + i).integers(0, 255, (16, 16, 3), dtype=np.uint8)
            (tmp_path / "src" / CLASS_NAMES[c]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(arr).save(tmp_path / "src" / CLASS_NAMES[c] / f"{i}.png")
            source.append((c, arr.tobytes()))
    m = write_shards(tmp_path / "src", tmp_path / "out", samples_per_shard=4, progress=False)
    loader = make_loader(str(tmp_path / "out" / "manifest.json"), batch_size=5, img_size=16, train=False,
                         labeled=True, data_cfg=DataConfig(num_workers=0, eval_crop_pct=1.0))
    got = [(int(lab), img.permute(1, 2, 0).numpy().tobytes())
           for b in loader.epoch(0) for img, lab in zip(b["image"], b["label"])]
    assert loader.num_samples == m["num_samples"] == 21 and loader.classes == CLASS_NAMES
    assert sorted(got) == sorted(source)


def test_a_file_past_the_members_limit_is_skipped_unread(folder: Path, tmp_path: Path, monkeypatch):
    """A folder's file larger than a shard member may be was read whole and written, and the
    loader then refused its member and lost the rest of the shard; it is skipped and counted
    like an unreadable file, never read."""
    import mpp.data.writer
    monkeypatch.setattr(mpp.data.writer, "MAX_MEMBER", 4096)
    before = write_shards(folder, tmp_path / "before", progress=False)
    (folder / "a_cls" / "big.jpg").write_bytes(_image_bytes(7, size=(200, 200)) + bytes(8192))  # readable
    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or real(self))
    m = write_shards(folder, tmp_path / "out", progress=False)
    assert any("big.jpg" in e and "past the 0 MiB a shard member may hold" in e for e in m["skipped"]["examples"])
    assert "big.jpg" not in read and read
    assert m["num_samples"] == before["num_samples"] and m["skipped"]["count"] == before["skipped"]["count"] + 1


@pytest.mark.parametrize("compressed", [False, True])
def test_an_archive_member_past_the_members_limit_is_skipped_unread(folder: Path, tmp_path: Path, monkeypatch,
                                                                     compressed: bool):
    """A source archive's member larger than a shard member may be (or a sparse one: a 10 KB tar
    can declare any size) is skipped and counted like an unreadable file, never read into memory;
    the rest are written."""
    import mpp.data.writer
    monkeypatch.setattr(mpp.data.writer, "MAX_MEMBER", 4096)
    src = tmp_path / ("src.tar.gz" if compressed else "src.tar")
    mode = "w:gz" if compressed else "w"
    with tarfile.open(src, mode) as tar:
        tar.add(folder, arcname="src")
    before = write_shards(src, tmp_path / "before", progress=False)
    (folder / "a_cls" / "big.jpg").write_bytes(_image_bytes(7, size=(200, 200)) + bytes(8192))  # readable
    with tarfile.open(src, mode) as tar:
        tar.add(folder, arcname="src")
    read = []
    real = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: read.append(m.name) or real(self, m))
    m = write_shards(src, tmp_path / "out", progress=False)
    assert any("big.jpg" in e and "past the 0 MiB a shard member may hold" in e for e in m["skipped"]["examples"])
    assert not any(n.endswith("big.jpg") for n in read) and read
    assert m["num_samples"] == before["num_samples"] and m["skipped"]["count"] == before["skipped"]["count"] + 1


def test_a_tar_sources_links_and_replaced_members_are_counted_and_a_cut_tar_refused(folder: Path, tmp_path: Path):
    """From a tar source: a link (not followed) and a member a later one of the same name replaces
    (as extracting it would) are skipped and counted, not dropped unsaid nor written twice; a tar
    cut at a member's end, which reads as a smaller whole set, is refused."""
    src = tmp_path / "src.tar"
    with tarfile.open(src, "w") as tar:
        tar.add(folder, arcname="src")
    before = write_shards(src, tmp_path / "before", progress=False)
    again = _image_bytes(77)
    with tarfile.open(src, "a") as tar:
        for name, kind in (("src/a_cls/link.jpg", tarfile.SYMTYPE), ("src/a_cls/hard.jpg", tarfile.LNKTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "src/a_cls/000.jpg"
            tar.addfile(info)
        info = tarfile.TarInfo("./src/a_cls/000.jpg")  # the same path again, spelled otherwise, other bytes
        info.size = len(again)
        tar.addfile(info, io.BytesIO(again))
    m = write_shards(src, tmp_path / "out", progress=False)
    examples = "\n".join(m["skipped"]["examples"])
    assert m["skipped"]["count"] == before["skipped"]["count"] + 3 and m["num_samples"] == before["num_samples"]
    assert examples.count("a link, which make_shards does not follow") == 2, examples
    assert "replaced by a later member of the same path" in examples
    written = [fields.get("jpg") for shard in _read_shards(tmp_path / "out") for _, fields in shard]
    assert written.count(again) == 1
    with tarfile.open(src) as tar:
        last = tar.getmembers()[-1]
    cut = tmp_path / "cut.tar"  # the archive up to its last member's data, without the zero blocks
    cut.write_bytes(src.read_bytes()[:last.offset_data + last.size + (-last.size % 512)])
    with pytest.raises(ShardError, match="before its end-of-archive block: it was cut short .* or is corrupt"):
        write_shards(cut, tmp_path / "cut_out", progress=False)
    assert not (tmp_path / "cut_out").exists()


def test_a_dangling_link_a_fifo_and_a_device_are_skipped_and_counted(folder: Path, tmp_path: Path):
    """A folder's dangling link and FIFO, and a source tar's FIFO and device members, were dropped
    unsaid: missing from the manifest's `skipped`; they are counted like any file not written (a
    FIFO never read: it would wait forever)."""
    src = tmp_path / "src.tar"
    with tarfile.open(src, "w") as tar:
        tar.add(folder, arcname="src")
    before, before_tar = (write_shards(s, tmp_path / f"b{i}", progress=False) for i, s in enumerate((folder, src)))
    (folder / "a_cls" / "dangling.jpg").symlink_to(folder / "a_cls" / "gone.jpg")
    os.mkfifo(folder / "b_cls" / "fifo.jpg")
    m = write_shards(folder, tmp_path / "out", progress=False)
    examples = "\n".join(m["skipped"]["examples"])
    assert m["skipped"]["count"] == before["skipped"]["count"] + 2 and m["num_samples"] == before["num_samples"]
    assert "a_cls/dangling.jpg: " in examples and "b_cls/fifo.jpg: not a regular file" in examples, examples
    with tarfile.open(src, "a") as tar:
        for name, kind in (("src/a_cls/fifo.jpg", tarfile.FIFOTYPE), ("src/b_cls/null.jpg", tarfile.CHRTYPE)):
            info = tarfile.TarInfo(name)
            info.type = kind
            tar.addfile(info)
    m = write_shards(src, tmp_path / "from_tar", progress=False)
    examples = "\n".join(m["skipped"]["examples"])
    assert m["skipped"]["count"] == before_tar["skipped"]["count"] + 2
    assert m["num_samples"] == before_tar["num_samples"]
    assert examples.count("not a regular file (a FIFO, socket or device)") == 2, examples


def test_a_class_folder_that_is_a_link_is_read_and_a_link_loop_ends(folder: Path, tmp_path: Path):
    """A class folder linked in from elsewhere (as subsets of a data set are often made) was
    skipped unsaid by Path.rglob, and every later class's label moved down one; it is read like
    the others. A link back to a folder above it is not followed (it would never end)."""
    before = write_shards(folder, tmp_path / "before", progress=False)
    (folder / "b_cls").rename(tmp_path / "elsewhere")
    (folder / "b_cls").symlink_to(tmp_path / "elsewhere")
    (folder / "a_cls" / "loop").symlink_to(folder)
    m = write_shards(folder, tmp_path / "out", progress=False)
    assert m["classes"] == before["classes"] == sorted(CLASSES)
    assert (m["num_samples"], m["skipped"]["count"]) == (before["num_samples"], before["skipped"]["count"])
    assert _read_shards(tmp_path / "out") == _read_shards(tmp_path / "before")  # the same images and labels


def test_a_compressed_source_is_not_held_in_memory(tmp_path: Path):
    """A .tar.gz was read whole into memory to shuffle its members; it is decompressed into a
    temporary file and read member by member, like a plain tar."""
    import tracemalloc
    src = tmp_path / "src.tar.gz"
    rng = np.random.default_rng(0)
    with tarfile.open(src, "w:gz", compresslevel=1) as tar:
        for i, data in enumerate([_image_bytes(1)] + [rng.bytes(1 << 20) for _ in range(24)]):  # 24 MiB unreadable
            info = tarfile.TarInfo(f"a_cls/{i:03d}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tracemalloc.start()
    try:
        m = write_shards(src, tmp_path / "out", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert m["num_samples"] == 1 and m["skipped"]["count"] == 24
    assert peak < 8 << 20, f"held {peak >> 20} MiB"


def test_a_link_beside_the_class_folders_decides_no_top_folder(tmp_path: Path):
    """'train/CLASS/x.jpg' takes 'train/' as the root unless images lie in it; a link there, never
    written, made it the one class of every image."""
    src = tmp_path / "src.tar"
    with tarfile.open(src, "w") as tar:
        for i, name in enumerate(("train/cat/0.jpg", "train/dog/1.jpg")):
            data = _image_bytes(i)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("train/cover.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "cat/0.jpg"
        tar.addfile(link)
    m = write_shards(src, tmp_path / "out", progress=False)
    assert m["classes"] == ["cat", "dog"] and m["num_samples"] == 2 and m["skipped"]["count"] == 1


def test_a_compressed_source_checks_the_output_first_and_says_when_its_copy_finds_no_room(folder: Path,
                                                                                        tmp_path: Path, monkeypatch):
    """The output folder is checked before decompressing; a full disk while decompressing is said
    as such, not as a damaged archive to download again."""
    import errno
    import tempfile
    src = tmp_path / "src.tar.gz"
    with tarfile.open(src, "w:gz") as tar:
        tar.add(folder, arcname="src")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    real = tempfile.TemporaryFile
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda **kw: pytest.fail("decompressed before the check"))
    with pytest.raises(ShardError, match="is not empty"):
        write_shards(src, tmp_path / "full", progress=False)

    class Full(io.BytesIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda **kw: Full())
    with pytest.raises(ShardError, match=r"no room to decompress .*src.tar.gz' into .*No space left.*free space"):
        write_shards(src, tmp_path / "out", progress=False)
    monkeypatch.setattr(tempfile, "TemporaryFile", real)
    assert write_shards(src, tmp_path / "out", progress=False)["num_samples"] > 0


def test_an_output_folder_is_a_path_never_a_url(folder: Path, tmp_path: Path, monkeypatch):
    """Each shard's path went to webdataset as a string, which it reads as a URL: an output folder
    'v2:shards' failed (no handler for 'v2:'), and one named 'pipe:...' ran a shell command."""
    monkeypatch.chdir(tmp_path)
    m = write_shards(folder, "v2:shards", samples_per_shard=5, progress=False)
    _check_round_trip(tmp_path / "v2:shards", folder, m)
    write_shards(folder, "pipe:touch PWNED;", progress=False)  # ';': the command ran whatever followed
    assert not list(tmp_path.rglob("PWNED*")) and (tmp_path / "pipe:touch PWNED;" / "manifest.json").is_file()


def test_a_folder_that_cannot_be_listed_is_refused_not_dropped(folder: Path, tmp_path: Path, monkeypatch, caplog):
    """os.walk dropped a folder it could not list without a word: its images were lost and, a
    class, every later class's label moved down one. It is an error naming the folder."""
    scandir = os.scandir
    def denied(path="."):
        if not isinstance(path, int) and Path(path) in (folder / "b_cls", folder / ".Trash-1000"):  # int: rmtree's
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)
    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(ShardError, match=f"cannot list folder '{folder / 'b_cls'}' \\(Permission denied\\)"):
        write_shards(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    # another user's trash, a disk's lost+found: no class, left out (unlabeled, a hidden folder's images count)
    (folder / "b_cls").rename(folder / ".Trash-1000")
    (folder / "lost+found").mkdir()
    m = write_shards(folder, tmp_path / "out", progress=False)
    assert m["classes"] == ["a_cls", "c_cls"] and "cannot list folder" in caplog.text
    (folder / ".Trash-1000").rename(folder / "b_cls")
    with pytest.raises(ShardError, match="cannot list folder"):
        write_shards(folder, tmp_path / "out2", unlabeled=True, progress=False)


def test_an_empty_class_folder_keeps_its_label_from_a_folder_and_a_tar(folder: Path, tmp_path: Path):
    """A truly empty class folder (a test split's) vanished from the classes, and every later
    class's label moved down one; only one holding some non-image file kept its label."""
    shutil.rmtree(folder / CLASSES[1])
    (folder / CLASSES[1]).mkdir()
    (folder / "loose.jpg").unlink()  # an image beside the class folders: the tar's 'src/' would be the class
    src = tmp_path / "src.tar"
    with tarfile.open(src, "w") as tar:
        tar.add(folder, arcname="src")
    for i, source in enumerate((folder, src)):
        m = write_shards(source, tmp_path / f"out{i}", progress=False)
        assert m["classes"] == CLASSES
        assert {lab for s in json.loads((tmp_path / f"out{i}" / "labels.json").read_text()) for _, lab in s} == {0, 2}


def test_a_path_stored_twice_writes_the_later_under_its_own_key(tmp_path: Path):
    """'/a/x.jpg' and 'a/x.jpg' (or './a/x.jpg') are one path to extracting the tar: the earlier
    is skipped as replaced (the absolute spelling was written too), and the one written takes the
    path's key, as from a folder ('a/x', not 'a/x_2')."""
    first, later = _image_bytes(1), _image_bytes(2)
    for spelling in ("/a_cls/x.jpg", "./a_cls/x.jpg"):
        src = tmp_path / "src.tar"
        with tarfile.open(src, "w") as tar:
            for name, data in ((spelling, first), ("a_cls/x.jpg", later), ("b_cls/y.jpg", first)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        m = write_shards(src, tmp_path / "out", progress=False)
        assert (m["num_samples"], m["skipped"]["count"]) == (2, 1), m["skipped"]
        assert dict(s for shard in _read_shards(tmp_path / "out") for s in shard)["a_cls/x"]["jpg"] == later


def test_a_cut_compressed_tar_and_a_pipe_source_are_refused_in_one_line(folder: Path, tmp_path: Path):
    """A .tar.gz cut inside its first block raised EOFError from tarfile.open (a traceback); a
    pipe given as the source (<(tar c ...)) was reported as missing."""
    src = tmp_path / "src.tar.gz"
    with tarfile.open(src, "w:gz") as tar:
        tar.add(folder, arcname="src")
    (tmp_path / "cut.tar.gz").write_bytes(src.read_bytes()[:60])
    with pytest.raises(ShardError, match="cut.tar.gz' is neither a folder nor a readable tar archive"):
        write_shards(tmp_path / "cut.tar.gz", tmp_path / "o1", progress=False)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ShardError, match="fifo' is neither a folder nor a regular file"):
        write_shards(tmp_path / "fifo", tmp_path / "o2", progress=False)


def test_the_pixel_limit_keeps_an_image_of_exactly_max_pixels_and_skips_one_pixel_more(tmp_path: Path):
    """`max_pixels` is the most an image may have: one of exactly that many is written, one a pixel
    larger is skipped and counted as too large (the loader would refuse it and count it corrupt)."""
    from mpp.data.writer import write_samples
    exact, over = _image_bytes(1, "PNG", size=(12, 10)), _image_bytes(2, "PNG", size=(11, 11))
    items = [(name, lambda data=data: data, None) for name, data in (("exact.png", exact), ("over.png", over))]
    m = write_samples(items, tmp_path / "out", classes=None, max_pixels=120, progress=False)
    assert m["num_samples"] == 1 and m["skipped"]["examples"] == ["over.png: too large (11x11 pixels, limit 120)"]
    assert [fields["png"] for shard in _read_shards(tmp_path / "out") for _, fields in shard] == [exact]


def test_an_image_cut_inside_its_pixel_data_is_skipped_though_its_header_opens(tmp_path: Path):
    """A PNG or JPEG cut short after an intact header (an interrupted copy) opens, and only decoding
    finds it short: it is skipped and counted, never written for the loader to fail on."""
    root = tmp_path / "src"
    (root / "a_cls").mkdir(parents=True)
    for fmt, ext in (("PNG", "png"), ("JPEG", "jpg")):
        good = _image_bytes(3, fmt, size=(64, 64))
        cut = good[: len(good) * 3 // 4]
        with Image.open(io.BytesIO(cut)) as im:  # the header is intact: only the pixels are missing
            assert im.size == (64, 64)
        (root / "a_cls" / f"cut.{ext}").write_bytes(cut)
        (root / "a_cls" / f"good.{ext}").write_bytes(good)
    m = write_shards(root, tmp_path / "out", progress=False)
    assert m["num_samples"] == 2 and m["skipped"]["count"] == 2
    assert sorted(e.split(":")[0] for e in m["skipped"]["examples"]) == ["a_cls/cut.jpg", "a_cls/cut.png"]
    assert sorted(k for shard in _read_shards(tmp_path / "out") for k, _ in shard) == ["a_cls/good", "a_cls/good_2"]


def test_an_overwrite_never_leaves_a_manifest_beside_shards_it_does_not_describe(folder: Path, tmp_path: Path,
                                                                                  monkeypatch):
    """Replacing a data set, the old manifest is moved out before its shards and the new one in
    after its shards: a writer killed at any move leaves no manifest naming shards (or sizes) that
    are not there, which a reader would trust."""
    out = tmp_path / "out"
    write_shards(folder, out, samples_per_shard=4, progress=False)  # 6 shards, replaced by 2 of other sizes
    wrong = []
    real = os.rename

    def rename(src, dst):
        real(src, dst)
        if (out / "manifest.json").exists():
            shards = json.loads((out / "manifest.json").read_text())["shards"]
            if any(not (out / s["name"]).is_file() or (out / s["name"]).stat().st_size != s["bytes"]
                   for s in shards):
                wrong.append(f"after moving {Path(src).name} to {dst}")
    monkeypatch.setattr(os, "rename", rename)
    m = write_shards(folder, out, samples_per_shard=15, overwrite=True, progress=False)
    assert not wrong, wrong
    assert len(m["shards"]) == 2 and sorted(p.name for p in out.iterdir() if p.suffix == ".tar") == [
        "000000.tar", "000001.tar"]


def test_with_unlabeled_a_hidden_or_lost_found_folder_that_cannot_be_listed_is_refused(folder: Path, tmp_path: Path,
                                                                                        monkeypatch):
    """Unlabeled, every image anywhere is a sample, a hidden folder's or lost+found's too: one that
    cannot be listed is an error naming it, not a warning while its images are silently left out."""
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.jpg").write_bytes(_image_bytes(5))
    (folder / "lost+found").mkdir()
    scandir = os.scandir
    for name in (".cache", "lost+found"):
        def denied(path=".", name=name):
            if not isinstance(path, int) and Path(path) == folder / name:  # int: rmtree's
                raise PermissionError(13, "Permission denied", str(path))
            return scandir(path)
        monkeypatch.setattr(os, "scandir", denied)
        with pytest.raises(ShardError, match=re.escape(f"cannot list folder '{folder / name}' (Permission denied)")):
            write_shards(folder, tmp_path / "out", unlabeled=True, progress=False)
        assert not (tmp_path / "out").exists()


def test_a_file_of_exactly_the_members_limit_is_written_and_one_byte_more_skipped(tmp_path: Path, monkeypatch):
    """`MAX_MEMBER` is the most a shard member may hold (what the loader reads): a file of exactly
    that size is written, one a byte larger skipped and counted (written, the loader would lose
    the rest of its shard)."""
    import mpp.data.writer
    data = _image_bytes(4, size=(40, 40))
    (tmp_path / "src" / "a_cls").mkdir(parents=True)
    (tmp_path / "src" / "a_cls" / "x.jpg").write_bytes(data)
    monkeypatch.setattr(mpp.data.writer, "MAX_MEMBER", len(data))
    assert write_shards(tmp_path / "src", tmp_path / "out", progress=False)["num_samples"] == 1
    monkeypatch.setattr(mpp.data.writer, "MAX_MEMBER", len(data) - 1)
    with pytest.raises(ShardError, match=f"x.jpg: {len(data)} bytes, past the 0 MiB a shard member may hold"):
        write_shards(tmp_path / "src", tmp_path / "out2", progress=False)


def _tar_of(path: Path, members: dict[str, bytes], **pax: dict[str, str]) -> Path:
    """A tar at `path` of name -> bytes (PAX headers per name from `pax`)."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax.get(name, {})
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_top_folder_with_images_beside_its_class_folders_is_the_class_not_the_root(tmp_path: Path):
    """'train/CLASS/x.jpg' takes 'train/' as the root only when no image lies in 'train/' itself:
    one that does would be dropped as outside any class folder, so 'train' is then the class."""
    src = _tar_of(tmp_path / "src.tar", {n: _image_bytes(i) for i, n in enumerate(
        ("train/cat/0.jpg", "train/dog/1.jpg", "train/2.jpg"))})
    m = write_shards(src, tmp_path / "out", progress=False)
    assert m["classes"] == ["train"] and (m["num_samples"], m["skipped"]["count"]) == (3, 0)


def test_an_archive_of_absolute_paths_takes_classes_from_their_first_folder(tmp_path: Path):
    """Members stored as '/a_cls/x.jpg' (tar -P) are the paths extracting would write, 'a_cls/x.jpg':
    their class is 'a_cls' and their keys the same as from a folder; an image at '/' is outside any."""
    src = _tar_of(tmp_path / "src.tar", {n: _image_bytes(i) for i, n in enumerate(
        ("/a_cls/0.jpg", "/b_cls/1.jpg", "/b_cls/2.jpg", "/cover.jpg"))})
    m = write_shards(src, tmp_path / "out", progress=False)
    assert m["classes"] == ["a_cls", "b_cls"] and m["skipped"]["examples"] == ["cover.jpg: outside any class folder"]
    assert sorted((k, int(f["cls"])) for shard in _read_shards(tmp_path / "out") for k, f in shard) == [
        ("a_cls/0", 0), ("b_cls/1", 1), ("b_cls/2", 1)]


def test_a_sparse_archive_member_is_skipped_and_counted_whatever_its_size(tmp_path: Path):
    """A sparse member (GNU sparse map) is never read, however small it declares itself: a small
    archive can declare huge sparse files. It is skipped and counted, the others are written."""
    data = _image_bytes(6)
    src = _tar_of(tmp_path / "src.tar", {"a_cls/sparse.jpg": data, "a_cls/plain.jpg": _image_bytes(7)},
                  **{"a_cls/sparse.jpg": {"GNU.sparse.map": f"0,{len(data)}", "GNU.sparse.size": str(len(data))}})
    with tarfile.open(src) as tar:
        assert tar.getmember("a_cls/sparse.jpg").issparse()
    m = write_shards(src, tmp_path / "out", progress=False)
    assert m["num_samples"] == 1 and m["skipped"]["examples"] == [
        "a_cls/sparse.jpg: a sparse file, which make_shards does not read; store it without --sparse"]


def test_an_output_folder_inside_the_source_folder_is_refused(folder: Path):
    """Shards written inside the source would be read as a class folder of images by the next run
    on that source; refused before anything is written."""
    for out in (folder / "shards", folder / "a_cls" / "shards"):
        with pytest.raises(ShardError, match="lies inside the source folder"):
            write_shards(folder, out, progress=False)
        assert not out.exists()
