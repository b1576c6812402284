"""The embedded default data set: 10 classes of procedurally drawn shapes and textures.

The project ships no third-party images, so tests and the default job use these. Each image has
one colour scheme: a background in one colour family (flat, a linear gradient or low-frequency
"clouds", plus fine noise) and a foreground colour of a clearly different hue, lightly shaded.
The class is the foreground's form: six objects (circle, square, triangle, star, cross, ring) of
random position, size and rotation, three textures that continue over the whole image (stripes,
checkerboard, dots; random period, angle and phase) and a soft-edged blob. Patch colours are thus
predictable from context (colours repeat within an image, shapes and textures continue across
patches), which is what masked patch prediction learns from, while colours say nothing about
the class.

Image `i` of a split depends only on (seed, split, i), so sets of different sizes share their
first images; labels are `i % 10` (balanced), written in a seeded shuffled order as JPEG shards
with manifests at OUT/train and OUT/test (see mpp.data.writer).
"""
from __future__ import annotations

import colorsys
import functools
import io
import json
import logging
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mpp.data.decode import DataError
from mpp.data.sources import resolve
from mpp.data.subset import read_label_index
from mpp.data.writer import MANIFEST, ShardError, write_samples

log = logging.getLogger(__name__)

CLASSES = ["circle", "square", "triangle", "star", "cross", "ring", "stripes", "checkerboard", "dots", "blob"]
SPLITS = {"train": 0, "test": 1}
JPEG_QUALITY = 90
_SS = 2  # supersampling factor: draw at 2x and reduce, for anti-aliased edges


@functools.lru_cache(maxsize=4)
def _grid(w: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [0, 1), (w, w) each."""
    c = (np.arange(w, dtype=np.float32) + 0.5) / w
    return np.meshgrid(c, c)  # x, y


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Background colour, a near variant of it, and a foreground of a different hue (RGB 0-255)."""
    h = rng.random()
    s_bg, v_bg = rng.uniform(0.2, 0.9), rng.uniform(0.25, 0.95)
    bg = np.array(colorsys.hsv_to_rgb(h, s_bg, v_bg))
    bg2 = np.array(colorsys.hsv_to_rgb((h + rng.uniform(-0.06, 0.06)) % 1, s_bg,
                                       np.clip(v_bg + rng.uniform(-0.3, 0.3), 0.1, 1)))
    v_fg = rng.uniform(0.15, 0.45) if v_bg > 0.6 else rng.uniform(0.7, 1.0)  # contrast in lightness too
    fg = np.array(colorsys.hsv_to_rgb((h + rng.uniform(0.25, 0.75)) % 1, rng.uniform(0.5, 1.0), v_fg))
    return tuple((c * 255).astype(np.float32) for c in (bg, bg2, fg))


def _background(rng: np.random.Generator, c1: np.ndarray, c2: np.ndarray, w: int) -> np.ndarray:
    x, y = _grid(w)
    kind = rng.integers(3)
    if kind == 0:    # flat
        return np.broadcast_to(c1, (w, w, 3))
    if kind == 1:    # linear gradient at a random angle
        a = rng.uniform(0, 2 * math.pi)
        t = (x - 0.5) * math.cos(a) + (y - 0.5) * math.sin(a) + 0.5
    else:            # low-frequency clouds
        coarse = Image.fromarray((rng.random((4, 4)) * 255).astype(np.uint8))
        t = np.asarray(coarse.resize((w, w), Image.BICUBIC), np.float32) / 255
    return c1 + t[..., None] * (c2 - c1)


def _polygon(cx: float, cy: float, radii: list[float], rot: float) -> list[tuple[float, float]]:
    """Vertices at equal angular steps with the given radii, rotated by `rot` radians."""
    n = len(radii)
    return [(cx + r * math.cos(rot + 2 * math.pi * k / n), cy + r * math.sin(rot + 2 * math.pi * k / n))
            for k, r in enumerate(radii)]


def _object_mask(label: int, rng: np.random.Generator, w: int) -> np.ndarray:
    """Alpha (w, w) in [0, 1] of the foreground of class `label`."""
    x, y = _grid(w)
    rot = rng.uniform(0, 2 * math.pi)
    name = CLASSES[label]
    if name in ("stripes", "checkerboard", "dots"):
        u = x * math.cos(rot) + y * math.sin(rot) + rng.random()
        v = -x * math.sin(rot) + y * math.cos(rot) + rng.random()
        if name == "stripes":
            p = rng.uniform(0.18, 0.35)
            return ((u / p) % 1 < 0.5).astype(np.float32)
        if name == "checkerboard":
            p = rng.uniform(0.15, 0.3)
            return ((np.floor(u / p) + np.floor(v / p)) % 2).astype(np.float32)
        p = rng.uniform(0.2, 0.33)
        return ((((u / p) % 1 - 0.5) ** 2 + ((v / p) % 1 - 0.5) ** 2) < 0.3 ** 2).astype(np.float32)
    cx, cy = rng.uniform(0.3, 0.7, 2)
    r = rng.uniform(0.18, 0.36)
    if name == "blob":
        sx, sy = r * rng.uniform(0.5, 0.9), r * rng.uniform(0.3, 0.7)
        u = (x - cx) * math.cos(rot) + (y - cy) * math.sin(rot)
        v = -(x - cx) * math.sin(rot) + (y - cy) * math.cos(rot)
        return np.exp(-0.5 * ((u / sx) ** 2 + (v / sy) ** 2)).astype(np.float32)
    mask = Image.new("L", (w, w), 0)
    draw = ImageDraw.Draw(mask)
    cx, cy, r = cx * w, cy * w, r * w
    if name == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    elif name == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=255, width=max(2, round(0.4 * r)))
    elif name == "square":
        draw.polygon(_polygon(cx, cy, [1.25 * r] * 4, rot), fill=255)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, [1.35 * r] * 3, rot), fill=255)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, [1.35 * r, 0.55 * r] * 5, rot), fill=255)
    else:  # cross: a plus of two bars, as one 12-vertex outline
        a, b = 1.25 * r, 0.38 * r
        pts = [(b, a), (b, b), (a, b), (a, -b), (b, -b), (b, -a),
               (-b, -a), (-b, -b), (-a, -b), (-a, b), (-b, b), (-b, a)]
        c, s = math.cos(rot), math.sin(rot)
        draw.polygon([(cx + px * c - py * s, cy + px * s + py * c) for px, py in pts], fill=255)
    return np.asarray(mask, np.float32) / 255


