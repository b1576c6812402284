"""tools/compare.py: the plan of stages (sweeps on a dev split, seeds, choices made from earlier
stages), validation before any work, an end-to-end run on tiny synthetic data (every stage
writes its metrics, the report fills every cell), and a second run that resumes by skipping the
finished stages."""
from __future__ import annotations

import hashlib
import json
import shutil
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from mpp import outcomes
from mpp.compare import check_processes, check_unchanged, plan, prepare_data, repeat_dir, run, time_split, validate
from mpp.compare.planning import best_point, head_l2
from mpp.config import ConfigError, load_compare_config, load_config, to_dict
from mpp.data import make_loader
from toolrun import run_tool

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the tools and their stages import this checkout's mpp


def _one_error(stderr: str) -> bool:
    """Whether a comparison's stderr ends in one error line, after any warnings (the synthetic
    configs' warmup outlasts these tests' 2-step stages, which the comparison warns about)."""
    lines = [line for line in stderr.splitlines() if not line.startswith("warning: ")]
    return len(lines) == 1 and lines[0].startswith("error: ")


def _write_configs(tmp: Path, data: Path, stage_extra: str = "", fractions: str = "[0.5, 1.0]",
                   compare_extra: str = "") -> Path:
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
        """) + compare_extra)
    return tmp / "compare.yaml"


def test_data_of_another_source_or_other_sizes_is_refused_not_read_as_the_old(tmp_path):
    """The stages' configs name only the data's folder, so a comparison given another shards source
    or other synthetic sizes over data it made reused the old data and every finished stage, and
    the report named the new source. Both are refused, naming the fix (there is no --overwrite)."""
    from PIL import Image
    for src in ("a", "b"):
        for label in ("cat", "dog"):
            (tmp_path / src / label).mkdir(parents=True)
            Image.new("RGB", (8, 8), (200, 9, 9)).save(tmp_path / src / label / "0.png")
    path = _write_configs(tmp_path, tmp_path / "d")
    shards = [f"prepare.shards_out=[{tmp_path / 'out'}]", "prepare.synthetic_train=10", "prepare.synthetic_test=4"]
    prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'a'}]"]))
    assert json.loads((tmp_path / "out/manifest.json").read_text())["num_samples"] == 2
    prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'a'}/]"]))  # the same
    with pytest.raises(ConfigError, match=f"prepare.shards_out '{tmp_path / 'out'}' holds the shards of "
                                          f"{tmp_path / 'a'}, not of prepare.shards_src '{tmp_path / 'b'}'; delete"):
        prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'b'}]"]))
    (tmp_path / "a").rename(tmp_path / "moved")  # the source moved since (or another machine's): reused
    prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'moved'}]"]))
    shards[1] = "prepare.synthetic_train=12"
    with pytest.raises(ConfigError, match=r"prepare.synthetic: .* other settings \(num 10, not 12\); delete it and "
                                          "every stage of the comparison that read it, or give another folder$"):
        prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'moved'}]"]))


@pytest.mark.parametrize("launcher, stated", [("", 1), ("torchrun --nproc_per_node 2", 2),
                                              ("torchrun --nnodes=2 --nproc-per-node 4", 8),
                                              ("accelerate launch --num_processes=4", 4),
                                              ("torchrun --nproc_per_node gpu", None),
                                              ("torchrun --nnodes 1:4 --nproc_per_node auto", None),
                                              ("torchrun --nnodes $SLURM_NNODES --nproc_per_node 8", None),
                                              ("accelerate launch --multi_gpu", None), ("nice python", None)])
def test_a_finished_stage_of_another_process_count_is_refused_where_the_launcher_states_it(tmp_path, launcher, stated,
                                                                                         monkeypatch):
    """The processes split the data, so a stage trained on 2 and resumed with another count is
    refused; where the launcher decides the count at run time (a GPU count, a config file, an
    unexpanded variable) it is not checked: resuming with the same launcher was refused."""
    from mpp.compare import launcher_words, stated_processes
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    assert stated_processes(launcher_words(launcher, machine=False)) == stated
    stage = next(s for s in plan(load_compare_config(_write_configs(tmp_path, tmp_path / "d"))) if s.tool == "pretrain")
    stage.out.mkdir(parents=True)
    (stage.out / "metrics.json").write_text(json.dumps({"processes": 2}))
    if stated in (2, None):  # the count it ran on, or one the launcher decides: reused
        check_processes(stage, stated)
    else:
        with pytest.raises(ConfigError, match=rf"on 2 process\(es\); the launcher now starts {stated}"):
            check_processes(stage, stated)
    (stage.out / "metrics.json").write_text(json.dumps({"top1": 0.5}))  # an older mpp's: no count recorded, reused
    check_processes(stage, stated)


def test_a_launchers_variables_are_expanded_as_a_shell_would_and_an_unset_one_refused(monkeypatch):
    """Stages run without a shell: `--nnodes $SLURM_NNODES` reached torchrun as the text '$SLURM_NNODES'
    (its int() failed at the first stage, after the data). $NAME and ${NAME} are expanded now, and
    counted; an unset one refused (left as written in a dry run); a shell's other forms refused."""
    from mpp.compare import launcher_words, stated_processes
    monkeypatch.setenv("SLURM_NNODES", "2")
    words = launcher_words("torchrun --nnodes $SLURM_NNODES --nproc_per_node=${SLURM_NNODES}", machine=False)
    assert words == ["torchrun", "--nnodes", "2", "--nproc_per_node=2"] and stated_processes(words) == 4
    monkeypatch.delenv("SLURM_NNODES")
    monkeypatch.setattr("shutil.which", lambda cmd: f"/usr/bin/{cmd}")
    with pytest.raises(ConfigError, match=r"names \$SLURM_NNODES, a variable not set here"):
        launcher_words("torchrun --nnodes $SLURM_NNODES --nproc_per_node 8")
    assert launcher_words("torchrun --nnodes '$SLURM_NNODES'", machine=False)[-1] == "$SLURM_NNODES"  # a dry run
    for other in ("${SLURM_NNODES:-1}", "$(hostname):29500", "$((2))"):  # a shell's, not expanded here: refused
        with pytest.raises(ConfigError, match=r"only \$NAME and \$\{NAME\} are expanded"):
            launcher_words(f"torchrun --rdzv_endpoint {other}", machine=False)


@pytest.mark.parametrize("out", [".", "runs/..", "/", ".."])
def test_repeats_need_an_output_dir_with_a_name_to_sit_beside(tmp_path, out):
    """pretrain_seeds > 1 puts the repeats beside output_dir (output_dir_pretrain_seed1): '.' ended
    in a traceback, and 'runs/..' put them inside runs/."""
    path = _write_configs(tmp_path, tmp_path / "d")
    load_compare_config(path, [f"output_dir={out}"])  # one pre-training seed: no sibling to place
    with pytest.raises(ConfigError, match=f"'output_dir' is '{re.escape(out)}', which names no folder for the repeats"):
        load_compare_config(path, [f"output_dir={out}", "pretrain_seeds=2"])
    with pytest.raises(ConfigError, match="'output_dir' is empty, which would write the comparison into this folder"):
        load_compare_config(path, ["output_dir="])  # a report.md in the working directory, exit 0
    cfg = load_compare_config(path, [f"output_dir={tmp_path}/runs/x/..", "pretrain_seeds=2"])
    assert repeat_dir(cfg, 1) == tmp_path / "runs_pretrain_seed1"  # beside runs, not inside it


def test_plan_covers_every_stage_and_wires_inits(tmp_path):
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "data"))
    stages = plan(cfg)
    names = [s.name for s in stages]
    assert names[:5] == ["pre-train mpp", "pre-train supervised", "linear probe mpp", "linear probe supervised",
                         "linear probe scratch"]
    assert sum(n.startswith("fine-tune") for n in names) == 6  # 3 inits x 2 label fractions, no sweep, 1 seed
    assert "probe.encoder=none" in {s.name: s for s in stages}["linear probe scratch"].overrides
    longer = plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data"), ["pretrain_overrides=[steps=5]"]))
    assert [s.name for s in longer if "steps=5" in s.overrides] == ["pre-train mpp", "pre-train supervised"]
    assert all(s.overrides.index("steps=5") > s.overrides.index("steps=2") for s in longer[:2])  # after `overrides`
    assert len({s.out for s in stages}) == len(stages)  # no two stages share a run dir
    ft = {s.name: s for s in stages}["fine-tune mpp, 50% labels, seed 0"]
    assert f"finetune.init={tmp_path / 'runs' / 'pretrain_mpp'}" in ft.overrides
    assert "finetune.label_fraction=0.5" in ft.overrides and "seed=0" in ft.overrides
    assert ft.args(resolved=False)[-1] == f"output_dir={ft.out}"  # compare decides where each stage writes
    # without a sweep each fine-tune chooses its representation on its own training labels
    assert "finetune.pool=auto" in ft.overrides and not ft.choices


def test_sweep_on_dev_split_then_best_value_over_seeds(tmp_path, capsys):
    path = _write_configs(tmp_path, tmp_path / "data", fractions="[0.1]", compare_extra=textwrap.dedent("""\
        sweep: {optim.lr: [0.01, 0.03, 0.1]}
        seeds: 2
        dev_fraction: 0.2
        """))
    cfg = load_compare_config(path)
    stages = {s.name: s for s in plan(cfg)}
    sweeps = [s for n, s in stages.items() if n.startswith("fine-tune scratch, 10% labels, sweep")]
    finals = [s for n, s in stages.items() if n.startswith("fine-tune scratch, 10% labels, seed")]
    runner_ups = [s for n, s in stages.items() if n.startswith("fine-tune scratch, 10% labels, runner-up")]
    others = [s for n, s in stages.items() if n.startswith("fine-tune scratch, 10% labels, other representation")]
    assert len(stages) == 5 + 3 * (3 + 2 + 2 + 2) and len(sweeps) == 3
    assert len(finals) == len(runner_ups) == len(others) == 2
    assert {s.out.name for s in others} == {"other_pool_seed0", "other_pool_seed1"}
    assert {s.out.name for s in runner_ups} == {"runner_up_seed0", "runner_up_seed1"}
    assert [s.out.name for s in sweeps] == ["sweep_lr0.01", "sweep_lr0.03", "sweep_lr0.1"]
    assert all("finetune.dev_fraction=0.2" in s.overrides for s in sweeps)
    # finals and runner-ups train on all the labels and test on data.val, even where a config sets a split
    assert all(s.overrides[-2:] == ["finetune.dev_fraction=0", f"seed={s.out.name[-1]}"]
               for s in finals + runner_ups + others)
    assert [o for o in finals[1].overrides if o.startswith("seed=")] == ["seed=1"]
    validate(cfg, list(stages.values()))  # every grid value and the finals' placeholders resolve
    # the sweep chooses the representation on its own training labels; the finals take the best
    # stage's, never the all-label probe's (a 10%-label cell must not lean on all the labels)
    assert all("finetune.pool=auto" in s.overrides for s in sweeps)
    assert all("finetune.pool=auto" not in s.overrides for s in finals + runner_ups)
    for s, top1, pool in zip(sweeps, (0.4, 0.6, 0.5), ("avg", "token", "avg")):
        s.out.mkdir(parents=True)
        (s.out / "metrics.json").write_text(json.dumps({"top1": top1, "evaluated_on": "dev", "pool": pool}))
    (tmp_path / "runs" / "probe_scratch").mkdir(parents=True)
    (tmp_path / "runs" / "probe_scratch" / "metrics.json").write_text(json.dumps({"pool": "avg"}))
    assert finals[0].args()[-3:-1] == ["finetune.pool=token", "optim.lr=0.03"]
    assert runner_ups[1].args()[-3:-1] == ["finetune.pool=avg", "optim.lr=0.1"]  # the second best, 0.5, its pool
    assert not runner_ups[0].when.holds()  # no per-image outcomes: no toss-up can be claimed
    assert not others[0].when.holds()  # nor for the representation, whose choice recorded no scores
    # the best stage (lr 0.03) chose the [class] token over the patch mean by 10 points on 100 held-out
    # images, the two disagreeing on 90 of them: a toss-up, so the finals are retrained with the patch mean
    held, h = np.arange(100) % 10, np.arange(100)
    best = {"top1": 0.6, "evaluated_on": "dev", "pool": "token", "pool_heldout_top1": {"token": 0.6, "avg": 0.5},
            "pool_heldout_outcomes": {"token": outcomes.record(h < 60, held), "avg": outcomes.record(h >= 50, held)}}
    (sweeps[1].out / "metrics.json").write_text(json.dumps(best))
    assert others[0].when.holds() and others[1].args()[-3:-1] == ["optim.lr=0.03", "finetune.pool=avg"]
    # a probe head's L2, chosen by each sweep stage on its development split per representation, goes to
    # the finals with the representation they train through: none chosen again on their training labels
    (sweeps[1].out / "metrics.json").write_text(json.dumps({**best, "pool_head_l2": {"token": 0.01, "avg": 1.0}}))
    (sweeps[2].out / "metrics.json").write_text(json.dumps({"top1": 0.5, "evaluated_on": "dev", "pool": "avg",
                                                           "head_probe_l2": 1e-4}))  # a fixed pool's record
    assert finals[0].args()[-4:-1] == ["finetune.pool=token", "optim.lr=0.03", "finetune.head_l2=0.01"]
    assert others[1].args()[-4:-1] == ["optim.lr=0.03", "finetune.pool=avg",
                                       "finetune.head_l2=1.0"]  # the other representation's, not the best's too
    assert runner_ups[0].args()[-4:-1] == ["finetune.pool=avg", "optim.lr=0.1", "finetune.head_l2=0.0001"]
    resolved = load_config(others[1].config, others[1].args() + ["finetune.head_init=probe"]).finetune
    assert (resolved.pool, resolved.head_l2) == ("avg", 1.0)  # this test's configs start the head at zero
    best["pool_heldout_outcomes"]["avg"] = outcomes.record(h < 50, held)  # disagreeing on 10: a clear lead
    (sweeps[1].out / "metrics.json").write_text(json.dumps(best))
    assert not others[0].when.holds()
    labels, idx = np.arange(200) % 10, np.arange(200)
    for s, hits in zip(sweeps, (idx < 80, idx < 120, idx >= 100)):  # 0.03 leads 0.1 by 10 points on 200 images
        s.out.joinpath("metrics.json").write_text(json.dumps({"top1": hits.mean(), "evaluated_on": "dev",
                                                              "outcomes": outcomes.record(hits, labels)}))
    assert runner_ups[0].when.holds()  # ... but they disagree on 180 of them: a toss-up
    (sweeps[2].out / "metrics.json").write_text(json.dumps({"top1": 0.5, "evaluated_on": "dev", "outcomes":
                                                           outcomes.record((idx < 100), labels)}))
    assert not runner_ups[0].when.holds()  # they disagree on 20: a clear lead, no runner-up run
    for m in ({"evaluated_on": "val"}, {}):  # scored on test images, or saying nothing of where
        m.update(top1=0.9, pool="avg")
        (sweeps[0].out / "metrics.json").write_text(json.dumps(m))
        with pytest.raises(RuntimeError, match="development split"):
            finals[0].args()
    run(cfg, dry_run=True)
    out = capsys.readouterr().out
    assert ("optim.lr: best dev top-1 of 3 sweep stages" in out and "finetune.pool: the best sweep stage's" in out
            and "the second-best sweep stage's" in out)
    assert "runs only if the best value's dev lead over it is under t times its standard error" in out
    assert f"{sys.executable} -m mpp.tools.pretrain --config" in out  # the installed module, not a repo path
    assert not (tmp_path / "data").exists()  # a dry run makes nothing
    total = len(plan(cfg)) + 2  # its listing began at step 2: the data and figures steps were left out
    assert out.startswith(f"[1/{total}] data: made where missing") and f"[{total}/{total}] figures and report" in out


