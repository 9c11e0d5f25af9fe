"""``python -m tpe_train.train``: the same as ``tpe-train``."""

import sys

from tpe_train.train.cli import main

sys.exit(main())
