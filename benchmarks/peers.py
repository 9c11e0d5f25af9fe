"""The Hugging Face peers of the benchmarks, matched to our config, and fixed-length decoding.

- ``hf_model``: a Hugging Face encoder-decoder of a ``ModelArgs``' shape, random weights, no download:
  MarianMT (sinusoidal) <-> ``sinusoidal``, BART (learned absolute) <-> ``learned``, T5 (relative
  bucket bias) <-> ``t5`` (``HF_MATCH``). The activation is ReLU everywhere (Marian and BART set to
  ``relu``), embeddings tied; T5 is pre-norm RMSNorm without biases and its ``dropout_rate`` also
  drops attention probabilities.
- Fixed-length decoding: with random weights the models would stop at different, arbitrary lengths, so
  both sides are made to decode an exact number of steps. tpe_train: ``suppress_eos`` wraps a model's
  ``decode`` (per instance) to lower the EOS logit while fewer than N tokens were decoded (one in-place
  write into the (B*K, 1, V) logits per step: what HF's ``min_new_tokens`` logits processor does), and
  the beam search's length limit forces EOS at step N + 1. Hugging Face: ``generation_config`` with
  ``min_new_tokens`` = ``max_new_tokens`` (EOS suppressed throughout), or ``ExactLength`` per sentence.
  ``DecodeRow`` times either side under ``harness.interleave``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from harness import SEED
from torch import Tensor, nn

from tpe_train.ckpt.hf import bart_family_kwargs
from tpe_train.data.batching import BOS_ID, EOS_ID, PAD_ID
from tpe_train.model.args import ModelArgs
from tpe_train.model.generate import beam_search
from tpe_train.model.transformer import Memory, Transformer

HF_MATCH = {"sinusoidal": "hf-marian", "learned": "hf-bart", "t5": "hf-t5"}


def hf_model(name: str, args: ModelArgs, seed: int = SEED) -> nn.Module:
    """``hf-marian``, ``hf-bart`` or ``hf-t5`` of the shape of ``args`` (vocabulary, width, heads, FFN,
    layers, dropout, positions), random weights from ``seed``, no download."""
    import transformers as tf

    torch.manual_seed(seed)
    ids = {
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID,
    }
    pos = args.position_args(causal=False)
    if name in ("hf-marian", "hf-bart"):
        common = bart_family_kwargs(args, pos.max_positions)
        if name == "hf-marian":
            config = tf.MarianConfig(
                decoder_vocab_size=args.vocab_size, share_encoder_decoder_embeddings=True, **common
            )
            return tf.MarianMTModel(config)
        return tf.BartForConditionalGeneration(tf.BartConfig(forced_bos_token_id=None, **common))
    if name == "hf-t5":
        config = tf.T5Config(
            vocab_size=args.vocab_size,
            d_model=args.d_model,
            d_kv=args.d_model // args.n_heads,
            d_ff=args.ffn_dim,
            num_layers=args.encoder_layers,
            num_decoder_layers=args.decoder_layers,
            num_heads=args.n_heads,
            relative_attention_num_buckets=pos.t5_buckets,
            relative_attention_max_distance=pos.t5_max_distance,
            dropout_rate=args.dropout,
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            **ids,
        )
        return tf.T5ForConditionalGeneration(config)
    raise ValueError(f"unknown peer {name!r}; choose from {sorted(HF_MATCH.values())}")


def attn_impl(model: nn.Module) -> str:
    """The attention implementation a Hugging Face model runs (ours: sdpa/explicit)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", "sdpa/explicit")) if config else "sdpa/explicit"


# ------------------------------------------------------------------------------ fixed lengths