def test_bad_sweep_fails_before_any_work(tmp_path, capsys):
    with pytest.raises(ConfigError, match="sets itself"):
        load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra="sweep: {seed: [0, 1]}\n"))
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP),
                              ['sweep={optim.lr: [0.01, "0.010"]}'])  # one value twice: one recipe, a false toss-up
    with pytest.raises(ConfigError, match="sweep optim.lr=0.01' and .*sweep optim.lr=0.010' resolve to the same"):
        validate(cfg, plan(cfg), machine=False)
    # a key that a setting of the fine-tunes leaves unread (SGD's momentum under AdamW): its points train one recipe
    # (alone, or beside a key that every stage reads)
    for grid in ("{optim.momentum: [0.8, 0.9]}", "{optim.lr: [0.01, 0.1], optim.momentum: [0.8, 0.9]}"):
        cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP),
                                  [f"sweep={grid}", "overrides=[optim.name=adamw]"])
        with pytest.raises(ConfigError, match=r"the sweep names optim.momentum, which no sweep stage reads \(optim.name="
                                              r"adamw, e.g. stage 'fine-tune .*'\): its points would train the same "
                                              "recipe"):
            validate(cfg, plan(cfg), machine=False)
    # ... where some stages read it (a grid over the optimiser too, or another one for one label fraction): warned
    for mixed in (["sweep={optim.name: [sgd, adamw], optim.momentum: [0.8, 0.9]}"],
                  ["sweep={optim.momentum: [0.8, 0.9]}", "fraction_overrides={1.0: [optim.name=adamw]}"]):
        cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", fractions="[0.5, 1.0]",
                                                 compare_extra=SWEEP), mixed)
        capsys.readouterr()
        validate(cfg, plan(cfg), machine=False)
        assert ("warning: the sweep names optim.momentum, which some sweep stages never read (optim.name=adamw, e.g. "
                "stage 'fine-tune") in capsys.readouterr().err, mixed
    validate(cfg := load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP),
                                        ["sweep={optim.momentum: [0.8, 0.9]}"]), plan(cfg), machine=False)  # SGD's
    # a fine-tune key that the sweep, or finetune_pool: auto, sets after the overrides would reach no stage
    for compare_extra, overrides in ((SWEEP, ["overrides=[finetune.pool=avg]"]),
                                     (SWEEP, ['overrides=["finetune={pool: avg}"]']),  # a section's mapping too
                                     (SWEEP, ["fraction_overrides={0.5: [finetune.pool=avg]}"]),
                                     ("sweep: {finetune.layer_decay: [0.5, 0.75]}\n",
                                      ["overrides=[finetune.layer_decay=0.9]"])):
        with pytest.raises(ConfigError, match=r"sets finetune\.(pool|layer_decay).* sweep"):
            load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=compare_extra), overrides)
    load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP + "finetune_pool: config\n"),
                        ["overrides=[finetune.pool=avg]"])  # there the overrides' pool is every fine-tune's
    for grid in ("{optim.lr: 0.1}", "{optim.lr: []}"):  # a value, not a list; an empty grid, which plans no sweep
        with pytest.raises(ConfigError, match="non-empty lists"):
            load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=f"sweep: {grid}\n"))
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra="sweep: {optim.lrr: [1]}\n"))
    with pytest.raises(ConfigError, match="sweep optim.lrr=1.*unknown config key 'optim.lrr'"):
        validate(cfg, plan(cfg))


def test_fraction_overrides_reach_that_fractions_fine_tunes_alone(tmp_path):
    """`fraction_overrides`: one label fraction's fine-tunes (sweep and final, every arm) take
    settings of their own, after `overrides`; a fraction the comparison does not run, a key it or
    its sweep sets, and a bad stage key fail before any work."""
    extra = "sweep: {optim.lr: [0.01, 0.03]}\nfraction_overrides: {1.0: [steps=5, optim.momentum=0.8]}\n"
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=extra))
    stages = plan(cfg)
    validate(cfg, stages)
    longer = [s for s in stages if "steps=5" in s.overrides]
    assert {s.name for s in longer} == {s.name for s in stages if s.name.startswith("fine-tune")
                                        and "100% labels" in s.name}
    assert {s.arm for s in longer} == {"mpp", "supervised", "scratch"} and any("sweep" in s.name for s in longer)
    assert all(s.overrides.index("steps=5") > s.overrides.index("steps=2") and "optim.momentum=0.8" in s.overrides
               for s in longer)
    # from the command line the fraction arrives as text
    assert load_compare_config(_write_configs(tmp_path, tmp_path / "d"),
                               ["fraction_overrides={0.5: [steps=4]}"]).fraction_overrides == {0.5: ["steps=4"]}
    for bad, match in [("{0.2: [steps=4]}", "label fraction '0.2', which label_fractions \\[0.5, 1.0\\] lacks"),
                       ("{1.0: [seed=4]}", "sets seed for label fraction 1.0"),
                       ("{1.0: [finetune.label_fraction=0.2]}", "sets finetune.label_fraction"),
                       ("{1.0: [5]}", "gives label fraction 1.0 \\[5\\]; give key=value overrides")]:
        with pytest.raises(ConfigError, match=match):
            load_compare_config(_write_configs(tmp_path, tmp_path / "d"), [f"fraction_overrides={bad}"])
    for key, shape in [("sweep", "config keys to non-empty lists of values"),
                       ("fraction_overrides", "label fractions to non-empty lists of key=value overrides")]:
        with pytest.raises(ConfigError, match=f"config key '{key}' must be a mapping of {shape}"):
            load_compare_config(_write_configs(tmp_path, tmp_path / "d"), [f"{key}=5"])
    with pytest.raises(ConfigError, match="sets optim.lr for label fraction 1.0"):
        load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=extra),
                            ["fraction_overrides={1.0: [optim.lr=0.1]}"])
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d"), ["fraction_overrides={1.0: [stepz=4]}"])
    with pytest.raises(ConfigError, match="100% labels.*unknown config key 'stepz'"):
        validate(cfg, plan(cfg))


def test_a_stage_normalising_otherwise_than_its_encoder_fails_before_any_work(tmp_path):
    """A probe or fine-tune whose data.mean/std differ from its encoder's pre-training would stop
    only when it starts, after the pre-training's hours: validation names it first."""
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d"))
    validate(cfg, plan(cfg))
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d"),
                              ["pretrain_overrides=['data.mean=[0.4,0.4,0.4]']"])
    with pytest.raises(ConfigError, match=r"stage 'linear probe mpp'.*data.mean=\[0.5, 0.5, 0.5\].*pre-trained "
                                          r"with data.mean=\[0.4, 0.4, 0.4\]"):
        validate(cfg, plan(cfg))


def test_stages_are_resolved_as_their_tools_run_them_and_checked_for_their_arm(tmp_path):
    """A fine-tune config without `objective:` runs as mpp-finetune runs it (objective=classify),
    so validation and a resume's check see what ran; a pre-training config of the other arm, or
    fine-tunes without test images, fail before any work."""
    import yaml
    path = _write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP)
    plain = yaml.safe_load((ROOT / "configs/synthetic_finetune.yaml").read_text())
    plain.pop("objective", None)
    (tmp_path / "finetune.yaml").write_text(yaml.safe_dump(plain))
    cfg = load_compare_config(path, [f"finetune={tmp_path / 'finetune.yaml'}"])
    stages = plan(cfg)
    validate(cfg, stages)
    ft = next(s for s in stages if s.tool == "finetune")
    assert ft.settings().objective == "classify"
    ft.out.mkdir(parents=True)  # as the tool wrote it: a resume finds its settings unchanged
    (ft.out / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(ft.config, ["objective=classify",
                                                                                      *ft.args()]))))
    check_unchanged(ft)
    saved = yaml.safe_load((ft.out / "config.yaml").read_text())  # the shards' folder spelled as its manifest:
    saved["data"]["train"] = str(Path(saved["data"]["train"]) / "manifest.json")  # the same data, reused
    (ft.out / "config.yaml").write_text(yaml.safe_dump(saved))
    check_unchanged(ft)
    swapped = load_compare_config(path, [f"supervised={ROOT / 'configs/synthetic_mpp.yaml'}"])
    with pytest.raises(ConfigError, match="stage 'pre-train supervised'.*objective=mpp, not supervised"):
        validate(swapped, plan(swapped))
    untested = load_compare_config(path, ["overrides=[data.val=]"])
    with pytest.raises(ConfigError, match="stage '(fine-tune|linear probe) .* has no data.val"):
        validate(untested, plan(untested))
    probe = yaml.safe_load((ROOT / "configs/synthetic_probe.yaml").read_text())  # no test images: it failed
    del probe["data"]["val"]                                                     # only after the pre-trainings
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(probe))
    kept = [o for o in cfg.overrides if not o.startswith("data.val=")]
    untested = load_compare_config(path, [f"probe={tmp_path / 'probe.yaml'}", f"overrides={json.dumps(kept)}"])
    with pytest.raises(ConfigError, match="stage 'linear probe .* has no data.val, the test images its probe is scored"):
        validate(untested, plan(untested))


def test_probes_and_fine_tunes_on_other_test_sets_are_refused_before_any_stage(tmp_path):
    """A probe and fine-tunes scored on different data.val passed every check, ran every stage, and
    then the report refused their gaps (no report): refused before the first stage now, a dry run
    too, as is one label fraction given its own data.val; the same set spelled another way, or a
    shard pattern's count of a manifest's set (a manifest counts its own), are one test set."""
    path = _write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP)
    other = ("stages 'linear probe mpp' and 'fine-tune scratch, 50% labels, seed 0' would be scored on different "
             "test sets")
    for spelled in (f"{tmp_path / 'd/test'}/", f"{tmp_path / 'd/test/manifest.json'}, data.val_num_samples=7"):
        cfg = load_compare_config(path, [f"fraction_overrides={{0.5: [data.val={spelled}]}}"])
        validate(cfg, plan(cfg))
    cfg = load_compare_config(path, [f"fraction_overrides={{0.5: [data.val={tmp_path / 'd2/test'}]}}"])
    with pytest.raises(ConfigError, match=other + r" \(data.val .*/d/test.* and .*/d2/test.*\).*give every probe and "
                                          "fine-tune one data.val"):
        validate(cfg, plan(cfg))
    probe = yaml.safe_load((ROOT / "configs/synthetic_probe.yaml").read_text())
    probe["data"]["val"] = str(tmp_path / "d2/test")  # the audit's: the probe's config tests elsewhere
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(probe))
    kept = [o for o in load_compare_config(path).overrides if not o.startswith("data.val=")]
    cfg = load_compare_config(path, [f"probe={tmp_path / 'probe.yaml'}", f"overrides={json.dumps(kept)}"])
    with pytest.raises(ConfigError, match=other):
        run(cfg, dry_run=True)


