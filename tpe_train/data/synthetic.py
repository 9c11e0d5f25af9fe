"""Deterministic synthetic language pair used as the embedded default corpus.

The source side is an English-like SVO language; the target side is an invented
verb-final (SOV) language that marks grammatical roles with particles.  The
translation is a pure function of the source sentence, but *who does what to
whom* is recoverable only from the source word order: swapping the subject and
object noun phrases keeps the bag of source words identical while changing the
target (see :func:`minimal_pairs`).

Source grammar (every sentence ends with ``" ."``)::

    S    -> NP VERB NP "."                  verb agrees with the subject (chases / chase)
    NP   -> CORE [PP] [RC]
    CORE -> ("the" | "a") ADJ{0,2} NOUN     singular
          | ["the"] [NUM] ADJ{0,2} NOUNs    plural (NUM in two..nine)
    PP   -> PREP CORE                       the NP inside a PP has no PP / RC
    RC   -> "that" VERB NP                  subject-gap relative clause, nesting depth <= 2

Target grammar::

    S'    -> NP' "ga" NP' "wo" VERB' "."
    NP'   -> [RC'] [PP'] NOUN' ["ra"] ADJ'{reversed} [NUM'] ["za"]
    PP'   -> CORE' POSTP'
    RC'   -> NP' "wo" VERB' "ki"

``"ra"`` marks plural, ``"za"`` marks ``the`` (``a`` vanishes), ``"ki"`` closes a
pre-nominal relative clause; adjectives follow the noun in mirrored order,
numbers follow the noun, prepositions become postpositions.  Every source word
has exactly one target word (both verb forms share one).

Only ``random.Random(seed)`` instances are used, so every function here is a
deterministic function of its arguments.
"""

from __future__ import annotations

import math
import random

__all__ = [
    "MAX_SOURCE_WORDS",
    "MIN_SOURCE_WORDS",
    "Pair",
    "generate",
    "minimal_pairs",
    "translate",
]

Pair = tuple[str, str]
"""(source sentence, target sentence)."""

# --------------------------------------------------------------------------- lexicon

_NOUNS: dict[str, str] = {
    "cat": "neko",
    "dog": "inu",
    "bird": "tori",
    "horse": "uma",
    "frog": "kaeru",
    "rabbit": "usagi",
    "lion": "shishi",
    "tiger": "tora",
    "bear": "kuma",
    "snake": "hebi",
    "monkey": "saru",
    "girl": "musume",
    "boy": "bozu",
    "king": "oja",
    "queen": "kisaki",
    "farmer": "nomin",
    "teacher": "sensei",
    "doctor": "isha",
    "robot": "kikai",
    "pirate": "kaizoku",
    "garden": "niwa",
    "house": "ie",
    "tree": "moku",
    "river": "kawa",
}

# base form -> (third person singular form, target word)
_VERBS: dict[str, tuple[str, str]] = {
    "chase": ("chases", "oikakeru"),
    "see": ("sees", "miru"),
    "like": ("likes", "konomu"),
    "follow": ("follows", "tsuiteku"),
    "help": ("helps", "tasukeru"),
    "push": ("pushes", "osu"),
    "find": ("finds", "mitsukeru"),
    "watch": ("watches", "nagameru"),
    "bite": ("bites", "kamu"),
    "call": ("calls", "yobu"),
    "carry": ("carries", "hakobu"),
    "kick": ("kicks", "keru"),
}

# No adjective starts with a vowel, so "a" never needs to become "an".
_ADJECTIVES: dict[str, str] = {
    "big": "ookina",
    "small": "chiisana",
    "red": "akai",
    "blue": "aoi",
    "green": "midori",
    "tall": "takai",
    "young": "wakai",
    "happy": "ureshii",
    "sad": "kanashii",
    "brave": "isamashii",
    "black": "kuroi",
    "white": "shiroi",
}

_PREPOSITIONS: dict[str, str] = {
    "in": "naka",
    "on": "ue",
    "near": "chikaku",
    "under": "shita",
    "behind": "ushiro",
    "with": "tomo",
}

_NUMBERS: dict[str, str] = {
    "two": "futa",
    "three": "mitsu",
    "four": "yotsu",
    "five": "itsu",
    "six": "mutsu",
    "seven": "nana",
    "eight": "yatsu",
    "nine": "kokono",
}

