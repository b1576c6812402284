"""Pre-train a ViT encoder on shards: masked patch prediction (objective=mpp) or supervised.

  mpp-pretrain --config configs/synthetic_mpp.yaml [key=value ...]     (or: python tools/pretrain.py ...)
  torchrun --nproc_per_node N -m mpp.tools.pretrain --config ...      (or: accelerate launch -m ...)

Writes OUTPUT_DIR/{config.yaml, metrics.json, encoder.safetensors, model.json, tensorboard/,
checkpoints/}, an MPP run also mpp_head.safetensors (its head and [mask] embedding, for
tools/inspect_encoders.py), a profiled one profile/; train.resume=auto (the default) continues an interrupted run.
"""
from __future__ import annotations

from mpp.cli import RESUMABLE, one_line_errors, parse_config_args


@one_line_errors(interrupted=RESUMABLE)
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config_args(__doc__, argv, tool="pretrain")
    from mpp.runtime import leave_process_group  # after parsing: --help and a bad key answer without importing torch
    from mpp.train import train
    train(cfg)
    leave_process_group()


if __name__ == "__main__":
    main()
