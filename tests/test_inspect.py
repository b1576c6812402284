"""mpp.figures and tools/inspect_encoders.py: hooked attention agrees with a direct computation and leaves
the forward pass as it was, attention distance / position similarity / filter components against
hand-computed cases, the MPP head's round trip through a run dir, the prediction grid, the tool end
to end on tiny shards (several encoders side by side), and the TensorBoard grid during training."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpp.cli import UsageError
from mpp.config import load_config, save_config
from mpp.data.synthetic import make_synthetic
from mpp.figures.attention import attention_distance_sum, patch_distances, record_attention
from mpp.figures.filters import filter_components
from mpp.figures.posembed import position_similarity
from mpp.figures.predictions import HEAD_FILE, KEPT_RGB, load_mpp_task, predict, prediction_grid, save_mpp_head
from mpp.models import create_encoder, save_encoder
from mpp.objectives import MPPTask
from mpp.targets import class_colors, quantize
from toolrun import run_tool

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the tool imports this checkout's mpp


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    make_synthetic(out, train=16, test=16, shards=2, progress=False)
    return out / "test" / "manifest.json"


def saved_mpp_run(out: Path, seed: int = 0, target: str = "mean_color") -> MPPTask:
    """A run dir as an MPP pre-training leaves it (config, encoder, head), without training."""
    torch.manual_seed(seed)
    cfg = load_config(ROOT / "configs/synthetic_mpp.yaml",
                      ["model=vit_micro4_32", f"output_dir={out}", f"mpp.target={target}"])
    task = MPPTask(create_encoder("vit_micro4_32", attn="math"), cfg.mpp, cfg.data)
    torch.nn.init.normal_(task.head.weight)  # a head whose argmax varies with the input
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    save_encoder(task.encoder, out)
    save_mpp_head(task, out)
    return task


def test_hooked_attention_matches_direct_computation_and_leaves_the_forward_unchanged():
    torch.manual_seed(0)
    enc = create_encoder("vit_micro4_32", attn="fused").eval()
    vit = enc.vit
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        plain = enc(x)
        with record_attention(vit) as maps:
            hooked = enc(x)
        # direct: softmax(q k^T / sqrt(d)) from the block's own weights, block by block
        t = vit.norm_pre(vit._pos_embed(vit.patch_embed(x)))
        direct = []
        for block in vit.blocks:
            a = block.attn
            qkv = block.norm1(t) @ a.qkv.weight.T + a.qkv.bias
            B, T, _ = qkv.shape
            q, k = qkv[..., :a.attn_dim], qkv[..., a.attn_dim:2 * a.attn_dim]
            q = q.view(B, T, a.num_heads, -1).transpose(1, 2)
            k = k.view(B, T, a.num_heads, -1).transpose(1, 2)
            direct.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1))
            t = block(t)
    assert torch.equal(plain, hooked)
    assert len(maps) == len(direct) == 2 and maps[0].shape == (3, 2, 65, 65)
    for m, d in zip(maps, direct):
        torch.testing.assert_close(m, d, atol=1e-5, rtol=1e-4)
    with torch.no_grad(), record_attention(vit, reduce=lambda a: a.sum((0, 2, 3))) as reduced:
        enc(x)  # reduced as each layer's weights come: one (heads,) per layer held, not the maps
    assert [r.shape for r in reduced] == [(2,)] * 2
    for r, m in zip(reduced, maps):
        torch.testing.assert_close(r, m.sum((0, 2, 3)))
    with torch.no_grad():
        enc(x)
    assert len(maps) == 2  # hooks removed on exit


def test_attention_distance_by_hand():
    dist = patch_distances((2, 2), 4)
    assert dist[0].tolist() == pytest.approx([0, 4, 4, 4 * math.sqrt(2)])
    # every query: half its weight on the [class] token (left out, renormalised), half on patch 0
    a = torch.zeros(1, 2, 5, 5)
    a[:, 0, :, 0] = a[:, 0, :, 1] = 0.5
    a[:, 1, :, 4] = 1.0  # head 1: everything on patch 3
    sums = torch.stack([attention_distance_sum(m, dist, num_prefix=1) for m in (a, a)])
    assert sums.shape == (2, 2)
    assert sums[0, 0].item() == pytest.approx(8 + 4 * math.sqrt(2))
    assert sums[1, 1].item() == pytest.approx(8 + 4 * math.sqrt(2))
    a[:, 0, 2] = 0  # query 1 of head 0: every bit of its weight on the [class] token (an underflow)
    a[:, 0, 2, 0] = 1.0
    sums = attention_distance_sum(a, dist, num_prefix=1)[None]
    assert sums[0, 0].item() == pytest.approx(8 + 4 * math.sqrt(2) - 4)  # that query counts 0, not NaN


def test_position_similarity_and_filter_components():
    torch.manual_seed(0)
    vit = create_encoder("vit_micro4_32").vit
    with torch.no_grad():
        vit.pos_embed[0, 1:] = torch.randn(64, 64)
        vit.pos_embed[0, 2] = -3 * vit.pos_embed[0, 1]  # position 1 opposite to position 0
    sim = position_similarity(vit)
    assert sim.shape == (64, 64)
    torch.testing.assert_close(sim.diagonal(), torch.ones(64))
    assert sim[0, 1].item() == pytest.approx(-1.0, abs=1e-5)
    # filters spread along one RGB pattern: the first component is that pattern, all the variance
    pattern = torch.randn(3, 4, 4)
    with torch.no_grad():
        vit.patch_embed.proj.weight.copy_(torch.randn(64, 1, 1, 1) * pattern)
    comps, share = filter_components(vit, k=5)
    assert comps.shape == (5, 3, 4, 4) and share[0].item() == pytest.approx(1.0, abs=1e-5)
    assert abs(torch.nn.functional.cosine_similarity(comps[0].flatten(), pattern.flatten(), 0).item()) > 0.9999
    # trained on inputs normalised by a per-channel std: the filters on raw RGB are the weights / std
    std = (0.25, 0.5, 1.0)
    comps, share = filter_components(vit, std, k=5)
    raw = pattern / torch.tensor(std).view(3, 1, 1)
    assert abs(torch.nn.functional.cosine_similarity(comps[0].flatten(), raw.flatten(), 0).item()) > 0.9999


def test_class_colors_are_inside_their_class():
    classes = torch.arange(512)
    assert torch.equal(quantize(class_colors(classes, 3), 3), classes)


def test_mpp_head_round_trip_and_prediction_grid(tmp_path):
    task = saved_mpp_run(tmp_path / "run")
    assert (tmp_path / "run" / HEAD_FILE).is_file()
    loaded = load_mpp_task(tmp_path / "run")
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    a, b = predict(task, images, seed=3), predict(loaded, images, seed=3)
    assert torch.equal(a.predicted, b.predicted)  # head and [mask] embedding survived the trip
    n_chosen = a.chosen.sum(1)
    assert (n_chosen == 32).all() and (a.masked <= a.chosen).all() and (a.swapped <= a.chosen).all()
    assert a.masked.any() and a.swapped.any()
    grey = a.corrupted.view(4, 3, 8, 4, 8, 4).permute(0, 2, 4, 1, 3, 5).reshape(4, 64, -1)
    assert (grey[a.masked] == 0.5).all()
    assert (a.predicted[~a.chosen] == 0).all() and (a.predicted[a.chosen] > 0).all()
    grid = prediction_grid(a, 4, 3, min_size=96)
    assert grid.dtype == torch.uint8 and grid.shape == (4 * (96 + 2), 4 * (96 + 2), 3)
    # per patch (cells of 12 px, panels 98 px apart): the chosen patches kept as they are outlined in cyan
    # (they were unmarked, though predicted), both colour panels at the centre of their colour class (the
    # true one painted the exact mean: a patch predicted in its true class looked off)
    kept = a.chosen & ~a.masked & ~a.swapped
    assert kept.any()
    rgb = lambda c: (c * 255).round().to(torch.uint8)  # noqa: E731
    for b, n in a.chosen.nonzero().tolist():
        y, x = b * 98 + n // 8 * 12, n % 8 * 12
        assert torch.equal(grid[y, 98 + x], rgb(torch.tensor(KEPT_RGB))) == kept[b, n].item(), (b, n)
        for side in (x, x + 11):  # the outline's left and right edges too, mid-cell
            assert torch.equal(grid[y + 6, 98 + side], rgb(torch.tensor(KEPT_RGB))) == kept[b, n].item(), (b, n, side)
        for panel, colour in ((2, a.predicted[b, n]), (3, a.true[b, n])):
            assert torch.equal(grid[y + 6, panel * 98 + x + 6], rgb(class_colors(quantize(colour, 3), 3))), (b, n)
    b, n = a.chosen.nonzero()[0].tolist()  # predicted in its true class, as the mean_color head paints it
    a.predicted[b, n] = class_colors(quantize(a.true[b, n], 3), 3)
    y, x = b * 98 + n // 8 * 12 + 6, n % 8 * 12 + 6
    assert torch.equal(prediction_grid(a, 4, 3)[y, 2 * 98 + x], grid[y, 3 * 98 + x])  # looks right
    assert load_mpp_task(tmp_path / "nothing") is None


def test_tool_side_by_side(data, tmp_path):
    saved_mpp_run(tmp_path / "mpp")
    saved_mpp_run(tmp_path / "hog", target="hog")  # predicts no colours: no prediction figure for it
    out = tmp_path / "figures"
    r = subprocess.run([sys.executable, str(ROOT / "tools/inspect_encoders.py"), "--encoder", str(tmp_path / "mpp"),
                        "--encoder", "rand=none:vit_micro4_32", "--encoder", str(tmp_path / "hog"),
                        "--data", str(data), "--out", str(out),
                        "--images", "10", "--grid-images", "3", "--batch-size", "4"],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    for png in ("attention_distance.png", "position_similarity.png", "filters.png", "predictions_mpp.png"):
        assert (out / png).stat().st_size > 1000
    numbers = json.loads((out / "inspect.json").read_text())
    assert list(numbers["encoders"]) == ["mpp", "rand", "hog"]
    assert not (out / "predictions_hog.png").exists() and "mpp_chosen_color_accuracy" not in numbers["encoders"]["hog"]
    mpp, rand = numbers["encoders"]["mpp"], numbers["encoders"]["rand"]
    assert len(mpp["mean_attention_distance_px"]) == 2 and len(mpp["mean_attention_distance_px"][0]) == 2
    assert 0 <= mpp["mpp_chosen_color_accuracy"] <= 1 and "mpp_chosen_color_accuracy" not in rand
    assert all(0 < d < 32 * math.sqrt(2) for row in rand["mean_attention_distance_px"] for d in row)


@pytest.fixture
def drawn(monkeypatch) -> dict[str, str]:
    """The text of each figure drawn (titles, labels, legend), by file name."""
    from matplotlib.text import Text

    from mpp.figures import plots
    texts, save = {}, plots.save_figure

    def record(fig, path, **kw):
        texts[Path(path).name] = "\n".join(t.get_text() for t in fig.findobj(Text))
        save(fig, path, **kw)
    monkeypatch.setattr(plots, "save_figure", record)
    return texts


def test_the_figures_say_what_they_show(data, tmp_path, drawn):
    """The prediction grid's accuracy is over --images, not the rows shown: its title says so. Encoders
    at different resolutions share the attention distance's axis in their own pixels: the legend gives
    each one's resolution."""
    from mpp.figures.inspection import inspect_encoders
    saved_mpp_run(tmp_path / "mpp")
    inspect_encoders([f"m={tmp_path / 'mpp'}", "r=none:vit_micro4_32@48"], data, tmp_path / "o", images=10,
                     grid_images=3, batch_size=4)
    assert "m (patch 4 px of 32 px images)" in drawn["attention_distance.png"]
    assert "r (patch 4 px of 48 px images)" in drawn["attention_distance.png"]
    assert "each encoder's own images" in drawn["attention_distance.png"]
    assert "on its own; a component's sign is arbitrary" in drawn["filters.png"]
    assert "first 3 of 10 images" in drawn["predictions_m.png"]
    assert "of the chosen patches of all 10 fall in the true colour class" in drawn["predictions_m.png"]
    inspect_encoders([f"m={tmp_path / 'mpp'}"], data, tmp_path / "few", images=2, grid_images=3, batch_size=4)
    assert "first 3 images" in drawn["predictions_m.png"]  # more rows than the accuracy counts: it says so
    assert "of the chosen patches of the first 2 of them fall in the true colour class" in drawn["predictions_m.png"]


