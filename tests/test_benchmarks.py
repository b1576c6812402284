"""benchmarks/: the benchmark scripts still run end to end at toy sizes (they live outside the
package, so nothing else imports them), and their tables carry every method they timed."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mpp.config import DataConfig, build_config
from mpp.data import make_loader
from mpp.data.synthetic import make_synthetic
from mpp.evaluators.features import extract_features
from mpp.models import create_encoder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a busy shared machine two threads wait on each other for tens of seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_step_benchmark_times_every_method_and_counts_flops(monkeypatch):
    b = load("train_step")
    monkeypatch.setitem(b.MODELS, "micro", "vit_micro4_32")  # the tests' preset: seconds, not minutes
    rows = b.run(("micro",), ("fp32",), ("mpp", "timm+loop"), steps=1, warmup=0, batch_size=2,
                 progress=lambda m: None)
    assert [r["method"] for r in rows] == ["mpp", "timm+loop"]
    assert all(r["images_per_s"] > 0 for r in rows)
    assert rows[0]["flops"] > 0 and "flops" not in rows[1]
    assert rows[0]["speedup"] == pytest.approx(rows[0]["vs"]["timm+loop"])
    assert rows[0]["vs"]["timm+loop"] == pytest.approx(rows[0]["images_per_s"] / rows[1]["images_per_s"])
    b.add_peaks(rows, {"bf16": {"flops": 1e12, "n": 4096}, "fp32": {"flops": 1e12, "n": 2048}})
    table = b.format_table(rows, {"bf16": {"flops": 1e12, "n": 4096}}, None)
    assert "timm+loop" in table and "mpp" in table and "bf16 1.000 TFLOP/s at 4096^3" in table
    assert f"micro fp32 mpp: {rows[0]['vs']['timm+loop']:.2f}x timm+loop" in table


def test_train_step_measures_only_the_benchmarked_precisions_peaks_within_about_a_second(monkeypatch, capsys):
    """One bf16 4096^3 product takes minutes on a CPU without bf16 hardware: it was measured for an
    fp32-only run too, ten times, twice. Now a precision's peak is measured only when it is
    benchmarked, at the largest size whose product fits the time, and no rep starts after it."""
    b = load("train_step")
    synced = []
    monkeypatch.setattr(b, "_sync", lambda device: synced.append(device))
    b.matmul_rate(8, 8, 8, torch.float32, reps=10, budget_s=0)  # the time is spent after one rep
    assert len(synced) == 2
    rates = []

    def rate(m, k, n, dtype, reps=10, device=b.CPU, budget_s=1.0):  # 1 GFLOP/s: bf16 on an AVX2 CPU
        rates.append((dtype, n))
        return 1e9
    monkeypatch.setattr(b, "matmul_rate", rate)
    # 512^3 takes 0.27 s at that rate, so 1024^3 (2.1 s) would exceed half the second
    assert b.matmul_peak(torch.bfloat16, 4096) == {"flops": 1e9, "n": 512}
    assert max(n for _, n in rates) == 512
    rates.clear()
    monkeypatch.setitem(b.MODELS, "micro", "vit_micro4_32")
    b.main(["--only", "micro", "--precision", "fp32", "--methods", "mpp", "--steps", "1", "--warmup", "0",
            "--batch-size", "2", "--no-loader"])
    assert rates and {dtype for dtype, _ in rates} == {torch.float32}
    out = capsys.readouterr().out
    assert "fp32 0.001 TFLOP/s at 512^3; bf16 not benchmarked, not measured: no 'of peak'" in out, out
    row = next(line for line in out.splitlines() if line.startswith("micro  fp32  mpp"))
    assert re.search(r" [\d.]+ +$", row) and "%" not in row, out  # the ceiling, no of-peak



def test_steps_are_timed_in_blocks_synchronised_at_their_ends_only_on_batches_laid_out_as_the_loaders(monkeypatch):
    """A sync after every step charged the in-memory step with the host's time that the trainer
    overlaps with the device's; a contiguous batch met a compiled step with other strides than
    the loader's channels-last batches (a graph of its own)."""
    b = load("train_step")
    log = []
    monkeypatch.setattr(b, "_sync", lambda device: log.append("sync"))
    seconds = b.time_interleaved({"a": lambda x: log.append("a"), "b": lambda x: log.append("b")}, torch.zeros(1),
                                 warmup=1, rounds=2, block=3)
    assert log == ["a", "b"] + (["sync", "a", "a", "a", "sync", "sync", "b", "b", "b", "sync"]) * 2
    assert set(seconds) == {"a", "b"}
    batch = b.batch_like_the_loader(2, 8, torch.device("cpu"))
    assert batch.shape == (2, 3, 8, 8) and batch.dtype == torch.uint8
    with tempfile.TemporaryDirectory() as tmp:
        make_synthetic(tmp, train=4, test=0, size=8, progress=False)
        loader = make_loader(f"{tmp}/train/manifest.json", batch_size=2, img_size=8, train=True, labeled=False)
        real = next(iter(loader.epoch(0)))["image"]
        loader.close()
    assert batch.stride() == real.stride()


