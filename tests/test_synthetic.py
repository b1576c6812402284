"""The embedded synthetic data set: deterministic, balanced, distinct classes, reusable output."""
from __future__ import annotations

import io
import json
import re
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mpp.data.synthetic import CLASSES, _object_mask, make_synthetic, render
from mpp.data.writer import ShardError


def test_render_deterministic_per_seed_and_split():
    a, la = render(7, seed=1)
    b, lb = render(7, seed=1)
    assert la == lb == 7 and np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(render(7, seed=2)[0]))
    assert not np.array_equal(np.asarray(a), np.asarray(render(7, seed=1, split="test")[0]))
    big, _ = render(7, seed=1, size=64)
    assert a.size == (32, 32) and a.mode == "RGB" and big.size == (64, 64)


@pytest.mark.parametrize("label", range(len(CLASSES)))
def test_each_class_draws_a_visible_foreground(label: int):
    for i in range(5):
        alpha = _object_mask(label, np.random.default_rng(i), 64)
        assert 0.03 < alpha.mean() < 0.8, CLASSES[label]  # present, not the whole image
    img = np.asarray(render(label)[0], np.float32)
    assert img.std() > 10  # foreground contrasts with background


def test_classes_differ():
    """Masks drawn from the same random numbers differ between any two classes."""
    masks = [_object_mask(c, np.random.default_rng(0), 64) for c in range(len(CLASSES))]
    for a in range(len(CLASSES)):
        for b in range(a + 1, len(CLASSES)):
            assert np.abs(masks[a] - masks[b]).mean() > 0.01, (CLASSES[a], CLASSES[b])


def _labels_and_images(split_dir: Path) -> tuple[list[int], list[bytes]]:
    labels, images = [], []
    manifest = json.loads((split_dir / "manifest.json").read_text())
    for s in manifest["shards"]:
        with tarfile.open(split_dir / s["name"]) as tar:
            for m in tar.getmembers():
                data = tar.extractfile(m).read()
                (labels.append(int(data)) if m.name.endswith(".cls") else images.append(data))
    return labels, images


def test_make_synthetic_shards(tmp_path: Path):
    ms = make_synthetic(tmp_path / "a", train=100, test=30, shards=4, seed=3, progress=False)
    assert ms["train"]["num_samples"] == 100 and ms["test"]["num_samples"] == 30
    assert ms["train"]["classes"] == CLASSES and len(ms["test"]["shards"]) == 4
    labels, images = _labels_and_images(tmp_path / "a" / "train")
    assert Counter(labels) == {c: 10 for c in range(10)}  # balanced
    assert len(labels) == len(images) == 100 and len(set(images)) == 100
    assert labels[:10] != sorted(labels[:10])  # shuffled order
    assert all(Image.open(io.BytesIO(b)).format == "JPEG" and Image.open(io.BytesIO(b)).size == (32, 32)
               for b in images)
    # same seed: byte-identical shards
    make_synthetic(tmp_path / "b", train=100, test=30, shards=4, seed=3, progress=False)
    for split in ("train", "test"):
        for s in ms[split]["shards"]:
            assert ((tmp_path / "a" / split / s["name"]).read_bytes()
                    == (tmp_path / "b" / split / s["name"]).read_bytes())


def test_make_synthetic_reuses_same_settings_refuses_others(tmp_path: Path):
    make_synthetic(tmp_path, train=20, test=10, shards=2, progress=False)
    shard = tmp_path / "train" / "000000.tar"
    stamp = shard.stat().st_mtime_ns
    make_synthetic(tmp_path, train=20, test=10, shards=2, progress=False)
    assert shard.stat().st_mtime_ns == stamp  # reused, not rewritten
    for other, what in ((dict(train=30, shards=2), "num 20, not 30"),  # more images, or more shards
                        (dict(train=20, shards=4), "samples_per_shard 10, not 5")):
        with pytest.raises(ShardError, match=f"holds a synthetic set made with other settings \\({what}[;)]"):
            make_synthetic(tmp_path, **other, test=10, progress=False)
    ms = make_synthetic(tmp_path, train=30, test=10, shards=2, overwrite=True, progress=False)
    assert ms["train"]["num_samples"] == 30
    ms = make_synthetic(tmp_path, train=30, test=10, shards=3, overwrite=True, progress=False)
    assert len(ms["train"]["shards"]) == 3 and ms["train"]["made"]["shards"] == 3
    manifest = tmp_path / "train" / "manifest.json"  # as an older mpp wrote it: its samples per shard are checked
    ms["train"]["made"].pop("shards")
    manifest.write_text(json.dumps(ms["train"]))
    stamp = shard.stat().st_mtime_ns
    make_synthetic(tmp_path, train=30, test=10, shards=3, progress=False)
    assert shard.stat().st_mtime_ns == stamp  # reused


def test_a_damaged_split_is_written_again_not_reused(tmp_path: Path, caplog):
    """A rerun reused a split whose shard had been cut short or removed, or whose labels.json was
    edited, and said it was done: the reader refused it later (and named make_shards). The same
    images are written again, with a warning."""
    from mpp.data.sources import resolve
    first = make_synthetic(tmp_path, train=20, test=0, shards=2, progress=False)["train"]
    shard, labels = tmp_path / "train" / "000001.tar", tmp_path / "train" / "labels.json"
    whole = shard.read_bytes()
    for damage in (lambda: shard.write_bytes(whole[: len(whole) // 2]), shard.unlink,
                   lambda: labels.write_text("[]")):
        damage()
        again = make_synthetic(tmp_path, train=20, test=0, shards=2, progress=False)["train"]
        assert "writing the same images again" in caplog.text and shard.read_bytes() == whole
        assert again["labels_sha256"] == first["labels_sha256"] and resolve(str(tmp_path / "train/manifest.json"))
        caplog.clear()


@pytest.mark.parametrize("text, problem", [("[1, 2]", "is JSON but not an object"),
                                           ('{"made": ', "is not valid JSON"),
                                           ('{"made": [1]}', None)])  # an object, not one of ours: refused
def test_make_synthetic_over_a_foreign_manifest_says_what_to_do(tmp_path: Path, text: str, problem: str | None):
    """A split's manifest that is not the object this module writes is one ShardError naming the
    file and the fix (not a traceback, not a JSON message alone); --overwrite replaces the split."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "manifest.json").write_text(text)
    message = "not empty" if problem is None else re.escape(
        f"manifest '{tmp_path / 'train' / 'manifest.json'}' {problem}") + r".*; delete it or overwrite the split"
    with pytest.raises(ShardError, match=message):
        make_synthetic(tmp_path, train=10, test=0, shards=1, progress=False)
    ms = make_synthetic(tmp_path, train=10, test=0, shards=1, overwrite=True, progress=False)
    assert ms["train"]["num_samples"] == 10


def test_the_tool_gives_its_settings_to_the_generator(tmp_path: Path):
    from mpp.tools.make_synthetic import main
    main([str(tmp_path / "tool"), "--train", "12", "--test", "0", "--shards", "2", "--size", "16", "--seed", "4"])
    make_synthetic(tmp_path / "lib", train=12, test=0, shards=2, size=16, seed=4, progress=False)
    make_synthetic(tmp_path / "seed0", train=12, test=0, shards=2, size=16, progress=False)
    for shard in ("000000.tar", "000001.tar"):
        tool = (tmp_path / "tool/train" / shard).read_bytes()
        assert tool == (tmp_path / "lib/train" / shard).read_bytes() != (tmp_path / "seed0/train" / shard).read_bytes()
