"""The whole experiment in one command: MPP and supervised pre-training, fine-tuning of both and
of a from-scratch baseline at each label fraction, linear probes of both and of a randomly
initialised encoder (the probe's from-scratch baseline), then the gap report.

Each stage runs as its own process (so a crash loses one stage, memory is freed between stages,
and `launcher` can be `torchrun --nproc_per_node N`); a stage whose `metrics.json` exists is
skipped, so running the comparison again resumes it. Every stage config is resolved and validated
before the first stage starts.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mpp.config import CompareConfig, ConfigError, as_list, load_config, parse_overrides

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@dataclass
class Stage:
    name: str
    tool: str             # script in tools/
    config: str           # its --config
    overrides: list[str]  # its key=value overrides
    out: Path             # its output_dir; done when out/metrics.json exists

    def command(self, launcher: list[str]) -> list[str]:
        return launcher + [str(TOOLS / self.tool), "--config", self.config] + self.overrides


def plan(cfg: CompareConfig) -> list[Stage]:
    """The stages in run order, each with its fully resolved overrides."""
    root = Path(cfg.output_dir)
    common = as_list(cfg.overrides)
    pre = {"mpp": root / "pretrain_mpp", "supervised": root / "pretrain_supervised"}
    stages = [Stage(f"pre-train {kind}", "pretrain.py", getattr(cfg, kind), common, out) for kind, out in pre.items()]
    for frac in cfg.label_fractions:
        pct = f"{frac * 100:g}pct"
        for init, src in (("scratch", None), ("mpp", pre["mpp"]), ("supervised", pre["supervised"])):
            stages.append(Stage(f"fine-tune {init}, {frac:.0%} labels", "finetune.py", cfg.finetune,
                                common + [f"finetune.init={src or 'none'}", f"finetune.label_fraction={frac}"],
                                root / f"finetune_{init}_{pct}"))
    for kind, src in (*pre.items(), ("scratch", "none")):
        stages.append(Stage(f"linear probe {kind}", "linear_probe.py", cfg.probe, common + [f"probe.encoder={src}"],
                            root / f"probe_{kind}"))
    for s in stages:
        s.overrides = s.overrides + [f"output_dir={s.out}"]
    return stages


def validate(cfg: CompareConfig, stages: list[Stage]) -> None:
    """Resolve every stage config now, so a bad key fails before hours of work."""
    for s in stages:
        try:
            load_config(s.config, s.overrides)
        except ConfigError as e:
            raise ConfigError(f"stage '{s.name}' ({s.config}): {e}") from None
    try:
        parse_overrides(as_list(cfg.overrides))
    except ConfigError as e:
        raise ConfigError(f"compare config key 'overrides': {e}") from None


def prepare_data(cfg: CompareConfig) -> None:
    """Make the data sets the stages read, unless their manifests already exist."""
    p = cfg.prepare
    if p.synthetic and not (Path(p.synthetic) / "test" / "manifest.json").exists():
        from mpp.data.synthetic import make_synthetic
        print(f"[data] generating the synthetic data set at {p.synthetic}", flush=True)
        make_synthetic(p.synthetic, train=p.synthetic_train, test=p.synthetic_test)
    for src, out in zip(as_list(p.shards_src), as_list(p.shards_out)):
        if not (Path(out) / "manifest.json").exists():
            from mpp.data.writer import write_shards
            print(f"[data] writing shards of {src} to {out}", flush=True)
            write_shards(src, out)


def run(cfg: CompareConfig, dry_run: bool = False) -> Path:
    """Run (or resume) the comparison; returns the report path."""
    stages = plan(cfg)
    validate(cfg, stages)
    launcher = shlex.split(cfg.launcher) if cfg.launcher else [sys.executable]
    total = len(stages) + 2
    if dry_run:
        for i, s in enumerate(stages, 2):
            print(f"[{i}/{total}] {s.name}: {shlex.join(s.command(launcher))}")
        return Path(cfg.output_dir) / "report.md"
    print(f"[1/{total}] data", flush=True)
    prepare_data(cfg)
    for i, s in enumerate(stages, 2):
        if (s.out / "metrics.json").exists():
            print(f"[{i}/{total}] {s.name}: done earlier ({s.out})", flush=True)
            continue
        print(f"[{i}/{total}] {s.name} -> {s.out}", flush=True)
        t0 = time.time()
        cmd = s.command(launcher)
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"stage '{s.name}' failed; fix the cause and run the same command again "
                               f"to resume (finished stages are kept). Command: {shlex.join(cmd)}")
        print(f"[{i}/{total}] {s.name}: finished in {time.time() - t0:.0f} s", flush=True)
    from mpp.report import write_report
    print(f"[{total}/{total}] report", flush=True)
    write_report([s.out for s in stages], Path(cfg.output_dir))
    from mpp.figures.inspection import write_compare_figures  # issue 11: what the encoders learned
    write_compare_figures([s.out for s in stages if s.tool == "pretrain.py"], None, Path(cfg.output_dir) / "figures")
    return Path(cfg.output_dir) / "report.md"
