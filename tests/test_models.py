"""The masked encoder: corruption before position embeddings, export to plain timm, loading."""
import json

import pytest
import timm
import torch
from timm.models import checkpoint_seq

import mpp.models
from mpp.config import ConfigError, DataConfig
from mpp.models import PRESETS, MaskedEncoder, create_encoder, load_encoder, save_encoder
from mpp.corruption import Corruption

PRESET = "vit_micro4_32"  # 2 blocks, dim 64, 8x8 patches of 4 px


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return create_encoder(PRESET).eval()


def plan(masked, src):
    chosen = masked | (src != torch.arange(src.shape[1]))
    return Corruption(chosen=chosen, masked=masked, src=src, index=torch.zeros(src.shape[0], 0, dtype=torch.long))


def test_shapes_and_properties(encoder):
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = encoder(x)
    assert out.shape == (2, 1 + 64, 64)
    assert (encoder.embed_dim, encoder.patch_size, encoder.num_patches, encoder.grid_size) == (64, 4, 64, (8, 8))
    assert encoder.mask_token.shape == (1, 1, 64)
    params = dict(encoder.named_parameters())
    assert encoder.no_weight_decay() == {"vit.pos_embed", "vit.cls_token", "mask_token"}
    assert encoder.no_weight_decay() <= params.keys()


def test_all_masked_tokens_depend_only_on_position(encoder):
    """Mask replaces the patch embedding BEFORE position embeddings are added."""
    x = torch.randn(2, 3, 32, 32)
    masked = torch.ones(2, 64, dtype=torch.bool)
    with torch.no_grad():
        out = encoder(x, plan(masked, torch.arange(64).expand(2, 64)))
    torch.testing.assert_close(out[0], out[1])  # the images' content is gone entirely
    assert (out[0, 1] - out[0, 2]).abs().max() > 1e-3  # but positions still tell tokens apart


def test_random_other_takes_the_source_patch_content(encoder):
    """src gathers patch embeddings before position embeddings: equal to moving the pixels."""
    torch.manual_seed(1)
    x = torch.randn(1, 3, 32, 32)
    src = torch.randperm(64).unsqueeze(0)
    grid = x.reshape(1, 3, 8, 4, 8, 4).permute(0, 2, 4, 1, 3, 5).reshape(1, 64, 3, 4, 4)
    moved = grid[:, src[0]].reshape(1, 8, 8, 3, 4, 4).permute(0, 3, 1, 4, 2, 5).reshape(1, 3, 32, 32)
    with torch.no_grad():
        out = encoder(x, plan(torch.zeros(1, 64, dtype=torch.bool), src))
        ref = encoder(moved)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_export_loads_into_plain_timm_with_equal_features(encoder, tmp_path):
    x = torch.randn(3, 3, 32, 32)
    path = save_encoder(encoder, tmp_path)
    spec = json.loads((tmp_path / "model.json").read_text())
    assert set(spec) == {"name", "kwargs"} and spec["name"] == PRESETS[PRESET][0]
    model = timm.create_model(spec["name"], checkpoint_path=str(path), **spec["kwargs"]).eval()
    assert model.state_dict().keys() == encoder.encoder_state_dict().keys()
    assert "mask_token" not in encoder.encoder_state_dict()
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), encoder(x))
        torch.testing.assert_close(model(x), encoder(x)[:, 0])  # pooled [class] token, no head


def test_an_encoder_loads_at_an_img_size_its_own_patch_divides(tmp_path):
    """The patch size is the encoder's as built: a model.json may leave it to the timm model's name
    (vit_small_patch8_224: 8, not timm's default 16), so 40 px suits it and 36 px is refused in one
    line, not in timm's patch embedding at the first forward."""
    save_encoder(MaskedEncoder("vit_small_patch8_224", dict(img_size=32, embed_dim=64, depth=1, num_heads=2),
                               attn="math"), tmp_path)
    assert "patch_size" not in json.loads((tmp_path / "model.json").read_text())["kwargs"]
    assert tuple(load_encoder(tmp_path, img_size=40).grid_size) == (5, 5)
    with pytest.raises(ConfigError, match="img_size=36 does not suit .*its patch size is 8"):
        load_encoder(tmp_path, img_size=36)


