"""Frozen-feature evaluation: the few-shot solver, the linear probe, the feature cache, the
during-training evaluator and the probe end to end on generated shards."""
from __future__ import annotations

import io
import json
import math
import os
import random
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import webdataset as wds
from PIL import Image

import mpp.evaluators.features
import mpp.evaluators.fewshot as fs_mod
import mpp.evaluators.linear_probe
import mpp.objectives
from mpp import outcomes
from mpp.config import ConfigError, build_config
from mpp.data import DataError, make_loader
from mpp.evaluators import create
from mpp.evaluators.classify import Evaluator as ClassifyEvaluator
from mpp.evaluators.features import extract_features
from mpp.evaluators.fewshot import BIAS_CONSTANT, Evaluator, fewshot_correct, fewshot_eval, fewshot_lstsq
from mpp.evaluators.linear_probe import linear_probe
from mpp.models import create_encoder, save_encoder
from mpp.nonfinite import NonFiniteError
from shardutil import write_shards

ROOT = Path(__file__).resolve().parents[1]


def _blobs(n: int, centers: torch.Tensor, g: torch.Generator):
    """Gaussian class clusters around `centers` (C, D): features (n, D) and labels (n,)."""
    y = torch.randint(0, len(centers), (n,), generator=g)
    return centers[y] + torch.randn(n, centers.shape[1], generator=g), y


def test_fewshot_lstsq_matches_direct_least_squares():
    g = torch.Generator().manual_seed(0)
    for n, d in ((40, 7), (6, 30)):  # primal (N >= D) and dual (N < D) branches
        x = F.pad(torch.randn(n, d, generator=g, dtype=torch.float64), (0, 1), value=BIAS_CONSTANT)
        y = torch.randint(0, 4, (n,), generator=g)
        l2 = 3.0
        w = fewshot_lstsq(x, y, 4, l2)
        # ridge as plain least squares on the augmented system [x; sqrt(l2) I] w = [t; 0]
        t = 2.0 * F.one_hot(y, 4).double() - 1.0
        a = torch.cat([x, l2 ** 0.5 * torch.eye(d + 1, dtype=torch.float64)])
        b = torch.cat([t, torch.zeros(d + 1, 4, dtype=torch.float64)])
        direct = torch.linalg.lstsq(a, b).solution
        torch.testing.assert_close(w, direct, rtol=1e-6, atol=1e-8)


def test_fewshot_eval_separable_and_deterministic():
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(5, 16, generator=g) * 4
    x, y = _blobs(300, centers, g)
    xt, yt = _blobs(200, centers, g)
    state = torch.get_rng_state()
    out = fewshot_eval(x, y, xt, yt, shots=(1, 5), seeds=3, l2=1024.0)
    assert torch.equal(state, torch.get_rng_state())
    assert set(out) == {"1shot_mean", "1shot_std", "5shot_mean", "5shot_std"}
    assert out["5shot_mean"] > 0.9 and out["1shot_mean"] > 0.5  # chance is 0.2
    assert out == fewshot_eval(x, y, xt, yt, shots=(1, 5), seeds=3, l2=1024.0)
    full = fewshot_eval(x, y, xt, yt, shots=(1, 5), seeds=3, l2=1024.0, draws=True)
    assert {k: full[k] for k in out} == out and full["fewshot_train_labels"] == outcomes.labels_digest(y)
    for k in (1, 5):  # each draw's accuracy and outcomes; the std is their sample std
        assert [outcomes.read(e)[1].mean() for e in full[f"{k}shot_outcomes"]] == full[f"{k}shot_draws"]
        assert out[f"{k}shot_std"] == pytest.approx(np.std(full[f"{k}shot_draws"], ddof=1))
        assert out[f"{k}shot_mean"] == pytest.approx(np.mean(full[f"{k}shot_draws"]))
    one = fewshot_eval(x, y, xt, yt, shots=(1, 5), seeds=1, l2=1024.0)  # one draw: no spread to show, not 0
    assert one["1shot_std"] is None and one["5shot_std"] is None and one["5shot_mean"] > 0.9


def test_linear_probe_separable_beats_chance():
    g = torch.Generator().manual_seed(2)
    centers = torch.randn(10, 32, generator=g) * 2
    x, y = _blobs(1000, centers, g)
    xt, yt = _blobs(500, centers, g)
    out = linear_probe(x, y, xt, yt, num_classes=10)
    assert out["top1"] > 0.9 and out["top5"] >= out["top1"]
    assert out["l2"] in (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def test_a_probes_top1_and_its_per_image_record_count_the_same_images_when_logits_tie(monkeypatch):
    """Tied logits (a collapsed encoder's; here a head of zeros): top-1 came from timm's topk and
    the per-image record, which the report pairs arms by, from argmax, which break ties toward
    other classes; both now come from one pick (topk's)."""
    monkeypatch.setattr(mpp.evaluators.linear_probe, "fit_linear_head",
                        lambda x, y, c, l2, init=None: (torch.zeros(c, x.shape[1]), torch.zeros(c)))
    y = torch.arange(200) % 10
    out = linear_probe(torch.randn(200, 8), y, torch.randn(100, 8), y[:100], num_classes=10, l2_grid=(1.0,))
    pick = torch.zeros(1, 10).topk(1, 1).indices.item()  # where topk breaks a tie of ten equal logits
    _, right = outcomes.read(out["outcomes"])
    assert right.tolist() == (y[:100] == pick).tolist() and out["top1"] == pytest.approx(right.mean())


def test_the_class_count_is_the_manifests_and_never_the_test_labels(tmp_path):
    """A class the training images lack still counts where the manifest lists it; without a
    manifest, one past the largest training label (the test labels never decide it), unless that
    makes more classes than labels."""
    from mpp.data.sources import class_count
    manifest, _ = write_shards(tmp_path / "a", [4, 4], classes=5)
    assert class_count(manifest, 0, torch.tensor([0, 1])) == 5
    pattern = str(tmp_path / "a" / "{000000..000001}.tar")
    assert class_count(pattern, 8, torch.tensor([0, 3, 1, 2])) == 4
    # a stray label made a head of a billion classes (hundreds of GiB)
    with pytest.raises(DataError, match="its largest label, 999999999, would make 1000000000 classes for 3 labeled"):
        class_count(pattern, 8, torch.tensor([0, 1, 999_999_999]))


def test_linear_probe_picks_interior_regulariser_on_weak_dense_signal():
    """Weak signal spread over many dimensions with N ~ D: neither the weakest nor the strongest
    L2 is right; the held-out choice lands in between and beats the unregularised fit."""
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(5, 200, generator=g) * 0.15
    x, y = _blobs(400, centers, g)
    xt, yt = _blobs(1000, centers, g)
    grid = (1e-4, 1e-2, 1.0, 100.0)
    out = linear_probe(x, y, xt, yt, val_fraction=0.3, l2_grid=grid)
    assert grid[0] < out["l2"] < grid[-1]
    weakest = linear_probe(x, y, xt, yt, val_fraction=0.3, l2_grid=grid[:1])
    assert out["top1"] > weakest["top1"] + 0.02


def test_probe_fit_is_converged_on_vit_features():
    """The logistic fit a probe reports is the optimum of its L2, not an early-stopped one: on a
    random ViT's patch-mean features (correlated, and separable at a weak L2, where L-BFGS needs
    hundreds of iterations) going on from the returned weights lowers the objective by nothing."""
    from mpp.evaluators.features import standardize
    from mpp.evaluators.linear_probe import _fit_logistic
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (2000,), generator=g)
    img = torch.randn(2000, 3, 32, 32, generator=g) * 0.5 + torch.randn(10, 3, 1, 1, generator=g)[y] * 0.3
    torch.manual_seed(0)
    vit = create_encoder("vit_mini8_32", img_size=32).vit.eval()
    with torch.no_grad():
        x = standardize(vit.forward_features(img)[:, 1:].mean(1))[0]

    def objective(w):
        return (F.cross_entropy(x @ w[:-1] + w[-1], y) + 0.5e-4 * w[:-1].pow(2).sum()).item()
    w = _fit_logistic(x, y, 10, 1e-4)
    further = _fit_logistic(x, y, 10, 1e-4, init=w, max_iter=5000)
    assert objective(w) - objective(further) < 1e-6


def test_probe_fit_is_stationary_under_autograd():
    """The fit's written-out gradient is the objective's: at the returned weights autograd's
    gradient of cross-entropy + L2/2 |W|^2 (bias free) vanishes, for a warm start too."""
    from mpp.evaluators.linear_probe import _fit_logistic
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (600,), generator=g)
    x = torch.randn(600, 12, generator=g) + torch.randn(4, 12, generator=g)[y]
    for init in (None, torch.randn(13, 4, generator=g)):
        w = _fit_logistic(x, y, 4, 1e-2, init=init).requires_grad_(True)
        (F.cross_entropy(x @ w[:-1] + w[-1], y) + 0.5e-2 * w[:-1].pow(2).sum()).backward()
        assert w.grad.abs().max() < 1e-4


def test_linear_probe_chooses_representation_on_heldout_train_features():
    """Candidates {token, avg}: the chosen one is the informative one, whichever it is; the
    per-candidate held-out scores are reported."""
    g = torch.Generator().manual_seed(4)
    centers = torch.randn(4, 16, generator=g) * 3
    x, y = _blobs(400, centers, g)
    xt, yt = _blobs(200, centers, g)
    noise, noise_t = torch.randn(400, 16, generator=g), torch.randn(200, 16, generator=g)
    for informative in ("token", "avg"):
        other = "avg" if informative == "token" else "token"
        out = linear_probe({informative: x, other: noise}, y, {informative: xt, other: noise_t}, yt, num_classes=4)
        assert out["representation"] == informative and out["top1"] > 0.9
        assert out["heldout_top1"][informative] > 0.9 > 0.5 > out["heldout_top1"][other]


# ----------------------------------------------------------------------------- on shards

PALETTE = [(220, 40, 40), (40, 200, 40), (40, 40, 220), (220, 220, 40)]


