"""Convert an image folder (one sub-folder per class) or a tar archive of one into WebDataset
shards OUT/000000.tar, ... plus OUT/manifest.json (see mpp.data.writer).

  mpp-make-shards ../shared/data/cifar10/train.tar data/cifar10/train
"""
from __future__ import annotations

from mpp.cli import ArgumentParser, count, one_line_errors, path, seed
from mpp.data.writer import BYTES_PER_SHARD, SAMPLES_PER_SHARD, write_shards


@one_line_errors()
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("src", type=path, help="image folder, or a tar archive (optionally compressed) holding one")
    p.add_argument("out", type=path, help="output folder for the shards and manifest.json (new or empty)")
    p.add_argument("--unlabeled", action="store_true",
                   help="take every image anywhere in the tree, without labels (default: one sub-folder per class)")
    p.add_argument("--samples-per-shard", type=count, default=SAMPLES_PER_SHARD, metavar="N",
                   help=f"at most N samples per shard (default {SAMPLES_PER_SHARD})")
    p.add_argument("--bytes-per-shard", type=count, default=BYTES_PER_SHARD, metavar="N",
                   help=f"at most N bytes per shard file (default {BYTES_PER_SHARD})")
    p.add_argument("--seed", type=seed, default=0, help="seed of the sample order across shards (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the shards and manifest in a non-empty OUT, once the new ones are complete")
    a = p.parse_args(argv)
    m = write_shards(a.src, a.out, unlabeled=a.unlabeled, samples_per_shard=a.samples_per_shard,
                     bytes_per_shard=a.bytes_per_shard, seed=a.seed, overwrite=a.overwrite)
    classes = f", {len(m['classes'])} classes" if m["classes"] else ", unlabeled"
    print(f"wrote {m['num_samples']} samples in {len(m['shards'])} shards{classes} to {a.out} "
          f"({m['skipped']['count']} files skipped)")


if __name__ == "__main__":
    main()
