"""The loader alone, with no step to feed: how many images/s it delivers and how much of the
consuming thread's CPU each batch costs (receiving the worker's batch, re-chunking, and on a GPU
pinning and queueing the copy), over the epochs after the first (worker start-up and the first
pass over the shards left out), beside the baseline it is bounded by: the loader's own decode code
(`decode_batch` + stacking, as a worker runs it) on the same images held in memory, in this
process on one core, times the workers; the ratio is the share of that limit the loader delivers.

  python benchmarks/loader_rate.py --data /tmp/syn32/train/manifest.json --batch-size 1024 --workers 1
  python benchmarks/loader_rate.py --data ... --batch-size 256 --workers 12 --fraction 0.1 --epochs 24 --device cuda

`--device cuda` reads through the trainer's prefetcher (`mpp.prefetch`: a thread pins and copies
each batch to the GPU); then the CPU time per batch is the main thread's wait alone. The data
settings are the synthetic configs' (`configs/synthetic_mpp.yaml`, with `--fraction` the labeled
`configs/synthetic_finetune.yaml`'s). Record the figures in docs/benchmarks.md.
"""
from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import torch

from mpp.cli import ArgumentParser, UsageError, one_line_errors
from mpp.config import load_config
from mpp.data import make_loader
from mpp.data.decode import IMAGE_EXTS
from mpp.data.sources import read_shard, resolve
from mpp.prefetch import DevicePrefetcher

sys.path.insert(0, str(Path(__file__).parent))  # the benchmarks beside this one
from data_loading import decode_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def shard_images(data: str, count: int) -> list[dict]:
    """The image members of the first `count` samples of `data`'s shards, as {ext: bytes}."""
    samples = (s for url in resolve(data).urls for s in read_shard(url, {}))
    return [{k: v for k, v in s.items() if k in IMAGE_EXTS} for s in itertools.islice(samples, count)]


def run(data: str, *, batch_size: int, workers: int, epochs: int, fraction: float = 0.0,
        device: str = "cpu") -> dict:
    """images/s and the consumer's CPU ms per batch over epochs 1.. of `data`; the decode limit
    (`decode_rate` of up to 4,096 of its images on one core, times `workers`) and the share of it."""
    yaml = "finetune" if fraction else "mpp"
    cfg = load_config(ROOT / f"configs/synthetic_{yaml}.yaml", [f"data.num_workers={workers}"])
    loader = make_loader(data, batch_size=batch_size, img_size=32, train=True, labeled=bool(fraction),  # Ti/4's
                         data_cfg=cfg.data, subset=(fraction, 0) if fraction else None)
    source = (b for e in range(epochs) for b in loader.epoch(e))
    batches = DevicePrefetcher(source, device) if device != "cpu" else source
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    first = loader.batches_per_epoch  # epoch 0 left out
    for i in range(epochs * first):
        if i == first:
            sync()
            images, cpu, start = 0, 0.0, time.perf_counter()
        t = time.thread_time()
        batch = next(batches)
        if i >= first:
            cpu += time.thread_time() - t
            images += len(batch["image"])
    sync()
    wall = time.perf_counter() - start
    if device != "cpu":
        batches.close()
    loader.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs
    try:
        one_core = decode_rate(shard_images(data, 4096), 32, min(images, 20_000), batch_size, cfg.data)
    finally:
        torch.set_num_threads(threads)
    rate = images / wall
    return {"images": images, "images_per_s": rate, "cpu_ms_per_batch": 1e3 * cpu / ((epochs - 1) * first),
            "decode_limit": one_core * workers, "of_limit": rate / (one_core * workers)}


@one_line_errors(extra=(ValueError,))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
    p.add_argument("--data", required=True, help="shards' manifest.json (32 px: tools/make_synthetic.py)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3, help="epochs read, the first left out (default 3)")
    p.add_argument("--fraction", type=float, default=0.0,
                   help="a class-balanced label fraction (default: all, unlabeled)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: host batches; cuda: through the trainer's prefetcher")
    a = p.parse_args(argv)
    if not Path(a.data).is_file():
        raise UsageError(f"manifest '{a.data}' not found; write shards first (tools/make_synthetic.py) or give --data")
    if not a.data.endswith(".json"):  # a shard list would need its count, which this benchmark does not take
        raise UsageError(f"--data '{a.data}' is not a manifest.json; give the shards' manifest.json")
    if min(a.batch_size, a.workers) < 1 or a.epochs < 2 or not 0 <= a.fraction <= 1:
        raise UsageError("--batch-size and --workers must be >= 1, --epochs >= 2, --fraction in [0, 1]")
    r = run(a.data, batch_size=a.batch_size, workers=a.workers, epochs=a.epochs, fraction=a.fraction,
            device=a.device)
    print(f"loader alone, batch {a.batch_size}, {a.workers} worker(s)"
          f"{f', {a.fraction:g} of the labels' if a.fraction else ''}, epochs 1-{a.epochs - 1}, "
          f"{'through the prefetcher to ' + a.device if a.device != 'cpu' else 'host batches'}: "
          f"{r['images_per_s']:.0f} images/s, {r['cpu_ms_per_batch']:.2f} ms of the reading thread's CPU a batch; "
          f"decode limit (one core's decode x {a.workers}) {r['decode_limit']:.0f} images/s: "
          f"{r['of_limit']:.2f}x of it")


if __name__ == "__main__":
    main()