_THE = "the"
_A = "a"
_THAT = "that"
_END = "."
_SUBJ = "ga"  # subject particle
_OBJ = "wo"  # object particle
_DEF = "za"  # definiteness marker for "the"
_PLURAL = "ra"  # plural marker
_REL = "ki"  # relative clause marker

_MAX_ADJ = 2
_MAX_RC_DEPTH = 2

# Tuple views for fast sampling (order is fixed by the dict literals above).
_NOUN_LIST: tuple[tuple[str, str, str], ...] = tuple((n, n + "s", t) for n, t in _NOUNS.items())
_VERB_LIST: tuple[tuple[str, str, str], ...] = tuple((b, s, t) for b, (s, t) in _VERBS.items())
_ADJ_LIST: tuple[tuple[str, str], ...] = tuple(_ADJECTIVES.items())
_PREP_LIST: tuple[tuple[str, str], ...] = tuple(_PREPOSITIONS.items())
_NUM_LIST: tuple[tuple[str, str], ...] = tuple(_NUMBERS.items())

# Reverse lookups for the parser: source word -> (target word, flag) where the flag
# is "plural" for nouns and "third person singular" for verbs.
_NOUN_FORMS: dict[str, tuple[str, bool]] = {
    **{sg: (t, False) for sg, _, t in _NOUN_LIST},
    **{pl: (t, True) for _, pl, t in _NOUN_LIST},
}
_VERB_FORMS: dict[str, tuple[str, bool]] = {
    **{b: (t, False) for b, _, t in _VERB_LIST},
    **{s3: (t, True) for _, s3, t in _VERB_LIST},
}

# ------------------------------------------------------------------- length planning

# A core shape is (plural, determiner or None, has_number, n_adjectives).
_Shape = tuple[bool, str | None, bool, int]


def _core_shapes() -> dict[int, tuple[_Shape, ...]]:
    shapes: dict[int, list[_Shape]] = {}
    for n_adj in range(_MAX_ADJ + 1):
        for det in (_THE, _A):
            shapes.setdefault(2 + n_adj, []).append((False, det, False, n_adj))
        for pdet in (None, _THE):
            for has_num in (False, True):
                length = 1 + (pdet is not None) + has_num + n_adj
                shapes.setdefault(length, []).append((True, pdet, has_num, n_adj))
    return {k: tuple(v) for k, v in shapes.items()}


_CORE_SHAPES = _core_shapes()
_CORE_MIN = min(_CORE_SHAPES)
_CORE_MAX = max(_CORE_SHAPES)
_PP_LENGTHS = tuple(range(1 + _CORE_MIN, 2 + _CORE_MAX))  # preposition + core


def _np_max(depth: int) -> int:
    """Longest NP (in words) at relative-clause nesting ``depth``."""
    longest = _CORE_MAX + _PP_LENGTHS[-1]
    if depth < _MAX_RC_DEPTH:
        longest += 2 + _np_max(depth + 1)
    return longest


def _np_splits() -> dict[tuple[int, int], tuple[tuple[int, int, int], ...]]:
    """(length, depth) -> feasible (core, pp, rc) word splits of a full NP."""
    splits: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}
    for depth in range(_MAX_RC_DEPTH + 1):
        rc_lengths: tuple[int, ...] = (0,)
        if depth < _MAX_RC_DEPTH:
            rc_lengths += tuple(range(2 + 1, 2 + _np_max(depth + 1) + 1))
        for k in range(1, _np_max(depth) + 1):
            splits[(k, depth)] = tuple(
                (k - p - r, p, r) for p in (0, *_PP_LENGTHS) for r in rc_lengths if k - p - r in _CORE_SHAPES
            )
    return splits


_NP_SPLITS = _np_splits()
_NP_MAX_TOP = _np_max(0)

MIN_SOURCE_WORDS = 2 * 1 + 2
"""Shortest possible source sentence in words, counting the final '.' (``cats chase dogs .``)."""
MAX_SOURCE_WORDS = 2 * _NP_MAX_TOP + 2
"""Longest possible source sentence in words, counting the final '.'."""

# ------------------------------------------------------------------------ generation


