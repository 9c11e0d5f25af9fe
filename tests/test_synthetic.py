"""Tests for the embedded synthetic language pair (tpe_train.data.synthetic)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tpe_train.data import synthetic
from tpe_train.data.synthetic import (
    MAX_SOURCE_WORDS,
    MIN_SOURCE_WORDS,
    generate,
    minimal_pairs,
    translate,
)


def _n_words(sentence: str) -> int:
    return len(sentence.split(" "))


def _roles(target: str) -> tuple[list[str], list[str]]:
    """(subject tokens, object tokens) of a simple ``NP ga NP wo VERB .`` target."""
    toks = target.split(" ")
    ga = toks.index("ga")
    wo = len(toks) - 1 - toks[::-1].index("wo")
    return toks[:ga], toks[ga + 1 : wo]


# ----------------------------------------------------------------------------- generate


def test_generate_is_deterministic_and_seed_dependent() -> None:
    random.seed(1)
    a = generate(300, seed=7)
    random.seed(2)  # global random state must not matter
    b = generate(300, seed=7)
    c = generate(300, seed=8)
    assert a == b
    assert a != c
    assert len(set(a) & set(c)) < 30


def test_generate_prefix_stable_for_same_seed() -> None:
    # Same (seed, range): a longer request extends a shorter one.
    assert generate(500, seed=3)[:200] == generate(200, seed=3)


def test_generate_lengths_in_bounds_and_spread() -> None:
    pairs = generate(3000, seed=0, min_words=4, max_words=40)
    lengths = [_n_words(src) for src, _ in pairs]
    assert min(lengths) >= 4
    assert max(lengths) <= 40
    counts = Counter(lengths)
    assert sum(v for k, v in counts.items() if k <= 8) > 200  # short ones present
    assert sum(v for k, v in counts.items() if k >= 30) > 200  # long ones present
    assert len(counts) == 37  # every length 4..40 occurs


@pytest.mark.parametrize(("lo", "hi"), [(4, 4), (10, 12), (41, 60), (60, MAX_SOURCE_WORDS)])
def test_generate_respects_narrow_and_long_ranges(lo: int, hi: int) -> None:
    pairs = generate(200, seed=5, min_words=lo, max_words=hi)
    lengths = {_n_words(src) for src, _ in pairs}
    assert min(lengths) >= lo
    assert max(lengths) <= hi
    for src, tgt in pairs:
        assert translate(src) == tgt


def test_generate_can_reach_50_plus_words() -> None:
    pairs = generate(100, seed=0, min_words=50, max_words=200)
    assert all(50 <= _n_words(src) <= MAX_SOURCE_WORDS for src, _ in pairs)


def test_generate_distinct_sources() -> None:
    pairs = generate(5000, seed=11, min_words=4, max_words=12)
    sources = [src for src, _ in pairs]
    assert len(sources) == len(set(sources)) == 5000


def test_generate_40k_distinct_short_enough() -> None:
    pairs = generate(40_000, seed=0, min_words=4, max_words=30)
    assert len({src for src, _ in pairs}) == 40_000


def test_generate_honours_exclude() -> None:
    base = generate(2000, seed=1, min_words=4, max_words=7)
    excluded = frozenset(src for src, _ in base[:1000])
    again = generate(2000, seed=1, min_words=4, max_words=7, exclude=excluded)
    assert not excluded & {src for src, _ in again}
    assert len(again) == 2000
    # A plain set is accepted too.
    again_set = generate(2000, seed=1, min_words=4, max_words=7, exclude=set(excluded))
    assert again_set == again


def test_sentence_format() -> None:
    for src, tgt in generate(500, seed=2):
        for sentence in (src, tgt):
            assert sentence.endswith(" .")
            assert sentence == sentence.strip()
            assert "  " not in sentence
            assert sentence == sentence.lower()
        assert src.count(".") == 1
        assert tgt.count(".") == 1


def test_translate_matches_generated_targets() -> None:
    for src, tgt in generate(3000, seed=4, min_words=4, max_words=MAX_SOURCE_WORDS):
        assert translate(src) == tgt


def test_target_is_verb_final_with_role_particles() -> None:
    verbs = {t for _, t in synthetic._VERBS.values()}
    for _, tgt in generate(500, seed=9):
        toks = tgt.split(" ")
        assert toks[-2] in verbs
        assert toks[-3] == "wo"
        assert toks.count("ga") == 1


def test_translate_examples() -> None:
    assert translate("the cat chases the dog .") == "neko za ga inu za wo oikakeru ."
    assert translate("the dog chases the cat .") == "inu za ga neko za wo oikakeru ."
    assert translate("cats chase dogs .") == "neko ra ga inu ra wo oikakeru ."
    assert (
        translate("the big cat that sees a bird chases two small dogs in the garden .")
        == "tori wo miru ki neko ookina za ga niwa za naka inu ra chiisana futa wo oikakeru ."
    )
    # Whitespace-tokenised input is accepted.
    assert translate("  the cat   chases the dog . ") == "neko za ga inu za wo oikakeru ."


def test_translate_nesting_depth_two() -> None:
    src = "the cat that sees a bird that bites the dog chases the king ."
    assert translate(src) == ("inu za wo kamu ki tori wo miru ki neko za ga oja za wo oikakeru .")
    src = "the cat in the garden that sees a dog in the house that likes a bird chases the dog ."
    assert translate(src) == (
        "tori wo konomu ki ie za naka inu wo miru ki niwa za naka neko za ga inu za wo oikakeru ."
    )


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "the cat chases the dog",  # no final '.'
        "the cat chases the dog . .",  # trailing words
        "the cat chase the dog .",  # agreement
        "cats chases the dog .",  # agreement
        "cat chases the dog .",  # singular without determiner
        "a cats chase the dog .",  # 'a' with plural
        "the two cat chases the dog .",  # number with singular
        "the big big cat chases the dog .",  # repeated adjective
        "the big red small cat chases the dog .",  # three adjectives
        "the cat chases the unicorn .",  # unknown word
        "The cat chases the dog .",  # not lowercase
        "the cat the dog chases .",  # wrong order
        "the cat in the garden in the house chases the dog .",  # two PPs
        # relative clauses nested three deep
        "the cat that sees a bird that bites the dog that likes a king chases the king .",
        (
            "the cat in the garden that sees a dog in the house that likes a bird"
            " that bites a king chases the dog ."
        ),
    ],
)
def test_translate_rejects_non_grammatical(bad: str) -> None:
    with pytest.raises(ValueError):
        translate(bad)


def test_generate_value_errors() -> None:
    with pytest.raises(ValueError):
        generate(-1, seed=0)
    with pytest.raises(ValueError):
        generate(10, seed=0, min_words=20, max_words=10)
    with pytest.raises(ValueError):
        generate(10, seed=0, min_words=1, max_words=3)
    with pytest.raises(ValueError):
        generate(10, seed=0, min_words=MAX_SOURCE_WORDS + 1, max_words=MAX_SOURCE_WORDS + 10)
    # Only "NOUNs VERB NOUNs ." has 4 words: fewer than 7000 such sentences exist.
    n_four = len(synthetic._NOUNS) ** 2 * len(synthetic._VERBS)
    assert n_four < 7000
    with pytest.raises(ValueError):
        generate(7000, seed=0, min_words=4, max_words=4)
    assert generate(0, seed=0) == []


def test_length_constants() -> None:
    assert MIN_SOURCE_WORDS == 4
    assert MAX_SOURCE_WORDS >= 50


# ------------------------------------------------------------------------------ lexicon


def test_lexicon_is_unambiguous() -> None:
    src_words: list[str] = [
        *synthetic._NOUNS,
        *(n + "s" for n in synthetic._NOUNS),
        *synthetic._VERBS,
        *(s for s, _ in synthetic._VERBS.values()),
        *synthetic._ADJECTIVES,
        *synthetic._PREPOSITIONS,
        *synthetic._NUMBERS,
        "the",
        "a",
        "that",
        ".",
    ]
    assert len(src_words) == len(set(src_words))
    tgt_words: list[str] = [
        *synthetic._NOUNS.values(),
        *(t for _, t in synthetic._VERBS.values()),
        *synthetic._ADJECTIVES.values(),
        *synthetic._PREPOSITIONS.values(),
        *synthetic._NUMBERS.values(),
        "ga",
        "wo",
        "za",
        "ra",
        "ki",
        ".",
    ]
    assert len(tgt_words) == len(set(tgt_words))
    assert 20 <= len(synthetic._NOUNS) <= 30
    assert 10 <= len(synthetic._VERBS) <= 15
    assert 10 <= len(synthetic._ADJECTIVES) <= 15
    assert 5 <= len(synthetic._PREPOSITIONS) <= 6
    assert list(synthetic._NUMBERS) == [
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
    ]


# ------------------------------------------------------------------------ minimal pairs


def test_minimal_pairs_deterministic() -> None:
    assert minimal_pairs(200, seed=1) == minimal_pairs(200, seed=1)
    assert minimal_pairs(200, seed=1) != minimal_pairs(200, seed=2)


def test_minimal_pairs_same_words_different_targets() -> None:
    probes = minimal_pairs(1000, seed=0)
    assert len(probes) == 1000
    sources: list[str] = []
    for (src1, tgt1), (src2, tgt2) in probes:
        assert src1 != src2
        assert Counter(src1.split(" ")) == Counter(src2.split(" "))
        assert tgt1 != tgt2
        assert _n_words(src1) <= 12
        assert translate(src1) == tgt1
        assert translate(src2) == tgt2
        sources += [src1, src2]
    assert len(sources) == len(set(sources))


def test_minimal_pairs_swap_roles() -> None:
    for (_, tgt1), (_, tgt2) in minimal_pairs(500, seed=3):
        subj1, obj1 = _roles(tgt1)
        subj2, obj2 = _roles(tgt2)
        assert subj1 != obj1
        assert subj1 == obj2  # the subject of one is the object of the other
        assert obj1 == subj2
        assert subj1[0] != obj1[0]  # the head nouns differ


def test_minimal_pairs_defeat_bag_of_words() -> None:
    # Any translator that only sees the multiset of source words maps both members of a
    # pair to the same output, so it is wrong on at least one member of every pair.
    probes = minimal_pairs(500, seed=4)
    bag_translator: dict[tuple[str, ...], str] = {}
    correct = 0
    for (src1, tgt1), (src2, tgt2) in probes:
        key1 = tuple(sorted(src1.split(" ")))
        key2 = tuple(sorted(src2.split(" ")))
        assert key1 == key2
        assert tgt1 != tgt2
        bag_translator[key1] = tgt1  # best case: it memorised one of the two
        correct += (bag_translator[key1] == tgt1) + (bag_translator[key2] == tgt2)
    assert correct == len(probes)  # exactly half of the 2 * len(probes) sentences


def test_minimal_pairs_exclude_and_max_words() -> None:
    first = minimal_pairs(300, seed=5)
    excluded = {src for pair in first[:150] for src, _ in pair}
    again = minimal_pairs(300, seed=5, exclude=excluded)
    assert not excluded & {src for pair in again for src, _ in pair}
    short = minimal_pairs(200, seed=6, max_words=5)
    assert all(_n_words(src) <= 5 for pair in short for src, _ in pair)


def test_minimal_pairs_value_errors() -> None:
    with pytest.raises(ValueError):
        minimal_pairs(-1, seed=0)
    with pytest.raises(ValueError):
        minimal_pairs(5, seed=0, max_words=3)
    # With 4 words only "NOUNs VERB NOUNs ." exists: far fewer than 10_000 probes.
    with pytest.raises(ValueError):
        minimal_pairs(10_000, seed=0, max_words=4)
    assert minimal_pairs(0, seed=0) == []


def test_minimal_pairs_disjoint_from_training_via_exclude() -> None:
    probes = minimal_pairs(100, seed=0)
    probe_sources = {src for pair in probes for src, _ in pair}
    train = generate(2000, seed=0, min_words=4, max_words=12, exclude=probe_sources)
    assert not probe_sources & {src for src, _ in train}
