"""CTranslate2 export of a trained model, and decoding with it as ``tpe-translate`` decodes.

``export_ctranslate2`` fills CTranslate2's own model description (``ctranslate2.specs.TransformerSpec``)
with the model's weights instead of going through one of its converters, so that every choice below is
made here, explicitly, and checked by tests/test_export_ct2.py against our own forward pass and decoding:

- Layers: post-norm (the paper) or pre-norm with a final LayerNorm per stack (``pre_norm``), ReLU FFN,
  LayerNorm epsilon 1e-5 (``nn.LayerNorm``'s, CTranslate2's default is 1e-6), q/k/v with biases fused
  into one product (cross-attention: q, then k and v fused), softmax scale 1/sqrt(head_dim).
- One vocabulary: the tokenizer's tokens in id order, written once (``shared_vocabulary.json``); the
  embedding serves the source, the target and the output layer (CTranslate2 stores it once and aliases
  the others). Embeddings are scaled by sqrt(d_model) before the position term, as ours.
- Special tokens: the source gets ``</s>`` appended by CTranslate2 (``add_source_eos``: the encoder
  input of ``tpe-translate``), the decoder starts from ``<s>`` and stops at ``</s>``. CTranslate2 takes
  token strings: the pieces our ``tokenizer.json`` (copied into the export) makes of a sentence, and
  gives pieces back, which the same tokenizer decodes (``translate``, and the export's README.md).

Position encodings, per stack (the encoder's and the decoder's self-attention; CTranslate2 has no
position term in cross-attention, so ``model.position.cross`` other than none is refused):

- ``sinusoidal``: an explicit table of ``TABLE_POSITIONS`` rows computed by our own function (ours
  interleaves sin and cos, CTranslate2's built-in sinusoid puts them in halves), so the table holds
  our values. ``none``: a table of zeros (without a table CTranslate2 would add its own sinusoid).
  ``learned``: our table (``model.position.max_positions`` rows).
- ``shaw``: CTranslate2's relative position keys (the per-layer (2k + 1, head_dim) table, clip k from
  its size, distance key minus query, the term scaled like the logits) and values (zeros without
  ``shaw_values``).
- ``t5``: CTranslate2's relative attention bias (the (buckets, heads) table, bidirectional in the
  encoder and causal in the decoder, ``max_distance``), computed once per stack as ours.
- ``rope``: CTranslate2's rotary embeddings over the whole head (``rotary_dim`` 0), in the half-split
  layout (``rotary_interleave`` false, GPT-NeoX's, ours), base ``rope_base``, in both stacks.
- ``alibi`` in the decoder: CTranslate2's ALiBi (same slopes, not scaled by 1/sqrt(head_dim)), which
  adds -slope * (last key - key): within a causal row that is ours, -slope * (query - key), plus a
  constant the softmax removes. In the encoder CTranslate2 has no ALiBi; its symmetric
  -slope * |query - key| is written as a T5 bias whose exact buckets cover every distance below
  ``TABLE_POSITIONS`` (4 x ``TABLE_POSITIONS`` buckets, max_distance 2 x ``TABLE_POSITIONS``): exact for
  sources of up to ``TABLE_POSITIONS`` tokens, EOS included (CTranslate2's default ``max_input_length``
  truncates there); longer distances fall into T5's log buckets, given the bias of each bucket's
  smallest distance.

The tables bound the positions: ``TABLE_POSITIONS`` (1,024) source and target positions for none,
sinusoidal and the encoder's ALiBi, ``max_positions`` for learned (CTranslate2 raises an error past a
table); shaw, t5, rope and the decoder's ALiBi are unbounded.

``translate`` decodes with the exported model as ``tpe-translate`` does, where CTranslate2 allows:

- Greedy: CTranslate2's greedy search, ``min_decoding_length`` 0 (EOS allowed first, as ours), one
  call up to the longest sentence's limit, each hypothesis then cut to its own sentence's limit (greedy
  search is prefix-consistent): the search of ours.
- Beam: CTranslate2's beam search expands as ours (2 x beam candidates, EOS taken only among the first
  beam, a sentence done with beam finished hypotheses). Its length penalty divides log p by
  length^alpha, ours by ((5 + length) / 6)^alpha (GNMT), length counting EOS: CTranslate2 is asked for
  its beam finished hypotheses with their scores and ends (score x length^alpha is log p), and they are
  re-ranked by ours. Where more than beam hypotheses finish on a sentence's last step, ours keeps the
  earlier ones and the best of that step by log p, CTranslate2 the best by its normalised score.
- ``<pad>``: ours masks it in beam search after the softmax. CTranslate2 is not asked to suppress it
  (it would remove it before the softmax and so shift every log-probability), so it could continue a
  hypothesis with ``<pad>`` where ours cannot. Its output row is the padding embedding, zero, so its
  logit is 0, far below a trained model's best tokens; ``best_pieces`` shows whether it happened.
- Length: ours limits each sentence to max_len_a x (its source tokens + EOS) + max_len_b decoder steps
  and forces EOS at the last; CTranslate2's beam search takes one limit per call (the longest
  sentence's) and ends every hypothesis still open there without EOS: beam search can differ on
  sentences that reach their limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from tpe_train.ckpt.export import KINDS
from tpe_train.ckpt.rundir import TOKENIZER, RunDir
from tpe_train.ckpt.store import CheckpointError
from tpe_train.config import Config
from tpe_train.config.plugins import export_refusal
from tpe_train.data.batching import BOS_ID, EOS_ID, PAD_ID
from tpe_train.data.tokenizer import BOS, EOS, PAD, UNK
from tpe_train.model.generate import length_penalty, max_lengths
from tpe_train.model.transformer import Layer, Stack, Transformer
from tpe_train.positions import augment
from tpe_train.positions.absolute import sinusoid_table
from tpe_train.positions.relative import alibi_slopes
from tpe_train.run.outputs import written_directory

#: the weight types ``export_ctranslate2`` writes (CTranslate2's names; int8_float16 and float16
#: compute in fp16 on a GPU, on a CPU CTranslate2 computes them as int8 and float32)
QUANTIZATIONS = ("float32", "int8", "int8_float16", "float16")
#: positions of the tables written for none, sinusoidal and the encoder's ALiBi (CTranslate2's default
#: ``max_input_length``: sources are truncated to this many tokens, EOS included)
TABLE_POSITIONS = 1024
#: the encodings each stack can take, and how CTranslate2 represents them
REPRESENTED = {
    "none": "a table of zeros",
    "sinusoidal": "our table, explicit",
    "learned": "our table",
    "shaw": "relative position keys and values",
    "t5": "relative attention bias",
    "rope": "rotary embeddings, half-split",
    "alibi": "ALiBi (decoder); a T5 bias with exact buckets (encoder)",
}
#: the encodings CTranslate2 cannot represent, with the reason
UNREPRESENTED = {
    "kerple_log": "its Transformer takes no learned kernel bias -r1 log(1 + r2 |i-j|), and a T5 bucket "
    "table would be exact only where each distance has its own bucket",
    "kerple_power": "its Transformer takes no learned kernel bias -r1 |i-j|^r2, and a T5 bucket table "
    "would be exact only where each distance has its own bucket",
    "sandwich": "its Transformer takes no sinusoidal-product bias, and a T5 bucket table would be exact "
    "only where each distance has its own bucket",
    "fire": "its Transformer takes no bias from an MLP of the normalised distance, which depends on the "
    "query position as well as the distance",
    "xpos": "its rotary embeddings have no per-position decay of queries and keys",
    "cope": "its attention has no term computed from gated counts of the keys",
}
README = "README.md"


def check_exportable(model: Transformer, tok: Tokenizer, quantization: str) -> None:
    """Raise a ``CheckpointError`` (what ``tpe-ckpt`` reports) naming the reason when the model cannot
    be written exactly, before any work: a cross-attention encoding, a vocabulary the model was not
    built over, an unknown quantization."""
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(
            f"quantization {quantization!r} is not one CTranslate2 export writes; choose one of "
            f"{', '.join(QUANTIZATIONS)}"
        )
    a = model.args
    if a.cross_position != "none":
        raise CheckpointError(
            f"model.position.cross={a.cross_position} cannot be exported to CTranslate2: its "
            "encoder-decoder attention takes no position term (only self-attention has relative "
            "keys, biases, rotary embeddings or ALiBi); only models with cross=none export"
        )
    pa = a.position_args(causal=False)
    drawn = augment.drawn_positions_refusal(pa.augment, pa.randomized_test, "CTranslate2")
    if drawn is not None:
        raise CheckpointError(drawn)
    for side, kind in (("encoder", a.encoder_position), ("decoder", a.decoder_position)):
        if kind in UNREPRESENTED:
            raise CheckpointError(
                f"the {side}'s position encoding {kind!r} cannot be exported to CTranslate2: "
                f"{UNREPRESENTED[kind]}; exportable: {', '.join(REPRESENTED)}"
            )
        if kind not in REPRESENTED:
            refusal = export_refusal(kind, "CTranslate2", "; ".join(REPRESENTED.values()))
            if refusal is not None:
                raise CheckpointError(f"the {side}: {refusal}")
            raise CheckpointError(
                f"the {side}'s position encoding {kind!r} has no CTranslate2 form here; exportable: "
                f"{', '.join(REPRESENTED)}"
            )
    if tok.get_vocab_size() != a.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tok.get_vocab_size()} tokens but the model's embedding {a.vocab_size} "
            "rows; export with the checkpoint's own tokenizer.json"
        )
    for name, i in ((PAD, PAD_ID), (BOS, BOS_ID), (EOS, EOS_ID)):
        if tok.token_to_id(name) != i:
            raise CheckpointError(
                f"the tokenizer's {name} is not id {i}; export with the checkpoint's own tokenizer"
            )
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise CheckpointError(
            f"the model's LayerNorms use several epsilons {sorted(eps)}; CTranslate2 takes one"
        )


def export_ctranslate2(model: Transformer, cfg: Config, tok: Tokenizer, out: Path, quantization: str) -> Path:
    """Write ``model`` (as ``load_export`` returns it, with its config and tokenizer) as a CTranslate2
    model directory ``out`` with weights of type ``quantization`` (one of ``QUANTIZATIONS``), plus
    tokenizer.json and a README.md on loading and translating. Written under a temporary name and
    renamed into place when complete (``run.outputs``). See the module's docstring for the mapping."""
    import ctranslate2  # noqa: F401  (a clear ImportError before any work)

    check_exportable(model, tok, quantization)
    out = Path(out)
    spec = build_spec(model, tok)
    spec.validate()
    spec.optimize(quantization=quantization)
    with written_directory(out, "tpe-ckpt export", KINDS["ctranslate2"], protected=RunDir.what) as tmp:
        spec.save(str(tmp))
        tok.save(str(tmp / TOKENIZER))
        (tmp / README).write_text(readme(model, cfg, quantization))
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy().copy()


