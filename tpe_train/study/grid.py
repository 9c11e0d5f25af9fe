"""The grid of a study: named settings x seeds from one preset, its directory, manifest and commands.

A *setting* is what one column of the study changes about position information:

- ``<kind>`` (``none``, ``sinusoidal``, ``learned``, ``shaw``, ``t5``, ``rope``, ``alibi``): that
  encoding in the encoder and in the decoder (``model.position.kind=<kind>``);
- ``<kind>-noenc``: no position information in the encoder only; the decoder keeps ``<kind>``
  (``model.position.encoder=false``);
- ``<kind>-nodec``: no position information in the decoder only; the encoder keeps ``<kind>``
  (``model.position.decoder=false``);
- ``<kind>+<augment>`` (``sinusoidal+shape``, ``learned+randomized``, ``rope+cape``; with a variant,
  ``sinusoidal+shape-nodec``): ``<kind>`` trained with a position augmentation
  (``model.position.augment``; its parameters, such as ``randomized_range``, are the study's overrides).

A study's grid is every setting x every seed, or part of it: running the study again with other
``--encodings``/``--seeds`` adds exactly those runs (a second seed of two settings is two runs, not a
second seed of all seven). A study directory holds ``study.json`` (preset, overrides, settings, seeds,
the runs when they are not the whole grid, how it was launched),
``runs/s<seed>[-noenc|-nodec][-<augment>]/<kind>/`` (one tpe-train run directory each; the same layout as
``tpe-launch``'s position sweep, whose run directories are ``<sweep root>/<kind>``) and ``report/``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpe_train.ckpt.rundir import RunDir
from tpe_train.config import Config, ConfigError, load_config
from tpe_train.evaluation.evaluate import EvalFiles
from tpe_train.positions import POSITIONS
from tpe_train.run import atomic
from tpe_train.study.terms import ENCODINGS as ENCODINGS
from tpe_train.study.terms import StudyError as StudyError

#: The encodings in the order of the README's table; the default grid of ``tpe-study run``.
VARIANTS = {"": "positions in encoder and decoder", "noenc": "no positions in the encoder",
            "nodec": "no positions in the decoder"}  # fmt: skip
#: Overrides the study sets itself for every run; a user override of one of them is refused.
STUDY_KEYS = ("model.position.kind", "model.position.encoder", "model.position.decoder", "train.seed",
              "train.run_dir")  # fmt: skip
#: Set by a setting that names an augmentation (``<kind>+<augment>``); then not a user override as well.
AUGMENT_KEY = "model.position.augment"
MANIFEST = "study.json"
RUN_LOG = "study.log"  # in each run directory: the run's output, between start and exit stamps


@dataclass(frozen=True)
class Setting:
    """One column of the study: an encoding, possibly removed from the encoder or the decoder."""

    kind: str
    variant: str = ""  # "", "noenc" or "nodec"
    augment: str = ""  # "" or a training-time position augmentation (shape, cape, randomized)

    @property
    def name(self) -> str:
        name = f"{self.kind}+{self.augment}" if self.augment else self.kind
        return f"{name}-{self.variant}" if self.variant else name

    @property
    def suffix(self) -> str:
        """What the seed's directory adds for this setting: ``-noenc``, ``-shape``, ``-nodec-cape`` ..."""
        return "".join(f"-{part}" for part in (self.variant, self.augment) if part)

    def overrides(self) -> list[str]:
        """The config overrides that make a run of this setting."""
        augment = [f"{AUGMENT_KEY}={self.augment}"] if self.augment else []
        return [
            f"model.position.kind={self.kind}",
            f"model.position.encoder={str(self.variant != 'noenc').lower()}",
            f"model.position.decoder={str(self.variant != 'nodec').lower()}",
            *augment,
        ]

    def describe(self) -> str:
        if self.kind == "none":
            return "no position information anywhere"
        kind = f"{self.kind} (trained with {self.augment} positions)" if self.augment else self.kind
        if self.variant == "noenc":
            return f"no position information in the encoder; {kind} in the decoder"
        if self.variant == "nodec":
            return f"{kind} in the encoder; no position information in the decoder"
        return f"{kind} in the encoder and the decoder"


