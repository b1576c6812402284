"""Linear probe and few-shot evaluation of a frozen pre-trained encoder.

  mpp-probe --config configs/synthetic_probe.yaml probe.encoder=runs/synthetic/mpp output_dir=runs/probe_mpp

probe.encoder: a pre-training run directory or its encoder.safetensors (data.mean and data.std must be
the ones its model.json recorded), or none (a randomly initialised model). Features of data.train /
data.val are cached (probe.cache_dir); OUT/metrics.json gets `top1`, `top5` (linear),
`{k}shot_mean` / `{k}shot_std` and, for the gap report's noise, each shot draw's figures and every
test sample's outcome, and `encoder_sha256` (of the encoder file probed, which tools/compare.py
checks before it reuses the probe); the figures are printed.
"""
from __future__ import annotations

import json

from mpp.cli import one_line_errors, parse_config_args


@one_line_errors(extra=(ValueError,))  # the probe's own checks raise ValueError
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config_args(__doc__, argv, tool="linear_probe")
    from mpp.evaluators.linear_probe import run_linear_probe
    metrics = run_linear_probe(cfg)
    if metrics:
        print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}, indent=1))


if __name__ == "__main__":
    main()
