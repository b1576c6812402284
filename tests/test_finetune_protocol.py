"""The paper's fine-tuning protocol pieces: a class-balanced seeded development split drawn from
the label-fraction subset, a fine-tune that trains on the rest and evaluates on it, and the
MAE/BEiT-style recipe (AdamW, layer-wise lr decay, drop path, label smoothing) as a shipped config."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from colours import write_colours

from mpp import outcomes
from mpp.config import load_config
from mpp.data.decode import DataError
from mpp.data.sources import ShardSet, resolve
from mpp.data.subset import select_subset, withhold_splits

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    """300 train / 60 val noisy images whose class is their dominant colour channel."""
    return write_colours(tmp_path_factory.mktemp("colours"), (("train", 300), ("val", 60)))


def _labels(shards) -> Counter:
    keys = {(u, k) for u, ks in zip(shards.urls, shards.keys) for k in ks}
    return keys, Counter(int(k) % 3 for _, k in keys)  # keys are the item names: index % 3 is the class


def test_dev_split_is_class_balanced_seeded_and_drawn_from_the_subset(colours):
    shards = resolve(str(colours / "train/manifest.json"), 0)
    subset, per_class = _labels(select_subset(shards, 0.5, seed=7))
    dev, dev_classes = _labels(select_subset(shards, 0.5, seed=7, dev_fraction=0.2, dev=True))
    rest, _ = _labels(select_subset(shards, 0.5, seed=7, dev_fraction=0.2, dev=False))
    assert per_class == {0: 50, 1: 50, 2: 50} and dev_classes == {0: 10, 1: 10, 2: 10}
    assert dev | rest == subset and not dev & rest  # the subset is unchanged by the split
    assert _labels(select_subset(shards, 0.5, seed=7, dev_fraction=0.2, dev=True))[0] == dev  # seeded
    assert _labels(select_subset(shards, 0.5, seed=8, dev_fraction=0.2, dev=True))[0] != dev
    whole, _ = _labels(select_subset(shards, 1.0, seed=0, dev_fraction=0.1, dev=True))
    assert len(whole) == 30
    # of all the labels too (the probes' and the 100% cells' split), where the subset cannot vary
    assert _labels(select_subset(shards, 1.0, seed=1, dev_fraction=0.1, dev=True))[0] != whole


def test_subset_and_dev_split_sizes_round_to_the_nearest_count(colours):
    """0.127 of a class's 100 images is 12.7, so 13, not the 12 of a floor; 0.27 of those 13 is 3.51,
    so 4 in the development split."""
    shards = resolve(str(colours / "train/manifest.json"), 0)
    assert _labels(select_subset(shards, 0.127, seed=2))[1] == {0: 13, 1: 13, 2: 13}
    assert _labels(select_subset(shards, 0.127, seed=2, dev_fraction=0.27, dev=True))[1] == {0: 4, 1: 4, 2: 4}


def test_the_fine_tunes_development_split_is_scored_on_its_split_seed(colours, monkeypatch):
    """A fine-tune with finetune.split_seed=3 trains on the rest of seed 3's development split, so
    its evaluator must score that split: with another seed's it scores images it trained on."""
    import mpp.evaluators.classify as classify
    from mpp.data import make_loader

    class Built(Exception):
        pass

    def built(*args, **kwargs):  # the evaluator's loader: kept, and the run stopped there
        raise Built(make_loader(*args, **kwargs))
    monkeypatch.setattr(classify, "make_loader", built)
    cfg = load_config(None, ["objective=classify", "model=vit_micro4_32", "batch_size=16", "steps=1",
                             f"data.train={colours / 'train/manifest.json'}",
                             f"data.val={colours / 'val/manifest.json'}", "finetune.label_fraction=0.5", "finetune.dev_fraction=0.2", "finetune.split_seed=3"])
    from mpp.models import create_encoder
    encoder = create_encoder("vit_micro4_32")
    with pytest.raises(Built) as e:
        classify.Evaluator(cfg, "cpu").run(type("Classifier", (), {"encoder": encoder})())
    shards = resolve(str(colours / "train/manifest.json"), 0)
    scored, _ = _labels(e.value.args[0].shards)
    assert scored == _labels(select_subset(shards, 0.5, seed=3, dev_fraction=0.2, dev=True))[0]
    assert not scored & _labels(select_subset(shards, 0.5, seed=3, dev_fraction=0.2, dev=False))[0]


