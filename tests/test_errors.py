"""Every bad input ends with one line on stderr, a non-zero exit and nothing written.

Each case prepares its bad input under a scratch directory, runs a tool in-process (its
`__main__`, as `python tools/X.py ...` would) and checks the exit code, that stderr is a single
`error: ...` line, and that the scratch directory holds exactly what the case put there. The
same cases produce docs/errors.md; `python tests/test_errors.py` rewrites it, and the test fails
when the table is stale."""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mpp.config import DataConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs/errors.md"
SMALL = ["model=vit_micro4_32", "batch_size=8", "steps=2", "data.num_workers=0", "train.attn=math"]


def _data(tmp: Path) -> Path:
    """A labeled 3-class set (train/, val/), one with other classes (other/) and unlabeled shards
    (unlabeled/: a manifest without classes)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from shardutil import write_shards
    write_shards(tmp / "data/train", [8, 8], classes=3)
    write_shards(tmp / "data/val", [4, 4], classes=3)
    write_shards(tmp / "data/other", [4, 4], classes=4)
    write_shards(tmp / "data/unlabeled", [4, 4], classes=None)
    write_shards(tmp / "data/oneclass", [4, 4], classes=1)
    from mpp.data.writer import write_samples
    from shardutil import encode
    pixels = np.random.default_rng(0).integers(0, 256, (12, 16, 16, 3), dtype=np.uint8)
    write_samples([(f"c{i % 3}/{i}.png", lambda p=p: encode(p), i % 3) for i, p in enumerate(pixels)],
                  tmp / "data/made", classes=["c0", "c1", "c2"], samples_per_shard=4, progress=False)
    return tmp / "data"


def _made(tmp: Path, shard: bytes = b"", manifest=None, labels=None) -> None:
    """TMP/m: a copy of data/made (written by mpp's writer) with `shard` appended to its second
    shard and `manifest(dict)` / `labels(list)` applied to its manifest / label index."""
    shutil.copytree(tmp / "data/made", tmp / "m")
    with open(tmp / "m/000001.tar", "ab") as f:
        f.write(shard)
    for name, edit in (("manifest.json", manifest), ("labels.json", labels)):
        if edit:
            data = json.loads((tmp / "m" / name).read_text())
            edit(data)
            (tmp / "m" / name).write_text(json.dumps(data))


def _compare(tmp: Path) -> None:
    """A comparison over copies of the shipped synthetic stage configs (their paths under TMP)."""
    for k in ("mpp", "supervised", "finetune", "probe"):
        shutil.copy(ROOT / "configs" / f"synthetic_{k}.yaml", tmp)
    (tmp / "c.yaml").write_text("".join(f"{k}: {tmp / f'synthetic_{k}.yaml'}\n"
                                        for k in ("mpp", "supervised", "finetune", "probe"))
                                + f"output_dir: {tmp / 'runs'}\nlabel_fractions: [1.0]\n")


def _synthetic(tmp: Path, manifest: str | None = None) -> None:
    """TMP/syn: a synthetic set of 10 training images in one shard (`--train 10 --test 0 --shards 1`),
    its manifest's text replaced when given."""
    from mpp.data.synthetic import make_synthetic
    make_synthetic(tmp / "syn", train=10, test=0, shards=1, progress=False)
    if manifest is not None:
        (tmp / "syn/train/manifest.json").write_text(manifest)


def _encoder(tmp: Path, spec: dict | str | None = None, weights: bytes | None = None, data=None,
             preset: str = "vit_micro4_32") -> Path:
    """A run directory with an exported encoder of `preset` (trained with the DataConfig `data`, when
    given: its normalisation recorded), its model.json or weights replaced when given."""
    from mpp.models import create_encoder, save_encoder
    out = tmp / "enc"
    save_encoder(create_encoder(preset, attn="math"), out, data)
    if spec is not None:
        (out / "model.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
    if weights is not None:
        (out / "encoder.safetensors").write_bytes(weights)
    return out


class _Payload:
    def __reduce__(self):
        return os.system, ("touch /tmp/owned",)


def _encoder_loading_a_pickle(tmp: Path) -> Path:
    """An exported encoder whose model.json also asks timm to load a pickle (`checkpoint_path`)."""
    out = _encoder(tmp)
    (tmp / "evil.pth").write_bytes(_pickle())
    spec = json.loads((out / "model.json").read_text())
    spec["kwargs"]["checkpoint_path"] = str(tmp / "evil.pth")
    (out / "model.json").write_text(json.dumps(spec))
    return out


def _pickle() -> bytes:
    """A torch.save file that would run a shell command if it were unpickled."""
    buf = io.BytesIO()
    torch.save({"w": _Payload()}, buf)
    return buf.getvalue()


def _ckpt_run(tmp: Path, state: bytes, weights: bytes = b"", run: str = "out") -> None:
    """TMP/RUN, a run dir whose only checkpoint has a crafted state.pt (and model.safetensors)."""
    ck = tmp / run / "checkpoints/step_0000001"
    ck.mkdir(parents=True)
    (ck / "state.pt").write_bytes(state)
    (ck / "model.safetensors").write_bytes(weights)
    (ck / "rng_0.pt").write_bytes(b"")


def _foreign(world_size: int = 1) -> tuple[bytes, bytes]:
    """state.pt and model.safetensors of a sound checkpoint of some other model (one tensor),
    written by `world_size` processes."""
    from safetensors.torch import save
    buf = io.BytesIO()
    torch.save({"step": 1, "world_size": world_size, "nonfinite_steps": 0, "elapsed": 0.0, "train_time": 0.0,
                "data_wait": 0.0, "last": {}, "optimizer": {}, "scaler": None}, buf)
    return buf.getvalue(), save({"w": torch.zeros(2)})


def _image_folder(path: Path) -> None:
    """An image folder of two classes, one PNG each."""
    from shardutil import encode
    for name in ("cat", "dog"):
        (path / name).mkdir(parents=True)
        (path / name / "0.png").write_bytes(encode(np.zeros((8, 8, 3), np.uint8)))


def _cut_tar(path: Path) -> None:
    """A tar of one class folder without its end-of-archive blocks, as an interrupted copy leaves it."""
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("a/0.jpg")
        info.size = 600
        tar.addfile(info, io.BytesIO(bytes(600)))
    path.write_bytes(path.read_bytes()[:512 + 1024])


def _finished(tmp: Path) -> None:
    """TMP/out: a finished run of TRAIN's settings."""
    from mpp.config import load_config
    from mpp.train import train
    train(load_config(None, TRAIN(tmp)))


def _unfinished(tmp: Path) -> None:
    """TMP/run: a pre-training stopped after its checkpoint at step 5 (no encoder.safetensors yet)."""
    (tmp / "run/checkpoints/step_0000005").mkdir(parents=True)
    (tmp / "run/config.yaml").write_text("objective: mpp\n")


def _run_dir(tmp: Path, metrics: str, config: str) -> None:
    """TMP/run: a run directory with the given metrics.json and config.yaml texts."""
    (tmp / "run").mkdir()
    (tmp / "run/metrics.json").write_text(metrics)
    (tmp / "run/config.yaml").write_text(config)


# (what, tool, arguments (a function of the scratch dir), setup). TRAIN: a valid small pre-training.
def TRAIN(t):
    return [f"output_dir={t}/out", f"data.train={t}/data/train", *SMALL]


def FT(t):
    return [*TRAIN(t), f"data.val={t}/data/val"]


def FS(t):
    """TRAIN evaluating few-shot every step on the labeled train/ and val/ sets."""
    return [*TRAIN(t), "fewshot.every=1", f"fewshot.train={t}/data/train", f"fewshot.test={t}/data/val"]


IMAGENET = DataConfig(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))  # not the runs' default normalisation


def OLD(t):
    """The checkpoint of `_ckpt_run(..., run="old")`."""
    return t / "old/checkpoints/step_0000001"


CASES = [
    ("unknown config key", "pretrain", lambda t: [*TRAIN(t), "optim.lrr=0.1"], None),
    ("img_size not a multiple of the patch", "pretrain", lambda t: [*TRAIN(t), "img_size=30"], None),
    ("img_size of one patch", "pretrain", lambda t: [*TRAIN(t), "img_size=4"], None),
    ("mpp.ratio choosing no patch", "pretrain", lambda t: [*TRAIN(t), "mpp.ratio=0.001"], None),
    ("mpp.bits=8 (a 16.7M-class head)", "pretrain", lambda t: [*TRAIN(t), "mpp.bits=8"], None),
    ("optim.lr=.inf", "pretrain", lambda t: [*TRAIN(t), "optim.lr=.inf"], None),
    ("mpp.ratio=.nan", "pretrain", lambda t: [*TRAIN(t), "mpp.ratio=.nan"], None),
    ("optim.beta2 of 1 or more", "pretrain", lambda t: [*TRAIN(t), "optim.beta2=1"], None),
    ("optim.min_lr above optim.lr", "pretrain", lambda t: [*TRAIN(t), "optim.min_lr=0.5"], None),
    ("both steps and epochs (one would be ignored)", "pretrain", lambda t: [*TRAIN(t), "epochs=3"], None),
    ("unlabeled few-shot training set (checked before training)", "pretrain",
     lambda t: [*FS(t), f"fewshot.train={t}/data/unlabeled"], None),
    ("unlabeled few-shot test set (checked before training)", "pretrain",
     lambda t: [*FS(t), f"fewshot.test={t}/data/unlabeled"], None),
    ("few-shot sets with other classes", "pretrain", lambda t: [*FS(t), f"fewshot.test={t}/data/other"], None),
    ("few-shot on without its sets", "pretrain", lambda t: [*TRAIN(t), "fewshot.every=1"], None),
    ("supervised pre-training on shards of one class", "pretrain",
     lambda t: [*TRAIN(t), "objective=supervised", f"data.train={t}/data/oneclass"], None),
    ("no few-shot shots", "pretrain", lambda t: [*TRAIN(t), "fewshot.shots=[]"], None),
    ("few-shot without its ridge term", "pretrain", lambda t: [*TRAIN(t), "fewshot.l2=0"], None),
    ("data.withhold not a list of triples", "pretrain", lambda t: [*TRAIN(t), "data.withhold=[0.1,0,0.1]"], None),
    ("data.eval_crop_pct resizing images 100 times over", "pretrain", lambda t: [*TRAIN(t), "data.eval_crop_pct=0.01"],
     None),
    ("a shuffle buffer bounded to no bytes", "pretrain", lambda t: [*TRAIN(t), "data.shuffle_mb=0"], None),
    ("a data timeout past what a timer holds", "pretrain", lambda t: [*TRAIN(t), "data.timeout=1e14"], None),
    ("data.withhold of unlabeled shards", "pretrain",
     lambda t: [*TRAIN(t), f"data.train={t}/data/unlabeled", "data.withhold=[[0.5,0,0.1]]"], None),
    ("a negative seed", "pretrain", lambda t: [*TRAIN(t), "seed=-1"], None),
    ("a batch_size past any real batch", "pretrain", lambda t: [*TRAIN(t), "batch_size=1e19"], None),
    ("a data.std that would overflow every input", "pretrain", lambda t: [*TRAIN(t), "data.std=[0.5,0.5,1e-300]"],
     None),
    ("RandAugment of more ops than an image could take", "pretrain", lambda t: [*TRAIN(t), "data.randaugment=[1e19,9]"],
     None),
    ("a shift as wide as the images", "pretrain", lambda t: [*TRAIN(t), "data.shift=32"], None),
    ("a manifest of no samples", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/empty"],
     lambda t: ((t / "empty").mkdir(), (t / "empty/manifest.json").write_text(
         '{"shards": [], "num_samples": 0, "classes": ["a", "b"]}'))),
    ("a section given after one of its keys (merged: the key is still checked)", "pretrain",
     lambda t: [*TRAIN(t), "optim.lr=-1", "optim={name: sgd}"], None),
    ("a section set to null after one of its keys", "pretrain", lambda t: [*TRAIN(t), "optim.lr=0.2", "optim=null"],
     None),
    ("a fine-tune's objective given to the pre-training tool", "pretrain", lambda t: [*FT(t), "objective=classify"],
     None),
    ("a pre-training's objective given to the fine-tune tool", "finetune", lambda t: [*FT(t), "objective=mpp"], None),
    ("a pre-training's config file given to the fine-tune tool", "finetune",
     lambda t: ["--config", f"{t}/synthetic_mpp.yaml", *FT(t)],
     lambda t: shutil.copy(ROOT / "configs/synthetic_mpp.yaml", t)),
    ("a seed past numpy's 2**32 - 1", "finetune", lambda t: [*FT(t), "seed=1e23"], None),
    ("a split seed past 2**32 - 1", "finetune", lambda t: [*FT(t), "finetune.split_seed=1e23"], None),
    ("finetune.head_l2 without a probe head", "finetune", lambda t: [*FT(t), "finetune.head_l2=0.01"], None),
    ("one fold for the representation's choice", "finetune", lambda t: [*FT(t), "finetune.pool_folds=1"], None),
    ("a dotted key in a config file", "pretrain", lambda t: ["--config", f"{t}/dot.yaml", *TRAIN(t)],
     lambda t: (t / "dot.yaml").write_text("optim.lr: 0.1\n")),
    ("batch not divisible by accumulation", "pretrain", lambda t: [*TRAIN(t), "batch_size=6", "train.grad_accum=4"],
     None),
    ("CUDA graphs with gradient accumulation", "pretrain",
     lambda t: [*TRAIN(t), "batch_size=4", "train.grad_accum=2", "train.compile_mode=reduce-overhead"], None),
    ("config file that is a folder", "pretrain", lambda t: ["--config", f"{t}/data"], None),
    ("an empty config path (an unset variable: it trained on the defaults)", "pretrain",
     lambda t: ["--config", "", *TRAIN(t)], None),
    ("malformed YAML config", "pretrain", lambda t: ["--config", f"{t}/bad.yaml"],
     lambda t: (t / "bad.yaml").write_text("steps: [1,\n")),
    ("a key given twice in a config file", "pretrain", lambda t: ["--config", f"{t}/twice.yaml", *TRAIN(t)],
     lambda t: (t / "twice.yaml").write_text("optim: {lr: 0.1}\noptim: {name: sgd}\n")),
    ("a number where text is wanted (its spelling lost)", "pretrain", lambda t: [*TRAIN(t), "output_dir=1.10"], None),
    ("a negative sample count", "pretrain", lambda t: [*TRAIN(t), "data.num_samples=-5"], None),
    ("img_size of more patches than a model attends over", "pretrain", lambda t: [*TRAIN(t), "img_size=1e9"], None),
    ("a negative generator seed", "make_synthetic", lambda t: [f"{t}/syn", "--seed", "-1"], None),
    ("config file that is not UTF-8 text", "pretrain", lambda t: ["--config", f"{t}/bin.yaml"],
     lambda t: (t / "bin.yaml").write_bytes(b"steps: 1\n\xff\xfe\n")),
    ("config nested 2,000 lists deep", "pretrain", lambda t: ["--config", f"{t}/deep.yaml"],
     lambda t: (t / "deep.yaml").write_text("steps: " + "[" * 2000 + "]" * 2000 + "\n")),
    ("config whose base: does not exist", "pretrain", lambda t: ["--config", f"{t}/orphan.yaml"],
     lambda t: (t / "orphan.yaml").write_text("base: gone.yaml\nsteps: 1\n")),
    ("config whose base: includes itself", "pretrain", lambda t: ["--config", f"{t}/loop.yaml"],
     lambda t: (t / "loop.yaml").write_text("base: loop.yaml\nsteps: 1\n")),
    ("mistyped data directory", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/data/trian"], None),
    ("a shard pattern matching directories", "pretrain",
     lambda t: [*TRAIN(t), f"data.train={t}/s{{0..1}}.tar", "data.num_samples=10"],
     lambda t: [(t / f"s{i}.tar").mkdir() for i in range(2)]),
    ("malformed manifest JSON", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/bad/manifest.json"],
     lambda t: (t / "bad").mkdir() or (t / "bad/manifest.json").write_text("{\"shards\": [")),
    ("manifest naming a command (pipe:)", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/pipe/manifest.json"],
     lambda t: (t / "pipe").mkdir() or (t / "pipe/manifest.json").write_text(json.dumps(
         {"shards": [{"name": "pipe:touch /tmp/owned", "num_samples": 8}]}))),
    ("a shard changed since its manifest was written", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/m"],
     lambda t: _made(t, shard=b"\0" * 512)),
    ("manifest total that disagrees with its shards", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/m"],
     lambda t: _made(t, manifest=lambda m: m.update(num_samples=13))),
    ("manifest listing one shard twice", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/m"],
     lambda t: _made(t, manifest=lambda m: (m["shards"].append(m["shards"][0]),
                                            m.update(num_samples=sum(x["num_samples"] for x in m["shards"]))))),
    ("shard list naming one shard twice", "pretrain",
     lambda t: [*TRAIN(t), f"data.train=[{t}/data/train/000000.tar,{t}/data/train/000001.tar,{t}/data/train/000001.tar]",
                "data.num_samples=16"], None),
    ("a list of manifests", "pretrain",
     lambda t: [*TRAIN(t), f"data.train=[{t}/data/train/manifest.json,{t}/data/val/manifest.json]"], None),
    ("manifest nested 100,000 lists deep", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/m"],
     lambda t: _made(t) or (t / "m/manifest.json").write_text("[" * 100_000)),
    ("manifest with a shard count past any integer (1e400)", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/m"],
     lambda t: _made(t, manifest=lambda m: m["shards"][0].update(num_samples=float("inf")))),
    ("manifest with a negative shard count (the total kept)", "pretrain", lambda t: [*TRAIN(t), f"data.train={t}/m"],
     lambda t: _made(t, manifest=lambda m: (m["shards"][1].update(num_samples=m["shards"][1]["num_samples"]
                                                                  + m["shards"][0]["num_samples"] + 10),
                                            m["shards"][0].update(num_samples=-10)))),
    ("label index with a label past any integer (older manifest)", "finetune",
     lambda t: [*FT(t), f"data.train={t}/m", "finetune.label_fraction=0.5"],
     lambda t: _made(t, manifest=lambda m: m.pop("labels_sha256"), labels=lambda x: x[0][0].__setitem__(1, 1e400))),
    ("label index edited after its manifest", "finetune",
     lambda t: [*FT(t), f"data.train={t}/m", "finetune.label_fraction=0.5"],
     lambda t: _made(t, labels=lambda x: x[0].reverse())),
    ("label index that does not describe its shards (older manifest)", "finetune",
     lambda t: [*FT(t), f"data.train={t}/m", "finetune.label_fraction=0.5"],
     lambda t: _made(t, manifest=lambda m: m.pop("labels_sha256"), labels=lambda x: x[1].pop())),
    ("output_dir is a file", "pretrain", lambda t: [*TRAIN(t)[1:], f"output_dir={t}/afile"],
     lambda t: (t / "afile").write_text("x")),
    ("output_dir in use by another run", "pretrain", TRAIN,
     lambda t: (t / "out").mkdir() or _hold_lock(t / "out/.lock")),
    ("train.resume=none in a directory with an earlier run", "pretrain", lambda t: [*TRAIN(t), "train.resume=none"],
     lambda t: (t / "out").mkdir() or (t / "out/metrics.json").write_text("{}")),
    ("a finished run whose checkpoints were deleted, started again", "pretrain", TRAIN,
     lambda t: (t / "out").mkdir() or (t / "out/encoder.safetensors").write_bytes(b"x")),
    ("a finished run started again with other settings", "pretrain", lambda t: [*TRAIN(t), "optim.lr=0.01"],
     lambda t: _finished(t)),
    ("a finished run started again with more steps", "pretrain", lambda t: [*TRAIN(t), "steps=4"],
     lambda t: _finished(t)),
    ("resume: the only checkpoint is a pickle payload", "pretrain", TRAIN, lambda t: _ckpt_run(t, _pickle())),
    ("train.resume=PATH that is not a checkpoint", "pretrain", lambda t: [*TRAIN(t), f"train.resume={t}/data"], None),
    ("train.resume=PATH whose checkpoint does not load", "pretrain", lambda t: [*TRAIN(t), f"train.resume={OLD(t)}"],
     lambda t: _ckpt_run(t, _pickle(), run="old")),
    ("train.resume=PATH of another model's run", "pretrain", lambda t: [*TRAIN(t), f"train.resume={OLD(t)}"],
     lambda t: _ckpt_run(t, *_foreign(), "old")),
    ("resume in an output_dir of another model's run", "pretrain", TRAIN, lambda t: _ckpt_run(t, *_foreign())),
    ("resume of a checkpoint written by another number of processes", "pretrain", TRAIN,
     lambda t: _ckpt_run(t, *_foreign(world_size=2))),
    ("fine-tune without data.val", "finetune", TRAIN, None),
    ("fine-tune with finetune.init empty", "finetune", lambda t: [*TRAIN(t), "finetune.init="], None),
    ("mpp.target=downsampled at 5 bits a channel (a 524288-wide head)", "pretrain",
     lambda t: [*TRAIN(t), "mpp.target=downsampled", "mpp.bits=5"], None),
    ("train.dist_timeout past timedelta's range", "pretrain", lambda t: [*TRAIN(t), "train.dist_timeout=1e14"], None),
    ("data.val missing (checked before training)", "finetune", lambda t: [*TRAIN(t), f"data.val={t}/data/vla"], None),
    ("data.val with other classes", "finetune", lambda t: [*TRAIN(t), f"data.val={t}/data/other"], None),
    ("unlabeled data.val (checked before training)", "finetune",
     lambda t: [*TRAIN(t), f"data.val={t}/data/unlabeled"], None),
    ("finetune.init that does not exist", "finetune", lambda t: [*FT(t), f"finetune.init={t}/nope"], None),
    ("finetune.init of a pre-training that has not finished", "finetune", lambda t: [*FT(t), f"finetune.init={t}/run"],
     _unfinished),
    ("fine-tune at an img_size its encoder's patch size does not divide", "finetune",
     lambda t: [*FT(t), f"finetune.init={t}/enc", "img_size=36"], lambda t: _encoder(t, preset="vit_mini8_32")),
    ("encoder model.json that does not match it", "finetune", lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, {"name": "vit_tiny_patch16_224", "kwargs": {"img_size": 32, "patch_size": 4}})),
    ("encoder model.json asking for a model far larger than its weights (built on no memory first)", "finetune",
     lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, {"name": "vit_tiny_patch16_224", "kwargs": {
         "img_size": 32, "patch_size": 4, "embed_dim": 8192, "depth": 100, "num_heads": 8}})),
    ("encoder model.json naming a timm model that is no ViT", "finetune", lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, {"name": "resnet18", "kwargs": {}})),
    ("encoder model.json naming an unknown timm model", "finetune", lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, {"name": "vit_nonexistent", "kwargs": {}})),
    ("malformed encoder model.json", "finetune", lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, "{\"name\": ")),
    ("encoder model.json whose kwargs make timm load another file (a pickle)", "finetune",
     lambda t: [*FT(t), f"finetune.init={t}/enc"], _encoder_loading_a_pickle),
    ("truncated encoder.safetensors", "finetune", lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, weights=(_encoder(t) / "encoder.safetensors").read_bytes()[:300])),
    ("pickled encoder.safetensors", "finetune", lambda t: [*FT(t), f"finetune.init={t}/enc"],
     lambda t: _encoder(t, weights=_pickle())),
    ("fine-tune of an encoder trained on inputs normalised otherwise", "finetune",
     lambda t: [*FT(t), f"finetune.init={t}/enc"], lambda t: _encoder(t, data=IMAGENET)),
    ("probe of an encoder trained on inputs normalised otherwise", "linear_probe",
     lambda t: [*FT(t), f"probe.encoder={t}/enc"], lambda t: _encoder(t, data=IMAGENET)),
    ("probe: data.val with other classes", "linear_probe",
     lambda t: [*TRAIN(t), f"data.val={t}/data/other", "probe.encoder=none"], None),
    ("probe: unlabeled data.val (checked before the features)", "linear_probe",
     lambda t: [*TRAIN(t), f"data.val={t}/data/unlabeled", "probe.encoder=none"], None),
    ("probe without an encoder", "linear_probe", lambda t: [*FT(t)], None),
    ("probe.encoder that does not exist", "linear_probe", lambda t: [*FT(t), f"probe.encoder={t}/nope"], None),
    ("probe.encoder of a pre-training that has not finished", "linear_probe",
     lambda t: [*FT(t), f"probe.encoder={t}/run"], _unfinished),
    ("probe.dev_split out of range", "linear_probe",
     lambda t: [*FT(t), "probe.encoder=none", "probe.dev_split=[0,1.5]"], None),
    ("probe: output_dir is a file", "linear_probe",
     lambda t: [*FT(t)[1:], "probe.encoder=none", f"output_dir={t}/afile"], lambda t: (t / "afile").write_text("x")),
    ("report of a path that does not exist", "report", lambda t: [f"{t}/nope"], None),
    ("report of a directory without a run", "report", lambda t: [f"{t}/empty"], lambda t: (t / "empty").mkdir()),
    ("report of an empty path (an unset variable: it reported every run below the working folder)", "report",
     lambda t: [""], None),
    ("report of a run whose metrics.json is not an object", "report", lambda t: [f"{t}/run"],
     lambda t: _run_dir(t, "[]", "objective: mpp\n")),
    ("report of a run with a malformed config.yaml", "report", lambda t: [f"{t}/run"],
     lambda t: _run_dir(t, "{}", "objective: [mpp\n")),
    ("report --repeat of a folder without a comparison's report", "report",
     lambda t: [f"{t}/nope", "--repeat", f"{t}/nope"], None),
    ("report --repeat naming the report's own folder", "report",
     lambda t: [f"{t}/run", "--out", f"{t}/out", "--repeat", f"{t}/out"],
     lambda t: (_run_dir(t, '{"kind": "linear_probe", "top1": 0.4}', "objective: mpp\nprobe: {encoder: none}\n"),
                (t / "out").mkdir(), (t / "out" / "report.json").write_text('{"derived": {}}'))),
    ("report re-rendered where the report names a repeat that is gone", "report", lambda t: [f"{t}/run"],
     lambda t: (_run_dir(t, '{"kind": "linear_probe", "top1": 0.4}', "objective: mpp\nprobe: {encoder: none}\n"),
                (t / "report.json").write_text(json.dumps({"runs": [{"dir": str(t / "run")}], "plan": ["run"],
                                                           "pretrain_seeds": {"seeds": 2, "repeats": ["gone"]}})))),
    ("report of a comparison's folder whose report.json holds a damaged plan", "report", lambda t: [f"{t}/cmp"],
     lambda t: ((t / "cmp").mkdir(), (t / "cmp" / "report.json").write_text('{"plan": 3}'))),
    ("report of a comparison's folder whose plan names a run since deleted", "report", lambda t: [f"{t}/cmp"],
     lambda t: ((t / "cmp").mkdir(), (t / "cmp" / "report.json").write_text('{"plan": ["finetune_mpp_10pct"]}'))),
    ("report of one run into its comparison's folder, by default", "report", lambda t: [f"{t}/cmp/run"],
     lambda t: ((t / "cmp").mkdir(), (t / "cmp" / "report.json").write_text('{"plan": ["run", "other"]}'),
                _run_dir(t / "cmp", '{"kind": "linear_probe", "top1": 0.4}',
                         "objective: mpp\nprobe: {encoder: none}\n"))),
    ("make_shards from a missing folder", "make_shards", lambda t: [f"{t}/nope", f"{t}/out"], None),
    ("a missing argument", "make_shards", lambda t: [f"{t}/nope"], None),
    ("make_shards from a tar cut short at a member's end", "make_shards", lambda t: [f"{t}/cut.tar", f"{t}/out"],
     lambda t: _cut_tar(t / "cut.tar")),
    ("make_shards with shards of 0 samples", "make_shards",
     lambda t: [f"{t}/data/train", f"{t}/out", "--samples-per-shard", "0"], None),
    ("make_shards of an empty source path", "make_shards", lambda t: ["", f"{t}/shards"], None),
    ("make_shards into a folder inside its source", "make_shards", lambda t: [f"{t}/imgs", f"{t}/imgs/shards"],
     lambda t: _image_folder(t / "imgs")),
    ("make_shards from a .tar.gz cut inside its first block", "make_shards",
     lambda t: [f"{t}/cut.tar.gz", f"{t}/out"],
     lambda t: (t / "cut.tar.gz").write_bytes(gzip.compress(bytes(10240))[:12])),
    ("make_shards from a pipe", "make_shards", lambda t: [f"{t}/fifo", f"{t}/out"], lambda t: os.mkfifo(t / "fifo")),
    ("soak for a negative time", "soak", lambda t: [f"{t}/soak", "--minutes", "-1"], None),
    ("soak whose runs save no checkpoint before their end", "soak",
     lambda t: [f"{t}/soak", "--minutes", "1", "train.ckpt_every=0"], None),
    ("soak for no time", "soak", lambda t: [f"{t}/soak", "--minutes", "0"], None),
    ("soak into an earlier soak's folder", "soak", lambda t: [f"{t}/soak", "--minutes", "1"],
     lambda t: (t / "soak/run").mkdir(parents=True)),
    ("soak without its working folder", "soak", lambda t: ["--minutes", "1"], None),
    ("make_synthetic into a file", "make_synthetic", lambda t: [f"{t}/file.txt", "--train", "4"],
     lambda t: (t / "file.txt").write_text("x")),
    ("make_synthetic of a negative count", "make_synthetic", lambda t: [f"{t}/syn", "--train", "-1"], None),
    ("make_synthetic of images under 8 pixels", "make_synthetic", lambda t: [f"{t}/syn", "--size", "4"], None),
    ("make_synthetic over a split made with other --shards", "make_synthetic",
     lambda t: [f"{t}/syn", "--train", "10", "--test", "0", "--shards", "2"], lambda t: _synthetic(t)),
    ("make_synthetic over a split whose manifest is malformed JSON", "make_synthetic",
     lambda t: [f"{t}/syn", "--train", "10", "--test", "0", "--shards", "1"], lambda t: _synthetic(t, '{"made": ')),
    ("make_synthetic over a split whose manifest is not a JSON object", "make_synthetic",
     lambda t: [f"{t}/syn", "--train", "10", "--test", "0", "--shards", "1"], lambda t: _synthetic(t, "[1, 2]")),
    ("compare config that does not exist", "compare", lambda t: ["--config", f"{t}/nope.yaml"], None),
    ("comparison launcher whose process count is no number", "compare",
     lambda t: ["--config", f"{t}/c.yaml", "launcher=true --nproc_per_node two"], lambda t: _compare(t)),
    ("comparison launcher that is no command", "compare", lambda t: ["--config", f"{t}/c.yaml", "launcher=torchrn"],
     lambda t: _compare(t)),
    ("comparison whose scratch arm builds another model than the pre-trainings", "compare",
     lambda t: ["--config", f"{t}/c.yaml", "fraction_overrides={1.0: [model=vit_micro4_32]}"], lambda t: _compare(t)),
    ("comparison whose fine-tune config is a pre-training's", "compare",
     lambda t: ["--config", f"{t}/c.yaml", f"finetune={t}/synthetic_mpp.yaml"], lambda t: _compare(t)),
    ("comparison whose fine-tunes are tested on other images than its probes", "compare",
     lambda t: ["--config", f"{t}/c.yaml", f"overrides=[data.val={t}/test]",
                f"fraction_overrides={{1.0: [data.val={t}/other]}}"], lambda t: _compare(t)),
    ("soak setting that is not a config key", "soak", lambda t: [f"{t}/soak", "--minutes", "1", "stepz=3"], None),
    ("inspect an encoder that does not exist", "inspect_encoders",
     lambda t: ["--encoder", f"{t}/nope", "--data", f"{t}/data/val", "--out", f"{t}/figures"], None),
    ("inspect a random encoder of an unknown preset", "inspect_encoders",
     lambda t: ["--encoder", "none:vit_nope", "--data", f"{t}/data/val", "--out", f"{t}/figures"], None),
    ("inspect an encoder labelled with nothing after =", "inspect_encoders",
     lambda t: ["--encoder", "mpp=", "--data", f"{t}/data/val", "--out", f"{t}/figures"], None),
    ("inspect on data that does not exist", "inspect_encoders",
     lambda t: ["--encoder", "none:vit_micro4_32", "--data", f"{t}/data/nope", "--out", f"{t}/figures"], None),
    ("inspect on shards named without a manifest or --num-samples", "inspect_encoders",
     lambda t: ["--encoder", "none:vit_micro4_32", "--data", f"{t}/data/val/{{000000..000001}}.tar", "--out",
                f"{t}/figures"], None),
    ("inspect a random encoder at 100,000 px", "inspect_encoders",
     lambda t: ["--encoder", "none:vit_micro4_32@100000", "--data", f"{t}/data/val", "--out", f"{t}/figures"], None),
    ("inspect with a seed past 2**32 - 1", "inspect_encoders",
     lambda t: ["--encoder", "none:vit_micro4_32", "--data", f"{t}/data/val", "--out", f"{t}/figures", "--seed",
                "99999999999999999999"], None),
    ("inspect over 0 images", "inspect_encoders",
     lambda t: ["--encoder", "none:vit_micro4_32", "--data", f"{t}/data/val", "--out", f"{t}/figures", "--images", "0"],
     None),
]
_locks: list = []


