"""``python -m tpe_train.config > docs/config.md``."""

import sys

from tpe_train.config.cli import main

sys.exit(main())