def test_a_label_fraction_that_rounds_to_no_sample_of_a_class_is_warned_about(colours, caplog):
    """Each class keeps at least 1 sample: a fraction that rounds below it gives a subset larger
    than asked for, which used to go unsaid."""
    shards = resolve(str(colours / "train/manifest.json"), 0)
    with caplog.at_level("WARNING"):
        _, per_class = _labels(select_subset(shards, 0.001, seed=3))
    assert per_class == {0: 1, 1: 1, 2: 1}
    assert "a label fraction of 0.001 rounds to no sample of 3 of the 3 classes" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        select_subset(shards, 0.01, seed=3)  # 1 of 100 per class: as asked
    assert "rounds to no sample" not in caplog.text


@pytest.mark.slow
def test_finetune_with_dev_fraction_trains_on_the_rest_and_evaluates_on_dev(colours, tmp_path):
    from mpp.train import train
    items = [f"output_dir={tmp_path}", "objective=classify", "model=vit_micro4_32", "batch_size=16", "steps=4",
             f"data.train={colours / 'train/manifest.json'}", f"data.val={colours / 'val/manifest.json'}",
             "data.num_workers=0", "train.attn=math", "finetune.label_fraction=0.5", "finetune.dev_fraction=0.2"]
    m = train(load_config(None, items))
    assert m["evaluated_on"] == "dev" and m["val_samples"] == 30 and m["train_samples"] == 120
    final = train(load_config(None, items[:-1] + ["finetune.dev_fraction=0", f"output_dir={tmp_path / 'f'}"]))
    assert final["evaluated_on"] == "val" and final["val_samples"] == 60 and final["train_samples"] == 150
    _, correct = outcomes.read(final["outcomes"])  # the test images it got right, for the report's noise
    assert len(correct) == 60 and correct.mean() == pytest.approx(final["top1"])
    _, on_dev = outcomes.read(m["outcomes"])  # and the dev images, for the noise of the recipe's choice
    assert len(on_dev) == 30 and on_dev.mean() == pytest.approx(m["top1"])


def test_adamw_recipe_gives_layer_decayed_lrs():
    """configs/cifar10_finetune_adamw.yaml: block i of d at lr * decay^(d - i): the head at the
    full rate, the last block (and the final norm) one step down, the embeddings lowest."""
    from mpp.models import create_encoder
    from mpp.objectives import build_task
    from mpp.optim import create_optimizer, create_scheduler
    cfg = load_config(ROOT / "configs/cifar10_finetune_adamw.yaml")
    o = cfg.optim
    assert o.name == "adamw" and 0 < o.layer_decay < 1 and cfg.finetune.drop_path > 0
    assert cfg.finetune.label_smoothing > 0
    encoder = create_encoder(cfg.model, drop_path=cfg.finetune.drop_path, attn="math")
    task = build_task(cfg, encoder, num_classes=10)
    opt = create_optimizer(cfg, task)
    sched = create_scheduler(cfg, opt, total_steps=cfg.steps)
    sched.step_update(o.warmup_steps)  # end of warmup: every group at its peak
    depth = len(encoder.vit.blocks)
    lr = {n: g["lr"] for g in opt.param_groups for n, p in task.named_parameters() if any(p is q for q in g["params"])}
    assert lr["head.weight"] == pytest.approx(o.lr)
    assert lr[f"encoder.vit.blocks.{depth - 1}.mlp.fc1.weight"] == pytest.approx(o.lr * o.layer_decay)
    assert lr["encoder.vit.blocks.0.attn.qkv.weight"] == pytest.approx(o.lr * o.layer_decay ** depth)
    assert lr["encoder.vit.patch_embed.proj.weight"] == pytest.approx(o.lr * o.layer_decay ** (depth + 1))
    assert lr["encoder.vit.norm.weight"] == pytest.approx(o.lr * o.layer_decay)  # with the last block


