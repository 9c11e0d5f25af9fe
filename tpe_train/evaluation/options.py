"""What ``tpe-eval`` and ``tpe-translate`` (``cli``) name in their options and the library uses too,
importable without torch so that the commands parse their arguments before loading it."""

from __future__ import annotations

#: sentences in the diagnostics batch (``tpe-eval --diagnostics``, training's position logging)
DIAGNOSTIC_PAIRS = 64
#: file names of ``tpe-eval --diagnostics`` in its output directory
JSON_NAME = "diagnostics.json"
#: subword tokens of a source line, for every encoding (``tpe-translate --max-source-len``)
MAX_SOURCE_LEN = 1024