def _colour_shards(root: Path, n: int, *, seed: int, shards: int = 2, size: int = 16) -> str:
    """Labeled shards written with webdataset.TarWriter: class c is a noisy image of PALETTE[c],
    so even a random encoder's features separate the classes. Returns the manifest path."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    entries, per = [], -(-n // shards)
    for s in range(shards):
        count = min(per, n - s * per)
        with wds.TarWriter(str(root / f"{s:06d}.tar")) as w:
            for j in range(count):
                c = int(rng.integers(len(PALETTE)))
                pixels = np.clip(np.array(PALETTE[c]) + rng.normal(0, 30, (size, size, 3)), 0, 255).astype(np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="png")
                w.write({"__key__": f"s{s}_{j}", "png": buf.getvalue(), "cls": str(c).encode()})
        entries.append({"name": f"{s:06d}.tar", "num_samples": count})
    manifest = {"num_samples": n, "shards": entries, "classes": [f"c{i}" for i in range(len(PALETTE))]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root / "manifest.json")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("colours")
    return {"train": _colour_shards(root / "train", 240, seed=0), "test": _colour_shards(root / "test", 80, seed=1)}


def _cfg(shards: dict, out: Path, **extra):
    data = {"output_dir": str(out), "model": "vit_micro4_32", "img_size": 16, "batch_size": 32,
            "data": {"train": shards["train"], "val": shards["test"], "num_workers": 1},
            "fewshot": {"train": shards["train"], "test": shards["test"], "shots": [1, 5], "seeds": 2,
                        "max_test": 40}}
    for k, v in extra.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    return build_config(data)


def test_feature_cache_hits_and_is_keyed_by_encoder(shards, tmp_path, monkeypatch):
    cfg = _cfg(shards, tmp_path / "run")
    torch.manual_seed(0)
    enc_a, enc_b = create_encoder("vit_micro4_32", img_size=16), create_encoder("vit_micro4_32", img_size=16)
    kw = dict(cfg=cfg, cache_dir=tmp_path / "cache", progress=False)
    x1, y1, _ = extract_features(enc_a, shards["test"], **kw)
    assert set(x1) == {"token", "avg"} and len(y1) == 80  # every candidate from one pass, one file
    assert x1["token"].dtype == torch.float32 and x1["avg"].shape == (80, enc_a.embed_dim)
    assert not torch.allclose(x1["token"], x1["avg"])
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1

    def no_loader(*a, **k):
        raise AssertionError("a cache hit must not read the shards")
    monkeypatch.setattr(mpp.evaluators.features, "make_loader", no_loader)
    x2, y2, _ = extract_features(enc_a, shards["test"], **kw)
    assert all(torch.equal(x1[p], x2[p]) for p in x1) and torch.equal(y1, y2)
    monkeypatch.undo()

    x3, y3, _ = extract_features(enc_b, shards["test"], **kw)
    assert torch.equal(y1, y3) and not torch.allclose(x1["token"], x3["token"])
    x4, _, _ = extract_features(enc_a, shards["test"], **{**kw, "pools": ("avg",)})
    assert set(x4) == {"avg"} and torch.allclose(x1["avg"], x4["avg"])
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 3
    shard = Path(shards["test"]).parent / "000000.tar"  # a rewritten shard must miss the cache
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    extract_features(enc_a, shards["test"], **kw)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 4
    monkeypatch.setattr(mpp.evaluators.features, "code_version", lambda: "other code")  # an upgrade
    extract_features(enc_a, shards["test"], **kw)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 5
    # another count of data workers orders the images otherwise: its own entry
    two = extract_features(enc_a, shards["test"], **{**kw, "cfg": _cfg(shards, tmp_path / "run",
                                                                        data={"num_workers": 2})})
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 6
    # ... and so does another batch, where several workers hand out whole batches in turn
    other = extract_features(enc_a, shards["test"], **{**kw, "cfg": _cfg(shards, tmp_path / "run", batch_size=8,
                                                                          data={"num_workers": 2})})
    assert not torch.equal(two.y, other.y) and len(list((tmp_path / "cache").glob("*.safetensors"))) == 7
    # the same shards named as file: URLs are the same files (a hit), fingerprinted by size and
    # mtime too: rewritten, they miss
    urls = [f"file:{p}" for p in sorted(Path(shards["test"]).parent.glob("*.tar"))]
    extract_features(enc_a, urls, **kw, num_samples=80)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 7
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    extract_features(enc_a, urls, **kw, num_samples=80)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 8


def test_probe_head_is_fitted_once_per_encoder_labels_and_grid(shards, tmp_path, monkeypatch):
    """An LP-FT head (probe_head) is cached beside the features: the same encoder, labels and
    probe settings load it (no fit), a different L2 grid, encoder or representation fits anew (the
    representations of one encoder share one extraction); a miss hashes the encoder's weights once."""
    from mpp.evaluators.linear_probe import probe_head
    cfg = _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-3, 1e-1]})
    torch.manual_seed(0)
    enc_a, enc_b = create_encoder("vit_micro4_32", img_size=16), create_encoder("vit_micro4_32", img_size=16)
    kw = dict(pool="avg", subset=(0.5, 0, 0.0, False), num_classes=4, device=torch.device("cpu"), precision="no")
    hashes = []
    real_hash = mpp.evaluators.features._weights_hash
    monkeypatch.setattr(mpp.evaluators.features, "_weights_hash", lambda e: hashes.append(1) or real_hash(e))
    first = probe_head(enc_a, cfg, **kw)
    assert len(hashes) == 1  # the features' key is computed once, for the head's key and the features
    monkeypatch.undo()
    assert first["l2"] in (1e-3, 1e-1) and first["weight"].shape == (4, enc_a.embed_dim) and first["pool"] == "avg"
    fits = []
    real_choose = mpp.evaluators.linear_probe.choose_probe
    monkeypatch.setattr(mpp.evaluators.linear_probe, "choose_probe",  # records the representations it chose from
                        lambda x, *a, **k: fits.append(list(x)) or real_choose(x, *a, **k))
    again = probe_head(enc_a, cfg, **kw)
    assert not fits and all(torch.equal(first[k], again[k]) for k in ("weight", "bias"))
    assert (again["l2"], again["heldout_top1"]) == (first["l2"], first["heldout_top1"])
    probe_head(enc_a, _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-2]}), **kw)
    probe_head(enc_b, cfg, **kw)
    assert len(fits) == 2 and len(list((tmp_path / "feature_cache").glob("head-*.safetensors"))) == 3
    token = probe_head(enc_a, cfg, **{**kw, "pool": "token"})  # its own head, from the features already there
    assert fits == [["avg"], ["avg"], ["token"]] and token["pool"] == "token"
    assert not torch.equal(token["weight"], first["weight"])
    assert len(list((tmp_path / "feature_cache").glob("head-*.safetensors"))) == 4
    assert len(list((tmp_path / "feature_cache").glob("features-*.safetensors"))) == 2  # one per encoder


def test_an_unreadable_cache_entry_is_computed_again(shards, tmp_path, caplog):
    """A damaged feature or head entry (truncated: a full disk, a killed copy) is a miss named in a
    warning: the probe head and its features are computed again, the same as before, and written
    over the bad files, instead of every later run sharing the cache stopping at it."""
    from safetensors.torch import load_file
    from mpp.evaluators.linear_probe import probe_head
    cfg = _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-1]})
    torch.manual_seed(0)
    enc = create_encoder("vit_micro4_32", img_size=16)
    kw = dict(pool="avg", subset=(0.5, 0, 0.0, False), num_classes=4, device=torch.device("cpu"), precision="no")
    first = probe_head(enc, cfg, **kw)
    entries = sorted((tmp_path / "feature_cache").glob("*.safetensors"))
    assert [p.name.split("-")[0] for p in entries] == ["features", "head"]
    for p in entries:
        os.truncate(p, 100)
    again = probe_head(enc, cfg, **kw)
    assert all(torch.equal(first[k], again[k]) for k in ("weight", "bias")) and again["l2"] == first["l2"]
    assert all(load_file(str(p)) for p in entries)  # rewritten whole
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 2 and all(any(str(p) in w for w in warned) for p in entries)


def test_probe_refit_starts_at_the_chosen_head(monkeypatch):
    """fit_linear_head's warm start is the given raw-feature head carried into the refit's
    standardised coordinates (a fit that stops at once returns it unchanged), and from
    choose_probe's head the refit on all features ends at the same objective as one from zeros."""
    from mpp.evaluators.features import feature_stats
    from mpp.evaluators.linear_probe import choose_probe, fit_linear_head
    g = torch.Generator().manual_seed(3)
    x, y = _blobs(600, torch.randn(4, 12, generator=g) * 2, g)
    x = x * torch.linspace(0.1, 20, 12) + 5
    weight, bias = torch.randn(4, 12, generator=g), torch.randn(4, generator=g)
    monkeypatch.setattr(mpp.evaluators.linear_probe, "_fit_logistic", lambda x, y, c, l2, init=None: init)
    w, b = fit_linear_head(x, y, 4, 1e-2, init=(weight, bias))
    monkeypatch.undo()
    torch.testing.assert_close((w, b), (weight, bias), rtol=1e-4, atol=1e-4)
    choice = choose_probe({"x": x}, y, num_classes=4, l2_grid=(1e-3, 1e-1))
    mean, std = feature_stats(x)

    def objective(w, b):
        return (F.cross_entropy(x @ w.T + b, y) + 0.5 * choice.l2 * (w * std).pow(2).sum()).item()
    warm = fit_linear_head(x, y, 4, choice.l2, init=choice.head)
    assert not torch.equal(warm[0], choice.head[0])  # refitted on all the features
    assert objective(*warm) == pytest.approx(objective(*fit_linear_head(x, y, 4, choice.l2)), abs=1e-5)


def test_starting_head_takes_the_strongest_l2_within_a_standard_error_of_the_lowest_loss():
    """A fine-tune's starting head (choose_probe's head_l2) is not the top-1 choice: on weakly
    informative features, as a random-init encoder's, held-out top-1 picks a weak L2 whose head
    has a large norm (which, clipped, starved a fine-tune's encoder); the start takes the strongest
    L2 whose held-out cross-entropy is within one standard error of the lowest."""
    from mpp.evaluators.linear_probe import choose_probe
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 4, (600,), generator=g)
    x = torch.randn(600, 32, generator=g) * 0.01 + 0.006 * F.one_hot(y, 32).float()
    grid = (1e-6, 1e-3, 1e-2, 1e-1, 1.0)
    c = choose_probe({"x": x}, y, num_classes=4, l2_grid=grid)
    lowest = min(c.losses, key=lambda l2: c.losses[l2][0])
    assert c.l2 == lowest == 0.1 and set(c.losses) == set(grid)  # top-1 and the loss both pick 0.1 here
    assert c.head_l2 == 1.0 and c.losses[1.0][0] <= c.losses[lowest][0] + c.losses[lowest][1]
    assert c.start_head[0].norm() < c.head[0].norm() / 2  # a far smaller head at a loss within noise
    informative = x + 0.05 * F.one_hot(y, 32).float()  # features that say a lot: the start is the top-1 fit
    c = choose_probe({"x": informative}, y, num_classes=4, l2_grid=grid)
    assert c.head_l2 < 1.0 and torch.equal(c.start_head[0], c.head[0]) == (c.head_l2 == c.l2)


