"""How long the linear probe's logistic fits take, and why they run class-major. Prints the two
matmuls of one L-BFGS evaluation at the probe's shapes (N features of width D, C classes) laid
out sample-major, (N, D) @ (D, C) as a user would write it (the baseline), against class-major,
(C, D) @ (D, N), which `_fit_logistic` uses; then `choose_probe` (the whole L2 grid, strong to
weak, warm-started) on each cached feature file given, and the refit on all its features at the
chosen L2, from zeros (the baseline) and from the chosen fit's head (what the probe does): the
time, the objective each reaches, and the share of training predictions they agree on. For
`choose_probe` it also prints the share of its time in the evaluations (the closure's matmuls)
against L-BFGS's own work, and `--history N` runs every fit with that L-BFGS history instead of
the probe's (a lever tried: fewer small operations an iteration, fits that stop elsewhere).

  python benchmarks/probe_fit.py [--features runs/compare_cifar10/feature_cache/features-*.safetensors] [--history N]
"""
from __future__ import annotations

import time
from unittest import mock

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from mpp.cli import ArgumentParser, count, one_line_errors
from mpp.evaluators.features import feature_stats
from mpp.evaluators.linear_probe import choose_probe, fit_linear_head


def _ms(fn, reps: int = 200) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def matmul_layouts(n: int, d: int, c: int) -> tuple[float, float]:
    """Milliseconds for logits plus gradient, sample-major and class-major."""
    x, w, g = torch.randn(n, d), torch.randn(d, c), torch.randn(n, c)
    xt, wt, gt = x.T.contiguous(), w.T.contiguous(), g.T.contiguous()
    return _ms(lambda: (x @ w, xt @ g)), _ms(lambda: (wt @ xt, gt @ x))


class _TimedLBFGS(torch.optim.LBFGS):
    """torch's L-BFGS as the probe builds it, with `history` (None: the probe's own) and the
    seconds its evaluations take summed in `evaluations_s`."""
    history: int | None = None
    evaluations_s = 0.0

    def __init__(self, params, **kw):
        super().__init__(params, **{**kw, **({"history_size": self.history} if self.history else {})})

    def step(self, closure):
        def timed():
            t = time.perf_counter()
            loss = closure()
            _TimedLBFGS.evaluations_s += time.perf_counter() - t
            return loss
        return super().step(timed)


def refit(x, y, c: int, l2: float, init) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The probe's refit on all features from `init` (None: zeros): weight, bias, seconds."""
    t = time.perf_counter()
    w, b = fit_linear_head(x, y, c, l2, init=init)
    return w, b, time.perf_counter() - t


def objective(x, y, l2: float, w, b) -> float:
    """The fit's objective: cross-entropy + L2/2 |W|^2 in the standardised coordinates."""
    std = feature_stats(x)[1]
    return (F.cross_entropy(x @ w.T + b, y) + 0.5 * l2 * (w * std).pow(2).sum()).item()


def _read_features(path: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A feature-cache file's representations and labels; ValueError naming the file otherwise."""
    try:
        d = load_file(path)
    except (SafetensorError, OSError) as e:  # OSError: a folder, a missing file
        raise ValueError(f"{path} is not a safetensors file ({' '.join(str(e).split())}); give a run's "
                         "feature_cache/features-*.safetensors") from None
    x = {k.split(".", 1)[1]: v for k, v in d.items() if k.startswith("features.")}
    if not x or "labels" not in d or d["labels"].numel() == 0:
        raise ValueError(f"{path} holds no features and labels; give a run's feature_cache/features-*.safetensors")
    return x, d["labels"].long()


@one_line_errors(extra=(ValueError, FileNotFoundError))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--features", nargs="*", default=[], help="feature-cache files (features-*.safetensors)")
    p.add_argument("--dim", type=count, default=128)
    p.add_argument("--classes", type=count, default=10)
    p.add_argument("--history", type=count, default=None, help="L-BFGS history of every fit (default: the probe's)")
    a = p.parse_args(argv)
    files = {path: _read_features(path) for path in a.features}  # a wrong file stops before the timings
    _TimedLBFGS.history = a.history
    with mock.patch.object(torch.optim, "LBFGS", _TimedLBFGS):  # `_fit_logistic` builds torch.optim.LBFGS
        print(f"threads {torch.get_num_threads()}; logits + gradient matmuls, D={a.dim}, C={a.classes}")
        for n in (4500, 45000):
            rows, cols = matmul_layouts(n, a.dim, a.classes)
            print(f"  N={n}: sample-major {rows:.3f} ms, class-major {cols:.3f} ms ({rows / cols:.1f}x)")
        for path, (x, y) in files.items():
            c = int(y.max()) + 1
            t, _TimedLBFGS.evaluations_s = time.perf_counter(), 0.0
            choice = choose_probe(x, y, num_classes=c)
            took = time.perf_counter() - t
            rep, l2, scores, head = choice.pool, choice.l2, choice.scores, choice.head
            print(f"{path}: {len(y)} samples, {len(x)} representations: choose_probe {took:.1f} s "
                  f"({100 * _TimedLBFGS.evaluations_s / took:.0f}% in its evaluations) -> {rep}, L2 {l2:g}, "
                  f"held-out {100 * scores[rep][l2]:.1f}; every held-out score: "
                  + " ".join(f"{100 * v:.1f}" for r in scores for v in scores[r].values()))
            xr = x[rep].float()
            fits = {k: refit(xr, y, c, l2, init) for k, init in (("zeros", None), ("warm", head))}
            pred = {k: (xr @ w.T + b).argmax(1) for k, (w, b, _) in fits.items()}
            print("  refit on all: " + ", ".join(f"from {k} {sec:.2f} s (objective {objective(xr, y, l2, w, b):.6f})"
                                               for k, (w, b, sec) in fits.items())
                  + f" ({fits['zeros'][2] / fits['warm'][2]:.1f}x); "
                  f"{100 * (pred['zeros'] == pred['warm']).float().mean():.1f}% of predictions agree")


if __name__ == "__main__":
    main()
