"""`specchat`: with no arguments, the desktop app; with any, the command line (engine.cli).

The entry point lives in the app so that the engine never names the GUI: `python -m engine`
is the command line alone. `specchat -v` (only verbosity flags) still opens the app.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

APP_FLAGS = ("-v", "-vv", "-vvv", "--verbose")


def opens_app(argv: Sequence[str]) -> bool:
    return all(arg in APP_FLAGS for arg in argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if opens_app(args):
        from app.main import main as app_main  # Qt is imported only when the app opens

        return int(app_main() or 0)
    try:
        from engine import interrupts

        interrupts.watch()
        from engine.cli.main import main as cli_main
        from engine.cli.main import settle
    except BaseException as exc:  # Ctrl+C while the command line's modules import (maybe wrapped): no traceback
        from engine.interrupts import caused_by_ctrl_c

        if not caused_by_ctrl_c(exc):
            raise
        print(file=sys.stderr, flush=True)
        os._exit(130)  # not sys.exit: see engine.cli.main.settle
    return settle(int(cli_main(args)))


if __name__ == "__main__":
    sys.exit(main())
