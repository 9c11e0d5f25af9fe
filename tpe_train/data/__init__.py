"""The data layer: preparation as one pipeline (prepare.py: read, clean, de-duplicate, tokenise, store),
the synthetic corpus, the joint tokenizer and token batches."""

import os
import sys

# One progress bar on the terminal: training's. datasets reads the variable when it is first imported
# (by the modules of this package that use it), so that importing the package does not load it.
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
if "datasets" in sys.modules:  # imported before this package: the variable was read already
    sys.modules["datasets"].disable_progress_bars()
