"""`python -m engine` is `specchat`."""

import os
import sys


def run() -> int:
    try:
        from engine import interrupts

        interrupts.watch()
        from engine.cli.main import main, settle
    except KeyboardInterrupt:  # Ctrl+C while the command line's modules import
        print(file=sys.stderr, flush=True)
        os._exit(130)  # not sys.exit: see engine.cli.main.settle
    return settle(main())


if __name__ == "__main__":
    sys.exit(run())
