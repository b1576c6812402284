"""How much does a probe scored in folds over a label subset flatter an encoder that trained on
those labels? `finetune.pool_folds` scores the probe that chooses a fine-tune's representation in
k folds over all of a cell's labels, but only for an encoder that never fitted them
(`linear_probe.fitted_labels`); this script measures why.

For each encoder, on the class-balanced `--label-fraction` subset of `--train` and its
development split (`--dev-fraction`, which a comparison's pre-trainings withhold): each
representation's best top-1 on the development split (the probe fitted on the rest), and in
`--folds` folds over the whole subset, split into the images outside the development split (a
supervised pre-training fitted their labels) and those in it; beside them, the test top-1 on
`--test` of the probe fitted on the whole subset at the folds' L2, for information (nothing is
chosen on it), and how far the folds' score lies above it: what the folds flatter. The
development split is small (500 CIFAR images at 10%), so its part of the folds is noisy.

  python benchmarks/probe_memorised.py --train data/cifar10/train/manifest.json \\
      --test data/cifar10/test/manifest.json --encoder supervised=runs/X/pretrain_supervised \\
      --encoder mpp=runs/X/pretrain_mpp
"""
from __future__ import annotations

import dataclasses

import torch

from mpp.cli import ArgumentParser, one_line_errors
from mpp.config import build_config
from mpp.evaluators.features import extract_features
from mpp.evaluators.linear_probe import choose_probe, fit_linear_head, fold_parts
from mpp.figures.inspection import load_inspected
from mpp.models import POOLS
from mpp.outcomes import read


def measure(encoder, data_cfg, train: str, test: str, *, label_fraction: float, dev_fraction: float,
            split_seed: int, folds: int) -> dict:
    """{representation: {dev, cv, cv_fitted, cv_withheld, test}} top-1 (fractions), and the L2 the
    folds chose for each ('l2')."""
    cfg = dataclasses.replace(build_config({}), data=data_cfg)
    kw = dict(cfg=cfg, pools=POOLS, precision="auto", progress=False)
    tx, ty, _ = extract_features(encoder, train, subset=(label_fraction, split_seed, dev_fraction, False), **kw)
    dx, dy, _ = extract_features(encoder, train, subset=(label_fraction, split_seed, dev_fraction, True), **kw)
    ex, ey, _ = extract_features(encoder, test, **kw)
    classes = int(max(ty.max(), dy.max())) + 1
    on_dev = choose_probe(tx, ty, num_classes=classes, dev=(dx, dy))
    in_folds = choose_probe(tx, ty, num_classes=classes, dev=(dx, dy), folds=folds, seed=split_seed)
    withheld = (torch.cat(fold_parts(len(ty) + len(dy), folds, split_seed)) >= len(ty)).numpy()  # the split's rows
    out = {}
    for n in POOLS:
        hit = read(in_folds.outcomes[n])[1]
        l2 = max(in_folds.scores[n], key=lambda v: (in_folds.scores[n][v], v))
        weight, bias = fit_linear_head(torch.cat([tx[n], dx[n]]), torch.cat([ty, dy]), classes, l2)
        out[n] = {"dev": max(on_dev.scores[n].values()), "cv": max(in_folds.scores[n].values()),
                  "cv_fitted": hit[~withheld].mean(), "cv_withheld": hit[withheld].mean(),
                  "test": ((ex[n].float() @ weight.T + bias).argmax(1) == ey).float().mean().item(), "l2": l2}
    return out


@one_line_errors(extra=(ValueError, FileNotFoundError))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--train", required=True, help="labeled training shards (a manifest, shard list or pattern)")
    p.add_argument("--test", required=True, help="labeled test shards")
    p.add_argument("--encoder", action="append", required=True,
                   help="[LABEL=]RUN_DIR | ENCODER.safetensors | none:PRESET (repeatable)")
    p.add_argument("--label-fraction", type=float, default=0.1, help="the label subset (default 0.1)")
    p.add_argument("--dev-fraction", type=float, default=0.1, help="its development split (default 0.1)")
    p.add_argument("--split-seed", type=int, default=0, help="the subset's and the folds' seed (default 0)")
    p.add_argument("--folds", type=int, default=5, help="folds over the subset (default 5)")
    a = p.parse_args(argv)
    if not (0 < a.label_fraction <= 1 and 0 < a.dev_fraction < 1 and a.folds >= 2):
        p.error("--label-fraction must be in (0, 1], --dev-fraction in (0, 1), --folds >= 2")
    print("top-1 %: development split | folds over the subset (its fitted / withheld images) | test, the probe "
          "of the whole subset (information only) | folds - test")
    for spec in a.encoder:
        enc = load_inspected(spec)
        for n, r in measure(enc.encoder, enc.data, a.train, a.test, label_fraction=a.label_fraction,
                            dev_fraction=a.dev_fraction, split_seed=a.split_seed, folds=a.folds).items():
            print(f"{enc.name} {n}: {100 * r['dev']:.1f} | {100 * r['cv']:.1f} ({100 * r['cv_fitted']:.1f} / "
                  f"{100 * r['cv_withheld']:.1f}) | {100 * r['test']:.1f} at L2 {r['l2']:g} | "
                  f"{100 * (r['cv'] - r['test']):+.1f}")


if __name__ == "__main__":
    main()
