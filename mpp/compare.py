"""The whole experiment in one command: MPP and supervised pre-training, linear probes of both
and of a randomly initialised encoder (the probe's from-scratch baseline), fine-tuning of both
and of a from-scratch baseline at each label fraction, then the gap report.

Fine-tuning follows the paper's protocol, identically for every arm: each value of the `sweep`
grid is trained on the labels minus a class-balanced development split (`dev_fraction`) and
scored on it; the best is retrained on all the labels, `seeds` times, and tested on `data.val`
once per seed. Where the split could not separate the best value from the next (its lead under t
times its paired standard error, Student's t at the images' degrees of freedom: a toss-up),
`runner_up` also retrains the next with the same seeds, so that the report can give each figure
the range that choice spans (and likewise the best value through the other representation where
the best stage's choice of it was a toss-up). `finetune.pool` is best swept like the rate (every
shipped comparison but the `hog` and `histogram` ones does: the fine-tune itself then chooses
it); left out of the sweep, a linear probe of the sweep's own training labels chooses it, scored
on its development split (`finetune_pool: auto`, i.e. finetune.pool=auto in the sweep stages; the
finals take the best one's): one cheap frozen-feature fit per arm and label fraction, and a
10%-label cell never leans on a probe of all the labels. Such run-time choices are `Choice`s of a
stage (whether it runs at all, its `Condition`), read from the finished stages' metrics.json just
before it starts.

A pre-training is one draw too: `pretrain_seeds: N` pre-trains MPP and supervised N times (seed
0..N-1, in place of their configs' seed), each repeat fine-tuned, probed and reported the same
way (seed 0 in `output_dir`, seed s in `output_dir_pretrain_seed{s}`; the scratch arm, which no
pre-training touches, runs once and serves every repeat), and the main report adds each gap
over the repeats, whose ± then counts
the pre-training's own seed (`mpp.gaps.across_pretrain_seeds`).

Each stage runs as its own process (so a crash loses one stage, memory is freed between stages,
and `launcher` can be `torchrun --nproc_per_node N`); a stage whose `metrics.json` exists is
skipped, so running the comparison again resumes it, unless the settings it ran with (its
`config.yaml`) are not the ones planned now: a changed config is an error, not a silently reused
result (keys of speed and logging alone, mpp.config.RESULT_NEUTRAL, may differ), and so is an
interrupted stage's checkpoint of other settings, which it would train on from; nor is a probe
or fine-tune reused whose encoder has been trained again since (its metrics.json records the
sha256 of the encoder it started from). Every stage config is resolved and validated before the
first stage starts.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from mpp import outcomes
from mpp.cli import QUIET_INTERRUPT
from mpp.config import (TOOL_DEFAULTS, CompareConfig, Config, ConfigError, as_list, changed_settings,
                        flatten, load_config, parse_overrides, said, to_dict)
from mpp.gaps import choice_lead, dev_rank, pool_choice
from mpp.launcher import follow_parent
from mpp.specs import data_key, dev_split, names_manifest, two_test_sets

TOOLS = "mpp.tools"  # a stage runs `python -m mpp.tools.TOOL` (or LAUNCHER -m ...)


@dataclass
class Choice:
    """Overrides of a stage decided by earlier stages' results (the probe's representation, the
    best sweep value); `placeholder` stands in for them while planning and validating."""
    what: str                       # for the plan, e.g. "optim.lr: best dev top-1 of 2 sweep stages"
    placeholder: list[str]
    pick: Callable[[], list[str]]   # reads the finished stages' metrics.json


@dataclass
class Condition:
    """Whether a stage runs at all, decided by earlier stages' results (a runner-up's finals run
    only after a toss-up); checked just before it would start."""
    what: str                       # for the plan
    holds: Callable[[], bool]       # reads the finished stages' metrics.json


@dataclass
class Stage:
    name: str
    tool: str             # module in mpp.tools
    config: str           # its --config
    overrides: list[str]  # its key=value overrides
    out: Path             # its output_dir; done when out/metrics.json exists
    choices: list[Choice] = field(default_factory=list)
    when: Condition | None = None  # None: always runs
    pretrain_seed: int = 0  # the pre-training seed of the comparison it belongs to (scratch's: 0, shared)
    arm: str = ""  # the arm it pre-trains or evaluates: mpp, supervised or scratch

    def chosen(self, resolved: bool = True) -> list[str]:
        """The run-time choices' overrides (their placeholders unless `resolved`), each key once: a
        later choice's value replaces an earlier one's, as the config would read them (the other
        representation's finetune.head_l2 the best stage's)."""
        picks: dict[str, str] = {}
        for o in (o for c in self.choices for o in (c.pick() if resolved else c.placeholder)):
            picks.pop(key := o.split("=", 1)[0], None)
            picks[key] = o
        return list(picks.values())

    def args(self, resolved: bool = True) -> list[str]:
        """Overrides, then the run-time choices (`chosen`), then output_dir."""
        return self.overrides + self.chosen(resolved) + [f"output_dir={self.out}"]

    def command(self, launcher: list[str], resolved: bool = True) -> list[str]:
        return launcher + ["-m", f"{TOOLS}.{self.tool}", "--config", self.config] + self.args(resolved)

    def settings(self, resolved: bool = True) -> Config:
        """The config its tool will run with: the tool's own defaults (mpp-finetune's objective=classify)
        beneath its config file, the stage's arguments over it."""
        return load_config(self.config, self.args(resolved), defaults=TOOL_DEFAULTS.get(self.tool, []))


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def grid_points(sweep: dict) -> list[list[str]]:
    """Every combination of the sweep's values as key=value overrides (one empty point without a sweep)."""
    return [[f"{k}={_value(v)}" for k, v in zip(sweep, values)] for values in itertools.product(*sweep.values())]


def _slug(point: list[str]) -> str:
    """A run-dir name for a grid point: optim.lr=0.01 -> lr0.01."""
    return "_".join(re.sub(r"[^A-Za-z0-9.+-]", "-", o.split("=", 1)[0].rsplit(".", 1)[-1] + o.split("=", 1)[1])
                    for o in point)


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _ranked(outs: list[Path]) -> list[tuple[int, dict]]:
    """(index, metrics) of the sweep stages from the best top-1 on the development split down
    (`mpp.gaps.dev_rank`)."""
    ms = [_metrics(out) for out in outs]
    for out, m in zip(outs, ms):
        if m.get("evaluated_on") != "dev":
            raise RuntimeError(f"{out}/metrics.json was not evaluated on a development split; delete it and resume")
    return sorted(enumerate(ms), key=lambda im: dev_rank(im[1]["top1"], outs[im[0]]))