def _linear(spec: Any, *modules: nn.Linear) -> None:
    """One CTranslate2 linear layer from one or several of ours fused along the output (q, k, v)."""
    spec.weight = _np(torch.cat([m.weight for m in modules]))
    spec.bias = _np(torch.cat([m.bias for m in modules]))


def _norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _table(kind: str, stack: Stack, d_model: int) -> np.ndarray | None:
    """The explicit position table of an absolute encoding (None for the others)."""
    if kind == "none":
        return np.zeros((TABLE_POSITIONS, d_model), dtype=np.float32)
    if kind == "sinusoidal":
        return _np(sinusoid_table(torch.arange(TABLE_POSITIONS), d_model))
    if kind == "learned":
        learned: Any = stack.pos(0)
        return _np(learned.table.weight)
    return None


def alibi_as_t5(n_heads: int, positions: int = TABLE_POSITIONS) -> tuple[np.ndarray, int]:
    """The encoder's ALiBi, -slope_h * |query - key|, as a bidirectional T5 bias table (4 x positions
    buckets, h columns) and its max_distance: the exact buckets of each sign cover distances below
    ``positions``; the log buckets past them get the bias of their smallest distance. The biases are
    computed as ``AlibiPosition.attn_bias`` computes them (float32 slopes times float32 distances)."""
    slopes = torch.tensor(alibi_slopes(n_heads), dtype=torch.float32)  # (h,)
    exact = torch.arange(positions, dtype=torch.float32)  # bucket r < positions: distance r
    log = torch.arange(positions, dtype=torch.float64)  # bucket positions + r: distances from below
    smallest = torch.ceil(positions * torch.pow(2.0, log / positions)).to(torch.float32)
    distance = torch.cat((exact, smallest))  # (2 x positions,) one sign's buckets
    half = -slopes[None, :] * distance[:, None]  # (2 x positions, h)
    return _np(torch.cat((half, half))), 2 * positions  # key before or at the query, then after


