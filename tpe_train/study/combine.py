"""Several study directories as one study for a report: ``tpe-study report DIR --include OTHER ...``.

A study directory holds one preset, one set of overrides and one launch; a comparison often spans
several: the committed archive of the first seven encodings beside a study of newer encodings, and a
study of augmentations that needs an override of its own (``randomized_range``). ``combine`` joins them
into one ``CombinedStudy``: settings and seeds are the union, each (setting, seed) cell is read from the
one directory that holds it, and the report's tables, paired tests and plots treat them as one grid.
Paired tests need the test set's references, which an archive leaves out; the runs of a directory that
kept them lend them to the others on the same test set (``results.significance``).

The parts must share the preset and the averaging (the figures must be of the same model kind); their
overrides may differ, and the report lists each part's. A cell held by two parts is taken from the one
named first (``DIR`` before the ``--include`` directories, in their order), and the report names the
copy it set aside with that copy's BLEU: a setting trained again, for instance to keep its test
hypotheses for the paired tests, shows how far its figures moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tpe_train.study.grid import Setting, Study, StudyError


@dataclass
class CombinedStudy(Study):
    """The union of ``parts``: each cell's run directory is that of the part which holds it."""

    parts: list[Study] = field(default_factory=list)
    owner: dict[tuple[str, int], Study] = field(default_factory=dict)
    out: Path | None = None  # where the report goes (None: the first part's report folder)
    #: cells also held by a later part, which the report does not use: (setting, seed, that part)
    set_aside: list[tuple[Setting, int, Study]] = field(default_factory=list)

    @property
    def report_dir(self) -> Path:
        return self.out if self.out is not None else self.root / "report"

    def part_of(self, setting: Setting, seed: int) -> Study:
        return self.owner[(setting.name, seed)]

    def run_dir(self, setting: Setting, seed: int) -> Path:
        return self.part_of(setting, seed).run_dir(setting, seed)

    def where(self, path: Path) -> str:
        """``<part folder>/<path within it>``: the folder's own name, no machine path."""
        for part in self.parts:
            if path.is_relative_to(part.root):
                return f"{part.root.name}/{path.relative_to(part.root)}"
        return str(path)

    def provenance(self) -> str:
        lines = []
        for part in self.parts:
            overrides = " ".join(f"`{o}`" for o in part.overrides) or "none"
            lines.append(f"`{part.root.name}` ({part.describe_grid()}; overrides: {overrides})")
        text = f"Combined from {len(self.parts)} study directories: " + "; ".join(lines) + "."
        aside = []
        for setting, seed, part in self.set_aside:
            figures = part.eval_files(setting, seed).read_figures()
            bleu = (
                f"BLEU {figures['bleu']:.2f}" if figures and figures.get("bleu") is not None else "no figures"
            )
            used = self.part_of(setting, seed).root.name
            aside.append(f"`{setting.name}` seed {seed} from `{used}` ({part.root.name}'s copy: {bleu})")
        if aside:
            text += " Runs in two directories are taken from the first named: " + "; ".join(aside) + "."
        return text


def combine(first: Study, others: list[Study], report_dir: Path | None = None) -> CombinedStudy:
    """``first`` and ``others`` as one study (errors name the part and the fix)."""
    parts = [first, *others]
    names = [p.root.name for p in parts]
    if len(set(names)) != len(names):
        raise StudyError(
            f"--include names study directories with the same folder name ({', '.join(names)}); the report "
            "tells the parts apart by folder name: include each directory once, or rename one"
        )
    for part in others:
        for key in ("preset", "average"):
            if getattr(part, key) != getattr(first, key):
                raise StudyError(
                    f"{part.root} has {key}={getattr(part, key)!r}, {first.root} {getattr(first, key)!r}: a "
                    "report compares runs of one preset and one averaging; include studies that share them"
                )
    owner: dict[tuple[str, int], Study] = {}
    set_aside: list[tuple[Setting, int, Study]] = []
    for part in parts:
        for setting, seed in part.grid():
            if (setting.name, seed) in owner:
                set_aside.append((setting, seed, part))
            else:
                owner[(setting.name, seed)] = part
    settings = list(dict.fromkeys(name for part in parts for name in part.settings))
    seeds = sorted({seed for part in parts for seed in part.seeds})
    whole = len(owner) == len(settings) * len(seeds)
    cells = None if whole else [[name, seed] for seed in seeds for name in settings if (name, seed) in owner]
    return CombinedStudy(
        root=first.root,
        preset=first.preset,
        overrides=[],
        settings=settings,
        seeds=seeds,
        average=first.average,
        baseline=first.baseline,
        cells=cells,
        parts=parts,
        owner=owner,
        out=report_dir,
        set_aside=set_aside,
    )
