"""A Hugging Face export against the model it came from, on a test set: teacher-forced logits on the
references, and ``generate`` against ``tpe-translate``'s decoding, sentence by sentence.

    python docs/results/export/compare_hf.py SRC --source test.en --reference test.de --out DIR

SRC is what ``tpe-ckpt export --format hf`` takes (a checkpoint, a run directory or an export); the
export is written to DIR/hf. Logits: every test pair teacher-forced through both models in padded
batches of ``--logits-batch`` pairs (fp32), the largest absolute difference over real target positions.
Decoding: ``tpe-translate``'s batches (``decode_sentences``) and the same batches through
``generate`` (``tpe_train.ckpt.hf.generate``) for greedy and for ``--beam`` at each ``--alphas``
value (``length_penalty`` = alpha in transformers: the same penalty only at 0), compared by token ids
(``tpe-translate``'s from its subword pieces). Each sentence that differs is named with a reason: a
hypothesis at the length cap; a tie (both scores under our model within 1e-5); the two length
penalties ranking the two hypotheses in opposite order; or else the search whose hypothesis scores
higher under ``tpe-translate``'s criterion. Writes DIR/compare.json and DIR/*.txt (the translations);
prints a summary.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from sacrebleu.metrics import BLEU

from tpe_train.ckpt import hf as hf_export
from tpe_train.ckpt.cli import main as ckpt_main
from tpe_train.ckpt.export import load_export
from tpe_train.data.batching import BOS_ID, EOS_ID, pad
from tpe_train.data.tokenizer import encode
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences, read_lines, token_batches
from tpe_train.model.generate import length_penalty


def logits_diff(model: Any, hf: Any, tok: Any, sources: list[str], refs: list[str], batch: int) -> float:
    worst = 0.0
    src_ids = [[*s, EOS_ID] for s in encode(tok, sources)]
    tgt_ids = [[*t, EOS_ID] for t in encode(tok, refs)]
    for i in range(0, len(src_ids), batch):
        src = pad(src_ids[i : i + batch])
        tgt_in = pad([t[:-1] for t in tgt_ids[i : i + batch]], prefix=BOS_ID)
        with torch.no_grad():
            ours = model(src, tgt_in)
            theirs = hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt_in).logits
        keep = pad([t for t in tgt_ids[i : i + batch]]) != 0  # real target positions (EOS included)
        worst = max(worst, float((ours - theirs)[keep].abs().max()))
    return worst


def logprob(model: Any, src: list[int], hyp: list[int]) -> float:
    """log p(hyp + EOS | src) under our model."""
    tgt = [*hyp, EOS_ID]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([src]), torch.tensor([[BOS_ID, *hyp]]))[0].float(), -1)
    return float(lp[torch.arange(len(tgt)), torch.tensor(tgt)].sum())


def hf_decode(hf: Any, seqs: list[list[int]], o: DecodeOptions, lp: float) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in seqs]
    for batch in token_batches([len(s) for s in seqs], o.max_tokens, o.batch_size):
        hyps = hf_export.generate(hf, [seqs[i] for i in batch], o.beam, lp, o.max_len_a, o.max_len_b)
        for i, hyp in zip(batch, hyps, strict=True):
            out[i] = hyp
    return out


def compare(model: Any, hf: Any, tok: Any, sources: list[str], o: DecodeOptions, refs: list[str]) -> dict:
    seqs = [[*s, EOS_ID] for s in encode(tok, sources)]
    start = time.perf_counter()
    # the subword pieces (tpe-translate --pieces): the ids it generated, which the detokenised text
    # need not give back when encoded again
    pieces = [t.text or "" for t in decode_sentences(model, tok, sources, replace(o, pieces=True))]
    ours_ids = [[tok.token_to_id(p) for p in line.split(" ")] if line else [] for line in pieces]
    ours = tok.decode_batch(ours_ids, skip_special_tokens=True)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    hf_ids = hf_decode(hf, seqs, o, o.alpha)
    hf_s = time.perf_counter() - start
    theirs = tok.decode_batch(hf_ids, skip_special_tokens=True)
    differ: list[dict[str, Any]] = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if ours_ids[i] == hf_ids[i]:
            continue
        cap = int(len(seqs[i]) * o.max_len_a) + o.max_len_b
        la, lb = len(ours_ids[i]) + 1, len(hf_ids[i]) + 1  # lengths with EOS
        ra, rb = logprob(model, seqs[i], ours_ids[i]), logprob(model, seqs[i], hf_ids[i])
        # both hypotheses under both criteria: GNMT ((5 + len) / 6) ** alpha; transformers len ** alpha
        ga, gb = ra / float(length_penalty(la, o.alpha)), rb / float(length_penalty(lb, o.alpha))
        ha, hb = ra / la**o.alpha, rb / lb**o.alpha
        if max(la, lb) >= cap:
            why = "length cap"
        elif abs(ga - gb) <= 1e-5 * max(1.0, abs(ga)):
            why = "tie"
        elif ga > gb and hb > ha:
            why = "the two length penalties rank them in opposite order"
        else:
            why = (
                "tpe-translate's search found the better one"
                if ga > gb
                else "generate's search found the better one"
            )
        differ.append({"line": i + 1, "reason": why, "tpe_logprob": round(ra, 6), "hf_logprob": round(rb, 6),
                       "tpe": a, "hf": b})  # fmt: skip
    bleu = BLEU()
    return {
        "beam": o.beam,
        "alpha": o.alpha,
        "identical": len(sources) - len(differ),  # the same token ids
        "identical_text": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "sentences": len(sources),
        "bleu_tpe": round(bleu.corpus_score(ours, [refs]).score, 2) if refs else None,
        "bleu_hf": round(bleu.corpus_score(theirs, [refs]).score, 2) if refs else None,
        "seconds_tpe": round(ours_s, 1),
        "seconds_hf": round(hf_s, 1),
        "differ": differ,
        "_texts": (ours, theirs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a checkpoint, a run directory or an export")
    p.add_argument("--source", required=True, help="source sentences, one a line")
    p.add_argument("--reference", help="reference translations (logits and BLEU)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alphas", default="0,0.6", help="length penalties of the beam runs")
    p.add_argument("--limit", type=int, default=0, help="the first N sentences only (0: all)")
    p.add_argument("--logits-batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForSeq2SeqLM

    args.out.mkdir(parents=True, exist_ok=True)
    hf_dir = args.out / "hf"
    assert ckpt_main(["export", args.src, "--out", str(hf_dir), "--format", "hf"]) == 0
    meta = json.loads((hf_dir / hf_export.PROVENANCE).read_text())
    native = Path(args.src)
    if not (native / "model.safetensors").is_file():  # a checkpoint or a run: export it natively too
        native = args.out / "native"
        assert ckpt_main(["export", args.src, "--out", str(native)]) == 0
    model, cfg, tok = load_export(native)
    hf = AutoModelForSeq2SeqLM.from_pretrained(hf_dir)
    sources = read_lines(args.source)
    refs = read_lines(args.reference) if args.reference else []
    if args.limit:
        sources, refs = sources[: args.limit], refs[: args.limit]
    result: dict[str, Any] = {"src": args.src, "step": meta["step"], "architecture": meta["architecture"],
                              "threads": args.threads, "torch": torch.__version__}  # fmt: skip
    import transformers

    result["transformers"] = transformers.__version__
    if refs:
        result["logits_max_abs_diff"] = logits_diff(model, hf, tok, sources, refs, args.logits_batch)
        worst = result["logits_max_abs_diff"]
        print(f"teacher-forced logits, {len(refs)} pairs: largest |difference| {worst:.2e}")
    runs = [DecodeOptions.of(cfg.eval, beam=1, alpha=0.0)]
    runs += [DecodeOptions.of(cfg.eval, beam=args.beam, alpha=float(a)) for a in args.alphas.split(",")]
    result["decoding"] = []
    for o in runs:
        r = compare(model, hf, tok, sources, o, refs)
        ours, theirs = r.pop("_texts")
        name = f"beam{o.beam}-alpha{o.alpha:g}"
        (args.out / f"{name}.tpe.txt").write_text("".join(t + "\n" for t in ours))
        (args.out / f"{name}.hf.txt").write_text("".join(t + "\n" for t in theirs))
        reasons: dict[str, int] = {}
        for d in r["differ"]:
            reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
        r["reasons"] = reasons
        result["decoding"].append(r)
        print(
            f"beam {o.beam}, alpha {o.alpha:g}: {r['identical']}/{r['sentences']} identical {reasons}; BLEU "
            f"tpe {r['bleu_tpe']} hf {r['bleu_hf']}; {r['seconds_tpe']} s / {r['seconds_hf']} s"
        )
    (args.out / "compare.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