def test_a_sweep_override_replaces_the_grid(tmp_path):
    """`sweep=...` on the command line is the whole grid (it was merged into the file's: both keys
    swept; sweep={} could not clear it); `sweep.KEY=...` sets one key's values."""
    path = _write_configs(tmp_path, tmp_path / "d", compare_extra="sweep: {optim.lr: [0.1, 0.3]}\n")
    assert load_compare_config(path, ["sweep={optim.weight_decay: [0, 0.1]}"]).sweep == {
        "optim.weight_decay": [0, 0.1]}
    assert load_compare_config(path, ["sweep={}"]).sweep == {}
    # given twice, the later grid is the grid (a merge of mappings given after their keys kept both)
    assert load_compare_config(path, ["sweep={optim.lr: [0.01]}", "sweep={}"]).sweep == {}
    assert load_compare_config(path, ["fraction_overrides={0.1: [steps=5]}", "fraction_overrides={1.0: [steps=6]}"]
                               ).fraction_overrides == {1.0: ["steps=6"]}
    assert load_compare_config(path, ["sweep.optim.weight_decay=[0]"]).sweep == {
        "optim.lr": [0.1, 0.3], "optim.weight_decay": [0]}


def test_fraction_sweep_gives_one_label_fraction_its_own_grid(tmp_path):
    """`fraction_sweep`: one label fraction's sweep stages (every arm) try that fraction's values of
    the sweep's keys, the others the sweep's; its finals choose among those; a fraction the
    comparison does not run, another set of keys, no sweep, a pool of auto and a grid that is not
    a mapping fail before any work."""
    extra = "sweep: {optim.lr: [0.01, 0.03]}\nfraction_sweep: {1.0: {optim: {lr: [0.03, 0.1, 0.3]}}}\n"
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=extra))
    assert cfg.fraction_sweep == {1.0: {"optim.lr": [0.03, 0.1, 0.3]}} and cfg.sweep_at(0.5) == cfg.sweep
    stages = plan(cfg)
    validate(cfg, stages)
    for arm in ("mpp", "supervised", "scratch"):
        for pct, lrs in (("50pct", {"0.01", "0.03"}), ("100pct", {"0.03", "0.1", "0.3"})):
            swept = [s for s in stages if s.out.parent.name == f"finetune_{arm}_{pct}" and s.out.name.startswith("sweep_")]
            assert {s.out.name for s in swept} == {f"sweep_lr{lr}" for lr in lrs}, (arm, pct)
            assert all(f"optim.lr={s.out.name[len('sweep_lr'):]}" in s.overrides for s in swept)
            for rank, stage in enumerate(sorted(swept, key=lambda s: float(s.out.name[len("sweep_lr"):]))):
                stage.out.mkdir(parents=True)  # the largest rate best on the development split
                (stage.out / "metrics.json").write_text(json.dumps({"top1": 0.3 + 0.1 * rank, "evaluated_on": "dev",
                                                                    "pool": "avg"}))
    for pct, best, second in (("50%", "optim.lr=0.03", "optim.lr=0.01"), ("100%", "optim.lr=0.3", "optim.lr=0.1")):
        for kind, value in (("seed", best), ("runner-up, seed", second)):  # each from its own fraction's grid
            finals = [s for s in stages if s.name.startswith("fine-tune") and f", {pct} labels, {kind}" in s.name]
            assert finals and all(value in s.chosen() for s in finals), (pct, kind)
    # on the command line the grid replaces the file's
    assert load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=extra),
                               ["fraction_sweep={0.5: {optim.lr: [0.02, 0.05]}}"]
                               ).fraction_sweep == {0.5: {"optim.lr": [0.02, 0.05]}}
    for bad, match in [("{0.2: {optim.lr: [0.1]}}", "'fraction_sweep' names label fraction 0.2, which label_fractions"),
                       ("{1.0: {optim.weight_decay: [0, 0.1]}}",
                        "gives label fraction 1 a grid of optim.weight_decay where the sweep has optim.lr"),
                       ("{1.0: {optim.lr: [0.1], finetune.pool: [token, avg]}}", "a grid of finetune.pool, optim.lr"),
                       ("{1.0: [0.1, 0.3]}", "must be a mapping of label fractions to grids of the sweep's keys"),
                       ("{1.0: {optim.lr: 0.1}}", "must be a mapping of label fractions to grids")]:
        with pytest.raises(ConfigError, match=match):
            load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=extra),
                                [f"fraction_sweep={bad}"])
    with pytest.raises(ConfigError, match="where the sweep has none"):
        load_compare_config(_write_configs(tmp_path, tmp_path / "d"), ["fraction_sweep={1.0: {optim.lr: [0.1]}}"])
    with pytest.raises(ConfigError, match="finetune.pool the value auto for label fraction 1"):
        load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=SWEEP),
                            ["sweep={finetune.pool: [token, avg]}", "fraction_sweep={1.0: {finetune.pool: [auto, avg]}}"])
    with pytest.raises(ConfigError, match=r"names label fraction 1 twice \('1.0' and '1'\)"):
        load_compare_config(_write_configs(tmp_path, tmp_path / "d", compare_extra=extra),
                            ['fraction_sweep={"1.0": {optim.lr: [0.1]}, "1": {optim.lr: [0.2]}}'])


def test_a_files_sweep_replaces_its_bases_grid(tmp_path):
    """A compare config's `sweep` is one grid: a file that inherits another (`base:`) and sweeps
    optim.lr sweeps only that, as `sweep=...` on the command line does (it was merged into the
    base's: both keys swept); a file without `sweep` keeps the base's, and sections still merge;
    an emptied `sweep:` is refused, and a label fraction named twice in fraction_overrides."""
    base = _write_configs(tmp_path, tmp_path / "d", compare_extra="sweep: {optim.weight_decay: [0, 0.1]}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: compare.yaml\nsweep: {optim: {lr: [0.1, 0.3]}}\nprepare: {synthetic_test: 20}\n")
    cfg = load_compare_config(child)
    assert cfg.sweep == {"optim.lr": [0.1, 0.3]}
    assert (cfg.prepare.synthetic_test, cfg.prepare.synthetic_train) == (20, 120)
    child.write_text("base: compare.yaml\nseeds: 2\n")
    assert load_compare_config(child).sweep == load_compare_config(base).sweep == {"optim.weight_decay": [0, 0.1]}
    child.write_text("base: compare.yaml\nsweep:\n  # optim.lr: [0.1]\n")  # emptied by comments: it kept the
    with pytest.raises(ConfigError, match="'sweep' must be a mapping"):  # base's grid without a word
        load_compare_config(child)
    with pytest.raises(ConfigError, match=r"names label fraction 0.5 twice \('0.5' and '0.50'\)"):  # one was dropped
        load_compare_config(base, ['fraction_overrides={0.5: [steps=6], "0.50": [steps=8]}'])


def test_bad_stage_key_fails_before_any_work(tmp_path):
    path = _write_configs(tmp_path, tmp_path / "data", stage_extra=", mpp.ratioo=0.3")
    cfg = load_compare_config(path)
    with pytest.raises(ConfigError, match="pre-train mpp.*unknown config key 'mpp.ratioo'"):
        validate(cfg, plan(cfg))
    r = run_tool("compare", "--config", path, cwd=tmp_path)
    assert r.returncode != 0 and "mpp.ratioo" in r.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()  # nothing started


def test_what_would_stop_a_stage_hours_in_fails_before_any_work(tmp_path, capsys):
    """A config audit's list: what a trainer, the sweep or the figures would refuse only when its
    stage starts (after both pre-trainings, for a fine-tune) is refused before the first stage."""
    path = _write_configs(tmp_path, tmp_path / "d")

    def refused(match, *overrides, compare=False):
        with pytest.raises(ConfigError, match=match):
            cfg = load_compare_config(path, list(overrides))
            if not compare:
                validate(cfg, plan(cfg))

    (tmp_path / "mpp64.yaml").write_text(f"base: {ROOT / 'configs/synthetic_mpp.yaml'}\nimg_size: 64\n")
    refused("fine-tune scratch, 50% labels.*would both write to", "label_fractions=[0.5,0.5]")
    refused("would both write to .*sweep_lr0.01", "sweep.optim.lr=[0.01,1.0e-2]")
    refused("'sweep' names mpp.ratio, which no fine-tune", "sweep.mpp.ratio=[0.3,0.5]", compare=True)
    refused("'sweep' names train.log_every", "sweep.train.log_every=[1,2]", compare=True)
    refused("'overrides' sets finetune.init, seed, which the comparison sets itself",
            "overrides=[seed=3,finetune.init=x]", compare=True)
    refused("'overrides' sets finetune.init, which the comparison sets itself", 'overrides=["finetune={init: x}"]',
            compare=True)
    refused("'launcher' names 'torchrn', which is no command on PATH", "launcher=torchrn")
    refused("'launcher' .* does not split into words", f"launcher={sys.executable} '--x")
    refused("'pretrain_overrides' sets seed, which the repeats would ignore",
            "pretrain_overrides=[seed=1]", "pretrain_seeds=2", compare=True)
    refused("'sweep' gives finetune.pool the value auto", "sweep={optim.lr: [0.01], finetune.pool: [token, auto]}",
            compare=True)
    refused("prepare.synthetic_train and prepare.synthetic_test must be >= 0", "prepare.synthetic_train=-5",
            compare=True)
    refused("'overrides' did not read as a YAML list .*quote each item", "overrides=[data.val=d/{0..1}.tar]")
    refused("'pretrain_overrides' did not read as a YAML list .*quote each item",
            "pretrain_overrides=[data.val=d/{0..1}.tar]")
    refused("fine-tune scratch, 50% labels.*: set the run length", "fraction_overrides={0.5: [steps=0]}")
    refused("fine-tune scratch, 50% labels.*batch_size=32 is not divisible by processes x train.grad_accum = 1 x 3",
            "fraction_overrides={0.5: [train.grad_accum=3]}")
    refused("pre-train mpp.*batch_size=32 is not divisible by processes x train.grad_accum = 6 x 1",
            f"launcher={sys.executable} -m torch.distributed.run --nnodes=2 --nproc_per_node 3")
    refused("pre-train mpp.*batch_size=32 is not divisible by processes x train.grad_accum = 5 x 1",
            f"launcher={sys.executable} -m accelerate.commands.launch --num_machines 2 --num-processes=5")
    refused("fine-tune scratch, 50% labels.*builds model=vit_mini8_32, but 'pre-train mpp' pre-trains "
            "model=vit_micro4_32", "fraction_overrides={0.5: [model=vit_mini8_32]}")
    refused("linear probe scratch.*builds model=vit_micro4_32, but 'pre-train mpp' pre-trains model=vit_mini8_32",
            "pretrain_overrides=[model=vit_mini8_32]")  # both pre-trainings one way, the scratch arm another
    refused("linear probe scratch.*builds its encoder at 32 px, but 'pre-train mpp' pre-trains at 64 px",
            "pretrain_overrides=[img_size=64]")  # the pre-trained arms' stages keep 64 px: scratch alone at 32
    refused("pre-train supervised.*builds its encoder at 32 px, but 'pre-train mpp' pre-trains at 64 px",
            f"mpp={tmp_path / 'mpp64.yaml'}")  # the two pre-trainings at two sizes
    if not __import__("torch").cuda.is_available():
        refused("pre-train mpp.*fp16 needs a GPU", "pretrain_overrides=[train.precision=fp16]")
    # a dry run plans for any machine: a command or a GPU this one lacks is no error there
    run(load_compare_config(path, ["launcher=torchrn", "pretrain_overrides=[train.precision=fp16]"]), dry_run=True)
    assert "torchrn -m mpp.tools.pretrain" in capsys.readouterr().out
    capsys.readouterr()
    short = ["pretrain_overrides=[optim.warmup_steps=1]", "fraction_overrides.0.5=[optim.warmup_steps=1]"]
    for last, warned in (("1", ""), ("2", "warning: stage 'fine-tune scratch, 100% labels, seed 0': optim.warmup_steps"
                                          "=2 is not below the run's 2 steps: the learning rate rises to 0.015, not "
                                          "optim.lr=0.03, and never decays; give fewer warmup steps "
                                          "(pretrain_overrides or fraction_overrides reach only the stages that "
                                          "train")):
        cfg = load_compare_config(path, short + [f"fraction_overrides.1.0=[optim.warmup_steps={last}]"])
        validate(cfg, plan(cfg))  # a warmup as long as the run is warned about, not refused
        err = capsys.readouterr().err
        assert (warned in err) if warned else "optim.warmup_steps" not in err, err


