"""Test helper: small WebDataset shards + manifest.json written directly with webdataset.TarWriter
(independent of mpp.data.writer), with the source pixels and labels to compare against."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image


def encode(pixels: np.ndarray, fmt: str = "png", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kw)
    return buf.getvalue()


def write_shards(root, sizes, *, classes: int | None = 3, size: int = 16, fmt: str = "png",
                 seed: int = 0, extra=None) -> tuple[str, dict]:
    """Shards root/000000.tar... with sizes[i] samples each (key 's{i}_{j}', PNG/JPEG image,
    'cls' = running index % classes unless classes is None) and a manifest. `extra(shard, j)` may
    return members to add to/override a sample (value None removes one). Returns (manifest path,
    {key: (label, HxWx3 uint8 pixels)})."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    source, shards, n = {}, [], 0
    for s, count in enumerate(sizes):
        name = f"{s:06d}.tar"
        with wds.TarWriter(str(root / name)) as w:
            for j in range(count):
                key = f"s{s}_{j}"
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                sample = {"__key__": key, fmt: encode(pixels, fmt)}
                label = None
                if classes:
                    label = n % classes
                    sample["cls"] = str(label).encode()
                for k, v in (extra(s, j) if extra else {}).items():
                    if v is None:
                        sample.pop(k, None)
                    else:
                        sample[k] = v
                w.write(sample)
                source[key] = (label, pixels)
                n += 1
        shards.append({"name": name, "num_samples": count})
    manifest = {"num_samples": n, "shards": shards,
                "classes": [f"c{i}" for i in range(classes)] if classes else []}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root / "manifest.json"), source
