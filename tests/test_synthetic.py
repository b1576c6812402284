"""The embedded synthetic data set: deterministic, balanced, distinct classes, reusable output."""
from __future__ import annotations

import colorsys
import io
import json
import math
import re
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mpp.data.synthetic import CLASSES, JPEG_QUALITY, _colours, _object_mask, make_synthetic, render
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



def _second_direction(mask: np.ndarray) -> float:
    """The strongest frequency of `mask` at more than 30 degrees from its strongest one, as a share
    of it (power of the Hann-windowed 2-D FFT, the lowest frequencies left out): near 0 for a
    pattern that varies one way (stripes), near 1 for one that varies two ways."""
    w = mask.shape[0]
    window = np.outer(np.hanning(w), np.hanning(w))
    power = np.abs(np.fft.fftshift(np.fft.fft2((mask - mask.mean()) * window))) ** 2
    ky, kx = np.meshgrid(np.arange(w) - w // 2, np.arange(w) - w // 2, indexing="ij")
    power[(np.abs(kx) <= 1) & (np.abs(ky) <= 1)] = 0
    peak = np.unravel_index(power.argmax(), power.shape)
    cos = np.abs(kx * kx[peak] + ky * ky[peak]) / (np.hypot(kx, ky) * np.hypot(kx[peak], ky[peak]) + 1e-9)
    return float(power[cos < math.cos(math.radians(30))].max() / power.max())


def test_stripes_vary_one_way_and_a_checkerboard_and_dots_two():
    """Three texture classes must stay three: a checkerboard drawn as floor(u/p) % 2 alone is a
    second stripes class, which `test_classes_differ` lets pass (its periods differ)."""
    for seed in range(20):
        second = {name: _second_direction(_object_mask(CLASSES.index(name), np.random.default_rng(seed), 64))
                  for name in ("stripes", "checkerboard", "dots")}
        assert second["stripes"] < 0.2 < 0.5 < min(second["checkerboard"], second["dots"]), (seed, second)

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


def test_the_tools_defaults_and_overwrite_reach_the_generator(tmp_path: Path, monkeypatch, capsys):
    """A bare make_synthetic writes with the defaults its --help names; --overwrite reaches it."""
    from mpp.tools import make_synthetic as tool
    seen = []
    monkeypatch.setattr(tool, "make_synthetic", lambda out, **kw: seen.append(kw) or {})
    tool.main([str(tmp_path / "a")])
    tool.main([str(tmp_path / "b"), "--overwrite"])
    defaults = dict(train=5000, test=1000, size=32, seed=0, shards=8)
    assert seen == [dict(defaults, overwrite=False), dict(defaults, overwrite=True)]
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{what} (default {n})" in text for what, n in (("training images", 5000), ("test images", 1000),
                                                               ("pixels", 32), ("per split", 8)))


def test_each_written_label_is_the_class_its_image_draws(tmp_path: Path):
    """The writer labels sample i with i % 10 apart from render's own label: were the two to part,
    every image would be trained on another class's label and nothing could be learnt. Each
    member's label is render's for its index, and its image is render's image, as JPEG."""
    make_synthetic(tmp_path, train=12, test=0, shards=2, progress=False)
    seen = {}
    for shard in ("000000.tar", "000001.tar"):
        with tarfile.open(tmp_path / "train" / shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                seen.setdefault(int(key), {})[ext] = tar.extractfile(m).read()
    assert sorted(seen) == list(range(12))
    for i, sample in seen.items():
        drawn, label = render(i)
        assert int(sample["cls"]) == label == i % len(CLASSES)
        jpeg = io.BytesIO()
        drawn.save(jpeg, "JPEG", quality=JPEG_QUALITY)
        assert sample["jpg"] == jpeg.getvalue(), i


@pytest.mark.parametrize("other, what", [(dict(seed=1), "seed 0, not 1"), (dict(size=16), "size 8, not 16")])
def test_a_set_of_another_seed_or_image_size_is_refused_not_reused(tmp_path: Path, other: dict, what: str):
    """A folder made with seed 0 at 8 px, asked for another seed or size, was reused as if it held
    the images asked for (other images, or images of the wrong size for the model's patches)."""
    make_synthetic(tmp_path, train=10, test=0, shards=1, size=8, progress=False)
    with pytest.raises(ShardError, match=f"other settings \\({what}\\)"):
        make_synthetic(tmp_path, train=10, test=0, shards=1, **{"size": 8, **other}, progress=False)


@pytest.mark.parametrize("label, area", [(0, math.pi), (1, 2.0), (2, 3 * math.sqrt(3) / 4)])
def test_circles_squares_and_triangles_keep_their_form_at_every_size_and_turn(label: int, area: float):
    """Area over squared circumradius is the form alone (pi, 2 and 1.30): a triangle drawn with a
    fourth corner would be a square under another name, two classes nothing can tell apart."""
    for i in range(10):
        mask = _object_mask(label, np.random.default_rng(i), 64) > 0.5
        ys, xs = np.nonzero(mask)
        r2 = ((xs - xs.mean()) ** 2 + (ys - ys.mean()) ** 2).max()
        assert abs(mask.sum() / r2 - area) < 0.2, (CLASSES[label], i)


def test_the_foreground_hue_is_far_from_the_backgrounds():
    """Shapes stand out by hue as well as lightness (a quarter turn of the colour wheel at least),
    so that the class is visible in the colours a masked patch predicts."""
    for i in range(100):
        bg, _, fg = _colours(np.random.default_rng(i))
        turn = abs(colorsys.rgb_to_hsv(*bg / 255)[0] - colorsys.rgb_to_hsv(*fg / 255)[0])
        assert min(turn, 1 - turn) > 0.24, i


def test_no_shards_is_refused_as_a_value_error(tmp_path: Path):
    """--shards 0 is a bad setting, said as such, not a ZeroDivisionError from the split's sizing."""
    with pytest.raises(ValueError, match="shards >= 1"):
        make_synthetic(tmp_path, train=10, test=0, shards=0, progress=False)
