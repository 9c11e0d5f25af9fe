"""Ensemble decoding: several models of one vocabulary decode as one, step by step.

Each member encodes the source itself and keeps its own decoder cache; at every step the members'
next-token distributions over the shared vocabulary are combined into one,

    log p(y | prefix) = log( (1/n) * sum_i p_i(y | prefix) ),

the log of the mean of the members' probabilities (fairseq's ensemble; OpenNMT-py's with
``-avg_raw_probs``, whose default is the mean of the log-probabilities instead). The mixture is a
distribution, so beam-search scores stay log-probabilities and the length penalty, forced EOS and
n-best scores mean what they mean for one model. Members may differ in size and position encoding;
they must agree on the vocabulary and its special ids. ``generate.greedy`` and
``generate.beam_search_nbest`` take an ``Ensemble`` wherever they take a ``Transformer`` (a plain
model decodes as an ensemble of one, whose combination is the model's own log-softmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tpe_train.model.args import ModelArgs
from tpe_train.model.transformer import DecoderCache, Memory, Transformer


@dataclass
class EnsembleMemory:
    """Every member's encoder output, in member order."""

    members: list[Memory]

    @property
    def group(self) -> int:
        return self.members[0].group

    @group.setter
    def group(self, value: int) -> None:  # beam search: every member's memory serves K beams
        for memory in self.members:
            memory.group = value

    def select(self, rows: Tensor) -> EnsembleMemory:
        return EnsembleMemory([m.select(rows) for m in self.members])


@dataclass
class EnsembleCache:
    """Every member's decoder cache; beam search reorders and shrinks them together."""

    members: list[DecoderCache]

    def reorder(self, index: Tensor) -> None:
        for cache in self.members:
            cache.reorder(index)

    def select_sentences(self, rows: Tensor) -> None:
        for cache in self.members:
            cache.select_sentences(rows)


def _min_length(lengths: list[int | None]) -> int | None:
    known = [n for n in lengths if n is not None]
    return min(known) if known else None


def log_mean_exp(lprobs: Tensor) -> Tensor:
    """``log(mean(exp(lprobs), dim=0))``, computed as ``m + log(mean(exp(lprobs - m)))`` with ``m`` the
    maximum over the members: identical members give back their log-probabilities bitwise (every
    ``exp(0)`` is 1, their mean 1, its log 0)."""
    top = lprobs.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all -inf: stays -inf
    return top + (lprobs - top).exp().mean(dim=0).log()


class Ensemble(nn.Module):
    """Models of one vocabulary that decode as one (see the module's docstring)."""

    def __init__(self, members: Sequence[Transformer]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one model")
        first = members[0].args
        for i, model in enumerate(members[1:], start=2):
            a = model.args
            mine = (a.vocab_size, a.pad_id, a.bos_id, a.eos_id)
            theirs = (first.vocab_size, first.pad_id, first.bos_id, first.eos_id)
            if mine != theirs:
                raise ValueError(
                    f"ensemble member {i} has vocabulary size and pad/bos/eos ids {mine}, member 1 has "
                    f"{theirs}: an ensemble's members must share one vocabulary"
                )
        self.members = nn.ModuleList(members)

    @property
    def models(self) -> list[Transformer]:
        return list(self.members)  # type: ignore[arg-type]

    @property
    def args(self) -> ModelArgs:
        """The first member's (vocabulary and special ids are the same for all)."""
        return self.models[0].args

    def max_target_length(self) -> int | None:
        """Longest target every member's decoder can represent (None: unbounded)."""
        return _min_length([m.max_target_length() for m in self.models])

    def max_source_length(self) -> int | None:
        """Longest source every member's encoder can represent (None: unbounded)."""
        return _min_length([m.max_source_length() for m in self.models])

    def encode(self, src: Tensor) -> EnsembleMemory:
        return EnsembleMemory([m.encode(src) for m in self.models])

    def new_cache(self, source_length: int = 0, limit: int = 0) -> EnsembleCache:
        return EnsembleCache([m.new_cache(source_length, limit) for m in self.models])

    def _logits(self, tokens: Tensor, memory: EnsembleMemory, cache: EnsembleCache) -> list[Tensor]:
        return [
            model.decode(tokens, mem, c)[:, -1]
            for model, mem, c in zip(self.models, memory.members, cache.members, strict=True)
        ]

    def log_probs(self, tokens: Tensor, memory: EnsembleMemory, cache: EnsembleCache) -> Tensor:
        """The next token's combined log-probabilities (B, V) in fp32, after the new ``tokens`` (B, 1).

        One member: its log-softmax, exactly as beam search computes it for a plain model."""
        lprobs = [torch.log_softmax(x.float(), dim=-1) for x in self._logits(tokens, memory, cache)]
        if len(lprobs) == 1:
            return lprobs[0]
        return log_mean_exp(torch.stack(lprobs))

    def greedy_scores(self, tokens: Tensor, memory: EnsembleMemory, cache: EnsembleCache) -> Tensor:
        """Scores (B, V) whose argmax is the greedy choice: one member's logits (as greedy decoding
        of a plain model takes them), several members' combined log-probabilities."""
        if len(self.members) == 1:
            return self._logits(tokens, memory, cache)[0]
        return self.log_probs(tokens, memory, cache)


def as_ensemble(model: Transformer | Ensemble) -> Ensemble:
    """``model`` itself, or a plain model as an ensemble of one."""
    return model if isinstance(model, Ensemble) else Ensemble([model])
