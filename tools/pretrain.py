"""Pre-train a ViT encoder on shards: masked patch prediction (objective=mpp) or supervised.

  python tools/pretrain.py --config configs/synthetic_mpp.yaml [key=value ...]
  torchrun --nproc_per_node N tools/pretrain.py --config ...    (or: accelerate launch ...)

Writes OUTPUT_DIR/{config.yaml, metrics.json, encoder.safetensors, model.json, tensorboard/,
checkpoints/}; train.resume=auto (the default) continues an interrupted run.
"""
from mpp.cli import parse_config_args
from mpp.train import main

if __name__ == "__main__":
    main(parse_config_args(__doc__))