def best_point(points: list[list[str]], outs: list[Path], rank: int = 0) -> list[str]:
    """The grid point whose sweep stage ranks `rank` on its development split (0: the best), with
    the starting head's L2 that stage chose there (`head_l2`)."""
    return points[_ranked(outs)[rank][0]] + head_l2(outs, rank)


def head_l2(outs: list[Path], rank: int = 0, pool: str | None = None) -> list[str]:
    """The override that gives a final fine-tune the starting head's L2 (finetune.head_l2) that the
    sweep stage ranked `rank` chose on its development split for representation `pool` (default:
    its own), so that the finals choose nothing on their training labels, most of which a
    supervised pre-training fitted; none where that stage fitted no probe head for it, nor where its
    head started at zero (finetune.pool=auto then fits a probe only to choose the representation)."""
    m = _ranked(outs)[rank][1]
    if m.get("head_init", "probe") != "probe":
        return []
    pool = pool or m.get("pool")
    l2 = (m.get("pool_head_l2") or {}).get(pool) or (m.get("head_probe_l2") if pool == m.get("pool") else None)
    return [f"finetune.head_l2={l2!r}"] if l2 else []  # repr: the float itself, to the last digit


def toss_up(outs: list[Path]) -> bool:
    """Whether the development split could not separate the best sweep value from the next: the
    `mpp.gaps.choice_lead` of the two is not clear (False, not None: both recorded outcomes)."""
    (_, a), (_, b) = _ranked(outs)[:2]
    return choice_lead(a["top1"], b["top1"], outcomes.read(a.get("outcomes")),
                       outcomes.read(b.get("outcomes")))["clear"] is False


def _pool_choice(outs: list[Path]) -> dict:
    """How the best sweep stage chose its representation (`mpp.gaps.pool_choice`: the other
    candidate, the chosen one's lead over it); {} if it chose none (finetune.pool not auto)."""
    m = _ranked(outs)[0][1]
    return pool_choice(m) or {}


def repeat_dir(cfg: CompareConfig, pretrain_seed: int) -> Path:
    """Where the comparison with pre-training seed `pretrain_seed` writes: output_dir for seed 0,
    a sibling output_dir_pretrain_seed{s} for the others (each its own comparison and report)."""
    root = Path(os.path.normpath(cfg.output_dir))  # no trailing slash or '..', which put the sibling inside it
    return root if pretrain_seed == 0 else root.with_name(f"{root.name}_pretrain_seed{pretrain_seed}")


def plan(cfg: CompareConfig) -> list[Stage]:
    """The stages in run order, each with its resolved overrides and run-time choices: the
    comparison of pre-training seed 0, then the MPP and supervised stages again for each further
    pre-training seed (`pretrain_seeds`; scratch depends on no pre-training and runs once)."""
    stages = []
    for pretrain_seed in range(cfg.pretrain_seeds):
        stages += _plan_one(cfg, pretrain_seed)
    return stages


def _plan_one(cfg: CompareConfig, pretrain_seed: int) -> list[Stage]:
    """The stages of the comparison whose pre-trainings run with `pretrain_seed` (`repeat_dir`);
    for a seed other than 0, without the scratch arm's."""
    root = repeat_dir(cfg, pretrain_seed)
    common = as_list(cfg.overrides)
    again = f" (pre-training seed {pretrain_seed})" if pretrain_seed else ""
    pre = {"mpp": root / "pretrain_mpp", "supervised": root / "pretrain_supervised"}
    seeded = [f"seed={pretrain_seed}"] if cfg.pretrain_seeds > 1 else []  # 0..N-1, whatever the configs say
    arms = ("scratch", "mpp", "supervised") if pretrain_seed == 0 else ("mpp", "supervised")
    probe_split = _probe_split(cfg)
    stages = [Stage(f"pre-train {kind}{again}", "pretrain", getattr(cfg, kind),
                    common + _withheld(cfg, getattr(cfg, kind), probe_split) + as_list(cfg.pretrain_overrides)
                    + seeded, out, pretrain_seed=pretrain_seed, arm=kind)
              for kind, out in pre.items()]
    for arm in sorted(arms, key=("mpp", "supervised", "scratch").index):
        stages.append(Stage(f"linear probe {arm}{again}", "linear_probe", cfg.probe,
                            probe_split + common + [f"probe.encoder={pre.get(arm, 'none')}"], root / f"probe_{arm}",
                            pretrain_seed=pretrain_seed, arm=arm))
    points = grid_points(cfg.sweep)
    for frac in cfg.label_fractions:
        pct = f"{frac * 100:g}pct"
        for arm in arms:
            base = common + cfg.fraction_overrides.get(frac, []) + [
                f"finetune.init={pre.get(arm, 'none')}", f"finetune.label_fraction={frac}"]
            choose = ["finetune.pool=auto"] if cfg.finetune_pool == "auto" and "finetune.pool" not in cfg.sweep else []
            sweep = []
            if cfg.sweep:
                for point in points:
                    sweep.append(Stage(f"fine-tune {arm}, {frac:.0%} labels, sweep {' '.join(point)}{again}",
                                       "finetune", cfg.finetune,
                                       base + point + [f"finetune.dev_fraction={cfg.dev_fraction}"] + choose,
                                       root / f"finetune_{arm}_{pct}" / f"sweep_{_slug(point)}",
                                       pretrain_seed=pretrain_seed, arm=arm))
                stages += sweep
            outs = [s.out for s in sweep]
            best = [Choice(f"{', '.join(cfg.sweep)}: best dev top-1 of {len(sweep)} sweep stages (with the "
                           "finetune.head_l2 it chose, if it started from a probe head)", points[0],
                           lambda outs=outs: best_point(points, outs))] if sweep else []
            # the representation that the best (the second-best) sweep stage chose on its training labels
            pools = [Choice(f"finetune.pool: the {nth} sweep stage's, chosen on its training labels",
                            ["finetune.pool=token"],
                            lambda outs=outs, r=r: [f"finetune.pool={_ranked(outs)[r][1]['pool']}"])
                     for r, nth in enumerate(("best", "second-best"))] if choose and sweep else []
            # all the labels, tested on data.val, whatever the configs say; without a sweep each final chooses its pool
            final = base + (choose if not sweep else []) + ["finetune.dev_fraction=0"]
            for seed in range(cfg.seeds):
                stages.append(Stage(f"fine-tune {arm}, {frac:.0%} labels, seed {seed}{again}", "finetune", cfg.finetune,
                                    final + [f"seed={seed}"], root / f"finetune_{arm}_{pct}" / f"seed{seed}",
                                    pools[:1] + best, pretrain_seed=pretrain_seed, arm=arm))
            if cfg.runner_up and len(sweep) > 1:
                second = Choice(f"{', '.join(cfg.sweep)}: second-best dev top-1 of {len(sweep)} sweep stages "
                                "(with its finetune.head_l2, if any)",
                                points[1], lambda outs=outs: best_point(points, outs, rank=1))
                when = Condition("the best value's dev lead over it is under t times its standard error (a toss-up)",
                                 lambda outs=outs: toss_up(outs))
                for seed in range(cfg.seeds):
                    stages.append(Stage(f"fine-tune {arm}, {frac:.0%} labels, runner-up, seed {seed}{again}",
                                        "finetune", cfg.finetune, final + [f"seed={seed}"],
                                        root / f"finetune_{arm}_{pct}" / f"runner_up_seed{seed}",
                                        pools[1:] + [second], when=when, pretrain_seed=pretrain_seed, arm=arm))
            if cfg.runner_up and pools:  # the representation: the best stage's value, the other pool
                other = Choice("finetune.pool: the one the best sweep stage did not choose (with its finetune.head_l2 "
                               "there, if any)", ["finetune.pool=avg"],
                               lambda outs=outs: [f"finetune.pool={(p := _pool_choice(outs)['other'])}",
                                                  *head_l2(outs, pool=p)])
                when = Condition("the best sweep stage's representation led the other by under t times its standard "
                                 "error on the images it was chosen on (a toss-up)",
                                 lambda outs=outs: (_pool_choice(outs).get("lead") or {}).get("clear") is False)
                for seed in range(cfg.seeds):
                    stages.append(Stage(f"fine-tune {arm}, {frac:.0%} labels, other representation, seed {seed}{again}",
                                        "finetune", cfg.finetune, final + [f"seed={seed}"],
                                        root / f"finetune_{arm}_{pct}" / f"other_pool_seed{seed}", best + [other],
                                        when=when, pretrain_seed=pretrain_seed, arm=arm))
    return stages


