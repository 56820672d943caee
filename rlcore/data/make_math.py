"""Generates `math_word_problems.jsonl`: GSM8K-style multi-step arithmetic word problems.

Run ``python -m rlcore.data.make_math`` to rebuild the shipped files (deterministic: the same
seed writes the same bytes). Each line: {"question", "answer" (GSM8K style: working then
"#### N"), "split": "train" | "demo" | "eval"}. Answers are integers.

- `math_word_problems.jsonl`: two-step problems with numbers up to a few hundred (train, eval);
- `math_one_step.jsonl`: one addition or subtraction of numbers below 10 in a short sentence,
  plus a "demo" split for supervised warm-up: a task a tiny policy can learn on a CPU (the
  `math` recipe).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Faye", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena", "Max", "Nia"]
ITEMS = ["apples", "pens", "books", "stickers", "marbles", "cookies", "shells", "cards"]


def _problem(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(5, 40), rng.randint(2, 30)
        c = rng.randint(1, a + b - 1)
        return (
            f"{name} has {a} {item}, buys {b} more and gives away {c}. How many {item} does {name} have now?",
            f"{a}+{b}={a + b}. {a + b}-{c}={a + b - c}.\n#### {a + b - c}",
        )
    if kind == 1:
        a, b, c = rng.randint(3, 12), rng.randint(2, 9), rng.randint(1, 11)
        return (
            f"A box holds {a} {item}. {name} fills {b} boxes and has {c} {item} left over. "
            f"How many {item} are there in total?",
            f"{a}*{b}={a * b}. {a * b}+{c}={a * b + c}.\n#### {a * b + c}",
        )
    if kind == 2:
        a, b, c = rng.randint(8, 25), rng.randint(2, 8), rng.randint(2, 6)
        return (
            f"{name} earns ${a} an hour and works {b} hours a day for {c} days. How many dollars does {name} earn?",
            f"{a}*{b}={a * b}. {a * b}*{c}={a * b * c}.\n#### {a * b * c}",
        )
    if kind == 3:
        a, c = rng.randint(5, 30), rng.randint(2, 9)
        b = a * c + rng.randint(1, 60)
        return (
            f"A book has {b} pages. {name} reads {a} pages a day for {c} days. How many pages are left?",
            f"{a}*{c}={a * c}. {b}-{a * c}={b - a * c}.\n#### {b - a * c}",
        )
    if kind == 4:
        a, b = rng.randint(2, 15), rng.randint(2, 9)
        return (
            f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?",
            f"{a * b}/{b}={a}.\n#### {a}",
        )
    if kind == 5:
        price, off = 20 * rng.randint(1, 15), rng.choice([10, 20, 25, 50])
        sale = price * (100 - off) // 100
        return (
            f"A jacket costs ${price}. It is on sale for {off}% off. What is the sale price in dollars?",
            f"{price}*{off}/100={price * off // 100}. {price}-{price * off // 100}={sale}.\n#### {sale}",
        )
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 5)
    return (
        f"{name} has {a} {item} and a friend has {b}. Each of them then gets {c} times as many as they had. "
        f"How many {item} do they have together now?",
        f"{a}+{b}={a + b}. {a + b}*{c}={(a + b) * c}.\n#### {(a + b) * c}",
    )


def _one_step(rng: random.Random) -> tuple[str, str]:
    """One operation on numbers below 10: `a+b` (gets more) or `a-b` (gives away, a > b)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"{name} has {a} {item}, gets {b} more. How many now?", f"{a}+{b}={a + b}\n#### {a + b}"
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    return f"{name} has {a} {item}, gives {b} away. How many now?", f"{a}-{b}={a - b}\n#### {a - b}"


def generate(n_train: int = 400, n_eval: int = 100, seed: int = 1234, problem=_problem, n_demo: int = 0) -> list[dict]:
    """`n_train` + `n_demo` + `n_eval` distinct problems, split in that order."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n_train + n_demo + n_eval:
        q, a = problem(rng)
        if q in seen:
            continue
        seen.add(q)
        split = "train" if len(rows) < n_train else "demo" if len(rows) < n_train + n_demo else "eval"
        rows.append({"question": q, "answer": a, "split": split})
    return rows


FILES = {
    "math_word_problems.jsonl": lambda: generate(),
    "math_one_step.jsonl": lambda: generate(n_train=1500, n_demo=1500, n_eval=200, seed=4321, problem=_one_step),
}


def main() -> None:
    for name, rows in FILES.items():
        out = Path(__file__).with_name(name)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
