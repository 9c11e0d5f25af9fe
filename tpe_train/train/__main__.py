"""``python -m tpe_train.train``: the same as ``tpe-train``."""

from tpe_train.train.cli import entry

entry()
