"""How long the linear probe's logistic fits take, and why they run class-major. Prints the two
matmuls of one L-BFGS evaluation at the probe's shapes (N features of width D, C classes) laid
out sample-major, (N, D) @ (D, C) as a user would write it (the baseline), against class-major,
(C, D) @ (D, N), which `_fit_logistic` uses; then `choose_probe` (the whole L2 grid, strong to
weak, warm-started) on each cached feature file given.

  python benchmarks/probe_fit.py [--features runs/compare_cifar10/feature_cache/features-*.safetensors]
"""
from __future__ import annotations

import time

import torch
from safetensors.torch import load_file

from mpp.cli import ArgumentParser, one_line_errors
from mpp.evaluators.linear_probe import choose_probe


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


@one_line_errors(extra=(ValueError, FileNotFoundError))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--features", nargs="*", default=[], help="feature-cache files (features-*.safetensors)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    a = p.parse_args(argv)
    print(f"threads {torch.get_num_threads()}; logits + gradient matmuls, D={a.dim}, C={a.classes}")
    for n in (4500, 45000):
        rows, cols = matmul_layouts(n, a.dim, a.classes)
        print(f"  N={n}: sample-major {rows:.3f} ms, class-major {cols:.3f} ms ({rows / cols:.1f}x)")
    for path in a.features:
        d = load_file(path)
        x = {k.split(".", 1)[1]: v for k, v in d.items() if k.startswith("features.")}
        t = time.perf_counter()
        rep, l2, scores, _ = choose_probe(x, d["labels"], num_classes=int(d["labels"].max()) + 1)
        print(f"{path}: {len(d['labels'])} samples, {len(x)} representations: choose_probe "
              f"{time.perf_counter() - t:.1f} s -> {rep}, L2 {l2:g}, held-out {100 * scores[rep][l2]:.1f}")


if __name__ == "__main__":
    main()
