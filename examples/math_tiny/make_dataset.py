"""Generate the sample math dataset: arithmetic word problems with answers, in verl's RL format.

Each row is what verl's GSM8K preprocessing (examples/data_preprocess/gsm8k.py) writes::

    {"data_source": "megatron_rl/arith_tiny",
     "prompt": [{"role": "user", "content": "<question> Let's think step by step and output the final answer after \"####\"."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "19"},
     "extra_info": {"split": "train", "index": 0, "answer": "12 + 7 = 19\n#### 19", "question": "<question>"}}

Problems: addition, subtraction, multiplication, exact division, two-step totals, and equal shares whose
answers are fractions (ground truth like "3/4"). Deterministic given --seed; the committed
examples/math_tiny/train.jsonl is ``python examples/math_tiny/make_dataset.py`` (a test checks it).

Usage: python examples/math_tiny/make_dataset.py [--out examples/math_tiny/train.jsonl] [--rows 256] [--seed 0]
       (a .parquet --out writes Parquet, needs pyarrow)
"""
from __future__ import annotations

import argparse
import json
import os
import random
from fractions import Fraction

DATA_SOURCE = "megatron_rl/arith_tiny"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
NAMES = ("Ann", "Ben", "Carla", "Dev", "Emma", "Farid", "Gina", "Hugo", "Ines", "Jamal", "Kira", "Liam")
THINGS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells")


def _problem(rng: random.Random) -> tuple[str, str, str]:
    """(question, worked solution ending in '#### answer', answer) of one random problem."""
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    kind = rng.choice(("add", "sub", "mul", "div", "two_step", "share"))
    if kind == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        q = f"{name} has {a} {thing} and gets {b} more from {other}. How many {thing} does {name} have now?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == "sub":
        a = rng.randint(20, 150)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {thing} and gave {b} of them to {other}. How many {thing} does {name} have left?"
        ans, work = a - b, f"{a} - {b} = {a - b}"
    elif kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 25)
        q = f"{name} buys {a} bags with {b} {thing} in each bag. How many {thing} does {name} buy?"
        ans, work = a * b, f"{a} * {b} = {a * b}"
    elif kind == "div":
        b, ans = rng.randint(2, 9), rng.randint(2, 20)
        a = b * ans
        q = f"{name} shares {a} {thing} equally among {b} friends. How many {thing} does each friend get?"
        work = f"{a} / {b} = {ans}"
    elif kind == "two_step":
        a, b, c = rng.randint(2, 9), rng.randint(2, 15), rng.randint(1, 30)
        q = (f"{name} has {a} boxes of {b} {thing} and {c} loose {thing}. "
             f"How many {thing} does {name} have in total?")
        ans, work = a * b + c, f"{a} * {b} = {a * b}\n{a * b} + {c} = {a * b + c}"
    else:
        b = rng.randint(2, 8)
        a = rng.randint(1, 3 * b)
        while a % b == 0:
            a = rng.randint(1, 3 * b)
        f = Fraction(a, b)
        q = f"{name} cuts {a} pizzas into equal parts for {b} people. How many pizzas does each person get?"
        ans, work = f"{f.numerator}/{f.denominator}", f"{a} / {b} = {f.numerator}/{f.denominator}"
    return q, f"{work}\n#### {ans}", str(ans)


def make_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` verl-format rows (see the module docstring), deterministic given ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q, work, ans = _problem(rng)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ans},
            "extra_info": {"split": split, "index": i, "answer": work, "question": q},
        })
    return rows


def write(rows: list[dict], out: str) -> str:
    """Write ``rows`` as JSONL (or Parquet for a .parquet path); return ``out``."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        with open(out, "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, sort_keys=True) + "\n")
    return out


def main(argv=None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "train.jsonl"))
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write(make_rows(a.rows, a.seed), a.out))


if __name__ == "__main__":
    main()
