"""JSON-lines reading shared by prompt datasets, recorded rollouts and run metrics.

    for line_no, record in read_json_objects("rollouts.jsonl"):
        ...

Blank lines are skipped; a line that is not JSON, or JSON that is not an object, raises ValueError
``"<where>:<line>: not valid JSON (<reason>)"`` / ``"<where>:<line>: expected a JSON object, got <type>"``
(``where`` defaults to the path), so every reader reports bad files the same way.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Optional, Tuple


def read_json_objects(path: str | os.PathLike, where: Optional[str] = None) -> Iterator[Tuple[int, dict]]:
    """Yield ``(line number, object)`` for each non-blank line of the JSON-lines file ``path``."""
    where = str(path) if where is None else where
    with open(path, encoding="utf-8") as fh:
        for no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}:{no}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}:{no}: expected a JSON object, got {type(rec).__name__}")
            yield no, rec
