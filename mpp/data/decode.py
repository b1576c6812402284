"""Safe sample decoding: one image (image formats only, pixel cap) and an integer label.

A complete JPEG (SOI ... EOI, size read from its frame header) becomes a `Jpeg`, decoded later by
libjpeg-turbo through torchvision (same pixels as PIL's decode, ~25 us less per 32 px sample, no
copy out of PIL) unless the transform asks PIL to decode it at reduced size; every other image (and
any JPEG that is truncated, has a malformed header or that torchvision refuses) goes through PIL,
which decodes it or raises as before. Two costs of that path: torchvision deprecated its image
decoders in 0.29 (a DeprecationWarning, silent outside pytest, filtered in pyproject's pytest
settings; should a release drop them, every image goes through PIL again), and libjpeg prints one "Corrupt
JPEG data" line to stderr for a complete JPEG with damaged data, which it decodes as PIL does
(torchvision does not route libjpeg's warnings through Python).

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
try:  # deprecated since torchvision 0.29 (TorchCodec supersedes it); once removed, PIL decodes all
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:
    decode_jpeg = None

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


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (not DHT, JPG, DAC)
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: markers without a length field


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header (SOFn), found by walking the marker segments from
    SOI (fill bytes and standalone markers allowed); None when the bytes are no JPEG, the segments
    are malformed, or the scan (SOS) or the end comes before a frame header with a nonzero size."""
    if not data.startswith(b"\xff\xd8"):
        return None
    i, end = 2, len(data)
    while i < end and data[i] == 0xFF:
        while i < end and data[i] == 0xFF:  # a marker may be preceded by any number of fill bytes
            i += 1
        if i >= end:
            return None
        marker = data[i]
        i += 1
        if marker in _STANDALONE:
            continue
        if i + 2 > end or marker in (0x00, 0xD8, 0xD9, 0xDA):  # stuffed byte, SOI, EOI, SOS
            return None
        (length,) = struct.unpack_from(">H", data, i)
        if length < 2 or i + length > end:
            return None
        if marker in _SOF:  # length, precision, height, width, components
            if length < 8:
                return None
            height, width = struct.unpack_from(">HH", data, i + 3)
            return (width, height) if width and height else None
        i += length
    return None


def _open_pil(data: bytes, max_pixels: int) -> Image.Image:
    """Open (not yet decode) image bytes with PIL's image plugins only; refuse > max_pixels."""
    img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    if img.width * img.height > max_pixels:
        raise ValueError(f"{img.width}x{img.height} image exceeds data.max_pixels={max_pixels}")
    return img


class Jpeg:
    """A complete JPEG whose size (within the pixel cap) is known from its header, not yet decoded:
    `pixels()` decodes it with libjpeg-turbo (torchvision), `pil()` opens it lazily with PIL (for
    `draft`, PIL's reduced-size decoding). Has PIL's `format`, `size`, `width` and `height`."""
    format = "JPEG"

    def __init__(self, data: bytes, size: tuple[int, int], max_pixels: int):
        self.data, self.size, self.max_pixels = data, size, max_pixels
        self.width, self.height = size

    def pil(self) -> Image.Image:
        return _open_pil(self.data, self.max_pixels)

    def pixels(self) -> torch.Tensor | Image.Image:
        """RGB pixels (greyscale and CMYK converted) as uint8 (3, H, W), channels-last (a view of
        (H, W, 3)); PIL's lazily opened image when torchvision refuses the bytes (PIL then decodes
        or raises as for any other image)."""
        try:
            return decode_jpeg(torch.frombuffer(bytearray(self.data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            return self.pil()


def open_image(data: bytes, max_pixels: int) -> Image.Image | Jpeg:
    """Image bytes, not yet decoded, as a `Jpeg` (a complete JPEG: ends with EOI, size read from
    its header) or else opened with PIL's image plugins only; either way refused (ValueError) when
    larger than max_pixels, before decoding. JPEGs above PIL's decompression-bomb threshold are left
    to PIL (which warns or refuses as before)."""
    size = jpeg_size(data) if decode_jpeg is not None and data.endswith(b"\xff\xd9") else None
    if size is None or size[0] * size[1] > (Image.MAX_IMAGE_PIXELS or max_pixels):
        return _open_pil(data, max_pixels)
    if size[0] * size[1] > max_pixels:
        raise ValueError(f"{size[0]}x{size[1]} image exceeds data.max_pixels={max_pixels}")
    return Jpeg(data, size, max_pixels)


def image_member(sample: dict) -> bytes | None:
    for ext in IMAGE_EXTS:
        if ext in sample:
            return sample[ext]
    return None


def decode_sample(sample: dict, transform: Callable[[Image.Image | Jpeg, random.Random], torch.Tensor],
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
        image = transform(open_image(data, max_pixels), rng)
    except IMAGE_ERRORS:
        skips["corrupt_image"] = skips.get("corrupt_image", 0) + 1
        return None
    return image, label
