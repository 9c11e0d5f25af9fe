"""The test-time position methods of ``tpe-study extrapolate``: families of ``--position`` settings
(``evaluation.position_settings``) whose strength is a factor s > 1, the length ratio aimed at
(``rope-yarn`` x 2 is ``rope.scaling=yarn rope.factor=2``), custom lists of settings, and the baseline
(the unmodified model)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tpe_train.config import Config
from tpe_train.evaluation.position_settings import SIDES, parse_position_settings
from tpe_train.study.grid import StudyError

BASELINE = "baseline"


@dataclass(frozen=True)
class Family:
    """A test-time method of one encoding whose strength is a factor s > 1 (the length ratio aimed at)."""

    encoding: str
    describe: str
    items: Callable[[float, Config], list[str]]


def _number(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() or len(f"{x:g}") < 8 else repr(float(x))


def _distance(kind: str) -> Family:
    def items(s: float, cfg: Config) -> list[str]:
        return [f"{kind}.distance_scale={_number(s)}"]

    why = f"{kind}'s trained bias read at distance |i-j| / s (a distance s*d gets the trained bias of d)"
    return Family(kind, why, items)


def _xpos(scaling: str) -> Family:
    def items(s: float, cfg: Config) -> list[str]:
        return [f"xpos.scaling={scaling}", f"xpos.factor={_number(s)}"]

    why = f"xPos with RoPE's {scaling} scaling of its rotation by s (as rope-{scaling})"
    return Family("xpos", why, items)


#: The built-in families, by name; each turns a factor and the checkpoint's config into --position items.
FAMILIES: dict[str, Family] = {
    "rope-pi": Family(
        "rope",
        "RoPE position interpolation (Chen et al. 2023): every frequency divided by s",
        lambda s, cfg: ["rope.scaling=pi", f"rope.factor={_number(s)}"],
    ),
    "rope-ntk": Family(
        "rope",
        "RoPE NTK-aware scaling: base times s^(hd/(hd-2))",
        lambda s, cfg: ["rope.scaling=ntk", f"rope.factor={_number(s)}"],
    ),
    "rope-yarn": Family(
        "rope",
        "YaRN (Peng et al. 2023): per-frequency interpolation ramp and attention temperature (original "
        "context: rope.original, by default data.max_len + 1)",
        lambda s, cfg: ["rope.scaling=yarn", f"rope.factor={_number(s)}"],
    ),
    "alibi-slope": Family(
        "alibi",
        "ALiBi slopes divided by s (a distance s*d gets the trained bias of d)",
        lambda s, cfg: [f"alibi.slope_scale={_number(1 / s)}"],
    ),
    "t5-distance": Family(
        "t5",
        "T5 max_distance times s: trained buckets unchanged, more log buckets past the old limit, their "
        "biases extrapolated linearly",
        lambda s, cfg: [f"t5.max_distance={round(s * cfg.model.position.t5_max_distance)}"],
    ),
    "learned-interpolate": Family(
        "learned",
        "learned table of s times the rows, linearly interpolated",
        lambda s, cfg: ["learned.extend=interpolate", f"learned.factor={_number(s)}"],
    ),
    **{f"{kind}-distance": _distance(kind) for kind in ("kerple_log", "kerple_power", "sandwich")},
    **{f"xpos-{scaling}": _xpos(scaling) for scaling in ("pi", "ntk", "yarn")},
}


@dataclass(frozen=True)
class Method:
    """One row kind of the report: a family at a factor (and side), a custom list of settings, or the
    baseline (no settings)."""

    name: str  # rope-yarn-x2, rope-yarn-x2@encoder, a custom label, or baseline
    family: str  # a FAMILIES key, "custom" or "baseline"
    factor: float | None = None
    side: str = "both"
    custom: tuple[str, ...] = ()  # the items of a custom method
    original: int | None = None  # rope-yarn, xpos-yarn: the trained context in tokens (None: max_len + 1)

    def encodings(self) -> set[str]:
        """The encodings this method changes (none for the baseline)."""
        if self.family == BASELINE:
            return set()
        if self.family == "custom":
            return set(parse_position_settings(list(self.custom))[1])
        return {FAMILIES[self.family].encoding}

    def sides(self) -> list[str]:
        if self.family == "custom":
            return parse_position_settings(list(self.custom))[0]
        return list(SIDES) if self.side == "both" else [self.side]

    def items(self, cfg: Config) -> list[str]:
        """The ``--position`` items of this method for a checkpoint trained with ``cfg``."""
        if self.family == BASELINE:
            return []
        if self.family == "custom":
            return list(self.custom)
        assert self.factor is not None
        side = [] if self.side == "both" else [f"side={self.side}"]
        yarn = self.family in ("rope-yarn", "xpos-yarn")
        encoding = FAMILIES[self.family].encoding
        original = [f"{encoding}.original={self.original}"] if self.original and yarn else []
        return [*side, *FAMILIES[self.family].items(self.factor, cfg), *original]

    def describe(self) -> str:
        if self.family == BASELINE:
            return "the unmodified model"
        if self.family == "custom":
            return "custom: " + " ".join(f"`{i}`" for i in self.custom)
        where = "" if self.side == "both" else f", {self.side} only"
        return f"{FAMILIES[self.family].describe}; s = {_number(self.factor or 1)}{where}"


def parse_list(text: str, what: str, cast: Callable[[str], Any] = str) -> list[Any]:
    """``a,b,c`` -> [a, b, c] (``cast`` each; StudyError names a bad entry)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.append(cast(part))
        except ValueError:
            raise StudyError(f"{what} {text!r}: {part!r} is not a {cast.__name__}") from None
    return out


