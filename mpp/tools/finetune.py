"""Fine-tune an encoder with a new linear head (objective=classify) and report top-1 / top-5 on
data.val. The head starts at zero (the paper's; finetune.head_init=zero, the default) or at the
linear probe of the run's own training labels (finetune.head_init=probe, the shipped CIFAR-10 and
synthetic configs).

  mpp-finetune --config configs/synthetic_finetune.yaml finetune.init=runs/mpp [key=value ...]

finetune.init: none (from scratch), a pre-training run directory or an encoder.safetensors with its
model.json (data.mean and data.std must be the ones it recorded); finetune.label_fraction trains on
a class-balanced seeded subset of the labels; finetune.pool: token ([class] token, the default), avg
(mean of the patch tokens) or auto (the one a linear probe of the run's own training labels reads
better, recorded as `pool`).
Writes OUTPUT_DIR/metrics.json with top1, top5 and the run's settings, plus what pre-training writes.
"""
from __future__ import annotations

from mpp.cli import RESUMABLE, one_line_errors, train_tool


@one_line_errors(interrupted=RESUMABLE)
def main(argv: list[str] | None = None) -> None:
    train_tool(__doc__, argv, "finetune")


if __name__ == "__main__":
    main()
