"""The `specchat` command line: generate, chat, models and the benchmarks.

Contract: parser.py holds every command and option and imports no torch, so `--help`, `models
...` and a mistyped option answer at once; each command's handler lives in its own module
(generate, chat, models, bench, bench_offload) and is imported only when the command runs.
Results go to stdout, progress and errors to stderr; a user's error is one `error:` line.

What it does not do: open the desktop app (app/launcher.py, the `specchat` entry point, does
that when there are no arguments), or hold any logic the app also needs (that lives in the
engine's packages, which both call).
"""

from engine.cli.main import main

__all__ = ["main"]
