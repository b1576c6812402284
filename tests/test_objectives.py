"""MPP targets and corruption, the four target variants, supervised and classify heads."""
import math

import pytest
import numpy as np
import torch
import torch.nn.functional as F

from mpp.config import build_config
from mpp.models import create_encoder
from mpp.corruption import sample_corruption
from mpp.objectives import build_task
from mpp.targets import HOG_BINS, HOG_CELLS, TARGETS, Target, class_colors, hog, mean_color_targets, patches, quantize

PRESET = "vit_micro4_32"


def image(patch_colors, p=4):
    """A (1, 3, 2p, 2p) image from 4 per-patch (3, p, p) tensors in row-major patch order."""
    rows = [torch.cat(patch_colors[0:2], dim=2), torch.cat(patch_colors[2:4], dim=2)]
    return torch.cat(rows, dim=1).unsqueeze(0)


def flat(r, g, b, p=4):
    return torch.tensor([r, g, b], dtype=torch.float32).view(3, 1, 1).expand(3, p, p).clone()


def test_mean_color_targets_hand_computed():
    half = flat(0, 0, 0)
    half[:, :, 2:] = 0.25  # mean exactly 1/8 built from unequal pixels
    below = flat(0.125, 0.125, 0.125)
    below[0, 0, 0] -= 1e-6  # red mean just under 1/8
    img = image([flat(0.125, 0.125, 0.125), flat(0.999, 1.0, 0.0), half, below])
    # levels: (1,1,1); (7, 7 clamped from 8, 0); (1,1,1); (0,1,1)
    expect = [(1 << 6) | (1 << 3) | 1, (7 << 6) | (7 << 3), (1 << 6) | (1 << 3) | 1, (1 << 3) | 1]
    assert mean_color_targets(img, 4).tolist() == [expect]
    assert mean_color_targets(img, 4).dtype == torch.long
    # 1 bit: class = r << 2 | g << 1 | b with the boundary at 0.5
    img1 = image([flat(0.5, 0.4999, 1.0), flat(0, 0, 0), flat(1, 1, 1), flat(0.75, 0.0, 0.5)])
    assert mean_color_targets(img1, 4, bits=1).tolist() == [[0b101, 0, 0b111, 0b101]]
    # uint8-derived pixels: 32/255 is just above 1/8 -> level 1; 31/255 -> level 0
    u8 = image([flat(32 / 255, 31 / 255, 255 / 255), flat(0, 0, 0), flat(0, 0, 0), flat(0, 0, 0)])
    assert mean_color_targets(u8, 4)[0, 0].item() == (1 << 6) | (0 << 3) | 7
    assert quantize(torch.tensor([[1.5, -0.2, 0.5]])).tolist() == [(7 << 6) | (0 << 3) | 4]


def test_mean_color_targets_row_major_order():
    img = torch.zeros(1, 3, 8, 12)  # 2 x 3 patches of 4 px; red level = patch index
    for i in range(6):
        r, c = divmod(i, 3)
        img[0, 0, 4 * r:4 * r + 4, 4 * c:4 * c + 4] = i / 8 + 0.01
    assert mean_color_targets(img, 4).tolist() == [[i << 6 for i in range(6)]]


@pytest.mark.parametrize("N,ratio", [(64, 0.5), (65, 0.5), (196, 0.4), (10, 1.0)])
def test_corruption_exact_counts_per_image(N, ratio):
    g = torch.Generator().manual_seed(0)
    c = sample_corruption(300, N, ratio, 0.8, 0.1, 0.1, generator=g)
    K = math.floor(ratio * N + 0.5)
    own = torch.arange(N)
    swapped = c.src != own
    assert (c.chosen.sum(1) == K).all()
    assert c.index.shape == (300, K) and c.chosen.gather(1, c.index).all()
    assert (c.index.sort(1).values.diff(dim=1) > 0).all()  # distinct positions
    assert not (c.masked & ~c.chosen).any() and not (swapped & ~c.chosen).any()
    assert not (c.masked & swapped).any()
    for count, frac in ((c.masked.sum(1), 0.8), (swapped.sum(1), 0.1)):
        assert ((count == math.floor(frac * K)) | (count == math.ceil(frac * K))).all()


