"""``python -m envkit``: the ``envkit`` command line, for environments where the console script is not on PATH."""

import sys

from envkit.cli import main

sys.exit(main())
