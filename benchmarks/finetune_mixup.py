"""Does mixup (Zhang et al. 2018) lift a short fine-tune? The fine-tune tool's run, with the training
forward of the classification task mixing each batch with a shuffled copy of itself (weight
lam ~ Beta(alpha, alpha), on the normalised pixels, the loss mixed alike); evaluation unchanged.

  python benchmarks/finetune_mixup.py --alpha 0.2 --config configs/cifar10_finetune.yaml \\
      finetune.init=runs/compare_cifar10/pretrain_mpp finetune.label_fraction=0.1 \\
      finetune.dev_fraction=0.1 finetune.pool=avg optim.lr=0.03 output_dir=OUT

The framework's fine-tune offers no mixup: this script measured that it does not help the CIFAR-10
fine-tunes of 600-1,200 steps (docs/results.md). Prints the run's metrics (top1: the development
split's when finetune.dev_fraction is set).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mpp.cli import ArgumentParser, one_line_errors
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
        pooled = self.encoder.pool(self.encoder(lam * x + (1 - lam) * x[perm]), self.pool)
        with torch.autocast(images.device.type, enabled=False):
            logits = self.head(pooled.float())
        ce = lambda y: F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)  # noqa: E731
        loss = lam * ce(labels) + (1 - lam) * ce(labels[perm])
        return loss, {"loss": loss.detach(), "acc": (logits.argmax(-1) == labels).float().mean().detach()}
    return forward


@one_line_errors()
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--alpha", type=float, required=True, help="Beta(alpha, alpha) of the mixing weight; 0: no mixup")
    p.add_argument("--config", required=True, help="a fine-tune config (configs/cifar10_finetune.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value settings, as the fine-tune tool takes them")
    a = p.parse_args(argv)
    if a.alpha > 0:
        LabelTask.forward = mixed_forward(a.alpha)
    metrics = train(load_config(a.config, a.overrides))
    print({k: v for k, v in metrics.items() if k in ("top1", "acc", "loss", "pool")})


if __name__ == "__main__":
    main()