def render(index: int, *, seed: int = 0, split: str = "train", size: int = 32) -> tuple[Image.Image, int]:
    """Image `index` of `split` (RGB, size x size) and its label; a pure function of its arguments."""
    label = index % len(CLASSES)
    rng = np.random.default_rng([seed, SPLITS[split], index])
    w = size * _SS
    bg, bg2, fg = _colours(rng)
    back = _background(rng, bg, bg2, w)
    x, y = _grid(w)
    a = rng.uniform(0, 2 * math.pi)
    shade = 1 + 0.3 * ((x - 0.5) * math.cos(a) + (y - 0.5) * math.sin(a))  # light from one side
    alpha = _object_mask(label, rng, w)[..., None]
    img = back * (1 - alpha) + (fg * shade[..., None]) * alpha
    img = sum(img[i::_SS, j::_SS] for i in range(_SS) for j in range(_SS)) / _SS ** 2  # anti-aliasing
    img += rng.standard_normal((size, size, 3), dtype=np.float32) * 5  # sensor-like noise
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)), label


def _jpeg(index: int, seed: int, split: str, size: int) -> bytes:
    buf = io.BytesIO()
    render(index, seed=seed, split=split, size=size)[0].save(buf, "JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def _manifest(path: Path) -> dict:
    """An existing split's manifest; a file that is not a JSON object is refused in one line that
    names it and the fix, not met with a traceback further on."""
    fix = "delete it or overwrite the split (--overwrite)"
    try:
        old = json.loads(path.read_text())
    except ValueError as e:  # malformed JSON, or not UTF-8
        raise ShardError(f"manifest '{path}' is not valid JSON ({e}); {fix}") from None
    if not isinstance(old, dict):
        raise ShardError(f"manifest '{path}' is JSON but not an object; {fix}")
    return old


class OtherSettings(ShardError):
    """A split's folder holds a synthetic set made with other settings (`other`: which, as text)."""

    def __init__(self, path: Path, other: str):
        super().__init__(f"'{path}' holds a synthetic set made with other settings ({other}); give another folder, "
                         "or delete it (make_synthetic: or --overwrite)")
        self.path, self.other = path, other


def make_synthetic(out: str | Path, *, train: int = 5000, test: int = 1000, size: int = 32, seed: int = 0,
                   shards: int = 8, overwrite: bool = False, progress: bool = True) -> dict[str, dict]:
    """Write OUT/train and OUT/test (shards + manifest, `shards` shards per split); returns the
    manifests by split. A split whose manifest already records the same parameters (and so the
    same samples per shard) is reused; one made with others is refused unless `overwrite`."""
    if size < 8 or train < 0 or test < 0 or shards < 1 or train + test == 0:
        raise ValueError("synthetic data needs size >= 8, train/test >= 0 (not both 0) and shards >= 1")
    manifests = {}
    for split, n in (("train", train), ("test", test)):
        if n == 0:
            continue
        params = {"generator": "mpp.data.synthetic", "split": split, "num": n, "size": size,
                  "jpeg_quality": JPEG_QUALITY}
        per_shard = -(-n // shards)  # what `shards` changes; every manifest records it, older ones too
        path = Path(out) / split
        again = overwrite or not (path / MANIFEST).is_file()  # a write cut off before its manifest: no set there
        if not again:
            old = _manifest(path / MANIFEST)
            made = old.get("made") if isinstance(old.get("made"), dict) else {}
            wanted = {**params, "seed": seed, "samples_per_shard": per_shard}
            other = "; ".join(f"{k} {made.get(k)!r}, not {v!r}" for k, v in wanted.items() if made.get(k) != v)
            if not other:
                if not (damage := _damage(path)):
                    manifests[split] = old
                    continue
                log.warning("warning: %s (%s): writing the same images again", path, damage)
                again = True
            elif made.get("generator") == params["generator"]:  # else not ours: the writer's refusal below
                raise OtherSettings(path, other)
        items = [(f"{i:06d}.jpg", functools.partial(_jpeg, i, seed, split, size), i % len(CLASSES)) for i in range(n)]
        manifests[split] = write_samples(items, path, classes=list(CLASSES), seed=seed,
                                         made={**params, "shards": shards}, samples_per_shard=per_shard,
                                         progress=progress, overwrite=again)
    return manifests


def _damage(path: Path) -> str | None:
    """Why a split's shards or label index no longer match its manifest (a shard cut short or
    removed, labels.json edited), as the reader refuses them; None when they match."""
    try:
        shards = resolve(str(path / MANIFEST))
        if shards.labels:
            read_label_index(shards)
    except DataError as e:
        return " ".join(str(e).split())
    return None
