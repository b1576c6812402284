"""The whole experiment in one command: MPP and supervised pre-training, linear probes of both
and of a randomly initialised encoder (the probe's from-scratch baseline), fine-tuning of both
and of a from-scratch baseline at each label fraction, then the gap report.

Fine-tuning follows the paper's protocol, identically for every arm: each value of the `sweep` grid
is trained on the labels minus a class-balanced development split (`dev_fraction`) and scored on
it; the best is retrained on all the labels, `seeds` times, and tested on `data.val` once per seed
(`fraction_sweep` gives a label fraction values of its own: a rate that suits 10% of the labels may
sit low for all of them). Where the split could not separate the best value from the next (its lead
under t times its paired standard error, Student's t at the images' degrees of freedom: a toss-up),
`runner_up` also retrains the next with the same seeds, so that the report can give each figure the
range that choice spans (and likewise the best value through the other representation where the
best stage's choice of it was a toss-up). `finetune.pool` is best swept like the rate (every
shipped comparison but the `hog` and `histogram` ones does: the fine-tune itself then chooses it);
left out of the sweep, a linear probe of the sweep's own training labels chooses it, scored on its
development split (`finetune_pool: auto`, i.e. finetune.pool=auto in the sweep stages; the finals
take the best one's): one cheap frozen-feature fit per arm and label fraction, and a 10%-label cell
never leans on a probe of all the labels. Such run-time choices are `Choice`s of a stage (whether
it runs at all, its `Condition`), read from the finished stages' metrics.json just before it
starts.

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

Five parts, one idea each: this module holds `run`, the orchestration read top to bottom (the
data, the checks, each stage in turn, then the figures and the report); `mpp.compare.planning`
the plan (the stages, their run-time choices and conditions, the development splits the
pre-trainings withhold); `mpp.compare.checks` what is checked before any stage starts (and, on a
resume, before a finished one is reused); `mpp.compare.prepare` makes the data the stages read;
`mpp.compare.stages` runs a stage as a process of its own and reads how it ended.
"""
from __future__ import annotations

import shlex
import signal
import sys
import time
from pathlib import Path

from mpp.compare.checks import (check_data, check_encoder, check_processes, check_unchanged, checkpointed,
                                launcher_words, saved_since, stated_processes, validate)
from mpp.compare.planning import plan, repeat_dir
from mpp.compare.prepare import prepare_data
from mpp.compare.stages import StageTerminated, killed, run_stage, seconds, start_server, time_split
from mpp.config import CompareConfig, as_list
from mpp.report.runs import UNFINISHED, UNFINISHED_NOTE


def run(cfg: CompareConfig, dry_run: bool = False) -> Path:
    """Run (or resume) the comparison; returns the report path."""
    if not (dry_run or cfg.launcher):
        start_server()  # its imports, seconds, overlap the planning's and the data's
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
            check_processes(s, stated_processes(words))
            if not s.choices:
                check_unchanged(s)
    # in every folder it reports, each pre-training seed's too, until every stage is done
    unfinished = [Path(cfg.output_dir) / UNFINISHED,
                  *(repeat_dir(cfg, seed) / UNFINISHED for seed in range(1, cfg.pretrain_seeds))]
    for f in unfinished:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(UNFINISHED_NOTE + "\n")
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
        if checkpointed(s.out):  # it would resume from weights trained with the settings it ran with
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
            ended = "which saved its checkpoint" if code == 128 + signal.SIGTERM else (
                f"which ended with exit {code}" + (f" (its launcher's), having saved {name}"
                                                   if (name := saved_since(s.out, t0)) else ""))
            print(f"error: SIGTERM during stage '{s.name}', {ended}; run the same command again to resume "
                  "(finished stages and checkpoints are kept)", file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGTERM)
        if code != 0:
            raise RuntimeError(f"stage '{s.name}' failed{killed(code)}; fix the cause and run the same command "
                               f"again to resume (finished stages are kept). Command: {shlex.join(cmd)}")
        took = time.time() - t0
        split = time_split(s.out, took)
        if split is not None:
            spent.append((took, split))
        print(f"[{i}/{total}] {s.name}: finished in {seconds(took, split)}", flush=True)
    for f in unfinished:
        f.unlink(missing_ok=True)  # a user may have removed it
    from mpp.figures.inspection import write_compare_figures
    from mpp.report import write_report
    if spent:  # where this run's training time went, summed over its trained stages
        print(f"the {len(spent)} stages trained now took " + seconds(sum(t for t, _ in spent),
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
