"""See what an encoder learned: MPP predictions (MPP runs), mean attention distance per head and
layer, position-embedding similarity and patch-embedding filters, several encoders side by side.

  mpp-inspect --encoder mpp=runs/synthetic/mpp --encoder sup=runs/synthetic/supervised \\
      --encoder none:vit_mini8_32 --data data/synthetic/test/manifest.json --out runs/synthetic/figures

Writes OUT/{attention_distance,position_similarity,filters}.png, OUT/predictions_NAME.png for each
MPP run whose target is a colour (not hog; none with --grid-images 0), and OUT/inspect.json with
the numbers behind them.
"""
from __future__ import annotations

from mpp.cli import ArgumentParser, count, one_line_errors, path, seed, whole


@one_line_errors(extra=(ValueError,))  # bad sources or data (DataError is a ValueError)
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--encoder", action="append", required=True, metavar="[LABEL=]SOURCE",
                   help="a run dir, an encoder.safetensors with model.json beside it, or none:PRESET[@IMG_SIZE] "
                        "(random init); repeat to compare encoders on the same images and axes")
    p.add_argument("--data", required=True, type=path,
                   help="shards to draw images from: a manifest.json, or a shard list or brace pattern with "
                        "--num-samples")
    p.add_argument("--num-samples", type=whole, default=0,
                   help="the sample count of a --data that is no manifest.json (a shard list or pattern)")
    p.add_argument("--out", required=True, type=path, help="output folder for the PNGs and inspect.json")
    p.add_argument("--images", type=count, default=64, help="images averaged over (default 64)")
    p.add_argument("--grid-images", type=whole, default=6,
                   help="rows of the MPP prediction grid (default 6; 0: no grid)")
    p.add_argument("--batch-size", type=count, default=32, help="images per forward pass (default 32)")
    p.add_argument("--seed", type=seed, default=0, help="seeds random init and the MPP corruption")
    a = p.parse_args(argv)
    from mpp.data.sources import CountNeeded
    from mpp.figures.inspection import inspect_encoders
    try:
        inspect_encoders(a.encoder, a.data, a.out, images=a.images, grid_images=a.grid_images,
                         batch_size=a.batch_size, seed=a.seed, num_samples=a.num_samples)
    except CountNeeded:
        p.error(f"--data {a.data} is not a manifest.json: give its total sample count with --num-samples N")
    print(f"figures: {a.out}")


if __name__ == "__main__":
    main()