def test_data_a_stage_reads_is_checked_once_made(tmp_path):
    """After the data are made, before the first stage: a missing test set or few-shot set, a
    pattern without its count, a label
    subset too small for its development split (withheld by a pre-training, or drawn by a fine-tune)
    and a stage that would learn from test images fail, naming the stage."""
    from mpp.compare import check_data, prepare_data
    from mpp.data.decode import DataError
    path = _write_configs(tmp_path, tmp_path / "d")
    cfg = load_compare_config(path)
    prepare_data(cfg)
    stages = plan(cfg)
    check_data(stages, validate(cfg, stages))  # the shipped way: fine

    def tested_on(val: str) -> str:  # every stage's data.val (probes and fine-tunes share one test set)
        kept = [o for o in load_compare_config(path).overrides if not o.startswith("data.val=")]
        return f"overrides={json.dumps(kept + [f'data.val={val}'])}"
    for overrides, match in (
            (["pretrain_overrides=[data.val=/nowhere/manifest.json]"],
             "pre-train mpp.*'/nowhere/manifest.json' does not exist"),
            ([f"pretrain_overrides=[fewshot.every=2,fewshot.train=/nowhere/fs.json,"
              f"fewshot.test={tmp_path}/d/test/manifest.json]"],
             "pre-train mpp.*'/nowhere/fs.json' does not exist"),  # the few-shot sets a pre-training watches
            ([tested_on(f"{tmp_path}/d/test/{{000000..000001}}.tar"),
              f"pretrain_overrides=[data.val={tmp_path}/d/test/manifest.json]"],
             "linear probe mpp.*not a manifest.json: give its total sample count"),
            (["label_fractions=[0.02]", "sweep.optim.lr=[0.1,0.2]", "dev_fraction=0.5"],
             "pre-train mpp.*would take them all"),  # the splits it withholds cannot be drawn
            (["label_fractions=[0.02]", "sweep.optim.lr=[0.1,0.2]", "dev_fraction=0.5",
              'pretrain_overrides=["data.withhold=[]"]'],
             "fine-tune scratch, 2% labels, sweep.*would take them all")):
        cfg = load_compare_config(path, overrides)
        stages = plan(cfg)
        resolved = validate(cfg, stages)
        with pytest.raises(DataError, match=match):
            check_data(stages, resolved)
    shards = sorted((tmp_path / "d/train").glob("*.tar"))  # the fine-tunes' shards by a pattern: none withheld
    cfg = load_compare_config(path, [f'pretrain_overrides=["data.train={tmp_path}/d/train/{{000000..'
                                     f'{len(shards) - 1:06d}}}.tar",data.num_samples=120]'])
    stages = plan(cfg)
    with pytest.raises(DataError, match="pre-train mpp.*the shards of .*under another name.*name both data the same"):
        check_data(stages, validate(cfg, stages))
    for overrides, learner in (  # a stage that learns from test images: the report's test figures were not
            ([f"pretrain_overrides=[data.train={tmp_path}/d/test/manifest.json]"], "pre-train mpp"),
            ([tested_on(f"{tmp_path}/d/train")], "pre-train mpp")):
        cfg = load_compare_config(path, overrides)
        stages = plan(cfg)
        with pytest.raises(DataError, match=f"stage '{learner}.*learns from data.train .*which holds test images of "
                                            "stage 'fine-tune"):
            check_data(stages, validate(cfg, stages))
    other = tmp_path / "other"  # the test images under another class order: a typo for another data set
    shutil.copytree(tmp_path / "d/test", other)
    m = json.loads((other / "manifest.json").read_text())
    m["classes"] = m["classes"][::-1]
    (other / "manifest.json").write_text(json.dumps(m))
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", stage_extra=f", data.val={other}"))
    stages = plan(cfg)
    with pytest.raises(DataError, match=f"linear probe mpp.*data.val '{other}' has other classes than data.train"):
        check_data(stages, validate(cfg, stages))  # each stage refused it at its start: after the pre-trainings
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "d", stage_extra=", 'probe.dev_split=[0,0.999]'"),
                              ['pretrain_overrides=["data.withhold=[]"]'])  # a probe's split that cannot be drawn
    stages = plan(cfg)
    with pytest.raises(DataError, match="linear probe mpp.*would take them all"):
        check_data(stages, validate(cfg, stages))
    cfg = load_compare_config(path, ["pretrain_overrides=[fewshot.every=2,fewshot.train=]"])
    with pytest.raises(ConfigError, match="pre-train mpp.*'fewshot.every' > 0 needs labeled shards"):
        validate(cfg, plan(cfg))  # no few-shot set at all: refused with the stage's settings, earlier still


def test_compare_config_errors_are_one_line(tmp_path):
    (tmp_path / "c.yaml").write_text("mpp: a.yaml\nsupervised: b.yaml\nfinetune: c.yaml\nprobe: d.yaml\n"
                                     "label_fractions: [0, 1]\n")
    with pytest.raises(ConfigError, match="label_fractions"):
        load_compare_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="unknown config key 'steps'.*valid keys: output_dir"):
        load_compare_config(tmp_path / "c.yaml", ["steps=3"])


def test_a_stage_config_missing_from_the_current_directory_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped compare configs name their stages from the project root
    with pytest.raises(ConfigError, match=f"'configs/x.yaml' does not exist \\(relative to the current "
                                          f"directory, {tmp_path}\\)"):
        load_config("configs/x.yaml")
    with pytest.raises(ConfigError, match="'/nowhere/x.yaml' does not exist; see configs/"):  # absolute: no hint
        load_config("/nowhere/x.yaml")


@pytest.mark.slow
def test_end_to_end_then_resume_skips_finished_stages(tmp_path):
    path = _write_configs(tmp_path, tmp_path / "data", fractions="[0.5]",  # 17-23 stages: seconds each
                          compare_extra="sweep: {optim.lr: [0.01, 0.1]}\nseeds: 2\ndev_fraction: 0.25\n")
    cmd = [sys.executable, str(ROOT / "tools/compare.py"), "--config", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = tmp_path / "runs"
    # each trained stage's time split as its metrics.json times it (a probe's: its wall time alone)
    line = re.search(r"fine-tune mpp, 50% labels, seed 1: finished in ([\d.]+) s \(set-up ([\d.]+), begin ([\d.]+), "
                     r"training loop ([\d.]+), final evaluation ([\d.]+), export ([\d.]+), "
                     r"process start and exit ([\d.]+) s\)",
                     r.stdout)
    assert line, r.stdout[-3000:]
    took, *parts = map(float, line.groups())
    assert abs(sum(parts) - took) <= 0.3 and min(parts) >= 0, line[0]
    assert json.loads((runs / "finetune_mpp_50pct/seed1/metrics.json").read_text())["final_eval_s"] > 0  # scored test
    assert re.search(r"linear probe mpp: finished in [\d.]+ s\n", r.stdout), r.stdout[-3000:]
    tooks = [float(t) for t in re.findall(r"finished in ([\d.]+) s \(set-up", r.stdout)]  # and their sum
    summed = re.search(r"the (\d+) stages trained now took ([\d.]+) s \(set-up ([\d.]+), begin ([\d.]+), training loop",
                       r.stdout)
    assert summed and int(summed[1]) == len(tooks) > 0 and abs(float(summed[2]) - sum(tooks)) <= 0.05 * len(tooks)
    # both pre-trainings trained on all the fine-tunes' training images but the development splits
    # (the 50%-label cells' and the probes' split of all the labels)
    rest = make_loader(str(tmp_path / "data" / "train"), batch_size=1, img_size=32, train=False, labeled=True,
                       withhold=[(0.5, 0, 0.25), (1.0, 0, 0.25)]).num_samples
    dev = 120 - rest
    assert [json.loads((runs / f"pretrain_{k}" / "metrics.json").read_text())["train_samples"]
            for k in ("mpp", "supervised")] == [rest] * 2 and dev > make_loader(
        str(tmp_path / "data" / "train"), batch_size=1, img_size=32, train=False, labeled=True,
        subset=(0.5, 0, 0.25, True)).num_samples
    report = json.loads((runs / "report.json").read_text())
    md = (runs / "report.md").read_text()
    assert md.count(f" steps on {120 - dev} images)") == 2  # the table says what each pre-training read
    assert "MPP" in md and "share" in md and (runs / "report.png").stat().st_size > 0
    assert "](figures/attention_distance.png)" in md and (runs / "figures/attention_distance.png").is_file()
    stages = plan(load_compare_config(path))
    for stage in stages:  # every stage ran, a runner-up's finals exactly where its cell's choice was a toss-up
        assert (stage.out / "metrics.json").is_file() == (stage.when is None or stage.when.holds()), stage.name
    assert sorted(report["plan"]) == sorted(str(s.out.relative_to(runs)) for s in stages  # what it reported
                                            if (s.out / "metrics.json").is_file())
    ran = [s for s in stages if (s.out / "metrics.json").is_file()]
    ft = json.loads((runs / "finetune_mpp_50pct" / "seed1" / "metrics.json").read_text())
    assert 0.0 <= ft["top1"] <= 1.0 and ft["label_fraction"] == 0.5 and ft["evaluated_on"] == "val"
    assert ft["seed"] == 1 and ft["dev_fraction"] == 0
    sweep = [json.loads((runs / "finetune_mpp_50pct" / f"sweep_lr{lr}" / "metrics.json").read_text())
             for lr in (0.01, 0.1)]
    assert ft["pool"] == sweep[0]["pool"] == sweep[1]["pool"] in ("token", "avg")  # one choice for the cell
    assert all(m["evaluated_on"] == "dev" and m["train_samples"] < ft["train_samples"] for m in sweep)
    best = 0.01 if sweep[0]["top1"] >= sweep[1]["top1"] else 0.1
    assert ft["lr"] == best and report["recipes"]["mpp"]["0.5"]["chosen"]["optim.lr"] == best
    for arm in ("scratch", "mpp", "supervised"):  # a toss-up's runner-up is listed, and is no table cell
        recipe = report["recipes"][arm]["0.5"]
        chosen, pool = recipe["chosen"]["optim.lr"], recipe["chosen"]["finetune.pool"]
        tossed = (recipe["lead"] or {}).get("clear") is False
        again = [x for x in recipe["retrained"] if x["kind"] == "value"]
        assert [x["values"]["optim.lr"] for x in again] == ([0.1 if chosen == 0.01 else 0.01] if tossed else [])
        other = [x["values"]["finetune.pool"] for x in recipe["retrained"] if x["kind"] == "pool"]  # the same for
        assert other == ([{"token": "avg", "avg": "token"}[pool]]  # the representation
                         if arm in report["derived"]["finetune"]["0.5"]["pool_toss_ups"] else [])
        assert report["table"][arm]["finetune_n"]["0.5"] == 2
    # the derived figures are computed from the fine-tunes' own metrics: means over the seeds
    tops = {init: sum(json.loads((runs / f"finetune_{init}_50pct" / f"seed{s}" / "metrics.json").read_text())["top1"]
                      for s in (0, 1)) * 50 for init in ("mpp", "scratch", "supervised")}
    assert report["table"]["mpp"]["finetune_n"]["0.5"] == 2
    gap = report["derived"]["finetune"]["0.5"]
    assert gap["mpp_minus_scratch"] == pytest.approx(tops["mpp"] - tops["scratch"], abs=0.06)
    assert gap["supervised_minus_mpp"] == pytest.approx(tops["supervised"] - tops["mpp"], abs=0.06)
    # and the probe's from the probes', the random-init one as its scratch baseline
    probes = {kind: json.loads((runs / f"probe_{kind}" / "metrics.json").read_text())["top1"] * 100
              for kind in ("mpp", "scratch")}
    assert report["derived"]["linear_top1"]["mpp_minus_scratch"] == pytest.approx(
        probes["mpp"] - probes["scratch"], abs=0.06)
    # every probe and fine-tune scored the same test images in the same order: each gap has its test noise
    assert all(v is not None for g in (report["derived"]["linear_top1"], gap) for v in g["noise_test"].values())

    def files():  # every file of the stages and figures; the report itself is rewritten on purpose
        return {f: f.stat().st_mtime_ns for f in runs.rglob("*") if f.is_file() and f.parent != runs}
    before = files()
    again = ("compare", "--config", path)  # in this process from here: a tool's own process takes seconds of imports
    r2 = run_tool(*again, cwd=tmp_path)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert r2.stdout.count("done earlier") == len(ran) and r2.stdout.count("not needed") == len(stages) - len(ran)
    assert files() == before  # nothing re-trained, re-probed or redrawn
    # settings changed since: the finished stage they touch is an error, not a silently reused result
    r3 = run_tool(*again, "pretrain_overrides=[steps=3]", cwd=tmp_path)
    assert r3.returncode != 0 and _one_error(r3.stderr), r3.stderr[-2000:]  # one line: no traceback
    assert "stage 'pre-train mpp' finished earlier" in r3.stderr and "steps: 2 -> 3" in r3.stderr, r3.stderr
    assert files() == before
    # a stage deleted to run it again: the finished stages whose choices read it are checked once it ran
    (runs / "probe_mpp" / "metrics.json").unlink()
    r4 = run_tool(*again, cwd=tmp_path)
    assert r4.returncode == 0 and "linear probe mpp -> " in r4.stdout, r4.stderr[-2000:]
    assert r4.stdout.count("done earlier") == len(ran) - 1
    # each probe and fine-tune records the encoder file it started from (none: a random init) ...
    encoder = runs / "pretrain_mpp" / "encoder.safetensors"
    digest = hashlib.sha256(encoder.read_bytes()).hexdigest()
    assert json.loads((runs / "probe_mpp" / "metrics.json").read_text())["encoder_sha256"] == digest
    assert ft["init_sha256"] == digest
    assert json.loads((runs / "finetune_scratch_50pct" / "seed0" / "metrics.json").read_text())["init_sha256"] is None
    # ... so that the stages of an encoder trained again since are not reported as the new one's
    from safetensors.torch import load_file, save_file
    weights = load_file(str(encoder))
    save_file({k: v + 1 for k, v in weights.items()}, str(encoder))
    before = files()
    r5 = run_tool(*again, cwd=tmp_path)
    assert r5.returncode != 0 and _one_error(r5.stderr), r5.stderr[-2000:]
    assert f"stage 'linear probe mpp' finished earlier in {runs / 'probe_mpp'} from another encoder" in r5.stderr
    assert files() == before


def test_stage_runs_in_its_own_process_with_the_code_already_imported(tmp_path, monkeypatch):
    """Without a launcher a stage is forked from a server that imported mpp.train once (no import
    cost per stage), still as a process of its own running the tool module with its argv and exit
    code; with a launcher it is a plain new process (`LAUNCHER -m module ...`)."""
    import json
    import os

    from mpp.compare import run_stage
    script, out = tmp_path / "stage_tool.py", tmp_path / "out.json"
    monkeypatch.syspath_prepend(str(tmp_path))  # the forked stage gets this process's sys.path
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{ROOT}")  # the launched one, its environment's
    script.write_text("import json, os, signal, sys\n"
                      "json.dump({'pid': os.getpid(), 'argv': sys.argv[1:], 'name': __name__,\n"
                      "           'preloaded': 'mpp.train' in sys.modules,\n"
                      "           'sigterm': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL},\n"
                      "          open(sys.argv[1], 'w'))\n"
                      "sys.exit(3)\n")
    for launcher, preloaded in (("", True), (sys.executable, False)):
        assert run_stage([sys.executable, "-m", "stage_tool", str(out), "x=1"], launcher) == 3
        got = json.loads(out.read_text())
        # SIGTERM ends the stage: the server ignores it, and a stage that kept that ignored a SIGTERM
        # outside its training loop (set-up, a probe stage) and the comparison waited on
        assert got == {"pid": got["pid"], "argv": [str(out), "x=1"], "name": "__main__", "preloaded": preloaded,
                       "sigterm": True}
        assert got["pid"] != os.getpid()


def test_data_cut_off_mid_write_is_written_again(tmp_path):
    """A comparison stopped while it wrote its data leaves shards without a manifest: the next run
    writes them again instead of refusing the non-empty folder."""
    from mpp.compare import prepare_data
    cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "data"))
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train" / "000000.tar").write_bytes(b"\0" * 1024)  # the first shard, cut off
    prepare_data(cfg)
    for split, n in (("train", 120), ("test", 40)):
        assert json.loads((tmp_path / "data" / split / "manifest.json").read_text())["num_samples"] == n


