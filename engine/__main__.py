"""`python -m engine` is `specchat`."""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