def test_starting_head_takes_top1_among_the_near_losses_where_none_beats_a_uniform_guess():
    """On a few dozen held-out images of features that say little, no head's cross-entropy beats a
    uniform guess's (log C) by its standard error, and the strongest L2 within it is a head near
    zero. The start then takes, of the L2s within that standard error, the best held-out top-1:
    neither that empty head nor the large, overconfident one top-1 alone picks."""
    from mpp.evaluators.linear_probe import choose_probe
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (300,), generator=g)
    x = torch.randn(300, 64, generator=g) + 0.5 * F.one_hot(y, 64).float()
    grid = (1e-6, 1e-4, 1e-2, 1.0, 10.0)
    c = choose_probe({"x": x}, y, num_classes=10, l2_grid=grid)
    lowest, se = min(c.losses.values())
    assert lowest + se >= math.log(10)  # the case: the loss cannot tell any head from a uniform guess
    near = [l2 for l2 in grid if c.losses[l2][0] <= lowest + se]
    top1 = c.scores["x"]
    assert c.head_l2 in near and top1[c.head_l2] == max(top1[l2] for l2 in near)
    assert c.l2 < c.head_l2 < max(grid) and top1[c.head_l2] > top1[max(grid)]  # a head, and not the empty one
    assert c.losses[c.head_l2][0] < 2.5 < c.losses[c.l2][0]  # top-1 alone took a large, overconfident head


def test_fewshot_evaluator_leaves_rng_and_mode_alone(shards, tmp_path):
    cfg = _cfg(shards, tmp_path / "run", train={"precision": "bf16"}, probe={"pool": "token"})
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16).train()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    evaluator = create("fewshot", cfg, "cpu")
    first = evaluator.run(encoder)
    second = evaluator.run(encoder)
    assert (random.getstate(), torch.get_rng_state().tolist()) == (states[0], states[2].tolist())
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert encoder.training
    assert first == second and set(first) == {"1shot_mean", "1shot_std", "5shot_mean", "5shot_std"}
    assert first["5shot_mean"] > 0.5  # 4 colour classes: chance is 0.25
    both = create("fewshot", _cfg(shards, tmp_path / "run"), "cpu").run(encoder)  # probe.pool=auto: every candidate
    assert set(both) == {f"{p}/{k}" for p in ("token", "avg") for k in first}
    assert all(both[f"token/{k}"] == v for k, v in first.items())
    tr_x, _, te_x, _, _ = evaluator._data[16]
    # class-balanced subsets: per-class rounding moves the totals by at most one per class
    assert tr_x.dtype == torch.uint8 and abs(len(te_x) - 40) <= 4 and len(tr_x) <= 5 * 2 * 4 + 4


def test_fewshot_evaluator_reports_the_samples_it_skipped(shards, tmp_path):
    """Unreadable images of the few-shot sets were skipped and only logged once, never recorded:
    each call returns them by kind (TensorBoard's fewshot/skipped_*), with its scores."""
    bad, _ = write_shards(tmp_path / "bad", [20, 20], classes=4, seed=3,
                          extra=lambda s, j: {"png": b"not a png"} if j < 3 else {})
    cfg = _cfg(shards, tmp_path / "run", probe={"pool": "token"}, fewshot={"test": bad})
    figures = create("fewshot", cfg, "cpu").run(create_encoder("vit_micro4_32", img_size=16))
    assert figures["skipped_corrupt_image"] == 6 and "5shot_mean" in figures
    clean = create("fewshot", _cfg(shards, tmp_path / "clean", probe={"pool": "token"}), "cpu")
    assert not [k for k in clean.run(create_encoder("vit_micro4_32", img_size=16)) if k.startswith("skipped")]


def _constant_cls(module, inputs, tokens):
    """A forward hook on the final norm that makes the [class] token's output carry nothing."""
    return torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, 1:]], dim=1)


def test_probe_reads_patch_tokens_when_the_class_token_is_uninformative(shards, tmp_path):
    """An encoder whose [class] output is constant (as MPP leaves the path it never trains, at the
    extreme) is probed, and few-shot evaluated, through the mean of its patch tokens; forcing
    probe.pool=token shows what the old fixed choice gave."""
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")
    save_encoder(encoder, tmp_path)  # the file whose sha256 the probe records
    encoder.vit.norm.register_forward_hook(_constant_cls)
    monkey_load = lambda *a, **k: encoder  # noqa: E731 -- the hooked encoder stands for a loaded one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mpp.evaluators.linear_probe, "encoder_from", monkey_load)
        auto = mpp.evaluators.linear_probe.run_linear_probe(_cfg(shards, tmp_path / "auto",
                                                                 probe={"encoder": str(tmp_path)}))
        forced = mpp.evaluators.linear_probe.run_linear_probe(_cfg(shards, tmp_path / "token",
                                                    probe={"encoder": str(tmp_path), "pool": "token"}))
        on_dev = mpp.evaluators.linear_probe.run_linear_probe(_cfg(shards, tmp_path / "dev",
                                                    probe={"encoder": str(tmp_path), "dev_split": [0, 0.25]}))
    # probe.dev_split: chosen on that development split of all the labels (60 of 240), fitted on the rest, every
    # training image in the refit and the shots
    assert on_dev["pool"] == "avg" and on_dev["num_train"] == 240 and not [k for k in on_dev if "heldout" in k]
    assert on_dev["pool_dev_top1"]["avg"] > 0.6 > 0.5 > on_dev["pool_dev_top1"]["token"]
    dev_labels = make_loader(shards["train"], batch_size=60, img_size=16, train=False, labeled=True,
                             data_cfg=_cfg(shards, tmp_path).data, subset=(1.0, 0, 0.25, True))
    dev_labels = torch.cat([b["label"] for b in dev_labels.epoch(0)]).numpy()
    for pool, record in on_dev["pool_dev_outcomes"].items():
        assert record == {**record, "n": 60, "labels": outcomes.labels_digest(dev_labels)}
        assert outcomes.read(record)[1].mean() == pytest.approx(on_dev["pool_dev_top1"][pool])
    assert auto["pool"] == "avg" and auto["pool_setting"] == "auto"
    assert set(auto["pool_heldout_top1"]) == {"token", "avg"}
    assert auto["pool_heldout_top1"]["avg"] > 0.6 and auto["pool_heldout_top1"]["token"] < 0.5  # chance 0.25
    assert {p: outcomes.read(r)[1].mean() for p, r in auto["pool_heldout_outcomes"].items()} == \
        pytest.approx(auto["pool_heldout_top1"])  # the held-out images behind each score, for the report's lead
    assert auto["top1"] > 0.6 and forced["pool"] == "token" and forced["top1"] < 0.5
    assert auto["5shot_mean"] > forced["5shot_mean"] + 0.2
    assert json.loads((tmp_path / "auto" / "metrics.json").read_text())["pool"] == "avg"


def test_probing_an_encoder_at_another_img_size_than_its_own_warns(shards, tmp_path, monkeypatch, capsys):
    """A frozen encoder probed at another resolution has its position embeddings resampled: one
    warning line naming both sizes; none at its own size or with img_size unset."""
    save_encoder(create_encoder("vit_micro4_32", img_size=16, attn="math"), tmp_path / "enc")
    monkeypatch.setattr(mpp.evaluators.linear_probe.Evaluator, "run", lambda self, encoder: {})
    for size in (32, 16, 0):
        mpp.evaluators.linear_probe.run_linear_probe(_cfg(shards, tmp_path / f"at{size}", img_size=size,
                                                          probe={"encoder": str(tmp_path / "enc")}))
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
        assert err == ([f"warning: probe.encoder='{tmp_path}/enc' was trained at 16 px and is probed at img_size=32: "
                        "its position embeddings are resampled; leave img_size unset (or give img_size=16) to probe "
                        "it at its own"] if size == 32 else []), size


def test_train_deterministic_holds_for_the_probe_alone_and_keeps_its_figures(shards, tmp_path, monkeypatch):
    """train.deterministic covers the probe's features and fits as it covers training (the probe
    reads train.* too: train.attn); the process gets its setting back, and on the CPU nothing moves."""
    seen, run = [], mpp.evaluators.linear_probe.Evaluator.run

    def recorded(self, encoder):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return run(self, encoder)
    monkeypatch.setattr(mpp.evaluators.linear_probe.Evaluator, "run", recorded)
    probe = mpp.evaluators.linear_probe.run_linear_probe
    plain = probe(_cfg(shards, tmp_path / "plain", probe={"encoder": "none", "cache_dir": str(tmp_path / "c1")}))
    held = probe(_cfg(shards, tmp_path / "held", probe={"encoder": "none", "cache_dir": str(tmp_path / "c2")},
                      train={"deterministic": True}))
    assert seen == [False, True] and not torch.are_deterministic_algorithms_enabled()
    keys = ("top1", "outcomes", "5shot_mean")
    assert [held[k] for k in keys] == [plain[k] for k in keys]


def test_choose_probe_chooses_the_representation_on_a_development_split():
    """Given a development split, the representation is the one whose fit scores best there, not on
    the held-out training part: a representation that memorised the training images (informative
    on all of them, noise elsewhere, as a supervised encoder's features of images it fitted) wins
    the held-out part and loses the development split."""
    from mpp.evaluators.linear_probe import choose_probe
    g = torch.Generator().manual_seed(0)
    y, dev_y = torch.arange(400) % 4, torch.arange(200) % 4

    def features(labels, signal):
        return torch.nn.functional.one_hot(labels, 8).float() * signal + torch.randn(len(labels), 8, generator=g)
    train = {"memorised": features(y, 3.0), "general": features(y, 1.0)}
    dev = {"memorised": features(dev_y, 0.0), "general": features(dev_y, 1.0)}
    plain = choose_probe(train, y, num_classes=4, l2_grid=(1e-3, 1e-1))
    on_dev = choose_probe(train, y, num_classes=4, l2_grid=(1e-3, 1e-1), dev=(dev, dev_y))
    assert (plain.pool, plain.on, on_dev.pool, on_dev.on) == ("memorised", "heldout", "general", "dev")
    best = {n: max(s.values()) for n, s in on_dev.scores.items()}
    assert best["general"] > 0.5 > 0.35 > best["memorised"]
    assert on_dev.l2 == max(on_dev.scores["general"], key=lambda l2: (on_dev.scores["general"][l2], l2))
    for name, record in on_dev.outcomes.items():  # the images the choice was made on: the development split
        assert record["n"] == 200 and outcomes.read(record)[1].mean() == pytest.approx(best[name])
    assert on_dev.start_head[0].shape == (4, 8)


