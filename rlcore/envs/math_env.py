"""math: GSM8K-style word problems; reward 1 when the final answer equals the gold answer.

The dataset is a JSONL file of {"question", "answer", "split"} rows (GSM8K's own format works:
the gold value follows `####`; rows without `split` are train). The default is the generated
file shipped in `rlcore/data/` (see :mod:`rlcore.data.make_math`). The train split is visited in
a fresh seeded permutation each epoch (so is a "demo" split, when the file has one); the eval
split in file order. `path` may also name a shipped file: `math_one_step.jsonl` holds one-step
problems on numbers below 10 (what the tiny CPU policy of the `math` recipe can learn).

Demonstrations (supervised warm-up, `sft.dataset=env`) are the rows' worked answers
(`7+4=11\n#### 11`), which the reward scores 1.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlcore.data import data_path
from rlcore.envs.answers import equivalent, gold_of
from rlcore.envs.base import Environment, register, rng_for
from rlcore.types import Task

DEFAULT_INSTRUCTION = "Solve. End with '#### <number>'.\n"


def load_rows(path: str | Path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"env.args.path: line {n} of {path} needs 'question' and 'answer'")
            rows.append(row)
    return rows


@register("math")
class MathWordProblems(Environment):
    """Args: `path` (JSONL, or a shipped file's name; default `math_word_problems.jsonl`),
    `instruction` (prefix of every question)."""

    reward_imports = ("math_verify",)  # `equivalent` imports it for symbolic answers

    def __init__(self, seed: int = 0, path: str = "", instruction: str = DEFAULT_INSTRUCTION, **kwargs):
        super().__init__(seed, **kwargs)
        source = Path(path).expanduser() if path else data_path("math_word_problems.jsonl")
        if path and not source.is_file() and "/" not in path and data_path(path).is_file():
            source = data_path(path)
        if not source.is_file():
            raise ValueError(f"env.args.path: no such file {str(source)!r}")
        rows = load_rows(source)
        self.split_rows: dict[str, list[dict]] = {"train": [], "eval": []}
        for r in rows:
            self.split_rows.setdefault(r.get("split", "train"), []).append(r)
        if not self.split_rows["train"]:
            raise ValueError(f"env.args.path: {source} has no train rows")
        self.instruction = instruction
        self._eval_size = min(self._eval_size, len(self.split_rows["eval"])) or 0

    @property
    def eval_size(self) -> int:
        return self._eval_size

    def split_size(self, split: str) -> int | None:
        return len(self.split_rows.get(split, []))

    def _row(self, index: int, split: str) -> dict:
        rows = self.split_rows[split]
        if not rows:
            raise IndexError(f"math: the dataset has no {split!r} rows")
        if split == "eval":
            return rows[index % len(rows)]
        epoch, pos = divmod(index, len(rows))
        order = list(range(len(rows)))
        rng_for(self.seed, f"{split}-epoch", epoch).shuffle(order)
        return rows[order[pos]]

    def make_task(self, index: int, split: str) -> Task:
        row = self._row(index, split)
        return Task(
            id=f"math/{split}/{index}",
            messages=[{"role": "user", "content": self.instruction + row["question"]}],
            answer=gold_of(str(row["answer"])),
            info={"solution": str(row["answer"])},
        )

    def demonstration(self, task: Task) -> str:
        """The row's worked answer (GSM8K style, ending `#### N`)."""
        return task.info["solution"]

    def reward(self, task: Task, completion: str) -> float:
        return 1.0 if equivalent(completion, task.answer) else 0.0