def build_spec(model: Transformer, tok: Tokenizer) -> Any:
    """CTranslate2's ``TransformerSpec`` of ``model``, filled with its fp32 weights and vocabulary."""
    from ctranslate2.specs import common_spec, transformer_spec

    a = model.args
    p = a.position_args(causal=False)
    enc, dec = a.encoder_position, a.decoder_position
    rope = {"rotary_interleave": False, "rotary_base": p.rope_base}
    encoder = transformer_spec.TransformerEncoderSpec(
        a.encoder_layers,
        a.n_heads,
        pre_norm=a.pre_norm,
        activation=common_spec.Activation.RELU,
        relative_position=enc == "shaw",
        relative_attention_bias=enc in ("t5", "alibi"),
        rotary_dim=0 if enc == "rope" else None,
        **rope,
    )
    decoder = transformer_spec.TransformerDecoderSpec(
        a.decoder_layers,
        a.n_heads,
        pre_norm=a.pre_norm,
        activation=common_spec.Activation.RELU,
        relative_position=dec == "shaw",
        relative_attention_bias=dec == "t5",
        alibi=dec == "alibi",
        alibi_use_positive_positions=False,  # -slope * (last key - key): ours up to a row constant
        scale_alibi=False,  # added to the scaled logits, as ours
        rotary_dim=0 if dec == "rope" else None,
        **rope,
    )
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    embedding = _np(model.embed.weight)
    encoder.embeddings[0].weight = embedding
    decoder.embeddings.weight = embedding
    decoder.projection.weight = embedding  # tied output layer, no bias
    for side, kind, stack in (("encoder", enc, model.encoder), ("decoder", dec, model.decoder)):
        s = encoder if side == "encoder" else decoder
        table = _table(kind, stack, a.d_model)
        if table is not None:
            s.position_encodings.encodings = table
        if stack.final_norm is not None:
            _norm(s.layer_norm, stack.final_norm)
        for i, (layer_spec, layer) in enumerate(zip(s.layer, stack.layers, strict=True)):
            assert isinstance(layer, Layer)
            _fill_layer(layer_spec, layer, kind, stack, i, side)
    bos = tok.id_to_token(BOS_ID)
    spec.config.layer_norm_epsilon = next(m.eps for m in model.modules() if isinstance(m, nn.LayerNorm))
    spec.config.add_source_eos = True  # the encoder reads the pieces + </s>, as ours
    spec.config.decoder_start_token = bos
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = bos, EOS, UNK
    vocabulary = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    return spec


