"""``python -m tpe_train.evaluation ARGS`` is ``tpe-eval ARGS``; ``python -m tpe_train.evaluation
translate ARGS`` is ``tpe-translate ARGS`` (for an interpreter whose scripts are not on PATH)."""

import sys

from tpe_train.evaluation.cli import eval_main, translate_main

if sys.argv[1:2] == ["translate"]:
    sys.exit(translate_main(sys.argv[2:]))
sys.exit(eval_main())
