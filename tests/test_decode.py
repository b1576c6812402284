"""mpp.data.decode's JPEG fast path: the header read that enforces the pixel cap before decoding,
the choice between libjpeg-turbo (simplejpeg) and PIL, and that both give the same pixels."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mpp.data import decode
from mpp.data.decode import IMAGE_ERRORS, Jpeg, open_image
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
    j = open_image(data, CAP)
    with Image.open(io.BytesIO(data)) as img:
        assert j.size == img.size
    if name == "cmyk":  # the two convert CMYK to RGB differently (+-1): PIL decodes it
        assert isinstance(j, Image.Image)
        return
    assert isinstance(j, Jpeg)
    px = j.pixels()  # RGB, the same pixels as PIL's decode, channels-last
    assert isinstance(px, torch.Tensor) and torch.equal(px, pil_rgb(data))
    assert px.permute(1, 2, 0).is_contiguous()


def test_mangled_headers_are_pil_s_call_or_skipped():
    """Bytes libjpeg-turbo's header reader refuses go to PIL; any mangled prefix of a JPEG either
    decodes or fails with one of IMAGE_ERRORS (then it is skipped and counted), never otherwise."""
    data = jpeg()
    assert isinstance(open_image(data[:4] + b"\x00\x01" + data[6:], CAP), Image.Image)  # segment length < 2
    sof = data.index(b"\xff\xc0")
    for bad in (data[:sof + 5] + b"\x00\x00" + data[sof + 7:], b"\x89PNG\r\n\x1a\n" + data):  # height 0, junk
        with pytest.raises(IMAGE_ERRORS):
            open_image(bad, CAP)
    rng = random.Random(0)
    outcomes = set()
    for _ in range(300):
        b = bytearray(data[:rng.randrange(3, len(data) + 1)])
        for _ in range(rng.randrange(4)):
            b[rng.randrange(2, len(b))] = rng.randrange(256)
        try:
            out = TrainTransform(16).batch([open_image(bytes(b), CAP)], random.Random(0))[0]
        except IMAGE_ERRORS:
            out = None
        assert out is None or out.shape == (3, 16, 16)
        outcomes.add(out is None)
    assert outcomes == {True, False}


def test_pixel_cap_before_decoding_and_pil_fallbacks(capfd):
    data = jpeg()
    sof = data.index(b"\xff\xc0")
    huge = data[:sof + 5] + (5000).to_bytes(2, "big") * 2 + data[sof + 9:]  # 5000x5000 claimed
    with pytest.raises(ValueError, match="5000x5000 image exceeds data.max_pixels"):
        open_image(huge, 10**6)
    with pytest.raises(ValueError, match="exceeds data.max_pixels"):
        open_image(data, 37 * 23 - 1)
    # truncated: libjpeg-turbo warns, so PIL decodes it, and PIL raises: the sample is skipped
    truncated = open_image(data[:len(data) // 2], CAP)
    assert isinstance(truncated.pixels(), Image.Image)
    assert TrainTransform(16).batch([truncated], random.Random(0)) == [None]
    # damaged data that PIL tolerates: decoded as PIL decodes it, without libjpeg's stderr line
    damaged = bytearray(data)
    damaged[len(data) - 40:len(data) - 20] = bytes(20)
    px = open_image(bytes(damaged), CAP).pixels()
    assert torch.equal(torch.from_numpy(np.array(px)).permute(2, 0, 1), pil_rgb(bytes(damaged)))
    assert capfd.readouterr().err == ""


def test_libjpeg_turbo_refusal_falls_back_to_pil(monkeypatch):
    data = jpeg()

    def refuse(*args, **kwargs):
        raise ValueError("unsupported")

    monkeypatch.setattr(decode.simplejpeg, "decode_jpeg", refuse)
    img = open_image(data, CAP).pixels()
    assert isinstance(img, Image.Image) and torch.equal(torch.from_numpy(np.array(img)).permute(2, 0, 1), pil_rgb(data))
    out = TrainTransform(16).batch([open_image(data, CAP)], random.Random(0))[0]
    assert torch.equal(out, TrainTransform(16).batch([Image.open(io.BytesIO(data))], random.Random(0))[0])


def test_the_evaluation_crop_is_the_images_centre():
    """timm's evaluation transform: the shorter side resized, then the centre square (of a wide
    image, the middle; at crop_pct < 1, the middle of that too), never a corner."""
    pixels = np.zeros((16, 48, 3), dtype=np.uint8)
    pixels[:, :16] = (0, 0, 255)
    pixels[:, 16:32] = (255, 0, 0)
    pixels[:, 32:] = (0, 255, 0)
    pixels[2:14, 18:30] = (255, 255, 255)  # around the middle of the middle
    for crop_pct, colour in ((1.0, (255, 143.4375, 143.4375)), (0.5, (255, 255, 255))):  # red, 144 of 256 white
        (out,) = EvalTransform(16, crop_pct).batch([Image.fromarray(pixels)])
        assert out.shape == (3, 16, 16)
        assert (out.float().mean((1, 2)) - torch.tensor(colour, dtype=torch.float)).abs().max() < 1, crop_pct


@pytest.mark.parametrize("size", [32, 224])
def test_transforms_same_draws_and_pixels_on_both_decoders(size):
    """The libjpeg-turbo path draws the same crops and flips as the PIL path and gives the same
    pixels (torch resizes decoded tensors: within +-1 of PIL's resize below 64 px) where it decodes
    at full scale; big images decode at reduced scale (libjpeg's scaled IDCT), a close match."""
    for transform in (TrainTransform(size), EvalTransform(size)):
        for width, height in ((256, 256), (300, 200), (2000, 1500)):
            data = jpeg(width, height, quality=95)
            fast, slow = random.Random(1), random.Random(1)
            for _ in range(4):
                (a,), (b,) = (transform.batch([open_image(data, CAP)], fast),
                              transform.batch([Image.open(io.BytesIO(data))], slow))
                assert a.shape == b.shape == (3, size, size) and a.stride()[0] == b.stride()[0] == 1  # (H, W, 3) pixels
                diff = (a.int() - b.int()).abs().float()
                if width < 2 * size:  # never reduced: PIL's pixels (within +-1 below 64 px: PIL resizes there)
                    assert torch.equal(a, b) if size >= 64 else diff.mean() < 0.5
                else:  # reduced-scale IDCT vs full decode + resize, on noise pixels (the worst case)
                    assert diff.mean() < 8
            assert fast.random() == slow.random()
    reduced, _ = _load(open_image(jpeg(2000, 1500), CAP), (0, 0, 1500, 1500), size)
    assert isinstance(reduced, torch.Tensor) and reduced.shape[2] <= 1000
    assert _load(open_image(jpeg(256, 256), CAP), (0, 0, 256, 256), 224)[0].shape == (3, 256, 256)


def test_odd_decoder_errors_and_16_bit_images():
    """A JPEG with a chroma subsampling libjpeg-turbo's header reader does not know (4:4:1; it
    raised KeyError in a worker and stopped the run at the same step on every resume) goes to PIL;
    a 16-bit greyscale PNG is scaled to 8 bits, not clipped white by PIL's conversion; a float one
    is skipped and counted."""
    from mpp.config import DataConfig
    from mpp.data.decode import decode_batch
    from mpp.data.transforms import build_transform
    data = bytearray(jpeg())
    sof = data.index(b"\xff\xc0")
    data[sof + 11] = 0x14  # the first component's sampling factors: 1x4
    grey = io.BytesIO()
    Image.fromarray(np.full((20, 30), 32768, np.uint16)).save(grey, "PNG")
    skips: dict = {}
    images, _ = decode_batch([{"__key__": "a", "jpg": bytes(data)}, {"__key__": "b", "png": grey.getvalue()}],
                             build_transform(16, False, DataConfig(eval_crop_pct=1.0)), random.Random(0),
                             labeled=False, num_classes=None, max_pixels=CAP, skips=skips)
    assert len(images) == 2 and not skips
    assert images[1].float().mean().item() == pytest.approx(128.0, abs=1.0)
    floats = io.BytesIO()  # a 0..1 float TIFF: PIL's conversion clipped it black and nothing was counted
    Image.fromarray(np.full((20, 30), 0.5, np.float32)).save(floats, "TIFF")
    images, _ = decode_batch([{"__key__": "c", "tiff": floats.getvalue()}], build_transform(16, False, DataConfig()),
                             random.Random(0), labeled=False, num_classes=None, max_pixels=CAP, skips=skips)
    assert images == [] and skips == {"corrupt_image": 1}
    from mpp.data.writer import probe_image  # make_shards skips it, saying why
    with pytest.raises(ValueError, match="floating-point pixels"):
        probe_image(floats.getvalue())
    wide = io.BytesIO()  # 32-bit integers (PIL mode I) past 16 bits: clipped at 65535, they trained as white
    Image.fromarray(np.arange(600, dtype=np.int32).reshape(20, 30) * 1000).save(wide, "TIFF")
    images, _ = decode_batch([{"__key__": "d", "tiff": wide.getvalue()}], build_transform(16, False, DataConfig()),
                             random.Random(0), labeled=False, num_classes=None, max_pixels=CAP, skips=skips)
    assert images == [] and skips == {"corrupt_image": 2}
    with pytest.raises(ValueError, match="integer pixels beyond 16 bits"):
        probe_image(wide.getvalue())
    assert probe_image(grey.getvalue()) == "png"


def test_randaugment_follows_the_crop_rng_and_is_off_at_zero_ops():
    """`data.randaugment`: each image's ops come from a seed drawn from the crops' rng (the same
    rng state, the same pixels: a resumed run augments as the run did); at 0 ops the transform
    and its draws are the plain one's, so runs without it are unchanged."""
    data = [jpeg(40, 40, seed=s) for s in range(6)]

    def run(transform, seed=0):
        rng = random.Random(seed)
        return transform.batch([open_image(d, CAP) for d in data], rng), rng.random()
    plain, after_plain = run(TrainTransform(32, (0.5, 1.0)))
    off, after_off = run(TrainTransform(32, (0.5, 1.0), randaugment=(0, 9)))
    assert all(torch.equal(a, b) for a, b in zip(plain, off, strict=True)) and after_plain == after_off
    augment = TrainTransform(32, (0.5, 1.0), randaugment=(2, 9))
    torch.manual_seed(123)
    first, _ = run(augment)
    torch.manual_seed(456)  # the global torch RNG plays no part
    again, _ = run(augment)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert all(a.shape == (3, 32, 32) and a.dtype == torch.uint8 for a in first)
    assert sum(not torch.equal(a, b) for a, b in zip(first, plain)) >= 4  # 2 ops rarely leave an image alone
    assert any(not torch.equal(a, b) for a, b in zip(first, run(augment, seed=1)[0]))


def test_a_shift_is_a_crop_of_the_reflection_padded_image_drawn_from_the_crop_rng():
    """`data.shift`: each image moved by up to `shift` pixels each way, the border reflected, is
    the crop at that offset of the image padded by reflection (CIFAR's pad-and-crop); the moves
    are drawn from the crops' rng after them, so a resumed run augments as the run did, and at 0
    the transform and its draws are the plain one's."""
    from mpp.data.transforms import shifted
    image = torch.randint(0, 256, (3, 8, 9), dtype=torch.uint8)
    padded = torch.nn.functional.pad(image[None].float(), (4, 4, 4, 4), mode="reflect")[0]
    for dx, dy in [(0, 0), (4, -4), (-3, 2), (1, 4)]:
        assert torch.equal(shifted(image, dx, dy), padded[:, 4 + dy:12 + dy, 4 + dx:13 + dx].to(torch.uint8))
    data = [jpeg(40, 40, seed=s) for s in range(6)]

    def run(transform, seed=0):
        rng = random.Random(seed)
        return transform.batch([open_image(d, CAP) for d in data], rng), rng
    plain, rng = run(TrainTransform(32, (0.5, 1.0)))
    off, rng_off = run(TrainTransform(32, (0.5, 1.0), shift=0))
    assert all(torch.equal(a, b) for a, b in zip(plain, off, strict=True)) and rng.random() == rng_off.random()
    plain, rng = run(TrainTransform(32, (0.5, 1.0)))
    moves = [(rng.randint(-4, 4), rng.randint(-4, 4)) for _ in plain]  # after the crops, image by image
    moved, _ = run(TrainTransform(32, (0.5, 1.0), shift=4))
    assert all(torch.equal(m, shifted(p, *d)) for m, p, d in zip(moved, plain, moves, strict=True))
    assert sum(d != (0, 0) for d in moves) >= 4 and sum(not torch.equal(m, p) for m, p in zip(moved, plain)) >= 4
    with pytest.raises(ValueError, match="shift must be in 0..31"):
        TrainTransform(32, shift=32)


def test_randaugment_setting_reaches_the_training_transform_and_is_checked():
    from mpp.config import ConfigError, DataConfig, build_config
    from mpp.data.transforms import build_transform
    assert build_transform(32, True, DataConfig(randaugment=(1, 5))).augment.num_ops == 1
    assert build_transform(32, True, DataConfig()).augment is None  # off by default
    assert isinstance(build_transform(32, False, DataConfig(randaugment=(1, 5))), EvalTransform)  # training only
    assert build_config({"data": {"randaugment": [2, 9]}}).data.randaugment == (2, 9)
    assert build_transform(32, True, DataConfig(shift=4)).shift == 4 and build_transform(32, True, DataConfig()).shift == 0
    assert build_config({"model": "vit_mini8_32", "data": {"shift": 31}}).data.shift == 31
    for bad in (-1, 32, 2.5):
        with pytest.raises(ConfigError, match="data.shift"):
            build_config({"model": "vit_mini8_32", "data": {"shift": bad}})
    for bad in ([1], [-1, 9], [1, 31], [1.5, 9]):
        with pytest.raises(ConfigError, match="data.randaugment"):
            build_config({"data": {"randaugment": bad}})
    # the torchvision internals it drives, gone in some release: one line at set-up, not a crash mid-run
    from torchvision.transforms import v2
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(v2.RandAugment, "_AUGMENTATION_SPACE")
        with pytest.raises(ConfigError, match=r"data.randaugment.*torchvision .* lacks .*_AUGMENTATION_SPACE") as e:
            build_transform(32, True, DataConfig(randaugment=(1, 5)))
    assert "\n" not in str(e.value)


def test_randaugment_leaves_the_global_torch_rng_to_other_threads():
    """With data.num_workers=0 the transform runs on the trainer's prefetch thread while the step
    draws the corruption and drop path from torch's global generator: RandAugment must not reseed
    (or fork and restore) it, or the step's draws change from run to run."""
    import threading
    data = [jpeg(40, 40, seed=s) for s in range(8)]
    augment = TrainTransform(32, (0.5, 1.0), randaugment=(2, 9))

    def load():
        rng = random.Random(0)
        for _ in range(20):
            augment.batch([open_image(d, CAP) for d in data], rng)
    loader = threading.Thread(target=load)
    torch.manual_seed(0)
    drawn = []
    loader.start()
    while loader.is_alive():
        drawn.append(torch.rand(1).item())
    loader.join()
    torch.manual_seed(0)
    assert len(drawn) > 10 and drawn == [torch.rand(1).item() for _ in drawn]


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_a_flip_comes_with_its_configured_probability(p):
    """Every other test flips always or never: a draw that ignored data.hflip between them passed."""
    t, img, rng = TrainTransform(16, hflip=p), Image.new("RGB", (24, 20)), random.Random(0)
    rate = sum(t.params(img, rng)[1] for _ in range(4000)) / 4000
    assert abs(rate - p) < 0.03, rate  # 4 standard errors at most


def test_a_negative_or_underscored_label_is_a_counted_bad_label():
    """A `cls` must be a class index in plain digits: '-1' (a 'no label' marker of some tools) and
    '1_0' (which int() reads as 10) are skipped and counted as bad labels, not trained as classes
    -1 and 10; surrounding whitespace is allowed."""
    from mpp.config import DataConfig
    from mpp.data.decode import decode_batch
    from mpp.data.transforms import build_transform
    image = jpeg(16, 16)
    samples = [{"__key__": str(i), "jpg": image, "cls": cls} for i, cls in enumerate((b"-1", b"1_0", b"12", b" 3\n"))]
    skips: dict = {}
    images, labels = decode_batch(samples, build_transform(16, False, DataConfig()), random.Random(0), labeled=True,
                                  num_classes=12, max_pixels=CAP, skips=skips)
    assert labels == [3] and len(images) == 1 and skips == {"bad_label": 3}
    for raw in (b"-1", b"1_0"):
        with pytest.raises(ValueError):
            decode.read_label(raw, None)


def test_the_pixel_cap_of_a_non_jpeg_image_allows_exactly_max_pixels():
    """A PNG of exactly max_pixels pixels opens; one pixel over the cap is refused before decoding
    (as the writer skips it), so the cap means the same for every format."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((10, 12, 3), np.uint8)).save(buf, "PNG")
    assert open_image(buf.getvalue(), 120).size == (12, 10)
    with pytest.raises(ValueError, match="12x10 image exceeds data.max_pixels=119"):
        open_image(buf.getvalue(), 119)


def test_a_ycck_jpeg_is_decoded_by_pil_as_a_cmyk_one_is():
    """An Adobe YCCK JPEG (CMYK stored as YCCK) goes to PIL like a CMYK one: libjpeg-turbo converts
    it to RGB differently (+-1), so the same image would give other pixels depending on the decoder."""
    data = bytearray(jpeg(mode="CMYK"))
    adobe = data.index(b"Adobe")
    data[adobe + 11] = 2  # the Adobe segment's transform flag: YCCK
    data = bytes(data)
    assert decode.simplejpeg.decode_jpeg_header(data)[2] == "YCCK"
    transform = EvalTransform(16)
    assert torch.equal(transform.batch([open_image(data, CAP)])[0], transform.batch([Image.open(io.BytesIO(data))])[0])


@pytest.mark.parametrize("width,height", [(5, 5), (37, 23), (3, 7)])
def test_a_jpeg_decoded_at_reduced_scale_rounds_its_sides_up(width, height):
    """At 1/reduce scale a JPEG keeps ceil(side / reduce) pixels a side, as libjpeg's scaled decode
    gives, never fewer (a small image came out at a smaller scale, or whole at 1/8)."""
    img = open_image(jpeg(width, height), CAP)
    for reduce in (1, 2, 4, 8):
        assert img.pixels(reduce).shape == (3, -(-height // reduce), -(-width // reduce)), reduce
