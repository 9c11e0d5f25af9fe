"""Hugging Face ``transformers`` export: a model of this project as a ``transformers`` seq2seq model
whose logits equal ours, with its tokenizer as a fast tokenizer that ``AutoTokenizer`` loads.

Which architecture, by the model's normalisation and encoding (both stacks one encoding, no
cross-attention encoding); every other model is refused with the reason (``hf_target``):

================  ==============  ========================================================
ours              transformers    why it is exact
================  ==============  ========================================================
post-norm,        MarianMTModel   post-norm layers, sqrt(d) embedding scale, one shared
sinusoidal                        embedding tied to the output layer, ReLU, LayerNorm eps
                                  1e-5, head_dim^-1/2 attention scaling, positions from 0
pre-norm,         PegasusFor...   Marian's layers in pre-norm order with a final LayerNorm
sinusoidal        Generation      after each stack, and Marian's sinusoid
pre-norm,         BlenderbotFor.. pre-norm with final LayerNorms, a learned table of
learned / none    Generation      ``max_position_embeddings`` rows at positions from 0 (none:
                                  the table is zero)
================  ==============  ========================================================

The sinusoid. Ours interleaves, PE[p, 2i] = sin(p w_i) and PE[p, 2i+1] = cos(p w_i); Marian's and
Pegasus's table (recomputed by ``transformers`` whenever the model is built or loaded: it is not
saved) puts the sines in the first half and the cosines in the second, M[p, i] = sin(p w_i) and
M[p, h + i] = cos(p w_i) with h = ceil(d / 2), at the same frequencies w_i = 10000^(-2i/d). So
M[:, m] = PE[:, perm[m]] with perm = [0, 2, 4, ..., 1, 3, 5, ...]. A layer never looks at the order
of the residual stream's coordinates except through its weights, so the exported model carries
the stream permuted, h_hf = h_ours[perm], and every weight that touches the stream is permuted to
match (``_residual_weights``):

- read from the stream (token embedding rows, the q, k, v projections of every attention, fc1): the
  input columns, W[:, perm];
- written to the stream (attention out-projections, fc2): the output rows and biases, W[perm], b[perm];
- LayerNorm weight and bias, w[perm], b[perm]: LayerNorm's mean and variance run over all
  coordinates, so LN(h[perm]) = LN(h)[perm] with permuted affine parameters;
- the output layer is the (permuted) embedding itself: h[perm] . E[:, perm] = h . E, unchanged logits.

The heads' own coordinates (q, k, v outputs, fc1 outputs) are not the stream and stay as they are.
Learned and zero tables need no permutation (perm is the identity there).

Decoding. ``generation_config.json`` holds this model's decoding defaults where ``transformers``
can say the same: the beam size, BOS as the decoder start, EOS, PAD suppressed (our beam search
never extends a hypothesis with PAD), ``early_stopping=True`` (a sentence is done when it has
``beam`` finished hypotheses, as in fairseq and ``tpe-translate``). The length penalty cannot be
said exactly: ``transformers`` divides a hypothesis's log-probability by len ** length_penalty,
``tpe-translate`` by ((5 + len) / 6) ** alpha (GNMT); both are 1 at alpha = 0, the one value where
they agree, so the export's ``length_penalty`` is 0.0 when eval.alpha is 0, and eval.alpha otherwise
(the same exponent on another base; see the model card). The per-sentence length cap of
``tpe-translate`` is a logits processor, ``LengthCap``; ``generate`` decodes a batch with both.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, processors

from tpe_train.ckpt.export import KINDS
from tpe_train.ckpt.rundir import RunDir
from tpe_train.ckpt.store import CheckpointError
from tpe_train.config import Config
from tpe_train.config.plugins import export_refusal
from tpe_train.data.batching import BOS_ID, EOS_ID, PAD_ID
from tpe_train.data.tokenizer import BOS, EOS, PAD, UNK, vocab_hash
from tpe_train.model.args import ModelArgs
from tpe_train.model.generate import max_lengths
from tpe_train.model.transformer import Transformer
from tpe_train.positions import augment
from tpe_train.run.outputs import written_directory

#: What ``tpe-ckpt export --format hf`` writes besides ``transformers``' own files: provenance.
PROVENANCE = "tpe-export.json"

_RELATIVE_WHY = {
    "shaw": "Shaw et al.'s relative key (and value) embeddings inside attention: no transformers text "
    "encoder-decoder has them",
    "t5": "T5's bucketed relative bias would map onto T5ForConditionalGeneration only with its RMSNorm "
    "(no mean, no bias), bias-free projections and unscaled attention; this model has LayerNorm, biased "
    "projections and scaled attention",
    "rope": "rotary q/k embeddings: the transformers text models with rotary attention that form an "
    "encoder-decoder differ elsewhere (RoFormer normalises the embeddings, T5Gemma has RMSNorm and gated "
    "feed-forward layers), so none equals this model",
    "alibi": "ALiBi's linear attention biases: no transformers encoder-decoder has them",
}


@dataclass(frozen=True)
class Target:
    """The ``transformers`` architecture a model maps onto."""

    model_type: str  # marian | pegasus | blenderbot
    class_name: str  # the ...ForConditionalGeneration / MTModel class
    encoding: str  # ours: sinusoidal | learned | none
    permute: bool  # the residual stream's coordinates are permuted (sinusoid layout)


def hf_target(args: ModelArgs) -> Target:
    """The architecture ``args`` maps onto exactly; ``CheckpointError`` with the reason otherwise."""
    enc, dec, cross = args.encoder_position, args.decoder_position, args.cross_position
    if cross != "none" or enc != dec:
        raise CheckpointError(
            f"no transformers encoder-decoder fits this model's encodings (encoder {enc}, decoder {dec}, "
            f"cross-attention {cross}): the exportable models use one encoding in both stacks and none in "
            "cross-attention; export it as --format native"
        )
    pa = args.position_args(causal=False)
    drawn = augment.drawn_positions_refusal(pa.augment, pa.randomized_test, "transformers")
    if drawn is not None:
        raise CheckpointError(drawn)
    refusal = export_refusal(enc, "transformers", "a sinusoid or a learned absolute table")
    if enc not in ("sinusoidal", "learned", "none") and refusal is not None:
        raise CheckpointError(refusal)
    if enc in _RELATIVE_WHY:
        raise CheckpointError(
            f"model.position.kind={enc} cannot be exported to transformers exactly: {_RELATIVE_WHY[enc]}. "
            "Export --format native (tpe-eval, tpe-translate) instead"
        )
    if enc == "sinusoidal" and not args.pre_norm:
        return Target("marian", "MarianMTModel", enc, permute=True)
    if enc == "sinusoidal":
        return Target("pegasus", "PegasusForConditionalGeneration", enc, permute=True)
    if enc in ("learned", "none") and args.pre_norm:
        return Target("blenderbot", "BlenderbotForConditionalGeneration", enc, permute=False)
    if enc in ("learned", "none"):
        raise CheckpointError(
            f"model.position.kind={enc} with post-norm layers (model.pre_norm=false) cannot be exported to "
            "transformers exactly: MarianMTModel, the post-norm model with our layers, recomputes its "
            "sinusoid whenever it is loaded (the table is not saved), so it cannot carry a learned or a "
            "zero table, and BART and BlenderbotSmall normalise the embeddings (layernorm_embedding), which "
            "this model does not. Pre-norm models with these encodings export (BlenderbotForConditional"
            "Generation); export this one as --format native"
        )
    raise CheckpointError(f"model.position.kind={enc}: no transformers export is known for this encoding")


def residual_permutation(d_model: int) -> torch.Tensor:
    """perm with Marian's sinusoid M[:, m] = ours[:, perm[m]]: the even coordinates, then the odd."""
    return torch.cat((torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)))


