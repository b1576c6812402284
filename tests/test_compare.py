"""tools/compare.py: the plan of stages, validation before any work, an end-to-end run on tiny
synthetic data (every stage writes its metrics, the report fills every cell), and a second run
that resumes by skipping the finished stages."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpp.compare import plan, validate
from mpp.config import ConfigError, load_compare_config

ROOT = Path(__file__).resolve().parents[1]


def _write_configs(tmp: Path, data: Path, stage_extra: str = "", fractions: str = "[0.5, 1.0]") -> Path:
    """A comparison over ROOT/configs' synthetic stages, shrunk to seconds per stage."""
    (tmp / "compare.yaml").write_text(textwrap.dedent(f"""\
        output_dir: {tmp / 'runs'}
        mpp: {ROOT / 'configs/synthetic_mpp.yaml'}
        supervised: {ROOT / 'configs/synthetic_supervised.yaml'}
        finetune: {ROOT / 'configs/synthetic_finetune.yaml'}
        probe: {ROOT / 'configs/synthetic_probe.yaml'}
        label_fractions: {fractions}
        overrides: [model=vit_micro4_32, steps=2, batch_size=32, train.log_every=1, train.attn=math,
                    data.num_workers=0, data.train={data / 'train'}, data.val={data / 'test'},
                    'fewshot.shots=[1,2]', fewshot.seeds=1{stage_extra}]
        prepare:
          synthetic: {data}
          synthetic_train: 120
          synthetic_test: 40
        """))
    return tmp / "compare.yaml"


def test_plan_covers_every_stage_and_wires_inits(tmp_path):
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "data"))
    stages = plan(cfg)
    names = [s.name for s in stages]
    assert names[:2] == ["pre-train mpp", "pre-train supervised"]
    assert sum(n.startswith("fine-tune") for n in names) == 6  # 3 inits x 2 label fractions
    assert [n for n in names if n.startswith("linear probe")] == [
        "linear probe mpp", "linear probe supervised", "linear probe scratch"]
    assert "probe.encoder=none" in {s.name: s for s in stages}["linear probe scratch"].overrides
    assert len({s.out for s in stages}) == len(stages)  # no two stages share a run dir
    ft = {s.name: s for s in stages}["fine-tune mpp, 50% labels"]
    assert f"finetune.init={tmp_path / 'runs' / 'pretrain_mpp'}" in ft.overrides
    assert "finetune.label_fraction=0.5" in ft.overrides
    assert ft.overrides[-1] == f"output_dir={ft.out}"  # compare decides where each stage writes


def test_bad_stage_key_fails_before_any_work(tmp_path):
    path = _write_configs(tmp_path, tmp_path / "data", stage_extra=", mpp.ratioo=0.3")
    cfg = load_compare_config(path)
    with pytest.raises(ConfigError, match="pre-train mpp.*unknown config key 'mpp.ratioo'"):
        validate(cfg, plan(cfg))
    r = subprocess.run([sys.executable, str(ROOT / "tools/compare.py"), "--config", str(path)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "mpp.ratioo" in r.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()  # nothing started


def test_compare_config_errors_are_one_line(tmp_path):
    (tmp_path / "c.yaml").write_text("mpp: a.yaml\nsupervised: b.yaml\nfinetune: c.yaml\nprobe: d.yaml\n"
                                     "label_fractions: [0, 1]\n")
    with pytest.raises(ConfigError, match="label_fractions"):
        load_compare_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="unknown config key 'steps'.*valid keys: output_dir"):
        load_compare_config(tmp_path / "c.yaml", ["steps=3"])


@pytest.mark.slow
def test_end_to_end_then_resume_skips_finished_stages(tmp_path):
    path = _write_configs(tmp_path, tmp_path / "data", fractions="[0.5]")  # 7 stages: seconds each
    cmd = [sys.executable, str(ROOT / "tools/compare.py"), "--config", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = tmp_path / "runs"
    report = json.loads((runs / "report.json").read_text())
    md = (runs / "report.md").read_text()
    assert "MPP" in md and "share" in md and (runs / "report.png").stat().st_size > 0
    for stage in plan(load_compare_config(path)):
        assert (stage.out / "metrics.json").is_file(), stage.name
    ft = json.loads((runs / "finetune_mpp_50pct" / "metrics.json").read_text())
    assert 0.0 <= ft["top1"] <= 1.0 and ft["label_fraction"] == 0.5
    # the derived figures are computed from the fine-tunes' own metrics
    tops = {init: json.loads((runs / f"finetune_{init}_50pct" / "metrics.json").read_text())["top1"] * 100
            for init in ("mpp", "scratch", "supervised")}
    gap = report["derived"]["finetune"]["0.5"]
    assert gap["mpp_minus_scratch"] == pytest.approx(tops["mpp"] - tops["scratch"], abs=0.06)
    assert gap["supervised_minus_mpp"] == pytest.approx(tops["supervised"] - tops["mpp"], abs=0.06)
    # and the probe's from the probes', the random-init one as its scratch baseline
    probes = {kind: json.loads((runs / f"probe_{kind}" / "metrics.json").read_text())["top1"] * 100
              for kind in ("mpp", "scratch")}
    assert report["derived"]["linear_top1"]["mpp_minus_scratch"] == pytest.approx(
        probes["mpp"] - probes["scratch"], abs=0.06)

    t0 = time.time()
    r2 = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert r2.stdout.count("done earlier") == 8
    assert time.time() - t0 < 60  # nothing re-trained
