"""Safe sample decoding: one image (PIL, image formats only, pixel cap) and an integer label.

No other shard member is ever decoded: webdataset's default decoder unpickles `.pyd`/`.pickle`
members, which would run code from a shard, so it is not used at all. Bad samples are skipped and
counted by kind in a plain dict (`SKIP_KINDS` says what each kind means); a labeled loader given
unlabeled data raises `DataError` instead, because training on it cannot be right.
"""
from __future__ import annotations

import io
import random
import struct
from typing import Callable

import torch
from PIL import Image

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
PIL_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "PPM", "TIFF")

SKIP_KINDS = {
    "corrupt_image": "image bytes that do not decode, are truncated, or exceed data.max_pixels",
    "missing_image": "sample without an image member (e.g. only non-image members)",
    "bad_label": "'cls' that is not an integer in [0, number of classes)",
    "truncated_tar": "shard that ends mid-archive (its last, possibly incomplete sample is dropped)",
    "unreadable_shard": "shard that could not be opened, read or parsed (the rest of it is lost)",
    "padded": "repeated samples that filled a rank's last batches after skips left it short",
    "dropped": "samples beyond a rank's expected count (shards without exact counts in a manifest)",
}
# what PIL raises on corrupt, truncated or hostile bytes (a bug in our code still raises)
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, ZeroDivisionError, struct.error,
                Image.DecompressionBombError)
SAMPLE_SKIPS = ("corrupt_image", "missing_image", "bad_label")  # kinds that are one sample each


class DataError(ValueError):
    """A data problem that must stop the run; the message says what is wrong and what to do."""


def read_label(raw: bytes, num_classes: int | None) -> int:
    """The integer in a `cls` member; ValueError when it is not one or is out of range."""
    label = int(raw.decode("ascii").strip())
    if label < 0 or (num_classes is not None and label >= num_classes):
        raise ValueError(f"label {label} out of range")
    return label


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Open (not yet decode) image bytes with PIL's image plugins only; refuse > max_pixels."""
    img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    if img.width * img.height > max_pixels:
        raise ValueError(f"{img.width}x{img.height} image exceeds data.max_pixels={max_pixels}")
    return img


def image_member(sample: dict) -> bytes | None:
    for ext in IMAGE_EXTS:
        if ext in sample:
            return sample[ext]
    return None


def decode_sample(sample: dict, transform: Callable[[Image.Image, random.Random], torch.Tensor],
                  rng: random.Random, *, labeled: bool, num_classes: int | None, max_pixels: int,
                  skips: dict[str, int]) -> tuple[torch.Tensor, int | None] | None:
    """(uint8 CHW image, label or None) for a raw webdataset sample, or None when it is skipped
    (the kind is counted in `skips`). Raises DataError when a labeled loader meets a sample
    without `cls`."""
    data = image_member(sample)
    if data is None:
        skips["missing_image"] = skips.get("missing_image", 0) + 1
        return None
    label = None
    if labeled:
        if "cls" not in sample:
            raise DataError(
                f"sample '{sample.get('__key__')}' in {sample.get('__url__')} has no 'cls' label, but a "
                "labeled loader was asked for: these shards look unlabeled; use labeled shards "
                "(tools/make_shards.py on a class-folder tree) or an unlabeled objective (mpp)")
        try:
            label = read_label(sample["cls"], num_classes)
        except (ValueError, UnicodeDecodeError):
            skips["bad_label"] = skips.get("bad_label", 0) + 1
            return None
    try:
        with open_image(data, max_pixels) as img:
            image = transform(img, rng)
    except IMAGE_ERRORS:
        skips["corrupt_image"] = skips.get("corrupt_image", 0) + 1
        return None
    return image, label
