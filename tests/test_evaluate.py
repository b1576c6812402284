"""Frozen-feature evaluation: the few-shot solver, the linear probe, the feature cache, the
during-training evaluator and the probe end to end on generated shards."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mpp.evaluate import BIAS_CONSTANT, fewshot_eval, fewshot_lstsq, linear_probe


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


def test_linear_probe_separable_beats_chance():
    g = torch.Generator().manual_seed(2)
    centers = torch.randn(10, 32, generator=g) * 2
    x, y = _blobs(1000, centers, g)
    xt, yt = _blobs(500, centers, g)
    out = linear_probe(x, y, xt, yt, num_classes=10)
    assert out["top1"] > 0.9 and out["top5"] >= out["top1"]
    assert out["l2"] in (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


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