def suppress_eos(model: Transformer, until: int | None = None, penalty: float = math.inf) -> Transformer:
    """Per instance: the EOS logit lowered by ``penalty`` (inf: set to -inf) in incremental decoding
    while fewer than ``until`` target tokens were decoded; ``until=None``: at every call. Idempotent
    for the same arguments (a model shared by several rows is wrapped once)."""
    if model.__dict__.get("_eos_suppressed") == (until, penalty):
        return model
    inner = model.decode

    def decode(tgt_in: Tensor, memory: Memory, cache: Any = None) -> Tensor:
        offset = cache.offset if cache is not None else 0
        logits = inner(tgt_in, memory, cache)
        if until is None or (cache is not None and offset < until):
            if math.isinf(penalty):
                logits[..., EOS_ID] = float("-inf")
            else:
                logits[..., EOS_ID] -= penalty
        return logits

    model.decode = decode  # type: ignore[method-assign]
    model.__dict__["_eos_suppressed"] = (until, penalty)
    return model


def generation_config(beam: int, alpha: float, max_new: int, min_new: int | None = None) -> Any:
    """Hugging Face ``generate``'s settings matching tpe_train's beam search: beam ``beam``, length
    penalty ``alpha``, no sampling, no early stopping, KV cache, pad suppressed (as tpe_train's beam
    search does); ``min_new``: EOS suppressed before that many new tokens."""
    from transformers import GenerationConfig

    extra = {} if min_new is None else {"min_new_tokens": min_new}
    return GenerationConfig(
        num_beams=beam,
        length_penalty=alpha,
        max_new_tokens=max_new,
        do_sample=False,
        early_stopping=False,
        suppress_tokens=[PAD_ID],
        use_cache=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        **extra,
    )


class ExactLength:
    """Hugging Face logits processor: sentence b of the batch ends at decoder call ``calls[b]`` (EOS
    removed before, forced there and after)."""

    def __init__(self, calls: Tensor, beams: int) -> None:
        self.calls = calls.repeat_interleave(beams)  # (B * K,) rows as generate lays them out

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        call = input_ids.shape[1]  # the decoder start token plus what was generated: this call's number
        calls = self.calls.to(scores.device)
        early = calls > call
        scores[early, EOS_ID] = float("-inf")
        end = ~early
        if bool(end.any()):
            scores[end] = float("-inf")
            scores[end, EOS_ID] = 0.0
        return scores


@dataclass
class DecodeRow:
    """Beam search of one batch ``src`` with exactly ``steps`` decoder calls per sentence (``steps - 1``
    tokens, then EOS), by tpe_train's ``beam_search`` or Hugging Face's ``generate`` (a name starting
    ``hf-``); eval mode, inference mode. ``before``: called before each search (a backend to set).
    After a step: ``lengths`` (decoder steps per sentence, EOS counted) and, for tpe_train, ``hyps``."""

    name: str
    model: nn.Module
    src: Tensor
    steps: int
    beam: int = 4
    alpha: float = 0.6
    before: Callable[[], None] | None = None
    times: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    hyps: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model.to(self.src.device).eval()
        self.hf = self.name.startswith("hf-")
        if self.hf:
            self.gen_config = generation_config(self.beam, self.alpha, self.steps, min_new=self.steps)
        else:
            assert isinstance(self.model, Transformer)
            suppress_eos(self.model, self.steps - 1)

    def step(self) -> None:
        if self.before is not None:
            self.before()
        with torch.inference_mode():
            if self.hf:
                out = self.model.generate(  # type: ignore[operator]
                    input_ids=self.src,
                    attention_mask=(self.src != PAD_ID).long(),
                    generation_config=self.gen_config,
                )
                # minus the decoder start token; EOS never appears (suppressed throughout)
                self.lengths = [out.shape[1] - 1] * out.shape[0]
            else:
                assert isinstance(self.model, Transformer)
                self.hyps = beam_search(
                    self.model,
                    self.src,
                    beam=self.beam,
                    alpha=self.alpha,
                    max_len_a=0.0,
                    max_len_b=self.steps,
                )
                self.lengths = [len(h) + 1 for h in self.hyps]  # + the EOS step
