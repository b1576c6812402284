"""Safe sample decoding: one image (image formats only, pixel cap) and an integer label.

A JPEG whose header libjpeg-turbo reads (size and colour space, through `simplejpeg`) becomes a
`Jpeg`, decoded later by libjpeg-turbo straight into a numpy array: the same pixels as PIL's decode
(the same library underneath) with less overhead per image (docs/benchmarks.md), optionally at a
reduced 1/2^k scale (libjpeg's scaled IDCT, the mechanism behind PIL's `draft`). libjpeg-turbo
runs strict: at any warning (damaged data, a truncated file) the JPEG goes to PIL instead, which
decodes it as it always would (PIL tolerates damaged data silently) or raises. CMYK/YCCK JPEGs
(converted to RGB differently by the two), headers libjpeg-turbo refuses and every other format
go through PIL.

No other shard member is ever decoded: webdataset's default decoder unpickles `.pyd`/`.pickle`
members, which would run code from a shard, so it is not used at all. Bad samples are skipped and
counted by kind in a plain dict (`SKIP_KINDS` says what each kind means), a sample without a label
in a labeled loader too (`missing_label`); shards that are unlabeled as a whole are refused
earlier, by their manifest (no `classes`), or when every sample of a rank is skipped.
"""
from __future__ import annotations

import io
import random
import struct

import simplejpeg
import torch
from PIL import Image

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
PIL_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "PPM", "TIFF")

SKIP_KINDS = {
    "corrupt_image": "image bytes that do not decode, are truncated, or exceed data.max_pixels",
    "missing_image": "sample without an image member (e.g. only non-image members)",
    "bad_label": "'cls' that is not an integer in [0, number of classes)",
    "missing_label": "sample without a 'cls' member in a labeled (supervised / classify / probe) loader",
    "truncated_tar": "shard that ends mid-archive (its last, possibly incomplete sample is dropped)",
    "corrupt_tar": ("shard whose tar headers are malformed or declare an oversized image or label, or that is "
                    "compressed other than by gzip, bzip2 or xz (the rest of it is lost)"),
    "unreadable_shard": "shard that could not be opened, read or parsed (the rest of it is lost)",
    "lost_samples": ("samples a damaged shard held past where it broke: its manifest's count (of the subset's "
                     "samples, under a subset) less those read; not known for shards without exact counts"),
    "padded": "repeated samples that filled a rank's last batches after skips left it short",
    "dropped": ("samples beyond a rank's expected count (shards without exact counts in a manifest, or a "
                "manifest that undercounts its shards)"),
}
# what PIL and libjpeg-turbo raise on corrupt, truncated or hostile bytes (a bug in our code still
# raises): KeyError (simplejpeg on an unknown chroma subsampling), TypeError and OverflowError (PIL
# on mistyped or out-of-range TIFF tags) came from mutated images that a fuzzer fed through decode_batch
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError, OverflowError,
                ZeroDivisionError, struct.error, Image.DecompressionBombError)
SAMPLE_SKIPS = ("corrupt_image", "missing_image", "bad_label", "missing_label", "lost_samples")  # one sample each
SHARD_SKIPS = ("truncated_tar", "corrupt_tar", "unreadable_shard")  # one shard each (its lost samples apart)


class DataError(ValueError):
    """A data problem that must stop the run; the message says what is wrong and what to do."""


def read_label(raw: bytes, num_classes: int | None) -> int:
    """The integer in a `cls` member; ValueError when it is not one or is out of range."""
    text = raw.decode("ascii").strip()
    if "_" in text:  # int() reads '1_0' as 10 (PEP 515); the writer writes a label in plain digits
        raise ValueError(f"label {text!r} is not a plain integer")
    label = int(text)
    if label < 0 or label >= (num_classes if num_classes is not None else 2**31):  # a class index, not damage
        raise ValueError(f"label {label} out of range")
    return label