def methods_of(
    families: Sequence[str] | None,
    factors: Sequence[float],
    sides: Sequence[str],
    custom: Sequence[str],
    yarn_original: int | None = None,
) -> list[Method]:
    """The baseline, every family x factor x side (``families`` None: every family), and the custom
    methods (``LABEL=KEY=VALUE,KEY=VALUE``). ``yarn_original``: YaRN's trained context in tokens."""
    names = list(FAMILIES) if families is None else [f for f in families if f != BASELINE]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        by_encoding = "; ".join(
            f"{enc}: {', '.join(n for n, f in FAMILIES.items() if f.encoding == enc)}"
            for enc in dict.fromkeys(f.encoding for f in FAMILIES.values())
        )
        raise StudyError(
            f"--methods: {', '.join(unknown)} is not a method; the methods are {by_encoding} (sinusoidal, "
            "shaw and none have none: their baseline row is the model as trained); --custom names any "
            "other --position settings"
        )
    if names and not factors:
        raise StudyError("--factors names no factor; give e.g. --factors 2,4")
    for s in factors:
        if not s > 1:
            raise StudyError(
                f"--factors: {_number(s)} is not above 1 (factor 1 is the unmodified model, the baseline "
                "row); give the length ratios to aim at, e.g. 2,4"
            )
    for side in sides:
        if side not in (*SIDES, "both"):
            raise StudyError(f"--sides: {side!r} is not a side; choose from encoder, decoder, cross, both")
    if yarn_original is not None and yarn_original < 2:
        raise StudyError(f"--yarn-original {yarn_original}: give the trained context length in tokens")
    methods = [Method(BASELINE, BASELINE)]
    for name in names:
        for s in factors:
            for side in sides:
                label = f"{name}-x{_number(s)}" + ("" if side == "both" else f"@{side}")
                methods.append(Method(label, name, float(s), side, original=yarn_original))
    for text in custom:
        label, eq, rest = text.partition("=")
        items = tuple(i.strip() for i in rest.split(",") if i.strip())
        if not eq or not re.fullmatch(r"[\w.+@-]+", label) or not items:
            raise StudyError(
                f"--custom {text!r}: give LABEL=KEY=VALUE[,KEY=VALUE...], e.g. "
                "--custom yarn3-enc=rope.scaling=yarn,rope.factor=3,side=encoder"
            )
        try:
            _, settings = parse_position_settings(list(items))
        except ValueError as err:
            raise StudyError(f"--custom {label}: {err}") from None
        if not settings:
            raise StudyError(f"--custom {label}: names no setting; the baseline row is the unmodified model")
        methods.append(Method(label, "custom", custom=items))
    seen = [m.name for m in methods]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise StudyError(f"method {', '.join(twice)} is named twice (--custom labels must be new names)")
    return methods