@pytest.mark.parametrize("u", [0.0, 1 - 2 ** -24])  # the ends of torch.rand's range
def test_corruption_counts_hold_at_the_ends_of_the_leftover_draw(monkeypatch, u):
    """Fractions whose sum is not exactly 1 in floating point (0.7 + 0.2 + 0.1) still give each
    part the floor or ceiling of its share when the leftover draw lands on an end of its range."""
    real = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *size, **kw: torch.full(size, u) if size[-1] == 1 else real(*size, **kw))
    c = sample_corruption(4, 20, 0.5, 0.7, 0.2, 0.1)
    swapped = c.src != torch.arange(20)
    kept = c.chosen & ~c.masked & ~swapped
    assert (c.masked.sum(1) == 7).all() and (swapped.sum(1) == 2).all() and (kept.sum(1) == 1).all()


def test_corruption_split_over_many_draws():
    g = torch.Generator().manual_seed(1)
    c = sample_corruption(4000, 64, 0.5, 0.8, 0.1, 0.1, generator=g)
    chosen = c.chosen.sum().item()
    swapped = c.src != torch.arange(64)
    keep = c.chosen & ~c.masked & ~swapped
    for part, frac in ((c.masked, 0.8), (swapped, 0.1), (keep, 0.1)):
        assert part.sum().item() / chosen == pytest.approx(frac, abs=0.005)
    assert c.chosen.float().mean(0).sub(0.5).abs().max() < 0.05  # every position equally likely
    # "random other patch": never itself, and every other position reachable
    assert (c.src[swapped] != torch.arange(64).expand(4000, 64)[swapped]).all()
    assert len(c.src[swapped].unique()) == 64


def test_corruption_config_variants_and_generator():
    c = sample_corruption(8, 16, 0.5, 1.0, 0.0, 0.0)
    assert torch.equal(c.masked, c.chosen) and torch.equal(c.src, torch.arange(16).expand(8, 16))
    c = sample_corruption(8, 16, 0.5, 0.0, 1.0, 0.0)
    assert not c.masked.any() and torch.equal(c.src != torch.arange(16), c.chosen)
    a = sample_corruption(4, 16, generator=torch.Generator().manual_seed(3))
    b = sample_corruption(4, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.src, b.src) and torch.equal(a.masked, b.masked)
    with pytest.raises(ValueError, match="ratio"):
        sample_corruption(2, 4, ratio=0.1)


def task_for(objective="mpp", num_classes=None, **over):
    cfg = build_config({"model": PRESET, "objective": objective, **over})
    torch.manual_seed(0)
    return build_task(cfg, create_encoder(PRESET, attn="math"), num_classes)


def batch(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)


def palette_batch(n=8, seed=0):
    """Patches of one colour from a 4-colour palette: every target has learnable structure."""
    g = torch.Generator().manual_seed(seed)
    palette = torch.tensor([[250, 10, 10], [10, 250, 10], [10, 10, 250], [128, 128, 128]], dtype=torch.uint8)
    idx = torch.randint(0, 4, (n, 8, 8), generator=g)
    return palette[idx].permute(0, 3, 1, 2).repeat_interleave(4, 2).repeat_interleave(4, 3).contiguous()