def _residual_weights(model: Transformer, target: Target) -> dict[str, torch.Tensor]:
    """Our weights under ``transformers``' names for the BART-family layout, the residual stream
    permuted (see the module docstring) where ``target.permute``."""
    args = model.args
    d = args.d_model
    perm = residual_permutation(d) if target.permute else torch.arange(d)
    ours = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}

    def reads(dst: str, src: str) -> None:  # a linear layer fed by the stream: permute input columns
        out[f"{dst}.weight"] = ours[f"{src}.weight"][:, perm]
        out[f"{dst}.bias"] = ours[f"{src}.bias"].clone()

    def writes(dst: str, src: str) -> None:  # a linear layer adding to the stream: permute output rows
        out[f"{dst}.weight"] = ours[f"{src}.weight"][perm, :]
        out[f"{dst}.bias"] = ours[f"{src}.bias"][perm]

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = ours[f"{src}.weight"][perm]
        out[f"{dst}.bias"] = ours[f"{src}.bias"][perm]

    def attention(dst: str, src: str) -> None:
        for a, b in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            reads(f"{dst}.{a}", f"{src}.{b}")
        writes(f"{dst}.out_proj", f"{src}.out")

    embed = ours["embed.weight"][:, perm]
    out["model.shared.weight"] = embed
    for side, n_layers in (("encoder", args.encoder_layers), ("decoder", args.decoder_layers)):
        out[f"model.{side}.embed_tokens.weight"] = embed
        for i in range(n_layers):
            dst, src = f"model.{side}.layers.{i}", f"{side}.layers.{i}"
            attention(f"{dst}.self_attn", f"{src}.self_attn")
            norm(f"{dst}.self_attn_layer_norm", f"{src}.self_norm")
            if side == "decoder":
                attention(f"{dst}.encoder_attn", f"{src}.cross_attn")
                norm(f"{dst}.encoder_attn_layer_norm", f"{src}.cross_norm")
            reads(f"{dst}.fc1", f"{src}.ffn.fc_in")
            writes(f"{dst}.fc2", f"{src}.ffn.fc_out")
            norm(f"{dst}.final_layer_norm", f"{src}.ffn_norm")
        if args.pre_norm:
            norm(f"model.{side}.layer_norm", f"{side}.final_norm")
        if target.encoding == "learned":
            out[f"model.{side}.embed_positions.weight"] = ours[f"{side}.positions.0.table.weight"].clone()
        elif target.encoding == "none":
            out[f"model.{side}.embed_positions.weight"] = torch.zeros(
                args.position_args(False).max_positions, d
            )
    out["lm_head.weight"] = embed
    out["final_logits_bias"] = torch.zeros(1, args.vocab_size)
    return out


