"""The comparison's first step: making the data sets its `prepare` key names (a synthetic set,
shards of image folders) where their manifests are missing, and refusing a folder made from
another source (the finished stages read it, and their configs name only its folder). It writes
data, in this process, before any stage runs; the data made are then checked by
`mpp.compare.checks.check_data`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from mpp.config import CompareConfig, ConfigError, as_list

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