@pytest.mark.slow
def test_adamw_recipe_trains(colours, tmp_path):
    """The recipe learns; under its layer-wise lr decay the logged train/lr is the largest group's
    (the head's, at optim.lr's schedule) rate of the logged step, not an embedding's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from mpp.train import train
    cfg = load_config(ROOT / "configs/cifar10_finetune_adamw.yaml", [
        f"output_dir={tmp_path}", "model=vit_micro4_32", "batch_size=16", "steps=30", "optim.warmup_steps=3",
        f"data.train={colours / 'train/manifest.json'}", f"data.val={colours / 'val/manifest.json'}",
        "data.num_workers=0", "train.attn=math"])
    m = train(cfg)
    assert m["top1"] > 0.6, m  # chance: 1/3
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/lr")}
    o = cfg.optim
    head = _lrs({"name": o.name, "lr": o.lr, "warmup_steps": o.warmup_steps, "schedule": o.schedule,
                 "min_lr": o.min_lr}, total_steps=30)  # no layer decay: the one group at the head's rate
    assert o.layer_decay < 1 and sorted(logged) == [20, 30]
    assert [logged[done] for done in (20, 30)] == pytest.approx([head[19], head[29]], rel=1e-5)  # step done-1's rate


def test_folded_probe_head_predicts_like_the_probe_on_standardised_features():
    """fit_linear_head folds the standardisation into the weights: raw features through the head
    give the logits of the logistic fit on standardised features."""
    import torch

    from mpp.evaluators.features import standardize
    from mpp.evaluators.linear_probe import _fit_logistic, fit_linear_head
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (200,), generator=g)
    x = torch.randn(200, 16, generator=g) * torch.linspace(0.1, 50, 16) + 7 + y[:, None] * torch.rand(16, generator=g)
    weight, bias = fit_linear_head(x, y, 4, l2=1e-2)
    w = _fit_logistic(standardize(x)[0], y, 4, 1e-2)
    torch.testing.assert_close(x @ weight.T + bias, standardize(x)[0] @ w[:-1] + w[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_head_init_probe_starts_the_fine_tune_at_the_probe(colours, tmp_path):
    """With finetune.head_init=probe the head is the linear probe fitted on the run's own training
    labels (dev split excluded): a fine-tune that does not move (its one step inside the warmup, at
    lr 0) scores the probe's accuracy
    on the dev split, where a zero head scores chance; the probe's L2 and its top-1 on the dev split,
    where it was chosen, and the start's score are recorded, and kept when the run resumes from its checkpoint."""
    from mpp.train import train
    items = [f"output_dir={tmp_path / 'zero'}", "objective=classify", "model=vit_micro4_32", "batch_size=16",
             "steps=1", "optim.warmup_steps=1", "optim.name=sgd", "optim.weight_decay=0", "finetune.pool=avg",
             f"data.train={colours / 'train/manifest.json'}", f"data.val={colours / 'val/manifest.json'}",
             "data.num_workers=0", "train.attn=math", "finetune.dev_fraction=0.2", "data.eval_crop_pct=1.0"]
    zero = train(load_config(None, items))
    probe = train(load_config(None, items + [f"output_dir={tmp_path / 'probe'}", "finetune.head_init=probe"]))
    assert zero["head_init"] == "zero" and "head_probe_l2" not in zero
    assert zero["top1"] == pytest.approx(1 / 3, abs=0.01)  # every logit 0: one class for all
    assert probe["evaluated_on"] == "dev" and probe["head_init"] == "probe"
    assert probe["top1"] > 0.6 and probe["head_probe_dev_top1"] == pytest.approx(probe["top1"], abs=0.05), probe
    assert probe["head_probe_l2"] > 0
    assert probe["start_top1"] == probe["top1"] and "start_top1" not in zero  # scored before the step too
    assert probe["begin_s"] > 0.05 > zero["begin_s"] >= 0  # the fit and the start's score: begin's, not set-up's
    assert list(tmp_path.glob("feature_cache/features-*.safetensors"))  # the sweep's other runs reuse them
    (cached,) = tmp_path.glob("feature_cache/head-*.safetensors")
    from safetensors.torch import load_file
    head, model = load_file(str(cached)), load_file(str(tmp_path / "probe/checkpoints/step_0000001/model.safetensors"))
    for k in ("weight", "bias"):  # the head is the probe's, bias too (its one step at lr 0 moved nothing)
        assert torch.equal(model[f"head.{k}"], head[k].to(model[f"head.{k}"].dtype)) and head[k].abs().sum() > 0, k
    (tmp_path / "probe" / "metrics.json").unlink()  # as stopped at step 1: a finished run is refused more steps
    longer = train(load_config(None, items + [f"output_dir={tmp_path / 'probe'}", "finetune.head_init=probe",
                                              "steps=2", "optim.warmup_steps=2"]))  # resumes at step 1
    assert {k: longer[k] for k in ("start_top1", "head_probe_l2", "head_probe_dev_top1")} == \
        {k: probe[k] for k in ("start_top1", "head_probe_l2", "head_probe_dev_top1")}
    assert longer["begin_s"] == 0  # a resumed segment begins nothing
    given = train(load_config(None, items + [f"output_dir={tmp_path / 'given'}", "finetune.head_init=probe",
                                             "finetune.head_l2=100"]))  # a final's: its sweep stage chose it
    assert given["head_probe_l2"] == 100 != probe["head_probe_l2"]
    assert given["head_probe_dev_loss"] > probe["head_probe_dev_loss"] + 0.1  # a head near zero: near uniform
    test = train(load_config(None, items[:-2] + [f"output_dir={tmp_path / 'test'}", "finetune.head_init=probe",
                                                 "data.eval_crop_pct=1.0"]))
    assert test["evaluated_on"] == "val" and test["start_outcomes"] == test["outcomes"]  # image by image, unmoved


