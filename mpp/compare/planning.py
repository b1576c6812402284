"""The plan: the stages of a comparison in run order (`plan`: each a `Stage`, its tool, config,
overrides and folder), the run-time `Choice`s and `Condition`s that read the finished stages'
metrics.json (the best sweep value and its head's L2, a toss-up, the representation), where each
pre-training seed's comparison writes (`repeat_dir`), and the development splits that the sweeps
and the probes choose on and the pre-trainings withhold (`dev_splits`, `probe_split`). What the
comparison will run, decided from its config (and, as a stage starts, from the stages before it);
what it checks before running it is `mpp.compare.checks`, how it runs a stage
`mpp.compare.stages`.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mpp import outcomes
from mpp.config import TOOL_DEFAULTS, CompareConfig, Config, ConfigError, as_list, load_config
from mpp.gaps import choice_lead, dev_rank, pool_choice
from mpp.specs import data_key, names_manifest

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


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _ranked(outs: list[Path]) -> list[tuple[int, dict]]:
    """(index, metrics) of the sweep stages from the best top-1 on the development split down
    (`mpp.gaps.dev_rank`)."""
    ms = [metrics(out) for out in outs]
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
    sweep stage ranked `rank` chose on its development split (or in folds, finetune.pool_folds) for
    representation `pool` (default: its own), so that the finals choose nothing on their training
    labels, most of which a supervised pre-training fitted; none where that stage fitted no probe
    head for it, nor where its head started at zero (finetune.pool=auto then fits a probe only to
    choose the representation)."""
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
    probe_dev_split = probe_split(cfg)
    stages = [Stage(f"pre-train {kind}{again}", "pretrain", getattr(cfg, kind),
                    common + _withheld(cfg, getattr(cfg, kind), probe_dev_split) + as_list(cfg.pretrain_overrides)
                    + seeded, out, pretrain_seed=pretrain_seed, arm=kind)
              for kind, out in pre.items()]
    for arm in sorted(arms, key=("mpp", "supervised", "scratch").index):
        stages.append(Stage(f"linear probe {arm}{again}", "linear_probe", cfg.probe,
                            probe_dev_split + common + [f"probe.encoder={pre.get(arm, 'none')}"], root / f"probe_{arm}",
                            pretrain_seed=pretrain_seed, arm=arm))
    for frac in cfg.label_fractions:
        pct, points = f"{frac * 100:g}pct", grid_points(cfg.sweep_at(frac))
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
                           lambda outs=outs, points=points: best_point(points, outs))] if sweep else []
            # the representation that the best (the second-best) sweep stage chose on its labels
            pools = [Choice(f"finetune.pool: the {nth} sweep stage's, chosen by a probe of its labels",
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
                                points[1], lambda outs=outs, points=points: best_point(points, outs, rank=1))
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


def dev_splits(cfg: CompareConfig, fractions=None, unswept: bool = False) -> set[tuple]:
    """(data.train's `data_key`, label_fraction, split_seed, dev_fraction) of every development split
    the fine-tune sweeps draw at `fractions` (default: the label fractions), as their configs
    resolve; none without a sweep, unless `unswept` (the split a sweep would draw, for the probes).
    A config that does not load raises its ConfigError."""
    common, splits = as_list(cfg.overrides), set()
    for frac in cfg.label_fractions if fractions is None else fractions:
        for point in grid_points(cfg.sweep_at(frac)) if cfg.sweep or unswept else []:
            f = load_config(cfg.finetune, common + cfg.fraction_overrides.get(frac, [])
                            + [f"finetune.label_fraction={frac}"] + point
                            + [f"finetune.dev_fraction={cfg.dev_fraction}"], defaults=TOOL_DEFAULTS["finetune"])
            splits.add((data_key(f.data.train), f.finetune.label_fraction, f.finetune.split_seed,
                        f.finetune.dev_fraction))
    return splits


def probe_dev(cfg: CompareConfig, split: list[str]) -> tuple | None:
    """The development split every linear probe chooses its representation and L2 on, as the probe
    stages resolve it (`split`, the override `probe_split` gives, or what the comparison's
    `overrides` give instead), in `dev_splits`' terms for `_withheld`; None where they have none."""
    p = load_config(cfg.probe, split + as_list(cfg.overrides))
    return (data_key(p.data.train), 1.0, *p.probe.dev_split) if p.probe.dev_split else None


def _withheld(cfg: CompareConfig, pretrain_config: str, split: list[str]) -> list[str]:
    """The pre-training override that leaves out every development split the fine-tune sweeps and
    the probes (`probe_dev` of `split`) choose on from its training set (`data.withhold`), so that no swept
    value, nor a fine-tune's or a linear probe's representation, is chosen on images a
    pre-training trained on (the supervised one with their labels). Nothing for a pre-training on
    other data, or where nothing is chosen on a split; `pretrain_overrides` come after it (and
    `data.withhold=[]` there turns it off). A config that does not load is left to
    `validate`, which names its stage."""
    try:
        train = load_config(pretrain_config, as_list(cfg.overrides) + as_list(cfg.pretrain_overrides)).data.train
        probe = probe_dev(cfg, split)
        splits = sorted(s[1:] for s in dev_splits(cfg) | ({probe} if probe else set()) if s[0] == data_key(train))
    except ConfigError:
        return []
    return [f"data.withhold={[list(s) for s in splits]}".replace(" ", "")] if splits else []


def probe_split(cfg: CompareConfig) -> list[str]:
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
        drawn = dev_splits(cfg, [1.0], unswept=True)
        splits = sorted(s[2:] for s in drawn if s[0] == data_key(train)) or (
            sorted(s[2:] for s in drawn) if names_manifest(train) else [])
    except ConfigError:
        return []
    return [f"probe.dev_split=[{splits[0][0]},{splits[0][1]}]"] if splits else []