def _hold_lock(path: Path) -> None:
    """Another run's lock, held by another process (POSIX locks never conflict within one)."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'a+'); fcntl.lockf(f, fcntl.LOCK_EX)\n"
                               "f.write('12345\\n'); f.flush(); print('held', flush=True); time.sleep(300)",
                               str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    _locks.append(holder)


def tool_in_process(tool: str, argv: list[str]) -> tuple[int, str]:
    """Run tools/TOOL.py in this process; (exit code, stderr)."""
    err, old = io.StringIO(), sys.argv
    sys.argv = [f"tools/{tool}.py", *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(ROOT / f"tools/{tool}.py"), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            err.write(e.code + "\n")
    finally:
        sys.argv = old
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip() and not ln.startswith("warning:")]
    return code, "\n".join(lines)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its size and mtime (files only: a lock taken and given back
    touches its directory's mtime, not its content)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def run_case(tmp: Path, case) -> tuple[int, str, set[str]]:
    """(exit code, stderr with the scratch path as TMP, paths written by the run)."""
    what, tool, args, setup = case
    if setup:
        setup(tmp)
    before = snapshot(tmp)
    try:
        code, err = tool_in_process(tool, args(tmp))
    finally:
        while _locks:
            holder = _locks.pop()
            holder.kill()
            holder.wait()
    after = snapshot(tmp)
    changed = {k for k in after if before.get(k) != after[k]} | (before.keys() - after.keys())
    return code, err.replace(str(tmp), "TMP"), changed


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return _data(tmp_path_factory.mktemp("errdata"))


def _scratch(tmp: Path, data_root: Path) -> Path:
    tmp.mkdir(parents=True)
    (tmp / "data").symlink_to(data_root)
    return tmp


@pytest.mark.slow
def test_every_bad_input_is_one_line_nothing_written_and_in_the_docs(data_root, tmp_path):
    Path("/tmp/owned").unlink(missing_ok=True)  # the payloads' mark: one left by another process proves nothing here
    rows = []
    for i, case in enumerate(CASES):
        code, err, changed = run_case(_scratch(tmp_path / str(i), data_root), case)
        assert code != 0 and err.count("\n") == 0 and err.startswith("error: "), (case[0], code, err)
        assert not changed, (case[0], changed)
        assert not os.path.exists("/tmp/owned")
        rows.append((case[0], case[1], code, err))
    assert DOC.read_text() == render(rows), "docs/errors.md is stale: run python tests/test_errors.py"


def test_a_full_disk_says_so(tmp_path, monkeypatch):
    """A writer that fails its own way (torch.save: 'unexpected pos') on a nearly full disk is
    reported as a full disk, and the target file is left untouched."""
    from mpp.cli import one_line_errors
    from mpp.fileio import atomic_path
    import mpp.fileio
    (tmp_path / "f").write_text("old")
    monkeypatch.setattr(mpp.fileio.shutil, "disk_usage", lambda p: _Usage(0))
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err), one_line_errors():
        with atomic_path(tmp_path / "f") as f:
            f.write_text("partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert e.value.code == 1 and "the disk is full" in err.getvalue() and err.getvalue().count("\n") == 1
    assert (tmp_path / "f").read_text() == "old" and os.listdir(tmp_path) == ["f"]


def test_tensorboards_own_errors_keep_their_words(tmp_path, monkeypatch):
    """An OSError of no errno is TensorBoard's own ("Writer is closed"): it is raised as it is, not
    rewritten into "[Errno None] None: FOLDER"; one with an errno (the disk's) names the folder."""
    import errno
    from mpp.tensorboard import TensorBoard
    tb = TensorBoard(tmp_path)
    try:
        for raised in (OSError("Writer is closed"), OSError(errno.ENOSPC, "No space left on device")):
            def fail(*args, raised=raised):
                raise raised
            monkeypatch.setattr(tb._writer, "add_scalar", fail)
            with pytest.raises(OSError) as e:
                tb.add_scalar("x", 1.0, 0)
            assert (e.value.errno, str(e.value)) == ((None, "Writer is closed") if raised.errno is None else
                                                     (errno.ENOSPC, f"[Errno 28] No space left on device: '{tmp_path}'"))
    finally:
        monkeypatch.undo()
        tb.close()


def test_a_full_disk_under_tensorboard_is_one_line_naming_its_folder(data_root, tmp_path, monkeypatch):
    """TensorBoard's writer thread met the full disk: its traceback was printed before the error,
    which (the thread's, of no file) read "the disk is full (writing)", naming nothing. Now one
    line names the folder, and the run is not finished (no metrics.json); an error of no file
    says no "(writing)"."""
    import errno
    import threading
    from tensorboard.summary.writer.record_writer import RecordWriter
    from mpp.cli import os_message
    write, calls = RecordWriter.write, []

    def full(self, data):  # the disk fills after the writer's first events
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, data)
    monkeypatch.setattr(RecordWriter, "write", full)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # it prints (pytest's own records)
    out = tmp_path / "out"
    code, err = tool_in_process("pretrain", [f"output_dir={out}", f"data.train={data_root}/train", *SMALL])
    errors = [line[line.index("error:"):] for line in err.splitlines() if "error:" in line]  # after tqdm's bar
    assert code == 1 and "Traceback" not in err and errors == [
        f"error: the disk is full (writing '{out / 'tensorboard'}'); free space or choose an output_dir on another "
        "disk"], err
    assert not (out / "metrics.json").exists() and threading.excepthook is threading.__excepthook__
    assert os_message(OSError(errno.ENOSPC, "No space left on device")) == \
        "the disk is full; free space or choose an output_dir on another disk"