@pytest.mark.parametrize("target", TARGETS)
def test_loss_only_on_chosen_patches(target):
    """The encoder is asked for exactly the chosen patches' tokens (rows), each of which gets a gradient."""
    task = task_for(mpp={"target": target})
    seen = {}

    def keep_plan(module, args, kwargs):
        seen["plan"], seen["rows"] = args[1], kwargs["rows"]

    def keep_tokens(module, args, kwargs, out):
        out.retain_grad()
        seen["tokens"] = out

    task.encoder.register_forward_pre_hook(keep_plan, with_kwargs=True)
    task.encoder.register_forward_hook(keep_tokens, with_kwargs=True)
    loss, _ = task(batch(4))
    loss.backward()
    chosen, rows = seen["plan"].chosen, seen["rows"] - 1  # token 0 is the [class] token
    assert (torch.zeros_like(chosen).scatter_(1, rows, True) == chosen).all()
    assert rows.shape[1] == chosen.sum(1).max()
    assert (seen["tokens"].grad.abs().sum(-1) > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_each_target_trains(target):
    task = task_for(mpp={"target": target})
    opt = torch.optim.AdamW(task.parameters(), lr=1e-3)
    images = palette_batch()
    losses = []
    for _ in range(10):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, metrics = task(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0]
    assert set(metrics) == {"loss", "acc", "baseline"}
    assert metrics["loss"].dim() == metrics["acc"].dim() == 0 and 0 <= metrics["acc"].item() <= 1
    assert metrics["baseline"].dim() == 1 and metrics["baseline"].sum() > 0  # class counts


def window_baseline(task, ranks: list[list[torch.Tensor]]) -> float:
    """The logged baseline of a log window in which rank i ran the micro-batches `ranks[i]`."""
    from types import SimpleNamespace
    from mpp.train import _Window
    windows = []
    for micro in ranks:
        windows.append(_Window(torch.zeros(())))
        for images in micro:
            loss, metrics = task(images)
            windows[-1].add_micro(loss, metrics, len(images))
    rows = []
    for win in windows[1:]:
        win.read(SimpleNamespace(gather=lambda row: rows.append(row) or row))
    return windows[0].read(SimpleNamespace(gather=lambda row: torch.cat([row, *rows])))["baseline"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_baseline_is_the_log_windows_mode_however_its_batch_is_split(target):
    """One batch of 8 single-coloured images logs one baseline at grad_accum 1 and 8 and on 2 ranks:
    the share of the most frequent class among all their chosen patches (2 of 8 images black). Taken
    per micro-batch, 8 micro-batches of one image each logged 1.0."""
    task = task_for(mpp={"target": target})
    images = torch.zeros(8, 3, 32, 32, dtype=torch.uint8)
    images[:, 0] = (torch.tensor([0, 0, 1, 2, 3, 4, 5, 6]) * 32 + 16).view(8, 1, 1)  # red levels 0, 0, 1, ..., 6
    one = window_baseline(task, [[images]])
    eight = window_baseline(task, [list(images.split(1))])
    two_ranks = window_baseline(task, [list(images[:4].split(1)), list(images[4:].split(1))])
    assert one == eight == two_ranks == (1.0 if target == "hog" else 0.25)  # a flat patch: hog's bin 0 alone


def test_supervised_head_and_training():
    task = task_for("supervised", num_classes=5, supervised={"hidden_dim": 32})
    assert isinstance(task.head[1], torch.nn.Tanh) and task.head[0].out_features == 32
    images, labels = batch(20, seed=1), torch.arange(20) % 5
    opt = torch.optim.AdamW(task.parameters(), lr=2e-3)
    first = None
    for _ in range(8):
        loss, metrics = task(images, labels)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first and set(metrics) == {"loss", "acc"}
    with pytest.raises(ValueError, match="labels"):
        task(images)


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_classify_head_starts_at_zero(pool):
    task = task_for("classify", num_classes=7, finetune={"pool": pool, "label_smoothing": 0.1})
    images = batch(4)
    logits = task.logits(images)
    assert logits.shape == (4, 7) and logits.dtype == torch.float32 and (logits == 0).all()
    loss, metrics = task(images, torch.arange(4))
    assert loss.item() == pytest.approx(math.log(7), rel=1e-5)
    assert metrics["acc"].dim() == 0
    assert task.no_weight_decay() <= dict(task.named_parameters()).keys()


@pytest.mark.parametrize("objective", ["classify", "supervised"])
def test_class_logits_are_fp32_under_bf16_autocast(objective):
    """bf16 logits tie and argmax then picks the lowest class: the head must run in fp32."""
    task = task_for(objective, num_classes=10)
    torch.manual_seed(0)
    for p in task.head.parameters():
        torch.nn.init.normal_(p, std=2.0)
    images = batch(64, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = task.logits(images)
        pooled = task.encoder.pool(task.encoder(task.inputs(images)[1]), task.pool)
    exact = task.head.double()(pooled.double())
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max().item() < 1e-4  # bf16 is off by ~1e-2 here
    top2 = logits.topk(2, -1).values
    assert (top2[:, 0] > top2[:, 1]).all()


def test_mpp_head_runs_in_fp32_under_bf16_autocast():
    """The MPP head's 512 colour logits in bf16 cost the colour task (docs/results.md): the head,
    like the class heads, runs in fp32 outside autocast, and the loss reads its exact output."""
    task = task_for("mpp")
    seen = []
    task.head.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = task(batch(8, seed=1))
    assert seen == [(torch.float32, torch.float32)] and loss.dtype == torch.float32


def test_bad_inputs():
    task = task_for()
    with pytest.raises(ValueError, match="uint8"):
        task(torch.rand(2, 3, 32, 32))
    with pytest.raises(ValueError, match="num_classes"):
        task_for("supervised", num_classes=None)


def test_a_new_target_is_one_table_entry(monkeypatch):
    """mpp.config takes mpp.target's allowed values from TARGETS: registering a target is enough."""
    from mpp.config import ConfigError, build_config
    with pytest.raises(ConfigError, match="choose one of mean_color"):
        build_config({"mpp": {"target": "my_target"}})
    monkeypatch.setitem(TARGETS, "my_target", TARGETS["mean_color"])
    task = task_for(mpp={"target": "my_target"})
    assert build_config({"mpp": {"target": "my_target"}}).mpp.target == "my_target"
    assert task.head.out_features == 512


def spy_target(task):
    """Wrap the task's target loss so each call's (pix, guess, classes) is kept."""
    seen = {}
    orig = task.target

    def loss(pred, pix, bits):
        out = orig.loss(pred, pix, bits)
        seen.update(pix=pix, guess=out[1], classes=out[2])
        return out
    task.target = Target(outputs=orig.outputs, loss=loss, colors=orig.colors)
    return seen


def spy_plan(task):
    """Keep the corruption plan the encoder receives."""
    seen = {}
    task.encoder.register_forward_pre_hook(lambda m, a, kw: seen.update(plan=a[1]), with_kwargs=True)
    return seen


def test_mpp_targets_are_the_true_pixels_of_the_chosen_patches():
    """Targets line up with the chosen tokens (corruption.index order), from the uncorrupted pixels."""
    task = task_for()
    seen, plan = spy_target(task), spy_plan(task)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=g)
    loss, metrics = task(images)
    index = plan["plan"].index
    pix = patches(images.float() / 255, 4)
    want = torch.gather(pix, 1, index.view(4, -1, 1, 1, 1).expand(-1, -1, *pix.shape[2:]))
    torch.testing.assert_close(seen["pix"].float(), want)
    assert torch.equal(seen["classes"], mean_color_targets(images.float() / 255, 4).gather(1, index))
    assert (plan["plan"].src != torch.arange(64)).any()  # the plan did swap some patches
    # the accuracy metric compares each prediction with its own patch's class
    assert metrics["acc"].item() == pytest.approx((seen["guess"] == seen["classes"]).float().mean().item())


def test_mpp_forward_uses_configured_random_and_keep():
    """mpp.mask, mpp.random and mpp.keep reach the corruption in the right places (keep 0: every chosen
    patch changes; unequal mask and random fractions, so swapping the two would show)."""
    task = task_for(mpp={"mask": 0.75, "random": 0.25, "keep": 0.0})
    plan = spy_plan(task)
    task(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8))
    c = plan["plan"]
    swapped = c.src != torch.arange(64)
    assert torch.equal(c.masked | swapped, c.chosen)  # keep = 0: every chosen patch is corrupted
    assert (c.masked.sum(1) == 24).all() and (swapped.sum(1) == 8).all()  # of round(0.5 * 64) = 32


def test_mean_color_guess_is_the_argmax():
    """The guess is the prediction's argmax, not the true class: a prediction wrong on some patches
    gives guesses wrong on exactly those."""
    pix = torch.rand(2, 3, 3, 4, 4, dtype=torch.float64)
    classes = quantize(pix.mean((-1, -2)), 3)
    wrong = torch.tensor([[True, False, True], [False, False, True]])
    picked = torch.where(wrong, (classes + 7) % 512, classes)
    pred = F.one_hot(picked, 512).float() * 5
    _, guess, true = TARGETS["mean_color"].loss(pred, pix, 3)
    assert torch.equal(true, classes) and torch.equal(guess, picked)
    assert torch.equal(guess != true, wrong)


def test_class_colors_are_level_centres_in_rgb_order():
    cls = torch.tensor([(1 << 6) | (2 << 3) | 3])
    torch.testing.assert_close(class_colors(cls, 3), torch.tensor([[1.5 / 8, 2.5 / 8, 3.5 / 8]]))
    c = torch.rand(100, 3)
    assert torch.equal(quantize(class_colors(quantize(c), 3)), quantize(c))


def test_downsampled_target_is_cell_mean_colour():
    pix = torch.zeros(1, 1, 3, 8, 8, dtype=torch.float64)
    pix[..., ::2, :] = 0.25  # every 2x2 cell: mean 0.125 -> level 1 (its max 0.25 would be level 2)
    pred = torch.zeros(1, 1, 16 * 512)
    _, _, classes = TARGETS["downsampled"].loss(pred, pix, 3)
    assert (classes == (1 << 6) | (1 << 3) | 1).all()


def test_downsampled_channels_classifies_each_channel_of_each_cell():
    """The channels head scores the same cells as `downsampled`, a level per channel: logits that
    pick every channel's true level make its guess the joint class, and its loss the least."""
    torch.manual_seed(0)
    pix = torch.rand(2, 3, 3, 8, 8, dtype=torch.float64)
    target = TARGETS["downsampled_channels"]
    assert target.outputs(3, 8) == 16 * 3 * 8 and target.outputs(5, 8) == 16 * 3 * 32
    _, _, joint = TARGETS["downsampled"].loss(torch.zeros(2, 3, 16 * 512), pix, 3)
    cells = F.adaptive_avg_pool2d(pix.flatten(0, 1), 4).flatten(2).transpose(1, 2).reshape(2, 3, 16, 3)
    right = F.one_hot((cells * 8).floor().long(), 8).float().flatten(2) * 20
    loss, guess, true = target.loss(right, pix, 3)
    assert torch.equal(true, joint) and torch.equal(guess, true)
    assert loss.item() < 1e-6 < target.loss(right.roll(1, -1), pix, 3)[0].item()
    torch.testing.assert_close(target.colors(right, 3), ((cells * 8).floor() + 0.5).float().mean(2) / 8)


def test_color_histogram_target_is_the_share_of_each_pixel_colour():
    pix = torch.zeros(1, 2, 3, 4, 4, dtype=torch.float64)
    pix[0, 0, 0, :, :2] = 0.8125  # patch 0: half its pixels red (class 6 << 6), half black (class 0)
    pix[0, 1] = 0.3            # patch 1: one grey (level 2 per channel) for every pixel
    grey = (2 << 6) | (2 << 3) | 2
    pred = torch.full((1, 2, 512), -30.0)
    pred[0, 0, [0, 6 << 6]] = 0.0
    pred[0, 1, grey] = 0.0
    pred.requires_grad_(True)
    loss, guess, true = TARGETS["color_histogram"].loss(pred, pix, 3)
    assert loss.item() == pytest.approx(math.log(2) / 2, abs=1e-6)  # the targets' entropy: the minimum
    loss.backward()
    assert pred.grad.abs().max() < 1e-6
    assert true.tolist() == [[3 << 6, grey]]  # the mean colour's class, as for mean_color's accuracy
    assert guess.tolist() == true.tolist()  # guessed through the predicted distribution's mean colour
    single = F.one_hot(torch.tensor([[3, 100]]), 512).float()
    torch.testing.assert_close(TARGETS["color_histogram"].loss(single, pix[:, 1:].expand(1, 2, -1, -1, -1), 3)[0],
                               TARGETS["mean_color"].loss(single, pix[:, 1:].expand(1, 2, -1, -1, -1), 3)[0])


def test_hog_target_is_each_cells_gradient_orientations():
    """A vertical edge puts the patch's gradient in orientation 0 of the two cells it crosses, a
    horizontal one half in orientation 4 and half in 5 (90 degrees falls between their centres),
    each patch normalised to length 1; a flat patch stays zero and a perfect guess has no gradient."""
    pix = torch.zeros(1, 3, 3, 8, 8, dtype=torch.float64)
    pix[0, 0, :, :, 4:] = 1.0  # the edge between columns 3 and 4: the left and the right cells of each row
    pix[0, 1, :, 4:, :] = 1.0  # the edge between rows 3 and 4
    h = hog(pix).view(3, HOG_BINS, HOG_CELLS, HOG_CELLS)
    vertical, horizontal = torch.zeros(2, HOG_BINS, HOG_CELLS, HOG_CELLS)
    vertical[0] = 0.5                              # 4 equal entries of a unit vector
    horizontal[4] = horizontal[5] = 8 ** -0.5      # 8 of them
    torch.testing.assert_close(h[0], vertical, atol=1e-3, rtol=0)
    torch.testing.assert_close(h[1], horizontal, atol=2e-3, rtol=0)
    assert (h[1, 4] - h[1, 5]).abs().max() < 1e-6 and (h[2] == 0).all()
    pred = hog(pix).clone().requires_grad_(True)
    loss, guess, true = TARGETS["hog"].loss(pred.float(), pix, 3)
    loss.backward()
    assert loss.item() == 0 and pred.grad.abs().max() == 0 and (guess == true).all()
    assert TARGETS["hog"].loss(torch.zeros(1, 3, 36), pix, 3)[0].item() == pytest.approx(2 / 3, abs=1e-2)


def test_pixels_and_regression_colors():
    pix = torch.rand(2, 3, 3, 4, 4)
    torch.testing.assert_close(TARGETS["pixels"].colors(pix.flatten(2), 3), pix.mean((-1, -2)))
    out = TARGETS["mean_color_regression"].colors(torch.tensor([[[1.5, -0.2, 0.5]]]), 3)
    assert out.tolist() == [[[1.0, 0.0, 0.5]]]


@pytest.mark.parametrize("target", ["pixels", "mean_color_regression"])
def test_the_regression_targets_are_least_at_the_truth_in_its_own_order(target):
    """The pixel target in channel, row, column order and the mean colour in RGB: the loss is 0 with
    no gradient at the truth, and more for the truth transposed or with its channels swapped."""
    torch.manual_seed(0)
    pix = torch.rand(2, 3, 3, 4, 4, dtype=torch.float64)
    pix[..., :2, :] += 0.5  # rows unlike columns, channels unlike each other: a permutation shows
    pix[:, :, 1] *= 0.5
    truth = pix.flatten(2) if target == "pixels" else pix.mean((-1, -2))
    pred = truth.float().clone().requires_grad_(True)
    loss, guess, true = TARGETS[target].loss(pred, pix, 3)
    loss.backward()
    assert loss.item() < 1e-12 and pred.grad.abs().max() < 1e-6 and torch.equal(guess, true)
    swapped = pix.flip(2)
    others = [swapped.flatten(2) if target == "pixels" else swapped.mean((-1, -2))]
    if target == "pixels":
        others.append(pix.transpose(-1, -2).flatten(2))
    for other in others:
        assert TARGETS[target].loss(other.float(), pix, 3)[0].item() > 1e-3


@pytest.mark.parametrize("objective", ["supervised", "classify"])
def test_the_label_heads_read_their_token_and_smooth_their_labels_as_configured(objective):
    """The supervised head reads the [class] token, the fine-tune's the pool it is given, and both
    smooth the labels by their own setting: the loss is torch's cross-entropy of those logits."""
    key = "supervised" if objective == "supervised" else "finetune"
    task = task_for(objective, num_classes=5, **{key: {"label_smoothing": 0.2, **({"pool": "avg"} if key == "finetune"
                                                                                   else {})}})
    for p in task.head.parameters():
        torch.nn.init.normal_(p)
    images, labels = batch(6), torch.arange(6) % 5
    features = task.encoder(task.inputs(images)[1])
    pooled = features[:, 0] if objective == "supervised" else features[:, task.encoder.vit.num_prefix_tokens:].mean(1)
    logits = task.head(pooled.float())
    torch.testing.assert_close(task.logits(images), logits)
    loss, _ = task(images, labels)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=0.2))
    assert abs(loss.item() - F.cross_entropy(logits, labels).item()) > 1e-3


