"""`specchat`: the command line (see parser.py for every command and option).

    specchat generate ...         one prompt -> one or more completions (text stream or --json lines)
    specchat chat ...             an interactive conversation in the terminal
    specchat models ...           list, download, import and remove models
    specchat bench ...            benchmarks that print tables

Output contract: results go to stdout (streamed text, or one JSON object per sample and line);
progress, per-answer stats and errors go to stderr. Every error a user can cause (an EngineError
or a bad option value) prints one line `error: <message>` on stderr and exits with 2, before any
model is loaded where it can be checked that early. Ctrl+C sets the generation's cancel Event;
the partial answer is kept (generate then exits 130, chat returns to the prompt).

`specchat` with no command opens the desktop app: that is the launcher's job (app/launcher.py),
so nothing under engine/ names the GUI; `python -m engine` with no command prints the help.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence

from engine.about import installation
from engine.cli.parser import EXIT_USAGE, HANDLER, build_parser
from engine.errors import EngineError

EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option already reported in one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    configure_logging(args.verbose)
    if args.version:
        about = installation()
        print(f"{about.summary()}\nenvironment: {about.prefix}\ndata: {about.data}")
        return 0
    target = getattr(args, HANDLER, None)
    if target is None:
        parser.print_help()
        return 0
    try:
        module, _, function = target.partition(":")
        handler = getattr(importlib.import_module(module), function)
        return int(handler(args))
    except EngineError as exc:
        print(f"error: {exc.user_message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # while loading: nothing to keep
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `specchat generate ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def configure_logging(verbose: int) -> None:
    level = logging.INFO if verbose == 1 else logging.DEBUG if verbose > 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
