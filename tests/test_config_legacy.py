"""A saved config that lacks a key added later means what the code that wrote it did
(``tpe_train/config/legacy.py``): an older CoPE checkpoint is CoPE without the division, and resuming
an older checkpoint of another encoding is not refused over a key that encoding never reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tpe_train.ckpt.errors import CheckpointError
from tpe_train.ckpt.store import check_compatible
from tpe_train.config import legacy, load_config, validate


def older_checkpoint(tmp_path: Path, kind: str, **position: object) -> Path:
    """A checkpoint folder whose config.yaml was written before cope_divide, randomized_per_layer and
    randomized_test."""
    overrides = [f"model.position.kind={kind}", *(f"model.position.{k}={v}" for k, v in position.items())]
    cfg = load_config("demo", overrides)
    data = cfg.model_dump(mode="json")
    for key in ("cope_divide", "randomized_per_layer", "randomized_test"):
        del data["model"]["position"][key]
    folder = tmp_path / kind / "step-00000010"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(data))
    (folder / "trainer.json").write_text("{}")
    return folder


def test_an_absent_key_means_the_behaviour_of_the_code_that_wrote_it(tmp_path: Path) -> None:
    folder = older_checkpoint(tmp_path, "cope")
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert validate(saved).model.position.cope_divide is True  # unfilled, the default would change it
    filled = validate(legacy.fill(saved)).model.position
    assert filled.cope_divide is False and filled.randomized_per_layer is False
    assert filled.randomized_test is False
    assert "cope_divide" not in saved["model"]["position"]  # fill copies


def test_resuming_an_older_checkpoint_compares_only_keys_that_act_on_its_model(tmp_path: Path) -> None:
    xpos = older_checkpoint(tmp_path, "xpos")
    check_compatible(xpos, load_config("demo", ["model.position.kind=xpos"]))  # cope_divide: not xpos's
    cope = older_checkpoint(tmp_path, "cope")
    with pytest.raises(CheckpointError, match=r"model\.position\.cope_divide is False there, True here"):
        check_compatible(cope, load_config("demo", ["model.position.kind=cope"]))
    check_compatible(
        cope, load_config("demo", ["model.position.kind=cope", "model.position.cope_divide=false"])
    )
    rope = older_checkpoint(tmp_path, "rope", augment="randomized", randomized_range=256)
    with pytest.raises(CheckpointError, match="randomized_per_layer is False there, True here"):
        augmented = ["model.position.augment=randomized", "model.position.randomized_range=256"]
        check_compatible(rope, load_config("demo", ["model.position.kind=rope", *augmented]))