def _fill_layer(spec: Any, layer: Layer, kind: str, stack: Stack, i: int, side: str) -> None:
    """One encoder or decoder layer: attention(s), norms, FFN and the self-attention's position term."""
    attn = spec.self_attention
    _linear(attn.linear[0], layer.self_attn.q, layer.self_attn.k, layer.self_attn.v)
    _linear(attn.linear[1], layer.self_attn.out)
    _norm(attn.layer_norm, layer.self_norm)
    if layer.cross_attn is not None and layer.cross_norm is not None:
        cross = spec.attention
        _linear(cross.linear[0], layer.cross_attn.q)
        _linear(cross.linear[1], layer.cross_attn.k, layer.cross_attn.v)
        _linear(cross.linear[2], layer.cross_attn.out)
        _norm(cross.layer_norm, layer.cross_norm)
    _linear(spec.ffn.linear_0, layer.ffn.fc_in)
    _linear(spec.ffn.linear_1, layer.ffn.fc_out)
    _norm(spec.ffn.layer_norm, layer.ffn_norm)
    pos: Any = stack.pos(i)
    if kind == "shaw":
        attn.relative_position_keys = _np(pos.keys)
        values = pos.values if pos.values is not None else torch.zeros_like(pos.keys)
        attn.relative_position_values = _np(values)
    elif kind == "t5":
        attn.relative_attention_bias = _np(pos.table.weight)  # one table per stack, aliased per layer
        attn.relative_attention_max_distance = np.int32(pos.args.t5_max_distance)
    elif kind == "alibi" and side == "encoder":
        table, max_distance = alibi_as_t5(pos.args.n_heads)
        attn.relative_attention_bias = table
        attn.relative_attention_max_distance = np.int32(max_distance)