def test_an_encoder_whose_model_json_leaves_the_resolution_to_its_timm_name_resamples_from_that(tmp_path):
    """A model.json without img_size (a timm name of 384 px) was resampled as if saved at 224 px and
    refused as 'weights do not match' the model.json it was exported with."""
    torch.manual_seed(0)
    enc = MaskedEncoder("vit_tiny_patch16_384", {"depth": 1, "embed_dim": 32, "num_heads": 2}, attn="math")
    save_encoder(enc, tmp_path)
    assert "img_size" not in json.loads((tmp_path / "model.json").read_text())["kwargs"]
    small = load_encoder(tmp_path, img_size=224)
    assert small.grid_size == (14, 14)
    torch.testing.assert_close(small.vit.pos_embed[0, 0], enc.vit.pos_embed[0, 0])


def test_load_encoder_same_and_new_resolution(encoder, tmp_path):
    save_encoder(encoder, tmp_path)
    x = torch.randn(2, 3, 32, 32)
    same = load_encoder(tmp_path).eval()  # a run dir
    with torch.no_grad():
        torch.testing.assert_close(same(x), encoder(x))
    big = load_encoder(tmp_path / "encoder.safetensors", img_size=48).eval()
    assert big.grid_size == (12, 12) and big.vit.pos_embed.shape == (1, 1 + 144, 64)
    pos, old = big.vit.pos_embed[0], encoder.vit.pos_embed[0]
    torch.testing.assert_close(pos[0], old[0])  # the [class] position is kept, the grid resampled
    assert json.loads(json.dumps(big.model_spec()))["kwargs"]["img_size"] == 48
    big_sd, sd = big.encoder_state_dict(), encoder.encoder_state_dict()
    assert all(torch.equal(big_sd[k], sd[k]) for k in sd if k != "pos_embed")
    # resampling back to the original grid lands close to the original embeddings (smooth map)
    save_encoder(big, tmp_path / "big")
    back = load_encoder(tmp_path / "big", img_size=32)
    assert (back.vit.pos_embed - encoder.vit.pos_embed).abs().mean() < encoder.vit.pos_embed.abs().mean()
    with torch.no_grad():
        assert big(torch.randn(2, 3, 48, 48)).shape == (2, 145, 64)


