"""Whether two runs' metrics.jsonl are bit-identical in everything but wall time.

    python tools/metrics_equal.py RUN_A RUN_B [RUN_A2 RUN_B2 ...]

Compares every record of ``RUN_A/metrics.jsonl`` with the same record of ``RUN_B/metrics.jsonl``, key by key, as
exact floats; ``time``, ``timing/*`` and ``perf/*`` (wall-clock measurements) are left out. Prints one line per pair (records,
keys compared, first difference) and exits 1 when any pair differs. ``tools/step_equivalence.sh`` makes the runs.
"""
from __future__ import annotations

import json
import os
import sys

SKIP = ("timing/", "perf/", "time")  # wall-clock: the record's time stamp, durations, rates


def records(run_dir: str):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def compare(a_dir: str, b_dir: str):
    """(records compared, keys compared, first difference or None)."""
    a, b = records(a_dir), records(b_dir)
    if len(a) != len(b):
        return len(a), 0, f"{len(a)} records vs {len(b)}"
    keys = 0
    for ra, rb in zip(a, b):
        ka = {k for k in ra if not k.startswith(SKIP)}
        kb = {k for k in rb if not k.startswith(SKIP)}
        if ka != kb:
            return len(a), keys, f"step {ra.get('step')}: keys only in A {sorted(ka - kb)[:5]}, only in B {sorted(kb - ka)[:5]}"
        for k in sorted(ka):
            keys += 1
            if ra[k] != rb[k]:
                return len(a), keys, f"step {ra.get('step')}: {k} = {ra[k]!r} vs {rb[k]!r}"
    return len(a), keys, None


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or len(args) % 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    bad = 0
    for a_dir, b_dir in zip(args[::2], args[1::2]):
        n, keys, diff = compare(a_dir, b_dir)
        print(f"{a_dir} vs {b_dir}: {n} records, {keys} values compared: " + ("identical" if diff is None else f"DIFFER ({diff})"))
        bad += diff is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
