"""Does a frozen encoder carry more after an intermediate block than after its last one? The linear
probe's held-out top-1 (`choose_probe`: fit on 90% of the training features, scored on the rest,
its L2 grid) of the [class] token and of the patch mean after every block, for each encoder.

  python benchmarks/probe_blocks.py --data data/cifar10/train/manifest.json \\
      --encoder mpp=runs/compare_cifar10/pretrain_mpp --encoder random=none:vit_mini8_32

The probe tool offers only the last block (`probe.pool`): this script measured that the earlier
ones do not matter for the CIFAR-10 encoders (docs/results.md). Every block's output goes through
the trained final norm (timm's `forward_intermediates`), as the last one does in the encoder.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from mpp.cli import ArgumentParser, one_line_errors
from mpp.data import make_loader, normalize, to_float01
from mpp.evaluators.features import encoder_img_size
from mpp.evaluators.linear_probe import choose_probe
from mpp.figures.inspection import load_inspected


@torch.no_grad()
def block_features(encoder, data: str, data_cfg) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """{'blockK token' | 'blockK avg': features (N, D)} after each block K of labeled shards `data`
    (evaluation transform), and the labels."""
    loader = make_loader(data, batch_size=256, img_size=encoder_img_size(encoder), train=False, labeled=True,
                         data_cfg=data_cfg)
    feats: dict[str, list[torch.Tensor]] = {}
    labels = []
    encoder.eval()
    for batch in tqdm(loader.epoch(0), total=loader.batches_per_epoch, desc="features", leave=False):
        x = normalize(to_float01(batch["image"]), data_cfg.mean, data_cfg.std)
        blocks = encoder.vit.forward_intermediates(x, norm=True, output_fmt="NLC", return_prefix_tokens=True,
                                                   intermediates_only=True)
        for k, (patches, prefix) in enumerate(blocks, 1):
            feats.setdefault(f"block{k} token", []).append(prefix[:, 0])
            feats.setdefault(f"block{k} avg", []).append(patches.mean(1))
        labels.append(batch["label"].long())
    return {k: torch.cat(f) for k, f in feats.items()}, torch.cat(labels)


@one_line_errors(extra=(ValueError, FileNotFoundError))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--data", required=True, help="labeled training shards (a manifest, shard list or pattern)")
    p.add_argument("--encoder", action="append", required=True,
                   help="[LABEL=]RUN_DIR | ENCODER.safetensors | none:PRESET (repeatable)")
    a = p.parse_args(argv)
    for spec in a.encoder:
        enc = load_inspected(spec)
        x, y = block_features(enc.encoder, a.data, enc.data)
        scores = choose_probe(x, y, num_classes=int(y.max()) + 1).scores
        best = {k: 100 * max(s.values()) for k, s in scores.items()}
        print(f"{enc.name}: held-out top-1 per block, [class] token / patch mean")
        for k in range(1, len(enc.encoder.vit.blocks) + 1):
            print(f"  block {k}: {best[f'block{k} token']:.1f} / {best[f'block{k} avg']:.1f}")


if __name__ == "__main__":
    main()
