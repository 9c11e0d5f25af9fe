"""An encoding's hooks act because the class defines them: ``has_bias``, ``needs_keys`` and
``needs_weights`` follow from ``attn_bias``, ``key_bias`` and ``value_term`` (``PositionEncoding.
__init_subclass__``), and a class that declares flags against its hooks is refused when it is defined.

End to end: a package of the user's own with one encoding per hook, each written as docs/positions.md
"Your own encoding" says (no flag set), installed with pip and trained by ``tpe-train``; each one's
parameter moves, so attention called its hook and the gradient reached it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.plugin_pkg import HOOKS, TINY, command, env_with, install_hooks, run
from tpe_train.positions import POSITIONS, PositionArgs, PositionEncoding
from tpe_train.positions.relative import T5Position

#: the built-ins whose class defines attn_bias (has_bias) and key_bias (needs_keys), as before the flags
#: were derived
BIASED = {"shaw", "t5", "alibi", "kerple_log", "kerple_power", "sandwich", "fire"}
KEYED = {"cope"}


def test_builtin_encodings_keep_their_flags() -> None:
    for name in POSITIONS.names():
        cls = POSITIONS.get(name)
        assert cls.has_bias == (name in BIASED), name
        assert cls.needs_keys == (name in KEYED), name
        for values in (False, True):
            enc = cls(PositionArgs(d_model=16, n_heads=2, causal=False, shaw_values=values))
            assert enc.needs_weights == (name == "shaw" and values), name  # Shaw's value table is optional


def define(body: dict[str, Any], base: type[PositionEncoding] = PositionEncoding) -> type[PositionEncoding]:
    return type("Mine", (base,), {"__module__": "mypkg.positions", **body})


def bias(self: PositionEncoding, q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, 1, q_pos.shape[0], k_pos.shape[0])


def keyed(self: PositionEncoding, q: Any, k: Any, q_pos: Any, k_pos: Any, keep: Any) -> torch.Tensor:
    return torch.zeros(())


def value(self: PositionEncoding, weights: Any, q_pos: Any, k_pos: Any) -> torch.Tensor:
    return torch.zeros(())


def mod(self: PositionEncoding, q: Any, q_pos: Any, k_pos: Any) -> None:
    return None


def test_each_hook_sets_its_flag_and_a_subclass_inherits_it() -> None:
    flags = ("has_bias", "needs_keys", "needs_weights")
    for hook, fn, flag in (("attn_bias", bias, "has_bias"), ("key_bias", keyed, "needs_keys"),
                           ("value_term", value, "needs_weights")):  # fmt: skip
        cls = define({hook: fn})
        assert {f: getattr(cls, f) for f in flags} == {f: f == flag for f in flags}, hook
        assert getattr(define({}, base=cls), flag), hook  # the hook inherited: the flag too
        assert getattr(define({flag: True, hook: fn}), flag), hook  # the flag stated as it follows
    t5_child = define({}, base=T5Position)
    assert t5_child.has_bias and t5_child.shared_bias and not t5_child.needs_keys
    assert define({"embed": lambda self, x, pos: x}).has_bias is False


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"has_bias": False, "attn_bias": bias}, "sets has_bias = False but defines attn_bias"),
        ({"has_bias": True}, "sets has_bias = True but defines no attn_bias"),
        ({"needs_keys": True}, "sets needs_keys = True but defines no key_bias"),
        ({"needs_keys": False, "key_bias": keyed}, "sets needs_keys = False but defines key_bias"),
        ({"needs_weights": True}, "sets needs_weights = True but defines no value_term"),
        ({"needs_weights": False, "value_term": value}, "sets needs_weights = False but defines value_term"),
        ({"attn_bias": bias, "key_bias": keyed}, "defines both attn_bias and key_bias"),
        ({"score_mod": mod}, "defines score_mod but no attn_bias"),
        ({"shared_bias": True}, "sets shared_bias = True but defines no attn_bias"),
        ({"shared_bias": True, "per_layer": True, "attn_bias": bias}, "sets both shared_bias"),
        ({"tp_split": "rows"}, "sets tp_split = 'rows', not one of heads, positions, replicated"),
        ({"augments": "cape"}, "sets augments = 'cape', not a tuple of shape, cape, randomized"),
        ({"augments": ("shift",)}, "sets augments = ('shift',), not a tuple of"),
    ],
)
def test_a_class_against_its_hooks_is_refused_when_defined(body: dict[str, Any], says: str) -> None:
    with pytest.raises(TypeError) as err:
        define(body)
    message = str(err.value)
    assert message.startswith("position encoding class mypkg.positions.Mine: it "), message
    assert says in message, message
    fixes = ("remove the", "remove one", "define", "choose", "list the", "return the whole")
    assert any(fix in message.split(says, 1)[1] for fix in fixes), message


@pytest.fixture(scope="module")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return env_with(install_hooks(tmp_path_factory.mktemp("hooks")))


@pytest.mark.integration
@pytest.mark.parametrize("name", list(HOOKS))
def test_a_plugin_with_one_hook_trains_its_parameter(
    name: str, hooks: dict[str, str], tmp_path: Path
) -> None:
    _, hook, param = HOOKS[name]
    out = tmp_path / "run"
    proc = run([*command("tpe-train"), "--preset", "demo", *TINY, "train.warmup_steps=1", "eval.at_end=false",
                f"model.position.kind={name}", f"train.run_dir={out}"], hooks)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    state = load_file(str(out / "checkpoint" / "model.safetensors"))
    keys = sorted(k for k in state if k.endswith(f"positions.0.{param}"))
    assert keys == [f"decoder.positions.0.{param}", f"encoder.positions.0.{param}"], sorted(state)[:10]
    for key in keys:  # 0.5 everywhere at the start; weight decay is 0: only a gradient moves it
        assert not torch.all(state[key] == 0.5), f"{hook}: {key} did not move from its initial 0.5"


@pytest.mark.integration
def test_a_plugin_whose_flag_contradicts_its_hook_is_refused_naming_flag_and_fix(
    hooks: dict[str, str],
) -> None:
    proc = run([*command("tpe-train"), "--preset", "demo", *TINY, "model.position.kind=clash"], hooks)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    message = " ".join(proc.stderr.split())
    assert "model.position.kind='clash': the position encoding of entry point clash = " in message, message
    assert "package hookpos" in message and "importing it failed (TypeError: " in message, message
    assert "hookpos.clash.OffBias: it sets has_bias = False but defines attn_bias" in message, message
    assert "remove the has_bias line" in message and "Traceback" not in proc.stderr, message
