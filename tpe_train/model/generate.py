"""Batched greedy and beam search with a KV cache (beam 4, alpha 0.6, max length = source + 50), of
one model or of an ensemble (``ensemble.Ensemble``: the members' per-step distributions combined)."""

from __future__ import annotations

import torch
from torch import Tensor

from tpe_train.model.ensemble import Ensemble, as_ensemble
from tpe_train.model.kernels import packed_inference
from tpe_train.model.transformer import Transformer


def length_penalty(length: Tensor | int, alpha: float) -> Tensor | float:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (Wu et al. 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src_len: Tensor, max_len_a: float, max_len_b: int, cap: int | None) -> Tensor:
    """Per sentence: a * source length (EOS included; float32) + b generated tokens (EOS included),
    at most ``cap`` (what the decoder's position encoding can represent), at least 1. The one rule of
    every decoder here, exports' included."""
    limit = (src_len.float() * max_len_a).long() + max_len_b
    if cap is not None:
        limit = limit.clamp(max=cap)
    return limit.clamp(min=1)


def _max_lengths(model: Ensemble, src: Tensor, max_len_a: float, max_len_b: int) -> Tensor:
    return max_lengths((src != model.args.pad_id).sum(dim=1), max_len_a, max_len_b, model.max_target_length())


@packed_inference()
def greedy(
    model: Transformer | Ensemble, src: Tensor, max_len_a: float = 1.0, max_len_b: int = 50
) -> list[list[int]]:
    """Greedy decoding of a batch of sources (B, Ls) -> token ids without BOS/EOS."""
    model = as_ensemble(model)
    args = model.args
    memory = model.encode(src)
    limit = _max_lengths(model, src, max_len_a, max_len_b)
    batch = src.shape[0]
    cache = model.new_cache(src.shape[1], int(limit.max()))
    token = torch.full((batch, 1), args.bos_id, dtype=torch.long, device=src.device)
    out: list[list[int]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    for step in range(int(limit.max())):
        nxt = model.greedy_scores(token, memory, cache).argmax(dim=-1)  # one model: its logits (B, V)
        forced = limit <= step + 1  # last allowed position: emit EOS
        nxt = torch.where(forced, torch.full_like(nxt, args.eos_id), nxt)
        for b in (~done).nonzero().flatten().tolist():
            if int(nxt[b]) != args.eos_id:
                out[b].append(int(nxt[b]))
        done |= nxt == args.eos_id
        if bool(done.all()):
            break
        token = nxt[:, None]
    return out


def beam_search(
    model: Transformer | Ensemble,
    src: Tensor,
    beam: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
) -> list[list[int]]:
    """Batched beam search: the best hypothesis of each source (B, Ls) as token ids without BOS/EOS."""
    return [hyps[0][1] for hyps in beam_search_nbest(model, src, beam, alpha, max_len_a, max_len_b)]


@packed_inference()
def beam_search_nbest(
    model: Transformer | Ensemble,
    src: Tensor,
    beam: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
) -> list[list[tuple[float, list[int]]]]:
    """Batched beam search; per source its ``beam`` finished hypotheses as (score, token ids), best
    first, scored log p / length_penalty (ties keep the order in which they finished).

    As in fairseq, EOS is accepted only among the top ``beam`` candidates of a step, 2 * beam
    candidates are kept so that ``beam`` unfinished ones always continue, and a sentence is done
    when it has ``beam`` finished hypotheses.
    """
    model = as_ensemble(model)
    args = model.args
    device = src.device
    limit = _max_lengths(model, src, max_len_a, max_len_b)
    memory = model.encode(src)
    memory.group = beam  # every sentence's memory serves its K beams, without K copies
    cache = model.new_cache(src.shape[1], int(limit.max()))
    alive = list(range(src.shape[0]))  # the sentences still decoding; row i of the batch is alive[i]
    scores = torch.zeros(len(alive), beam, device=device)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    tokens = torch.full((len(alive) * beam, 1), args.bos_id, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in alive]
    for step in range(int(limit.max())):
        batch = len(alive)
        # A sentence's best 2K continuations are among the best 2K of each of its beams: select per
        # row first, then among the K * 2K survivors (cheaper than adding scores to all K * V). The
        # log-probabilities come from log_softmax's fused kernel, written whole: on the CPU it is
        # faster than logsumexp alone (docs/cpu-kernels.md#beam-search).
        lprobs = model.log_probs(tokens[:, -1:], memory, cache)  # (B*K, V) fp32, written below
        eos_lprob = lprobs[:, args.eos_id].clone()
        lprobs[:, args.pad_id] = float("-inf")
        row_scores, row_tokens = lprobs.topk(2 * beam, dim=-1)  # (B*K, 2K)
        forced = (limit <= step + 1).repeat_interleave(beam)  # must end now: EOS is the only choice
        if bool(forced.any()):
            row_scores[forced] = float("-inf")
            row_scores[forced, 0] = eos_lprob[forced]
            row_tokens[forced, 0] = args.eos_id
        cand = (scores.view(-1, 1) + row_scores).view(batch, 2 * beam * beam)
        top_scores, top_pos = cand.topk(2 * beam, dim=-1)  # (B, 2K)
        src_beam = top_pos // (2 * beam)
        token = row_tokens.view(batch, 2 * beam * beam).gather(1, top_pos)
        is_eos = token == args.eos_id

        # Finalize EOS candidates ranked within the first K.
        for b, c in is_eos[:, :beam].nonzero().tolist():
            done_list = finished[alive[b]]
            if len(done_list) >= beam or top_scores[b, c] == float("-inf"):
                continue
            hyp = tokens[b * beam + int(src_beam[b, c]), 1:].tolist()
            done_list.append((float(top_scores[b, c]) / float(length_penalty(len(hyp) + 1, alpha)), hyp))
        still = [i for i in range(batch) if len(finished[alive[i]]) < beam]
        if not still:
            break

        # Continue with the first K non-EOS candidates of each sentence still decoding.
        order = (is_eos.long() * (2 * beam) + torch.arange(2 * beam, device=device)).argsort(dim=-1)
        keep = order[:, :beam]  # (B, K)
        next_beam = src_beam.gather(1, keep) + torch.arange(batch, device=device)[:, None] * beam
        scores, next_token = top_scores.gather(1, keep), token.gather(1, keep)
        if len(still) < batch:  # drop finished sentences from the batch (and from every cache)
            rows = torch.tensor(still, device=device)
            next_beam, scores, next_token = next_beam[rows], scores[rows], next_token[rows]
            memory = memory.select(rows)
            cache.select_sentences(rows)
            limit = limit[rows]
            alive = [alive[i] for i in still]
        flat = next_beam.flatten()
        cache.reorder(flat)
        tokens = torch.cat((tokens.index_select(0, flat), next_token.reshape(-1, 1)), dim=1)

    for b, hyps in enumerate(finished):
        if not hyps:  # cannot happen (the length limit forces EOS), but never return nothing
            hyps.append((0.0, tokens[alive.index(b) * beam, 1:].tolist() if b in alive else []))
    # a stable sort: among equal scores the first finished stays first
    return [sorted(hyps, key=lambda sh: sh[0], reverse=True) for hyps in finished]
