"""Per-sample image transforms (undecoded image -> uint8 CHW tensor) and the per-batch float
conversion.

Workers produce uint8 images (4x less to move than float), batched channels-last (`stack`); the
model side calls `to_float01` and `normalize` on the device. The transforms receive undecoded images
(`decode.open_image`: a `decode.Jpeg` or a lazily opened PIL image) so they can choose how to
decode (`_load`): a JPEG at least twice as large as the crop needs decodes at a reduced size (a
1/2, 1/4 or 1/8 scale IDCT costs a fraction of a full decode), PIL decodes what is no `Jpeg`. The
crop, antialiased bilinear resize and flip run in torch on the decoded HWC (= channels-last)
pixels, in PIL for PIL-decoded images below 64 px (`resized_crop`). A transform works on a list
of images (`batch`): every crop drawn first (in list order, so augmentation is reproducible),
then each image decoded, cropped and closed before the next, so a batch holds one decoded image
at a time.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import default_collate

from mpp.config import ConfigError
from mpp.data.decode import IMAGE_ERRORS, Jpeg

# output side from which PIL images resize in torch: PyTorch's uint8 channels-last antialiased
# bilinear kernel (made to match PIL's) wins on large images, PIL's lower per-call cost on small
# ones (docs/benchmarks.md). Decoded tensors (JPEGs decoded by libjpeg-turbo) always resize in
# torch: making them a PIL image costs more than the difference.
TORCH_RESIZE_FROM = 64


def to_float01(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 in [0, 1], on the images' device."""
    return images.to(torch.float32).div_(255.0)


def normalize(images01: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
              ) -> torch.Tensor:
    """(images01 - mean) / std per channel; mean/std are 3 numbers (e.g. data.mean, data.std), or
    tensors of them on the images' device (numbers are copied there on every call)."""
    m = torch.as_tensor(mean, dtype=images01.dtype, device=images01.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=images01.dtype, device=images01.device).view(-1, 1, 1)
    return (images01 - m) / s


def _load(img: Image.Image | Jpeg, box: Sequence[float], size: int
          ) -> tuple[Image.Image | torch.Tensor, tuple[int, int, int, int]]:
    """Decode `img` for a crop `box` (left, top, w, h in its pixels) that is resized to size x size:
    the decoded pixels (PIL image or uint8 (3, H, W) tensor) and the box in them (whole pixels). A
    `Jpeg` decodes at the smallest 1/2^k scale (k <= 3) that still gives the crop `size` pixels a
    side."""
    if not isinstance(img, Jpeg):
        return img, _scaled(box, 1.0, *img.size)
    reduce = 1
    while reduce < 8 and box[2] >= 2 * reduce * size and box[3] >= 2 * reduce * size:
        reduce *= 2
    pixels = img.pixels(reduce)
    width, height = (pixels.shape[2], pixels.shape[1]) if isinstance(pixels, torch.Tensor) else pixels.size
    return pixels, _scaled(box, img.width / width, width, height)


def _attempt(fn, *args):
    """fn(*args), or None when it fails on bad image data (decode.IMAGE_ERRORS)."""
    try:
        return fn(*args)
    except IMAGE_ERRORS:
        return None


def beyond_16_bits(img: Image.Image) -> bool:
    """A mode-I image with values outside 0..65535 (a 32-bit TIFF): no 8-bit pixels are read from
    it (clipped at 65535 it came out white), by the loader or by make_shards."""
    lo, hi = (img.getextrema() or (0, 0)) if img.mode == "I" else (0, 0)
    return not 0 <= lo <= hi <= 65535


def _rgb(img: Image.Image) -> Image.Image:
    """`img` in RGB. 16-bit integer greyscale (PIL's I;16 modes, and I, which 16-bit PNGs and TIFFs
    open as) is scaled to 8 bits first: PIL's conversion clips it at 255, a white image. Mode I
    values outside 16 bits (`beyond_16_bits`) are a ValueError (counted as corrupt_image), as a
    float image is."""
    if img.mode in ("I;16", "I;16L", "I;16B", "I"):
        if beyond_16_bits(img):
            raise ValueError("integer pixels beyond 16 bits ({}..{}, PIL mode I)".format(*img.getextrema()))
        img = Image.fromarray((np.asarray(img, dtype=np.int64).clip(0, 65535) >> 8).astype(np.uint8), "L")
    return img if img.mode == "RGB" else img.convert("RGB")


def _hwc(img: Image.Image) -> torch.Tensor:
    """A copy of a PIL image's RGB pixels as a uint8 (H, W, 3) tensor."""
    img = _rgb(img)
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)


