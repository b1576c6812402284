"""mpp.data.decode's JPEG fast path: the header parse that enforces the pixel cap before decoding,
the choice between libjpeg-turbo (torchvision) and PIL, and that both give the same pixels."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mpp.data import decode
from mpp.data.decode import Jpeg, jpeg_size, open_image
from mpp.data.transforms import EvalTransform, TrainTransform, _load

CAP = 10**8


def jpeg(width=37, height=23, mode="RGB", seed=0, **kw) -> bytes:
    px = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).convert(mode).save(buf, "JPEG", **kw)
    return buf.getvalue()


def pil_rgb(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)


def exif(text: str) -> bytes:
    e = Image.Exif()
    e[0x010E] = text  # ImageDescription: a big APP1 segment before the frame header
    return e.tobytes()


VARIANTS = {"baseline": {}, "progressive": {"progressive": True}, "444": {"subsampling": 0},
            "grey": {"mode": "L"}, "cmyk": {"mode": "CMYK"}, "odd": {"width": 1, "height": 301},
            "exif": {"exif": exif("x" * 3000)}, "optimize": {"optimize": True}}


@pytest.mark.parametrize("name", VARIANTS)
def test_header_size_and_pixels_match_pil(name):
    data = jpeg(**VARIANTS[name])
    with Image.open(io.BytesIO(data)) as img:
        assert jpeg_size(data) == img.size
    j = open_image(data, CAP)
    assert isinstance(j, Jpeg) and j.size == j.pil().size
    px = j.pixels()  # RGB, the same pixels as PIL's decode, channels-last
    assert isinstance(px, torch.Tensor) and torch.equal(px, pil_rgb(data))
    assert px.permute(1, 2, 0).is_contiguous()


def test_header_walk_fill_bytes_standalone_markers_and_malformed():
    data = jpeg()
    size = jpeg_size(data)
    # fill bytes and a standalone marker (TEM) between segments do not change the answer
    assert jpeg_size(data[:2] + b"\xff\xff\xff\x01" + b"\xff" + data[2:]) == size
    app0_end = 4 + int.from_bytes(data[4:6], "big")
    assert jpeg_size(data[:app0_end] + b"\xff\xff" + data[app0_end:]) == size
    sof = data.index(b"\xff\xc0")
    bad = [b"", b"\xff\xd8", b"\xff\xd8\xff", data[:sof + 6], data[:20], b"\x89PNG\r\n\x1a\n" + data,
           data[:2] + b"\x00" + data[2:],                                    # no marker after SOI
           data[:4] + b"\x00\x01" + data[6:],                                # segment length < 2
           data[:2] + b"\xff\xda\x00\x02" + data[2:],                        # scan before the frame
           data[:sof + 5] + b"\x00\x00" + data[sof + 7:],                    # height 0 (DNL)
           data[:4] + b"\xff\xff" + data[6:]]                                # length past the end
    assert [jpeg_size(b) for b in bad] == [None] * len(bad)
    rng = random.Random(0)  # mangled headers never raise
    for _ in range(300):
        b = bytearray(data[:rng.randrange(3, 700)])
        for _ in range(rng.randrange(4)):
            b[rng.randrange(2, len(b))] = rng.randrange(256)
        out = jpeg_size(bytes(b))
        assert out is None or (len(out) == 2 and min(out) > 0)


def test_pixel_cap_before_decoding_and_pil_fallbacks():
    data = jpeg()
    sof = data.index(b"\xff\xc0")
    huge = data[:sof + 5] + (5000).to_bytes(2, "big") * 2 + data[sof + 9:]  # 5000x5000 claimed
    with pytest.raises(ValueError, match="5000x5000 image exceeds data.max_pixels"):
        open_image(huge, 10**6)
    with pytest.raises(ValueError, match="exceeds data.max_pixels"):
        open_image(data, 37 * 23 - 1)
    # truncated (no EOI at the end): PIL opens it and raises when decoding, as before
    with pytest.raises(decode.IMAGE_ERRORS):
        open_image(data[:len(data) // 2], CAP).load()
    # a header our walk refuses or bytes after EOI: PIL's call (here PIL is lenient)
    for odd in (data[:4] + b"\x00\x01" + data[6:], data + b"\x00"):
        assert isinstance(open_image(odd, CAP), Image.Image)


def test_torchvision_refusal_falls_back_to_pil(monkeypatch):
    data = jpeg()

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported")

    monkeypatch.setattr(decode, "decode_jpeg", refuse)
    img = open_image(data, CAP).pixels()
    assert isinstance(img, Image.Image) and torch.equal(torch.from_numpy(np.array(img)).permute(2, 0, 1), pil_rgb(data))
    out = TrainTransform(16)(open_image(data, CAP), random.Random(0))
    assert torch.equal(out, TrainTransform(16)(Image.open(io.BytesIO(data)), random.Random(0)))


@pytest.mark.parametrize("size", [32, 224])
def test_transforms_same_draws_and_pixels_on_both_decoders(size):
    """The libjpeg-turbo path draws the same crops and flips as the PIL path and gives the same
    pixels (torch resizes decoded tensors: within +-1 of PIL's resize below 64 px); big images
    still decode at reduced size with PIL's draft."""
    for transform in (TrainTransform(size), EvalTransform(size)):
        for width, height in ((256, 256), (300, 200), (2000, 1500)):
            data = jpeg(width, height, quality=95)
            fast, slow = random.Random(1), random.Random(1)
            for _ in range(4):
                a = transform(open_image(data, CAP), fast)
                b = transform(Image.open(io.BytesIO(data)), slow)
                assert a.shape == b.shape == (3, size, size) and a.stride()[0] == b.stride()[0] == 1  # (H, W, 3) pixels
                diff = (a.int() - b.int()).abs()
                assert (diff.float().mean() < 0.5) if size < 64 else torch.equal(a, b)
            assert fast.random() == slow.random()
    drafted, _ = _load(open_image(jpeg(2000, 1500), CAP), (0, 0, 1500, 1500), size)
    assert isinstance(drafted, Image.Image) and drafted.width <= 1000  # PIL, at reduced scale
    assert isinstance(_load(open_image(jpeg(256, 256), CAP), (0, 0, 256, 256), 224)[0], torch.Tensor)


def test_without_torchvision_decoder_every_jpeg_goes_through_pil(monkeypatch):
    """Should a torchvision release drop its deprecated decoder, images still decode (with PIL)."""
    data = jpeg(40, 30)
    assert isinstance(open_image(data, max_pixels=10_000), Jpeg)
    monkeypatch.setattr(decode, "decode_jpeg", None)
    img = open_image(data, max_pixels=10_000)
    assert not isinstance(img, Jpeg) and img.size == (40, 30)