def test_tool_reads_a_brace_pattern_with_its_count_and_keeps_labels_apart(data, tmp_path):
    """A brace pattern (no manifest) is read with --num-samples; two labels that clean up to the same
    file name get two prediction figures; --grid-images 0 draws none."""
    saved_mpp_run(tmp_path / "r1")
    saved_mpp_run(tmp_path / "r2", seed=1)
    shards = str(data.parent / "{000000..000001}.tar")
    tool = ["--encoder", f"mpp a={tmp_path / 'r1'}", "--encoder", f"mpp_a={tmp_path / 'r2'}", "--data", shards,
            "--images", "4", "--batch-size", "4"]
    r = run_tool("inspect_encoders", *tool, "--num-samples", "16", "--grid-images", "4", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr[-2000:]
    numbers = json.loads((tmp_path / "o" / "inspect.json").read_text())["encoders"]
    files = [numbers[n]["predictions_png"] for n in ("mpp a", "mpp_a")]
    assert files == ["predictions_mpp_a.png", "predictions_mpp_a_2.png"]
    assert all((tmp_path / "o" / f).stat().st_size > 1000 for f in files)
    r = run_tool("inspect_encoders", *tool, "--num-samples", "16", "--grid-images", "0", "--out", tmp_path / "g")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list((tmp_path / "g").glob("predictions_*.png")) and (tmp_path / "g" / "filters.png").is_file()
    kept = json.loads((tmp_path / "g" / "inspect.json").read_text())["encoders"]  # no grid, the accuracy still
    assert kept["mpp a"]["mpp_chosen_color_accuracy"] == numbers["mpp a"]["mpp_chosen_color_accuracy"]
    r = run_tool("inspect_encoders", *tool, "--out", tmp_path / "n")
    assert r.returncode == 2 and "not a manifest.json: give its total sample count with --num-samples N" in r.stderr
    assert not (tmp_path / "n").exists()


def test_compare_figures_read_data_val_with_its_count(data, tmp_path):
    """A comparison whose data.val is a brace pattern draws its figures with data.val_num_samples (it
    failed at the comparison's last step)."""
    from mpp.figures.inspection import write_compare_figures
    shards = str(data.parent / "{000000..000001}.tar")
    saved_mpp_run(tmp_path / "pretrain_mpp")
    cfg = load_config(tmp_path / "pretrain_mpp" / "config.yaml", [f"data.val='{shards}'", "data.val_num_samples=16"])
    save_config(cfg, tmp_path / "pretrain_mpp" / "config.yaml")
    numbers = write_compare_figures([tmp_path / "pretrain_mpp"], out=tmp_path / "figures", images=4, grid_images=2)
    assert numbers["data"] == shards and list(numbers["encoders"]) == ["pretrain_mpp", "random init"]


def test_tool_rejects_a_missing_encoder(data, tmp_path):
    """A missing path, an unknown preset after none: (it was create_encoder's exit 1, not naming --encoder)
    and a label with nothing after it (read as the current directory) are usage errors naming --encoder."""
    for spec, says in [(str(tmp_path / "nope"), "no such file"), ("none:vit_nope", "unknown model preset 'vit_nope'"),
                       ("none:", "unknown model preset ''"), ("mpp=", "'mpp=' names no encoder")]:
        r = run_tool("inspect_encoders", "--encoder", spec, "--data", data, "--out", tmp_path / "o", cwd=tmp_path)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("error: --encoder") and says in last, (spec, r.stderr[-500:])
    assert not (tmp_path / "o").exists()


def test_training_logs_the_prediction_grid_and_saves_the_head(data, tmp_path, capsys):
    """The grid of train.image_every shows the same input images at every logging step (the
    segment's first batch), so its predictions can be followed as the run trains."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mpp.train import train
    cfg = load_config(ROOT / "configs/synthetic_mpp.yaml", [
        f"output_dir={tmp_path}", "model=vit_micro4_32", "steps=2", "batch_size=8", "train.log_every=1",
        "train.image_every=1", "train.attn=math", "train.precision='no'", "data.num_workers=0", "train.profile=[5,1]",
        f"data.train={data}", "data.shuffle_buffer=0"])
    train(cfg)
    # the shipped config's 30 warmup steps in a 2-step run: said, as a compare stage's would be
    err = capsys.readouterr().err
    assert "warning: optim.warmup_steps=30 is not below the run's 2 steps" in err
    assert "warning: train.profile=[5, 1] (steps 6..6) past the run's 2 steps" in err  # its images: reached
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.step for e in events.Images("mpp/predictions")] == [1, 2]
    grids = [np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in events.Images("mpp/predictions")]
    inputs = [g[:, :96] for g in grids]  # the first panel: the 32-pixel inputs upscaled to 96
    assert grids[0].shape == grids[1].shape == (8 * 98, 4 * 98, 3) and inputs[0].std() > 0
    assert np.array_equal(*inputs), "the grid's input images changed between steps 1 and 2"
    assert load_mpp_task(tmp_path) is not None and (tmp_path / HEAD_FILE).is_file()


def test_compare_figures_add_a_random_init(data, tmp_path):
    from mpp.figures.inspection import write_compare_figures
    saved_mpp_run(tmp_path / "pretrain_mpp")
    sup = tmp_path / "pretrain_supervised"
    sup.mkdir()
    save_config(load_config(ROOT / "configs/synthetic_supervised.yaml", ["model=vit_micro4_32"]), sup / "config.yaml")
    save_encoder(create_encoder("vit_micro4_32"), sup)
    numbers = write_compare_figures([tmp_path / "pretrain_mpp", sup], data, tmp_path / "figures", images=4,
                                    grid_images=2)
    assert list(numbers["encoders"]) == ["pretrain_mpp", "pretrain_supervised", "random init"]
    assert sorted(p.name for p in (tmp_path / "figures").glob("*.png")) == [
        "attention_distance.png", "filters.png", "position_similarity.png", "predictions_pretrain_mpp.png"]
    (tmp_path / "figures/filters.png").unlink()
    assert write_compare_figures([tmp_path / "pretrain_mpp", sup], data, tmp_path / "figures") == numbers
    assert not (tmp_path / "figures/filters.png").exists()  # up to date: a resumed comparison redraws nothing
    kept = json.loads((tmp_path / "figures/inspect.json").read_text())
    (tmp_path / "figures/inspect.json").write_text(json.dumps({k: v for k, v in kept.items() if k != "filters"}))
    write_compare_figures([tmp_path / "pretrain_mpp", sup], data, tmp_path / "figures", images=4, grid_images=2)
    assert (tmp_path / "figures/filters.png").exists()  # drawn before filters were shown on raw RGB: drawn again
    for damaged in ('{"specs": [', "[]"):  # a record that is not one: drawn again, no traceback
        (tmp_path / "figures/filters.png").unlink()
        (tmp_path / "figures/inspect.json").write_text(damaged)
        assert write_compare_figures([tmp_path / "pretrain_mpp", sup], data, tmp_path / "figures", images=4,
                                     grid_images=2)["encoders"].keys() == numbers["encoders"].keys()
        assert (tmp_path / "figures/filters.png").exists()
    (tmp_path / "figures/filters.png").unlink()
    save_encoder(create_encoder("vit_micro4_32"), sup)  # a newer encoder: drawn again
    write_compare_figures([tmp_path / "pretrain_mpp", sup], data, tmp_path / "figures", images=4, grid_images=2)
    assert (tmp_path / "figures/filters.png").exists()
    (tmp_path / "figures/filters.png").unlink()  # up to date, but for another list of encoders: drawn again
    numbers = write_compare_figures([sup], data, tmp_path / "figures", images=4, grid_images=2)
    assert list(numbers["encoders"]) == ["pretrain_supervised", "random init"]
    assert (tmp_path / "figures/filters.png").exists()


def test_the_compare_figures_random_init_has_the_runs_resolution_and_normalisation(data, tmp_path, monkeypatch,
                                                                                   capsys):
    """A comparison at another img_size than its preset's draws its random init at that size (it was
    drawn at the preset's, on the same axes), reading the images normalised as the runs do; the
    figures record how many images they averaged when the data holds fewer than asked."""
    import mpp.figures.inspection as inspection
    run = tmp_path / "pretrain_supervised"
    run.mkdir()
    save_config(load_config(ROOT / "configs/synthetic_supervised.yaml",
                            ["model=vit_micro4_32", "img_size=48", "data.mean=[0.1,0.2,0.3]"]), run / "config.yaml")
    save_encoder(create_encoder("vit_micro4_32", 48), run)
    fed, real = {}, inspection.mean_attention_distance

    def seen(encoder, images, data_cfg, *a, desc, **k):  # what each encoder was fed: normalisation, grid
        fed[desc] = (data_cfg.mean, encoder.grid_size)
        return real(encoder, images, data_cfg, *a, desc=desc, **k)
    monkeypatch.setattr(inspection, "mean_attention_distance", seen)
    numbers = inspection.write_compare_figures([run], data, tmp_path / "figures", images=100, grid_images=0)
    assert numbers["specs"][-1] == "random init=none:vit_micro4_32@48"
    assert fed["random init"] == fed["pretrain_supervised"] == ((0.1, 0.2, 0.3), (12, 12))
    assert numbers["images"] == 16 and "holds 16 images, fewer than the 100 asked for" in capsys.readouterr().err
    for size in ("big", "\u00b2"):  # a superscript two is a digit to str.isdigit, and no int
        with pytest.raises(UsageError, match="none:PRESET@IMG_SIZE"):
            inspection.load_inspected(f"none:vit_micro4_32@{size}")
    with pytest.raises(UsageError, match="patch size 4 does not divide 30"):
        inspection.load_inspected("none:vit_micro4_32@30")


def test_an_exported_encoder_alone_is_inspected_with_the_normalisation_it_recorded(tmp_path):
    """Without a run's config.yaml beside it, the figures feed an encoder the inputs its model.json
    says it trained on (they fell back to the default normalisation); an older export without one
    still gets the default."""
    from mpp.config import DataConfig
    from mpp.figures.inspection import load_inspected
    imagenet = DataConfig(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    save_encoder(create_encoder("vit_micro4_32"), tmp_path / "export", data=imagenet)
    seen = load_inspected(f"x={tmp_path / 'export' / 'encoder.safetensors'}").data
    assert (tuple(seen.mean), tuple(seen.std)) == (imagenet.mean, imagenet.std)
    save_encoder(create_encoder("vit_micro4_32"), tmp_path / "old")
    assert load_inspected(str(tmp_path / "old")).data == DataConfig()
    save_encoder(create_encoder("vit_micro4_32"), tmp_path / "lr=0.1" / "run", data=imagenet)  # a comparison's
    seen = load_inspected(str(tmp_path / "lr=0.1" / "run"))  # output_dir=runs/lr=0.1: a path, not LABEL=PATH
    assert seen.name == "run" and tuple(seen.data.mean) == imagenet.mean
    assert load_inspected(f"mine={tmp_path / 'lr=0.1' / 'run'}").name == "mine"


def test_image_every_is_checked_before_any_work():
    from mpp.config import ConfigError
    with pytest.raises(ConfigError, match="train.image_every"):
        load_config(None, ["objective=supervised", "train.image_every=5"])
    with pytest.raises(ConfigError, match="train.image_every"):
        load_config(None, ["train.image_every=-1"])
    with pytest.raises(ConfigError, match="train.image_every paints predicted colours, which mpp.target=hog"):
        load_config(None, ["mpp.target=hog", "train.image_every=5"])
    cfg = load_config(None, ["mpp.target=hog"])
    with pytest.raises(ValueError, match="no prediction figure"):
        predict(MPPTask(create_encoder("vit_micro4_32"), cfg.mpp, cfg.data), torch.zeros(1, 3, 32, 32, dtype=torch.uint8))


def test_runs_without_a_head_file_read_the_newest_checkpoint(tmp_path):
    from safetensors.torch import save_model
    task = saved_mpp_run(tmp_path)
    (tmp_path / HEAD_FILE).unlink()
    (tmp_path / "checkpoints/step_0000002").mkdir(parents=True)
    save_model(task, str(tmp_path / "checkpoints/step_0000002/model.safetensors"))
    older = saved_mpp_run(tmp_path / "older", seed=1)  # an older checkpoint with another head: not the one read
    (tmp_path / "checkpoints/step_0000001").mkdir(parents=True)
    save_model(older, str(tmp_path / "checkpoints/step_0000001/model.safetensors"))
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    assert not torch.equal(predict(task, images).predicted, predict(older, images).predicted)
    assert torch.equal(predict(task, images).predicted, predict(load_mpp_task(tmp_path), images).predicted)


def test_an_mpp_run_without_head_or_checkpoint_says_it_gets_no_prediction_figure(tmp_path, capsys):
    """It got none without a word; a hog run (no figure anyway) and a run with its head say nothing."""
    from mpp.figures.inspection import load_inspected
    for target in ("mean_color", "hog"):
        saved_mpp_run(tmp_path / target, target=target)
        (tmp_path / target / HEAD_FILE).unlink()
    assert load_inspected(f"m={tmp_path / 'mean_color'}").task is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: m: an MPP run with neither {HEAD_FILE} nor a checkpoint")
    assert load_inspected(str(tmp_path / "hog")).task is None
    saved_mpp_run(tmp_path / "whole")
    assert load_inspected(str(tmp_path / "whole")).task is not None and not capsys.readouterr().err


def test_a_drawing_again_leaves_no_earlier_grid_and_the_accuracy_is_of_the_images_asked_for(data, tmp_path):
    """A grid an earlier drawing left (another target, --grid-images 0 now) was kept and linked by the
    report as this drawing's; the colour accuracy covered the grid's images too, not --images alone,
    and the grid's corruption changed with --images (one draw over all images read)."""
    from mpp.figures.inspection import _first, _predict, inspect_encoders
    from mpp.report.render import figures_section
    saved_mpp_run(tmp_path / "mpp")
    out = tmp_path / "cmp/figures"
    run = lambda **kw: inspect_encoders([str(tmp_path / "mpp")], data, out, batch_size=2, **kw)  # noqa: E731
    wide = run(images=2, grid_images=6)["encoders"]["mpp"]
    assert "figures/predictions_mpp.png" in figures_section(tmp_path / "cmp")
    narrow = run(images=2, grid_images=2)["encoders"]["mpp"]
    assert narrow["mpp_chosen_color_accuracy"] == wide["mpp_chosen_color_accuracy"]
    assert run(images=6, grid_images=6)["encoders"]["mpp"]["mpp_chosen_color_accuracy"] != \
        wide["mpp_chosen_color_accuracy"]
    task, images = load_mpp_task(tmp_path / "mpp"), torch.randint(0, 256, (7, 3, 32, 32), dtype=torch.uint8)
    few, many = _predict(task, images[:3], 32, 0), _predict(task, images, 2, 0)  # image by image, seeded each
    assert all(torch.equal(a, b) for a, b in zip(vars(few).values(), vars(_first(many, 3)).values()))
    (out / "predictions_stray.png").write_bytes((out / "predictions_mpp.png").read_bytes())  # not of this drawing: not linked
    assert "predictions_stray" not in figures_section(tmp_path / "cmp")
    run(images=2, grid_images=0)
    assert not list(out.glob("predictions_*.png")) and "predictions" not in figures_section(tmp_path / "cmp")


def test_a_drawing_that_fails_leaves_no_record_of_the_one_before(data, tmp_path, monkeypatch):
    """A drawing that stopped after its first figures left the earlier drawing's inspect.json beside
    them: the report linked the new PNGs as the old record's, and a comparison took them as done."""
    from mpp.figures import inspection
    from mpp.report.render import figures_section
    saved_mpp_run(tmp_path / "mpp")
    out = tmp_path / "cmp/figures"
    inspection.inspect_encoders([str(tmp_path / "mpp")], data, out, images=2, grid_images=2, batch_size=2)
    assert "attention_distance.png" in figures_section(tmp_path / "cmp")
    def fail(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(inspection.plots, "filters", fail)
    with pytest.raises(OSError, match="disk full"):
        inspection.inspect_encoders([str(tmp_path / "mpp")], data, out, images=2, grid_images=2, batch_size=2)
    assert not (out / "inspect.json").exists() and figures_section(tmp_path / "cmp") == ""


def test_a_bad_mpp_head_or_encoder_file_is_refused_in_one_line(tmp_path):
    """A head file that is no safetensors, of other mpp settings, without the [mask] embedding or
    diverged ended in a traceback of safetensors or torch; so did a hand-made non-square encoder,
    and a missing path with '=' in it was named by its tail."""
    from safetensors.torch import load_file, save_file
    from mpp.config import ConfigError
    from mpp.figures.inspection import load_inspected
    from mpp.models import load_encoder
    saved_mpp_run(tmp_path / "run")
    head = tmp_path / "run" / HEAD_FILE
    good = {k: v.clone() for k, v in load_file(str(head)).items()}  # not mapped from the file rewritten below
    for name, state, why in (("garbage", None, "not a readable safetensors"),
                             ("other bits", {**good, "head.weight": torch.zeros(64, 64), "head.bias": torch.zeros(64)},
                              "not the MPP head of this run's mpp.target=mean_color, mpp.bits=3"),
                             ("no mask", {k: v for k, v in good.items() if k != "mask_token"}, "e.g. mask_token"),
                             ("NaN", {**good, "head.bias": torch.full_like(good["head.bias"], float("nan"))}, "NaN")):
        if state is None:
            head.write_bytes(b"\x80\x04junk")
        else:
            save_file(state, str(head))
        with pytest.raises(ConfigError, match=why):
            load_mpp_task(tmp_path / "run")
    spec = json.loads((tmp_path / "run/model.json").read_text())
    (tmp_path / "flat").mkdir()
    save_encoder(create_encoder("vit_micro4_32", 32, attn="math"), tmp_path / "flat")
    spec["kwargs"]["img_size"] = [32, 48]
    (tmp_path / "flat/model.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="a grid of 8x12 patches; mpp reads square images"):
        load_encoder(tmp_path / "flat")
    with pytest.raises(UsageError, match=r"--encoder runs/lr=0\.1/mpp: no such file"):
        load_inspected("runs/lr=0.1/mpp")


def test_a_report_over_a_damaged_figures_record_says_to_delete_it(tmp_path):
    from mpp.report import ReportError
    from mpp.report.render import figures_section
    (tmp_path / "figures").mkdir()
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "figures/inspect.json").write_text(text)
        with pytest.raises(ReportError, match="inspect.json is no record of the figures .*; delete it"):
            figures_section(tmp_path)


def test_the_chosen_colour_accuracy_counts_the_chosen_patches_alone():
    """inspect.json's mpp_chosen_color_accuracy is over the patches the head predicts: the others
    carry no prediction (zeros), which would count as misses and dilute it by the unchosen share."""
    from mpp.figures.predictions import Prediction
    true = torch.rand(2, 16, 3, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1
    chosen = torch.arange(16).repeat(2, 1) % 2 == 0
    predicted = torch.where(chosen[..., None], true, torch.zeros_like(true))
    pred = Prediction(torch.zeros(2, 3, 16, 16), torch.zeros(2, 3, 16, 16), chosen, ~chosen, chosen, predicted, true)
    assert pred.accuracy(3) == 1.0
    predicted[0, 0] = (true[0, 0] + 0.5) % 1  # one of the 16 chosen patches wrong, by half the range
    assert pred.accuracy(3) == 15 / 16


def _tiny_images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_mean_attention_distance_sums_every_batch():
    """Over 5 images in batches of 2 the distance is that of one batch of 5: every batch counts, not the last."""
    from mpp.config import DataConfig
    from mpp.figures.inspection import mean_attention_distance
    torch.manual_seed(0)
    enc, images = create_encoder("vit_micro4_32", attn="math"), _tiny_images(5)
    whole = mean_attention_distance(enc, images, DataConfig(), batch_size=5)
    torch.testing.assert_close(mean_attention_distance(enc, images, DataConfig(), batch_size=2), whole)


def test_mean_attention_distance_reads_the_images_normalised_as_the_run_did():
    """The encoder sees (x/255 - data.mean) / data.std, by hand through the hooks."""
    from mpp.config import DataConfig
    from mpp.data.transforms import normalize, to_float01
    from mpp.figures.inspection import mean_attention_distance
    torch.manual_seed(0)
    enc, images = create_encoder("vit_micro4_32", attn="math").eval(), _tiny_images(3)
    cfg = DataConfig(mean=(0.1, 0.2, 0.3), std=(0.05, 0.1, 0.2))
    dist = patch_distances(enc.grid_size, enc.patch_size)
    with torch.no_grad(), record_attention(enc.vit, lambda a: attention_distance_sum(a, dist, 1)) as sums:
        enc(normalize(to_float01(images), cfg.mean, cfg.std))
    by_hand = torch.stack(sums) / (3 * enc.num_patches)
    got = mean_attention_distance(enc, images, cfg, batch_size=2)
    torch.testing.assert_close(got, by_hand)
    other = mean_attention_distance(enc, images, DataConfig(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)))
    assert not torch.allclose(got, other)


def test_the_recorded_attention_distance_is_over_the_images_asked_for(data, tmp_path):
    """With more grid images than --images, the distance averages the first --images alone."""
    from mpp.figures.inspection import inspect_encoders, load_inspected, mean_attention_distance, read_images
    numbers = inspect_encoders(["none:vit_micro4_32"], data, tmp_path / "o", images=2, grid_images=3, batch_size=4)
    m = load_inspected("none:vit_micro4_32")  # the same seeded random init
    images = read_images(str(data), 32, 3, m.data)
    want = mean_attention_distance(m.encoder, images[:2], m.data, 4)
    assert not torch.allclose(want, mean_attention_distance(m.encoder, images, m.data, 4))
    got = numbers["encoders"]["random vit_micro4_32"]["mean_attention_distance_px"]
    torch.testing.assert_close(torch.tensor(got), want)


def test_the_corrupted_panel_shows_each_patch_as_the_encoder_saw_it(tmp_path):
    """A swapped patch shows the input patch it took (corruption.src); one neither masked nor swapped, its own."""
    from mpp.targets import patches
    task = saved_mpp_run(tmp_path / "run")
    images = _tiny_images(4)
    c = task.corrupt(4, images.device, torch.Generator().manual_seed(3))
    a = predict(task, images, corruption=c)
    own = torch.arange(64)
    swapped, plain = c.src != own, ~c.masked & (c.src == own)
    assert swapped.any() and plain.any() and torch.equal(a.swapped, swapped)
    shown, pix = patches(a.corrupted, 4), patches(a.images01, 4)  # (B, N, 3, p, p)
    for b, n in swapped.nonzero().tolist():
        assert torch.equal(shown[b, n], pix[b, c.src[b, n]]), (b, n)
        assert not torch.equal(shown[b, n], pix[b, n]), (b, n)
    assert torch.equal(shown[plain], pix[plain])


def test_filter_variance_shares_are_of_all_the_variance():
    """With full-rank filters the first k components explain less than all of it: s**2 / sum(s**2) of all."""
    torch.manual_seed(0)
    vit = create_encoder("vit_micro4_32").vit
    w = torch.randn(64, 3, 4, 4)
    with torch.no_grad():
        vit.patch_embed.proj.weight.copy_(w)
    _, share = filter_components(vit, k=5)
    flat = w.flatten(1)
    s = torch.linalg.svdvals(flat - flat.mean(0, keepdim=True))
    assert share.sum().item() < 0.9
    torch.testing.assert_close(share, (s ** 2 / (s ** 2).sum())[:5])


def test_filter_components_are_of_the_centred_filters():
    """A constant offset shared by every filter is no direction of their variance."""
    torch.manual_seed(0)
    vit = create_encoder("vit_micro4_32").vit
    pattern, offset = torch.randn(3, 4, 4), 50 * torch.randn(3, 4, 4)
    with torch.no_grad():
        vit.patch_embed.proj.weight.copy_(offset + torch.randn(64, 1, 1, 1) * pattern)
    comps, share = filter_components(vit, k=3)
    assert abs(torch.nn.functional.cosine_similarity(comps[0].flatten(), pattern.flatten(), 0).item()) > 0.9999
    assert share[0].item() == pytest.approx(1.0, abs=1e-4)


def test_the_filters_are_drawn_on_the_runs_std(data, tmp_path, monkeypatch):
    """filter_components gets the data.std the encoder trained with (raw-RGB filters), not the default."""
    from mpp.config import DataConfig
    from mpp.figures import inspection
    save_encoder(create_encoder("vit_micro4_32"), tmp_path / "export", data=DataConfig(std=(0.2, 0.3, 0.4)))
    got, real = [], inspection.filter_components

    def record(vit, *a, **k):
        got.append((a, k))
        return real(vit, *a, **k)
    monkeypatch.setattr(inspection, "filter_components", record)
    inspection.inspect_encoders([str(tmp_path / "export")], data, tmp_path / "o", images=2, grid_images=0)
    assert len(got) == 1
    a, k = got[0]
    std = k.get("std", a[0] if a else None)
    assert std is not None and tuple(std) == pytest.approx((0.2, 0.3, 0.4))


def test_record_attention_refuses_a_model_without_attention():
    with pytest.raises(ValueError, match="Linear has no timm Attention modules"):
        with record_attention(torch.nn.Linear(2, 2)):
            pass


def test_similarity_and_filter_mosaics_are_drawn_unflipped(tmp_path, monkeypatch):
    """On a 2x3 grid, position (r, c)'s map sits at tile (r, c) and peaks at its pixel (r, c); a filter
    tile is drawn (y, x) as it is, not transposed."""
    import numpy as np
    from matplotlib.axes import Axes

    from mpp.figures import plots
    shown, real = [], Axes.imshow

    def record(self, X, *a, **k):
        shown.append(np.asarray(X))
        return real(self, X, *a, **k)
    monkeypatch.setattr(Axes, "imshow", record)
    gh, gw = 2, 3
    plots.position_similarity({"e": torch.eye(gh * gw) * 2 - 1}, {"e": (gh, gw)}, tmp_path / "p.png")
    arr = shown.pop()
    assert arr.shape == (gh * (gh + 1) - 1, gw * (gw + 1) - 1)
    for r in range(gh):
        for c in range(gw):
            tile = arr[r * (gh + 1):r * (gh + 1) + gh, c * (gw + 1):c * (gw + 1) + gw]
            assert tile[r, c] == 1 and (tile == 1).sum() == 1, (r, c)
    comps = torch.zeros(2, 3, 4, 4)
    comps[0, 0, 0, 3] = 1.0  # red at y=0, x=3
    comps[1, 1, 2, 0] = 1.0  # green at y=2, x=0
    plots.filters({"e": comps}, tmp_path / "f.png")
    arr = shown.pop()
    for i in range(2):
        assert np.array_equal(arr[:4, i * 5:i * 5 + 4], comps[i].permute(1, 2, 0).numpy()), i


def test_the_tool_gives_its_options_to_the_inspection(tmp_path, monkeypatch):
    """--seed, --images, --batch-size, --grid-images and --num-samples reach inspect_encoders."""
    from mpp.figures import inspection
    seen = []
    monkeypatch.setattr(inspection, "inspect_encoders", lambda encoders, data, out, **kw: seen.append((encoders, kw)))
    r = run_tool("inspect_encoders", "--encoder", "none:vit_micro4_32", "--data", tmp_path / "x-{0..1}.tar",
                 "--num-samples", "9", "--out", tmp_path / "figs", "--seed", "3", "--images", "5",
                 "--batch-size", "2", "--grid-images", "1")
    assert r.returncode == 0, r.stderr
    assert seen == [(["none:vit_micro4_32"], dict(images=5, grid_images=1, batch_size=2, seed=3, num_samples=9))]
