"""Test helper: a labeled data set a micro ViT learns in a few steps (the class of a noisy image is
its dominant colour channel), written with mpp.data.writer so it has a label index for subsets."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from mpp.data.writer import write_samples


def write_colours(out: Path, sizes=(("train", 256), ("val", 96))) -> Path:
    """out/<split>/ shards + manifest; item i (key '{i:04d}') has class i % 3 (red, green, blue)."""
    rng = np.random.default_rng(0)

    def png(label: int) -> bytes:
        pixels = rng.integers(0, 90, (32, 32, 3))
        pixels[..., label] += 140
        buf = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
        return buf.getvalue()
    for split, n in sizes:
        items = [(f"{i:04d}.png", lambda b=png(i % 3): b, i % 3) for i in range(n)]
        write_samples(items, out / split, classes=["red", "green", "blue"], samples_per_shard=64 if n > 96 else 24,
                      progress=False)
    return out