def test_choose_probe_chooses_the_l2_on_a_development_split():
    """Given a development split, the L2 too is chosen there, each strength fitted on every training
    image: features that memorised the training labels in many dimensions beside a weak general
    signal ask for another L2 on held-out training images than on images the encoder never fitted."""
    from mpp.evaluators.linear_probe import choose_probe, fit_linear_head
    g = torch.Generator().manual_seed(0)
    y, dev_y = torch.arange(400) % 4, torch.arange(200) % 4

    def features(labels, signal, d):
        return torch.nn.functional.one_hot(labels, 4).float().repeat(1, d // 4) * signal + torch.randn(len(labels), d,
                                                                                                       generator=g)
    train = torch.cat([features(y, 1.0, 4), features(y, 0.6, 60)], 1)
    dev = torch.cat([features(dev_y, 1.0, 4), features(dev_y, 0.0, 60)], 1)
    grid = (1e-4, 1e-2, 1.0, 100.0)
    plain = choose_probe({"x": train}, y, num_classes=4, l2_grid=grid)
    on_dev = choose_probe({"x": train}, y, num_classes=4, l2_grid=grid, dev=({"x": dev}, dev_y))
    direct = {}
    for l2 in grid:  # each strength fitted on all the training features, scored on the development split
        weight, bias = fit_linear_head(train, y, 4, l2)
        direct[l2] = (dev @ weight.T + bias).argmax(1).eq(dev_y).float().mean().item()
    assert on_dev.scores["x"] == pytest.approx(direct, abs=1 / 200 + 1e-6)
    assert on_dev.l2 == max(direct, key=lambda l2: (direct[l2], l2)) != plain.l2
    assert plain.scores["x"][plain.l2] > 0.9 > 0.5 > direct[plain.l2]  # the held-out part's L2 flatters it


def test_linear_probe_refits_on_the_development_split_too():
    """With a development split the probe chooses there, then refits on the training features and
    the split's together: its labels are training labels, which the final head should not waste.
    Here the split alone holds classes 2 and 3, which only a head fitted on it can predict."""
    from mpp.evaluators.linear_probe import fit_linear_head, linear_probe
    g = torch.Generator().manual_seed(4)
    centers = torch.randn(4, 8, generator=g) * 4
    x, y = _blobs(800, centers, g)
    train, dev, test = y < 2, torch.arange(800) % 4 == 0, torch.arange(800) % 4 == 1
    train &= ~(dev | test)
    out = linear_probe({"x": x[train]}, y[train], {"x": x[test]}, y[test], num_classes=4, l2_grid=(1e-3, 1e-1),
                       dev=({"x": x[dev]}, y[dev]))
    weight, bias = fit_linear_head(torch.cat([x[train], x[dev]]), torch.cat([y[train], y[dev]]), 4, out["l2"])
    assert out["top1"] == pytest.approx((x[test] @ weight.T + bias).argmax(1).eq(y[test]).float().mean().item(),
                                        abs=2 / test.sum().item())
    assert out["top1"] > 0.9 and (y[test] >= 2).float().mean() > 0.4  # classes 2 and 3 are half the test images


def test_choose_probe_shows_its_fits(capsys):
    """The probe's fits, minutes on a CPU after the features' bar ended, showed nothing: a user could
    not tell them from a hang. A bar counts them: every fold, representation and L2."""
    from mpp.evaluators.linear_probe import choose_probe
    g = torch.Generator().manual_seed(5)
    x, y = _blobs(120, torch.randn(3, 6, generator=g) * 3, g)
    choose_probe({"token": x, "avg": -x}, y, num_classes=3, l2_grid=(1e-3, 1e-1, 10.0), folds=4)
    err = capsys.readouterr().err
    assert "probe fits" in err and "/24 [" in err, err[-500:]  # 4 folds x 2 representations x 3 L2s


def test_fine_tune_pool_auto_reads_patch_tokens_when_the_class_token_is_uninformative(shards, tmp_path):
    """finetune.pool=auto chooses the representation as the probe does, but on the run's own
    labels (a probe of its training part, scored on its development split): the patch mean for an
    encoder whose [class] output is constant, under a zero head as under a probe head; the choice
    is recorded, and kept when the run resumes (where the choice is not made again)."""
    from mpp.train import train
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")
    save_encoder(encoder, tmp_path)  # the file the fine-tunes record the digest of
    encoder.vit.norm.register_forward_hook(_constant_cls)
    run = dict(objective="classify", steps=1, data={"eval_crop_pct": 1.0}, train={"attn": "math"},
               optim={"name": "sgd", "warmup_steps": 1, "weight_decay": 0.0})  # one step at lr 0: nothing moves
    tune = {"init": str(tmp_path), "pool": "auto", "label_fraction": 0.5, "dev_fraction": 0.25}
    with pytest.MonkeyPatch.context() as mp:
        # the hooked encoder stands for a loaded one
        mp.setattr(mpp.objectives, "encoder_from", lambda *a, **k: encoder)
        zero = train(_cfg(shards, tmp_path / "zero", finetune=tune, **run))
        probe = train(_cfg(shards, tmp_path / "probe", finetune={**tune, "head_init": "probe"}, **run))
        chosen_again = []
        mp.setattr(mpp.evaluators.linear_probe, "probe_head",
                   lambda *a, real=mpp.evaluators.linear_probe.probe_head, **k: chosen_again.append(1) or real(*a, **k))
        (tmp_path / "probe" / "metrics.json").unlink()  # as stopped at step 1: a finished run is refused more steps
        longer = train(_cfg(shards, tmp_path / "probe", finetune={**tune, "head_init": "probe"},
                            **{**run, "steps": 2, "optim": {**run["optim"], "warmup_steps": 2}}))
    assert not chosen_again  # the resume took the checkpoint's choice
    for m in (zero, probe, longer):
        assert m["pool"] == "avg", m
        assert m["pool_dev_top1"]["avg"] > 0.6 > 0.5 > m["pool_dev_top1"]["token"]
        assert not [k for k in m if "heldout" in k]  # nothing chosen on the held-out training part
        assert set(m["pool_head_l2"]) == {"token", "avg"}  # each one's starting-head L2, for the finals
        for pool, record in m["pool_dev_outcomes"].items():  # the development split the run was scored on
            assert record["n"] == m["outcomes"]["n"] and record["labels"] == m["outcomes"]["labels"]
            assert outcomes.read(record)[1].mean() == pytest.approx(m["pool_dev_top1"][pool])
    assert probe["top1"] > 0.6 and probe["evaluated_on"] == "dev"  # the probe head on the patch mean
    assert probe["start_top1"] == probe["top1"] and probe["head_probe_l2"] == probe["pool_head_l2"]["avg"]
    assert "start_top1" not in zero and "head_probe_l2" not in zero  # a zero head: no start worth scoring
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ConfigError, match="finetune.pool=auto, but the checkpoint"):
        mp.setattr(mpp.objectives, "encoder_from", lambda *a, **k: encoder)
        fixed = {**tune, "pool": "token"}  # a run through a fixed pool, then resumed with auto
        train(_cfg(shards, tmp_path / "fixed", finetune=fixed, **{**run, "train": {**run["train"], "ckpt_every": 1}}))
        (tmp_path / "fixed" / "metrics.json").unlink()
        train(_cfg(shards, tmp_path / "fixed", finetune=tune, **{**run, "steps": 2}))


def test_choose_probe_with_folds_scores_every_labeled_image():
    """With folds, the representation is chosen on every labeled image, the training part and the
    development split together, each scored by fits that never saw it: a small development split
    on which the weaker representation happens to win (as 500 CIFAR images did) no longer decides."""
    from mpp.evaluators.linear_probe import choose_probe
    g = torch.Generator().manual_seed(0)
    y, dev_y = torch.arange(400) % 4, torch.arange(20) % 4

    def features(labels, signal):
        return torch.nn.functional.one_hot(labels, 8).float() * signal + torch.randn(len(labels), 8, generator=g)
    train = {"weak": features(y, 0.7), "strong": features(y, 1.5)}
    dev = (({"weak": features(dev_y, 3.0), "strong": features(dev_y, 0.0)}), dev_y)  # the weak one wins here
    kw = dict(num_classes=4, l2_grid=(1e-3, 1e-1))
    one, cv = choose_probe(train, y, dev=dev, **kw), choose_probe(train, y, dev=dev, folds=5, **kw)
    assert (one.pool, one.on, cv.pool, cv.on) == ("weak", "dev", "strong", "cv")
    for name, record in cv.outcomes.items():  # every labeled image once
        assert record["n"] == 420 and outcomes.read(record)[1].mean() == pytest.approx(max(cv.scores[name].values()))
    assert choose_probe(train, y, dev=dev, folds=5, **kw).scores == cv.scores  # seeded folds
    assert choose_probe(train, y, dev=dev, folds=5, seed=1, **kw).scores != cv.scores
    twice = choose_probe(train, y, dev=dev, folds=5, num_classes=4, l2_grid=(1e-3, 1e-1, 1e-3))  # a repeated L2
    assert (twice.scores, twice.losses, twice.outcomes) == (cv.scores, cv.losses, cv.outcomes)
    alone = choose_probe(train, y, folds=4, **kw)  # without a development split: the training labels in folds
    assert alone.on == "cv" and {r["n"] for r in alone.outcomes.values()} == {400}
    with pytest.raises(DataError, match="pool_folds=5 needs at least 5 labeled samples"):
        choose_probe({"x": torch.randn(3, 2)}, torch.arange(3), folds=5, **kw)


@pytest.mark.parametrize("init, config, fitted", [
    ("none", None, False), ("run", "objective: mpp\n", False), ("run/encoder.safetensors", "objective: mpp\n", False),
    ("run", "objective: supervised\n", True), ("run", "objective: classify\n", True), ("run", None, True),
    ("run", "objective: [mpp\n", True), ("run", "- mpp\n", True)])
def test_fitted_labels_trusts_only_a_label_free_pre_training(tmp_path, init, config, fitted):
    """Folds validate a probe on the images the encoder was pre-trained on, which flatters what it
    memorised where it fitted their labels: only a random init or a run whose config.yaml says
    objective: mpp is known not to have; a supervised or fine-tuned run, or one whose config is
    missing or unreadable, is taken as fitted."""
    from mpp.evaluators.linear_probe import fitted_labels
    (tmp_path / "run").mkdir()
    if config is not None:
        (tmp_path / "run" / "config.yaml").write_text(config)
    assert fitted_labels(init if init == "none" else str(tmp_path / init)) is fitted


