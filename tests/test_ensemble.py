"""Ensemble decoding: an ensemble of one model (or of one model twice) decodes exactly as the model;
two different models decode deterministically, unlike a member, as the log of the mean of their
probabilities computed here step by step; members of different vocabularies are refused. The models
are untrained tiny ones (their outputs differ from each other, which is all these checks need)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.models import tiny_model

from tpe_train.ckpt.export import save_export
from tpe_train.config import load_config
from tpe_train.data.batching import model_args
from tpe_train.data.tokenizer import train_tokenizer
from tpe_train.evaluation.cli import eval_main, translate_main
from tpe_train.model.build import build_model
from tpe_train.model.ensemble import Ensemble, log_mean_exp
from tpe_train.model.generate import beam_search_nbest, greedy, length_penalty
from tpe_train.model.transformer import Transformer

BOS, EOS = 1, 2


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """One thread (tiny models gain nothing from more, and lose much on a loaded machine), as the
    commands set from the exports' config; the next tests get their count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _src() -> torch.Tensor:
    src = torch.randint(3, 40, (4, 7), generator=torch.Generator().manual_seed(5))
    src[1, 5:] = 0  # padding
    src[3, 3:] = 0
    return src


def _members() -> tuple[Transformer, Transformer]:
    """Two models of one vocabulary, different in position encoding and size."""
    torch.manual_seed(1)
    a = tiny_model("sinusoidal")
    torch.manual_seed(2)
    b = tiny_model("alibi", decoder_layers=3, ffn_dim=48)
    return a, b


Decoded = tuple[list[list[int]], list[list[tuple[float, list[int]]]]]


def _decode(model: Transformer | Ensemble, src: torch.Tensor) -> Decoded:
    """Greedy ids, and beam search's n-best lists with their scores."""
    return greedy(model, src, 1.0, 5), beam_search_nbest(model, src, 3, 0.6, 1.0, 5)


@pytest.mark.parametrize(
    "kind",
    ["sinusoidal", "rope", "learned", "kerple_log", "kerple_power", "sandwich", "fire", "xpos", "cope"],
)
def test_an_ensemble_of_one_model_or_of_it_twice_decodes_exactly_as_the_model(kind: str) -> None:
    model, src = tiny_model(kind), _src()
    alone = _decode(model, src)
    assert _decode(Ensemble([model]), src) == alone  # ids and float scores compared with ==
    assert _decode(Ensemble([model, model]), src) == alone
    lprobs = torch.log_softmax(torch.randn(5, 40), dim=-1)
    assert torch.equal(log_mean_exp(torch.stack([lprobs, lprobs, lprobs])), lprobs)


