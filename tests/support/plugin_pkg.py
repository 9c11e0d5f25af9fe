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

#: The scaled sinusoid with a second parameter that its hooks never use: it gets no gradient. (The gain
#: is 1-d here: DeepSpeed without ZeRO cannot broadcast a 0-d parameter.)
IDLE = GOOD.replace(
    "self.gain = nn.Parameter(torch.ones(()))",
    "self.gain = nn.Parameter(torch.ones(1))\n        self.spare = nn.Parameter(torch.zeros(3))  # unused",
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


def install_bad(root: Path) -> Path:
    """Package ``badpos``: ``broken`` (its import fails), ``rope`` (a built-in's name) and ``notenc``
    (a function); its site folder."""
    entries = {
        "broken": "badpos.broken:Thing",
        "rope": "badpos.other:fn",
        "notenc": "badpos.other:fn",
    }
    return _install(root, "badpos", {"broken": BAD, "other": NOT_ENCODING}, entries)


def env_with(*sites: Path) -> dict[str, str]:
    """This environment with ``sites`` (and this tree) first on PYTHONPATH, for the commands started."""
    tree = str(Path(__file__).resolve().parents[2])
    paths = [*map(str, sites), tree, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
