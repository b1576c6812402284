"""The command-line tools, one module each: `main(argv=None)` parses the arguments and calls the
library under `mpp.cli.one_line_errors`, so bad input ends in one line on stderr. Installed as the
`mpp-*` scripts of pyproject.toml's [project.scripts]; `python tools/NAME.py` and
`python -m mpp.tools.NAME` run the same `main`."""
