"""Argument parsing shared by the config-driven tools: `--config FILE key=value ...`."""
from __future__ import annotations

import argparse
import sys

from mpp.config import Config, ConfigError, load_config, valid_keys


def parse_config_args(description: str, argv: list[str] | None = None, defaults: list[str] | None = None) -> Config:
    """Parse `--config FILE [key=value ...]` into a validated Config; exit 2 with one line on error.

    `defaults` (key=value) are the tool's own overrides, applied before the user's."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides are dotted keys with YAML values, e.g. steps=200 mpp.ratio=0.4 data.train=out/manifest.json\n"
               "valid keys: " + ", ".join(valid_keys()),
    )
    parser.add_argument("--config", help="YAML config (see configs/); keys not given keep their defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, (defaults or []) + args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