def resized_crop(img: Image.Image | torch.Tensor, box: tuple[int, int, int, int], size: int,
                 flip: bool = False) -> torch.Tensor:
    """uint8 (3, size, size), channels-last (a view of (H, W, 3) pixels, see `stack`): the integer
    pixel box (left, top, w, h) of `img` (a PIL image or RGB uint8 (3, H, W) pixels) resized with
    antialiased bilinear interpolation (PIL's BILINEAR) and mirrored if `flip`. (In torch the filter
    reads only pixels inside the box, PIL's also those just outside: a crop's 2-pixel rim can differ
    slightly, the rest is within +-1.)"""
    left, top, w, h = box
    if isinstance(img, Image.Image) and size < TORCH_RESIZE_FROM:
        img = _rgb(img)
        img = img.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        return _hwc(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img).permute(2, 0, 1)
    hwc = img.permute(1, 2, 0) if isinstance(img, torch.Tensor) else _hwc(img)
    crop = hwc[top:top + h, left:left + w][None].permute(0, 3, 1, 2)  # (1, 3, h, w), channels-last
    if (w, h) != (size, size):
        crop = F.interpolate(crop.contiguous(memory_format=torch.channels_last), size=(size, size),
                             mode="bilinear", antialias=True)
    return (crop.flip(-1) if flip else crop)[0]