def parse_setting(name: str) -> Setting:
    """``sinusoidal``, ``sinusoidal-noenc``, ``rope-nodec``, ``learned+randomized`` ... -> a ``Setting``
    (errors list the valid)."""
    kind, variant = name.strip(), ""
    for suffix in ("noenc", "nodec"):
        if kind.endswith(f"-{suffix}"):
            kind, variant = kind[: -len(suffix) - 1], suffix
    kind, _, augment = kind.partition("+")
    if kind not in POSITIONS:
        raise StudyError(
            f"setting {name!r}: {kind!r} is not a position encoding; settings are <kind>, <kind>-noenc "
            f"(no positions in the encoder), <kind>-nodec (none in the decoder) or <kind>+<augment> "
            f"(trained with a position augmentation), kind one of {', '.join(POSITIONS.names())}"
        )
    if kind == "none" and variant:
        raise StudyError(f"setting {name!r}: 'none' has no positions to remove; use 'none'")
    if "+" in name:
        takes = POSITIONS.get(kind).augments
        if augment not in takes:
            valid = ", ".join(f"{kind}+{a}" for a in takes) or f"none: {kind} takes no augmentation"
            raise StudyError(
                f"setting {name!r}: {augment!r} is not a position augmentation of {kind} "
                f"(model.position.augment; docs/positions.md); valid: {valid}"
            )
    return Setting(kind, variant, augment)


