"""Inspect one or more encoders on the same images: the MPP prediction grid (MPP runs), mean
attention distance, position-embedding similarity and patch-embedding filters, written as PNGs
plus `inspect.json` with the numbers behind them.

An encoder is given as a run dir (with model.json), an encoder.safetensors with its model.json
beside it, or `none:PRESET` (random initialisation, seeded); `LABEL=` in front names it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mpp.cli import UsageError
from mpp.config import MAX_TOKENS, DataConfig, load_config
from mpp.data import make_loader
from mpp.data.transforms import normalize, to_float01
from mpp.evaluators.features import encoder_img_size, eval_mode
from mpp.figures import plots
from mpp.figures.attention import attention_distance_sum, patch_distances, record_attention
from mpp.figures.filters import filter_components
from mpp.figures.posembed import position_similarity
from mpp.figures.predictions import HEAD_FILE, Prediction, load_mpp_task, predict, prediction_grid
from mpp.fileio import write_atomic
from mpp.models import (PRESETS, MaskedEncoder, create_encoder, grid_fix, load_encoder, preset_geometry,
                        read_model_json)
from mpp.corruption import Corruption
from mpp.objectives import MPPTask
from mpp.targets import TARGETS


# how filters.png shows the filters (inspect.json records it: figures drawn otherwise are drawn again)
FILTERS = "raw RGB (weights / data.std)"


@dataclass
class Inspected:
    name: str
    encoder: MaskedEncoder
    data: DataConfig          # normalisation (mean, std) the encoder was trained with (a random init: the default)
    task: MPPTask | None      # the MPP head, for MPP runs
    random: bool = False      # a random init (`none:`), which trained on no normalisation of its own


def load_inspected(spec: str, seed: int = 0) -> Inspected:
    """An encoder from `[LABEL=]RUN_DIR | ENCODER.safetensors | none:PRESET[@IMG_SIZE]` (a random
    init, at the preset's resolution or IMG_SIZE); a path that exists is a path, '=' in it or not
    (a comparison's output_dir=runs/lr=0.1)."""
    name, _, source = spec.partition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
    if not source:  # Path("") is the current directory: 'mpp=' would inspect whatever run is there
        raise UsageError(f"--encoder {spec!r} names no encoder; give [LABEL=]RUN_DIR, an encoder.safetensors "
                         "or none:PRESET")
    if source.startswith("none:"):
        preset, at, size = source[5:].partition("@")
        if at and not (size.isascii() and size.isdigit() and int(size) > 0):  # '²' is a digit int() refuses
            raise UsageError(f"--encoder {source}: give none:PRESET or none:PRESET@IMG_SIZE (whole pixels)")
        if preset not in PRESETS:
            raise UsageError(f"--encoder {source}: unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        patch = preset_geometry(preset)[1]
        if size and (fix := grid_fix(int(size), patch)):
            raise UsageError(f"--encoder {source}: {preset}'s patch size {patch} does not divide {size} at least "
                             f"twice; give {fix}")
        if size and (int(size) // patch) ** 2 > MAX_TOKENS:  # as a config's img_size
            raise UsageError(f"--encoder {source}: {(int(size) // patch) ** 2} patches of {preset} at {size} px, "
                             f"more than {MAX_TOKENS}; give an IMG_SIZE of at most {patch * math.isqrt(MAX_TOKENS)}")
        torch.manual_seed(seed)
        encoder = create_encoder(preset, int(size or 0), attn="math")
        return Inspected(name or f"random {source[5:]}", encoder, DataConfig(), None, random=True)
    path = Path(source)
    run = path if path.is_dir() else path.parent
    if not path.exists():  # named as given: 'runs/lr=0.1/mpp' is no label 'runs/lr' of '0.1/mpp'
        raise UsageError(f"--encoder {spec}: no such file or directory; give a run dir, an "
                         "encoder.safetensors with model.json beside it, or none:PRESET")
    cfg = load_config(run / "config.yaml") if (run / "config.yaml").is_file() else None
    if cfg is not None:
        data = cfg.data
    else:  # an exported encoder alone: the normalisation its model.json records, if it does
        norm = read_model_json(run / "model.json")[2] if (run / "model.json").is_file() else {}
        data = DataConfig(**{k: tuple(v) for k, v in norm.items()})
    task = load_mpp_task(run, attn="math") if path == run / "encoder.safetensors" or path.is_dir() else None
    if task is None and cfg is not None and cfg.objective == "mpp" and TARGETS[cfg.mpp.target].colors is not None:
        print(f"warning: {name or run.name}: an MPP run with neither {HEAD_FILE} nor a checkpoint: no prediction "
              f"figure; copy the run's {HEAD_FILE} (written when pre-training ends) or checkpoints/ into {run}",
              file=sys.stderr)
    encoder = task.encoder if task is not None else load_encoder(path, attn="math")
    return Inspected(name or run.name, encoder, data, task)


def read_images(data, img_size: int, count: int, data_cfg: DataConfig, num_samples: int = 0) -> torch.Tensor:
    """The first `count` images of `data` (shard order, evaluation crop), uint8 (B, 3, H, W);
    `num_samples`: the data's sample count where it is no manifest (a shard list or pattern)."""
    cfg = dataclasses.replace(data_cfg, num_workers=0, timeout=0)  # no worker to watch
    loader = make_loader(data, batch_size=min(count, 64), img_size=img_size, train=False, labeled=False,
                         data_cfg=cfg, rank=0, world_size=1, num_samples=num_samples)
    got = []
    for batch in loader.epoch(0):
        got.append(batch["image"])
        if sum(len(b) for b in got) >= count:
            break
    loader.close()
    if not got:
        raise ValueError(f"data {data!r} yielded no images")
    return torch.cat(got)[:count]


@torch.no_grad()
def mean_attention_distance(encoder: MaskedEncoder, images: torch.Tensor, data: DataConfig, batch_size: int = 32,
                            desc: str = "attention") -> torch.Tensor:
    """Mean attention distance in pixels (layers, heads) over `images` (uint8)."""
    reduce = functools.partial(attention_distance_sum, distances=patch_distances(encoder.grid_size, encoder.patch_size),
                               num_prefix=encoder.vit.num_prefix_tokens)
    total = None
    with eval_mode(encoder), record_attention(encoder.vit, reduce) as sums:
        for i in tqdm(range(0, len(images), batch_size), desc=desc, dynamic_ncols=True):
            sums.clear()
            encoder(normalize(to_float01(images[i:i + batch_size]), data.mean, data.std))
            total = torch.stack(sums) if total is None else total + torch.stack(sums)
    return total / (len(images) * encoder.num_patches)


def _predict(task: MPPTask, images: torch.Tensor, batch_size: int, seed: int) -> Prediction:
    """`predict` over `images` in batches of `batch_size` (the whole set at once would hold every
    image's activations), image i corrupted by a draw of its own seeded `seed + i`: an image is
    corrupted alike whatever the images and batches around it."""
    def corruption(start: int, count: int) -> Corruption:
        draws = [task.corrupt(1, images.device, torch.Generator(device=images.device).manual_seed(seed + start + i))
                 for i in range(count)]
        return Corruption(**{f.name: torch.cat([getattr(d, f.name) for d in draws])
                             for f in dataclasses.fields(Corruption)})
    parts = [predict(task, images[i:i + batch_size], corruption=corruption(i, len(images[i:i + batch_size])))
             for i in range(0, len(images), batch_size)]
    return Prediction(**{k: torch.cat([getattr(p, k) for p in parts]) for k in vars(parts[0])})


def _first(pred: Prediction, count: int) -> Prediction:
    return dataclasses.replace(pred, **{k: v[:count] for k, v in vars(pred).items()})


def _unique(names: list[str], form: str = "{} ({})") -> list[str]:
    """`names` made distinct, in order, by a suffix `form.format(name, 2)`, 3, ... on repeats."""
    seen: set[str] = set()
    out = []
    for n in names:
        name, i = n, 1
        while name in seen:
            i += 1
            name = form.format(n, i)
        seen.add(name)
        out.append(name)
    return out


def _file_stems(names: list[str]) -> list[str]:
    """Distinct file-name-safe stems of `names` ("mpp a" and "mpp_a" would otherwise share one)."""
    return _unique([re.sub(r"[^A-Za-z0-9_.-]+", "_", n) for n in names], "{}_{}")


def inspect_encoders(specs: list[str], data, out: str | Path, images: int = 64, grid_images: int = 6,
                     batch_size: int = 32, seed: int = 0, num_samples: int = 0) -> dict:
    """Write the figures of every encoder in `specs` on the same images of `data` to `out`;
    returns (and writes to OUT/inspect.json) the numbers behind them. `num_samples`: the data's
    sample count where `data` is a shard list or pattern, not a manifest."""
    if not specs:
        raise ValueError("no encoders given; pass --encoder RUN_DIR (or ENCODER.safetensors, or none:PRESET)")
    if images < 1 or grid_images < 0 or batch_size < 1:
        raise ValueError(f"images ({images}) and batch size ({batch_size}) must be >= 1, grid images >= 0")
    data = str(data) if isinstance(data, Path) else data
    models = [load_inspected(s, seed) for s in specs]
    trained = next((m.data for m in models if not m.random), DataConfig())
    for m, name in zip(models, _unique([m.name for m in models])):
        m.name, m.data = name, trained if m.random else m.data  # a random init reads images as the first trained one
    first = encoder_img_size(models[0].encoder)  # the data is read before anything is written
    cache = {first: read_images(data, first, max(images, grid_images), models[0].data, num_samples)}
    if len(cache[first]) < images:
        print(f"warning: {data} holds {len(cache[first])} images, fewer than the {images} asked for: each figure "
              "averages over those", file=sys.stderr)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inspect.json").unlink(missing_ok=True)  # a crash below leaves no record for the figures it left half-drawn
    numbers: dict = {"data": str(data), "num_samples": num_samples, "specs": list(specs),
                     "images": len(cache[first][:images]), "filters": FILTERS, "encoders": {}}
    distances, sims, comps, grids, patch, sizes = {}, {}, {}, {}, {}, {}
    for spec, m, stem in zip(specs, models, _file_stems([m.name for m in models])):
        size = encoder_img_size(m.encoder)
        if size not in cache:  # the first encoder's evaluation crop for all: the same images
            cache[size] = read_images(data, size, max(images, grid_images), models[0].data, num_samples)
        batch = cache[size]
        distances[m.name] = mean_attention_distance(m.encoder, batch[:images], m.data, batch_size, desc=m.name)
        sims[m.name] = position_similarity(m.encoder.vit)
        comps[m.name], share = filter_components(m.encoder.vit, m.data.std)
        grids[m.name], patch[m.name], sizes[m.name] = m.encoder.grid_size, m.encoder.patch_size, size
        entry = {"spec": spec, "model": m.encoder.model_spec(),
                 "mean_attention_distance_px": distances[m.name].tolist(),
                 "position_similarity": sims[m.name].tolist(),
                 "filter_pc_variance_share": share.tolist()}
        if m.task is not None and m.task.target.colors is not None:
            # the colour accuracy over the `images` every figure reads, the grid (grid_images > 0) of the first few
            pred = _predict(m.task, batch, batch_size, seed)
            entry["mpp_chosen_color_accuracy"] = _first(pred, images).accuracy(m.task.cfg.bits)
            if grid_images:
                file, shown = out / f"predictions_{stem}.png", _first(pred, grid_images)
                plots.predictions(prediction_grid(shown, m.encoder.patch_size, m.task.cfg.bits), m.name,
                                  entry["mpp_chosen_color_accuracy"], len(shown.chosen), len(batch[:images]), file)
                entry["predictions_png"] = file.name
        numbers["encoders"][m.name] = entry
    plots.attention_distance(distances, patch, sizes, out / "attention_distance.png")
    plots.position_similarity(sims, grids, out / "position_similarity.png")
    plots.filters(comps, out / "filters.png")
    drawn = {e.get("predictions_png") for e in numbers["encoders"].values()}
    for old in out.glob("predictions_*.png"):  # an earlier drawing's, of encoders or targets no longer there
        if old.name not in drawn:
            old.unlink()
    write_atomic(out / "inspect.json", json.dumps(numbers, indent=1) + "\n")  # last: the comparison's "figures done"
    return numbers


def write_compare_figures(run_dirs: list[str | Path], data=None, out: str | Path = "figures", **kw) -> dict:
    """The figures of a comparison's pre-trained encoders plus a random initialisation of the
    first one's preset and resolution, on `data` (default: the first run's data.val, else its data.train). Like a
    finished stage, figures of the same encoders and data, newer than every encoder, are kept (a
    resumed comparison redraws nothing); a record that does not read as one is drawn again."""
    runs = [Path(d) for d in run_dirs if (Path(d) / "encoder.safetensors").is_file()]
    if not runs:
        raise ValueError(f"none of {[str(d) for d in run_dirs]} holds an encoder.safetensors")
    cfg = load_config(runs[0] / "config.yaml")
    specs = [str(r) for r in runs] + [f"random init=none:{cfg.model}" + (f"@{cfg.img_size}" if cfg.img_size else "")]
    if data is None:  # with the count a shard list or pattern needs
        data, kw["num_samples"] = ((cfg.data.val, cfg.data.val_num_samples) if cfg.data.val
                                   else (cfg.data.train, cfg.data.num_samples))
    done = Path(out) / "inspect.json"
    if done.is_file() and all(done.stat().st_mtime > (r / "encoder.safetensors").stat().st_mtime for r in runs):
        try:
            kept = json.loads(done.read_text())
        except (OSError, ValueError):  # damaged (edited, or a disk's fault): draw them again
            kept = None
        kept = kept if isinstance(kept, dict) else {}
        same = {"specs": specs, "data": str(data), "num_samples": kw.get("num_samples", 0), "filters": FILTERS}
        if all(kept.get(k) == v for k, v in same.items()):  # the same encoders on the same images, drawn alike
            return kept
    return inspect_encoders(specs, data, out, **kw)
