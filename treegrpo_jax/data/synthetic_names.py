"""Invented words for the synthetic world's names, built from syllables.

Every entity name is made of one or two invented words that no other name shares, so a search for
a name has exactly one passage that mentions it many times (namesakes, `WorldConfig.distractors`,
share one word on purpose; the whole name stays unique). Beyond being distinct, no word is a
substring of another word or of an ordinary word in the world's templates: then string checks
such as "the answer does not appear in this passage" cannot fire on a piece of a longer word, and
BM25 (which splits on word boundaries) sees each name as its own rare tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

__all__ = ["NameWords", "template_words"]

# Weighted by repetition: plain onsets and vowels dominate, so words stay pronounceable.
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z") * 4 + (
    "br",
    "dr",
    "gr",
    "kr",
    "tr",
    "th",
    "st",
    "sk",
    "vr",
    "zh",
)
_VOWELS = ("a", "e", "i", "o", "u") * 6 + ("ae", "ia", "io", "ou", "ei")
# No "s" coda: a final "s" would read as a plural and invite stemmers to cut it.
_CODAS = ("",) * 12 + ("n", "r", "l", "m", "nd", "rk", "lt", "th")
_MIN_LETTERS = 5
_MAX_TRIES_PER_WORD = 1000


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


class NameWords:
    """Draws invented words that are pairwise non-overlapping (no word contains another).

    Args:
        rng: the random stream to draw from (the order of calls fixes the words).
        reserved: ordinary words of the templates; no drawn word may be part of one.
    """

    def __init__(self, rng: random.Random, reserved: Iterable[str]):
        self._rng = rng
        self._reserved = {w.lower() for w in reserved}
        self._words: list[str] = []

    def _clashes(self, word: str) -> bool:
        for other in self._words:
            if word in other or other in word:
                return True
        # One direction only: template words such as "in" or "of" sit inside many names harmlessly,
        # but a name inside a template word ("ster" in "master") would match where it is not meant.
        return any(word in r for r in self._reserved)

    def draw(self, min_syllables: int, max_syllables: int) -> str:
        """Returns a new capitalised word of `min_syllables`..`max_syllables` syllables.

        Raises:
            RuntimeError: if no fresh word is found (the world asks for far too many names).
        """
        for _ in range(_MAX_TRIES_PER_WORD):
            n = self._rng.randint(min_syllables, max_syllables)
            word = "".join(_syllable(self._rng) for _ in range(n))
            if len(word) < _MIN_LETTERS or self._clashes(word):
                continue
            self._words.append(word)
            return word.capitalize()
        raise RuntimeError(
            f"could not find a fresh name after {_MAX_TRIES_PER_WORD} tries ({len(self._words)} taken)"
        )


def template_words(*texts: str) -> set[str]:
    """Returns the lower-case words (letters only) that occur in `texts`."""
    return {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}