def test_random_other_patch_offsets_uniform():
    """The other patch of a random replacement is any patch of the image but itself, each equally likely."""
    c = sample_corruption(4000, 8, 0.5, 0.0, 1.0, 0.0, generator=torch.Generator().manual_seed(0))
    off = (c.src - torch.arange(8)) % 8
    counts = torch.bincount(off[c.chosen], minlength=8).double()
    assert counts[0] == 0  # never itself
    n = counts.sum()
    expect = n / 7
    sigma = (n * (1 / 7) * (6 / 7)) ** 0.5
    assert ((counts[1:] - expect).abs() < 4 * sigma).all(), counts  # 16,000 draws: each offset 2,286 ± 44


def test_the_hog_target_runs_at_any_bits():
    """hog's classes are its 36 orientation bins, whatever mpp.bits says: at bits=1 (8 colours) the
    batch's baseline accuracy counted them in a table of 8 and the first step failed."""
    from mpp.config import build_config
    from mpp.models import create_encoder
    from mpp.objectives import build_task
    torch.manual_seed(0)
    for bits in (1, 3):
        task = build_task(build_config({"objective": "mpp", "mpp": {"target": "hog", "bits": bits}}),
                          create_encoder("vit_micro4_32", attn="math"), None)
        images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
        loss, metrics = task(images)
        assert torch.isfinite(loss) and metrics["baseline"].sum() > 0


