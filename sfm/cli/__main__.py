"""``python -m sfm.cli``: the ``sfm`` console script."""

import sys

from sfm.cli import main

sys.exit(main())
