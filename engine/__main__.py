"""`python -m engine` is `specchat`."""

import os
import sys


def run() -> int:
    try:
        from engine import interrupts

        interrupts.watch()
        from engine.cli.main import main, settle
    except BaseException as exc:  # Ctrl+C while the command line's modules import (maybe wrapped by one)
        from engine.interrupts import caused_by_ctrl_c

        if not caused_by_ctrl_c(exc):
            raise
        print(file=sys.stderr, flush=True)
        os._exit(130)  # not sys.exit: see engine.cli.main.settle
    return settle(main())


if __name__ == "__main__":
    sys.exit(run())