def test_the_prediction_figure_scores_the_colour_classes_training_does():
    """Patches whose mean lies exactly on a level boundary (k/8) take the class training gives them:
    the figure averages in float64 as the target does (in float32, about 5% of such patches fell
    in the class below or above)."""
    from mpp.config import build_config
    from mpp.figures.predictions import predict
    from mpp.models import create_encoder
    from mpp.objectives import build_task
    from mpp.targets import mean_color_targets, quantize
    rng = np.random.default_rng(0)
    patches = []
    while len(patches) < 64:  # 4x4 uint8 patches summing to 255 * 16 * k / 8 (a mean of exactly k/8)
        k = int(rng.integers(1, 8))
        px = rng.integers(0, 256, 16)
        px[-1] = 255 * 2 * k - px[:-1].sum()
        if 0 <= px[-1] <= 255:
            patches.append(px)
    grid = np.stack(patches).reshape(8, 8, 4, 4).transpose(0, 2, 1, 3).reshape(32, 32)
    images = torch.from_numpy(np.repeat(grid[None, None], 3, 1).astype(np.uint8))
    task = build_task(build_config({"objective": "mpp"}), create_encoder("vit_micro4_32", attn="math"), None)
    figure = predict(task, images)
    training = mean_color_targets(images.float() / 255, 4, bits=3)
    assert len(set(training.flatten().tolist())) > 1 and torch.equal(quantize(figure.true, 3), training)


