"""The data layer: preparation as one pipeline (prepare.py: read, clean, de-duplicate, tokenise, store),
the synthetic corpus, the joint tokenizer and token batches."""

import datasets

datasets.disable_progress_bars()  # one progress bar on the terminal: training's