def _dev_splits(cfg: CompareConfig, fractions=None, unswept: bool = False) -> set[tuple]:
    """(data.train's `data_key`, label_fraction, split_seed, dev_fraction) of every development split
    the fine-tune sweeps draw at `fractions` (default: the label fractions), as their configs
    resolve; none without a sweep, unless `unswept` (the split a sweep would draw, for the probes).
    A config that does not load raises its ConfigError."""
    common, splits = as_list(cfg.overrides), set()
    for frac in cfg.label_fractions if fractions is None else fractions:
        for point in grid_points(cfg.sweep) if cfg.sweep or unswept else []:
            f = load_config(cfg.finetune, common + cfg.fraction_overrides.get(frac, [])
                            + [f"finetune.label_fraction={frac}"] + point
                            + [f"finetune.dev_fraction={cfg.dev_fraction}"], defaults=TOOL_DEFAULTS["finetune"])
            splits.add((data_key(f.data.train), f.finetune.label_fraction, f.finetune.split_seed,
                        f.finetune.dev_fraction))
    return splits


def _probe_dev(cfg: CompareConfig, probe_split: list[str]) -> tuple | None:
    """The development split every linear probe chooses its representation and L2 on, as the probe
    stages resolve it (`probe_split`, `_probe_split`'s, or what the comparison's `overrides` give
    instead), in `_dev_splits`' terms for `_withheld`; None where they have none."""
    p = load_config(cfg.probe, probe_split + as_list(cfg.overrides))
    return (data_key(p.data.train), 1.0, *p.probe.dev_split) if p.probe.dev_split else None


def _withheld(cfg: CompareConfig, pretrain_config: str, probe_split: list[str]) -> list[str]:
    """The pre-training override that leaves out every development split the fine-tune sweeps and
    the probes (`_probe_dev` of `probe_split`) choose on from its training set (`data.withhold`), so that no swept
    value, nor a fine-tune's or a linear probe's representation, is chosen on images a
    pre-training trained on (the supervised one with their labels). Nothing for a pre-training on
    other data, or where nothing is chosen on a split; `pretrain_overrides` come after it (and
    `data.withhold=[]` there turns it off). A config that does not load is left to
    `validate`, which names its stage."""
    try:
        train = load_config(pretrain_config, as_list(cfg.overrides) + as_list(cfg.pretrain_overrides)).data.train
        probe = _probe_dev(cfg, probe_split)
        splits = sorted(s[1:] for s in _dev_splits(cfg) | ({probe} if probe else set()) if s[0] == data_key(train))
    except ConfigError:
        return []
    return [f"data.withhold={[list(s) for s in splits]}".replace(" ", "")] if splits else []


def _probe_split(cfg: CompareConfig) -> list[str]:
    """The probe override that chooses every linear probe's representation and L2 on the development
    split of all the labels (`probe.dev_split`), the one a 100%-label fine-tune draws, drawn (and
    withheld, `_withheld`) even where none runs or nothing is swept, instead of on a held-out part of
    the training features, which the supervised pre-training fitted. A probe of other data than
    the fine-tunes' (a pre-training's own, say) draws the split of the same seed and fraction from
    its data, withheld as well from a pre-training on them, where they are named by a manifest (a
    shard list or pattern has no label index to draw it from). The comparison's `overrides` come
    after it. A config that does not load is left to `validate`."""
    try:
        train = load_config(cfg.probe, as_list(cfg.overrides)).data.train
        drawn = _dev_splits(cfg, [1.0], unswept=True)
        splits = sorted(s[2:] for s in drawn if s[0] == data_key(train)) or (
            sorted(s[2:] for s in drawn) if names_manifest(train) else [])
    except ConfigError:
        return []
    return [f"probe.dev_split=[{splits[0][0]},{splits[0][1]}]"] if splits else []


# a tool's key naming the encoder its stage starts from, and the metrics.json key of that file's sha256
STARTS_FROM = {"linear_probe": ("probe.encoder", "encoder_sha256"), "finetune": ("finetune.init", "init_sha256")}


