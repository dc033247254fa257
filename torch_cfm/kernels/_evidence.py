"""The evidence behind a tuning-table entry: (the entry's bench row id, the alternative's row id) pairs,
each pair measured in one run, resolved against a data file under ``bench/results``. Shared by
:mod:`.body_plans` and :mod:`.vocoder_tiles`, each with its own row-id form."""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Optional, Sequence


def check_pairs(owner: str, evidence: Sequence, pattern: re.Pattern, form: str) -> None:
    """ValueError (naming ``owner``) unless every item of ``evidence`` is a pair of ids ``pattern`` matches."""
    for pair in evidence:
        if len(pair) != 2 or not all(isinstance(i, str) and pattern.match(i) for i in pair):
            raise ValueError(f"{owner}: evidence must be (row id, row id) pairs of the form {form}, got {pair!r}")


def data_rows(relpath: str, path: Optional[str] = None) -> list[dict]:
    """The rows of a data file: ``path``, default ``relpath`` in the source tree (an installed package
    without the repository has none: FileNotFoundError)."""
    if path is None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.path.join(root, relpath)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def one_row(rows: Sequence[dict], rid: str, pattern: re.Pattern, form: str,
            matches: Callable[[dict, dict], bool]) -> dict:
    """The one row of ``rows`` that ``rid`` names (``matches(row, the id's named groups)``); ValueError
    when ``rid`` is not of the form, or names no row or several."""
    m = pattern.match(rid)
    if m is None:
        raise ValueError(f"find_row: rid must have the form {form}, got {rid!r}")
    found = [r for r in rows if matches(r, m.groupdict())]
    if len(found) != 1:
        raise ValueError(f"find_row: {rid!r} names {len(found)} rows of the data, not one")
    return found[0]