def test_a_subset_of_shards_without_a_label_index_reads_the_labels_the_stream_reads(tmp_path):
    """Without labels.json the subset reads each shard's `cls` members itself. It took only names
    ending in '.cls': samples labelled 'X.CLS' (the stream lower-cases a field) were in no subset,
    unsaid, and a member named '.cls' at the top (no key: the stream ignores it) was a TypeError."""
    import io
    import json
    import tarfile

    from mpp.data.sources import read_shard

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        add(tar, ".cls", b"0")
        for i in range(8):
            add(tar, f"k{i}.png", b"png bytes")  # never decoded here
            add(tar, f"k{i}.{'CLS' if i % 2 else 'cls'}", str(i // 4).encode())
    streamed = {s["__key__"] for s in read_shard(str(tmp_path / "s.tar"), {}) if "cls" in s}
    assert streamed == {f"k{i}" for i in range(8)}
    manifest = {"num_samples": 8, "classes": ["a", "b"],  # no label index
                "shards": [{"name": "s.tar", "num_samples": 8, "bytes": (tmp_path / "s.tar").stat().st_size}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    shards = resolve(str(tmp_path / "manifest.json"), 0)
    whole, = select_subset(shards, 1.0, seed=0).keys
    dev, = select_subset(shards, 1.0, seed=0, dev_fraction=0.5, dev=True).keys
    assert set(whole) == streamed and len(dev) == 4 and {int(k[1:]) // 4 for k in dev} == {0, 1}  # 2 of each class


def _indexed(tmp_path: Path, index: list) -> ShardSet:
    """Shards of two classes known only through a hand-written label index (the shards are never read)."""
    (tmp_path / "labels.json").write_text(json.dumps(index))
    return ShardSet([str(tmp_path / f"{s:06d}.tar") for s in range(len(index))], [len(e) for e in index],
                    ["a", "b"], labels=str(tmp_path / "labels.json"))


def test_withholding_takes_out_the_development_split_and_refuses_a_split_of_dev_fraction_0(tmp_path):
    """A pre-training withholds exactly the fine-tunes' development split; dev_fraction 0 draws none,
    so the split would be the whole label subset, and withholding it silently lost half the data."""
    shards = _indexed(tmp_path, [[[f"k{i}", i % 2] for i in range(20)]])
    dev, = select_subset(shards, 0.5, seed=0, dev_fraction=0.2, dev=True).keys
    left, = withhold_splits(shards, [(0.5, 0, 0.2)]).keys
    assert len(dev) == 2 and left == {f"k{i}" for i in range(20)} - dev
    with pytest.raises(DataError, match=r"withheld development split needs dev_fraction in \(0, 1\), got 0"):
        withhold_splits(shards, [(0.5, 0, 0.0)])


def test_a_label_index_that_lists_a_key_twice_in_a_shard_is_refused(tmp_path):
    """A subset keeps samples by key, so a key listed twice (a hand-written index, or a manifest
    without its digest) could go to the development split and the training part alike: refused
    by name, as read_labels refuses such a shard."""
    index = [[["k0", 0], ["k1", 1]], [["k0", 0], ["k1", 0], ["k2", 1], ["k3", 1], ["k0", 1]]]
    with pytest.raises(DataError, match=r"lists key 'k0' twice in shard 000001.tar.*development split"):
        select_subset(_indexed(tmp_path, index), 1.0, seed=0, dev_fraction=0.5, dev=True)
    index[1][-1] = ["k4", 1]  # the same key in two shards is two samples
    assert select_subset(_indexed(tmp_path, index), 1.0, seed=0).num_samples == 7


def _lrs(optim: dict, total_steps: int, model: torch.nn.Module | None = None) -> list[float]:
    """The learning rate of each step 0..total_steps (the last: the step after the run) of a plain
    model under `optim`, as the trainer steps the scheduler."""
    from mpp.config import build_config
    from mpp.optim import create_optimizer, create_scheduler
    model = model or torch.nn.Linear(4, 4)
    opt = create_optimizer(build_config({"model": "vit_micro4_32", "optim": optim}), model)
    sched = create_scheduler(build_config({"model": "vit_micro4_32", "optim": optim}), opt, total_steps)
    lrs = []
    for step in range(total_steps + 1):
        sched.step_update(step)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_the_linear_schedule_falls_in_a_straight_line_from_the_peak_to_min_lr():
    """optim.schedule=linear: after the warmup the rate falls by equal steps to optim.min_lr, which
    the step after the run reaches; not a curve (a power above 1) nor towards 0."""
    lrs = _lrs({"schedule": "linear", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2}, total_steps=12)
    assert lrs[:3] == pytest.approx([0.0, 5e-4, 1e-3])
    assert lrs[2:] == pytest.approx([1e-3 - 9e-4 * t / 10 for t in range(11)])


def test_the_warmup_note_names_the_peak_the_runs_last_step_reaches():
    """A warmup longer than the run: the note's peak is the rate of its last step (step n - 1),
    which the scheduler really gives, not one step further up the ramp."""
    from mpp.config import build_config
    from mpp.optim import warmup_note
    optim = {"lr": 1e-3, "warmup_steps": 10}
    lrs = _lrs(optim, total_steps=5)
    assert f"rises to {lrs[4]:.3g}," in warmup_note(build_config({"model": "vit_micro4_32", "optim": optim}), 5)
    assert lrs[4] == pytest.approx(4e-4)


def test_adam_is_adams_coupled_weight_decay_and_adamw_the_decoupled_one():
    """optim.name=adam builds torch's Adam (weight decay added to the gradient), adamw builds AdamW
    (decay applied to the weights apart from the adaptive step): two recipes, not one name for both;
    each takes optim.beta1 and optim.beta2."""
    from mpp.config import build_config
    from mpp.optim import create_optimizer
    for name, kind, decoupled in (("adam", torch.optim.Adam, False), ("adamw", torch.optim.AdamW, True)):
        cfg = build_config({"model": "vit_micro4_32", "optim": {"name": name, "beta1": 0.8, "beta2": 0.95}})
        opt = create_optimizer(cfg, torch.nn.Linear(4, 4))
        assert type(opt) is kind and {g["betas"] for g in opt.param_groups} == {(0.8, 0.95)}, name
        assert {g.get("decoupled_weight_decay", decoupled) for g in opt.param_groups} == {decoupled}, name


def test_the_constant_schedule_holds_optim_lr_after_the_warmup_to_the_end():
    """optim.schedule=constant: the warmup ramp, then optim.lr at every step of the run and the one
    after it; no step decay anywhere in between."""
    lrs = _lrs({"schedule": "constant", "lr": 1e-3, "warmup_steps": 2}, total_steps=12)
    assert lrs == pytest.approx([0.0, 5e-4] + [1e-3] * 11)