def test_peak_memory_of_a_step_is_its_own_and_counts_a_cuda_graphs_pools(monkeypatch):
    """A method's peak is what it holds between steps plus the allocator's peak above what was
    allocated before its step: the other methods alive beside it (1,000 bytes here, with its own)
    do not count. A replayed CUDA graph allocates nothing: the allocator's peak misses its
    activations, which sit in the graph's private pool (pool id other than (0, 0))."""
    b = load("train_step")
    segments = [dict(segment_pool_id=(0, 0), total_size=900, allocated_size=100),  # the default pool
                dict(segment_pool_id=(1, 3), total_size=700, allocated_size=200)]  # a graph's pool
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 1300)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    images = SimpleNamespace(device=torch.device("cuda"))  # a batch on a GPU, as far as peak_memory looks
    steps = []
    assert b.peak_memory(steps.append, images, held=150) == 150 + 300
    assert b.peak_memory(steps.append, images, held=150, graphs=True) == 150 + 300 + 500
    assert steps == [images, images]
    assert b.peak_memory(steps.append, torch.zeros(1), held=0) is None and b.allocated(torch.device("cpu")) == 0

@pytest.mark.slow
def test_data_benchmark_rates_every_method(tmp_path):
    b = load("data_loading")
    ds = b.prepare_generated(tmp_path, 32, size=48, crop=32)
    assert ds.manifest.is_file() and len(list(ds.folder.rglob("*.jpg"))) == 32
    rows = b.bench([ds], samples={ds.name: 32}, batch_size=8, workers=1, repeats=1)
    row = rows[0]
    assert all(row[m] > 0 for m in ("pil_loop", "mpp_decode", "shards", "imagefolder"))
    assert row["vs_imagefolder"] == pytest.approx(row["shards"] / row["imagefolder"])
    assert "| generated 48px, 32 crops |" in b.format_table(rows)


@pytest.mark.slow
def test_probe_blocks_last_block_is_the_encoders_own_output(tmp_path, capsys):
    """The per-block features' last block equals what the probe reads from the encoder's forward."""
    b = load("probe_blocks")
    make_synthetic(tmp_path, train=40, test=4, shards=2, progress=False)
    data = str(tmp_path / "train" / "manifest.json")
    torch.manual_seed(0)
    encoder = create_encoder("vit_micro4_32", attn="math")
    feats, labels = b.block_features(encoder, data, DataConfig())
    assert sorted(feats) == ["block1 avg", "block1 token", "block2 avg", "block2 token"] and len(labels) == 40
    own, own_labels, _ = extract_features(encoder, data, cfg=build_config({}), pools=("token", "avg"), progress=False,
                                       precision="no")  # block_features runs in fp32; auto is bf16 on bf16 CPUs
    assert torch.equal(labels, own_labels)
    torch.testing.assert_close(feats["block2 token"], own["token"])
    torch.testing.assert_close(feats["block2 avg"], own["avg"])
    b.main(["--data", data, "--encoder", "tiny=none:vit_micro4_32"])
    out = capsys.readouterr().out
    assert "tiny: held-out top-1 per block" in out and "block 2:" in out and "block 3:" not in out