@pytest.mark.parametrize("text", ["[1]", '"made"', '{"made": [1]}', '{"made": "src"}', "{", "\\xff"])
def test_shards_out_of_a_manifest_not_ours_are_left_to_the_stages_check_not_a_crash(tmp_path, text):
    """A shards_out manifest that is not an object with a `made` object (a list, a string, not JSON)
    keeps no source: prepare_data leaves it to check_data's one-line refusal, not a traceback."""
    from mpp.compare.prepare import _made
    (tmp_path / "manifest.json").write_text(text)
    assert _made(tmp_path / "manifest.json") == {}
    path = _write_configs(tmp_path, tmp_path / "d")
    prepare_data(load_compare_config(path, [f"prepare.shards_out=[{tmp_path}]", f"prepare.shards_src=[{tmp_path}]",
                                            "prepare.synthetic=''"]))


def test_shards_cut_off_mid_write_are_written_again_and_made_ones_kept_whatever_src_names(tmp_path):
    """Shards stopped before their manifest are written again, not refused as a non-empty folder;
    once made, a shards_src that names no folder here (a config of another machine) reuses them."""
    from PIL import Image
    (tmp_path / "src/cat").mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 9, 9)).save(tmp_path / "src/cat/0.png")
    (tmp_path / "out").mkdir()
    (tmp_path / "out/000000.tar").write_bytes(b"\0" * 1024)  # the first shard, cut off
    path = _write_configs(tmp_path, tmp_path / "d")
    shards = [f"prepare.shards_out=[{tmp_path / 'out'}]", "prepare.synthetic=''"]
    prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'src'}]"]))
    manifest = tmp_path / "out/manifest.json"
    assert json.loads(manifest.read_text())["num_samples"] == 1
    made = manifest.read_bytes()
    prepare_data(load_compare_config(path, [*shards, f"prepare.shards_src=[{tmp_path / 'elsewhere'}]"]))
    assert manifest.read_bytes() == made


def test_ctrl_c_says_which_stage_it_stopped_in_one_line(tmp_path):
    """Ctrl-C reaches the comparison and its stage (the terminal's process group): one line that
    names the stage and how to resume, no tracebacks."""
    import signal
    import time
    path = _write_configs(tmp_path, tmp_path / "data", compare_extra="pretrain_overrides: [steps=100000]\n")
    proc = subprocess.Popen([sys.executable, "-m", "mpp.tools.compare", "--config", str(path)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal,
    deadline = time.time() + 120  # even where pytest itself runs with Ctrl-C ignored (nohup, a shell's `&`)
    while not (tmp_path / "runs/pretrain_mpp/tensorboard").is_dir() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err  # as every tool's Ctrl-C
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # the stage's own bare line: none
    assert len(errors) == 1, err
    assert errors[0].startswith("error: interrupted during stage 'pre-train mpp'; run the same")


FAKE_LAUNCHER = """import signal, subprocess, sys, time
if sys.argv[2] == "passes":
    signal.signal(signal.SIGTERM, lambda *_: (rank.terminate(), sys.exit(143)))
# no death signal: a plain child, which writes its pid once its own SIGTERM handling is set
rank = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\\n"
                         "if sys.argv[2] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                         "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)", *sys.argv[1:]])
rank.wait()
"""


@pytest.mark.parametrize("launcher", ["passes", "dies", "stubborn"])
def test_a_stopped_comparison_lets_its_launcher_stop_its_ranks(tmp_path, monkeypatch, launcher):
    """Ctrl-C to the comparison alone (kill -INT) SIGKILLed a stage's launcher at once, and a rank
    that does not die with it (accelerate's one-process launch) trained on, orphaned. The launcher
    now gets SIGTERM, which it passes on to its ranks ('passes'); a rank it leaves behind (a
    launcher that dies of it, as accelerate's before 1.x) gets it too, and SIGKILL STOP_GRACE_S
    later where it ignores SIGTERM ('stubborn')."""
    import contextlib
    import signal
    import threading
    import time

    import psutil

    import mpp.compare.stages
    from mpp.compare import run_stage
    (tmp_path / "launcher.py").write_text(FAKE_LAUNCHER)
    pid_file = tmp_path / "rank.pid"
    real, ended = mpp.compare.stages._stop, []  # patched where run_stage calls it; no terminal's Ctrl-C to wait for
    monkeypatch.setattr(mpp.compare.stages, "_stop",
                        lambda proc: (real(proc, first=0.5), ended.append(proc.returncode)))
    monkeypatch.setattr(mpp.compare.stages, "STOP_GRACE_S", 2.0)

    def interrupt(*_):
        raise KeyboardInterrupt

    def when_started():  # the rank and the launcher's handler exist: then the comparison is stopped
        deadline = time.time() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGALRM)
    old = signal.signal(signal.SIGALRM, interrupt)
    threading.Thread(target=when_started, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_stage([sys.executable, str(tmp_path / "launcher.py"), str(pid_file), launcher], launcher="fake")
    finally:
        signal.signal(signal.SIGALRM, old)
    rank, deadline = int(pid_file.read_text()), time.time() + 5  # a SIGKILL's end is not instant
    try:
        with contextlib.suppress(psutil.NoSuchProcess):
            while psutil.Process(rank).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
                time.sleep(0.05)
            assert psutil.Process(rank).status() == psutil.STATUS_ZOMBIE  # ended, not yet reaped by init
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(rank).kill()
    # the launcher ended on the SIGTERM it was sent (its own exit, or the signal's), not on the last SIGKILL
    assert ended == [143 if launcher == "passes" else -signal.SIGTERM]


LAUNCHER = """import signal, subprocess, sys
stage = subprocess.Popen([sys.executable, *sys.argv[1:]])
signal.signal(signal.SIGTERM, lambda *a: stage.send_signal(signal.SIGTERM))
sys.exit(1 if stage.wait() else 0)  # as torchrun: 1 for a rank's 143
"""


@pytest.mark.parametrize("group, launcher", [(False, False), (True, False), (False, True)],
                         ids=["comparison", "process-group", "launcher"])
def test_sigterm_to_the_comparison_lets_its_stage_save_a_checkpoint(tmp_path, group, launcher):
    """SIGTERM to the comparison alone (`kill`) or to its whole process group (a scheduler's) mid
    pre-training: the stage's trainer saves its step as a checkpoint, and the comparison stops with
    one line naming the stage (exit 143); the stage's run directory is left unlocked for the
    resume. The group's SIGTERM also ended Python's forkserver: the comparison read the stage as
    ended (exit 255) and took it down before its checkpoint. Under a launcher that exits 1 for it
    (torchrun) the line said only that, as if the checkpoint were lost: it names the one saved."""
    import signal
    import time
    extra = "pretrain_overrides: [steps=100000]\n"
    if launcher:
        (tmp_path / "launcher.py").write_text(LAUNCHER)
        extra += f"launcher: {sys.executable} {tmp_path / 'launcher.py'}\n"
    path = _write_configs(tmp_path, tmp_path / "data", compare_extra=extra)
    proc = subprocess.Popen([sys.executable, "-m", "mpp.tools.compare", "--config", str(path)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=group)
    deadline = time.time() + 120
    while not (tmp_path / "runs/pretrain_mpp/config.yaml").is_file() and time.time() < deadline:
        time.sleep(0.2)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    saved = sorted((tmp_path / "runs/pretrain_mpp/checkpoints").glob("step_*"))
    said = (f"which ended with exit 1 (its launcher's), having saved {saved[-1].name};" if launcher
            else "which saved its")
    assert saved and err.strip().splitlines()[-1].startswith(f"error: SIGTERM during stage 'pre-train mpp', {said}")
    assert not (tmp_path / "runs/pretrain_mpp/.lock").exists()


def test_a_lone_sigint_to_the_comparison_lets_its_stage_save_a_checkpoint(tmp_path):
    """A SIGINT to the comparison alone (kill -INT, an IDE's stop button; not a terminal's Ctrl-C,
    which reaches the stage too) left the stage training 30 s, then killed it with SIGKILL: no
    checkpoint of the step it reached. The stage now gets SIGTERM after 5 s, as a launcher's does,
    and its trainer saves."""
    import signal
    import time
    path = _write_configs(tmp_path, tmp_path / "data", compare_extra="pretrain_overrides: [steps=100000]\n")
    proc = subprocess.Popen([sys.executable, "-m", "mpp.tools.compare", "--config", str(path)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "runs/pretrain_mpp/config.yaml").is_file() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    start = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert time.time() - start < 25, err[-3000:]
    assert proc.returncode == 130 and "saved its checkpoint" in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted during stage 'pre-train mpp'"), err[-3000:]
    assert list((tmp_path / "runs/pretrain_mpp/checkpoints").glob("step_*"))


def test_a_stage_dies_with_the_comparison(tmp_path):
    """A stage is the forkserver's child, not the comparison's: a kill -9 of the comparison must
    still end it (it trained on, orphaned, holding its run directory against the next run); so
    must it end a stage started by a `launcher:` (torchrun stops its ranks on the SIGTERM)."""
    import signal
    import time

    import psutil
    (tmp_path / "sleeper.py").write_text("import os, sys, time\n"
                                         "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                                         "time.sleep(120)\n")
    for launcher in ("", sys.executable):  # forked from the server; started by a launcher
        pid_file = tmp_path / f"stage{len(launcher)}.pid"
        comparison = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mpp.compare import run_stage\n"
                                   "run_stage([sys.executable, '-m', 'sleeper', sys.argv[1]], sys.argv[2])",
             str(pid_file), launcher], env={**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}, cwd=tmp_path)
        deadline = time.time() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        stage = psutil.Process(int(pid_file.read_text()))
        comparison.send_signal(signal.SIGKILL)
        comparison.wait()
        gone, alive = psutil.wait_procs([stage], timeout=20)
        for p in alive:
            p.kill()
        assert not alive, f"the stage outlived the comparison (launcher {launcher!r})"


def test_a_chosen_head_l2_reaches_the_finals_to_the_last_digit(tmp_path):
    """An L2 off the decades (a grid of the user's) is passed on as the float the sweep stage
    chose, not a rounding of it; a stage that fitted no head for that representation passes none."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "metrics.json").write_text(json.dumps({"top1": 0.5, "evaluated_on": "dev", "pool": "avg",
                                                  "pool_head_l2": {"avg": 1 / 30000}}))
    assert load_config(None, head_l2([out]) + ["finetune.head_init=probe"]).finetune.head_l2 == 1 / 30000
    (out / "metrics.json").write_text(json.dumps({"top1": 0.5, "evaluated_on": "dev", "pool": "avg"}))
    assert head_l2([out]) == [] and head_l2([out], pool="token") == []
    # a fixed pool's record (head_probe_l2) is that pool's L2: none for the other representation
    (out / "metrics.json").write_text(json.dumps({"top1": 0.5, "evaluated_on": "dev", "pool": "avg",
                                                  "head_probe_l2": 1e-4}))
    assert head_l2([out]) == ["finetune.head_l2=0.0001"] and head_l2([out], pool="token") == []
    # a zero head with finetune.pool=auto: the probe chose the representation only, and the finals,
    # whose config refuses a head L2 without head_init=probe, get none
    (out / "metrics.json").write_text(json.dumps({"top1": 0.5, "evaluated_on": "dev", "pool": "avg",
                                                  "head_init": "zero", "pool_head_l2": {"avg": 1e-4, "token": 1e-3}}))
    assert head_l2([out]) == [] and head_l2([out], pool="token") == []


def test_an_exact_tie_is_broken_alike_by_the_comparison_and_the_report(tmp_path):
    """A descending grid whose two values score the same on the development split: the value the
    comparison retrains (its finals, in seed*) is the report's cell, the other its runner-up."""
    import yaml

    from mpp.compare.planning import grid_points, toss_up
    from mpp.report import write_report
    points, labels = grid_points({"optim.lr": [0.03, 0.003]}), np.arange(500) % 10
    outs = []
    for point, hits in zip(points, (np.arange(500) < 230, np.arange(500) >= 270)):  # 230 right each
        out = tmp_path / "finetune_scratch_10pct" / f"sweep_lr{point[0].split('=')[1]}"
        out.mkdir(parents=True)
        cfg = {"objective": "classify", "optim": {"lr": float(point[0].split("=")[1])},
               "finetune": {"init": "none", "label_fraction": 0.1, "dev_fraction": 0.1}}
        (out / "config.yaml").write_text(yaml.safe_dump(cfg))
        (out / "metrics.json").write_text(json.dumps({"top1": hits.mean(), "evaluated_on": "dev",
                                                      "outcomes": outcomes.record(hits, labels)}))
        outs.append(out)
    chosen, second = best_point(points, outs), best_point(points, outs, rank=1)
    assert toss_up(outs) and {chosen[0], second[0]} == {"optim.lr=0.03", "optim.lr=0.003"}
    for name, point, top1 in (("seed0", chosen, 0.40), ("seed1", chosen, 0.42),
                              ("runner_up_seed0", second, 0.30), ("runner_up_seed1", second, 0.31)):
        out = tmp_path / "finetune_scratch_10pct" / name
        out.mkdir()
        cfg = {"objective": "classify", "seed": int(name[-1]), "optim": {"lr": float(point[0].split("=")[1])},
               "finetune": {"init": "none", "label_fraction": 0.1}}
        (out / "config.yaml").write_text(yaml.safe_dump(cfg))
        (out / "metrics.json").write_text(json.dumps({"top1": top1, "evaluated_on": "val"}))
    for order in (1, -1):  # whatever order the runs are passed in
        runs = sorted((tmp_path / "finetune_scratch_10pct").iterdir())[::order]
        recipe = write_report(runs, tmp_path)["recipes"]["scratch"]["0.1"]
        assert recipe["chosen"]["optim.lr"] == float(chosen[0].split("=")[1])
        assert [r["values"]["optim.lr"] for r in recipe["retrained"]] == [float(second[0].split("=")[1])]


def test_a_finished_stage_is_compared_through_the_schema_and_its_paths(tmp_path, monkeypatch):
    """A stage written by an mpp before a key existed (it ran with that key's default), resumed with
    output_dir spelled relative where it was absolute, ran with the settings planned now; a
    changed setting did not."""
    import yaml
    stage = plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data")))[0]
    saved = to_dict(load_config(stage.config, stage.args()))
    del saved["data"]["cache_mb"]
    stage.out.mkdir(parents=True)
    (stage.out / "config.yaml").write_text(yaml.safe_dump(saved))
    monkeypatch.chdir(tmp_path)
    again = plan(load_compare_config(tmp_path / "compare.yaml", ["output_dir=runs"]))[0]
    assert again.out != stage.out and again.out.resolve() == stage.out.resolve()
    check_unchanged(again)
    (stage.out / "config.yaml").write_text(yaml.safe_dump({**saved, "steps": saved["steps"] + 1}))
    with pytest.raises(ConfigError, match=f"steps: {saved['steps'] + 1} -> {saved['steps']}"):
        check_unchanged(again)


def test_a_changed_pool_folds_refuses_only_the_stages_it_reaches(tmp_path):
    """finetune.pool_folds reaches only a fine-tune that probes to choose and whose encoder never
    fitted labels; a comparison resumed with another count refused the supervised arm's finished
    stages too, which never folded, and retrained them for nothing."""
    import yaml
    path = _write_configs(tmp_path, tmp_path / "data", fractions="[0.5]", compare_extra="finetune_pool: auto\n")

    def finetunes(folds: int) -> list:
        cfg = load_compare_config(path, [f"fraction_overrides={{0.5: [finetune.pool_folds={folds}]}}"])
        return [s for s in plan(cfg) if s.tool == "finetune"]
    for s in finetunes(5):
        s.out.mkdir(parents=True)
        (s.out / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(s.config, s.args()))))
    for arm in ("mpp", "supervised"):  # what `fitted_labels` reads of the pre-trainings
        (tmp_path / "runs" / f"pretrain_{arm}").mkdir(parents=True)
        (tmp_path / "runs" / f"pretrain_{arm}" / "config.yaml").write_text(f"objective: {arm}\n")
    refused = set()
    for s in finetunes(3):
        try:
            check_unchanged(s)
        except ConfigError as e:
            assert "finetune.pool_folds: 5 -> 3" in str(e)
            refused.add(s.arm)
    assert refused == {"mpp", "scratch"}


def test_a_finished_stage_resumes_with_other_speed_and_logging_keys(tmp_path):
    """Workers' cache, their time-out, logging, checkpointing, profiling, the ranks' time-out and the feature cache's
    place change how a stage ran, not what it computed: a comparison resumed with other values
    reuses it. The data workers' count orders the batches and the test images: a stage of another
    count is refused."""
    import yaml
    stage = plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data")))[0]
    stage.out.mkdir(parents=True)
    (stage.out / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(stage.config, stage.args()))))
    other = ["data.cache_mb=0", "data.timeout=30", "train.log_every=7", "train.ckpt_every=3", "train.keep_ckpts=5", "train.resume=none",
             "train.image_every=4", "train.profile=[2,1]", "train.dist_timeout=60",
             f"probe.cache_dir={tmp_path / 'features'}"]
    quoted = ",".join(f"'{o}'" for o in other)  # YAML: a list value inside the list stays one item
    check_unchanged(plan(load_compare_config(tmp_path / "compare.yaml", [f"pretrain_overrides=[{quoted}]"]))[0])
    from mpp.config import RESULT_NEUTRAL
    assert sorted(o.split("=")[0] for o in other) == sorted(RESULT_NEUTRAL)  # every one of them, each changed
    with pytest.raises(ConfigError, match="data.num_workers: 0 -> 4"):
        check_unchanged(plan(load_compare_config(tmp_path / "compare.yaml",
                                                 ["pretrain_overrides=[data.num_workers=4]"]))[0])