def parse_seeds(text: str) -> list[int]:
    """``1,2,3`` or ``1-3`` (or both: ``1-3,7``) -> [1, 2, 3]."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            seeds += range(int(lo), int(hi) + 1) if sep else [int(lo)]
    except ValueError:
        raise StudyError(f"--seeds {text!r} is not a list of seeds such as 1,2,3 or 1-3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise StudyError(f"--seeds {text!r} names no seed or a seed twice")
    return seeds


@dataclass
class Study:
    """A study directory and its manifest (``study.json``)."""

    root: Path
    preset: str
    overrides: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=lambda: list(ENCODINGS))
    seeds: list[int] = field(default_factory=lambda: [1])
    launch: str | None = None  # accelerate launch file of every run (None: one plain process)
    average: int = 0  # average the last N checkpoints and evaluate that (0: the final export)
    baseline: str | None = None  # the setting paired tests compare against (None: see baseline_setting)
    slurm_jobs: list[dict[str, Any]] = field(default_factory=list)  # what was submitted, for the record
    cells: list[list[Any]] | None = None  # [setting, seed] of each run when not every setting x seed

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        clash = sorted({o.partition("=")[0].strip() for o in self.overrides} & set(STUDY_KEYS))
        if clash:
            raise StudyError(
                f"the study sets {', '.join(clash)} itself for every run (from --encodings and --seeds, "
                "run directories under the study directory); drop it from the overrides"
            )
        if self.average < 0:
            raise StudyError(
                f"--average must be 0 (no averaging) or a number of checkpoints, got {self.average}"
            )
        augmented = [name for name in self.settings if parse_setting(name).augment]
        if augmented and any(o.partition("=")[0].strip() == AUGMENT_KEY for o in self.overrides):
            raise StudyError(
                f"the settings {', '.join(augmented)} name their augmentation and the overrides set "
                f"{AUGMENT_KEY} as well; drop it from the overrides (a study compares augmentations as "
                "settings: <kind>+<augment>)"
            )
        for cell in self.cells or []:
            if len(cell) != 2 or cell[0] not in self.settings or cell[1] not in self.seeds:
                raise StudyError(
                    f"study run {cell!r} is not [setting, seed] of the study's settings "
                    f"({', '.join(self.settings)}) and seeds ({', '.join(map(str, self.seeds))}); restore "
                    "study.json or start a new study"
                )
        if self.baseline is not None and self.baseline not in self.settings:
            raise StudyError(
                f"--baseline {self.baseline} is not a setting of the study ({', '.join(self.settings)}); "
                "name one of them"
            )

    @property
    def baseline_setting(self) -> str:
        """The setting every other is tested against: ``baseline``, else ``sinusoidal`` (the
        Transformer's own encoding) when the study has it, else the first setting."""
        if self.baseline is not None:
            return self.baseline
        return "sinusoidal" if "sinusoidal" in self.settings else self.settings[0]

    # -- layout -------------------------------------------------------------------------------------
    def grid(self) -> list[tuple[Setting, int]]:
        """Every run, seed by seed (a study stopped early has whole seeds first)."""
        cells = None if self.cells is None else {(name, seed) for name, seed in self.cells}
        return [
            (parse_setting(name), seed)
            for seed in self.seeds
            for name in self.settings
            if cells is None or (name, seed) in cells
        ]

    def describe_grid(self) -> str:
        """``7 settings x 2 seeds (1, 2)``, or for part of the grid which settings each seed has."""
        count = f"{len(self.settings)} setting{'s' if len(self.settings) != 1 else ''}"
        if self.cells is None:
            seeds = f"{len(self.seeds)} seed{'s' if len(self.seeds) != 1 else ''}"
            return f"{count} x {seeds} ({', '.join(map(str, self.seeds))})"
        grid = self.grid()
        per_seed = []
        for seed in self.seeds:
            names = [s.name for s, s_seed in grid if s_seed == seed]
            per_seed.append(f"seed {seed}: {'all' if len(names) == len(self.settings) else ', '.join(names)}")
        return f"{count}, {len(grid)} runs ({'; '.join(per_seed)})"

    def sweep_root(self, setting: Setting, seed: int) -> Path:
        """The parent of this seed's (and variant's) run directories: one ``tpe-launch`` sweep root."""
        return self.root / "runs" / f"s{seed}{setting.suffix}"

    def run_dir(self, setting: Setting, seed: int) -> Path:
        return self.sweep_root(setting, seed) / setting.kind

    def averaged_dir(self, setting: Setting, seed: int) -> Path:
        """Where the average of the last ``average`` checkpoints goes (as ``tpe-launch --script eval``)."""
        return RunDir(self.run_dir(setting, seed)).averaged(self.average)

    def eval_files(self, setting: Setting, seed: int) -> EvalFiles:
        """The evaluation the report uses (figures and test hypotheses): the averaged model's when the
        study averages, else the one training wrote into the run directory."""
        return EvalFiles(self.averaged_dir(setting, seed) if self.average else self.run_dir(setting, seed))

    def eval_path(self, setting: Setting, seed: int) -> Path:
        """The figures the report uses (``eval_files(...).figures``)."""
        return self.eval_files(setting, seed).figures

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    def where(self, path: Path) -> str:
        """A run's file as the report names it: relative to the study directory where it lies there."""
        return str(path.relative_to(self.root) if path.is_relative_to(self.root) else path)

    def provenance(self) -> str:
        """The report's line on where the runs come from and what they changed of the preset."""
        return "Overrides: " + (" ".join(f"`{o}`" for o in self.overrides) or "none") + "."

    # -- configs and commands -----------------------------------------------------------------------
    def run_overrides(self, setting: Setting, seed: int) -> list[str]:
        """Overrides of one run: quiet progress, the user's, the setting's, seed and run directory."""
        return [
            "train.progress=false",  # the study logs to a file; a user override still wins
            *self.overrides,
            *setting.overrides(),
            f"train.seed={seed}",
            f"train.run_dir={self.run_dir(setting, seed).resolve()}",
        ]

    def config(self, setting: Setting, seed: int) -> Config:
        """The resolved config of one run (a bad combination stops the study before any work)."""
        try:
            return load_config(self.preset, self.run_overrides(setting, seed))
        except ConfigError as err:
            raise StudyError(f"setting {setting.name}, seed {seed}: {err}") from None

    def train_command(self, setting: Setting, seed: int, extra: Sequence[str] = ()) -> list[str]:
        """``python -m tpe_train.train ...``, or the same under ``accelerate launch --config_file``;
        ``extra`` overrides come before the user's (``train.threads`` of parallel local runs)."""
        overrides = self.run_overrides(setting, seed)
        args = ["-m", "tpe_train.train", "--preset", self.preset, *overrides[:1], *extra, *overrides[1:]]
        if self.launch:
            return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", self.launch, *args]
        return [sys.executable, *args]

    # -- manifest -----------------------------------------------------------------------------------
    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data.pop("root")
        atomic.write_json(self.root / MANIFEST, data, indent=2)

    @classmethod
    def load(cls, root: Path) -> Study:
        path = Path(root) / MANIFEST
        if not path.is_file():
            raise StudyError(
                f"{root} is not a study directory ({MANIFEST} missing); pass the --out directory of "
                "`tpe-study run`"
            )
        try:
            data = json.loads(path.read_text())
            return cls(root=Path(root), **data)
        except (json.JSONDecodeError, TypeError) as err:
            raise StudyError(
                f"{path} is not a study manifest ({err}); restore it or start a new study"
            ) from None

    def merge(self, other: Study) -> Study:
        """This (existing) study extended by ``other``'s runs (its settings x seeds); the rest must agree."""
        for key in ("preset", "overrides", "average", "launch"):
            if getattr(self, key) != getattr(other, key):
                raise StudyError(
                    f"{self.root} is a study with {key}={getattr(self, key)!r}, not {getattr(other, key)!r}; "
                    "a study directory holds one preset, overrides, launch file and averaging: choose a "
                    "new --out"
                )
        cells = {(s.name, seed) for study in (self, other) for s, seed in study.grid()}
        self.settings += [s for s in other.settings if s not in self.settings]
        self.seeds += [s for s in other.seeds if s not in self.seeds]
        whole = len(cells) == len(self.settings) * len(self.seeds)
        self.cells = None if whole else [[name, seed] for seed in self.seeds for name in self.settings
                                         if (name, seed) in cells]  # fmt: skip
        self.baseline = other.baseline if other.baseline is not None else self.baseline
        return self
