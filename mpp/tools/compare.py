"""Run the self-supervised vs supervised comparison: MPP and supervised pre-training, linear
probes, fine-tunes (MPP, supervised, scratch) at each label fraction (the `sweep` grid on a
development split, then the best value over `seeds`), then the gap report.
Finished stages are skipped, so the same command resumes an interrupted comparison.

  mpp-compare --config configs/compare_synthetic.yaml [--dry-run] [key=value ...]
"""
from __future__ import annotations

from mpp.cli import ArgumentParser, one_line_errors, path
from mpp.config import CompareConfig, load_compare_config, valid_keys


@one_line_errors(extra=(RuntimeError,))  # a failed stage: its own output said why
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(__doc__, epilog="valid keys: " + ", ".join(valid_keys(CompareConfig)))
    p.add_argument("--config", required=True, type=path, help="comparison config, e.g. configs/compare_synthetic.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the stages and their commands, run nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="comparison config overrides, e.g. output_dir=runs/x 'pretrain_overrides=[steps=100]'")
    a = p.parse_args(argv)
    cfg = load_compare_config(a.config, a.overrides)
    from mpp.compare import run
    report = run(cfg, dry_run=a.dry_run)
    print(f"report (when it has run): {report}" if a.dry_run else f"report: {report}")


if __name__ == "__main__":
    main()