def test_a_finished_stage_of_an_encoder_trained_again_is_refused(tmp_path, monkeypatch, capsys):
    """A probe or fine-tune is reused only while the encoder file it started from is the one there
    now; each file is hashed once per comparison; a stage that recorded no digest (an older mpp)
    is reused with a warning, and one of a random init has nothing to check."""
    import mpp.models
    from mpp.compare import check_encoder
    stages = {s.name: s for s in plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data")))}
    probe, ft = stages["linear probe mpp"], stages["fine-tune mpp, 50% labels, seed 0"]
    encoder = tmp_path / "runs" / "pretrain_mpp" / "encoder.safetensors"
    encoder.parent.mkdir(parents=True)
    encoder.write_bytes(b"the encoder")
    digest = hashlib.sha256(b"the encoder").hexdigest()
    for stage, metrics in ((probe, {"encoder_sha256": digest, "pool": "token"}), (ft, {"init_sha256": digest}),
                           (stages["linear probe scratch"], {"encoder_sha256": None})):
        stage.out.mkdir(parents=True)
        (stage.out / "metrics.json").write_text(json.dumps(metrics))
    hashed = []
    monkeypatch.setattr(mpp.models, "encoder_digest", lambda p, digest=mpp.models.encoder_digest: hashed.append(p)
                        or digest(p))
    digests = {}
    for stage in (probe, ft, stages["linear probe scratch"]):
        check_encoder(stage, digests)
    assert hashed == [encoder]
    encoder.write_bytes(b"the encoder, trained again")
    with pytest.raises(ConfigError, match=rf"stage 'linear probe mpp' finished earlier in {re.escape(str(probe.out))} "
                                          rf"from another encoder than {re.escape(str(encoder))} now.*delete"):
        check_encoder(probe, {})
    (ft.out / "metrics.json").write_text("{}")
    check_encoder(ft, {})
    assert capsys.readouterr().err.startswith(f"warning: stage '{ft.name}' ({ft.out}) records no digest")
    encoder.unlink()  # the pre-training's file gone, its stage still done: a one-line error with the remedy
    with pytest.raises(ConfigError, match=rf"stage 'linear probe mpp' .* from {re.escape(str(encoder))}, which is "
                                          rf"gone: delete the stage that made it \({re.escape(str(encoder.parent))}\)"):
        check_encoder(probe, {})


SWEEP = "sweep: {optim.lr: [0.01, 0.1]}\nseeds: 1\ndev_fraction: 0.2\n"


def _cfg(tmp_path, compare_extra: str = "", overrides=()):
    return load_compare_config(_write_configs(tmp_path, tmp_path / "data", fractions="[0.5]",
                                              compare_extra=compare_extra), list(overrides))


def test_pretrainings_withhold_the_development_splits_of_their_own_training_set(tmp_path, monkeypatch):
    """A pre-training on the fine-tunes' training set, however its path is spelled, leaves out every
    development split their sweeps choose on (one per label fraction), and the one of all the labels
    that the probes choose on, with or without a sweep; one on other data withholds nothing."""
    def withheld(stages):
        return [[o for o in s.overrides if o.startswith("data.withhold=")] for s in stages if s.tool == "pretrain"]
    path = _write_configs(tmp_path, tmp_path / "data", compare_extra=SWEEP)
    assert withheld(plan(load_compare_config(path))) == [["data.withhold=[[0.5,0,0.2],[1.0,0,0.2]]"]] * 2
    other = load_compare_config(path, [f"pretrain_overrides=[data.train={tmp_path / 'other'}]"])
    assert withheld(plan(other)) == [[], []]
    # the same shards in other words (their manifest, a path relative to here, a file: URL, a symbolic
    # link to their folder: it withheld nothing) withhold alike
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    for spelled in (tmp_path / "data" / "train" / "manifest.json", "./data/train/", f"file:{tmp_path}/data//train",
                    tmp_path / "alias" / "train" / "manifest.json"):
        same = load_compare_config(path, [f"pretrain_overrides=[data.train={spelled}]"])
        assert withheld(plan(same)) == [["data.withhold=[[0.5,0,0.2],[1.0,0,0.2]]"]] * 2, spelled
    # without a sweep the probes still choose on the split of all the labels, so it alone is withheld
    unswept = _write_configs(tmp_path, tmp_path / "data")
    assert withheld(plan(load_compare_config(unswept))) == [["data.withhold=[[1.0,0,0.1]]"]] * 2
    assert withheld(plan(load_compare_config(unswept, ["dev_fraction=0.3"]))) == [["data.withhold=[[1.0,0,0.3]]"]] * 2
    # without a 100%-label fine-tune the split of all the labels is still withheld: the probes choose on it
    tenth = plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data", fractions="[0.5]",
                                                    compare_extra=SWEEP)))
    assert withheld(tenth) == [["data.withhold=[[0.5,0,0.2],[1.0,0,0.2]]"]] * 2
    # ... and where the probes are told another split, that one, however it is spelled; none for none
    for told, split in ((", 'probe.dev_split=[]'", ""), (", 'probe.dev_split=[3,0.3]'", ",[1.0,3,0.3]"),
                        (", 'probe={dev_split: [3, 0.3]}'", ",[1.0,3,0.3]")):
        alone = _write_configs(tmp_path, tmp_path / "data", fractions="[0.5]", compare_extra=SWEEP, stage_extra=told)
        assert withheld(plan(load_compare_config(alone))) == [[f"data.withhold=[[0.5,0,0.2]{split}]"]] * 2, told
    # the fine-tunes' own split seed draws the splits, and so the ones withheld and the probes'
    seeded = load_compare_config(_write_configs(tmp_path, tmp_path / "data", compare_extra=SWEEP,
                                                stage_extra=", finetune.split_seed=3"))
    assert withheld(plan(seeded)) == [["data.withhold=[[0.5,3,0.2],[1.0,3,0.2]]"]] * 2
    assert [o for s in plan(seeded) if s.tool == "linear_probe" for o in s.overrides
            if o.startswith("probe.dev_split=")] == ["probe.dev_split=[3,0.2]"] * 3


def test_a_withheld_list_short_of_the_splits_chosen_on_is_warned_of(tmp_path, capsys):
    """pretrain_overrides may give data.withhold; one that lists some of the development splits the
    comparison chooses on but not all would have recipes chosen on images the pre-training read."""
    path = _write_configs(tmp_path, tmp_path / "data", compare_extra=SWEEP)
    for given, warned in (("[[0.5,0,0.2]]", True), ("[[1.0,0,0.2],[0.5,0,0.2]]", False), ("[]", False)):
        cfg = load_compare_config(path, [f'pretrain_overrides=["data.withhold={given}"]'])
        validate(cfg, plan(cfg), machine=False)
        err = capsys.readouterr().err
        assert ("withholds data.withhold=[[0.5, 0, 0.2]] but not the development split(s) [[1.0, 0, 0.2]]"
                in err) is warned, (given, err)
    # a pre-training on other data withholds what it likes: the fine-tunes' splits are not drawn from it
    cfg = load_compare_config(path, [f'pretrain_overrides=[data.train={tmp_path / "other"},'
                                     '"data.withhold=[[0.5,0,0.2]]"]'])
    validate(cfg, plan(cfg), machine=False)
    assert "but not the development split" not in capsys.readouterr().err


