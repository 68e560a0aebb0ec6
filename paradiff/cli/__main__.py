"""``python -m paradiff.cli``: the ``paradiff`` command."""

import sys

from . import main

sys.exit(main())