def test_fine_tune_pool_folds_only_for_an_encoder_that_never_fitted_labels(shards, tmp_path):
    """finetune.pool_folds scores a fine-tune's representation choice on all its labels in folds
    when its init never trained on labels (pool_cv_*, every labeled image once); from a supervised
    pre-training the development split alone decides, as without folds; and a final given its
    representation and its head's L2 chooses nothing, so fits no folds."""
    from mpp.train import train
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")
    save_encoder(encoder, tmp_path)
    encoder.vit.norm.register_forward_hook(_constant_cls)
    run = dict(objective="classify", steps=1, data={"eval_crop_pct": 1.0}, train={"attn": "math"},
               optim={"name": "sgd", "warmup_steps": 1, "weight_decay": 0.0})
    tune = {"init": str(tmp_path), "pool": "auto", "label_fraction": 0.5, "dev_fraction": 0.25, "pool_folds": 3}
    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mpp.objectives, "encoder_from", lambda *a, **k: encoder)
        for objective in ("mpp", "supervised"):
            (tmp_path / "config.yaml").write_text(f"objective: {objective}\n")
            seen[objective] = train(_cfg(shards, tmp_path / objective, finetune=tune, **run))
        final = {**tune, "pool": "avg", "dev_fraction": 0.0, "head_init": "probe", "head_l2": 0.01}
        (tmp_path / "config.yaml").write_text("objective: mpp\n")
        seen["final"] = train(_cfg(shards, tmp_path / "final_mpp", finetune=final, **run))
    cv, dev = seen["mpp"], seen["supervised"]
    assert cv["pool"] == dev["pool"] == "avg" and "pool_dev_top1" not in cv and "pool_cv_top1" not in dev
    assert cv["pool_cv_top1"]["avg"] > 0.6 > 0.5 > cv["pool_cv_top1"]["token"]
    for record in cv["pool_cv_outcomes"].values():  # the training part and the development split, once each
        assert record["n"] == cv["train_samples"] + cv["val_samples"]
    assert {r["n"] for r in dev["pool_dev_outcomes"].values()} == {dev["val_samples"]}
    assert "head_probe_heldout_top1" in seen["final"] and not [k for k in seen["final"] if "_cv_" in k]