def test_inputs_are_normalised_by_the_data_statistics_which_no_checkpoint_holds():
    """data.mean and data.std travel with the task to its device (a copy of host numbers at every
    step waits on a GPU's queue), but stay out of its state: checkpoints written before load, and
    a run of other statistics resumes as it did."""
    from mpp.data.transforms import normalize, to_float01
    cfg = build_config({"objective": "mpp", "data": {"mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 0.125]}})
    task = build_task(cfg, create_encoder("vit_micro4_32", attn="math"), None)
    assert not [k for k in task.state_dict() if "norm" in k and not k.startswith("encoder.")]
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    x01, x = task.inputs(images)
    torch.testing.assert_close(x, normalize(to_float01(images), (0.1, 0.2, 0.3), (0.5, 0.25, 0.125)))
    assert x[:, 2].mean() > x[:, 0].mean()  # the statistics of the config, not the defaults


def test_the_regression_accuracy_scores_the_predicted_colour_not_the_true_one():
    """mean_color_regression's `acc` compares the prediction's colour class with the truth's: a
    prediction far from the colours scores below 1 (logging 1.0 whatever the head says hides a dead head)."""
    torch.manual_seed(0)
    pix = torch.rand(2, 3, 3, 4, 4, dtype=torch.float64)
    colors = pix.mean((-1, -2))
    _, guess, true = TARGETS["mean_color_regression"].loss((1 - colors).float(), pix, 3)
    assert torch.equal(true, quantize(colors, 3)) and torch.equal(guess, quantize(1 - colors, 3))
    assert (guess == true).float().mean().item() < 1
    _, guess, true = TARGETS["mean_color_regression"].loss(colors.float(), pix, 3)
    assert torch.equal(guess, true)


def boundary_images(n, seed=0):
    """uint8 grey images of 4x4 patches whose mean is exactly k/8: a level boundary at 3 bits."""
    rng = np.random.default_rng(seed)
    patches = []
    while len(patches) < 64 * n:
        k = int(rng.integers(1, 8))
        px = rng.integers(0, 256, 16)
        px[-1] = 255 * 2 * k - px[:-1].sum()
        if 0 <= px[-1] <= 255:
            patches.append(px)
    grid = np.stack(patches).reshape(n, 8, 8, 4, 4).transpose(0, 1, 3, 2, 4).reshape(n, 1, 32, 32)
    return torch.from_numpy(np.repeat(grid, 3, 1).astype(np.uint8))


def test_training_classes_of_patches_on_a_level_boundary_are_those_of_mean_color_targets():
    """The training path averages each chosen patch in float64 as mean_color_targets does: in float32
    some means of exactly k/8 round below the boundary and train on the class under it."""
    task = task_for()
    seen, plan = spy_target(task), spy_plan(task)
    images = boundary_images(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        task(images)
    want = mean_color_targets(images.float() / 255, 4).gather(1, plan["plan"].index)
    assert torch.equal(seen["classes"], want)


def test_the_trained_heads_start_at_timm_init_and_the_fine_tune_head_at_zero():
    """The MPP and supervised heads start as ViT's (trunc-normal weights of std 0.02, zero bias);
    a wider init changes what the first steps learn. The fine-tune head starts at zero, as the paper."""
    layers = [task_for().head, *task_for("supervised", num_classes=300, supervised={"hidden_dim": 512}).head[::2]]
    for layer in layers:
        assert layer.weight.std().item() == pytest.approx(0.02, rel=0.1) and (layer.bias == 0).all()
    head = task_for("classify", num_classes=7).head
    assert (head.weight == 0).all() and (head.bias == 0).all()


def test_a_random_other_patch_needs_two_patches_an_image():
    """With one patch an image the 'random other patch' would be the patch itself: refused, unless
    mpp.random is 0."""
    with pytest.raises(ValueError, match="at least 2 patches"):
        sample_corruption(2, 1, ratio=1.0, mask=0.8, random=0.1, keep=0.1)
    c = sample_corruption(2, 1, ratio=1.0, mask=0.8, random=0.0, keep=0.2)
    assert c.chosen.all() and (c.src == 0).all()


def test_a_resumed_fine_tune_refuses_a_damaged_pool_choice():
    """finetune.pool=auto takes up the pool its checkpoint recorded; one that is not a pool means a
    damaged checkpoint, refused rather than run (it would fail later, or pool some other way)."""
    from mpp.config import ConfigError
    task = task_for("classify", num_classes=3, finetune={"pool": "auto"})
    with pytest.raises(ConfigError, match="damaged; start afresh"):
        task.restore({"pool": "max"})
    task.restore({"pool": "avg"})
    assert task.pool == "avg"


@pytest.mark.parametrize("objective", ["supervised", "classify"])
def test_a_labeled_objective_refuses_data_of_one_class(objective):
    """A classifier of one class learns nothing (its loss is 0 from the start): refused when built."""
    with pytest.raises(ValueError, match=">= 2 classes"):
        task_for(objective, num_classes=1)
    assert task_for(objective, num_classes=2).head is not None


def test_the_label_task_refuses_an_unknown_pool():
    """A pool that is neither one of mpp.models.POOLS nor auto is refused when the task is made,
    not at its first forward."""
    from mpp.objectives import ClassifyTask, _linear
    cfg = build_config({"model": PRESET, "objective": "classify"})
    encoder = create_encoder(PRESET, attn="math")
    for pool in ("max", "cls"):
        with pytest.raises(ValueError, match="choose one of token, avg or auto"):
            ClassifyTask(encoder, cfg.data, _linear(64, 3, zero=True), pool, 0.0)
    assert ClassifyTask(encoder, cfg.data, _linear(64, 3, zero=True), "auto", 0.0).pool == "auto"
