"""Linear probe and few-shot evaluation of a frozen pre-trained encoder.

Example: python tools/linear_probe.py --config configs/probe.yaml probe.encoder=runs/mpp output_dir=runs/probe_mpp
Features of data.train / data.val are cached (probe.cache_dir); OUT/metrics.json gets `top1`,
`top5` (linear) and `{k}shot_mean` / `{k}shot_std`.
"""
from __future__ import annotations

import json

from mpp.cli import one_line_errors, parse_config_args
from mpp.evaluators.linear_probe import run_linear_probe


def main() -> None:
    cfg = parse_config_args(__doc__)
    with one_line_errors(extra=(ValueError,)):  # the probe's own checks raise ValueError
        metrics = run_linear_probe(cfg)
    if metrics:
        print(json.dumps({k: v for k, v in metrics.items() if k not in ("config", "probe_val_top1")}, indent=1))


if __name__ == "__main__":
    main()
