"""``python -m tpe_train.evaluation``: the same as ``tpe-eval``."""

import sys

from tpe_train.evaluation.cli import eval_main

sys.exit(eval_main())
