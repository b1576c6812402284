"""Does mixup (Zhang et al. 2018) lift a short fine-tune? The fine-tune tool's run twice, in
OUT/plain as configured (the baseline) and in OUT/mixup_ALPHA with the training forward of the
classification task mixing each batch with a shuffled copy of itself (weight lam ~ Beta(alpha,
alpha), on the normalised pixels, the loss mixed alike); evaluation unchanged. Prints both top-1
and their difference with its standard error, paired over the evaluated images.

  python benchmarks/finetune_mixup.py --alpha 0.2 --config configs/cifar10_finetune.yaml \\
      finetune.init=runs/compare_cifar10/pretrain_mpp finetune.label_fraction=0.1 \\
      finetune.dev_fraction=0.1 finetune.pool=avg optim.lr=0.03 output_dir=OUT

The framework's fine-tune offers no mixup: this script measured that it does not help the CIFAR-10
fine-tunes of 600-1,200 steps (docs/results.md). top1 is the development split's when
finetune.dev_fraction is set.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from mpp import outcomes
from mpp.cli import ArgumentParser, UsageError, one_line_errors
from mpp.config import load_config
from mpp.objectives import LabelTask
from mpp.train import train


def mixed_forward(alpha: float):
    """LabelTask.forward with mixup in training mode."""
    beta, plain = torch.distributions.Beta(alpha, alpha), LabelTask.forward

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        if not self.training or labels is None:
            return plain(self, images, labels)
        x = self.inputs(images)[1]
        lam, perm = float(beta.sample()), torch.randperm(x.shape[0], device=x.device)
        logits = self.classify(lam * x + (1 - lam) * x[perm])
        ce = lambda y: F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)  # noqa: E731
        loss = lam * ce(labels) + (1 - lam) * ce(labels[perm])
        return loss, {"loss": loss.detach(), "acc": (logits.argmax(-1) == labels).float().mean().detach()}
    return forward


@one_line_errors()
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--alpha", type=float, required=True, help="Beta(alpha, alpha) of the mixing weight, > 0")
    p.add_argument("--config", required=True, help="a fine-tune config (configs/cifar10_finetune.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value settings, as the fine-tune tool takes them")
    a = p.parse_args(argv)
    if not a.alpha > 0:
        raise UsageError(f"--alpha must be > 0 (the baseline without mixup runs anyway), got {a.alpha}")
    out, plain = Path(load_config(a.config, a.overrides).output_dir), LabelTask.forward
    runs = {}
    try:
        for name, forward in (("plain", plain), (f"mixup_{a.alpha:g}", mixed_forward(a.alpha))):
            LabelTask.forward = forward
            runs[name] = train(load_config(a.config, [*a.overrides, f"output_dir={out / name}"]))
    finally:
        LabelTask.forward = plain
    (_, base), (_, mixed) = (outcomes.read(m["outcomes"]) for m in runs.values())
    print(", ".join(f"{name}: top-1 {100 * m['top1']:.1f}" for name, m in runs.items())
          + f"; mixup - plain {100 * (mixed.mean() - base.mean()):+.1f} ± {100 * outcomes.paired_sem(mixed, base):.1f}"
          f" (paired over {len(base)} {runs['plain']['evaluated_on']} images)")


if __name__ == "__main__":
    main()
