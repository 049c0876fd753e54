"""One-line message helpers shared by every layer (config, algorithms, data): the option a word most likely
misspells, and joining a clause onto a message. Kept below `config` so that any layer can phrase its errors
without importing the configuration."""

from __future__ import annotations

import difflib
from typing import Any


def closest(word: Any, options: Any) -> str | None:
    """The option `word` most likely misspells (difflib, similarity ≥ 0.7), else the closest option containing it
    (`epochs` → `local_epochs`); None when nothing is near. Letter case is ignored: names are lower case and
    papers write them as `FedAvg`, `FedRoD` or `CNN`, which a case-sensitive comparison would find near nothing."""
    word, options = str(word), [str(o) for o in options]
    folded = {}
    for o in options:
        folded.setdefault(o.casefold(), o)  # the first option of each spelling, as difflib's own order
    word = word.casefold()
    close = difflib.get_close_matches(word, folded, n=1, cutoff=0.7)
    containing = [o for o in folded if len(word) >= 3 and word in o]
    if not close and containing:
        close = difflib.get_close_matches(word, containing, n=1, cutoff=0)
    return folded[close[0]] if close else None


def did_you_mean(word: Any, options: Any) -> str:
    """"; did you mean X?" for the option `word` most likely meant (`closest`), or "" when none is near."""
    close = closest(word, options)
    return f"; did you mean {close}?" if close else ""


def then(message: str, more: str) -> str:
    """`message` followed by the clause `more` (without its separator): after a question, as a new sentence."""
    return f"{message} {more[:1].upper()}{more[1:]}" if message.endswith("?") else f"{message}; {more}"