def validate(cfg: CompareConfig, stages: list[Stage], machine: bool = True) -> dict[Path, Config]:
    """Resolve every stage config now as its tool will (mpp-finetune's defaults included), so a bad
    key fails before hours of work; check that no two stages share a folder, what each trainer
    would check at its start (`_check_training`), that each pre-training trains its arm's
    objective, that each fine-tune has test images, that the probes and final fine-tunes are scored
    on one test set (`mpp.specs.val_key`, as the report requires), and that each probe and
    fine-tune normalises its inputs as its encoder's pre-training did. The data are checked once
    made (`check_data`).
    `machine` False (a dry run, which may plan for another machine) leaves out what this machine
    must offer: the launcher's command, a GPU for fp16. Returns each stage's resolved config, by
    its folder (run-time choices as their placeholders)."""
    for key in ("overrides", "pretrain_overrides"):
        unparsed = next((o for o in as_list(getattr(cfg, key)) if o.lstrip().startswith(("[", "{"))), None)
        if unparsed is not None:
            raise ConfigError(f"compare config key '{key}' did not read as a YAML list ({unparsed!r}); quote each item "
                              f"that holds braces or commas, e.g. '{key}=[\"data.val=d/{{000000..000009}}.tar\"]'")
        try:
            parse_overrides(as_list(getattr(cfg, key)))
        except ConfigError as e:
            raise ConfigError(f"compare config key '{key}': {e}") from None
    resolved, named = {}, {}
    for s in stages:
        if s.out in named:
            raise ConfigError(f"stages '{named[s.out]}' and '{s.name}' would both write to {s.out}; give label_fractions "
                              "and sweep values that differ (in the folder names they give too)")
        named[s.out] = s.name
        try:
            resolved[s.out] = s.settings(resolved=False)
        except ConfigError as e:
            raise ConfigError(f"stage '{s.name}' ({s.config}): {e}") from None
    _check_training(cfg, stages, resolved, machine)
    points: dict[tuple, str] = {}
    for s in stages:  # two spellings of one value ('0.01', 0.010) would train one recipe twice, a false toss-up
        if s.out.name.startswith("sweep_"):
            same = {k: v for k, v in flatten(to_dict(resolved[s.out])).items() if k != "output_dir"}
            key = (s.out.parent, json.dumps(same, sort_keys=True, default=str))
            if key in points:
                raise ConfigError(f"stages '{points[key]}' and '{s.name}' resolve to the same settings: the sweep "
                                  "names one value twice; give each value once")
            points[key] = s.name
    for s in stages:  # each stage trains what its arm needs, and a fine-tune has test images
        c, need = resolved[s.out], {"pretrain": s.arm, "finetune": "classify"}.get(s.tool)
        if need and c.objective != need:
            raise ConfigError(f"stage '{s.name}' ({s.config}) resolves to objective={c.objective}, not {need}; give "
                              f"the compare config's '{s.arm if s.tool == 'pretrain' else 'finetune'}' a config of "
                              f"objective {need}, and no objective= in its overrides")
        if s.tool in ("finetune", "linear_probe") and not c.data.val:
            raise ConfigError(f"stage '{s.name}' ({s.config}) has no data.val, the test images its "
                              f"{'final fine-tunes are' if s.tool == 'finetune' else 'probe is'} scored on; set data.val")
        if s.tool == "finetune" and cfg.sweep and c.finetune.dev_fraction == 0 and c.finetune.pool == "auto":
            raise ConfigError(f"stage '{s.name}' ({s.config}) resolves to finetune.pool=auto, so it would choose its "
                              "representation on its own training labels, which a supervised pre-training fitted; "
                              "set the compare config's finetune_pool: auto (chosen on the development split), sweep "
                              "finetune.pool over token and avg, or give finetune.pool token or avg")
    # the probes and final fine-tunes: the report refuses gaps between other test images
    if two := two_test_sets((resolved[s.out].data.val, resolved[s.out].data.val_num_samples, s.name) for s in stages
                            if s.tool == "linear_probe"
                            or (s.tool == "finetune" and resolved[s.out].finetune.dev_fraction == 0)):
        (a, first), (b, second) = two
        raise ConfigError(f"stages '{first}' and '{second}' would be scored on different test sets (data.val {a} "
                          f"and {b}), and the report refuses gaps between other images; give every probe and "
                          "fine-tune one data.val")
    if not cfg.sweep:  # a final may choose on its own labels; a sweep of one value chooses on a withheld split
        _warn_own_label_choices(stages, resolved)
    _warn_short_withhold(cfg, stages, resolved)
    for s in stages:  # an encoder fed other inputs than it was trained on would stop its stage hours in
        c = resolved[s.out]
        up = resolved.get(Path(flatten(to_dict(c))[STARTS_FROM[s.tool][0]])) if s.tool in STARTS_FROM else None
        if up is not None and (tuple(up.data.mean), tuple(up.data.std)) != (tuple(c.data.mean), tuple(c.data.std)):
            raise ConfigError(f"stage '{s.name}' ({s.config}) normalises its inputs with data.mean={list(c.data.mean)} "
                              f"data.std={list(c.data.std)}, but its encoder is pre-trained with data.mean="
                              f"{list(up.data.mean)} data.std={list(up.data.std)}; give both configs the same")
    return resolved


