"""Training-step benchmark of the MPP objective (see mpp.bench): images/s of this project's step
vs a plain timm ViT + hand-written MPP loop and vit-pytorch's MPP, at bf16 autocast and fp32, for
ViT-Ti/4 at 32 px and ViT-S/16 at 224 px; model FLOP/s against the measured bf16 matmul peak and
the matmul-only ceiling; and the step with the real shard loader against in-memory batches. Take final figures on a quiet
machine. A quick check: --only ti4 --steps 2 --warmup 1 --no-loader. On a GPU: --device cuda (adds
the compiled steps; the loader check compiles as the trainer's train.compile=auto does)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from mpp.bench import DEFAULT_METHODS, METHODS, MODELS, PRECISIONS, format_table, gemm_rates, loader_check, run_with_peaks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS), help="models (default: all)")
    p.add_argument("--precision", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    p.add_argument("--methods", nargs="+", choices=list(METHODS),
                   help="default: " + "; ".join(f"{d}: {' '.join(m)}" for d, m in DEFAULT_METHODS.items()))
    p.add_argument("--device", choices=list(DEFAULT_METHODS), default="cpu")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method, one at a time in turn with the other methods; the median counts (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--batch-size", type=int, default=0, help="0: 128 for both models")
    p.add_argument("--no-loader", action="store_true", help="skip the shard-loader check")
    p.add_argument("--loader-model", choices=list(MODELS), default="ti4")
    p.add_argument("--workers", type=int, default=2, help="loader workers for the loader check")
    p.add_argument("--loader-blocks", type=int, default=5,
                   help="loader check: pairs of interleaved blocks, memory then loader (default 5)")
    p.add_argument("--loader-block-steps", type=int, default=4, help="loader check: steps per block (default 4)")
    p.add_argument("--work-dir", default="", help="synthetic shards for the loader check (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    a = p.parse_args(argv)
    if min(a.steps, a.loader_blocks, a.loader_block_steps) < 1 or min(a.warmup, a.batch_size, a.workers) < 0:
        sys.exit("error: --steps, --loader-blocks and --loader-block-steps must be >= 1, --warmup, --batch-size "
                 "and --workers >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no CUDA device; use --device cpu")
    device = torch.device(a.device)
    try:
        rows, peaks = run_with_peaks(a.only, a.precision, a.methods or DEFAULT_METHODS[a.device], steps=a.steps,
                                     warmup=a.warmup, batch_size=a.batch_size, device=device,
                                     progress=lambda m: print(m, flush=True))
        gemms = {m: gemm_rates(m, a.batch_size, device) for m in a.only} if "bf16" in a.precision else {}
        loader = None
        if not a.no_loader:
            with tempfile.TemporaryDirectory() as tmp:
                loader = loader_check(a.work_dir or tmp, a.loader_model, blocks=a.loader_blocks,
                                      block_steps=a.loader_block_steps, warmup=max(a.warmup, 1),
                                      batch_size=a.batch_size, num_workers=a.workers,
                                      compile=device.type == "cuda", device=device)
    except (RuntimeError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(format_table(rows, peaks, loader, gemms))
    if a.json:
        Path(a.json).write_text(json.dumps({"peak_flops": peaks, "gemm_flops": gemms, "rows": rows, "loader": loader},
                                           indent=1))


if __name__ == "__main__":
    main()
