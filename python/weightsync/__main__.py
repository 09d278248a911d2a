"""``python -m weightsync ...``: the ``weightsync`` command line (see :mod:`weightsync.cli`)."""

import sys

from .cli import main

sys.exit(main())