def test_ctrl_c_is_one_line_and_exit_130():
    """Ctrl-C in a tool: one line (a training tool's says how to resume), exit 130 as a shell's; none
    in a comparison's stage."""
    from mpp.cli import QUIET_INTERRUPT, RESUMABLE, one_line_errors
    for message in ("interrupted", RESUMABLE):
        err = io.StringIO()
        with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err), one_line_errors(interrupted=message):
            raise KeyboardInterrupt
        assert e.value.code == 130 and err.getvalue() == f"error: {message}\n"
    with pytest.MonkeyPatch.context() as mp:  # a comparison's stage: the comparison's line names it
        mp.setenv(QUIET_INTERRUPT, "1")
        err = io.StringIO()
        with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err), one_line_errors(interrupted=RESUMABLE):
            raise KeyboardInterrupt
        assert e.value.code == 130 and err.getvalue() == ""


def test_ctrl_c_in_a_fine_tune_says_how_to_resume(monkeypatch):
    """The fine-tune tool's Ctrl-C line is the training tools' (run the same command to resume)."""
    import mpp.train
    from mpp.cli import QUIET_INTERRUPT, RESUMABLE
    from mpp.tools.finetune import main
    from toolrun import call

    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(mpp.train, "train", interrupted)
    monkeypatch.delenv(QUIET_INTERRUPT, raising=False)
    r = call(main, ["--config", str(ROOT / "configs/synthetic_finetune.yaml")])
    assert r.returncode == 130 and r.stderr.splitlines()[-1] == f"error: {' '.join(RESUMABLE.split())}"


