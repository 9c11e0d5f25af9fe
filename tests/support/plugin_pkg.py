"""A user's own package that registers position encodings through the ``tpe_train.positions`` entry
points, built and installed (``pip install --target``, offline) for the tests that run it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1"

[project.entry-points."tpe_train.positions"]
{entries}
"""

#: A scaled sinusoid: the built-in table times a fixed factor, with a learned gain (one parameter, so
#: the checkpoint shows the encoding's own state).
GOOD = '''\
"""A scaled sinusoidal encoding."""

import torch
from torch import Tensor, nn

from tpe_train.positions import PositionArgs, PositionEncoding
from tpe_train.positions.absolute import sinusoid_table


class ScaledSinusoid(PositionEncoding):
    """0.5 x the sinusoid table, times a learned gain."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.gain = nn.Parameter(torch.ones(()))

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x + 0.5 * self.gain * sinusoid_table(pos, self.args.d_model).to(x.dtype)
'''

#: One encoding per hook, written as docs/positions.md "Your own encoding" says: a subclass that
#: defines its hook and sets no class attribute. Each has one learned parameter (named in ``HOOKS``),
#: 0.5 everywhere at the start, so that the checkpoint shows whether attention used it.
ONE_HOOK_EACH = '''\
"""Five position encodings, one hook each."""

import torch
from torch import nn

from tpe_train.positions import PositionArgs, PositionEncoding


def log_distance(q_pos, k_pos, dtype):
    """log(1 + |j - i|): (Lq, Lk)."""
    return torch.log1p((k_pos[None, :] - q_pos[:, None]).abs().to(dtype))


class LogPositionEmbed(PositionEncoding):
    """embed: log(1 + position) times a learned gain per feature, added to the embeddings."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.gain = nn.Parameter(torch.full((args.d_model,), 0.5))

    def embed(self, x, pos):
        return x + self.gain.to(x.dtype) * torch.log1p(pos.to(x.dtype))[:, None]


class LearnedRotation(PositionEncoding):
    """rotate: each pair (x_i, x_{i + hd/2}) turned by the angle position x a learned frequency."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.freq = nn.Parameter(torch.full((args.head_dim // 2,), 0.5))

    def turn(self, x, pos):
        angle = pos.to(x.dtype)[:, None] * self.freq.to(x.dtype)  # (L, hd/2)
        cos, sin = angle.cos(), angle.sin()
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def rotate(self, q, k, q_pos, k_pos):
        return self.turn(q, q_pos), self.turn(k, k_pos)


class LogDistanceBias(PositionEncoding):
    """attn_bias: -slope_h log(1 + |i - j|), a learned slope per head."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.slope = nn.Parameter(torch.full((args.n_heads,), 0.5))

    def attn_bias(self, q, q_pos, k_pos):
        distance = log_distance(q_pos, k_pos, q.dtype)  # (Lq, Lk)
        return (-self.slope.to(q.dtype)[:, None, None] * distance).unsqueeze(0)  # (1, H, Lq, Lk)


class GatedDistanceBias(PositionEncoding):
    """key_bias: -w_h sigmoid(q . k / sqrt(hd)) log(1 + |i - j|), a learned weight per head."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.weight = nn.Parameter(torch.full((args.n_heads,), 0.5))

    def key_bias(self, q, k, q_pos, k_pos, keep):
        gate = torch.sigmoid(torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5)  # (B, H, Lq, Lk)
        return -self.weight.to(q.dtype)[:, None, None] * gate * log_distance(q_pos, k_pos, q.dtype)


class DistanceValue(PositionEncoding):
    """value_term: the attention-weighted log distance times a learned vector, added to the output."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.vector = nn.Parameter(torch.full((args.head_dim,), 0.5))

    def value_term(self, weights, q_pos, k_pos):
        mean = (weights * log_distance(q_pos, k_pos, weights.dtype)).sum(-1, keepdim=True)  # (B, H, Lq, 1)
        return mean * self.vector.to(weights.dtype)  # (B, H, Lq, hd)
'''

#: entry-point name -> (class in ``hookpos.enc``, its hook, its parameter)
HOOKS = {
    "hook_embed": ("LogPositionEmbed", "embed", "gain"),
    "hook_rotate": ("LearnedRotation", "rotate", "freq"),
    "hook_attn_bias": ("LogDistanceBias", "attn_bias", "slope"),
    "hook_key_bias": ("GatedDistanceBias", "key_bias", "weight"),
    "hook_value_term": ("DistanceValue", "value_term", "vector"),
}

#: A class whose declared flag contradicts its hook: defining it raises the TypeError.
CLASH = '''\
"""An attention bias switched off by a flag."""

import torch

from tpe_train.positions import PositionEncoding


class OffBias(PositionEncoding):
    has_bias = False

    def attn_bias(self, q, q_pos, k_pos):
        return torch.zeros(())
'''
#: The scaled sinusoid with a second parameter that its hooks never use: it gets no gradient. (The gain
#: is 1-d here: DeepSpeed without ZeRO cannot broadcast a 0-d parameter.)
IDLE = GOOD.replace(
    "self.gain = nn.Parameter(torch.ones(()))",
    "self.gain = nn.Parameter(torch.ones(1))\n        self.spare = nn.Parameter(torch.zeros(3))  # unused",
)