def _warn_short_withhold(cfg: CompareConfig, stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """Warn where `pretrain_overrides` gave a pre-training a data.withhold that lists some of the
    development splits its comparison chooses on but not all: those recipes would be chosen on
    images it trained on (an empty list is a plain choice, which the report states)."""
    probe = _probe_dev(cfg, _probe_split(cfg))
    chosen = _dev_splits(cfg) | ({probe} if probe else set())
    for s in stages:
        c = resolved[s.out]
        if s.tool != "pretrain" or not c.data.withhold:
            continue
        given = {dev_split(*w) for w in c.data.withhold}
        short = sorted(split for key, *drawn in chosen if key == data_key(c.data.train)
                       and (split := dev_split(*drawn)) not in given)
        if short:
            print(f"warning: stage '{s.name}' withholds data.withhold={[list(w) for w in c.data.withhold]} but not the "
                  f"development split(s) {[list(w) for w in short]} that fine-tunes or probes choose on: recipes "
                  "chosen there are chosen on images it trained on; give every split, or leave data.withhold to the "
                  "comparison", file=sys.stderr)


def _warn_own_label_choices(stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """Without a sweep, warn where a supervised arm's final fine-tune chooses its representation or
    its starting head's L2 on its own training labels, which that arm's pre-training fitted."""
    fitted = {data_key(resolved[s.out].data.train) for s in stages if s.tool == "pretrain" and s.arm == "supervised"}
    for s in stages:
        c = resolved[s.out]
        if s.tool == "finetune" and s.arm == "supervised" and data_key(c.data.train) in fitted and (
                c.finetune.pool == "auto" or (c.finetune.head_init == "probe" and c.finetune.head_l2 == 0)):
            print(f"warning: stage '{s.name}' chooses its representation (finetune.pool=auto) or its starting "
                  "head's L2 (finetune.head_init=probe) on a held-out part of its own training labels, which the "
                  "supervised pre-training fitted; give a sweep, of one value if need be (e.g. 'sweep={optim.lr: "
                  f"[{c.optim.lr:g}]}}'), to choose them on a development split the pre-trainings "
                  "withhold", file=sys.stderr)
            return


def launcher_words(launcher: str, machine: bool = True) -> list[str]:
    """The command a stage runs under ([] for this Python): `launcher` split as a shell would, its
    variables ($NAME, ${NAME}, quoted or not) expanded from this environment (stages run without a
    shell). One that does not split, uses another $ form, or (`machine`) whose command is not on
    this machine's PATH or that names a variable not set here, is a ConfigError (without
    `machine`, as for a dry run, an unset one is left as written)."""
    try:
        words = shlex.split(launcher)
    except ValueError as e:
        raise ConfigError(f"compare config key 'launcher' ({launcher!r}) does not split into words ({e}); "
                          "close its quotes") from None
    def expand(m: re.Match) -> str:
        name = m[1] or m[2]
        if not name:
            raise ConfigError(f"compare config key 'launcher' has {m.string!r}: only $NAME and ${{NAME}} are expanded "
                              "(stages run without a shell); give the value itself")
        if machine and name not in os.environ:
            raise ConfigError(f"compare config key 'launcher' names ${name}, a variable not set here; run the "
                              "comparison where it is set (inside the job) or give its value")
        return os.environ.get(name, m[0])
    words = [re.sub(r"\$(?:(\w+)|\{(\w+)\}|)", expand, w) for w in words]
    if machine and words and shutil.which(words[0]) is None:
        raise ConfigError(f"compare config key 'launcher' names {words[0]!r}, which is no command on PATH; give one "
                          "such as 'torchrun --nproc_per_node 2', or '' for this Python")
    return words


def _counts(words: list[str]) -> dict[str, str]:
    """The values a launcher's `words` give its count flags (--flag=V or --flag V; dashes in a
    name read as underscores): torchrun's --nnodes and --nproc_per_node, accelerate launch's
    --num_processes."""
    given = {}
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        name = flag.lstrip("-").replace("-", "_")
        if flag.startswith("-") and name in ("num_processes", "nproc_per_node", "nnodes"):
            given[name] = value or (words[i + 1] if i + 1 < len(words) else "")
    return given


def _processes(words: list[str]) -> int:
    """The processes a launcher's `words` start per stage, where they say as numbers (all machines
    together); 1 otherwise (this Python, or counts the launcher decides at run time)."""
    given = {k: int(v) for k, v in _counts(words).items() if v.isdigit()}
    if "num_processes" in given:
        return max(given["num_processes"], 1)
    return max(given.get("nnodes", 1) * given.get("nproc_per_node", 1), 1)


def _stated_processes(words: list[str]) -> int | None:
    """`_processes` where the launcher's `words` state every count they give as a number (or are
    none: this Python, one process); None where it decides at run time (`--nproc_per_node gpu`, an
    accelerate config file, `--nnodes $SLURM_NNODES` unexpanded)."""
    if not words:
        return 1
    given = _counts(words)
    return _processes(words) if given and all(v.isdigit() for v in given.values()) else None


def _check_training(cfg: CompareConfig, stages: list[Stage], resolved: dict[Path, Config], machine: bool) -> None:
    """What each trained stage's trainer checks at its own start (`mpp.runtime.check_run_settings`,
    over the launcher's processes; `machine`: with what this machine offers), checked before the
    first; and the scratch arm built as the pre-trained encoders are (else it is no baseline for
    them). A warmup as long as a stage's run is worth a warning (`mpp.optim.warmup_note`)."""
    from mpp.models import preset_geometry
    from mpp.runtime import check_run_settings  # here: it imports torch, planning does not
    procs = _processes(launcher_words(cfg.launcher, machine))
    models = {}
    for s in stages:
        c = resolved[s.out]
        if s.tool == "pretrain":
            models.setdefault(s.pretrain_seed, (s.name, c.model, preset_geometry(c.model, c.img_size)[0]))
        if s.tool in ("pretrain", "finetune"):
            try:
                check_run_settings(c, procs, machine)
            except ConfigError as e:
                raise ConfigError(f"stage '{s.name}' ({s.config}): {e}") from None
    for s in stages:
        c = resolved[s.out]
        first, model, size = models.get(s.pretrain_seed, ("", c.model, 0))
        if s.tool != "pretrain" and s.arm != "scratch":
            continue  # loads a pre-trained encoder, at its own resolution unless img_size is given
        if c.model != model:
            raise ConfigError(f"stage '{s.name}' ({s.config}) builds model={c.model}, but '{first}' pre-trains "
                              f"model={model}; every arm must train the same encoder: give the stage configs the same "
                              "model")
        built = preset_geometry(c.model, c.img_size)[0]
        if size and built != size and (s.tool == "pretrain" or not c.img_size):
            raise ConfigError(f"stage '{s.name}' ({s.config}) builds its encoder at {built} px, but '{first}' "
                              f"pre-trains at {size} px, which the pre-trained arms' stages keep; every arm must see "
                              f"images of one size: give the stage configs img_size={size}, or the pre-trainings "
                              f"img_size={built}")
    late = next(((s, c) for s in stages if s.tool in ("pretrain", "finetune")
                 and 1 <= (c := resolved[s.out]).steps <= c.optim.warmup_steps), None)
    if late is not None:
        from mpp.optim import warmup_note  # here: it imports torch
        print(f"warning: stage '{late[0].name}': {warmup_note(late[1], late[1].steps)}", file=sys.stderr)


def check_data(stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """After the data are made and before the first stage: every data set a stage will read
    resolves (it exists, a shard list or pattern has its count), and each trained stage's samples
    can be drawn as its loader will draw them (a fine-tune's label subset and development split, a
    pre-training's withheld splits), so that a typo in a probe's or fine-tune's data, or in the
    few-shot sets a trained stage watches (fewshot.every), fails now, not after the pre-trainings.
    `resolved`: `validate`'s configs of the stages."""
    from mpp.data.decode import DataError
    from mpp.data.sources import check_same_classes
    from mpp.data.loader import select_shards
    from mpp.evaluators.fewshot import Evaluator as FewshotEvaluator
    from mpp.objectives import OBJECTIVES  # here: it imports torch, planning does not
    done = set()
    for s in stages:
        c = resolved[s.out]
        trained = OBJECTIVES[c.objective] if s.tool in ("pretrain", "finetune") else None
        # data.train as the stage's loader reads it: (labeled, subset, withhold, repeats)
        if trained:
            how = (trained.labeled, trained.subset(c), c.data.withhold, c.data.resampled)
        elif s.tool == "linear_probe" and c.probe.dev_split:  # the probe's development split
            how = (True, (1.0, *c.probe.dev_split, True), (), False)
        else:
            how = (False, None, (), False)
        reads = [(c.data.train, c.data.num_samples, *how)]
        # data.val: the test images of probes and fine-tunes, and the figures' images (the first MPP pre-training's)
        if c.data.val and (s.tool != "pretrain" or (s.arm == "mpp" and s.pretrain_seed == 0)):
            reads.append((c.data.val, c.data.val_num_samples, False, None, (), False))
        try:
            for spec, n, labeled, subset, withhold, repeats in reads:
                key = json.dumps([spec, n, labeled, subset, withhold, repeats])
                if key not in done:
                    select_shards(spec, n, labeled, subset, withhold, repeats)
                    done.add(key)
            if s.tool in ("linear_probe", "finetune"):  # as each checks its test images' classes at its start
                check_same_classes(c.data.train, c.data.val, c.data.val_num_samples)
            if trained and c.fewshot.every:  # the trainer's few-shot evaluator: its sets, as it checks them
                FewshotEvaluator(c, "cpu")
        except (DataError, ValueError) as e:
            raise DataError(f"stage '{s.name}' ({s.config}): {e}") from None
    _check_shards_apart(stages, resolved)


def _check_shards_apart(stages: list[Stage], resolved: dict[Path, Config]) -> None:
    """What the shards each stage names must keep apart, once the data are made: no stage learns
    from a shard that a fine-tune or probe is tested on (a typo would report figures of training
    images as test figures, a supervised pre-training on them would fit the test labels); and a
    pre-training withholds the development splits drawn from the data it names the same way
    (`data_key`), so one that reads those shards under another name (a brace pattern over a
    manifest's tars) would train on them, and is refused."""
    from mpp.data.decode import DataError
    from mpp.data.sources import resolve, shard_names

    read: dict[str, set[str]] = {}

    def files(spec, n: int) -> set[str]:  # the shards a data spec names, each data read once
        key = data_key(spec)
        if key not in read:
            read[key] = shard_names(resolve(spec, n or 1))
        return read[key]
    tests = {data_key(c.data.val): (s, c) for s in stages if s.tool in ("finetune", "linear_probe")
             for c in [resolved[s.out]] if c.data.val}
    for s in stages:
        c = resolved[s.out]
        for t, tc in tests.values():
            if files(c.data.train, c.data.num_samples) & files(tc.data.val, tc.data.val_num_samples):
                raise DataError(f"stage '{s.name}' ({s.config}) learns from data.train {c.data.train!r}, which holds "
                                f"test images of stage '{t.name}' (data.val {tc.data.val!r}); test on shards that no "
                                "stage trains on")
    chosen = {data_key(c.data.train): c for s in stages for c in [resolved[s.out]]
              if (s.tool == "finetune" and c.finetune.dev_fraction > 0) or (s.tool == "linear_probe" and c.probe.dev_split)}
    for s in (s for s in stages if s.tool == "pretrain"):
        c = resolved[s.out]
        for key, dev in chosen.items():
            if key != data_key(c.data.train) and (files(c.data.train, c.data.num_samples)
                                                  & files(dev.data.train, dev.data.num_samples)):
                raise DataError(f"stage '{s.name}' ({s.config}) trains on data.train {c.data.train!r}, the shards of "
                                f"{dev.data.train!r} under another name, so the development splits drawn from those "
                                "cannot be withheld from it; name both data the same way (the manifest)")


def check_unchanged(stage: Stage, finished: bool = True) -> None:
    """A finished stage (or, `finished` False, an interrupted one about to resume from its
    checkpoint) must have run with the settings planned now (its run-time choices read from the
    finished stages before it); else resuming would report a result of other settings, or train on
    from weights trained with them (`mpp.config.changed_settings`: keys of speed and logging alone
    may differ)."""
    state = "finished" if finished else "was interrupted"
    changed = changed_settings(stage.out / "config.yaml", stage.settings())
    if changed is None:
        raise ConfigError(f"stage '{stage.name}': {stage.out} has a {'metrics.json' if finished else 'checkpoint'} "
                          f"but no config.yaml this mpp can read, so what it ran is unknown; delete {stage.out} "
                          "to run it again")
    if changed:
        raise ConfigError(f"stage '{stage.name}' {state} earlier in {stage.out} with other settings ("
                          f"{said(changed)}): delete {stage.out} and "
                          "the stages that used it to run them with these, or set another output_dir")


def check_processes(stage: Stage, processes: int | None) -> None:
    """A finished trained stage must have run on as many processes as the launcher starts now
    (`processes`; None: a count it decides at run time, unchecked): they split each batch and the
    data, so another count trains on another order (as a checkpoint's resume refuses). A
    metrics.json of an older mpp records none and is reused."""
    ran = _metrics(stage.out).get("processes") if stage.tool in ("pretrain", "finetune") else None
    if processes is not None and isinstance(ran, int) and ran != processes:
        raise ConfigError(f"stage '{stage.name}' finished earlier in {stage.out} on {ran} process(es); the launcher "
                          f"now starts {processes}, which would split its data otherwise: give the launcher it ran "
                          f"with, or delete {stage.out} and the stages that used it to run them on {processes}")


def _checkpointed(out: Path) -> bool:
    """Whether an interrupted stage left a checkpoint that its `train.resume=auto` would train on from."""
    from mpp.checkpoint import list_checkpoints  # here: it imports torch, planning does not
    return bool(list_checkpoints(out / "checkpoints"))


def check_encoder(stage: Stage, digests: dict[Path, str]) -> None:
    """A finished probe or fine-tune must have started from the encoder file there now, else
    resuming would report it as the result of an encoder trained again since (its stage deleted
    and run again). Checked when the stage is reached, after the stages before it have made their
    encoders; `digests` keeps each file's sha256, so that it is read once per comparison. A stage
    whose metrics.json records no digest (made by an older mpp) is reused with a warning."""
    if stage.tool not in STARTS_FROM:
        return
    from mpp.models import encoder_digest, encoder_file  # here: mpp.models imports torch, planning does not
    key, recorded = STARTS_FROM[stage.tool]
    path = flatten(to_dict(stage.settings()))[key]
    if path == "none":  # a random init
        return
    metrics = _metrics(stage.out)
    if recorded not in metrics:
        print(f"warning: stage '{stage.name}' ({stage.out}) records no digest of its encoder, so it cannot be verified "
              f"to have started from {encoder_file(path)}; delete {stage.out} to run it again", file=sys.stderr)
        return
    file = encoder_file(path).resolve()
    if not file.is_file():
        raise ConfigError(f"stage '{stage.name}' finished earlier in {stage.out} from {file}, which is gone: delete "
                          f"the stage that made it ({Path(path)}) and the stages that started from it, "
                          "to run them again")
    if file not in digests:
        digests[file] = encoder_digest(file)
    if metrics[recorded] != digests[file]:
        raise ConfigError(f"stage '{stage.name}' finished earlier in {stage.out} from another encoder than {file} "
                          f"now (its sha256 differs): delete {stage.out}, and the other stages that started from that "
                          "encoder, to run them again from this one")


def prepare_data(cfg: CompareConfig) -> None:
    """Make the data sets the stages read, unless their manifests already exist; one made from
    another source that exists (or, synthetic, with other sizes) is refused: the finished stages
    read it, and their configs, which name only its folder, would not tell. A folder that a
    cut-off write left without its manifest is written again."""
    from mpp.data.writer import write_shards
    p = cfg.prepare
    again = "delete it and every stage of the comparison that read it, or give another folder"
    if p.synthetic:
        from mpp.data.synthetic import OtherSettings, make_synthetic
        print(f"[data] the synthetic data set at {p.synthetic}", flush=True)
        try:
            make_synthetic(p.synthetic, train=p.synthetic_train, test=p.synthetic_test)
        except OtherSettings as e:
            raise ConfigError(f"prepare.synthetic: '{e.path}' holds a synthetic set made with other settings "
                              f"({e.other}); {again}") from None
    for src, out in zip(as_list(p.shards_src), as_list(p.shards_out)):
        manifest = Path(out) / "manifest.json"
        if manifest.exists():
            source = _made(manifest).get("source")  # where it was made: moved since, or another machine's
            if isinstance(source, str) and os.path.exists(source) and os.path.exists(src) \
                    and not os.path.samefile(source, src):
                raise ConfigError(f"prepare.shards_out '{out}' holds the shards of {source}, not of "
                                  f"prepare.shards_src '{src}'; {again}")
            continue
        print(f"[data] writing shards of {src} to {out}", flush=True)
        write_shards(src, out, overwrite=True)


def _made(manifest: Path) -> dict:
    """A manifest's record of how it was made ({} for one that keeps none, or is not JSON: the
    stages that read it say what is wrong with it)."""
    try:
        made = json.loads(manifest.read_text()).get("made")
    except (OSError, ValueError, AttributeError):
        return {}
    return made if isinstance(made, dict) else {}


def _tool_main(module: str, argv: list[str]) -> None:
    """In a stage's process: run a tool module as `python -m module argv...` would, and die with the
    comparison (the process is the forkserver's child, so nothing else ends it when the comparison
    is killed: it trained on, orphaned, holding its run directory). Ctrl-C ends it quietly (exit 130,
    `QUIET_INTERRUPT`): the comparison's line names the stage and how to resume."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver's SIG_IGN (`_start_forkserver`) is not the stage's
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_die_with, args=(parent.sentinel,), daemon=True).start()
    sys.argv = [module, *argv]
    os.environ[QUIET_INTERRUPT] = "1"  # its Ctrl-C line would say less than the comparison's
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _die_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # ready when the comparison's process has ended
    os.kill(os.getpid(), signal.SIGKILL)  # checkpoints and metrics.json are written atomically


def _start_forkserver() -> None:
    """Start Python's forkserver, once, ignoring SIGTERM (kept across its exec): a scheduler's
    SIGTERM to the whole process group ended it, the comparison then read the stage it had served
    as ended (exit 255), stopped, and took the stage down before its checkpoint. Each stage restores
    the default (`_tool_main`); the server still ends with the comparison (its pipe closes)."""
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, old)


def run_stage(cmd: list[str], launcher: str) -> int:
    """Run one stage's command in a process of its own; its exit code. Without a launcher the
    process is forked from a server that imported the training and evaluation code once (Python's
    forkserver), so a stage does not pay the seconds of importing torch, timm and accelerate again;
    the server runs no torch operation, so each stage still starts from a clean state. A SIGTERM to
    the comparison goes on to the stage, whose trainer saves a checkpoint and stops (`mpp.train`);
    the stage's end then raises `StageTerminated`."""
    if launcher:  # the launcher (torchrun) gets SIGTERM when the comparison dies, and stops its ranks
        with subprocess.Popen(cmd, preexec_fn=lambda: follow_parent(signal.SIGTERM),
                              env={**os.environ, QUIET_INTERRUPT: "1"}) as proc, \
                _passing_sigterm(proc) as passed:
            try:
                code = proc.wait()
            except BaseException:  # Ctrl-C: a terminal's reached the launcher too, a lone kill -INT did not
                _stop(proc)
                raise
    else:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["mpp.train", "mpp.evaluators.linear_probe"])
        _start_forkserver()
        proc = ctx.Process(target=_tool_main, args=(cmd[2], cmd[3:]))  # cmd: python -m module ...
        proc.start()
        try:
            with _passing_sigterm(proc) as passed:
                proc.join()
        except KeyboardInterrupt:  # the stage got Ctrl-C too: it ends first, so its last lines come first
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            raise
        code = proc.exitcode
    if passed:
        raise StageTerminated(code)
    return code


def _killed(code: int) -> str:
    """What a stage's exit code says beyond its own output: a stage killed by a signal (a negative
    code) printed no cause, and its cut-off progress bar holds the line, which is ended here."""
    if code >= 0:
        return ""
    print(file=sys.stderr, flush=True)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f" (killed by {name}{', as the out-of-memory killer does' if -code == signal.SIGKILL else ''})"


STOP_GRACE_S = 30.0  # from a stage's SIGTERM to its SIGKILL (`_stop`)


def _stop(launcher: subprocess.Popen, first: float = 5.0) -> None:
    """End a stage's launcher and its ranks: `first` seconds to end on its own (a terminal's
    Ctrl-C reached it too), then SIGTERM (torchrun and accelerate pass it on, and the trainers save
    a checkpoint), then, STOP_GRACE_S on, SIGKILL; a rank left behind (a launcher that does not
    pass it on, as accelerate's one-process launch before 1.x) gets the same, where a SIGKILL at
    once would leave it training on, orphaned. Another Ctrl-C meanwhile kills them at once."""
    try:
        ranks = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:  # it has ended already
        ranks = []
    print(f"stopping the stage's launcher and its ranks (up to {first + 2 * STOP_GRACE_S:.0f} s; "
          "Ctrl-C again kills them)",
          file=sys.stderr, flush=True)
    try:
        try:
            launcher.wait(timeout=first)
        except subprocess.TimeoutExpired:
            launcher.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=STOP_GRACE_S)
        left = [r for r in ranks if r.is_running()]
        for rank in left:
            with contextlib.suppress(psutil.Error):
                rank.terminate()
        psutil.wait_procs(left, timeout=STOP_GRACE_S)
    except KeyboardInterrupt:
        pass
    for proc in ranks:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    launcher.kill()
    launcher.wait()


class StageTerminated(Exception):
    """The comparison got a SIGTERM, passed it on to its stage, and the stage ended (`code`: 143
    when its trainer saved a checkpoint, `mpp.train.Terminated`)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _passing_sigterm(proc):
    """While the stage `proc` runs, a SIGTERM to the comparison is sent on to it (the comparison
    waits for it to end, instead of ending at once and taking it down before its checkpoint);
    yields a list that records each one passed on."""
    passed: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield passed
        return

    def pass_on(signum, frame):
        passed.append(signum)
        proc.terminate()  # SIGTERM; nothing once the stage has ended

    old = signal.signal(signal.SIGTERM, pass_on)
    try:
        yield passed
    finally:
        signal.signal(signal.SIGTERM, old or signal.SIG_DFL)


SPLIT = ("set-up", "begin", "training loop", "final evaluation", "export", "process start and exit")


def time_split(out: Path, took: float) -> list[float] | None:
    """A trained stage's `took` seconds split (SPLIT) as its process timed them in metrics.json:
    set-up (device, model, data), begin (the Task's work before the first step: a fine-tune's probe
    head, fitted or read from the cache, and its start's score), training loop, final evaluation,
    the rest of training (the export), and outside it the process's start and exit (what a stage
    pays for being a process of its own). None for a stage without those figures (a probe)."""
    try:
        m = json.loads((out / "metrics.json").read_text())
        parts = [m["setup_s"], m["begin_s"], m["loop_s"], m["final_eval_s"]]
        return [*parts, m["segment_s"] - sum(parts), took - m["segment_s"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _seconds(took: float, split: list[float] | None) -> str:
    """'3.5 s (set-up 0.4, begin 1.0, training loop 1.9, ... s)', or '3.5 s' without a split."""
    parts = "" if split is None else " (" + ", ".join(f"{n} {v:.1f}" for n, v in zip(SPLIT, split)) + " s)"
    return f"{took:.1f} s{parts}"


def run(cfg: CompareConfig, dry_run: bool = False) -> Path:
    """Run (or resume) the comparison; returns the report path."""
    stages = plan(cfg)
    resolved = validate(cfg, stages, machine=not dry_run)
    launcher = launcher_words(cfg.launcher, machine=False) or [sys.executable]
    total = len(stages) + 2
    if dry_run:  # every step the run takes, the first and last too
        made = (f"{cfg.prepare.synthetic} (synthetic)" if cfg.prepare.synthetic
                else ", ".join(as_list(cfg.prepare.shards_out)) or "none: the stages' own")
        print(f"[1/{total}] data: made where missing ({made}), then every set the stages read is checked")
        for i, s in enumerate(stages, 2):
            print(f"[{i}/{total}] {s.name}: {shlex.join(s.command(launcher, resolved=False))}")
            for c in s.choices:
                print(f"    chosen when it starts: {c.what} (shown: {' '.join(c.placeholder)})")
            if s.when:
                print(f"    runs only if {s.when.what}")
        print(f"[{total}/{total}] figures and report")
        return Path(cfg.output_dir) / "report.md"
    print(f"[1/{total}] data", flush=True)
    prepare_data(cfg)
    words = launcher_words(cfg.launcher)
    check_data(stages, resolved)
    for s in stages:  # a stage with run-time choices is checked when reached: they read stages before it
        if (s.out / "metrics.json").exists():
            check_processes(s, _stated_processes(words))
            if not s.choices:
                check_unchanged(s)
    digests: dict[Path, str] = {}
    spent: list[tuple[float, list[float]]] = []  # (took, split) of the stages trained now
    stale: set[Path] = set()  # conditional stages finished earlier whose condition no longer holds
    for i, s in enumerate(stages, 2):
        if (s.out / "metrics.json").exists() and s.when and not s.when.holds():  # e.g. a sweep run again since
            print(f"[{i}/{total}] {s.name}: not needed now (it runs only if {s.when.what}); its earlier result in "
                  f"{s.out} is left out of the report", flush=True)
            stale.add(s.out)
            continue
        if (s.out / "metrics.json").exists():
            if s.choices:
                check_unchanged(s)
            check_encoder(s, digests)
            print(f"[{i}/{total}] {s.name}: done earlier ({s.out})", flush=True)
            continue
        if s.when and not s.when.holds():
            print(f"[{i}/{total}] {s.name}: not needed (it runs only if {s.when.what})", flush=True)
            continue
        if _checkpointed(s.out):  # it would resume from weights trained with the settings it ran with
            check_unchanged(s, finished=False)
        t0 = time.time()
        cmd = s.command(launcher)
        chosen = s.chosen()
        print(f"[{i}/{total}] {s.name} -> {s.out}" + (f" (chosen: {' '.join(chosen)})" if chosen else ""), flush=True)
        passed = False  # a SIGTERM of the comparison's own, passed on to the stage
        try:
            code = run_stage(cmd, cfg.launcher)
        except KeyboardInterrupt:  # exit 130, as every tool's Ctrl-C (mpp.cli.one_line_errors)
            print(f"error: interrupted during stage '{s.name}'; run the same command again to resume "
                  "(finished stages and checkpoints are kept)", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except StageTerminated as e:
            code, passed = e.code, True
        if passed or code == 128 + signal.SIGTERM:  # 143: the stage's trainer saved a checkpoint (mpp.train)
            ended = "which saved its checkpoint" if code == 128 + signal.SIGTERM else f"which ended with exit {code}"
            print(f"error: SIGTERM during stage '{s.name}', {ended}; run the same command again to resume "
                  "(finished stages and checkpoints are kept)", file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGTERM)
        if code != 0:
            raise RuntimeError(f"stage '{s.name}' failed{_killed(code)}; fix the cause and run the same command "
                               f"again to resume (finished stages are kept). Command: {shlex.join(cmd)}")
        took = time.time() - t0
        split = time_split(s.out, took)
        if split is not None:
            spent.append((took, split))
        print(f"[{i}/{total}] {s.name}: finished in {_seconds(took, split)}", flush=True)
    from mpp.figures.inspection import write_compare_figures
    from mpp.report import write_report
    if spent:  # where this run's training time went, summed over its trained stages
        print(f"the {len(spent)} stages trained now took " + _seconds(sum(t for t, _ in spent),
                                                                    [sum(p) for p in zip(*(v for _, v in spent))]))
    print(f"[{total}/{total}] figures and report", flush=True)
    write_compare_figures([s.out for s in stages if s.tool == "pretrain" and s.pretrain_seed == 0], None,
                          Path(cfg.output_dir) / "figures")
    ran = [s for s in stages if (s.out / "metrics.json").exists() and s.out not in stale]  # all but those not needed
    scratch = [s.out for s in ran if s.arm == "scratch"]
    repeats = [write_report([s.out for s in ran if s.pretrain_seed == seed] + scratch, repeat_dir(cfg, seed), [])
               for seed in range(1, cfg.pretrain_seeds)]  # each pre-training seed's own report, scratch shared
    write_report([s.out for s in ran if s.pretrain_seed == 0], Path(cfg.output_dir), repeats)  # links the figures
    return Path(cfg.output_dir) / "report.md"
