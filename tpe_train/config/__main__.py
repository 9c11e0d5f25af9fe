"""``python -m tpe_train.config > docs/config.md``."""

from tpe_train.config.reference import markdown_reference

print(markdown_reference(), end="")
