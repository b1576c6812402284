"""Test helper: run a tool's `main` in this process as `python tools/NAME.py ARGS...` would, and
return what subprocess.run(..., capture_output=True, text=True) would (returncode, stdout,
stderr). A tool's own process pays seconds of imports (torch, torchvision, timm,
matplotlib), so the suite keeps a subprocess only where the process is what is tested:
signals, launchers, ranks, a script's entry point, what a fresh process imports."""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess


def call(main, argv: list[str]) -> subprocess.CompletedProcess:
    """`main(argv)` with stdout and stderr captured; its SystemExit becomes the exit code."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:  # as the interpreter ends on it: a message is printed and exits 1
            if isinstance(e.code, str):
                print(e.code, file=err)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess([getattr(main, "__module__", "main"), *argv], code, out.getvalue(),
                                       err.getvalue())


def run_tool(name: str, *args, cwd=None) -> subprocess.CompletedProcess:
    """`mpp.tools.NAME.main(args)` (paths as strings), run in folder `cwd` if given."""
    main = importlib.import_module(f"mpp.tools.{name}").main
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return call(main, [str(a) for a in args])
    finally:
        os.chdir(here)
