"""Data-loading benchmark (see mpp.data.bench): decoded + augmented samples/s of the shard loader
vs torchvision ImageFolder + DataLoader vs single-process decode loops (plain PIL, the decode limit,
and the loader's own per-sample code), on CIFAR-10 (32px) and on generated 256px JPEGs at 224
crops. Data are prepared once in --work-dir (outside the project)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpp.data.bench import bench, format_table, prepare_cifar, prepare_generated


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cifar-tar", default="../shared/data/cifar10/train.tar",
                   help="CIFAR-10 image-folder tar (default ../shared/data/cifar10/train.tar)")
    p.add_argument("--work-dir", default="/tmp/mpp_bench_data", help="cache for extracted images and shards")
    p.add_argument("--only", choices=("cifar", "generated"), help="run one data set only")
    p.add_argument("--cifar-images", type=int, default=0, metavar="N", help="CIFAR images to use (0: all)")
    p.add_argument("--cifar-samples", type=int, default=20000, metavar="N", help="samples timed per method on CIFAR")
    p.add_argument("--gen-images", type=int, default=2000, metavar="N", help="256px JPEGs to generate")
    p.add_argument("--gen-samples", type=int, default=2000, metavar="N", help="samples timed per method on them")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method, interleaved, best kept (default 5)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    counts = (a.cifar_samples, a.gen_images, a.gen_samples, a.batch_size, a.workers, a.repeats)
    if a.cifar_images < 0 or min(counts) < 1:
        sys.exit("error: sample and image counts, --batch-size, --workers and --repeats must be >= 1 "
                 "(--cifar-images >= 0)")
    work = Path(a.work_dir)
    sets, samples = [], {}
    try:
        if a.only != "generated":
            if not Path(a.cifar_tar).is_file():
                sys.exit(f"error: CIFAR-10 tar '{a.cifar_tar}' not found; give --cifar-tar or --only generated")
            sets.append(prepare_cifar(a.cifar_tar, work, a.cifar_images))
            samples[sets[-1].name] = a.cifar_samples
        if a.only != "cifar":
            sets.append(prepare_generated(work, a.gen_images))
            samples[sets[-1].name] = a.gen_samples
        rows = bench(sets, samples=samples, batch_size=a.batch_size, workers=a.workers, repeats=a.repeats)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