@pytest.mark.slow
def test_linear_probe_tool_end_to_end(shards, tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    save_encoder(create_encoder("vit_micro4_32", img_size=16), tmp_path / "pretrain")
    out = tmp_path / "probe"
    cmd = [sys.executable, str(ROOT / "tools/linear_probe.py"), "model=vit_micro4_32", "img_size=16",
           "batch_size=32", f"output_dir={out}", f"probe.encoder={tmp_path / 'pretrain'}",
           f"data.train={shards['train']}", f"data.val={shards['test']}", "data.num_workers=1",
           "fewshot.shots=[1,5]", "fewshot.seeds=2", "probe.l2_grid=[1e-5,1e-2]"]
    run = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's mpp, not the installed one
    assert run.returncode == 0, run.stderr
    m = json.loads((out / "metrics.json").read_text())
    assert m["kind"] == "linear_probe" and m["num_train"] == 240 and m["num_test"] == 80
    assert m["top1"] > 0.6 and m["5shot_mean"] > 0.5  # chance is 0.25
    assert m["pool"] in ("token", "avg") and set(m["pool_heldout_top1"]) == {"token", "avg"}
    assert set(m["probe_val_top1"]) == {"1e-05", "0.01"} and m["probe_l2"] in (1e-5, 1e-2)  # the grid it was given
    _, correct = outcomes.read(m["outcomes"])
    assert len(correct) == 80 and correct.mean() == pytest.approx(m["top1"])
    assert (out / "config.yaml").is_file() and (tmp_path / "feature_cache").is_dir()
    monkeypatch.setattr(sys, "argv", cmd[1:] + [f"probe.encoder={tmp_path / 'missing'}"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(cmd[1], run_name="__main__")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "missing" in err


def test_the_probe_tool_gives_its_settings_to_its_fits(shards, tmp_path, monkeypatch):
    """probe.val_fraction, probe.l2_grid, fewshot.l2, shots and seeds reach the fits that use them
    (metrics.json records the config's values, so a value dropped on the way showed nowhere)."""
    import mpp.evaluators.linear_probe as lp
    from mpp.config import load_config
    seen, lin, few = {}, lp.linear_probe, lp.fewshot_eval
    monkeypatch.setattr(lp, "linear_probe", lambda *a, **k: (seen.setdefault("lin", k), lin(*a, **k))[1])
    monkeypatch.setattr(lp, "fewshot_eval", lambda *a, **k: (seen.setdefault("few", k), few(*a, **k))[1])
    save_encoder(create_encoder("vit_micro4_32", img_size=16), tmp_path / "pretrain")
    lp.run_linear_probe(load_config(None, [
        "model=vit_micro4_32", "img_size=16", "batch_size=32", f"output_dir={tmp_path / 'probe'}",
        f"probe.encoder={tmp_path / 'pretrain'}", f"data.train={shards['train']}", f"data.val={shards['test']}",
        "data.num_workers=0", "probe.val_fraction=0.3", "probe.l2_grid=[0.5]", "fewshot.l2=7.5",
        "fewshot.shots=[2]", "fewshot.seeds=3"]))
    assert (seen["lin"]["val_fraction"], list(seen["lin"]["l2_grid"])) == (0.3, [0.5])
    assert (seen["few"]["l2"], list(seen["few"]["shots"]), seen["few"]["seeds"]) == (7.5, [2], 3)


def test_a_probe_into_a_training_runs_folder_or_a_probe_of_other_settings_is_refused(shards, tmp_path):
    """A probe writes config.yaml and metrics.json: into the folder of the run it probes it replaced
    that run's and exited 0 (the run could no longer be exported again, and a report took it for a
    probe); a finished probe of other settings, or of settings it cannot read, is refused, one of the
    same settings probed again."""
    import mpp.evaluators.linear_probe as lp
    from mpp.config import ConfigError, load_config
    run = tmp_path / "pretrain"
    save_encoder(create_encoder("vit_micro4_32", img_size=16), run)
    (run / "metrics.json").write_text('{"steps": 4}')
    before = {p.name: p.read_bytes() for p in run.iterdir()}

    def probe(out, *more):
        return lp.run_linear_probe(load_config(None, [
            "model=vit_micro4_32", "img_size=16", "batch_size=32", f"output_dir={out}", f"probe.encoder={run}",
            f"data.train={shards['train']}", f"data.val={shards['test']}", "data.num_workers=0",
            "probe.l2_grid=[0.5]", "fewshot.shots=[2]", "fewshot.seeds=1", *more]))
    with pytest.raises(ConfigError, match="holds a training run .*encoder.safetensors, metrics.json.* its own"):
        probe(run)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    first = probe(tmp_path / "probe")
    assert probe(tmp_path / "probe")["top1"] == first["top1"]  # the same settings: probed again
    assert probe(tmp_path / "probe", "optim.lr=0.5")["top1"] == first["top1"]  # and one the probe never reads
    with pytest.raises(ConfigError, match="holds a finished probe of other settings .*probe.l2_grid"):
        probe(tmp_path / "probe", "probe.l2_grid=[0.1]")
    for damaged in (b"model: [", b"model: \xff\xfe"):  # not YAML, not UTF-8: its settings unknown, so kept
        (tmp_path / "probe" / "config.yaml").write_bytes(damaged)
        with pytest.raises(ConfigError, match="holds a finished probe .* no config.yaml this mpp can read"):
            probe(tmp_path / "probe")


def test_probe_l2_grid_is_a_config_key(tmp_path):
    """probe.l2_grid reads YAML 1.1's string-typed 1e-6 as a number; an empty or non-positive grid
    is refused before any work, naming the key."""
    from mpp.config import ConfigError, load_config
    cfg = load_config(None, ["probe.l2_grid=[1e-6, 0.01, 1]"])
    assert cfg.probe.l2_grid == (1e-6, 0.01, 1.0)
    for bad in ("[]", "[0.01, 0]", "[-1]"):
        with pytest.raises(ConfigError, match="probe.l2_grid"):
            load_config(None, [f"probe.l2_grid={bad}"])
    with pytest.raises(ConfigError, match="probe.l2_grid"):
        load_config(None, ["probe.l2_grid=[weak]"])


def _ref_correct(trx, try_, tex, tey, C, l2, bias: bool = True):
    """big_vision's few-shot fit written out: standardise with the shots' statistics, a bias
    column of 100 (unless `bias` is False), ridge onto {-1, 1}, argmax."""
    trx, tex = trx.double(), tex.double()
    mean, std = trx.mean(0), trx.std(0, unbiased=False) + 1e-5
    a, b = (trx - mean) / std, (tex - mean) / std
    if bias:
        a = torch.cat([a, torch.full((len(a), 1), 100.0, dtype=torch.float64)], 1)
        b = torch.cat([b, torch.full((len(b), 1), 100.0, dtype=torch.float64)], 1)
    t = 2.0 * F.one_hot(try_, C).double() - 1.0
    w = torch.linalg.solve(a.T @ a + l2 * torch.eye(a.shape[1], dtype=torch.float64), a.T @ t)
    return (b @ w).argmax(1).eq(tey).numpy()


def _noisy(seed, n=240, C=4, D=12):
    """Gaussian classes off the origin, one feature 50 times the others' scale."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(C, D, generator=g) * 1.5
    y = torch.arange(n) % C
    x = centers[y] + torch.randn(n, D, generator=g) * 2 + 3.0  # off-centre, scaled: standardising matters
    x[:, 0] *= 50
    return x, y


@pytest.mark.parametrize("l2", [0.01, 50.0])
def test_fewshot_correct_is_standardised_bias_ridge(l2):
    """Standardised with the shots' statistics (not the test set's), the bias column, fewshot.l2."""
    x, y = _noisy(0)
    xt, yt = _noisy(1, n=400)
    xt = xt * 1.7 - 2  # a test set with other statistics: standardise with the train set's
    assert BIAS_CONSTANT == 100.0
    got = fewshot_correct(x[:40], y[:40], xt, yt, 4, l2)
    assert np.array_equal(got, _ref_correct(x[:40], y[:40], xt, yt, 4, l2))


def test_fewshot_eval_draws_follow_big_vision():
    """Seed s draws each class's first k of one seeded permutation (nested shots); the std is the
    draws' sample std."""
    x, y = _noisy(2)
    xt, yt = _noisy(3, n=300)
    out = fewshot_eval(x, y, xt, yt, shots=(2, 5), seeds=3, l2=1.0, draws=True)
    for k in (2, 5):
        want = []
        for s in range(3):
            rng = np.random.default_rng(s)
            perms = [rng.permutation(np.flatnonzero(y.numpy() == c)) for c in range(4)]
            idx = torch.from_numpy(np.concatenate([p[:k] for p in perms]))
            want.append(float(_ref_correct(x[idx], y[idx], xt, yt, 4, 1.0).mean()))
        assert out[f"{k}shot_draws"] == pytest.approx(want, abs=1e-12)
        assert len(set(want)) > 1  # the draws differ
        assert out[f"{k}shot_std"] == pytest.approx(np.std(want, ddof=1))


def test_evaluator_passes_l2_and_reads_enough_shots(monkeypatch):
    """fewshot.l2 reaches the fit, and the evaluator reads max(shots) x seeds images per class."""
    cfg = build_config({"model": "vit_micro4_32", "fewshot": {"l2": 7.0, "shots": [1, 5], "seeds": 3}})
    ev = Evaluator.__new__(Evaluator)
    ev.cfg, ev.device = cfg, torch.device("cpu")
    limits = []

    def fake_read(spec, n, *, cfg, img_size, limit):
        limits.append(limit(1000, ["a", "b", "c", "d"]))
        g = torch.Generator().manual_seed(len(limits))
        return (torch.randint(0, 256, (16, 3, img_size, img_size), dtype=torch.uint8, generator=g),
                torch.arange(16) % 4, {})
    monkeypatch.setattr(fs_mod, "_read_images", fake_read)
    monkeypatch.setattr(fs_mod, "class_count", lambda spec, n, labels: int(labels.max()) + 1)  # no shards to read
    calls = []
    real = fs_mod.fewshot_eval
    monkeypatch.setattr(fs_mod, "fewshot_eval", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    ev._data, ev._skipped = {}, {}
    with pytest.warns(UserWarning, match="4 of 4 classes have fewer training images than 5 shots"):  # 4 each read
        ev.run(create_encoder("vit_micro4_32", attn="math"))
    assert calls and all(kw["l2"] == 7.0 for kw in calls)
    assert limits[0] == 5 * 3 * 4  # max shots x seeds per class


def test_fewshot_bias_column_matters_with_unbalanced_shots():
    """A class with fewer shots than k (it contributes all it has) shifts the class means: the
    constant bias feature is what absorbs that."""
    x, y = _noisy(4, n=400)
    keep = torch.cat([torch.nonzero(y == c).flatten()[:n] for c, n in enumerate((1, 12, 12, 12))])
    xt, yt = _noisy(5, n=400)
    got = fewshot_correct(x[keep], y[keep], xt, yt, 4, 1.0)
    assert np.array_equal(got, _ref_correct(x[keep], y[keep], xt, yt, 4, 1.0))
    assert not np.array_equal(got, _ref_correct(x[keep], y[keep], xt, yt, 4, 1.0, bias=False))  # it matters here


def test_a_class_short_of_the_shots_is_named_and_the_rest_are_not():
    """k-shot figures of a class with fewer than k training images use what it has: a warning says
    which class and how many, and nothing is said when every class fills the shots."""
    x, y = _noisy(4, n=400)
    keep = torch.cat([torch.nonzero(y == c).flatten()[:n] for c, n in enumerate((3, 12, 12, 12))])
    xt, yt = _noisy(5, n=100)
    with pytest.warns(UserWarning, match=r"1 of 4 classes have fewer training images than 5 shots "
                                         r"\(class: images 0: 3\)"):
        fewshot_eval(x[keep], y[keep], xt, yt, shots=(1, 5), seeds=1, l2=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fewshot_eval(x[keep], y[keep], xt, yt, shots=(1, 3), seeds=1, l2=1024.0)


def test_a_test_set_sharing_shards_with_the_training_set_is_warned_of(tmp_path, caplog):
    """A lone fine-tune or probe whose data.val shares shards with data.train reported the figures
    of images it trained on as held-out ones without a word (a comparison refuses it outright)."""
    from mpp.data.sources import check_same_classes
    train, _ = write_shards(tmp_path / "train", [4, 4])
    check_same_classes(train, str(tmp_path / "train" / "." / "000001.tar"), 4)  # one of its shards, spelled otherwise
    assert "data.val shares 1 shard(s) with data.train" in caplog.text and "not held-out ones" in caplog.text
    caplog.clear()
    test, _ = write_shards(tmp_path / "test", [4])
    check_same_classes(train, test)
    assert "shares" not in caplog.text
    from mpp.evaluators.fewshot import Evaluator as FewshotEvaluator  # a pre-training watching its own images
    shots, _ = write_shards(tmp_path / "shots", [4])
    watch = {"model": "vit_micro4_32", "data": {"train": train}, "fewshot": {"every": 1, "train": shots}}
    FewshotEvaluator(build_config({**watch, "fewshot": {**watch["fewshot"], "test": train}}), "cpu")
    assert "fewshot.test shares 2 shard(s) with data.train" in caplog.text
    caplog.clear()
    FewshotEvaluator(build_config({**watch, "fewshot": {**watch["fewshot"], "test": test}}), "cpu")
    assert "shares" not in caplog.text


def _classify_cfg(manifest: str):
    """A classify config that scores `manifest` whole (no crop) in batches of 4."""
    return build_config({"model": "vit_micro4_32", "objective": "classify", "batch_size": 4,
                         "data": {"train": manifest, "val": manifest, "num_workers": 0, "eval_crop_pct": 1.0}})


def test_a_fine_tunes_evaluation_scores_each_test_image_once_and_records_what_it_skipped(tmp_path):
    """A test set with a corrupt image and a corrupt shard: the classify evaluation scores every
    readable image exactly once (no repeated batch filling the rank's short tail) and records the
    images it could not score by kind."""
    manifest, source = write_shards(tmp_path / "test", [6, 6],
                                    extra=lambda s, j: {"png": b"junk"} if (s, j) == (0, 2) else {})
    tar = tmp_path / "test" / "000001.tar"  # a malformed header: that whole shard is lost
    data = bytearray(tar.read_bytes())
    data[100] ^= 0xFF  # its first header
    tar.write_bytes(bytes(data))
    seen = []

    class Classifier(torch.nn.Module):  # remembers the images it was given
        def __init__(self):
            super().__init__()
            self.encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")

        def logits(self, images):
            seen.extend(img.tobytes() for img in images.permute(0, 2, 3, 1).numpy())
            return torch.zeros(len(images), 3)

    m = ClassifyEvaluator(_classify_cfg(manifest), "cpu").run(Classifier())
    readable = {px.tobytes() for key, (_, px) in source.items() if key.startswith("s0_") and key != "s0_2"}
    assert len(seen) == len(set(seen)) == m["val_samples"] < 12 and readable <= set(seen)
    assert m["val_skipped_samples"] == {"corrupt_image": 1, "corrupt_tar": 1, "lost_samples": 6}  # the broken shard's
    assert "padded" not in m["val_skipped_samples"]


def _ranking_classifier(source: dict, rank_of: dict, classes: int, *, train_rank: int | None = None):
    """A stub classify model on a write_shards test set: for the image of key k it puts the true
    class at rank `rank_of[k]` (1 = first) of `classes` logits; in train mode, where `train_rank`
    is given, at that rank for every image instead."""
    truth = {px.tobytes(): (label, rank_of[key]) for key, (label, px) in source.items()}

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")

        def logits(self, images):
            rows = []
            for img in images.permute(0, 2, 3, 1).numpy():
                label, rank = truth[img.tobytes()]
                if self.training and train_rank is not None:
                    rank = train_rank
                others = [c for c in range(classes) if c != label]
                order = others[:rank - 1] + [label] + others[rank - 1:]  # highest score first
                row = torch.zeros(classes)
                row[order] = torch.arange(classes, 0, -1, dtype=torch.float32)
                rows.append(row)
            return torch.stack(rows)
    return Classifier()


def test_a_fine_tunes_top5_counts_the_images_whose_class_is_among_the_five_highest_logits(tmp_path):
    """7 test images of 6 classes in batches of 4 and 3: the true class ranked 1st for two images,
    2nd to 5th for four and 6th (last) for one. top1 is 2/7 and top5 6/7 exactly: top5 is not
    top1, and each batch's hits count its own images (not a percentage per batch)."""
    manifest, source = write_shards(tmp_path / "test", [7], classes=6)
    rank_of = dict(zip(sorted(source), [1, 2, 3, 6, 4, 5, 1]))
    m = ClassifyEvaluator(_classify_cfg(manifest), "cpu").run(_ranking_classifier(source, rank_of, 6))
    assert m["val_samples"] == 7
    assert (m["top1"], m["top5"]) == (2 / 7, 6 / 7)


def _second_rank(monkeypatch, hits: list[bool], labels: list[int], counts: dict, top5_hits: float = 0.0):
    """Makes the classify evaluation on one process see a second rank too: its gather returns that
    rank's (per-image hits and labels, skip counters) after this rank's, its all-reduce adds that
    rank's top-5 hits ("sum") or averages the two ("mean")."""
    import mpp.evaluators.classify as classify
    other = ([np.array(hits, dtype=bool), np.array(labels, dtype=np.int64)], counts)
    monkeypatch.setattr(classify, "gather_object", lambda objs: list(objs) + [other])
    monkeypatch.setattr(classify, "reduce", lambda t, op: {"sum": t + top5_hits, "mean": (t + top5_hits) / 2}[op])


def test_a_fine_tunes_evaluation_counts_the_images_every_rank_skipped(tmp_path, monkeypatch):
    """val_skipped_samples sums the skip counters gathered from all ranks: a corrupt image that only
    another rank met is counted, though this rank read all of its own."""
    manifest, source = write_shards(tmp_path / "test", [4], classes=6)
    _second_rank(monkeypatch, [], [], {"corrupt_image": 1})
    m = ClassifyEvaluator(_classify_cfg(manifest), "cpu").run(_ranking_classifier(source, dict.fromkeys(source, 1), 6))
    assert m["val_samples"] == 4
    assert m["val_skipped_samples"] == {"corrupt_image": 1}


def test_a_fine_tunes_top5_sums_the_hits_of_every_rank(tmp_path, monkeypatch):
    """top5 adds up the top-5 hits of all ranks (an all-reduce "sum") over all ranks' images: 6 of
    this rank's 7 and all 3 of another rank's are 9/10 (their mean, 4.5, would give 0.45)."""
    manifest, source = write_shards(tmp_path / "test", [7], classes=6)
    rank_of = dict(zip(sorted(source), [1, 2, 3, 6, 4, 5, 1]))
    _second_rank(monkeypatch, [True, False, False], [0, 1, 2], {}, top5_hits=3.0)
    m = ClassifyEvaluator(_classify_cfg(manifest), "cpu").run(_ranking_classifier(source, rank_of, 6))
    assert m["val_samples"] == 10
    assert (m["top1"], m["top5"]) == (3 / 10, 9 / 10)


def test_a_fine_tunes_evaluation_scores_in_eval_mode_a_model_left_in_train_mode(tmp_path):
    """The training loop hands over its model in train mode (dropout, drop path on): the evaluation
    scores the eval-mode model. Here train mode would rank every true class last (top1 = top5 = 0)."""
    manifest, source = write_shards(tmp_path / "test", [5], classes=6)
    classifier = _ranking_classifier(source, dict.fromkeys(source, 1), 6, train_rank=6).train()
    m = ClassifyEvaluator(_classify_cfg(manifest), "cpu").run(classifier)
    assert (m["top1"], m["top5"], m["val_samples"]) == (1.0, 1.0, 5)


def test_a_probe_records_the_images_it_could_not_read_and_a_cache_hit_keeps_them(tmp_path):
    """Corrupt training images (some in the development split) and a corrupt test image and shard:
    the probe's metrics count them by kind, training and test apart, as the fine-tune's do, and
    the same figures come back when the features are read from the cache."""
    from mpp.evaluators.linear_probe import Evaluator as ProbeEvaluator
    train, _ = write_shards(tmp_path / "train", [12, 12], extra=lambda s, j: {"png": b"junk"} if j % 4 == 1 else {})
    test, _ = write_shards(tmp_path / "test", [6, 6], extra=lambda s, j: {"png": b"junk"} if (s, j) == (0, 2) else {})
    tar = tmp_path / "test" / "000001.tar"  # a malformed header: that whole shard is lost
    data = bytearray(tar.read_bytes())
    data[100] ^= 0xFF
    tar.write_bytes(bytes(data))
    cfg = build_config({"model": "vit_micro4_32", "img_size": 16, "batch_size": 4, "output_dir": str(tmp_path / "run"),
                        "probe": {"dev_split": [0, 0.5], "l2_grid": [1e-2]}, "fewshot": {"shots": [1], "seeds": 1},
                        "data": {"train": train, "val": test, "num_workers": 0}})
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")
    for _ in range(2):  # features computed, then read from the cache
        m = ProbeEvaluator(cfg, "cpu").run(encoder)
        assert m["skipped_samples"] == {"corrupt_image": 6} and m["num_train"] == 18
        assert m["val_skipped_samples"] == {"corrupt_image": 1, "corrupt_tar": 1, "lost_samples": 6} and m["num_test"] == 5
    assert len(list((tmp_path / "feature_cache").glob("features-*"))) == 3


def test_the_feature_cache_key_changes_with_the_attention_kernel_the_device_and_the_label_index(tmp_path):
    """Features computed with the other attention kernel, on another kind of device or at another
    precision differ in their last bits (or more), and relabeled shards in their labels: each is its
    own cache entry (a comparison's runs share one cache)."""
    from mpp.evaluators.features import feature_cache_key
    manifest, _ = write_shards(tmp_path / "d", [4, 4])
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")

    def key(attn: str = "math", device: str = "cpu", precision: str = "no") -> str:
        cfg = build_config({"model": "vit_micro4_32", "img_size": 16, "train": {"attn": attn}})
        return feature_cache_key(encoder, manifest, cfg=cfg, pools=("token",), img_size=16, num_samples=0,
                                 precision=precision, device=torch.device(device))
    base = key()
    assert key() == base and key(attn="fused") != base and key(device="cuda") != base
    assert key(precision="bf16") != base
    m = json.loads(Path(manifest).read_text())
    Path(manifest).write_text(json.dumps({**m, "labels": "labels.json", "labels_sha256": "0" * 64}))
    assert key() != base


def test_features_are_the_eval_mode_encoder_on_images_normalised_as_in_training(shards, tmp_path):
    """The probe's, few-shot's and a fine-tune's starting head's features: the encoder in eval mode
    (a fine-tune's encoder has drop path, random in train mode; its mode is restored after) on
    images normalised by the run's data.mean and data.std, as its pre-training saw them."""
    from mpp.data import make_loader
    from mpp.evaluators.features import extract_features
    mean, std = (0.2, 0.4, 0.6), (0.1, 0.2, 0.3)
    cfg = _cfg(shards, tmp_path / "run", data={"mean": list(mean), "std": list(std), "num_workers": 0})
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16, drop_path=0.5).train()
    got = extract_features(encoder, shards["test"], cfg=cfg, pools=("token", "avg"), precision="no")
    assert encoder.training
    encoder.eval()
    want = {"token": [], "avg": []}
    with torch.no_grad():
        for batch in make_loader(shards["test"], batch_size=16, img_size=16, train=False, labeled=True,
                                 data_cfg=cfg.data).epoch(0):
            x = (batch["image"].float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
            for pool in want:
                want[pool].append(encoder.pool(encoder(x), pool))
    for pool in want:
        torch.testing.assert_close(got.x[pool], torch.cat(want[pool]), rtol=1e-4, atol=1e-4)


def test_a_cache_entry_of_other_shapes_is_a_miss_not_a_crash(shards, tmp_path, caplog):
    """Cache entries are files anyone with write access may have changed: labels of another length
    than the features, a label past the data's classes (a 2**40 one asked for a 285 TB one-hot)
    and a head of another shape are refused as unreadable, computed again, and the same."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from mpp.evaluators.linear_probe import probe_head
    cfg = _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-1]})
    torch.manual_seed(0)
    enc = create_encoder("vit_micro4_32", img_size=16)
    kw = dict(pool="avg", subset=(0.5, 0, 0.0, False), num_classes=4, device=torch.device("cpu"), precision="no")
    first = probe_head(enc, cfg, **kw)
    feats, head = sorted((tmp_path / "feature_cache").glob("*.safetensors"))

    def rewrite(path, **changed):
        with safe_open(str(path), "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        save_file({**tensors, **{k: edit(tensors[k]).contiguous() for k, edit in changed.items()}}, str(path),
                  metadata=meta)
    for features_edit, head_edit in (({"labels": lambda y: y[:3]}, {"weight": lambda w: w[:, :3]}),
                                     ({"labels": lambda y: torch.cat([y[:-1], torch.tensor([2**40])])}, {})):
        rewrite(feats, **features_edit)
        if head_edit:
            rewrite(head, **head_edit)
        else:
            head.unlink()
        caplog.clear()
        again = probe_head(enc, cfg, **kw)
        assert all(torch.equal(first[k], again[k]) for k in ("weight", "bias"))
        warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
        assert any(str(feats) in w for w in warned) and (not head_edit or any(str(head) in w for w in warned))


def test_a_cached_head_that_is_nan_or_lacks_a_figure_is_a_miss(shards, tmp_path, caplog):
    """A cached probe head is checked as features are: NaN weights trained every fine-tune sharing
    the cache to NaN (blaming optim.lr), figures without the chosen representation stopped it with
    a traceback (KeyError: 'pool'); these, a representation not a candidate, a NaN L2 and a top-1
    that is no number are unreadable entries, fitted again, the same as before."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from mpp.evaluators.linear_probe import probe_head
    cfg = _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-1]})
    torch.manual_seed(0)
    enc = create_encoder("vit_micro4_32", img_size=16)
    kw = dict(pool="avg", subset=(0.5, 0, 0.0, False), num_classes=4, device=torch.device("cpu"), precision="no")
    first = probe_head(enc, cfg, **kw)
    head, = (tmp_path / "feature_cache").glob("head-*.safetensors")
    with safe_open(str(head), "pt") as f:
        weight, bias, fit = f.get_tensor("weight"), f.get_tensor("bias"), json.loads(f.metadata()["fit"])
    nan = weight.clone()
    nan[0, 0] = math.nan
    for w, figures in ((nan, fit), (weight, {k: v for k, v in fit.items() if k != "pool"}),
                       (weight, {**fit, "pool": "token"}), (weight, {**fit, "l2": math.nan}),
                       (weight, {**fit, "heldout_top1": "0.5"})):
        save_file({"weight": w, "bias": bias}, str(head), metadata={"fit": json.dumps(figures)})
        caplog.clear()
        again = probe_head(enc, cfg, **kw)
        assert all(torch.equal(first[k], again[k]) for k in ("weight", "bias"))
        assert {k: v for k, v in again.items() if k not in ("weight", "bias")} == fit
        assert any(str(head) in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)


def test_a_head_written_after_a_killed_write_removes_its_temporary_file(shards, tmp_path):
    """kill -9 while the probe head was written left its temporary file in the feature cache for
    good (the features' writer removes them, but the features were cached): writing a head removes
    those of this machine's dead processes."""
    from mpp import fileio
    from mpp.evaluators.linear_probe import probe_head
    cfg = _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-1]})
    torch.manual_seed(0)
    enc = create_encoder("vit_micro4_32", img_size=16)
    kw = dict(pool="avg", subset=(0.5, 0, 0.0, False), num_classes=4, device=torch.device("cpu"), precision="no")
    probe_head(enc, cfg, **kw)
    head, = (tmp_path / "feature_cache").glob("head-*.safetensors")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = head.with_name(f".{head.name}.tmp{int(gone.stdout)}.{fileio._WHERE}")
    head.rename(orphan)  # as a killed write leaves it; the head itself is not there
    probe_head(enc, cfg, **kw)
    assert head.is_file() and not orphan.exists()