def _positions(args: ModelArgs, cfg: Config, target: Target) -> int:
    """``max_position_embeddings``: the learned (or zero) table's rows; for a sinusoid, which is
    recomputed and never saved, room for any sequence training or decoding produced."""
    rows = args.position_args(False).max_positions
    if target.encoding != "sinusoidal":
        return rows
    decodable = int(cfg.eval.max_len_a * (cfg.data.max_len + 1)) + cfg.eval.max_len_b + 1
    return max(1024, rows, cfg.data.max_len + 1, decodable)


def bart_family_kwargs(args: ModelArgs, max_positions: int) -> dict[str, Any]:
    """The keys that Marian, Pegasus, Blenderbot and BART configs share, for a model of ``args``' shape:
    sizes, ReLU, dropouts, sqrt(d_model) embedding scale, tied embeddings, our special token ids."""
    return dict(
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        encoder_attention_heads=args.n_heads,
        decoder_attention_heads=args.n_heads,
        encoder_ffn_dim=args.ffn_dim,
        decoder_ffn_dim=args.ffn_dim,
        activation_function="relu",
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        activation_dropout=args.activation_dropout,
        max_position_embeddings=max_positions,
        scale_embedding=True,  # sqrt(d_model), as ours
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,  # our decoder input starts with BOS
        forced_eos_token_id=None,
        tie_word_embeddings=True,
    )


def hf_config(model: Transformer, cfg: Config, target: Target) -> Any:
    """The ``transformers`` config of the model."""
    import transformers

    args = model.args
    common = bart_family_kwargs(args, _positions(args, cfg, target))
    common["architectures"] = [target.class_name]
    if target.model_type == "marian":
        return transformers.MarianConfig(**common, share_encoder_decoder_embeddings=True)
    if target.model_type == "pegasus":
        return transformers.PegasusConfig(**common)
    return transformers.BlenderbotConfig(**common, encoder_no_repeat_ngram_size=0)


def generation_config(cfg: Config, max_positions: int) -> Any:
    """Decoding defaults (see the module docstring for what maps exactly)."""
    import transformers

    e = cfg.eval
    return transformers.GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        num_beams=e.beam,
        early_stopping=True,
        length_penalty=float(e.alpha),
        suppress_tokens=[PAD_ID],
        max_new_tokens=min(int(e.max_len_a * cfg.data.max_len) + e.max_len_b, max_positions),
        do_sample=False,
    )


def fast_tokenizer(tok: Tokenizer, max_positions: int) -> Any:
    """Our tokenizer as a ``PreTrainedTokenizerFast``: the same vocabulary, normaliser and
    pre-tokeniser, with special tokens named and a post-processor that appends EOS (our sources and
    targets end with EOS), so ``tokenizer(text).input_ids`` is what our encoder and labels see."""
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer.from_str(tok.to_str())
    inner.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, EOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=inner,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
        clean_up_tokenization_spaces=False,  # our decoder's text as it is
        model_max_length=max_positions,
    )


