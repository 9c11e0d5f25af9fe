"""Using a trained model: ``decoding`` (batched greedy and beam search over sentences), ``metrics``
(sacreBLEU, chrF, tokenized BLEU, paired bootstrap: scoring only), ``evaluate`` (test sets decoded and
scored, kept on disk, compared), ``translate`` (a stream of lines in input order), ``cli`` (``tpe-eval``,
``tpe-translate``).
"""
