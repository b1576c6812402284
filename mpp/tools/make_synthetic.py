"""Write the embedded default data set (10 classes of drawn shapes and textures, see
mpp.data.synthetic) as JPEG shards with manifests at OUT/train and OUT/test.

  mpp-make-synthetic data/synthetic
"""
from __future__ import annotations

from mpp.cli import ArgumentParser, count, one_line_errors, path, seed, whole
from mpp.data.synthetic import make_synthetic


@one_line_errors(extra=(ValueError,))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("out", type=path, help="output folder (gets train/ and test/)")
    p.add_argument("--train", type=whole, default=5000, metavar="N", help="training images (default 5000)")
    p.add_argument("--test", type=whole, default=1000, metavar="N", help="test images (default 1000)")
    p.add_argument("--size", type=count, default=32, help="image side in pixels (default 32)")
    p.add_argument("--seed", type=seed, default=0, help="generator seed, >= 0 (default 0)")
    p.add_argument("--shards", type=count, default=8, help="shards per split (default 8)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing shards (by default a split made with the same settings is reused, "
                        "a different one refused)")
    a = p.parse_args(argv)
    if a.size < 8 or a.train + a.test == 0:
        p.error(f"--size must be >= 8 and --train plus --test >= 1, got {a.size}, {a.train} and {a.test}")
    ms = make_synthetic(a.out, train=a.train, test=a.test, size=a.size, seed=a.seed, shards=a.shards,
                        overwrite=a.overwrite)
    for split, m in ms.items():
        print(f"{split}: {m['num_samples']} images in {len(m['shards'])} shards at {a.out}/{split}/manifest.json")


if __name__ == "__main__":
    main()