# ------------------------------------------------------------------------------------------ decoding


def pieces(tok: Tokenizer, sentences: list[str]) -> list[list[str]]:
    """The token strings CTranslate2 takes for each sentence (no specials: it appends ``</s>``)."""
    return [e.tokens for e in tok.encode_batch(sentences, add_special_tokens=False)]


def detokenize(tok: Tokenizer, hypotheses: list[list[str]]) -> list[str]:
    """Text of CTranslate2's output pieces, as ``tpe-translate`` writes it (specials dropped)."""
    ids = [[tok.token_to_id(t) for t in hyp] for hyp in hypotheses]
    return tok.decode_batch([[i for i in hyp if i is not None] for hyp in ids], skip_special_tokens=True)


def limits(lengths: list[int], max_len_a: float, max_len_b: int, cap: int | None) -> list[int]:
    """Each source's decoder steps (EOS included), ``generate.max_lengths`` of its token count + EOS."""
    return max_lengths(torch.tensor([n + 1 for n in lengths]), max_len_a, max_len_b, cap).tolist()


def translate(
    translator: Any,
    tok: Tokenizer,
    sentences: list[str],
    beam: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    max_tokens: int = 6000,
    max_target_positions: int | None = None,
) -> list[str]:
    """``sentences`` translated by a ``ctranslate2.Translator`` of an export, in their order, with the
    decoding of ``tpe-translate`` (beam, GNMT length penalty alpha, at most max_len_a x (source + EOS)
    + max_len_b steps, batches of at most ``max_tokens`` source tokens): see the module's docstring for
    where the two can differ. ``max_target_positions``: the decoder's table
    (``model.max_target_length()``), which caps the steps as ours does. Empty lines translate to empty
    lines."""
    best = best_pieces(translator, tok, sentences, beam, alpha, max_len_a, max_len_b, max_tokens,
                       max_target_positions)  # fmt: skip
    return detokenize(tok, best)


def best_pieces(
    translator: Any,
    tok: Tokenizer,
    sentences: list[str],
    beam: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    max_tokens: int = 6000,
    max_target_positions: int | None = None,
) -> list[list[str]]:
    """The best hypothesis of each sentence as CTranslate2's pieces, without EOS (``translate``)."""
    todo = [i for i, s in enumerate(sentences) if s.strip()]
    out: list[list[str]] = [[] for _ in sentences]
    if not todo:
        return out
    src = pieces(tok, [sentences[i] for i in todo])
    steps = limits([len(s) for s in src], max_len_a, max_len_b, max_target_positions)
    common: dict[str, Any] = {
        "max_batch_size": max_tokens,
        "batch_type": "tokens",
        "max_input_length": 0,  # never truncate (a table's end raises an error instead)
        "min_decoding_length": 0,
    }
    if beam == 1:
        # Greedy is prefix-consistent: one call up to the longest limit, then each hypothesis cut to
        # its own limit - 1 tokens (ours then emits EOS) is the search of ours.
        results = translator.translate_batch(src, beam_size=1, max_decoding_length=max(steps) - 1, **common)
        best = [r.hypotheses[0][: n - 1] for r, n in zip(results, steps, strict=True)]
    else:
        penalty = alpha if alpha > 0 else 1e-6  # 0 would stop a sentence at its first finished beam
        results = translator.translate_batch(
            src,
            beam_size=beam,
            num_hypotheses=beam,
            length_penalty=penalty,
            return_scores=True,
            return_end_token=True,
            max_decoding_length=max(steps),
            **common,
        )
        best = [rerank(r.hypotheses, r.scores, penalty, alpha) for r in results]
    for i, hyp in zip(todo, best, strict=True):
        out[i] = hyp
    return out