def stack(images: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The transforms' (3, H, W) images as one uint8 (B, 3, H, W) batch in channels-last memory
    format: stacking their (H, W, 3) pixels is a plain copy, where a contiguous (B, 3, H, W) batch
    needs a transposing one (about as costly as the resize). Every torch op and
    the model accept it. Stacked into `out` (a (B', H, W, 3) buffer, B' >= B) when given, else by
    default_collate, which in a DataLoader worker stacks straight into fresh shared memory."""
    hwc = [image.permute(1, 2, 0) for image in images]
    batch = default_collate(hwc) if out is None else torch.stack(hwc, out=out[:len(hwc)])
    return batch.permute(0, 3, 1, 2)


def _scaled(box: Sequence[float], f: float, width: int, height: int) -> tuple[int, int, int, int]:
    """A (left, top, w, h) box of the original image in the pixels of its 1/f-scale decode
    (width x height), rounded to whole pixels (at most half a reduced pixel off)."""
    left, top = min(round(box[0] / f), width - 1), min(round(box[1] / f), height - 1)
    right = min(max(round((box[0] + box[2]) / f), left + 1), width)
    bottom = min(max(round((box[1] + box[3]) / f), top + 1), height)
    return left, top, right - left, bottom - top


CROP_RATIO = (3 / 4, 4 / 3)  # the inception crop's range of aspect ratios (torchvision's)


def crop_box(rng: random.Random, width: int, height: int, scale: Sequence[float]) -> tuple[float, float, float, float]:
    """Inception crop (left, top, w, h): torchvision RandomResizedCrop.get_params' algorithm, drawn
    from a seeded `random.Random` so augmentation is reproducible per worker without touching
    torch's global RNG (and costs microseconds, not several tensor ops)."""
    area, (low, high) = width * height, CROP_RATIO
    log_ratio = (math.log(low), math.log(high))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height  # fallback: the whole image centre-cropped to the ratio range
    if in_ratio < low:
        w, h = width, round(width / low)
    elif in_ratio > high:
        w, h = round(height * high), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class _Transform:
    """Crop parameters per image (`params`), applied to a list of undecoded images (`batch`)."""
    size: int

    def params(self, img: Image.Image | Jpeg, rng: random.Random | None
               ) -> tuple[tuple[float, float, float, float], bool]:
        raise NotImplementedError

    def batch(self, images: list[Image.Image | Jpeg], rng: random.Random | None = None
              ) -> list[torch.Tensor | None]:
        """Each image as uint8 (3, size, size) (channels-last), or None where its data fail to
        decode; crops are drawn from `rng` in list order (a training transform then draws every
        image's shift, then every image's RandAugment seed), so augmentation is reproducible for the
        same groups of images, which the loader's are. Each image is decoded, cropped and closed before
        the next, so a batch holds one decoded image at a time (pixel caps bound one image)."""
        out = []
        for img, (box, flip) in zip(images, [self.params(img, rng) for img in images]):
            got = _attempt(_load, img, box, self.size)
            out.append(None if got is None else _attempt(resized_crop, *got, self.size, flip))
            for used in (img, got[0] if got else None):
                if isinstance(used, Image.Image):
                    used.close()
        return out


def shifted(image: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """uint8 (3, H, W) pixels moved by (dx, dy), the border reflected: the crop at (dx, dy) of the
    image padded by reflection (torch's, which keeps uint8; CIFAR's pad-and-crop)."""
    (_, height, width), x, y = image.shape, abs(dx), abs(dy)
    padded = F.pad(image[None], (x, x, y, y), mode="reflect")[0]
    return padded[:, y + dy:y + dy + height, x + dx:x + dx + width]


class TrainTransform(_Transform):
    """Random resized ("inception") crop to img_size with area scale `scale`, then a horizontal
    flip with probability `hflip` (the paper's pre-training augmentation); with `shift` > 0 a move
    of up to `shift` pixels each way with the border reflected (CIFAR's pad-and-crop); with
    `randaugment` (ops, magnitude), ops > 0, torchvision's RandAugment last. Every draw comes from
    `rng` like the crops' (RandAugment's from a seed each image draws), so a resumed run augments
    as the run did."""

    def __init__(self, img_size: int, scale: Sequence[float] = (0.08, 1.0), hflip: float = 0.5,
                 randaugment: Sequence[int] = (0, 9), shift: int = 0):
        if not 0 <= shift < img_size:
            raise ValueError(f"shift must be in 0..{img_size - 1} pixels for {img_size}-pixel images, got {shift}")
        self.size, self.scale, self.hflip, self.shift = img_size, tuple(scale), hflip, shift
        self.augment, self.ops = None, []
        if randaugment[0] > 0:
            import torchvision
            from torchvision.transforms import v2
            self.augment = a = v2.RandAugment(num_ops=randaugment[0], magnitude=randaugment[1])
            # private to torchvision (tested 0.26-0.29): a release without them fails here, not mid-run
            missing = [n for n in ("_AUGMENTATION_SPACE", "_apply_image_or_video_transform", "_fill")
                       if not hasattr(a, n)]
            if missing:
                raise ConfigError(
                    f"config key 'data.randaugment' drives torchvision's RandAugment through internals that "
                    f"torchvision {torchvision.__version__} lacks ({', '.join(missing)}); install torchvision "
                    f"0.26-0.29 or set data.randaugment=[0, 9]")
            for name, (magnitudes, signed) in a._AUGMENTATION_SPACE.items():  # every output is size x size
                m = magnitudes(a.num_magnitude_bins, img_size, img_size)
                scaled = m is not None and m.ndim > 0
                self.ops.append((name, float(m[a.magnitude]) if scaled else 0.0, signed and scaled))

    def params(self, img, rng):
        box = crop_box(rng, img.width, img.height, self.scale)
        return box, rng.random() < self.hflip

    def batch(self, images, rng=None):
        out = super().batch(images, rng)
        for i, image in enumerate(out if self.shift else ()):
            dx, dy = rng.randint(-self.shift, self.shift), rng.randint(-self.shift, self.shift)  # decoded or not
            if image is not None:
                out[i] = shifted(image, dx, dy)
        for i, image in enumerate(out if self.augment is not None else ()):
            seed = rng.getrandbits(63)  # drawn for every image, decoded or not
            if image is not None:
                out[i] = self._randaugment(image, random.Random(seed))
        return out

    def _randaugment(self, image: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """torchvision's RandAugment.forward (its op table, magnitudes and ops) with its two draws,
        the op and the magnitude's sign, taken from `rng`: not from torch's global generators,
        which this process's other threads draw from (with data.num_workers=0 the transform runs on
        the trainer's prefetch thread while the step draws the corruption and drop path), and which
        torch.manual_seed would reseed on CUDA too, where fork_rng(devices=[]) restores only the CPU's."""
        a = self.augment
        for _ in range(a.num_ops):
            name, magnitude, signed = self.ops[rng.randrange(len(self.ops))]
            if signed and rng.random() < 0.5:
                magnitude = -magnitude
            image = a._apply_image_or_video_transform(image, name, magnitude, interpolation=a.interpolation,
                                                      fill=a._fill)
        return image


class EvalTransform(_Transform):
    """Resize the shorter side to floor(img_size / crop_pct), then centre-crop img_size (timm's
    evaluation transform). At crop_pct=1 and native size it returns the pixels unchanged."""

    def __init__(self, img_size: int, crop_pct: float = 0.875):
        self.size = img_size
        self.resize = math.floor(img_size / crop_pct)

    def params(self, img, rng=None):
        width, height = img.size
        side = min(width, height) * self.size / self.resize  # the centre square, original pixels
        return ((width - side) / 2, (height - side) / 2, side, side), False


def build_transform(img_size: int, train: bool, data_cfg) -> TrainTransform | EvalTransform:
    """The transform for a loader: train augmentation or the evaluation crop (from DataConfig)."""
    if train:
        return TrainTransform(img_size, data_cfg.crop_scale, data_cfg.hflip, data_cfg.randaugment, data_cfg.shift)
    return EvalTransform(img_size, data_cfg.eval_crop_pct)