def _core(rng: random.Random, length: int, src: list[str]) -> tuple[bool, list[str]]:
    """Append a CORE of exactly ``length`` words to ``src``.

    Returns (plural, target tokens of the core) so that the caller can put
    pre-nominal material in front of the target core.
    """
    plural, det, has_num, n_adj = rng.choice(_CORE_SHAPES[length])
    sg, pl, noun_t = rng.choice(_NOUN_LIST)
    adjs = rng.sample(_ADJ_LIST, n_adj) if n_adj else []
    core_t = [noun_t]
    if plural:
        core_t.append(_PLURAL)
    if det is not None:
        src.append(det)
    if has_num:
        num_s, num_t = rng.choice(_NUM_LIST)
        src.append(num_s)
    for a_s, _ in adjs:
        src.append(a_s)
    for _, a_t in reversed(adjs):
        core_t.append(a_t)
    if has_num:
        core_t.append(num_t)
    if det == _THE:
        core_t.append(_DEF)
    src.append(pl if plural else sg)
    return plural, core_t


def _np(rng: random.Random, length: int, depth: int, src: list[str]) -> tuple[bool, list[str]]:
    """Append an NP of exactly ``length`` words to ``src``; return (plural, target tokens)."""
    c, p, r = rng.choice(_NP_SPLITS[(length, depth)])
    plural, core_t = _core(rng, c, src)
    tgt: list[str] = []
    pp_t: list[str] = []
    if p:
        prep_s, prep_t = rng.choice(_PREP_LIST)
        src.append(prep_s)
        _, pp_t = _core(rng, p - 1, src)
        pp_t.append(prep_t)
    if r:
        base, s3, verb_t = rng.choice(_VERB_LIST)
        src.append(_THAT)
        src.append(base if plural else s3)
        _, obj_t = _np(rng, r - 2, depth + 1, src)
        tgt.extend(obj_t)
        tgt.append(_OBJ)
        tgt.append(verb_t)
        tgt.append(_REL)
    tgt.extend(pp_t)
    tgt.extend(core_t)
    return plural, tgt


def _sentence(rng: random.Random, length: int) -> tuple[list[str], list[str]]:
    """One (source tokens, target tokens) sentence of exactly ``length`` source words."""
    budget = length - 2  # words shared by the two NPs
    subj_len = rng.randint(max(1, budget - _NP_MAX_TOP), min(_NP_MAX_TOP, budget - 1))
    src: list[str] = []
    subj_plural, subj_t = _np(rng, subj_len, 0, src)
    base, s3, verb_t = rng.choice(_VERB_LIST)
    src.append(base if subj_plural else s3)
    _, obj_t = _np(rng, budget - subj_len, 0, src)
    src.append(_END)
    subj_t.append(_SUBJ)
    subj_t.extend(obj_t)
    subj_t.append(_OBJ)
    subj_t.append(verb_t)
    subj_t.append(_END)
    return src, subj_t


def _attempt_budget(n: int) -> int:
    return 10 * n + 10_000


