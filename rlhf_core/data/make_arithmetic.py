"""Write ``arithmetic.jsonl``: arithmetic word problems in GSM8K's row shape, from a seed.

    python -m rlhf_core.data.make_arithmetic [--rows 200] [--seed 0] [--out path]

Each row is ``{"id", "question", "answer"}``, the answer a worked solution ending in ``#### n``
(GSM8K's convention, which ``reward=math`` reads the reference from). Two steps each, over
addition, subtraction, multiplication and exact division, some results in the thousands (so
``1,000`` against ``1000`` occurs). The same seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elif", "Femi", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena"]
ITEMS = [("apples", "bag"), ("pencils", "pack"), ("stickers", "sheet"), ("marbles", "jar"), ("cookies", "tray"),
         ("books", "crate"), ("stamps", "album"), ("beads", "string")]

Problem = tuple[str, str, int]  # question, worked answer, result


def _buy_more(rng: random.Random, name: str, item: str, unit: str) -> Problem:
    have, packs, each = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    got = packs * each
    return (f"{name} has {have} {item}. {name} buys {packs} {unit}s with {each} {item} in each {unit}. "
            f"How many {item} does {name} have now?",
            f"{packs} {unit}s of {each} is {packs} * {each} = {got} {item}. {have} + {got} = {have + got}.", have + got)


def _give_away(rng: random.Random, name: str, item: str, unit: str) -> Problem:
    friends, each = rng.randint(2, 8), rng.randint(2, 15)
    have = friends * each + rng.randint(1, 50)
    given = friends * each
    return (f"{name} has {have} {item} and gives {each} {item} to each of {friends} friends. "
            f"How many {item} are left?",
            f"{name} gives away {friends} * {each} = {given} {item}. {have} - {given} = {have - given}.", have - given)


def _share(rng: random.Random, name: str, item: str, unit: str) -> Problem:
    people, each = rng.randint(2, 9), rng.randint(3, 20)
    total = people * each
    return (f"{name} shares {total} {item} equally among {people} children. How many {item} does each child get?",
            f"{total} / {people} = {each}.", each)


def _bulk(rng: random.Random, name: str, item: str, unit: str) -> Problem:
    shops, units, each = rng.randint(3, 12), rng.randint(10, 40), rng.randint(12, 30)
    per_shop = units * each
    return (f"A factory sends {shops} shops {units} {unit}s each, and every {unit} holds {each} {item}. "
            f"How many {item} does it send?",
            f"Each shop gets {units} * {each} = {per_shop} {item}. {shops} * {per_shop} = {shops * per_shop}.",
            shops * per_shop)


def _difference(rng: random.Random, name: str, item: str, unit: str) -> Problem:
    other = rng.choice([n for n in NAMES if n != name])
    a, times = rng.randint(3, 30), rng.randint(2, 6)
    b = a * times
    return (f"{name} has {a} {item}. {other} has {times} times as many. How many more {item} does {other} have than {name}?",
            f"{other} has {a} * {times} = {b} {item}. {b} - {a} = {b - a}.", b - a)


TEMPLATES: list[Callable[[random.Random, str, str, str], Problem]] = [_buy_more, _give_away, _share, _bulk, _difference]


def rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        item, unit = rng.choice(ITEMS)
        question, work, result = TEMPLATES[i % len(TEMPLATES)](rng, rng.choice(NAMES), item, unit)
        out.append({"id": f"arithmetic-{i}", "question": question, "answer": f"{work}\n#### {result}"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "arithmetic.jsonl")
    args = ap.parse_args()
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows, args.seed)))
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