def test_a_message_of_several_lines_is_printed_as_one(capsys):
    """A config error's message that spans lines (a YAML parser's, a wrapped hint) is printed as one
    `error:` line, its line breaks and indentation each made one space."""
    from mpp.cli import one_line_errors
    from mpp.config import ConfigError
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise ConfigError("a\n  b")
    assert e.value.code == 2 and capsys.readouterr().err == "error: a b\n"


def test_a_read_only_file_system_gets_the_advice_of_a_missing_permission():
    """EROFS (a read-only mount), EACCES and EPERM all say to choose a writable output_dir."""
    import errno
    from mpp.cli import os_message
    for code, words in ((errno.EACCES, "Permission denied"), (errno.EPERM, "Operation not permitted"),
                        (errno.EROFS, "Read-only file system")):
        assert os_message(OSError(code, words, "/x")) == \
            f"no permission to write '/x' ({words}); choose a writable output_dir", code


def test_out_of_memory_is_one_line_saying_what_to_lower():
    """A failed allocation (the CPU allocator's RuntimeError, the GPU's OutOfMemoryError, Python's
    MemoryError) ended in a traceback; a bug's RuntimeError still keeps its own."""
    from mpp.cli import one_line_errors
    for e in (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 1099545182464 bytes."), torch.OutOfMemoryError("CUDA out of memory."),
              MemoryError()):
        err = io.StringIO()
        with pytest.raises(SystemExit) as exit, contextlib.redirect_stderr(err), one_line_errors():
            raise e
        assert exit.value.code == 1 and err.getvalue().startswith("error: out of memory (") and \
            err.getvalue().count("\n") == 1 and "lower the batch size" in err.getvalue()
    with pytest.raises(RuntimeError, match="a bug"), one_line_errors():
        raise RuntimeError("a bug")


