"""Data-loading benchmark: decoded + augmented samples/s of the shard loader, side by side with
torchvision `ImageFolder` + `DataLoader` on the same images and with single-process decode loops.

  python benchmarks/data_loading.py [--cifar-tar PATH] [--only cifar|generated] [--json PATH]

Record the figures in docs/benchmarks.md.

Two data sets: (a) CIFAR-10 from its image-folder tar (32x32 JPEGs, 32 crops) and (b) generated
256x256 JPEGs at 224 crops. Both are prepared once in a work folder outside the project (images
extracted to a folder for ImageFolder, and the same files sharded with `write_shards`) and reused.

Rows, all with the pre-training augmentation (random resized crop + horizontal flip) to uint8, on
one core each (torch single-threaded):
- `PIL decode loop`: the issue's decode limit, a plain single-process PIL loop over image bytes
  already in memory: `Image.open`, `.convert("RGB")`, the crop box from the loader's `crop_box`,
  PIL `resize(box=...)` (bilinear), flip, to a uint8 array;
- `mpp decode (1 proc)`: the same bytes through the loader's own code, a batch at a time
  (`decode.decode_batch` with `TrainTransform`: libjpeg-turbo decode, at reduced scale where the
  crop allows, torch resize) and batch stacking, as a worker runs it: what the loader's workers can
  reach at most;
- `shards (mpp)`: `make_loader` with `workers` DataLoader workers;
- `ImageFolder`: torchvision's `ImageFolder` (its loader decodes every image fully) with
  `RandomResizedCrop` + `RandomHorizontalFlip` + `PILToTensor`, `DataLoader(shuffle=True)` with
  the same workers and batch size, persistent like the shard loader's (DataLoader's default forks
  them anew every epoch, which would make the baseline slower).
Rates are measured from the first batch on (the first worker start-up and shuffle-buffer fill
excluded; with more samples than images, later epoch starts count) and reported with the ratios the
issue targets, shards / ImageFolder >= 2 and shards / (PIL decode loop x workers) >= 0.8, plus
shards / (mpp decode x workers), the pipeline's efficiency over its own decode code. On a small
shared machine one timing is noisy, so the methods run in turn `repeats` times (interleaved, so a
busy moment hits all of them alike) and each keeps its best.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import random
import shutil
import tarfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2 as T
from tqdm import tqdm

from mpp.cli import ArgumentParser, UsageError, one_line_errors
from mpp.config import DataConfig
from mpp.data.decode import decode_batch
from mpp.data import make_loader
from mpp.data.synthetic import render
from mpp.data.transforms import TrainTransform, crop_box, stack
from mpp.data.writer import MANIFEST, write_shards

MIN_SHARDS = 16  # enough for 2 ranks x 8 workers


@dataclass
class BenchSet:
    """One prepared data set: an image folder and the same images as shards."""
    name: str
    folder: Path
    manifest: Path
    img_size: int


def _done(marker: Path, expected: dict) -> bool:
    return marker.is_file() and json.loads(marker.read_text()) == expected


def _shard(folder: Path, out: Path, n: int) -> Path:
    write_shards(folder, out, samples_per_shard=math.ceil(n / MIN_SHARDS), overwrite=True, progress=True)
    return out / MANIFEST


def prepare_cifar(tar_path: str | Path, work: Path, max_images: int = 0) -> BenchSet:
    """Extract (every k-th file, up to max_images; 0: all) CIFAR-10's tar to a folder and shard it."""
    root = work / "cifar10"
    expected = {"source": str(Path(tar_path).resolve()), "max_images": max_images}
    if not _done(root / "done.json", expected):
        shutil.rmtree(root, ignore_errors=True)
        with tarfile.open(tar_path) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
            if max_images:
                members = members[::max(1, len(members) // max_images)][:max_images]
            tar.extractall(root / "folder", members=members, filter="data")
        _shard(root / "folder", root / "shards", len(members))
        (root / "done.json").write_text(json.dumps(expected))
    return BenchSet("CIFAR-10 32px", root / "folder", root / "shards" / MANIFEST, 32)


def _photo_like(index: int, size: int) -> bytes:
    """A size x size JPEG with smooth structure plus grain, so it compresses like a photo (a
    synthetic 64px scene upscaled: cheap and varied)."""
    rng = np.random.default_rng(index)
    img = np.asarray(render(index, seed=1, size=64)[0].resize((size, size), Image.BICUBIC), np.float32)
    img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def prepare_generated(work: Path, num_images: int, size: int = 256, crop: int = 224) -> BenchSet:
    """num_images generated size x size JPEGs in 10 class folders, and the same as shards."""
    root = work / f"generated{size}"
    expected = {"num_images": num_images, "size": size}
    if not _done(root / "done.json", expected):
        shutil.rmtree(root, ignore_errors=True)
        for i in tqdm(range(num_images), desc=f"generating {size}px JPEGs", unit="img"):
            path = root / "folder" / f"class{i % 10}" / f"{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_photo_like(i, size))
        _shard(root / "folder", root / "shards", num_images)
        (root / "done.json").write_text(json.dumps(expected))
    return BenchSet(f"generated {size}px, {crop} crops", root / "folder", root / "shards" / MANIFEST, crop)


def _rate(batches, samples: int) -> float:
    """Samples/s over `samples` samples from an iterator of batches (dicts or (images, labels)),
    timed from the first batch's arrival on."""
    seen, start = 0, None
    first = 0
    for batch in batches:
        n = len(batch["image"] if isinstance(batch, dict) else batch[0])
        if start is None:
            start, first = time.perf_counter(), n
        seen += n
        if seen >= samples:
            break
    elapsed = time.perf_counter() - start
    return (seen - first) / elapsed if elapsed > 0 and seen > first else float("nan")


def _blobs(ds: BenchSet, samples: int) -> list[bytes]:
    return [f.read_bytes() for f in sorted(ds.folder.rglob("*.jpg"))[:samples]]


def rate_pil_loop(ds: BenchSet, samples: int, batch_size: int, data_cfg: DataConfig) -> float:
    """The decode limit: a plain single-process PIL decode + augment loop over in-memory bytes."""
    blobs, rng = _blobs(ds, samples), random.Random(0)
    size = (ds.img_size, ds.img_size)
    start = time.perf_counter()
    for data in itertools.islice(itertools.cycle(blobs), samples):
        img = Image.open(io.BytesIO(data)).convert("RGB")
        left, top, w, h = crop_box(rng, img.width, img.height, data_cfg.crop_scale)
        img = img.resize(size, Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < data_cfg.hflip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        np.asarray(img)
    return samples / (time.perf_counter() - start)


def decode_rate(members: list[dict], img_size: int, samples: int, batch_size: int, data_cfg: DataConfig) -> float:
    """Samples/s of single-process decode + augment + batch stacking of in-memory image members
    ({ext: bytes}, cycled to `samples`) with the loader's own per-sample code: what one worker
    does, without reading shards (benchmarks/loader_rate.py's baseline too)."""
    rng, transform = random.Random(0), TrainTransform(img_size, data_cfg.crop_scale, data_cfg.hflip)
    start = time.perf_counter()
    stream = itertools.islice(itertools.cycle(members), samples)
    while chunk := list(itertools.islice(stream, batch_size)):
        stack(decode_batch(chunk, transform, rng, labeled=False, num_classes=None,
                           max_pixels=data_cfg.max_pixels, skips={})[0])
    return samples / (time.perf_counter() - start)


def rate_mpp_decode(ds: BenchSet, samples: int, batch_size: int, data_cfg: DataConfig) -> float:
    """`decode_rate` of the set's JPEG bytes."""
    return decode_rate([{"jpg": data} for data in _blobs(ds, samples)], ds.img_size, samples, batch_size, data_cfg)


def rate_shards(ds: BenchSet, samples: int, batch_size: int, data_cfg: DataConfig) -> float:
    loader = make_loader(str(ds.manifest), batch_size=batch_size, img_size=ds.img_size, train=True,
                         labeled=True, data_cfg=data_cfg, rank=0, world_size=1)
    with contextlib.closing(loader):  # stops its workers at the end
        return _rate((b for e in itertools.count() for b in loader.epoch(e)), samples)


def rate_imagefolder(ds: BenchSet, samples: int, batch_size: int, data_cfg: DataConfig) -> float:
    transform = T.Compose([T.RandomResizedCrop(ds.img_size, scale=tuple(data_cfg.crop_scale), antialias=True),
                           T.RandomHorizontalFlip(data_cfg.hflip), T.PILToTensor()])
    loader = DataLoader(datasets.ImageFolder(str(ds.folder), transform=transform), batch_size=batch_size,
                        shuffle=True, num_workers=data_cfg.num_workers, drop_last=False,
                        persistent_workers=True)
    return _rate((b for _ in itertools.count() for b in loader), samples)


def bench(sets: list[BenchSet], *, samples: dict[str, int], batch_size: int, workers: int,
          repeats: int = 3) -> list[dict]:
    """One row per data set: samples/s of each method (best of `repeats` interleaved runs) and the
    target ratios."""
    cfg = replace(DataConfig(), num_workers=workers)
    torch.set_num_threads(1)  # the decode loops are one core; workers are single-threaded too
    methods = {"pil_loop": rate_pil_loop, "mpp_decode": rate_mpp_decode, "shards": rate_shards,
               "imagefolder": rate_imagefolder}
    rows = []
    for ds in sets:
        n = samples[ds.name]
        row = {"data": ds.name, "samples": n, "workers": workers, "batch_size": batch_size, "repeats": repeats}
        runs = {name: [] for name in methods}
        for _ in range(repeats):
            for name, rate in methods.items():
                runs[name].append(rate(ds, n, batch_size, cfg))
        row.update({name: max(r) for name, r in runs.items()})
        row["runs"] = runs
        row["vs_imagefolder"] = row["shards"] / row["imagefolder"]
        row["vs_decode_limit"] = row["shards"] / (row["pil_loop"] * workers)
        row["vs_mpp_decode"] = row["shards"] / (row["mpp_decode"] * workers)
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows (samples/s and ratios, with their targets where the issue sets
    one)."""
    lines = ["| data | PIL decode loop (1 proc) | mpp decode (1 proc) | shards (mpp) | ImageFolder "
             "| shards / ImageFolder (>= 2) | shards / (PIL loop x workers) (>= 0.8) "
             "| shards / (mpp decode x workers) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['data']} | {r['pil_loop']:.0f} | {r['mpp_decode']:.0f} | {r['shards']:.0f} "
                     f"| {r['imagefolder']:.0f} | {r['vs_imagefolder']:.2f} | {r['vs_decode_limit']:.2f} "
                     f"| {r['vs_mpp_decode']:.2f} |")
    w = rows[0] if rows else {}
    lines.append(f"\nsamples/s, decoded + augmented to uint8; {w.get('workers')} workers, batch {w.get('batch_size')}, "
                 f"best of {w.get('repeats')} interleaved runs per method")
    return "\n".join(lines)


@one_line_errors(extra=(ValueError,))
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__)
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
        raise UsageError("sample and image counts, --batch-size, --workers and --repeats must be >= 1 "
                         "(--cifar-images >= 0)")
    if min(a.cifar_samples, a.gen_samples) <= a.batch_size:  # the rates are timed from the first batch on
        raise UsageError(f"--cifar-samples and --gen-samples must exceed --batch-size ({a.batch_size})")
    work = Path(a.work_dir)
    sets, samples = [], {}
    if a.only != "generated":
        if not Path(a.cifar_tar).is_file():
            raise UsageError(f"CIFAR-10 tar '{a.cifar_tar}' not found; give --cifar-tar or --only generated")
        sets.append(prepare_cifar(a.cifar_tar, work, a.cifar_images))
        samples[sets[-1].name] = a.cifar_samples
    if a.only != "cifar":
        sets.append(prepare_generated(work, a.gen_images))
        samples[sets[-1].name] = a.gen_samples
    rows = bench(sets, samples=samples, batch_size=a.batch_size, workers=a.workers, repeats=a.repeats)
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