def to_hf(model: Transformer, cfg: Config, tok: Tokenizer) -> tuple[Any, Any]:
    """The ``transformers`` model (eval mode, fp32) and fast tokenizer of one of our models;
    ``CheckpointError`` for a model no ``transformers`` architecture represents exactly."""
    import transformers

    target = hf_target(model.args)
    config = hf_config(model, cfg, target)
    hf = getattr(transformers, target.class_name)(config)
    weights = _residual_weights(model, target)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    # the sinusoid is transformers' own (recomputed, never loaded); everything else must be ours
    missing = [
        k for k in missing if not (target.encoding == "sinusoidal" and k.endswith("embed_positions.weight"))
    ]
    if missing or unexpected:
        raise CheckpointError(
            f"internal: the {target.class_name} layout did not take every weight (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); this transformers version ({transformers.__version__}) may name "
            "its parameters differently"
        )
    hf.generation_config = generation_config(cfg, config.max_position_embeddings)
    hf.eval()
    return hf, fast_tokenizer(tok, config.max_position_embeddings)


def export_hf(model: Transformer, cfg: Config, tok: Tokenizer, out: Path, step: int, source: str) -> Path:
    """Write ``to_hf``'s model and tokenizer to ``out`` with ``save_pretrained``, a model card
    (README.md) and provenance (``PROVENANCE``), atomically (a temporary directory renamed)."""
    hf, hf_tok = to_hf(model, cfg, tok)  # refusals before anything is written
    out = Path(out)
    target = hf_target(model.args)
    from transformers.utils import logging as hf_logging

    meta = {
        "source": source,
        "step": step,
        "architecture": target.class_name,
        "encoding": target.encoding,
        "pre_norm": model.args.pre_norm,
        "residual_permutation": "even coordinates, then odd" if target.permute else "identity",
        "vocab_hash": vocab_hash(tok),
        "eval": {"beam": cfg.eval.beam, "alpha": cfg.eval.alpha, "max_len_a": cfg.eval.max_len_a,
                 "max_len_b": cfg.eval.max_len_b},
    }  # fmt: skip
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a few small files: no progress bars in the command's output
    try:
        with written_directory(out, "tpe-ckpt export", KINDS["hf"], protected=RunDir.what) as tmp:
            hf.save_pretrained(tmp)
            hf_tok.save_pretrained(tmp)
            (tmp / PROVENANCE).write_text(json.dumps(meta, indent=2) + "\n")
            (tmp / "README.md").write_text(model_card(model, cfg, target, step, source, out.name))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return out


def model_card(model: Transformer, cfg: Config, target: Target, step: int, source: str, name: str) -> str:
    """README.md of an export: what it is, how to load it, what maps exactly and what does not."""
    a, e = model.args, cfg.eval
    params = sum(p.numel() for p in model.parameters())
    pair = f"{cfg.data.src_lang} -> {cfg.data.tgt_lang}" if cfg.data.src_lang else "a"
    norm = (
        "pre-norm (LayerNorm before each sublayer, a final LayerNorm per stack)"
        if a.pre_norm
        else "post-norm"
    )
    positions = {
        "sinusoidal": "fixed sinusoids (Vaswani et al. 2017), recomputed by transformers; the residual "
        "stream's coordinates are stored permuted (even, then odd) so that transformers' sines-then-"
        "cosines table lines up with this model's interleaved one: the logits are unchanged",
        "learned": f"a learned absolute table of {a.position_args(False).max_positions} rows: inputs "
        "and outputs are limited to that many positions",
        "none": "none: the position table is all zeros, so the model sees no positions (as trained); "
        "fine-tuning would train that table",
    }[target.encoding]
    lp = (
        "none, as in tpe-translate (eval.alpha = 0)"
        if e.alpha == 0
        else f"`length_penalty={e.alpha}`: transformers divides a hypothesis's log-probability by "
        f"len ** {e.alpha}, tpe-translate by ((5 + len) / 6) ** {e.alpha}, so translations can differ where "
        "hypotheses of different lengths compete; `length_penalty=0.0` here and `--alpha 0` in "
        "tpe-translate decode alike"
    )

    def wrap(text: str, indent: str = "") -> str:
        return textwrap.fill(text, 100, subsequent_indent=indent, break_on_hyphens=False)

    facts = [
        f"Source: `{source}`, training step {step}.",
        f"Shape: d_model {a.d_model}, {a.n_heads} heads, FFN {a.ffn_dim}, {a.encoder_layers} + "
        f"{a.decoder_layers} layers, {norm}, ReLU, one {a.vocab_size}-token vocabulary shared by source, "
        f"target and output layer; {params:,} parameters.",
        f"Positions: {positions}.",
    ]
    exact = (
        "With fp32 weights, teacher-forced logits equal those of the tpe-train model within 1e-4 (what "
        "the export's tests check). `generation_config.json` decodes as `tpe-translate` does: beam "
        f"{e.beam}, "
        f"`early_stopping=True` (a sentence ends when it has {e.beam} finished hypotheses), `<pad>` never "
        f"generated. Length penalty: {lp}. Length: `tpe-translate` allows each sentence {e.max_len_a:g} x "
        f"its source tokens + {e.max_len_b} output tokens and ends it with EOS there; `max_new_tokens` "
        "is one cap for a whole batch and cuts hypotheses without EOS (tpe-train's "
        "`tpe_train.ckpt.hf.LengthCap` logits processor applies the per-sentence cap)."
    )
    return "\n".join([
        f"# {name}",
        "",
        wrap(f"A {pair} translation model trained with tpe-train (encoder-decoder Transformer, position "
             f"encoding: **{target.encoding}**), exported by `tpe-ckpt export --format hf` as "
             f"`{target.class_name}`."),
        "",
        *(wrap(f"- {fact}", "  ") for fact in facts),
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        f'model = AutoModelForSeq2SeqLM.from_pretrained("{name}")',
        'batch = tokenizer(["A man is riding a bike ."], return_tensors="pt", padding=True)',
        "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
        "```",
        "",
        "The tokenizer appends `</s>` to every input, as in training; the decoder starts from `<s>`.",
        "",
        "## Exactness",
        "",
        wrap(exact),
        "",
    ])  # fmt: skip


