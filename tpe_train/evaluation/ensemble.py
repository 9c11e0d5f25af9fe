"""Loading what ``tpe-eval`` and ``tpe-translate`` decode with: one export, or several of one vocabulary
as an ensemble (``tpe_train.model.ensemble``: at every step the log of the mean of the members'
probabilities).

Every member is loaded, its vocabulary checked against the first one's and the test-time position
settings applied to it before anything is decoded. Decoding settings (``eval``), the test sets and the
target language come from the first checkpoint's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tpe_train.config import Config
from tpe_train.data.tokenizer import vocab_hash
from tpe_train.evaluation.position_settings import apply_position_settings
from tpe_train.model.ensemble import Ensemble
from tpe_train.model.transformer import Transformer

#: How the members' next-token distributions are combined, as eval.json states it.
COMBINATION = "log of the mean of the members' probabilities at every step"


@dataclass
class Loaded:
    """A model (a plain one for one checkpoint, an ``Ensemble`` for several), the first checkpoint's
    config and the shared tokenizer."""

    model: Transformer | Ensemble
    cfg: Config
    tok: Tokenizer
    checkpoints: list[str]

    @property
    def is_ensemble(self) -> bool:
        return len(self.checkpoints) > 1

    def describe(self) -> dict[str, Any]:
        """What eval.json records of an ensemble: its checkpoints, in order, and the combination."""
        return {"checkpoints": list(self.checkpoints), "combination": COMBINATION}

    def banner(self) -> str:
        """One line naming an ensemble's members (empty for one checkpoint)."""
        if not self.is_ensemble:
            return ""
        return f"ensemble of {len(self.checkpoints)} checkpoints: {', '.join(self.checkpoints)}"


def load_models(checkpoints: list[str], position: list[str] | None = None) -> Loaded:
    """Load ``checkpoints`` (exports) and apply ``position`` (``--position`` items) to each.

    Several checkpoints must share one vocabulary: a ``ValueError`` names the first two whose
    vocabulary hashes differ. A position setting that a member cannot take is an error naming it."""
    from tpe_train.ckpt.export import load_export

    if not checkpoints:
        raise ValueError("give at least one --checkpoint")
    models: list[Transformer] = []
    first: tuple[Config, Tokenizer, str] | None = None
    for path in checkpoints:
        model, cfg, tok = load_export(Path(path))
        if first is None:
            first = (cfg, tok, vocab_hash(tok))
        elif vocab_hash(tok) != first[2]:
            raise ValueError(
                f"{path} and {checkpoints[0]} have different vocabularies (tokenizer hashes "
                f"{vocab_hash(tok)} and {first[2]}): an ensemble's members must be trained with one "
                "tokenizer; ensemble checkpoints of one corpus and vocabulary (the same data.* settings)"
            )
        try:
            apply_position_settings(model, position or [], cfg.data.max_len + 1)
        except ValueError as err:
            if len(checkpoints) == 1:
                raise
            raise ValueError(f"{path}: {err} (in an ensemble, --position applies to every member)") from None
        models.append(model)
    assert first is not None
    cfg, tok, _ = first
    decoder = models[0] if len(models) == 1 else Ensemble(models)
    return Loaded(decoder, cfg, tok, [str(p) for p in checkpoints])
