"""``python -m envkit.cli``: the ``envkit`` command, as the module this package replaced ran."""

import sys

from envkit.cli import main

sys.exit(main())
