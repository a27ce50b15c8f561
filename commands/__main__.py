"""`python -m dloco ...`: the same command line as the `dloco` script, for subprocesses of this
interpreter."""

import sys

from dloco.cli import main

sys.exit(main())
