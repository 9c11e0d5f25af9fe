"""A newcomer's first day, end to end at a tiny size, through the real commands as a user types them:
their own parallel text in a folder of their own, an encoding from their own installed package,
check, prepare, train, evaluate, export to CTranslate2 and translate with it, and the Slurm job their cluster
needs (site options and a set-up file) rendered with --dry-run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.plugin_pkg import env_with, install_good

pytestmark = pytest.mark.integration  # every test here starts the project's commands

EN = {"cat": "katze", "dog": "hund", "bird": "vogel", "man": "mann", "woman": "frau", "child": "kind"}
VERB = {"sees": "sieht", "finds": "findet", "likes": "mag", "follows": "folgt"}
ADJ = {"red": "rote", "small": "kleine", "old": "alte", "happy": "frohe"}


def sentences(n: int, seed: int) -> tuple[list[str], list[str]]:
    """``n`` tiny English-German pairs (word by word), as a user's own corpus."""
    rng = random.Random(seed)
    en, de = [], []
    for _ in range(n):
        a, b = rng.sample(sorted(EN), 2)
        adj, verb = rng.choice(sorted(ADJ)), rng.choice(sorted(VERB))
        en.append(f"the {adj} {a} {verb} the {b} .")
        de.append(f"die {ADJ[adj]} {EN[a]} {VERB[verb]} die {EN[b]} .")
    return en, de


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def tpe(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def test_a_newcomer_trains_their_corpus_with_their_encoding_and_exports_it(tmp_path: Path) -> None:
    home = tmp_path / "project"
    corpus = home / "corpora" / "mine"
    corpus.mkdir(parents=True)
    en, de = sentences(360, seed=3)  # the user's own two text files ...
    (corpus / "all.en").write_text("\n".join(en) + "\n")
    (corpus / "all.de").write_text("\n".join(de) + "\n")
    for lang, lines in (("en", en), ("de", de)):  # ... split as own_corpus lays them out
        for split, part in (("train", lines[:300]), ("validation", lines[300:330]), ("test", lines[330:])):
            (corpus / f"{split}.{lang}").write_text("\n".join(part) + "\n")
    env = env_with(install_good(tmp_path / "plugin"))  # their package: the encoding `scaled`
    config = [
        "data.path=corpora/mine",
        "data.src_lang=en",
        "data.tgt_lang=de",
        "data.vocab_size=120",
        "data.num_proc=1",
        "data.max_tokens=512",
        "model.d_model=16",
        "model.ffn_dim=32",
        "model.n_heads=2",
        "model.encoder_layers=1",
        "model.decoder_layers=1",
        "model.position.kind=scaled",
        "train.max_steps=3",
        "train.batch_tokens=0",
        "train.warmup_steps=2",
        "eval.average_last=2",  # the final model: the mean of the last two checkpoints
        "train.save_every=1",
        "train.keep_last=2",
        "train.valid_bleu_size=0",
        "train.progress=false",
        "eval.beam=1",
        "train.run_dir=runs/mine",
    ]

    checked = run([tpe("tpe-data"), "check", "--preset", "own_corpus", *config], env, home)
    report = checked.stdout + checked.stderr
    assert "found corpora/mine/train.en: 300 lines" in report and "no problems found" in report, report
    run([tpe("tpe-data"), "prepare", "--preset", "own_corpus", *config], env, home)
    train = run([tpe("tpe-train"), "--preset", "own_corpus", *config], env, home)
    assert "position scaled" in train.stdout + train.stderr
    checkpoint = home / "runs" / "mine" / "checkpoint"
    assert (checkpoint / "model.safetensors").is_file()

    averaged = home / "runs" / "mine" / "averaged-last2"  # the preset's final model
    assert (averaged / "model.safetensors").is_file()
    scored = run([tpe("tpe-eval"), "--checkpoint", str(averaged), "--json", "--limit", "10"], env, home)
    figures = json.loads(scored.stdout)
    assert figures["test_set"] == "test[:10]" and figures["test_sentences"] == 10
    assert 0 <= figures["bleu"] <= 100 and figures["chrf"] > 0

    # CTranslate2 takes no Python code: the plugin's encoding is refused with the reason; the same corpus
    # with a built-in encoding exports and translates
    refused = subprocess.run([tpe("tpe-ckpt"), "export", str(checkpoint), "--format", "ctranslate2",
                              "--out", "ct2"], capture_output=True, text=True, env=env, cwd=home)  # fmt: skip
    assert refused.returncode != 0 and "'scaled'" in refused.stderr and "mypos" in refused.stderr
    sinusoidal = [*config[:-2], "model.position.kind=sinusoidal", "train.run_dir=runs/mine-sin"]
    sinusoidal.remove("model.position.kind=scaled")
    run([tpe("tpe-train"), "--preset", "own_corpus", *sinusoidal], env, home)
    run([tpe("tpe-ckpt"), "export", "runs/mine-sin/checkpoint", "--format", "ctranslate2", "--out", "ct2"],
        env, home)  # fmt: skip
    assert (home / "ct2" / "model.bin").is_file()
    import ctranslate2  # the exported model loads and translates in CTranslate2 itself
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(home / "ct2" / "tokenizer.json"))
    source = [tok.encode("the red cat sees the dog .", add_special_tokens=False).tokens]
    translator = ctranslate2.Translator(str(home / "ct2"), device="cpu", intra_threads=1)
    result = translator.translate_batch(source, beam_size=1, max_decoding_length=8)
    assert all(tok.token_to_id(t) is not None for t in result[0].hypotheses[0])

    # their cluster: a QOS, memory, a reservation, and the set-up their nodes need, in one job script
    (home / "setup.sh").write_text("module load cuda/12.4\nsource ~/venvs/tpe/bin/activate\n")
    submit = [tpe("tpe-launch"), "submit", "--preset", "own_corpus", "--nodes", "1", "--gpus-per-node", "2",
              "--time", "4:00:00", "--qos", "normal", "--mem", "64G", "--sbatch", "reservation=lab",
              "--setup", "setup.sh", "--dry-run", *config]  # fmt: skip
    job = run(submit, env, home).stdout
    expected = ["#SBATCH --qos=normal", "#SBATCH --mem=64G", "#SBATCH --reservation=lab"]
    expected += ["#SBATCH --gpus-per-node=2", "#SBATCH --cpus-per-gpu=8", "module load cuda/12.4"]
    for line in expected:
        assert line in job, job
    assert job.index("module load cuda/12.4") < job.index("exec tpe-launch supervise")
    assert "model.position.kind=scaled" in job and str(home / "runs" / "mine") in job
