"""Corpus sources, cleaning, the synthetic corpus, the joint tokenizer and token batches."""

import datasets

datasets.disable_progress_bars()  # one progress bar on the terminal: training's