def _open_pil(data: bytes, max_pixels: int) -> Image.Image:
    """Open (not yet decode) image bytes with PIL's image plugins only; refuse > max_pixels."""
    img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    if img.width * img.height > max_pixels:
        raise ValueError(f"{img.width}x{img.height} image exceeds data.max_pixels={max_pixels}")
    if img.mode == "F":  # PIL's conversion clips values to 0..255: a 0..1 image came out black, uncounted
        raise ValueError("a floating-point image (PIL mode F) has no one reading as 8-bit pixels")
    return img


class Jpeg:
    """A JPEG whose header libjpeg-turbo read, size within the pixel cap, not yet decoded:
    `pixels(reduce)` decodes it with libjpeg-turbo, `pil()` opens it lazily with PIL. Has PIL's
    `size`, `width` and `height`."""

    def __init__(self, data: bytes, size: tuple[int, int], max_pixels: int):
        self.data, self.size, self.max_pixels = data, size, max_pixels
        self.width, self.height = size

    def pil(self) -> Image.Image:
        return _open_pil(self.data, self.max_pixels)

    def pixels(self, reduce: int = 1) -> torch.Tensor | Image.Image:
        """RGB pixels (greyscale converted) as uint8 (3, H, W), channels-last (a view of (H, W, 3)),
        decoded at 1/`reduce` scale (1, 2, 4 or 8; each side rounded up); PIL's lazily opened image
        (to decode at full scale) when libjpeg-turbo reports an error or a warning."""
        try:
            return torch.from_numpy(simplejpeg.decode_jpeg(
                self.data, "RGB", min_width=-(-self.width // reduce), min_height=-(-self.height // reduce))
            ).permute(2, 0, 1)
        except ValueError:
            return self.pil()


def open_image(data: bytes, max_pixels: int) -> Image.Image | Jpeg:
    """Image bytes, not yet decoded, as a `Jpeg` (a JPEG whose header libjpeg-turbo reads, not
    CMYK) or else opened with PIL's image plugins only; either way refused (ValueError) when larger
    than max_pixels, before decoding. JPEGs above PIL's decompression-bomb threshold are left to PIL
    (which warns or refuses as before)."""
    width = height = 0
    colorspace = None
    if data[:2] == b"\xff\xd8":
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except IMAGE_ERRORS:  # a header libjpeg-turbo refuses: PIL's call
            pass
    if not width or colorspace in ("CMYK", "YCCK") or width * height > (Image.MAX_IMAGE_PIXELS or max_pixels):
        return _open_pil(data, max_pixels)
    if width * height > max_pixels:
        raise ValueError(f"{width}x{height} image exceeds data.max_pixels={max_pixels}")
    return Jpeg(data, (width, height), max_pixels)


def image_member(sample: dict) -> bytes | None:
    for ext in IMAGE_EXTS:
        if ext in sample:
            return sample[ext]
    return None


def decode_batch(samples: list[dict], transform, rng: random.Random, *, labeled: bool,
                 num_classes: int | None, max_pixels: int, skips: dict[str, int]
                 ) -> tuple[list[torch.Tensor], list[int | None]]:
    """The uint8 CHW images and labels (None when unlabeled) of the raw webdataset samples that
    decode; the others are skipped and counted by kind in `skips`. Labels and headers are read here,
    the images decoded and augmented by `transform.batch` (a `transforms` transform), all of them
    in one go."""
    images, labels = [], []
    for sample in samples:
        data = image_member(sample)
        if data is None:
            skips["missing_image"] = skips.get("missing_image", 0) + 1
            continue
        label = None
        if labeled:
            if "cls" not in sample:
                skips["missing_label"] = skips.get("missing_label", 0) + 1
                continue
            try:
                label = read_label(sample["cls"], num_classes)
            except (ValueError, UnicodeDecodeError):
                skips["bad_label"] = skips.get("bad_label", 0) + 1
                continue
        try:
            images.append(open_image(data, max_pixels))
        except IMAGE_ERRORS:
            skips["corrupt_image"] = skips.get("corrupt_image", 0) + 1
            continue
        labels.append(label)
    out = [(image, label) for image, label in zip(transform.batch(images, rng), labels) if image is not None]
    if len(out) < len(images):
        skips["corrupt_image"] = skips.get("corrupt_image", 0) + len(images) - len(out)
    return [image for image, _ in out], [label for _, label in out]
