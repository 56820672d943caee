"""tool_use: answer questions about fictional places with a search tool and a calculator.

The facts (populations and founding years of made-up towns) exist only in a local corpus, so
the policy must search; questions combine two facts, so it must also compute. Tools, called in
the :mod:`rlcore.envs.tools` format:

    <tool>search: QUERY</tool>   the top `search_k` corpus documents by word overlap with QUERY
    <tool>calc: EXPRESSION</tool> exact arithmetic (+ - * / // % ** and parentheses)

Reward: 1 when `<answer>` is numerically equal to the gold value, else 0.

`facts` sets the difficulty: 2 (default) asks for a sum or difference of two towns' facts
(search, search, calc, answer); 1 asks for one town's fact (search, answer), which the tiny CPU
policy of the `tool_use` recipe can learn.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from rlcore.envs.answers import to_number
from rlcore.envs.base import Message, register, rng_for
from rlcore.envs.tools import ToolEnvironment, last_answer
from rlcore.types import Task

_SYLLABLES = ["ka", "lo", "mir", "ven", "dor", "sa", "tu", "bel", "rin", "gar", "zo", "phi", "nel", "ost", "ur"]
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (no names, no calls; bounded powers)."""

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("power too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    value = ev(ast.parse(expression.replace("^", "**"), mode="eval"))
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def build_corpus(n_towns: int = 40, seed: int = 7) -> list[dict[str, Any]]:
    """Made-up towns with a population and a founding year (fixed, independent of env.seed)."""
    rng, names, docs = random.Random(seed), set(), []
    while len(docs) < n_towns:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize()
        if name in names:
            continue
        names.add(name)
        pop, year = rng.randint(200, 9000), rng.randint(1200, 1950)
        docs.append(
            {
                "title": name,
                "text": f"{name}: town, population {pop}, founded {year}.",
                "population": pop,
                "founded": year,
            }
        )
    return docs


def search(corpus: list[dict[str, Any]], query: str, k: int) -> str:
    """The `k` documents sharing the most words with `query` (ties: corpus order)."""
    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    scored = [
        (len(words & set(re.findall(r"[a-z0-9]+", (d["title"] + " " + d["text"]).lower()))), -i, d)
        for i, d in enumerate(corpus)
    ]
    hits = [d for s, _, d in sorted(scored, key=lambda x: (x[0], x[1]), reverse=True) if s > 0][:k]
    return " | ".join(d["text"] for d in hits) or "no results"


@register("tool_use")
class ToolUse(ToolEnvironment):
    """Args: `corpus_path` (JSONL of {"title", "text", "population", "founded"}; default a
    built-in generated corpus), `search_k` (results per search), `facts` (1 or 2 per question),
    `instruction` (the text before every question; default the tools' syntax), plus the tool
    settings."""

    PROMPT = "Tools: <tool>search: words</tool> <tool>calc: 1+2</tool>. Finish with <answer>number</answer>.\n"

    def __init__(
        self,
        seed: int = 0,
        corpus_path: str = "",
        search_k: int = 1,
        max_turns: int = 4,
        facts: int = 2,
        instruction: str = PROMPT,
        **kwargs,
    ):
        super().__init__(seed, max_turns=max_turns, **kwargs)
        if facts not in (1, 2):
            raise ValueError(f"env.args.facts: must be 1 or 2, got {facts}")
        self.facts, self.instruction = facts, instruction
        if corpus_path:
            path = Path(corpus_path).expanduser()
            if not path.is_file():
                raise ValueError(f"env.args.corpus_path: no such file {corpus_path!r}")
            self.corpus = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            self.corpus = build_corpus()
        if len(self.corpus) < 2:
            raise ValueError("env.args.corpus_path: needs at least 2 documents")
        if search_k < 1:
            raise ValueError(f"env.args.search_k: must be >= 1, got {search_k}")
        self.search_k = search_k
        self.tools = {
            "search": lambda q, state: search(self.corpus, q, self.search_k),
            "calc": lambda e, state: calculate(e),
        }

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        a, b = rng.sample(self.corpus, 2)
        if self.facts == 1:
            fact = rng.choice(["population", "founded"])
            question = f"{'Population' if fact == 'population' else 'Founding year'} of {a['title']}?"
            gold, towns = a[fact], [a["title"]]
        else:
            fact = "population" if rng.random() < 0.5 else "founded"
            if fact == "population":
                question, gold = (
                    f"Total population of {a['title']} and {b['title']}?",
                    a["population"] + b["population"],
                )
            else:
                question, gold = (
                    f"Years between the founding of {a['title']} and {b['title']}?",
                    abs(a["founded"] - b["founded"]),
                )
            towns = [a["title"], b["title"]]
        return Task(
            id=f"tool_use/{split}/{index}",
            messages=[{"role": "user", "content": self.instruction + question}],
            answer=str(gold),
            info={"towns": towns, "fact": fact},
        )

    def demonstration_turns(self, task: Task) -> list[str]:
        """Search each town, compute with the calculator (two facts), answer: one tool call per turn."""
        if len(task.info["towns"]) == 1:
            return [f"<tool>search: {task.info['towns'][0]}</tool>", f"<answer>{task.answer}</answer>"]
        a, b = ({d["title"]: d for d in self.corpus}[t] for t in task.info["towns"])
        if task.info["fact"] == "population":
            expr = f"{a['population']}+{b['population']}"
        else:
            expr = f"{max(a['founded'], b['founded'])}-{min(a['founded'], b['founded'])}"
        return [
            f"<tool>search: {a['title']}</tool>",
            f"<tool>search: {b['title']}</tool>",
            f"<tool>calc: {expr}</tool>",
            f"<answer>{task.answer}</answer>",
        ]

    def score(self, task: Task, history: list[Message], state: dict[str, Any]) -> float:
        answer = last_answer(history)
        value = to_number(answer) if answer is not None else None
        return 1.0 if value is not None and value == to_number(task.answer) else 0.0