def test_non_finite_encoders_and_features_are_refused_and_never_cached(shards, tmp_path, monkeypatch, caplog):
    """A NaN encoder's probe failed deep in L-BFGS (a traceback) after caching its NaN features, and
    partly NaN features scored as class 0; an entry of NaN features, or of labels past the data's
    classes where the entry's own record allowed them, crashed every later run instead of missing.
    Upgrading timm, Pillow or simplejpeg (the ViT, decoding, resizing) is a miss too."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from mpp.models import load_encoder
    torch.manual_seed(0)
    enc = create_encoder("vit_micro4_32", img_size=16)
    save_encoder(enc, tmp_path / "enc")
    weights = tmp_path / "enc" / "encoder.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError, match="1 of its .* tensors hold NaN or infinite weights .*blocks.0.attn.qkv"):
        load_encoder(tmp_path / "enc")
    cfg = _cfg(shards, tmp_path / "run")
    kw = dict(cfg=cfg, cache_dir=tmp_path / "cache", progress=False)
    finite = mpp.evaluators.features.encode_images

    def some_nan(*a, **k):
        out = finite(*a, **k)
        out["avg"][0] = float("nan")  # one image a batch (3 batches)
        return out
    monkeypatch.setattr(mpp.evaluators.features, "encode_images", some_nan)
    with pytest.raises(NonFiniteError, match=r"avg features of 3 of 80 images .* are NaN or infinite \(precision no\); "
                                             r"give a finite encoder$"):
        extract_features(enc, shards["test"], precision="no", **kw)  # fp32: no overflow to blame
    assert not list((tmp_path / "cache").glob("*.safetensors"))
    from toolrun import run_tool
    save_encoder(enc, tmp_path / "finite")  # a fine-tune's probe head on them: one line, not a traceback
    done = run_tool("finetune", f"output_dir={tmp_path / 'ft'}", "model=vit_micro4_32", "batch_size=32", "steps=1",
                    f"data.train={shards['train']}", f"data.val={shards['test']}", "data.num_workers=1",
                    f"finetune.init={tmp_path / 'finite'}", "finetune.head_init=probe", "finetune.pool=avg",
                    f"probe.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 1 and done.stderr.splitlines()[-1].startswith("error: the encoder's avg features of "), \
        done.stderr[-2000:]
    assert not list((tmp_path / "cache").glob("*.safetensors"))
    monkeypatch.undo()
    first = extract_features(enc, shards["test"], **kw)
    entry, = (tmp_path / "cache").glob("*.safetensors")
    with safe_open(str(entry), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    for edit, record in ((lambda t: t["features.avg"].__setitem__((0, 0), float("nan")), "4"),
                         (lambda t: t["labels"].__setitem__(0, 7), "20")):  # the data has 4 classes
        changed = {k: v.clone() for k, v in tensors.items()}
        edit(changed)
        save_file(changed, str(entry), metadata={**meta, "num_classes": record})
        caplog.clear()
        again = extract_features(enc, shards["test"], **kw)
        assert torch.equal(again.y, first.y) and torch.equal(again.x["avg"], first.x["avg"])
        assert any("unreadable" in r.getMessage() for r in caplog.records)
    import timm
    before = mpp.evaluators.features.code_version()
    monkeypatch.setattr(timm, "__version__", "0.0.0")
    mpp.evaluators.features.code_version.cache_clear()
    try:
        assert mpp.evaluators.features.code_version() != before
    finally:
        monkeypatch.undo()
        mpp.evaluators.features.code_version.cache_clear()


def test_the_few_shot_watch_shows_nan_for_non_finite_features(shards, tmp_path, monkeypatch):
    """The watch during pre-training reads its features unchecked: NaN features (an fp16 overflow
    in evaluation, a diverging encoder) solved to the chance-level figures of an argmax over NaN
    (class 0 for every image), a plausible flat curve. Their figures are NaN now, with a warning;
    the other representation's are as before."""
    finite = fs_mod.encode_images

    def nan_avg(*a, **k):
        out = finite(*a, **k)
        out["avg"][:, 0] = float("nan")
        return out
    cfg = _cfg(shards, tmp_path / "run", fewshot={"train": shards["train"], "test": shards["test"], "shots": [1, 5],
                                                  "seeds": 2, "max_test": 40})
    evaluator = Evaluator(cfg, "cpu")
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16)
    clean = evaluator.run(encoder)
    monkeypatch.setattr(fs_mod, "encode_images", nan_avg)
    with pytest.warns(UserWarning, match="few-shot: the encoder's avg features are NaN or infinite"):
        got = evaluator.run(encoder)
    assert all(math.isnan(v) for k, v in got.items() if k.startswith("avg/")) and "avg/5shot_mean" in got
    assert {k: v for k, v in got.items() if k.startswith("token/")} == {
        k: v for k, v in clean.items() if k.startswith("token/")}