@pytest.mark.slow
def test_probe_memorised_splits_the_folds_at_the_development_split(tmp_path, capsys, monkeypatch):
    """The folds' per-image outcomes are split into the training part and the development split by
    the folds' own order: an encoder whose features give the label away on the training part only
    scores nearly every one of those images in the folds and few of the others."""
    b = load("probe_memorised")
    make_synthetic(tmp_path, train=200, test=20, shards=2, progress=False)
    train, test = (str(tmp_path / s / "manifest.json") for s in ("train", "test"))
    real = b.extract_features

    def memorised(encoder, data, *, subset=None, **kw):  # the training part's labels in its features
        x, y, skipped = real(encoder, data, subset=subset, **kw)
        if subset is not None and not subset[3]:
            given = torch.nn.functional.one_hot(y, 10).float() * 100
            x = {n: v + torch.nn.functional.pad(given, (0, v.shape[1] - 10)) for n, v in x.items()}
        return x, y, skipped

    monkeypatch.setattr(b, "extract_features", memorised)
    b.main(["--train", train, "--test", test, "--encoder", "tiny=none:vit_micro4_32", "--label-fraction", "0.5",
            "--dev-fraction", "0.2", "--folds", "4"])
    out = capsys.readouterr().out
    for n in ("token", "avg"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"tiny {n}: "))
        fitted, withheld = map(float, line.split("(")[1].split(")")[0].split(" / "))
        assert fitted > 90 and withheld < 50, line  # misaligned, both would read the mean, 79


