"""Evaluators, one file each (as big_vision's), one interface: `Evaluator(cfg, device)` checks its
settings and data when built, before any training; `run(model) -> {name: figure}`.

Pre-training runs those whose period key (e.g. `fewshot.every`) is > 0 every that many steps on
the encoder; a Task names the one run on it at the end (`Task.final_eval`, by its name here); the
probe tool builds its own directly (`linear_probe.run_linear_probe`). Adding one: a module with an `Evaluator`
class and a row here. Modules are imported only when a run uses them.
"""
from __future__ import annotations

import importlib

# name -> (module, config key of its period during pre-training, '' when it has none)
EVALUATORS: dict[str, tuple[str, str]] = {
    "fewshot": ("mpp.evaluators.fewshot", "fewshot.every"),  # few-shot least squares on frozen features
    "linear_probe": ("mpp.evaluators.linear_probe", ""),    # logistic regression on frozen features
    "classify": ("mpp.evaluators.classify", ""),            # top-1 / top-5 of a classifier on data.val
}


def create(name: str, cfg, device):
    """The evaluator `name` of EVALUATORS for `cfg` on `device`."""
    return importlib.import_module(EVALUATORS[name][0]).Evaluator(cfg, device)


def periodic(cfg, device) -> list[tuple[str, int, object]]:
    """(name, every, evaluator) of each evaluator whose period key in `cfg` is > 0."""
    out = []
    for name, (_, key) in EVALUATORS.items():
        every = _get(cfg, key) if key else 0
        if every > 0:
            out.append((name, every, create(name, cfg, device)))
    return out


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg
