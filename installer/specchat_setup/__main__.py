import sys

from specchat_setup.cli import main

sys.exit(main())