@pytest.mark.slow
def test_epoch_starts_benchmark_times_both_ways(tmp_path, capsys):
    b = load("epoch_starts")
    make_synthetic(tmp_path, train=80, test=4, shards=4, progress=False)
    b.main(["--data", str(tmp_path / "train" / "manifest.json"), "--fraction", "0.5", "--batch-size", "8",
            "--epochs", "3", "--step-ms", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "| 1 | restarted every epoch |" in out and "| 1 | run on (shipped) |" in out
    assert "later epoch starts' wait, run on / restarted: " in out
    # the step it simulated, measured: bf16 products sized it on a CPU without bf16 hardware at 3.5x
    # the time asked, silently
    took = re.search(r"simulated step, asked 1 ms, took \(mean per run\): restarted every epoch ([\d.]+) ms; "
                     r"run on \(shipped\) ([\d.]+) ms\n", out)
    assert took and all(float(ms) > 0 for ms in took.groups()), out


def test_epoch_starts_refuses_a_step_shorter_than_one_of_its_products(capsys):
    """One product longer than the step asked made the simulated step that product, silently."""
    b = load("epoch_starts")
    with pytest.raises(SystemExit) as stop:
        b.main(["--data", str(ROOT / "pyproject.toml"), "--step-ms", "1e-6"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and re.fullmatch(r"error: one 128x128 fp32 product takes [\d.]+ ms here, more than "
                                                 r"the simulated step of 1e-06 ms; give a larger --step-ms\n", err), err


def test_data_loading_refuses_counts_that_time_no_batch(capsys):
    """Rates are timed from the first batch on: as many samples as one batch would print nan."""
    b = load("data_loading")
    with pytest.raises(SystemExit) as stop:
        b.main(["--only", "generated", "--gen-samples", "8", "--batch-size", "8"])
    assert stop.value.code == 2 and "must exceed --batch-size (8)" in capsys.readouterr().err


def test_finetune_mixup_mixes_only_in_training_and_its_loss_is_the_mixed_one():
    from mpp.config import Config
    from mpp.objectives import build_task
    mixup = load("finetune_mixup")
    torch.manual_seed(0)
    task = build_task(Config(objective="classify"), create_encoder("vit_micro4_32", attn="math"), 10)
    torch.nn.init.normal_(task.head.weight)  # the zero head would give every input the same loss
    images, labels = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (8,))
    plain = task(images, labels)[0]
    task.eval()
    assert torch.equal(mixup.mixed_forward(1.0)(task, images, labels)[0], plain)  # evaluation: unchanged
    task.train()
    # alpha -> 0: the weight is 0 or 1, one whole image each, and a batch's mean loss ignores its order
    assert torch.allclose(mixup.mixed_forward(1e-4)(task, images, labels)[0], plain, atol=1e-3)
    torch.manual_seed(1)
    mixed = mixup.mixed_forward(1.0)(task, images, labels)[0]
    assert not torch.allclose(mixed, plain, atol=1e-3)
    # the same draws (weight, then permutation) by hand: both the inputs and the loss mixed, each
    # with its own weight, the second term against the permuted labels
    torch.manual_seed(1)
    lam, perm = float(torch.distributions.Beta(1.0, 1.0).sample()), torch.randperm(8)
    x = task.inputs(images)[1]
    logits = task.head(task.encoder.pool(task.encoder(lam * x + (1 - lam) * x[perm]), task.pool).float())
    task.label_smoothing = 0.1  # finetune.label_smoothing (configs/cifar10_finetune_adamw.yaml) mixes alike
    torch.manual_seed(1)
    mixed = mixup.mixed_forward(1.0)(task, images, labels)[0]
    ce = lambda y_: torch.nn.functional.cross_entropy(logits, y_, label_smoothing=0.1)  # noqa: E731
    assert 0.05 < lam < 0.95 and not torch.equal(labels, labels[perm])
    assert torch.allclose(mixed, lam * ce(labels) + (1 - lam) * ce(labels[perm]))


def test_loader_rate_times_the_epochs_after_the_first(tmp_path, capsys):
    b = load("loader_rate")
    make_synthetic(tmp_path, train=96, test=0, shards=2, progress=False)
    manifest = str(tmp_path / "train" / "manifest.json")
    r = b.run(manifest, batch_size=16, workers=1, epochs=3)
    assert r["images"] == 2 * 96 and r["images_per_s"] > 0 and r["cpu_ms_per_batch"] > 0
    # beside its bound: one core's decode of the same images, times the workers
    assert r["decode_limit"] > 0 and r["of_limit"] == pytest.approx(r["images_per_s"] / r["decode_limit"])
    assert len(b.shard_images(manifest, 50)) == 50 and set(b.shard_images(manifest, 1)[0]) == {"jpg"}
    subset = make_loader(manifest, batch_size=16, img_size=32, train=True, labeled=True, data_cfg=DataConfig(),
                         subset=(0.5, 0)).num_samples  # half of each class, rounded per class
    assert b.run(manifest, batch_size=16, workers=1, epochs=2, fraction=0.5)["images"] == subset < 96
    with pytest.raises(SystemExit) as stop:
        b.main(["--data", str(tmp_path / "nope.json")])
    assert stop.value.code == 2 and "not found" in capsys.readouterr().err


def test_probe_fit_times_the_layouts_and_the_probe_on_cached_features(tmp_path, capsys):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (400,), generator=g)
    centers = torch.randn(4, 16, generator=g)  # the feature cache's layout: features.<representation>, labels
    save_file({"features.token": centers[y] + torch.randn(400, 16, generator=g),
               "features.avg": 0.2 * centers[y] + torch.randn(400, 16, generator=g), "labels": y},
              str(tmp_path / "features-x.safetensors"))
    lbfgs = torch.optim.LBFGS
    load("probe_fit").main(["--features", str(tmp_path / "features-x.safetensors"), "--dim", "16", "--classes", "4"])
    assert torch.optim.LBFGS is lbfgs  # its timed L-BFGS is swapped in for its own run only
    out = capsys.readouterr().out
    assert "N=4500: sample-major" in out and "400 samples, 2 representations" in out, out
    assert "-> token," in out and "% of predictions agree" in out, out  # the stronger signal is chosen
    assert float(re.search(r"\(([\d.]+)x\); [\d.]+% of predictions agree", out)[1]) > 0, out  # zeros / warm
    assert 0 < float(re.search(r"\((\d+)% in its evaluations\)", out)[1]) < 100, out
    with pytest.raises(SystemExit):  # a one-line error, before any fit
        load("probe_fit").main(["--history", "0"])
    assert "--history: expected a whole number >= 1, got '0'" in capsys.readouterr().err
    (tmp_path / "bad.safetensors").write_bytes(b"x")  # not a feature-cache file: named, before the timings
    for bad, why in (("bad.safetensors", "is not a safetensors file"),
                     ("enc.safetensors", "holds no features and labels")):
        save_file({"w": torch.zeros(2)}, str(tmp_path / "enc.safetensors"))
        with pytest.raises(SystemExit):
            load("probe_fit").main(["--features", str(tmp_path / bad)])
        out, err = capsys.readouterr()
        assert err.startswith(f"error: {tmp_path / bad} {why}") and len(err.splitlines()) == 1 and not out, err


def test_gpu_session_script_parses_and_names_its_parts():
    """The GPU script runs only in a lent session's few minutes: a syntax error or a misnamed part
    must show here first."""
    script = str(ROOT / "benchmarks" / "gpu_session.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    r = subprocess.run(["bash", script, "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part 'nope'" in r.stderr and "probe-threads" in r.stderr, r.stderr
    r = subprocess.run(["bash", script, "step"], capture_output=True, text=True)
    assert r.returncode == 2 and "step needs models" in r.stderr, r.stderr
    for part in ("3/2", "0/2", "x"):  # checked before anything is installed or run
        r = subprocess.run(["bash", script, "tests", part], capture_output=True, text=True)
        want = f"tests takes K/N with 1 <= K <= N, e.g. tests 1/2, or test files; got '{part}'"
        assert r.returncode == 2 and want in r.stderr, r.stderr
    r = subprocess.run(["bash", script, "tests", "tests/test_models.py", "tests/test_nope.py"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "no test file 'tests/test_nope.py'" in r.stderr, r.stderr
    r = subprocess.run(["bash", script, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Every GPU figure") and "tests [K/N" in r.stdout, r.stdout


def test_the_gpu_session_sets_the_trainer_against_the_in_memory_step_it_measured(tmp_path):
    """The trainer / in-memory ratio was worked out by hand from two outputs; `session` now prints
    it from the trainer's windows and the step table of the same call, at the same batch and
    precision: the trainer's window (batch 1024) was set against a step row of any batch, and the
    latest window of an $OUT reused across calls could be another call's, on another card."""
    window = {"run": "/tmp/runs/pre_vit_ti4_32_default", "call": "this", "batch": 1024, "precision": "bf16"}
    (tmp_path / "windows.jsonl").write_text(
        json.dumps({**window, "median_images_per_s": 45000.0}) + "\n"
        + json.dumps({**window, "run": "/tmp/runs/pre_vit_ti4_32_default_w8_1", "median_images_per_s": 2.0}) + "\n"
        + json.dumps({**window, "call": "later", "median_images_per_s": 1.0}) + "\n")  # a later call's, same OUT
    rows = [{"method": "mpp+compile", "precision": "bf16", "batch": 256, "images_per_s": 30000.0},
            {"method": "mpp+compile", "precision": "bf16", "batch": 1024, "images_per_s": 50000.0},
            {"method": "mpp", "precision": "bf16", "batch": 1024, "images_per_s": 1.0}]

    def ratio(rows, call="this"):
        (tmp_path / "step_ti4.json").write_text(json.dumps({"rows": rows, "call": call}))
        return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "ratio"], capture_output=True,
                              text=True, env={**os.environ, "OUT": str(tmp_path), "CALL": "this"})
    r = ratio(rows)
    assert r.returncode == 0, r.stderr
    assert ("Ti/4 batch 1024 bf16: trainer 45000 images/s (median window) / in-memory compiled step 50000 images/s "
            "= 0.90" in r.stdout), r.stdout
    for wrong, said in (
            (ratio(rows[:1]), "ratio: the trainer ran batch 1024 bf16, the compiled step only batch 256 bf16; run "
                              "step ti4 --batch-size 1024"),
            (ratio([{**rows[1], "precision": "fp32"}]), "ratio: the trainer ran batch 1024 bf16, the compiled step "
                                                        "only batch 1024 fp32"),
            (ratio(rows, call="earlier"), "ratio: no Ti/4 trainer window or compiled step of call this in")):
        assert wrong.returncode == 1 and wrong.stderr.startswith(said) and len(wrong.stderr.splitlines()) == 1, wrong
        assert not wrong.stdout, wrong.stdout
    (tmp_path / "windows.jsonl").write_text(json.dumps({**window, "call": "later", "median_images_per_s": 1.0}) + "\n")
    r = ratio(rows)  # this call's trainer timed out: only another call's window
    assert r.returncode == 1 and r.stderr.startswith("ratio: no Ti/4 trainer window or compiled step of call this"), r
    (tmp_path / "step_ti4.json").unlink()  # the step part timed out: said in one line
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "ratio"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 1 and r.stderr.startswith("ratio: no Ti/4 trainer window or compiled step"), r.stderr


def test_every_gpu_session_run_starts_in_a_folder_emptied_first():
    """A warm machine keeps /tmp and the checkout between calls: a finished run left in a fixed
    folder by an earlier call resumes with nothing to train (a comparison skips its stages), and the
    part reads the old run as this call's. Each part or function that trains (pretrain, finetune,
    compare) removes its run folder before it, in its own body."""
    import yaml
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    lines = script.splitlines()
    runs = 0
    for i, line in enumerate(lines):
        if not re.search(r"python3 -m mpp\.tools\.(pretrain|finetune|compare)\b", line):
            continue
        command = line
        for nxt in lines[i + 1:]:
            if not command.endswith("\\"):
                break
            command += "\n" + nxt
        folder = re.search(r"output_dir=(\S+)", command)
        folder = folder[1] if folder else yaml.safe_load(
            (ROOT / re.search(r"--config (\S+)", command)[1]).read_text())["output_dir"]
        body = next(k for k in range(i, -1, -1) if re.match(r"(\w+\(\) \{|[\w|-]+\))", lines[k]))
        removed = [re.escape(f) for f in (folder, f'"{folder}"')]
        assert any(re.search(rf"rm -rf ({'|'.join(removed)})(\s|$)", x) for x in lines[body:i]), (lines[body], folder)
        runs += 1
    assert runs == 5  # pretrain(), finetune(), recompiles, deterministic, mainjob


def test_finetune_mixup_runs_the_baseline_beside_it_and_prints_the_paired_difference(tmp_path, capsys):
    make_synthetic(tmp_path / "data", train=64, test=16, shards=2, progress=False)
    mixup = load("finetune_mixup")
    plain = mixup.LabelTask.forward
    mixup.main(["--alpha", "0.4", "--config", str(ROOT / "configs/synthetic_finetune.yaml"), "steps=3",
                "model=vit_micro4_32", "batch_size=16", "finetune.head_init=zero", f"output_dir={tmp_path / 'out'}",
                f"data.train={tmp_path / 'data/train/manifest.json'}",
                f"data.val={tmp_path / 'data/test/manifest.json'}"])
    assert mixup.LabelTask.forward is plain  # mixup patched in for its own run only
    out = capsys.readouterr().out
    assert re.search(r"plain: top-1 [\d.]+, mixup_0.4: top-1 [\d.]+; mixup - plain [+-][\d.]+ ± [\d.]+ "
                     r"\(paired over 16 val images\)", out), out
    assert (tmp_path / "out/plain/metrics.json").is_file() and (tmp_path / "out/mixup_0.4/metrics.json").is_file()
    with pytest.raises(SystemExit) as stop:
        mixup.main(["--alpha", "0", "--config", str(ROOT / "configs/synthetic_finetune.yaml")])
    assert stop.value.code == 2 and "--alpha must be > 0" in capsys.readouterr().err


def test_paired_runs_averages_the_pairs_differences_with_errors_from_their_images(tmp_path, capsys):
    """Two development splits, each a baseline and a lever scored on the same images: the mean of
    the two differences and its standard error (each pair's paired over its images, the pairs'
    added in quadrature), and the spread of the two differences beside it; runs scored on other
    images, and two pairs on the same images, are refused in one line."""
    from mpp import outcomes
    rng = np.random.default_rng(0)
    pairs, diffs, errors = [], [], []
    for split in range(2):
        labels = rng.integers(0, 10, 200)
        base, lever = rng.random(200) < 0.4, rng.random(200) < 0.5
        for name, correct in (("base", base), ("lever", lever)):
            run = tmp_path / f"{name}_s{split}"
            run.mkdir()
            (run / "metrics.json").write_text(json.dumps({"top1": correct.mean(), "start_top1": 0.3, "acc": 0.6,
                                                          "outcomes": outcomes.record(correct, labels)}))
        pairs.append(f"{tmp_path / f'base_s{split}'}:{tmp_path / f'lever_s{split}'}")
        d = lever.astype(float) - base
        diffs.append(100 * d.mean())
        errors.append(100 * d.std(ddof=1) / np.sqrt(200))
    paired = load("paired_runs")
    paired.main(pairs)
    mean, se, spread = np.mean(diffs), np.sqrt(np.sum(np.square(errors))) / 2, np.std(diffs, ddof=1) / np.sqrt(2)
    out = capsys.readouterr().out
    said = re.search(r"mean over 2 pair\(s\): ([+-][\d.]+) ± ([\d.]+) points \(images\); spread of the pairs ± "
                     r"([\d.]+) \(1 degrees of freedom\)", out)
    assert said and np.allclose([float(x) for x in said.groups()], [mean, se, spread], atol=0.051), out
    for wrong, said in (([f"{tmp_path / 'base_s0'}:{tmp_path / 'lever_s1'}"], "were scored on other images"),
                        ([pairs[0], pairs[0]], "a second pair scored on the same images")):
        with pytest.raises(SystemExit) as stop:
            paired.main(wrong)
        assert stop.value.code == 2 and said in capsys.readouterr().err
