"""Config loading: order of precedence, every preset, and the promised error messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tpe_train.config import PRESET_DIR, Config, ConfigError, describe, load_config, validate

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def test_defaults_preset_overrides_in_order() -> None:
    cfg = load_config("demo", ["model.position.kind=rope", "train.max_steps=200"])
    assert cfg.model.position.kind == "rope"
    assert cfg.train.max_steps == 200
    assert cfg.model.d_model == 128  # from the preset
    assert cfg.train.adam_betas == (0.9, 0.98)  # default
    assert cfg.preset == "demo"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_and_validates(preset: str) -> None:
    cfg = load_config(preset)
    assert isinstance(cfg, Config)
    assert Config.model_validate(cfg.model_dump()) == cfg  # YAML round trip is lossless


def test_preset_can_be_a_path_and_inherit(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("base: demo\nmodel:\n  n_heads: 8\n")
    cfg = load_config(str(child))
    assert cfg.model.n_heads == 8 and cfg.model.d_model == 128


def test_resolved_config_round_trips_through_yaml() -> None:
    import yaml

    cfg = load_config("demo", ["model.position.kind=t5"])
    assert Config.model_validate(yaml.safe_load(cfg.to_yaml())) == cfg


ERRORS = [
    (["model.position.kind=rotary"], "model.position.kind='rotary' is not a position encoding; choose"),
    (["model.position.cross=rotary"], "model.position.cross='rotary'"),
    (["model.n_heds=4"], "unknown key 'model.n_heds' in section 'model'; valid keys are: d_model, n_heads"),
    (["trian.max_steps=4"], "unknown key 'trian'"),
    (["train.max_steps=abc"], "train.max_steps"),
    (["train.max_steps=0"], "train.max_steps"),
    (["model.d_model=100", "model.n_heads=8"], "model.d_model (100) is not divisible by model.n_heads (8)"),
    (
        ["model.position.kind=learned", "model.position.max_positions=50", "data.max_len=100"],
        "max_positions (50) is shorter than the longest training sequence",
    ),
    (["model.position.kind=rope", "model.d_model=12", "model.n_heads=4"], "rope needs an even head"),
    (["data.synthetic.max_words=60", "data.synthetic.long_max_words=50"], "max_words < long_max_words"),
    (["train.max_steps"], "overrides are KEY=VALUE"),
    (
        ["eval.average_last=3", "train.save_every=0"],
        "train.save_every=0 saves only at the end; set train.save_every",
    ),
    (["eval.average_last=6", "train.keep_last=5"], "raise train.keep_last to at least 6"),
    (["model.attention=fused"], "model.attention: Input should be 'auto', 'flex', 'sdpa' or 'explicit'"),
    (
        ["model.attention=flex", "model.attention_dropout=0.1"],
        "model.attention=flex has no dropout on the attention weights",
    ),
    (["eval.select=average_last"], "set eval.average_last=N with N >= 2"),
    (["eval.select=best", "eval.average_last=3"], "only eval.select=average_last does, but eval.select=best"),
    (
        ["eval.select=best", "eval.select_by=bleu", "train.valid_bleu_size=0"],
        "train.valid_bleu_size=0 translates no validation sentence",
    ),
    (["train.patience=2", "eval.select_by=bleu", "train.valid_bleu_size=0"], "or eval.select_by=loss"),
    (["eval.select=first"], "eval.select"),
    (["train.seed=-1"], "train.seed takes a whole number in [0, 4294967295]"),
    (["train.seed=4294967296"], "train.seed: Input should be less than or equal to 4294967295"),
    (["data.synthetic.seed=-3"], "data.synthetic.seed takes a whole number in [0, 4294967295]"),
    (["train.max_steps=true"], "train.max_steps: a number is needed, not a boolean (got True)"),
    (["train.lr=true"], "train.lr: a number is needed, not a boolean"),
    (["train.lr=inf"], "train.lr: Input should be a finite number"),
    (["train.lr=.nan"], "train.lr takes a finite number > 0.0"),
    (["train.bf16=1"], "train.bf16 takes true or false"),
    (["eval.length_buckets=[20,10]"], "eval.length_buckets: the list must be strictly ascending"),
    (["eval.length_buckets=[10,10]"], "the list must be strictly ascending (sorted, no repeats)"),
    (["eval.length_buckets=[-1,10]"], "eval.length_buckets takes ascending whole numbers >= 1"),
    (
        ["train.adam_betas=[0.9,1.0]"],
        "train.adam_betas takes a list of 2, each a finite number in [0.0, 1.0)",
    ),
    (["train.max_steps=9223372036854775808"], "train.max_steps: Input should be less than or equal to"),
    (["train.max_steps=" + "9" * 5000], "cannot read the overrides"),
    (["train.run_dir=\x01"], "cannot read the overrides"),
    (
        ["eval.length_buckets={}"],
        "override of eval.length_buckets gives a mapping where the preset has a list",
    ),
    (["model=[1]"], "override of model gives a list where the preset has a mapping"),
    (["parallel.tp_size=0"], "parallel.tp_size takes a whole number >= 1, or empty"),
    (["data.max_tokens=8"], "data.max_tokens=8 cannot hold a pair"),
    (["model.position.kind=[rope]"], "model.position.kind takes one of none, sinusoidal"),
]


def test_a_config_that_averages_without_eval_select_still_means_average_last() -> None:
    cfg = load_config("demo", ["eval.average_last=3", "train.save_every=100", "train.keep_last=3"])
    assert cfg.eval.select == "average_last" and cfg.eval.average_last == 3
    assert load_config("demo").eval.select == "last"


@pytest.mark.parametrize(("overrides", "message"), ERRORS)
def test_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("demo", overrides)
    assert message in str(err.value)


def test_a_huge_value_is_named_without_printing_it() -> None:
    with pytest.raises(
        ConfigError, match=r"train.max_steps: the number is far too large \(got a number of about"
    ):
        validate({"train": {"max_steps": 10**5000}})


def test_text_keys_refuse_control_characters() -> None:
    with pytest.raises(ConfigError) as err:
        validate({"train": {"run_dir": "runs/a\nb"}})
    assert "train.run_dir: the text holds the control character '\\n'" in str(err.value)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ConfigError, match="demo"):
        load_config("no-such-preset")


@pytest.mark.integration
def test_cli_error_is_one_message_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tpe_train.train", "model.n_heads=5", f"train.run_dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "model.d_model (128) is not divisible by model.n_heads (5)" in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started


def test_every_key_is_documented() -> None:
    rows = describe()
    assert len(rows) > 40
    undocumented = [key for key, _, _, doc in rows if not doc]
    assert undocumented == []


def test_docs_config_reference_is_up_to_date() -> None:
    from tpe_train.config import markdown_reference

    docs = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert docs.read_text() == markdown_reference(), "regenerate: python -m tpe_train.config > docs/config.md"


def test_the_model_sections_defaults_and_fields_are_the_models_own() -> None:
    """Each default is written once: the model and position sections' defaults are ``ModelArgs``' and
    ``PositionArgs``', and ``ModelConfig.args`` hands over every field those take."""
    import dataclasses

    from tpe_train.config.model_sections import MODEL_FIELDS, POSITION_FIELDS, ModelConfig
    from tpe_train.model.args import ModelArgs
    from tpe_train.positions import PositionArgs

    derived = {"vocab_size", "pad_id", "bos_id", "eos_id", "encoder_position", "decoder_position"}
    assert {f.name for f in dataclasses.fields(ModelArgs)} == {
        *MODEL_FIELDS,
        *derived,
        "cross_position",
        "position",
    }
    assert {f.name for f in dataclasses.fields(PositionArgs)} == {
        *POSITION_FIELDS,
        "d_model",
        "n_heads",
        "causal",
    }
    default = ModelArgs(vocab_size=100)
    assert ModelConfig().args(100, 0, 1, 2) == dataclasses.replace(
        default, position=default.position_args(False)
    )
