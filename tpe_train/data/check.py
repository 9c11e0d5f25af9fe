"""``tpe-data check``: what a corpus looks like to the readers, before any training.

For a text corpus: the files each split needs (``<data.path>/<split>.<lang>[.gz]`` from ``data.path``,
``data.train_split`` / ``valid_split`` / ``test_split`` and ``data.src_lang`` / ``tgt_lang``), the ones
found, lines per side, and every problem with its fix: a missing file, sides of different lengths,
bytes that are not UTF-8, a lone carriage return, a byte-order mark, empty lines. For the other kinds:
the splits expected and found. Nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tpe_train.config import DataConfig
from tpe_train.data.errors import CorpusError
from tpe_train.data.sources import load_split, parquet_files
from tpe_train.data.specs import source_spec
from tpe_train.data.textfiles import BOM, reading

SPLIT_KEYS = ("train_split", "valid_split", "test_split")


@dataclass
class Problem:
    """One problem: where, what, the fix, and whether ``tpe-data prepare`` would stop on it."""

    where: str
    what: str
    fix: str
    stops: bool


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)  # what was expected and found
    problems: list[Problem] = field(default_factory=list)
    train_pairs: int = 0


@dataclass
class FileScan:
    """Counts of one text file, with the first line (1-based) of each kind of problem (0: none)."""

    lines: int = 0
    bom: bool = False
    bad_utf8: int = 0
    first_bad_utf8: int = 0
    lone_cr: int = 0
    first_lone_cr: int = 0
    empty: int = 0
    first_empty: int = 0


def scan_file(path: Path) -> FileScan:
    """Read ``path`` once as the corpus readers do (lines end at ``\\n`` only) and count problems."""
    scan = FileScan()
    with reading(path) as f:
        for number, line in enumerate(f, start=1):
            scan.lines = number
            if number == 1 and line.startswith(BOM):
                scan.bom, line = True, line[len(BOM) :]
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1] if line.endswith(b"\n") else line
            if b"\r" in line:
                scan.lone_cr += 1
                scan.first_lone_cr = scan.first_lone_cr or number
            if not line.strip():
                scan.empty += 1
                scan.first_empty = scan.first_empty or number
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                scan.bad_utf8 += 1
                scan.first_bad_utf8 = scan.first_bad_utf8 or number
    return scan


def _n(lines: int) -> str:
    return "1 line is" if lines == 1 else f"{lines:,} lines are"


def _file_problems(path: Path, scan: FileScan, bad_utf8: str) -> list[Problem]:
    out = []
    if scan.bad_utf8:
        out.append(
            Problem(
                str(path),
                f"{_n(scan.bad_utf8)} not UTF-8 (the first: line {scan.first_bad_utf8})",
                "convert the file: iconv -f <its encoding> -t UTF-8; or set data.bad_utf8=replace to read "
                "those bytes as U+FFFD",
                stops=bad_utf8 == "error",
            )
        )
    if scan.lone_cr:
        out.append(
            Problem(
                str(path),
                f"{_n(scan.lone_cr)} holding a carriage return (\\r) that ends no line (the first: line "
                f"{scan.first_lone_cr}); it is read as part of the line and cleaned to a space",
                "if \\r was meant as a line break (an old Mac file), convert it: tr '\\r' '\\n'; else "
                "remove it: tr -d '\\r' (both sides must stay line-aligned)",
                stops=False,
            )
        )
    if scan.bom:
        out.append(
            Problem(
                str(path),
                "starts with a byte-order mark (UTF-8 BOM); the readers drop it",
                "remove it: sed -i '1s/^\\xEF\\xBB\\xBF//' FILE",
                stops=False,
            )
        )
    if scan.empty:
        out.append(
            Problem(
                str(path),
                f"{_n(scan.empty)} empty or blank (the first: line {scan.first_empty}); cleaning "
                "drops such training pairs and validation drops them too",
                "remove the pair from both files, or put its segment on the empty line",
                stops=False,
            )
        )
    return out


def _stems(root: Path, lang: str) -> list[str]:
    names = [p.name.removesuffix(".gz") for p in root.iterdir() if p.is_file()] if root.is_dir() else []
    return sorted({n[: -len(lang) - 1] for n in names if n.endswith(f".{lang}")})


def _text_split(cfg: DataConfig, key: str, report: Report) -> None:
    root, split = Path(cfg.path), getattr(cfg, key)
    report.lines.append(f"{split} (data.{key}): expects {split}.{cfg.src_lang} and {split}.{cfg.tgt_lang}")
    found: dict[str, tuple[Path, FileScan]] = {}
    for lang in (cfg.src_lang, cfg.tgt_lang):
        path = next((p for p in (root / f"{split}.{lang}", root / f"{split}.{lang}.gz") if p.is_file()), None)
        if path is None:
            both = sorted(set(_stems(root, cfg.src_lang)) & set(_stems(root, cfg.tgt_lang)))
            hint = f"; splits with both languages there: {', '.join(both)}" if both else ""
            report.problems.append(
                Problem(
                    str(root / f"{split}.{lang}"),
                    "not found (nor with .gz)",
                    f"put the file there, or set data.{key} to the name its files start with{hint}",
                    stops=True,
                )
            )
            continue
        try:
            scan = scan_file(path)
        except CorpusError as err:  # a damaged gzip stream
            what, _, fix = str(err).partition("; ")
            report.problems.append(Problem(str(path), what.removeprefix(f"{path} "), fix, stops=True))
            continue
        found[lang] = (path, scan)
        report.lines.append(f"  found {path}: {scan.lines:,} lines")
        report.problems += _file_problems(path, scan, cfg.bad_utf8)
    if len(found) == 2:
        (src, s), (tgt, t) = found[cfg.src_lang], found[cfg.tgt_lang]
        if s.lines != t.lines:
            report.problems.append(
                Problem(
                    f"{src} and {tgt}",
                    f"{s.lines:,} line{'s' * (s.lines != 1)} against {t.lines:,}: the sides are not "
                    "line-aligned",
                    "make both files hold one segment per line, pair by pair (a stray line break, often a "
                    "lone \\r or an empty line, shifts every later pair)",
                    stops=True,
                )
            )
        if key == "train_split":
            report.train_pairs = s.lines


def _other_kind(cfg: DataConfig, key: str, report: Report) -> None:
    split = getattr(cfg, key)
    spec = source_spec(cfg)
    try:
        if cfg.corpus == "parquet":
            files = parquet_files(spec, split)
            report.lines.append(f"{split} (data.{key}): found {len(files)} parquet files, {files[0]}, ...")
        else:
            rows = len(load_split(spec, split))
            report.lines.append(f"{split} (data.{key}): {rows:,} pairs")
            if key == "train_split":
                report.train_pairs = rows
    except CorpusError as err:
        report.problems.append(Problem(f"{split} (data.{key})", str(err), "see above", stops=True))


def check_corpus(cfg: DataConfig) -> Report:
    """Expected and found files, line counts and problems of the configured corpus."""
    report = Report()
    if cfg.corpus == "synthetic":
        report.lines.append("data.corpus=synthetic is generated: nothing to check")
        return report
    if cfg.corpus == "hub":
        name = f"{cfg.hub_id} ({source_spec(cfg).config_name})"
        report.lines.append(f"data.corpus=hub reads {name} from the hub or its cache: nothing local to check")
        return report
    report.lines.append(f"data.corpus={cfg.corpus}, data.path={cfg.path}, {cfg.src_lang} -> {cfg.tgt_lang}")
    for key in SPLIT_KEYS:
        if cfg.corpus == "text":
            _text_split(cfg, key, report)
        else:
            _other_kind(cfg, key, report)
    return report


def suggested_vocab(pairs: int) -> int:
    """A joint BPE size for a corpus of ``pairs``: smaller corpora learn better with smaller
    vocabularies (Sennrich and Zhang 2019); WMT-size corpora use 32,000-37,000."""
    for limit, size in ((50_000, 4000), (200_000, 8000), (1_000_000, 16_000), (3_000_000, 24_000)):
        if pairs < limit:
            return size
    return 32_000
