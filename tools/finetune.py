"""Fine-tune an encoder with a new zero-initialised linear head (objective=classify) and report
top-1 / top-5 on data.val.

  python tools/finetune.py --config configs/synthetic_finetune.yaml finetune.init=runs/mpp [key=value ...]

finetune.init: none (from scratch), a pre-training run directory or an encoder.safetensors with its
model.json; finetune.label_fraction trains on a class-balanced seeded subset of the labels.
Writes OUTPUT_DIR/metrics.json with top1, top5 and the run's settings, plus what pre-training writes.
"""
from mpp.cli import parse_config_args
from mpp.train import main

if __name__ == "__main__":
    main(parse_config_args(__doc__, defaults=["objective=classify"]))