#: The scaled sinusoid with a second parameter that only the first forward with gradients uses: a
#: model whose used parameters change from step to step.
FIRST_ONLY = GOOD.replace(
    "self.gain = nn.Parameter(torch.ones(()))",
    "self.gain = nn.Parameter(torch.ones(1))\n        self.extra = nn.Parameter(torch.zeros(1))\n"
    "        self.calls = 0",
).replace(
    "        return x + 0.5",
    "        if torch.is_grad_enabled():\n            self.calls += 1\n"
    "            x = x + self.extra if self.calls == 1 else x\n        return x + 0.5",
)

#: Entry points that cannot be used: an import that fails, a name a built-in has, an object that is not
#: an encoding class.
BAD = '''\
"""Entry points that cannot be used."""

from mypos_missing_dependency import nothing  # noqa: F401
'''
NOT_ENCODING = """\
def fn():
    return 1
"""


def _install(root: Path, name: str, modules: dict[str, str], entries: dict[str, str]) -> Path:
    pkg = root / f"{name}-src"
    (pkg / name).mkdir(parents=True)
    (pkg / name / "__init__.py").write_text("")
    for module, text in modules.items():
        (pkg / name / f"{module}.py").write_text(textwrap.dedent(text))
    lines = "\n".join(f'{key} = "{value}"' for key, value in entries.items())
    (pkg / "pyproject.toml").write_text(PYPROJECT.format(name=name, entries=lines))
    site = root / f"{name}-site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--no-index", "--disable-pip-version-check", "--target", str(site), str(pkg)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return site


def install_good(root: Path) -> Path:
    """Package ``mypos``: the encoding ``scaled`` (``mypos.enc:ScaledSinusoid``); its site folder."""
    return _install(root, "mypos", {"enc": GOOD}, {"scaled": "mypos.enc:ScaledSinusoid"})


def install_idle(root: Path) -> Path:
    """Package ``idlepos``: the encoding ``idle`` (``idlepos.enc:ScaledSinusoid``), whose parameter
    ``spare`` takes no part in the loss; its site folder."""
    return _install(root, "idlepos", {"enc": IDLE}, {"idle": "idlepos.enc:ScaledSinusoid"})


def install_first_only(root: Path) -> Path:
    """Package ``oncepos``: the encoding ``once`` (``oncepos.enc:ScaledSinusoid``), whose parameter
    ``extra`` takes part in the loss of the first training step only; its site folder."""
    return _install(root, "oncepos", {"enc": FIRST_ONLY}, {"once": "oncepos.enc:ScaledSinusoid"})


def install_bad(root: Path) -> Path:
    """Package ``badpos``: ``broken`` (its import fails), ``rope`` (a built-in's name) and ``notenc``
    (a function); its site folder."""
    entries = {
        "broken": "badpos.broken:Thing",
        "rope": "badpos.other:fn",
        "notenc": "badpos.other:fn",
    }
    return _install(root, "badpos", {"broken": BAD, "other": NOT_ENCODING}, entries)


def install_hooks(root: Path) -> Path:
    """Package ``hookpos``: the five one-hook encodings of ``HOOKS`` and ``clash`` (``CLASH``); its site
    folder."""
    entries = {name: f"hookpos.enc:{cls}" for name, (cls, _, _) in HOOKS.items()}
    entries["clash"] = "hookpos.clash:OffBias"
    return _install(root, "hookpos", {"enc": ONE_HOOK_EACH, "clash": CLASH}, entries)


def env_with(*sites: Path) -> dict[str, str]:
    """This environment with ``sites`` (and this tree) first on PYTHONPATH, for the commands started."""
    tree = str(Path(__file__).resolve().parents[2])
    paths = [*map(str, sites), tree, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


#: the smallest run of the demo preset: a tiny model, 2 steps, a small synthetic corpus
TINY = [
    "data.synthetic.train_size=200",
    "data.synthetic.valid_size=8",
    "data.synthetic.test_size=10",
    "data.synthetic.long_size=4",
    "data.synthetic.probe_size=4",
    "data.synthetic.max_words=10",
    "data.synthetic.long_max_words=12",
    "data.vocab_size=150",
    "data.max_tokens=512",
    "model.d_model=16",
    "model.ffn_dim=32",
    "model.n_heads=2",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "train.max_steps=2",
    "train.valid_bleu_size=0",
    "train.progress=false",
    "eval.beam=1",
    "eval.length_buckets=[6,12]",
]


def run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def command(name: str) -> list[str]:
    """A console script as the user types it (tpe-train, tpe-launch ...), from this interpreter's bin."""
    return [str(Path(sys.executable).parent / name)]