def test_an_encoder_refuses_inputs_normalised_otherwise(encoder, tmp_path):
    """model.json records the input normalisation the encoder trained on (a fine-tune or probe that
    normalised otherwise fed it inputs it never saw, silently); loading it for such a run stops in
    one line naming both and the fix. A model.json without one (an older export) loads as before."""
    imagenet = DataConfig(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    save_encoder(encoder, tmp_path / "new", imagenet)
    spec = json.loads((tmp_path / "new/model.json").read_text())
    assert (spec["mean"], spec["std"]) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    load_encoder(tmp_path / "new", data=imagenet)
    with pytest.raises(ConfigError) as e:
        load_encoder(tmp_path / "new", data=DataConfig())
    theirs = "data.mean=[0.485,0.456,0.406] data.std=[0.229,0.224,0.225]"
    assert str(e.value) == (f"encoder {tmp_path / 'new/encoder.safetensors'} was trained on inputs normalised with "
                            f"{theirs}, but this run normalises with data.mean=[0.5,0.5,0.5] data.std=[0.5,0.5,0.5]; "
                            f"set {theirs} (the encoder's)")
    save_encoder(encoder, tmp_path / "old")
    assert set(json.loads((tmp_path / "old/model.json").read_text())) == {"name", "kwargs"}
    load_encoder(tmp_path / "old", data=imagenet)


def test_load_encoder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.json"):
        load_encoder(tmp_path)
    with pytest.raises(ValueError, match="unknown model preset"):
        create_encoder("vit_nope")


def test_attention_paths_agree():
    torch.manual_seed(0)
    fused = create_encoder(PRESET, attn="fused").eval()
    math_ = create_encoder(PRESET, attn="math").eval()
    auto = create_encoder(PRESET, attn="auto").eval()
    math_.load_state_dict(fused.state_dict())
    auto.load_state_dict(fused.state_dict())
    assert all(m.fused_attn for m in fused._attn_modules) and not any(m.fused_attn for m in math_._attn_modules)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = fused(x)
        torch.testing.assert_close(math_(x), ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(auto(x), ref, atol=1e-5, rtol=1e-4)
    assert len({m.fused_attn for m in auto._attn_modules}) == 1
    with pytest.raises(ValueError, match="attn"):
        create_encoder(PRESET, attn="flash")


@pytest.mark.parametrize("attn", ["fused", "math"])
def test_rows_equal_the_same_tokens_of_the_full_output(attn):
    """forward(rows=) computes the last block only at the asked positions: same values and
    gradients as taking those rows of the full output."""
    torch.manual_seed(0)
    enc = create_encoder(PRESET, attn=attn)
    x = torch.randn(3, 3, 32, 32)
    rows = torch.stack([torch.randperm(65)[:20] for _ in range(3)])  # [class] token (0) may be among them
    full = enc(x)
    ref = torch.gather(full, 1, rows.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
    got = enc(x, rows=rows)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ref)
    params = list(enc.vit.parameters())  # no corruption: the [mask] token is unused
    for a, b in zip(torch.autograd.grad((ref * w).sum(), params), torch.autograd.grad((got * w).sum(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_drop_path_reaches_timm():
    enc = create_encoder(PRESET, drop_path=0.2)
    assert enc.vit.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)


def test_auto_attention_is_a_fixed_rule_on_cpu(monkeypatch):
    """Identical runs must take the same attention path: on CPU "auto" is math whatever the shape,
    precision or grad mode and however fast each path happens to be (it used to time them, and a
    close race went different ways in identical runs)."""
    import time
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) ** 2)  # whichever runs later looks slower
    enc = create_encoder(PRESET, attn="auto")
    for batch, dtype in ((1, torch.float32), (5, torch.bfloat16)):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            enc(torch.randn(batch, 3, 32, 32))
        assert not any(m.fused_attn for m in enc._attn_modules)


@pytest.mark.parametrize("rows", [False, True])
def test_math_attention_softmax_runs_in_fp32_under_cpu_autocast(monkeypatch, rows):
    """CPU autocast has no fp32 rule for softmax (CUDA autocast has): the math path asks for fp32
    itself, in every block and in the last block's row-wise path, and the output stays close to
    the fp32 forward."""
    dtypes, softmax = [], torch.Tensor.softmax
    monkeypatch.setattr(torch.Tensor, "softmax", lambda t, *a, **k: dtypes.append(softmax(t, *a, **k).dtype)
                        or softmax(t, *a, **k))
    torch.manual_seed(0)
    enc = create_encoder(PRESET, attn="math").eval()
    x, r = torch.randn(2, 3, 32, 32), (torch.tensor([[1, 5], [0, 3]]) if rows else None)
    with torch.no_grad():
        ref = enc(x, rows=r)
        dtypes.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = enc(x, rows=r)
    assert dtypes == [torch.float32] * len(enc.vit.blocks)
    torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("rows", [False, True])
def test_timms_grad_checkpointing_gives_the_plain_paths_outputs_and_gradients(rows, monkeypatch):
    """`vit.set_grad_checkpointing()` (timm's API) recomputes the blocks in backward instead of
    keeping their activations: the same values and gradients, with drop path in training too, and
    with the chosen rows' last block (corruption and `rows=` as MPP runs it)."""
    torch.manual_seed(0)
    enc = create_encoder(PRESET, drop_path=0.1, attn="math").train()
    x = torch.randn(3, 3, 32, 32)
    corruption = plan(torch.rand(3, 64) < 0.3, torch.stack([torch.randperm(64) for _ in range(3)]))
    chosen = torch.stack([torch.randperm(65)[:20] for _ in range(3)]) if rows else None
    params = [p for p in enc.parameters() if p.requires_grad]
    calls = []
    monkeypatch.setattr(mpp.models, "checkpoint_seq", lambda *a, **k: calls.append(1) or checkpoint_seq(*a, **k))
    results = []
    for on in (False, True):
        enc.vit.set_grad_checkpointing(on)
        torch.manual_seed(1)  # the same drop-path draws
        out = enc(x, corruption, rows=chosen)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        results.append((out, torch.autograd.grad((out * weights).sum(), params)))
    (plain, plain_grads), (ckpt, ckpt_grads) = results
    assert len(calls) == 1  # the checkpointed forward alone went through timm's checkpoint_seq
    torch.testing.assert_close(ckpt, plain, atol=0, rtol=0)
    for a, b in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


# the paper's Table 1 (B, L, H) and DeiT's Ti, S: width, depth, heads
PAPER_SIZES = {"ti": (192, 12, 3), "s": (384, 12, 6), "b": (768, 12, 12), "l": (1024, 24, 16), "h": (1280, 32, 16)}


def test_each_preset_builds_the_model_its_name_and_geometry_say():
    """A preset's name is a promise: vit_b16 is the paper's ViT-B/16 at 224 px (a wrong entry would
    train another architecture without a word), and `preset_geometry`, which the config checks and
    the figures read without building a model, agrees with the model built."""
    from mpp.models import preset_geometry
    for preset in PRESETS:
        with torch.device("meta"):
            encoder = create_encoder(preset)
        vit = encoder.vit
        size, patch = preset_geometry(preset)
        assert (vit.patch_embed.img_size[0], vit.patch_embed.patch_size[0]) == (size, patch), preset
        assert encoder.mask_token.shape[-1] == vit.embed_dim, preset
        name = preset.removeprefix("vit_").split("_")[0]  # 'b16', 'mini8'
        if name.rstrip("0123456789") in PAPER_SIZES and preset.count("_") == 1:
            assert (size, patch) == (224, int(name.lstrip("tislbh"))), preset
            assert (vit.embed_dim, len(vit.blocks), vit.blocks[0].attn.num_heads) == \
                PAPER_SIZES[name.rstrip("0123456789")], preset


def test_the_mask_embedding_starts_random_and_the_fine_tune_freezes_it():
    """The [mask] embedding starts as a random draw, not zeros (a zero token would be the patch
    embedding's bias alone); a fine-tune never corrupts, so it freezes it: DDP needs every trained
    parameter to get a gradient, and every other one does."""
    from mpp.config import build_config
    from mpp.objectives import build_task
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", attn="math")
    assert encoder.mask_token.std() > 0.005
    task = build_task(build_config({"model": "vit_micro4_32", "objective": "classify"}), encoder, 10)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    loss, _ = task(images, torch.tensor([1, 2]))
    loss.backward()
    assert not encoder.mask_token.requires_grad
    assert all(p.grad is not None for p in task.parameters() if p.requires_grad)


def test_the_evaluation_crop_is_the_centre_of_a_tall_image_unmirrored():
    """Evaluation sees the image as it is: the centre square of a tall image (its middle rows, not
    nearer the top) with left and right in place, never the training flip."""
    import numpy as np
    from PIL import Image

    from mpp.data.transforms import EvalTransform
    y, x = np.mgrid[0:48, 0:16]
    pixels = np.stack([x * 15, y * 5, np.zeros_like(x)], -1).astype(np.uint8)  # 16 wide, 48 tall
    (out,) = EvalTransform(16, crop_pct=1.0).batch([Image.fromarray(pixels)])
    assert torch.equal(out.permute(1, 2, 0), torch.from_numpy(pixels[16:32]))


def test_the_evaluation_crop_side_is_timms_floor_of_img_size_over_crop_pct():
    """data.eval_crop_pct reaches the evaluation transform, which resizes the shorter side to
    floor(img_size / crop_pct) as timm does: of a 350 px image at 32 px and 0.9, the middle 320 px."""
    from PIL import Image

    from mpp.data.transforms import build_transform
    transform = build_transform(32, False, DataConfig(eval_crop_pct=0.9))
    assert transform.params(Image.new("RGB", (350, 350))) == ((15.0, 15.0, 320.0, 320.0), False)
    assert build_transform(32, False, DataConfig(eval_crop_pct=1.0)).params(Image.new("RGB", (350, 350)))[0][2] == 350


def test_an_inception_crop_covers_the_area_fraction_the_crop_scale_allows():
    """data.crop_scale bounds the crop's share of the image at both ends: at [0.25, 0.25] every
    crop covers a quarter of it (to rounding), with an aspect ratio within 3/4..4/3."""
    import random

    from mpp.data.transforms import crop_box
    rng = random.Random(0)
    for _ in range(50):
        left, top, w, h = crop_box(rng, 100, 80, (0.25, 0.25))
        assert abs(w * h / 8000 - 0.25) < 0.01 and 3 / 4 - 0.05 < w / h < 4 / 3 + 0.05
        assert 0 <= left <= 100 - w and 0 <= top <= 80 - h


def test_an_image_too_narrow_or_too_wide_for_the_crop_falls_back_to_its_centre_at_the_ratio_limit():
    """When no drawn crop fits (a 10:1 panorama at crop_scale 1), the crop is the image's centre cut
    to the nearest allowed aspect ratio: 4:3 of a wide image's full height, 3:4 of a tall one's width."""
    import random

    from mpp.data.transforms import crop_box
    assert crop_box(random.Random(0), 400, 40, (1.0, 1.0)) == (173, 0, 53, 40)
    assert crop_box(random.Random(0), 40, 400, (1.0, 1.0)) == (0, 173, 40, 53)


def test_the_avg_pool_is_the_mean_of_the_patch_tokens_and_the_token_pool_the_class_token(encoder):
    """finetune.pool / probe pools: `avg` averages the patch tokens alone (not the [class] token),
    `token` takes the [class] token; each must reach timm's pooling as asked."""
    tokens = torch.randn(2, 1 + 64, 64)
    torch.testing.assert_close(encoder.pool(tokens, "avg"), tokens[:, 1:].mean(1))
    assert torch.equal(encoder.pool(tokens, "token"), tokens[:, 0])


def test_a_reduced_scale_jpeg_decode_keeps_the_crops_size_across_its_narrower_side():
    """A JPEG decodes at 1/2^k scale only while both sides of the crop keep `size` pixels: a crop
    100 px wide and 400 tall for 64 px decodes at full scale (at 1/2 its width would be upsampled)."""
    import io

    from PIL import Image

    from mpp.data.decode import open_image
    from mpp.data.transforms import _load
    data = io.BytesIO()
    Image.new("RGB", (512, 512), (200, 100, 50)).save(data, "JPEG")
    for box in ((0, 0, 100, 400), (0, 0, 400, 100)):
        pixels, scaled = _load(open_image(data.getvalue(), 10**8), box, 64)
        assert tuple(pixels.shape) == (3, 512, 512) and scaled == box, box
    pixels, scaled = _load(open_image(data.getvalue(), 10**8), (0, 0, 300, 200), 64)
    assert tuple(pixels.shape) == (3, 256, 256) and scaled == (0, 0, 150, 100)  # 1/2: both sides >= 128


def test_a_crop_box_maps_to_a_reduced_decode_by_rounding_each_edge_to_the_nearest_pixel():
    """A crop (7, 7, 16, 16) of an image decoded at 1/4 scale is pixels 2..6 there (edges 1.75 and
    5.75 rounded), not shifted half a pixel up-left by truncation; a box is never empty."""
    from mpp.data.transforms import _scaled
    assert _scaled((7, 7, 16, 16), 4.0, 10, 10) == (2, 2, 4, 4)
    assert _scaled((5.4, 0.6, 10, 10), 1.0, 20, 20) == (5, 1, 10, 10)
    assert _scaled((39, 39, 1, 1), 4.0, 10, 10) == (9, 9, 1, 1)


def test_a_grid_needs_at_least_two_whole_patches_a_side_and_a_preset_takes_the_size_asked():
    """An image of one patch a side (32 px at patch 32) is no grid to mask: `grid_fix` names a size
    to give instead; `preset_geometry` takes an asked img_size over the preset's own."""
    from mpp.models import grid_fix, preset_geometry
    assert grid_fix(64, 32) == "" and "64" in grid_fix(32, 32) and grid_fix(30, 4) != ""
    assert preset_geometry("vit_micro4_32", 64) == (64, 4) and preset_geometry("vit_micro4_32") == (32, 4)


def test_an_infinite_weight_counts_as_nonfinite_as_a_nan_does():
    """A diverged encoder may hold inf without NaN: `nonfinite` names both, never integer tensors."""
    from mpp.models import nonfinite
    state = {"a": torch.tensor([1.0, float("inf")]), "b": torch.tensor([float("nan")]), "c": torch.ones(2),
             "d": torch.tensor([-float("inf")]), "n": torch.tensor([3])}
    assert nonfinite(state) == ["a", "b", "d"]


def test_an_encoder_without_a_class_token_is_refused():
    """The pools and probes read the [class] token: a timm ViT built without one is refused at once."""
    kwargs = dict(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match=r"needs a \[class\] token"):
        MaskedEncoder("vit_tiny_patch16_224", kwargs)


def test_an_encoder_is_built_at_the_img_size_asked_not_its_presets():
    """create_encoder(img_size=64) of a 32 px preset builds a 16x16 grid with position embeddings to
    match (the run's data.img_size), not the preset's 8x8."""
    encoder = create_encoder(PRESET, img_size=64, attn="math")
    assert encoder.grid_size == (16, 16) and encoder.vit.pos_embed.shape == (1, 1 + 256, 64)


def test_randaugment_applies_the_configured_magnitude_with_either_sign():
    """data.randaugment=[2, 9]: a rotation is by torchvision's bin 9 of 0..30 degrees (9, not bin
    8's 8), and signed ops turn either way, about as often each (torchvision's coin)."""
    import random

    from mpp.data.transforms import TrainTransform
    t = TrainTransform(32, randaugment=(2, 9))
    assert {name: (m, signed) for name, m, signed in t.ops}["Rotate"] == (9.0, True)
    seen = []
    t.augment._apply_image_or_video_transform = lambda image, name, m, **kw: seen.append((name, m)) or image
    rng = random.Random(0)
    for _ in range(200):
        t._randaugment(torch.zeros(3, 32, 32, dtype=torch.uint8), rng)
    rotations = [m for name, m in seen if name == "Rotate"]
    assert set(rotations) == {9.0, -9.0} and 0.2 < rotations.count(9.0) / len(rotations) < 0.8