@pytest.mark.parametrize("env, says", [
    ({"MASTER_PORT": "abc", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"},
     "environment variable MASTER_PORT='abc' is not a whole number"),
    ({"MASTER_PORT": "70000", "MASTER_ADDR": "127.0.0.1"}, "environment variable MASTER_PORT=70000 is out of range"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1"}, "environment variable RANK=2 is out of range"),
    ({"WORLD_SIZE": "2"}, "environment variable WORLD_SIZE=2 asks for 2 processes, but MASTER_ADDR")])
def test_a_bad_launch_variable_is_one_line(data_root, tmp_path, monkeypatch, env, says):
    """The launcher's variables, mistyped or left from another launch, ended in torch's or
    Accelerate's traceback (int('abc') in the rendezvous; MASTER_ADDR not set), or with MASTER_ADDR
    in a wait of train.dist_timeout for ranks that never come; now one line before any work."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = tool_in_process("pretrain", [f"output_dir={tmp_path}/out", f"data.train={data_root}/train", *SMALL])
    assert code == 2 and err.startswith(f"error: {says}") and err.count("\n") == 0, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, edge, past", [("WORLD_SIZE", "1", "0"), ("RANK", "0", "-1"), ("LOCAL_RANK", "0", "-1"),
                                              ("LOCAL_WORLD_SIZE", "1", "0"), ("MASTER_PORT", "1", "0"),
                                              ("MASTER_PORT", "65535", "65536")])
def test_a_launch_variable_at_its_range_edge_is_taken_and_past_it_refused(monkeypatch, name, edge, past):
    from mpp.config import ConfigError
    from mpp.launcher import launch_env
    for other in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, edge)
    launch_env()
    monkeypatch.setenv(name, past)
    with pytest.raises(ConfigError, match=f"environment variable {name}={past} is out of range"):
        launch_env()


class _Usage:
    def __init__(self, free: int):
        self.free = free


@pytest.mark.slow
def test_a_real_full_disk_stops_a_run_with_one_line(data_root, tmp_path):
    """A 400 KiB tmpfs (needs root to mount; skipped otherwise): a run whose checkpoint does not fit."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=400k tmpfs {mnt} 2>/dev/null"):
        pytest.skip("cannot mount a small tmpfs here (test_a_full_disk_says_so covers the translation)")
    try:
        code, err = tool_in_process("pretrain", [f"output_dir={mnt}/out", f"data.train={data_root}/train", *SMALL,
                                          "train.ckpt_every=1"])
    finally:
        os.system(f"umount {mnt}")
    errors = [line[line.index("error:"):] for line in err.splitlines() if "error:" in line]  # after tqdm's bar
    assert code == 1 and len(errors) == 1 and errors[0].startswith("error: the disk is full"), err


def render(rows) -> str:
    lines = ["# Bad input and its one-line errors", "",
             "Every case below exits non-zero with exactly this one line on stderr and writes nothing "
             "(no output directory, no config.yaml). Generated by `python tests/test_errors.py` from the "
             "cases that `tests/test_errors.py` runs; TMP is the test's scratch directory. Exit code 2: a bad "
             "setting or argument; 1: bad data, files or a run that cannot go on. A full disk says "
             "`error: the disk is full (writing '...'); free space or choose an output_dir on another disk`.", "",
             "| case | tool | exit | message |", "|---|---|---|---|"]
    for what, tool, code, err in rows:
        lines.append(f"| {what} | {tool} | {code} | `{err.replace('|', '¦')}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.path.insert(0, str(ROOT))  # this checkout's mpp, not an installed one
    with tempfile.TemporaryDirectory() as d:
        data_root = _data(Path(d) / "shared")
        rows = []
        for i, case in enumerate(CASES):
            code, err, _ = run_case(_scratch(Path(d) / str(i), data_root), case)
            rows.append((case[0], case[1], code, err))
    DOC.write_text(render(rows))
    print(f"wrote {DOC} ({len(rows)} cases)")


if __name__ == "__main__":
    main()


def test_a_figure_that_fails_to_draw_leaves_the_old_one(tmp_path):
    """Figures are written through a temporary file: one cut off mid-write (here an error in
    matplotlib) leaves the previous figure whole, and nothing beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpp.fileio import save_figure
    fig = plt.figure()
    save_figure(fig, tmp_path / "f.png")
    old = (tmp_path / "f.png").read_bytes()
    fig = plt.figure()
    fig.text(0.5, 0.5, "$\\frac{$")  # mathtext that fails while drawing
    with pytest.raises(ValueError):
        save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes() == old and old.startswith(b"\x89PNG") and os.listdir(tmp_path) == ["f.png"]


def test_a_run_dir_saved_with_both_steps_and_epochs_still_loads():
    """Runs saved before the refusal hold both keys: reading their config.yaml (figures, reports,
    a comparison's checks) must work; only a run's start refuses them."""
    from mpp.config import ConfigError, load_config
    from mpp.runtime import check_run_settings
    cfg = load_config(None, ["output_dir=x", "steps=600", "epochs=5"])
    with pytest.raises(ConfigError, match=r"'steps' \(600\) and 'epochs' \(5\) both set the run length"):
        check_run_settings(cfg)