class LengthCap:
    """A ``transformers`` logits processor for ``tpe-translate``'s length cap: at the step where a
    sentence reaches a * source tokens + b generated tokens (EOS included), EOS is its only choice,
    with its own log-probability (every other token -inf). ``generate`` has one ``max_new_tokens``
    per batch; with this processor each sentence ends where ``tpe-translate`` ends it, in greedy and
    in beam search alike (beam search hands the processor log-probabilities, greedy logits; keeping
    EOS's value is ``tpe-translate``'s forced step in both).

    ``limits``: per sentence of the batch, in order; its ``beams`` rows follow one another."""

    def __init__(self, limits: list[int], beams: int) -> None:
        self.limits = torch.tensor(limits).repeat_interleave(beams)  # (B * K,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[1] - 1  # the decoder start token is no output
        forced = self.limits.to(scores.device) <= generated + 1  # (B * K,): the next token is the last
        if bool(forced.any()):
            eos = scores[forced, EOS_ID].clone()
            scores[forced] = float("-inf")
            scores[forced, EOS_ID] = eos
        return scores


def length_limits(src_lengths: list[int], max_len_a: float, max_len_b: int, cap: int | None) -> list[int]:
    """``tpe-translate``'s per-sentence cap (``generate.max_lengths``) of sources of ``src_lengths``
    tokens, EOS included."""
    return max_lengths(torch.tensor(src_lengths), max_len_a, max_len_b, cap).tolist()


def generate(
    hf: Any, src: list[list[int]], beam: int, length_penalty: float, max_len_a: float, max_len_b: int
) -> list[list[int]]:
    """``hf.generate`` on one batch of source ids (each ending with EOS) as ``tpe-translate`` decodes
    it: the beam, the length penalty (``tpe-translate``'s equals it at 0 only), and each sentence's
    length cap through ``LengthCap``. Returns the generated ids without the start token and EOS."""
    from transformers import LogitsProcessorList

    limits = length_limits([len(s) for s in src], max_len_a, max_len_b, hf.config.max_position_embeddings)
    width = max(len(s) for s in src)
    ids = torch.full((len(src), width), PAD_ID, dtype=torch.long)
    for row, s in enumerate(src):
        ids[row, : len(s)] = torch.tensor(s)
    beam_options = {"num_beams": beam, "length_penalty": length_penalty} if beam > 1 else {"num_beams": 1}
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=(ids != PAD_ID).long(),
            max_new_tokens=max(limits),
            do_sample=False,
            logits_processor=LogitsProcessorList([LengthCap(limits, beam)]),
            **beam_options,
        )
    hyps: list[list[int]] = []
    for row in out[:, 1:].tolist():
        hyps.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
    return hyps