def generate(
    n: int,
    seed: int,
    min_words: int = 4,
    max_words: int = 40,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[Pair]:
    """Generate ``n`` distinct (source, target) pairs.

    Every source has between ``min_words`` and ``max_words`` words (the final
    ``"."`` counts as a word) and none is in ``exclude``.  For each sentence a
    target length is drawn (half of the time uniformly from the range, half of
    the time from a linearly decreasing density favouring short sentences) and
    a sentence of exactly that length is built, so any length range inside
    ``[MIN_SOURCE_WORDS, MAX_SOURCE_WORDS]`` is sampled efficiently.

    The result is a deterministic function of the arguments.  Raises
    ``ValueError`` for a negative ``n``, an empty or impossible length range, or
    when ``n`` distinct pairs cannot be found within a bounded number of
    attempts (the grammar cannot supply that many in the range).
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    lo = max(min_words, MIN_SOURCE_WORDS)
    hi = min(max_words, MAX_SOURCE_WORDS)
    if lo > hi:
        raise ValueError(
            f"no sentence has between {min_words} and {max_words} words "
            f"(the grammar produces {MIN_SOURCE_WORDS}..{MAX_SOURCE_WORDS})"
        )
    rng = random.Random(seed)
    span = hi - lo + 1
    seen: set[str] = set()
    out: list[Pair] = []
    attempts = 0
    budget = _attempt_budget(n)
    random_ = rng.random
    sqrt = math.sqrt
    while len(out) < n:
        if attempts >= budget:
            raise ValueError(
                f"could only generate {len(out)} of {n} distinct pairs with "
                f"{min_words}..{max_words} words after {attempts} attempts"
            )
        attempts += 1
        if random_() < 0.5:
            length = lo + int(span * random_())
        else:
            length = lo + int(span * (1.0 - sqrt(random_())))
        length = min(length, hi)  # guards float edge cases
        src_toks, tgt_toks = _sentence(rng, length)
        src = " ".join(src_toks)
        if src in seen or src in exclude:
            continue
        seen.add(src)
        out.append((src, " ".join(tgt_toks)))
    return out


def _simple_np(rng: random.Random, noun: tuple[str, str, str], plural: bool) -> tuple[list[str], list[str]]:
    """A short NP (0-1 adjective, maybe a number) for minimal pairs: (source, target)."""
    sg, pl, noun_t = noun
    src: list[str] = []
    tgt = [noun_t]
    det: str | None
    if plural:
        det = _THE if rng.random() < 0.5 else None
        tgt.append(_PLURAL)
    else:
        det = _THE if rng.random() < 0.5 else _A
    if det is not None:
        src.append(det)
    num: tuple[str, str] | None = None
    if plural and rng.random() < 0.4:
        num = rng.choice(_NUM_LIST)
        src.append(num[0])
    if rng.random() < 0.4:
        adj_s, adj_t = rng.choice(_ADJ_LIST)
        src.append(adj_s)
        tgt.append(adj_t)
    if num is not None:
        tgt.append(num[1])
    if det == _THE:
        tgt.append(_DEF)
    src.append(pl if plural else sg)
    return src, tgt


def minimal_pairs(
    n: int,
    seed: int,
    max_words: int = 12,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[tuple[Pair, Pair]]:
    """Generate ``n`` word-order probes ``((src1, tgt1), (src2, tgt2))``.

    ``src2`` is ``src1`` with the subject NP and the object NP swapped
    (``the cat chases two dogs .`` / ``two dogs chase the cat .`` is impossible
    because of agreement, so both NPs always share grammatical number and the
    two sources contain exactly the same multiset of words).  The two NPs have
    different nouns, so the targets differ in which noun carries the subject
    particle ``ga`` and which the object particle ``wo``.  Sentences are
    ``NP VERB NP .`` with at most one adjective per NP and an optional number,
    at most ``max_words`` words.  No source appears twice in the result or is
    in ``exclude``.  Deterministic in the arguments; raises ``ValueError`` for
    a negative ``n``, ``max_words < 4`` or when the bounded number of attempts
    is exhausted.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if max_words < MIN_SOURCE_WORDS:
        raise ValueError(f"max_words must be at least {MIN_SOURCE_WORDS}, got {max_words}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[Pair, Pair]] = []
    attempts = 0
    budget = _attempt_budget(n)
    while len(out) < n:
        if attempts >= budget:
            raise ValueError(
                f"could only generate {len(out)} of {n} minimal pairs with "
                f"at most {max_words} words after {attempts} attempts"
            )
        attempts += 1
        plural = rng.random() < 0.4
        noun_a, noun_b = rng.sample(_NOUN_LIST, 2)
        base, s3, verb_t = rng.choice(_VERB_LIST)
        verb_s = base if plural else s3
        a_s, a_t = _simple_np(rng, noun_a, plural)
        b_s, b_t = _simple_np(rng, noun_b, plural)
        if len(a_s) + len(b_s) + 2 > max_words:
            continue
        src1 = " ".join([*a_s, verb_s, *b_s, _END])
        src2 = " ".join([*b_s, verb_s, *a_s, _END])
        if src1 in seen or src2 in seen or src1 in exclude or src2 in exclude:
            continue
        seen.add(src1)
        seen.add(src2)
        tgt1 = " ".join([*a_t, _SUBJ, *b_t, _OBJ, verb_t, _END])
        tgt2 = " ".join([*b_t, _SUBJ, *a_t, _OBJ, verb_t, _END])
        out.append(((src1, tgt1), (src2, tgt2)))
    return out


# --------------------------------------------------------------------------- parsing


class _Parser:
    """Recursive-descent parser for the source grammar, emitting target tokens."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _error(self, what: str) -> ValueError:
        where = " ".join(self.tokens[: self.pos])
        return ValueError(f"not a sentence of the synthetic grammar: {what} after {where!r}")

    def sentence(self) -> list[str]:
        subj_plural, tgt = self._np(0, allow_mod=True)
        verb_t = self._verb(subj_plural)
        _, obj_t = self._np(0, allow_mod=True)
        if self._peek() != _END:
            raise self._error(f"expected '.' but found {self._peek()!r}")
        self.pos += 1
        if self.pos != len(self.tokens):
            raise self._error("trailing words")
        tgt.append(_SUBJ)
        tgt.extend(obj_t)
        tgt.append(_OBJ)
        tgt.append(verb_t)
        tgt.append(_END)
        return tgt

    def _verb(self, subject_plural: bool) -> str:
        tok = self._peek()
        if tok is None or tok not in _VERB_FORMS:
            raise self._error(f"expected a verb but found {tok!r}")
        verb_t, is_3sg = _VERB_FORMS[tok]
        if is_3sg == subject_plural:
            raise self._error(f"verb {tok!r} does not agree with its subject")
        self.pos += 1
        return verb_t

    def _np(self, depth: int, allow_mod: bool) -> tuple[bool, list[str]]:
        tok = self._peek()
        det: str | None = None
        if tok in (_THE, _A):
            det = tok
            self.pos += 1
            tok = self._peek()
        num_t: str | None = None
        if tok is not None and tok in _NUMBERS:
            num_t = _NUMBERS[tok]
            self.pos += 1
            tok = self._peek()
        adjs: list[str] = []
        while tok is not None and tok in _ADJECTIVES:
            if len(adjs) == _MAX_ADJ:
                raise self._error("too many adjectives")
            adj_t = _ADJECTIVES[tok]
            if adj_t in adjs:
                raise self._error(f"repeated adjective {tok!r}")
            adjs.append(adj_t)
            self.pos += 1
            tok = self._peek()
        if tok is None or tok not in _NOUN_FORMS:
            raise self._error(f"expected a noun but found {tok!r}")
        noun_t, plural = _NOUN_FORMS[tok]
        if plural and det == _A:
            raise self._error("'a' with a plural noun")
        if not plural and (det is None or num_t is not None):
            raise self._error(f"singular noun {tok!r} needs 'the' or 'a' and no number")
        self.pos += 1
        core = [noun_t]
        if plural:
            core.append(_PLURAL)
        core.extend(reversed(adjs))
        if num_t is not None:
            core.append(num_t)
        if det == _THE:
            core.append(_DEF)
        if not allow_mod:
            return plural, core
        tgt: list[str] = []
        pp: list[str] = []
        tok = self._peek()
        if tok is not None and tok in _PREPOSITIONS:
            self.pos += 1
            _, pp = self._np(depth, allow_mod=False)
            pp.append(_PREPOSITIONS[tok])
        if self._peek() == _THAT and depth < _MAX_RC_DEPTH:
            self.pos += 1
            verb_t = self._verb(plural)
            _, obj = self._np(depth + 1, allow_mod=True)
            tgt.extend(obj)
            tgt.append(_OBJ)
            tgt.append(verb_t)
            tgt.append(_REL)
        tgt.extend(pp)
        tgt.extend(core)
        return plural, tgt


def translate(source: str) -> str:
    """Translate a source sentence of the synthetic grammar into the target language.

    The sentence is tokenised on whitespace and parsed with the (unambiguous)
    source grammar described in the module docstring; the target is built from
    the parse.  For every pair produced by :func:`generate` or
    :func:`minimal_pairs`, ``translate(src) == tgt``.  Raises ``ValueError`` for
    any input that is not a sentence of the grammar (unknown words, wrong word
    order, missing ``"."``, agreement errors, relative clauses nested deeper
    than two levels, ...).
    """
    tokens = source.split()
    if not tokens:
        raise ValueError("empty sentence")
    return " ".join(_Parser(tokens).sentence())