def test_an_interrupted_stage_of_other_settings_is_not_trained_on(tmp_path):
    """A stage stopped after a checkpoint, whose planned settings have changed since (here its
    steps), is refused before it resumes: its weights were trained with the old settings."""
    import yaml

    from mpp.checkpoint import checkpoint_name
    path = _write_configs(tmp_path, tmp_path / "data")
    stage = plan(load_compare_config(path))[0]
    saved = to_dict(load_config(stage.config, stage.args()))
    (stage.out / "checkpoints" / checkpoint_name(1)).mkdir(parents=True)
    (stage.out / "config.yaml").write_text(yaml.safe_dump({**saved, "steps": saved["steps"] + 1}))
    with pytest.raises(ConfigError, match=f"'{stage.name}' was interrupted earlier .*steps: {saved['steps'] + 1} -> "):
        run(load_compare_config(path))
    assert not (stage.out / "metrics.json").exists()



def test_an_interrupted_stage_without_a_readable_config_is_not_trained_on(tmp_path):
    """A stage stopped after a checkpoint whose config.yaml is missing or unreadable ran with
    settings no one knows: resuming would train on from those weights and report them as the
    planned settings' result, so it is refused, naming the folder to delete."""
    from mpp.checkpoint import checkpoint_name
    stage = plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data")))[0]
    (stage.out / "checkpoints" / checkpoint_name(1)).mkdir(parents=True)
    for written in (None, "steps: [unclosed\n"):
        if written is not None:
            (stage.out / "config.yaml").write_text(written)
        with pytest.raises(ConfigError, match=f"stage '{re.escape(stage.name)}': .* has a checkpoint but no "
                                              f"config.yaml this mpp can read, so what it ran is unknown"):
            check_unchanged(stage, finished=False)


def test_a_fine_tune_config_of_another_objective_is_refused_before_any_work(tmp_path):
    """The compare config's 'finetune' given a pre-training's config (objective=mpp) would run its
    fine-tunes as pre-trainings after hours of the arms' pre-training; refused at validation,
    naming the fine-tune stage."""
    path = _write_configs(tmp_path, tmp_path / "data")
    cfg = load_compare_config(path, [f"finetune={ROOT / 'configs/synthetic_mpp.yaml'}"])
    with pytest.raises(ConfigError, match=r"stage 'fine-tune .*' \(.*synthetic_mpp.yaml\) resolves to objective=mpp, "
                                          r"not classify; give the compare config's 'finetune' a config of objective"):
        validate(cfg, plan(cfg))

def test_the_report_reads_the_representation_choice_of_the_best_sweep_stage(tmp_path):
    """Two sweep stages of one representation recorded different choices of it (a swept key that
    changes the probe's fit): the report shows the best stage's, which the comparison acted on."""
    import yaml

    from mpp.report import write_report
    labels, cell = np.arange(500) % 10, tmp_path / "finetune_scratch_10pct"
    for lr, top1, token in ((0.003, 0.40, 0.30), (0.03, 0.45, 0.10)):  # the better stage sorts last by name
        out = cell / f"sweep_lr{lr}"
        out.mkdir(parents=True)
        (out / "config.yaml").write_text(yaml.safe_dump({"objective": "classify", "optim": {"lr": lr}, "finetune": {
            "init": "none", "label_fraction": 0.1, "dev_fraction": 0.1, "pool": "auto"}}))
        hits = np.arange(500) < int(top1 * 500)
        (out / "metrics.json").write_text(json.dumps({
            "top1": top1, "evaluated_on": "dev", "pool": "avg", "outcomes": outcomes.record(hits, labels),
            "pool_dev_top1": {"avg": 0.35, "token": token}}))
    for seed in (0, 1):
        out = cell / f"seed{seed}"
        out.mkdir()
        final = {"objective": "classify", "seed": seed, "optim": {"lr": 0.03},
                 "finetune": {"init": "none", "label_fraction": 0.1, "pool": "avg"}}
        (out / "config.yaml").write_text(yaml.safe_dump(final))
        (out / "metrics.json").write_text(json.dumps({"top1": 0.4, "evaluated_on": "val", "pool": "avg"}))
    recipe = write_report(sorted(cell.iterdir()), tmp_path)["recipes"]["scratch"]["0.1"]
    assert recipe["chosen"]["optim.lr"] == 0.03 and recipe["pool_choice"]["top1"]["token"] == 0.10


def test_probes_choose_on_the_development_split_of_all_the_labels(tmp_path):
    """Every linear probe (scratch's too) chooses its representation on the development split of all
    the labels (the 100%-label fine-tunes'), which the pre-trainings withhold, drawn even where no
    100%-label fine-tune runs, or nothing is swept; the comparison's overrides can turn it off."""
    def splits(stages):
        return [[o for o in s.overrides if o.startswith("probe.dev_split")] for s in stages if s.tool == "linear_probe"]
    path = _write_configs(tmp_path, tmp_path / "data", compare_extra=SWEEP)
    stages = plan(load_compare_config(path))
    assert splits(stages) == [["probe.dev_split=[0,0.2]"]] * 3
    assert all(load_config(s.config, s.args()).probe.dev_split == (0, 0.2)
               for s in stages if s.tool == "linear_probe")
    assert splits(plan(load_compare_config(path, ["label_fractions=[0.5]"]))) == [["probe.dev_split=[0,0.2]"]] * 3
    assert splits(plan(load_compare_config(_write_configs(tmp_path, tmp_path / "data")))) == [
        ["probe.dev_split=[0,0.1]"]] * 3
    off = plan(load_compare_config(path, ["overrides=['probe.dev_split=[]']"]))
    assert all(load_config(s.config, s.args()).probe.dev_split == ()
               for s in off if s.tool == "linear_probe")
    # probes (and pre-trainings) on other data than the fine-tunes: the split of the same seed and
    # fraction, drawn from the probes' data and withheld there (they chose on a held-out part of
    # training features the supervised pre-training fitted)
    other = tmp_path / "other"
    transfer = plan(load_compare_config(path, [f"fraction_overrides={{0.5: [data.train={other}], "
                                               f"1.0: [data.train={other}]}}"]))
    assert splits(transfer) == [["probe.dev_split=[0,0.1]"]] * 3  # the unswept comparison written last
    assert [[o for o in s.overrides if o.startswith("data.withhold=")] for s in transfer if s.tool == "pretrain"] == [
        ["data.withhold=[[1.0,0,0.1]]"]] * 2
    # ... where they are named by a manifest: a pattern has no label index to draw a split from
    pattern = plan(load_compare_config(
        _write_configs(tmp_path, tmp_path / "data", stage_extra=f", 'data.train={tmp_path}/p/{{000000..000001}}.tar', "
                                                               "data.num_samples=20"),
        [f"fraction_overrides={{0.5: [data.train={other}], 1.0: [data.train={other}]}}"]))
    assert splits(pattern) == [[]] * 3
    assert not [o for s in pattern if s.tool == "pretrain" for o in s.overrides if o.startswith("data.withhold=")]


def test_runner_up_false_plans_no_retrains_of_other_choices(tmp_path):
    names = [s.name for s in plan(_cfg(tmp_path, SWEEP + "runner_up: false\n"))]
    assert not [n for n in names if "runner-up" in n or "other representation" in n]
    assert sum("runner-up" in s.name for s in plan(_cfg(tmp_path, SWEEP))) == 3  # on by default: one per arm


def test_finetune_pool_config_leaves_every_fine_tune_its_configs_pool(tmp_path):
    stages = [s for s in plan(_cfg(tmp_path, SWEEP + "finetune_pool: config\n")) if s.tool == "finetune"]
    assert stages and not [s.name for s in stages if any(o.startswith("finetune.pool=") for o in s.args(False))]
    assert not [s for s in stages if "other representation" in s.name]
    auto = tmp_path / "finetune_auto.yaml"  # a config whose finals would choose on their training labels
    auto.write_text(f"base: {ROOT / 'configs/synthetic_finetune.yaml'}\nfinetune: {{pool: auto}}\n")
    cfg = _cfg(tmp_path, SWEEP + "finetune_pool: config\n", [f"finetune={auto}"])
    with pytest.raises(ConfigError, match="resolves to finetune.pool=auto, so it would choose its representation"):
        validate(cfg, plan(cfg), machine=False)
    validate(chosen := _cfg(tmp_path, SWEEP, [f"finetune={auto}"]), plan(chosen), machine=False)  # finetune_pool: auto


def test_finals_that_choose_on_their_training_labels_without_a_sweep_are_warned_about(tmp_path, capsys):
    """Without a sweep each final fine-tune chooses its representation and its starting head's L2 on
    its own training labels, which the supervised pre-training fitted: said before any work, and
    not where a sweep (of one value) or the configs leave them nothing to choose."""
    grep = "fine-tune supervised.*chooses its representation .*give a sweep, of one value"
    for compare_extra, stage_extra, warned in (("", "", True), ("sweep: {optim.lr: [0.1]}\n", "", False),
                                               ("finetune_pool: config\n", ", finetune.head_init=zero", False),
                                               ("finetune_pool: config\n", ", finetune.head_init=probe", True)):
        cfg = load_compare_config(_write_configs(tmp_path, tmp_path / "data", stage_extra, "[0.5]", compare_extra))
        validate(cfg, plan(cfg), machine=False)
        assert bool(re.search(grep, capsys.readouterr().err)) == warned, compare_extra
    # a supervised pre-training on other data fitted none of the fine-tunes' labels
    other = load_compare_config(_write_configs(tmp_path, tmp_path / "data", "", "[0.5]", ""),
                                [f"pretrain_overrides=[data.train={tmp_path / 'other'}]"])
    validate(other, plan(other), machine=False)
    assert "chooses its representation" not in capsys.readouterr().err


def test_a_swept_pool_is_not_replaced_by_auto(tmp_path):
    cfg = _cfg(tmp_path, "sweep: {finetune.pool: [token, avg]}\nseeds: 1\ndev_fraction: 0.2\n")
    sweeps = [s for s in plan(cfg) if s.tool == "finetune" and ", sweep " in s.name]
    assert len(sweeps) == 6
    for s in sweeps:
        assert load_config(s.config, s.args(False)).finetune.pool == s.out.name.rsplit("pool", 1)[1]


def test_the_time_split_of_a_stage_adds_up_to_its_time(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps({"setup_s": 1.0, "begin_s": 0.25, "loop_s": 5.0,
                                                       "final_eval_s": 2.0, "segment_s": 9.0}))
    # set-up, begin, loop, final, export, process: every part another figure, so that no two can trade places
    assert time_split(tmp_path, 10.5) == [1.0, 0.25, 5.0, 2.0, 0.75, 1.5]


def _fake_stages(monkeypatch, sweep_hits: dict) -> list[Path]:
    """No data, figures, report or stage processes: a 'stage' writes its config.yaml and a
    metrics.json (1 s set-up, 0.25 s begin, 2 s loop, 0.5 s final evaluation, 0.5 s export); a sweep
    stage of (arm, lr) scores `sweep_hits[arm][lr]` on 200 development images. Returns the stages run."""
    import mpp.compare
    import mpp.figures.inspection
    import mpp.report
    ran = []

    def run_stage(cmd, launcher):
        out = Path(cmd[-1].split("=", 1)[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(cmd[4], cmd[5:]))))
        m = {"setup_s": 1.0, "begin_s": 0.25, "loop_s": 2.0, "final_eval_s": 0.5, "segment_s": 4.25, "top1": 0.5,
             "evaluated_on": "val"}
        if out.name.startswith("sweep_lr"):
            hits = sweep_hits[out.parent.name.split("_")[1]][out.name[len("sweep_lr"):]]
            m.update(top1=float(hits.mean()), evaluated_on="dev", pool="token",
                     outcomes=outcomes.record(hits, np.arange(200) % 10))
        (out / "metrics.json").write_text(json.dumps(m))
        ran.append(out)
        return 0

    monkeypatch.setattr(mpp.compare, "run_stage", run_stage)
    monkeypatch.setattr(mpp.compare, "prepare_data", lambda cfg: None)
    monkeypatch.setattr(mpp.compare, "check_data", lambda *a: None)
    monkeypatch.setattr(mpp.figures.inspection, "write_compare_figures", lambda *a, **k: None)
    monkeypatch.setattr(mpp.report, "write_report", lambda *a, **k: None)
    return ran


def test_a_stage_killed_by_a_signal_is_said_on_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    """A stage killed by a signal (the out-of-memory killer's SIGKILL) printed no cause, and the
    comparison's error line ran on from the stage's cut-off progress bar; the line now starts
    afresh and names the signal. The comparison's folder keeps its mark of an unfinished one, which
    a report of it reads (tests/test_report.py); a finished comparison leaves none."""
    import mpp.compare
    _fake_stages(monkeypatch, {})

    def killed(cmd, launcher):
        print("pre-train:  40%|####      | 4/10", end="", file=sys.stderr, flush=True)  # a bar, cut off
        return -signal.SIGKILL
    monkeypatch.setattr(mpp.compare, "run_stage", killed)
    with pytest.raises(RuntimeError, match=r"stage 'pre-train mpp' failed \(killed by SIGKILL, as the out-of-memory "
                                           r"killer does\); fix the cause"):
        run(cfg := _cfg(tmp_path, "pretrain_seeds: 2\n"))
    assert capsys.readouterr().err.endswith("4/10\n")
    marks = [Path(cfg.output_dir) / "unfinished.txt", repeat_dir(cfg, 1) / "unfinished.txt"]  # each report's folder
    assert all("has not finished" in m.read_text() for m in marks)
    monkeypatch.undo()
    _fake_stages(monkeypatch, {})
    run(cfg)
    assert not any(m.exists() for m in marks)
    from mpp.compare.stages import killed as said
    assert [said(-signal.SIGTERM), said(-99), said(3)] == [" (killed by SIGTERM)", " (killed by signal 99)", ""]


