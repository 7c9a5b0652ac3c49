"""``python -m det_core.testing.divergence``: the command line (``cli.main``)."""

import sys

from .cli import main

sys.exit(main())