def test_the_few_shot_watch_names_its_own_count_keys_and_refuses_a_stray_label(tmp_path):
    """Shards named without a manifest: the few-shot watch's missing counts are its own keys (the
    error named data.num_samples), and a stray label of 999999 (no manifest bounds it) is refused
    as the probe refuses it, where it asked for a head of a million classes."""
    from mpp.data.decode import DataError
    from mpp.data.sources import CountNeeded
    write_shards(tmp_path / "d", [8, 8], classes=4, extra=lambda s, j: {"cls": b"999999"} if (s, j) == (1, 7) else {})
    pattern = str(tmp_path / "d" / "{000000..000001}.tar")
    fs = {"train": pattern, "test": pattern, "shots": [1], "seeds": 1}
    with pytest.raises(CountNeeded, match=r"give its total sample count \(fewshot.train_num_samples\)"):
        Evaluator(build_config({"fewshot": fs}), "cpu")
    evaluator = Evaluator(build_config({"fewshot": {**fs, "train_num_samples": 16, "test_num_samples": 16},
                                        "data": {"num_workers": 0}}), "cpu")
    with pytest.raises(DataError, match="its largest label, 999999, would make 1000000 classes for 16 labeled images"):
        evaluator.run(create_encoder("vit_micro4_32", img_size=16))


def test_a_held_out_probe_split_fits_on_rows_apart_from_those_it_scores_and_uses_every_row_once():
    """Without a development split the probe's L2 and representation are chosen on a held-out part of
    the training features: a fit that also saw those rows would choose on memorised images. The fit
    part and the held-out part are disjoint and together every training row, for every representation."""
    from mpp.evaluators.linear_probe import _splits
    n = 50
    rows = torch.arange(n, dtype=torch.float32)[:, None]  # each row's features name the row
    (fit_x, fit_y, val_x, val_y), = _splits({"token": rows, "avg": rows + 100}, torch.arange(n), 0.2, 0, None, 0)
    fit, val = fit_y.tolist(), val_y.tolist()
    assert len(val) == 10 and not set(fit) & set(val) and sorted(fit + val) == list(range(n))
    for name, shift in (("token", 0), ("avg", 100)):  # the features travel with their labels
        assert fit_x[name][:, 0].tolist() == [r + shift for r in fit]
        assert val_x[name][:, 0].tolist() == [r + shift for r in val]


def test_a_probes_top5_counts_a_true_class_ranked_below_first_but_within_five(monkeypatch):
    """Top-5 is its own figure: a test image whose true class has the third-largest logit counts for
    top-5 and not for top-1, so the reported top-5 is 1 where top-1 is 0 (not a copy of top-1)."""
    monkeypatch.setattr(mpp.evaluators.linear_probe, "fit_linear_head",
                        lambda x, y, c, l2, init=None: (torch.eye(c), torch.zeros(c)))  # logits = features
    y = torch.arange(40) % 10
    test_y = torch.arange(10)
    test_x = torch.zeros(10, 10)
    test_x[torch.arange(10), test_y] = 0.5  # the true class: third, behind two others
    test_x[torch.arange(10), (test_y + 1) % 10] = 1.0
    test_x[torch.arange(10), (test_y + 2) % 10] = 0.9
    out = linear_probe(torch.randn(40, 10), y, test_x, test_y, num_classes=10, l2_grid=(1.0,))
    assert out["top1"] == 0.0 and out["top5"] == pytest.approx(1.0)


def test_each_representations_reported_held_out_top1_is_its_best_l2s_the_score_the_choice_used(monkeypatch):
    """`heldout_top1` is each candidate's held-out top-1 at its best L2, the figure the choice of
    representation compared: for the chosen one it is its top-1 at the chosen L2 (`val_top1`), and
    for every one the largest of its scores over the grid, never a weaker L2's."""
    from mpp.evaluators.linear_probe import choose_probe
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(5, 200, generator=g) * 0.15  # weak dense signal: top-1 differs over the grid
    x, y = _blobs(400, centers, g)
    xt, yt = _blobs(50, centers, g)
    other, other_t = x + torch.randn(x.shape, generator=g) * 2, xt + torch.randn(xt.shape, generator=g) * 2
    grid = (1e-2, 100.0)
    monkeypatch.setattr(mpp.evaluators.linear_probe, "fit_linear_head",  # the test images' refit: not looked at here
                        lambda x, y, c, l2, init=None: (torch.zeros(c, x.shape[1]), torch.zeros(c)))
    out = linear_probe({"token": x, "avg": other}, y, {"token": xt, "avg": other_t}, yt, val_fraction=0.3,
                       l2_grid=grid)
    scores = choose_probe({"token": x, "avg": other}, y, num_classes=5, val_fraction=0.3, l2_grid=grid).scores
    assert any(len(set(s.values())) > 1 for s in scores.values())  # a worst L2 that is not the best
    assert out["heldout_top1"] == {n: max(s.values()) for n, s in scores.items()}
    assert out["heldout_top1"][out["representation"]] == out["val_top1"][f"{out['l2']:g}"]


def test_the_feature_cache_key_tells_apart_subsets_of_the_same_shards(tmp_path):
    """A development split, the rest of the training images and a label fraction read the same shards:
    each is its own cache entry, or the second extraction would load the first's features (the
    development split scored as if it were the training features)."""
    from mpp.evaluators.features import feature_cache_key
    manifest, _ = write_shards(tmp_path / "d", [4, 4])
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")
    cfg = build_config({"model": "vit_micro4_32", "img_size": 16})

    def key(subset):
        return feature_cache_key(encoder, manifest, cfg=cfg, pools=("token",), img_size=16, num_samples=0,
                                 precision="no", device=torch.device("cpu"), subset=subset)
    keys = [key(s) for s in (None, (1.0, 0.1, 0, False), (1.0, 0.1, 0, True), (0.5, 0, 0.0, False))]
    assert len(set(keys)) == 4 and key((1.0, 0.1, 0, True)) == keys[2]


def test_a_rewritten_shard_of_the_same_size_misses_the_feature_cache(tmp_path):
    """A shard written again (same name, same size, new images) must not reuse the features of the
    old one: its modification time is part of the cache key."""
    from mpp.evaluators.features import feature_cache_key
    manifest, _ = write_shards(tmp_path / "d", [4, 4])
    encoder = create_encoder("vit_micro4_32", img_size=16, attn="math")
    cfg = build_config({"model": "vit_micro4_32", "img_size": 16})

    def key():
        return feature_cache_key(encoder, manifest, cfg=cfg, pools=("token",), img_size=16, num_samples=0,
                                 precision="no", device=torch.device("cpu"))
    before = key()
    shard = sorted((tmp_path / "d").glob("*.tar"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert key() != before


def test_a_starting_head_chosen_on_another_split_seeds_held_out_part_is_fitted_again(shards, tmp_path, monkeypatch):
    """finetune.split_seed picks the held-out images a starting head's L2 is chosen on: a fine-tune of
    another seed gets its own head (its own fit, its own cache entry), never the cached head of the
    first seed's split; the same seed again loads it without a fit."""
    from mpp.evaluators.linear_probe import probe_head
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", img_size=16)
    kw = dict(pool="avg", subset=(0.5, 0, 0.0, False), num_classes=4, device=torch.device("cpu"), precision="no")
    seeds = []
    real_choose = mpp.evaluators.linear_probe.choose_probe
    monkeypatch.setattr(mpp.evaluators.linear_probe, "choose_probe",  # records the seed of each fit's split
                        lambda *a, **k: seeds.append(k["seed"]) or real_choose(*a, **k))
    for seed in (0, 1, 0):
        probe_head(encoder, _cfg(shards, tmp_path / "run", probe={"l2_grid": [1e-1]}, finetune={"split_seed": seed}),
                   **kw)
    assert seeds == [0, 1] and len(list((tmp_path / "feature_cache").glob("head-*.safetensors"))) == 2
