"""Pre-train a ViT encoder on shards: masked patch prediction (objective=mpp) or supervised.

  mpp-pretrain --config configs/synthetic_mpp.yaml [key=value ...]     (or: python tools/pretrain.py ...)
  torchrun --nproc_per_node N -m mpp.tools.pretrain --config ...      (or: accelerate launch -m ...)

Writes OUTPUT_DIR/{config.yaml, metrics.json, encoder.safetensors, model.json, tensorboard/,
checkpoints/}, an MPP run also mpp_head.safetensors (its head and [mask] embedding, for
tools/inspect_encoders.py), a profiled one profile/; train.resume=auto (the default) continues an interrupted run.
"""
from __future__ import annotations

from mpp.cli import RESUMABLE, one_line_errors, train_tool


@one_line_errors(interrupted=RESUMABLE)
def main(argv: list[str] | None = None) -> None:
    train_tool(__doc__, argv, "pretrain")


if __name__ == "__main__":
    main()
