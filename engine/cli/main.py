"""`specchat`: the command line (see parser.py for every command and option).

    specchat generate ...         one prompt -> one or more completions (text stream or --json lines)
    specchat chat ...             an interactive conversation in the terminal
    specchat models ...           list, download, import and remove models
    specchat bench ...            benchmarks that print tables

Output contract: results go to stdout (streamed text, or one JSON object per sample and line);
progress, per-answer stats and errors go to stderr. An error prints one line `error: <message>`
on stderr, never a traceback. Exit codes (EXIT_CODES, also in `--help`): 0 done; 1 a runtime
failure (a model that cannot load, a download that failed, a full disk); 2 a usage error (an
unknown option, a bad option value or combination: refused before any model loads where it can
be checked that early); 130 Ctrl+C (the partial answer is kept: generate exits, chat returns to
the prompt). A closed stdout (`specchat generate ... | head -1`) ends the command quietly with 0.

`specchat` with no command opens the desktop app: that is the launcher's job (app/launcher.py),
so nothing under engine/ names the GUI; `python -m engine` with no command prints the help.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence

from engine.about import installation
from engine import interrupts
from engine.cli.parser import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    HANDLER,
    build_parser,
)
from engine.errors import EngineError, UsageError
from engine.openmp import configure_waiting


def main(argv: Sequence[str] | None = None) -> int:
    configure_waiting()  # before torch starts its OpenMP runtime (engine.openmp)
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
        if interrupts.seen():  # a Ctrl+C during the imports, which one of them swallowed
            raise KeyboardInterrupt
        return int(handler(args))
    except UsageError as exc:
        return report(exc.user_message, EXIT_USAGE)
    except EngineError as exc:
        return report(exc.user_message, EXIT_FAILURE)
    except KeyboardInterrupt:  # while loading: nothing to keep
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `specchat generate ... | head`: the reader left, which is fine
        silence_stdout()
        return 0
    except OSError as exc:  # a file the command had to write or read, outside the store's own checks
        return report(os_error_message(exc), EXIT_FAILURE)
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, the traceback with -v
        if interrupts.caused_by_ctrl_c(exc):  # a Ctrl+C an import wrapped in another error
            print(file=sys.stderr)
            return EXIT_INTERRUPTED
        if args.verbose:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return report(f"unexpected {type(exc).__name__}{': ' + first if first else ''}. This is a bug in "
                      "SpecChat: run the command again with -v to see where it happened, and report it.",
                      EXIT_FAILURE)


def report(message: str, code: int) -> int:
    """The one `error:` line; returns `code`. A value quoted in it keeps it one line: control
    characters (a line break in a URL or a name) are shown escaped, and so are bytes of a path
    that are not UTF-8 (Python keeps them as lone surrogates, which a strict stream cannot write)."""
    message = "".join(repr(c)[1:-1] if c.isspace() and c != " " or not c.isprintable() and c.isascii() else c
                      for c in message).encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except OSError:  # stderr is gone too: the exit code still tells
        pass
    return code


def os_error_message(exc: OSError) -> str:
    """An OSError as a sentence a user can act on."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return f"The disk is full (writing{where}). Free some space and run the command again."
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"Permission denied:{where} cannot be written or read ({exc.strerror}). Make the folder "
                "writable, or point SpecChat elsewhere (SPECCHAT_DATA_DIR, SPECCHAT_CACHE_DIR, --models-dir).")
    return f"{exc.strerror or exc}{':' + where if where else ''}."


def silence_stdout() -> None:
    """Point stdout at the null device, so that flushing it at exit (to a reader that left)
    raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to flush into a pipe
        pass


def settle(code: int) -> int:
    """What an entry point does with main()'s code just before the interpreter exits: flush
    the output now (a reader that left is not an error), and from here on let Ctrl+C end the
    process at once with 130, since a KeyboardInterrupt during interpreter shutdown would
    print a traceback ("Exception ignored in ...").

    After a Ctrl+C the process ends here, with 130: CPython remembers a KeyboardInterrupt that
    passed through C code running Python source (some extension modules' initialisation does)
    even when it was caught, and would then end the process by SIGINT instead (-2, not 130)."""
    if code == EXIT_INTERRUPTED:
        leave_now(code)
    try:
        signal.signal(signal.SIGINT, lambda *_: leave_now(EXIT_INTERRUPTED))
    except ValueError:  # not the main thread (an embedding): keep Python's handler
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            if stream is sys.stdout:
                silence_stdout()
        except (OSError, ValueError):
            pass
    return code


def leave_now(code: int) -> None:
    """End the process at once (after flushing what can be flushed): for a second Ctrl+C, which
    must not wait for a running step, and for Ctrl+C during interpreter shutdown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def configure_logging(verbose: int) -> None:
    level = logging.INFO if verbose == 1 else logging.DEBUG if verbose > 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