def _reference_greedy(members: tuple[Transformer, ...], row: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding of one unpadded source, every step a full teacher-forced pass of every member
    and torch.logsumexp of their log-probabilities minus log(n)."""
    src, prefix = row[row != 0][None], [BOS]
    for step in range(steps):
        tgt = torch.tensor([prefix])
        lprobs = torch.stack([torch.log_softmax(m(src, tgt)[0, -1], dim=-1) for m in members])
        best = int((torch.logsumexp(lprobs, dim=0) - math.log(len(members))).argmax())
        if step + 1 == steps or best == EOS:
            break
        prefix.append(best)
    return prefix[1:]


def test_two_models_decode_deterministically_unlike_a_member_as_the_mean_of_probabilities() -> None:
    a, b = _members()
    src, ensemble = _src(), Ensemble([a, b])
    with torch.no_grad():
        first = _decode(ensemble, src)
        assert _decode(ensemble, src) == first
        assert first != _decode(a, src) or first != _decode(b, src)
        ids, nbest = first
        for row, hyp in zip(src, ids, strict=True):
            limit = int((row != 0).sum()) + 5  # max_len_a 1.0, max_len_b 5
            assert hyp == _reference_greedy((a, b), row, limit)
        # Every n-best score is the hypothesis's summed per-step ensemble log-probability (EOS
        # included) over the length penalty, recomputed here with full passes.
        for row, hyps in zip(src, nbest, strict=True):
            assert len(hyps) == 3
            for score, hyp in hyps:
                tgt_in, tgt_out = torch.tensor([[BOS, *hyp]]), torch.tensor([*hyp, EOS])
                sentence = row[row != 0][None]
                lprobs = torch.stack([torch.log_softmax(m(sentence, tgt_in)[0], -1) for m in (a, b)])
                per_step = torch.logsumexp(lprobs, dim=0) - math.log(2)
                total = float(per_step.gather(1, tgt_out[:, None]).sum())
                assert score == pytest.approx(total / float(length_penalty(len(hyp) + 1, 0.6)), abs=1e-4)


def test_models_of_different_vocabularies_are_no_ensemble() -> None:
    with pytest.raises(ValueError, match=r"member 2 has vocabulary size .* must share one vocabulary"):
        Ensemble([tiny_model("sinusoidal"), tiny_model("sinusoidal", vocab_size=48)])


# --------------------------------------------------------------------------------------------------
# tpe-translate and tpe-eval with several checkpoints

WORDS = [
    "the",
    "a",
    "small",
    "big",
    "cat",
    "dog",
    "sees",
    "helps",
    "river",
    "tree",
    "house",
    "bird",
    "runs",
    "near",
    "over",
    "and",
]
SOURCES = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 3 + i % 5)) + " ." for i in range(12)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untrained exports: A and B (another encoding and depth) share a vocabulary, C has another."""
    folder = tmp_path_factory.mktemp("ensemble")
    small = ["model.d_model=32", "model.ffn_dim=64", "model.encoder_layers=1", "model.decoder_layers=1"]
    small += ["eval.max_len_b=6", "train.threads=1"]
    texts = SOURCES * 4
    tok, other_tok = train_tokenizer(texts, 60), train_tokenizer(texts, 50)
    out = {}
    for name, seed, extra, vocab in (
        ("A", 1, [], tok),
        ("B", 2, ["model.position.kind=rope", "model.decoder_layers=2"], tok),
        ("C", 3, [], other_tok),
    ):
        cfg = load_config("demo", [*small, *extra])
        torch.manual_seed(seed)
        model = build_model(model_args(cfg.model, vocab.get_vocab_size()))
        out[name] = save_export(folder / name, model, cfg, vocab, step=0)
    (folder / "test.src").write_text("".join(s + "\n" for s in SOURCES))
    (folder / "test.ref").write_text("".join(s + "\n" for s in SOURCES))
    return out


def _translate(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = translate_main(argv)
    return code, out.getvalue(), err.getvalue()


def test_tpe_translate_with_several_checkpoints(exports: dict[str, Path]) -> None:
    a, b, c = (str(exports[n]) for n in "ABC")
    src = str(exports["A"].parent / "test.src")
    one = _translate(["--checkpoint", a, "-i", src])
    assert one[0] == 0 and "ensemble" not in one[2]
    assert _translate(["--checkpoint", a, a, "-i", src])[1] == one[1]  # the model twice: the model
    both = _translate(["--checkpoint", a, b, "-i", src, "--nbest", "2"])
    assert both[0] == 0 and f"ensemble of 2 checkpoints: {a}, {b}" in both[2]
    assert _translate(["--checkpoint", a, "--checkpoint", b, "-i", src, "--nbest", "2"])[1] == both[1]
    pair = _translate(["--checkpoint", a, b, "-i", src])[1]
    assert pair != one[1] or pair != _translate(["--checkpoint", b, "-i", src])[1]
    code, _, err = _translate(["--checkpoint", a, c, "-i", src])
    assert code == 2 and f"{c} and {a} have different vocabularies" in err and "Traceback" not in err
    code, _, err = _translate(["--checkpoint", a, b, "-i", src, "--position", "alibi.slope_scale=0.5"])
    assert code == 2 and a in err and "no alibi encoding" in err  # --position applies to every member


def test_tpe_eval_of_an_ensemble_says_so_and_scores_what_tpe_translate_writes(
    exports: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = (str(exports[n]) for n in "ABC")
    files = ["--src", str(exports["A"].parent / "test.src"), "--ref", str(exports["A"].parent / "test.ref")]
    assert eval_main(["--checkpoint", a, b, *files, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"ensemble of 2 checkpoints: {a}, {b}\n")
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert figures["ensemble"]["checkpoints"] == [a, b]
    hyps = (tmp_path / "hypotheses" / "test.src.hyp").read_text()
    assert hyps == _translate(["--checkpoint", a, b, "-i", str(exports["A"].parent / "test.src")])[1]
    assert eval_main(["--checkpoint", a, b, *files, "--compare", a, "--json", "--samples", "50"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["system"] == f"{a} + {b}" and report["ensemble"]["checkpoints"] == [a, b]
    assert eval_main(["--checkpoint", a, *files, "--json"]) == 0
    assert "ensemble" not in json.loads(capsys.readouterr().out)
    assert eval_main(["--checkpoint", c, a, *files]) == 2
    assert f"{a} and {c} have different vocabularies" in capsys.readouterr().err
