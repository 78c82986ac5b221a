"""`python -m engine` is `specchat`."""

import sys

from engine.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