def test_conditional_stages_run_exactly_after_a_toss_up_and_resume_checks_the_choice(tmp_path, monkeypatch, capsys):
    """With every stage's process faked: a runner-up runs for the one arm whose sweep was a toss-up;
    the summed time split adds the trained stages' parts; a resume runs nothing and keeps the
    runner-ups not needed; a sweep stage changed since, which makes another value the best, is
    refused at the final that trained the old best; a changed pre-training before anything runs."""
    idx = np.arange(200)
    toss = {"0.01": idx < 120, "0.1": idx >= 100}   # 60 vs 50, disagreeing on 180 images: a toss-up
    clear = {"0.01": idx < 120, "0.1": idx < 100}   # 60 vs 50, disagreeing on 20: a clear lead
    ran = _fake_stages(monkeypatch, {"scratch": toss, "mpp": clear, "supervised": clear})
    cfg = _cfg(tmp_path, SWEEP + "finetune_pool: config\n")
    run(cfg)
    out = capsys.readouterr().out
    names = {s.out: s.name for s in plan(cfg)}
    trained = sorted(names[o] for o in ran)
    assert [n for n in trained if "runner-up" in n] == ["fine-tune scratch, 50% labels, runner-up, seed 0"]
    assert out.count("not needed") == 2 and len(trained) == len(names) - 2
    n = len(trained)
    assert re.search(rf"the {n} stages trained now took [\d.]+ s \(set-up {n:.1f}, begin {0.25 * n:.1f}, "
                     rf"training loop {2 * n:.1f}, final evaluation {0.5 * n:.1f}, export {0.5 * n:.1f}, ", out), out
    ran.clear()
    run(cfg)
    out = capsys.readouterr().out
    assert not ran and out.count("done earlier") == len(names) - 2 and out.count("not needed") == 2
    sweep = tmp_path / "runs/finetune_scratch_50pct/sweep_lr0.1/metrics.json"  # its sweep run again: a clear lead
    m = json.loads(sweep.read_text())
    sweep.write_text(json.dumps({**m, "outcomes": outcomes.record(idx < 100, np.arange(200) % 10)}))
    reported = []
    import mpp.report
    monkeypatch.setattr(mpp.report, "write_report", lambda runs, *a, **k: reported.extend(runs))
    run(cfg)
    out = capsys.readouterr().out
    runner_up = tmp_path / "runs/finetune_scratch_50pct/runner_up_seed0"
    assert not ran and "runner-up, seed 0: not needed now" in out and f"earlier result in {runner_up} is left" in out
    assert (runner_up / "metrics.json").is_file() and runner_up not in reported and len(reported) == len(names) - 3
    sweep.write_text(json.dumps(m))
    sweep = tmp_path / "runs/finetune_mpp_50pct/sweep_lr0.1/metrics.json"
    m = json.loads(sweep.read_text())
    sweep.write_text(json.dumps({**m, "top1": 0.9}))
    with pytest.raises(ConfigError, match=r"stage 'fine-tune mpp, 50% labels, seed 0' finished earlier .*"
                                          r"optim.lr: 0.01 -> 0.1"):
        run(cfg)
    assert not ran
    sweep.write_text(json.dumps(m))
    pre = tmp_path / "runs/pretrain_mpp/metrics.json"  # trained on two processes, resumed with one
    m = json.loads(pre.read_text())
    pre.write_text(json.dumps({**m, "processes": 2}))
    with pytest.raises(ConfigError, match=r"stage 'pre-train mpp' finished earlier in .* on 2 process\(es\); the "
                                          "launcher now starts 1, which would split its data otherwise"):
        run(cfg)
    pre.write_text(json.dumps({**m, "processes": 1}))
    run(cfg)
    capsys.readouterr()
    assert not ran
    with pytest.raises(ConfigError, match="stage 'pre-train mpp' finished earlier.*steps: 2 -> 3"):
        run(_cfg(tmp_path, SWEEP + "finetune_pool: config\n", ["pretrain_overrides=[steps=3]"]))
    assert not ran


def test_a_resumed_comparison_refuses_a_finished_probe_of_an_encoder_trained_again(tmp_path, monkeypatch):
    """The comparison itself, not check_encoder alone: resumed after the MPP encoder's file changed
    (its pre-training deleted and run again), it reported the old probe as the new encoder's."""
    ran = _fake_stages(monkeypatch, {})
    run(cfg := _cfg(tmp_path))
    (tmp_path / "runs/pretrain_mpp/encoder.safetensors").write_bytes(b"trained again")
    probe = tmp_path / "runs/probe_mpp/metrics.json"
    old = hashlib.sha256(b"the encoder the probe started from").hexdigest()
    probe.write_text(json.dumps({**json.loads(probe.read_text()), "encoder_sha256": old}))
    ran.clear()
    with pytest.raises(ConfigError, match="stage 'linear probe mpp' finished earlier .* from another encoder"):
        run(cfg)
    assert not ran


def test_each_pretraining_seeds_report_reads_its_own_stages_and_the_shared_scratch_ones(tmp_path, monkeypatch):
    """Scratch runs once for every pre-training seed: the seed-1 report must read its stages too,
    else its gaps over scratch are empty; the main report reads seed 0's and scratch's alone."""
    import mpp.report
    _fake_stages(monkeypatch, {})
    reports = {}
    monkeypatch.setattr(mpp.report, "write_report", lambda runs, out, *a, **k: reports.setdefault(Path(out), runs))
    run(cfg := _cfg(tmp_path, "pretrain_seeds: 2\n"))
    stages = plan(cfg)
    for seed in (0, 1):
        want = {s.out for s in stages if s.pretrain_seed == seed or s.arm == "scratch"}
        assert set(reports[repeat_dir(cfg, seed)]) == want and any("scratch" in p.name for p in want)


def test_the_comparison_checks_the_data_it_made_before_any_stage_starts(tmp_path, monkeypatch):
    """check_data is what refuses a data set the stages cannot read: run must call it before the
    first stage, not leave the refusal to a stage hours in."""
    import mpp.compare
    ran = _fake_stages(monkeypatch, {})

    def refused(*a):
        raise ConfigError("the data are unreadable")
    monkeypatch.setattr(mpp.compare, "check_data", refused)
    with pytest.raises(ConfigError, match="the data are unreadable"):
        run(_cfg(tmp_path))
    assert not ran


def test_pretrain_seeds_repeat_the_pretrained_arms_and_share_scratch(tmp_path):
    """`pretrain_seeds: 2`: seed 0's comparison as before, then MPP's and supervised's stages again
    with pre-training seed 1 in OUTPUT_DIR_pretrain_seed1, their probes and fine-tunes starting
    from those encoders; scratch starts from no pre-training and is not repeated."""
    one, two = plan(_cfg(tmp_path, SWEEP)), plan(_cfg(tmp_path, SWEEP + "pretrain_seeds: 2\n"))
    assert [s.out for s in two[:len(one)]] == [s.out for s in one]  # seed 0: the comparison unchanged
    again = two[len(one):]
    repeat = tmp_path / "runs_pretrain_seed1"
    assert again and all(s.pretrain_seed == 1 and s.out.is_relative_to(repeat) for s in again)
    assert len({s.out for s in two}) == len(two)
    assert not [s.name for s in again if "scratch" in s.name or "=none" in " ".join(s.overrides)]
    assert len(again) == len([s for s in one if "scratch" not in s.name])
    pre = {s.name: s for s in again if s.tool == "pretrain"}
    assert sorted(pre) == ["pre-train mpp (pre-training seed 1)", "pre-train supervised (pre-training seed 1)"]
    assert all(s.overrides[-1] == "seed=1" for s in pre.values())  # after pretrain_overrides
    assert all("seed=1" not in s.overrides for s in one if s.tool == "pretrain")
    seeded = tmp_path / "mpp_seed1.yaml"  # a config's own seed: kept alone, replaced by 0..N-1 with repeats
    seeded.write_text(f"base: {ROOT / 'configs/synthetic_mpp.yaml'}\nseed: 1\n")
    for n, seeds in ((1, [1, 0]), (2, [0, 0, 1, 1])):
        stages = plan(_cfg(tmp_path, SWEEP + f"pretrain_seeds: {n}\n", [f"mpp={seeded}"]))
        assert [load_config(s.config, s.args(False)).seed for s in stages if s.tool == "pretrain"] == seeds
    encoders = {str(repeat / "pretrain_mpp"), str(repeat / "pretrain_supervised")}

    def starts(s):  # the encoders a stage's overrides start it from
        return [o.split("=", 1)[1] for o in s.overrides if o.startswith(("finetune.init=", "probe.encoder="))]
    for s in again:  # every probe and fine-tune of the repeat starts from the repeat's own encoders
        assert s.tool == "pretrain" or (len(starts(s)) == 1 and starts(s)[0] in encoders), s.name
    for s in two:  # each stage's arm is what it starts from (scratch: none) or pre-trains; the report groups by it
        source = s.out if s.tool == "pretrain" else Path(starts(s)[0])
        assert s.arm == ("scratch" if starts(s) == ["none"] else source.name.removeprefix("pretrain_")), s.name
    assert {s.arm for s in two} == {"mpp", "supervised", "scratch"}
    slashed = plan(_cfg(tmp_path, SWEEP + "pretrain_seeds: 2\n", [f"output_dir={tmp_path / 'runs'}/"]))
    assert [s.out for s in slashed] == [s.out for s in two]  # a trailing slash does not nest the repeat
    with pytest.raises(ConfigError, match="'pretrain_seeds' must be >= 1"):
        _cfg(tmp_path, "pretrain_seeds: 0\n")


@pytest.mark.slow  # a whole comparison twice over: the minutes of the end-to-end tests
def test_a_comparison_over_two_pretraining_seeds_reports_each_gap_over_them(tmp_path):
    path = _write_configs(tmp_path, tmp_path / "data", fractions="[1.0]", compare_extra="pretrain_seeds: 2\n")
    r = run_tool("compare", "--config", path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    runs, repeat = tmp_path / "runs", tmp_path / "runs_pretrain_seed1"
    reps = [json.loads((d / "report.json").read_text()) for d in (runs, repeat)]
    assert "pretrain_seeds" not in reps[1]
    assert [d for d in reps[1]["plan"] if d.startswith("..")] == [  # a repeat's report names the shared scratch runs
        f"../runs/{d}" for d in reps[0]["plan"] if "scratch" in d]
    for rep in reps:  # each repeat's own report, the scratch runs shared
        assert rep["table"]["scratch"]["finetune"]["1"] == reps[0]["table"]["scratch"]["finetune"]["1"]
        assert rep["table"]["mpp"]["finetune"]["1"] is not None
    digests = {json.loads((d / "probe_mpp" / "metrics.json").read_text())["encoder_sha256"] for d in (runs, repeat)}
    assert len(digests) == 2  # two pre-trainings, not one read twice
    across = reps[0]["pretrain_seeds"]
    assert across["seeds"] == 2
    for fig, got, mine in ((across["finetune"]["1"], reps[0]["derived"]["finetune"]["1"],
                            reps[1]["derived"]["finetune"]["1"]),
                           (across["linear_top1"], reps[0]["derived"]["linear_top1"],
                            reps[1]["derived"]["linear_top1"])):
        assert fig["mpp_minus_scratch"]["values"] == [got["mpp_minus_scratch"], mine["mpp_minus_scratch"]]
    md = (runs / "report.md").read_text()
    assert "## Across 2 pre-training seeds" in md and "section on pre-training seeds below" in md
    assert across["repeats"] == ["../runs_pretrain_seed1"] and "`../runs_pretrain_seed1`" in md
    # re-rendered in place, the report keeps the repeats its report.json names
    (runs / "report.json").write_text(json.dumps({**reps[0], "pretrain_seeds": {**across, "seeds": 9}}))
    again = run_tool("report", runs)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((runs / "report.json").read_text())["pretrain_seeds"] == across
    assert "../runs_pretrain_seed1" in again.stdout
    # elsewhere it keeps the section when told where the repeat is
    again = run_tool("report", runs, "--out", tmp_path / "re", "--repeat", repeat)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "re" / "report.json").read_text())["pretrain_seeds"] == across
    bad = run_tool("report", runs, "--out", tmp_path / "re", "--repeat", tmp_path / "nope")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "pretrain_seedN" in bad.stderr, bad.stderr


def test_the_tool_passes_dry_run_and_the_later_of_two_overrides(tmp_path, monkeypatch):
    """--dry-run reaches the comparison (which then runs nothing), and of two overrides of one key
    the later wins, as on every tool's command line."""
    import mpp.compare
    seen = []
    monkeypatch.setattr(mpp.compare, "run", lambda cfg, dry_run: seen.append((cfg, dry_run)) or tmp_path / "report")
    r = run_tool("compare", "--config", ROOT / "configs/compare_synthetic.yaml", "--dry-run",
                 f"output_dir={tmp_path / 'A'}", f"output_dir={tmp_path / 'B'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    [(cfg, dry_run)] = seen
    assert dry_run is True and cfg.output_dir == str(tmp_path / "B")
    assert r.stdout.startswith("report (when it has run): ")
    assert not (tmp_path / "A").exists() and not (tmp_path / "B").exists()