def rerank(hypotheses: list[list[str]], scores: list[float], penalty: float, alpha: float) -> list[str]:
    """The best of CTranslate2's finished hypotheses (with their end token, scored log p / length^penalty)
    under our GNMT penalty, log p / ((5 + length) / 6)^alpha, length counting EOS; returned without EOS."""
    ranked = [
        (score * len(hyp) ** penalty / float(length_penalty(len(hyp), alpha)), hyp)
        for hyp, score in zip(hypotheses, scores, strict=True)
    ]
    hyp = max(ranked, key=lambda sh: sh[0])[1]  # the first of equal scores, as ours
    return hyp[:-1] if hyp and hyp[-1] == EOS else hyp


def readme(model: Transformer, cfg: Config, quantization: str) -> str:
    """The export's README.md: what it holds, how to load it and translate with it."""
    a, e = model.args, cfg.eval
    limits = []
    for side, kind in (("source", a.encoder_position), ("target", a.decoder_position)):
        if kind in ("none", "sinusoidal") or (kind == "alibi" and side == "source"):
            limits.append(f"{side}: {TABLE_POSITIONS} positions (EOS included)")
        elif kind == "learned":
            limits.append(f"{side}: {a.position_args(False).max_positions} positions (the learned table)")
    limit_text = "; ".join(limits) if limits else "none (relative encodings)"
    return f"""# CTranslate2 model exported by tpe-train

Encoder {a.encoder_layers} layers, decoder {a.decoder_layers}, d_model {a.d_model}, {a.n_heads} heads, FFN
{a.ffn_dim}, {"pre" if a.pre_norm else "post"}-norm. Position encoding: encoder `{a.encoder_position}`
({REPRESENTED[a.encoder_position]}), decoder `{a.decoder_position}` ({REPRESENTED[a.decoder_position]}).
Weights: {quantization}. Position limits: {limit_text}.

The vocabulary (`shared_vocabulary.json`) is `tokenizer.json`'s, in id order; CTranslate2 takes and
returns token strings, and appends `</s>` to the source itself.

```python
import ctranslate2
from tokenizers import Tokenizer

tok = Tokenizer.from_file("MODEL_DIR/tokenizer.json")
translator = ctranslate2.Translator("MODEL_DIR", device="cpu", intra_threads=2)
lines = ["a man is riding a bike ."]
source = [e.tokens for e in tok.encode_batch(lines, add_special_tokens=False)]
results = translator.translate_batch(
    source, beam_size={e.beam}, length_penalty={e.alpha}, min_decoding_length=0, max_batch_size=4096,
    batch_type="tokens",
)
ids = [[tok.token_to_id(t) for t in r.hypotheses[0]] for r in results]
print(tok.decode_batch(ids, skip_special_tokens=True))
```

`tpe-translate` uses beam {e.beam} with the GNMT length penalty ((5 + length) / 6)^{e.alpha} (length
with EOS), at most {e.max_len_a} x source tokens + {e.max_len_b} output tokens. CTranslate2's
`length_penalty` divides by length^alpha instead, so the snippet above can rank the finished hypotheses
of some sentences differently. For `tpe-translate`'s ranking ask for all of them and re-rank:

```python
results = translator.translate_batch(
    source, beam_size={e.beam}, num_hypotheses={e.beam}, length_penalty=1.0, return_scores=True,
    return_end_token=True, suppress_sequences=[["<pad>"]], min_decoding_length=0,
)
def gnmt(score, hyp):  # length penalty 1: score x length is the log-probability
    return score * len(hyp) / ((5 + len(hyp)) / 6) ** {e.alpha}
best = [max(zip(r.scores, r.hypotheses), key=lambda sh: gnmt(*sh))[1] for r in results]
best = [h[:-1] if h and h[-1] == "</s>" else h for h in best]
```

(`tpe_train.ckpt.ct2.translate` does this, with the length limit.) Greedy: `beam_size=1,
min_decoding_length=0`.
"""
