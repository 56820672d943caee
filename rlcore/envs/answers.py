"""Final-answer extraction and equivalence for math-style rewards.

`extract_final` finds the answer a completion commits to, in priority order: the last
`\\boxed{...}`, the last `<answer>...</answer>`, the text after the last `####`, else the whole
text. `equivalent` compares it with the gold answer: first exactly as numbers (fractions,
decimals, percents, thousands separators, `$`), then with `math-verify` (symbolic equivalence,
LaTeX) when it is installed. math-verify's own signal-based timeouts are disabled (they only
work in the main thread); callers run rewards under :mod:`rlcore.isolation.safety` deadlines.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

# math-verify warns on every call that its (signal-based) timeouts are off: we own the deadline
logging.getLogger("math_verify").setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_final(text: str) -> str:
    """The span of `text` holding the final answer (see the module docstring)."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    tags = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tags:
        return tags[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


def to_number(text: str) -> Fraction | None:
    """The last number in `text` as an exact fraction (`1,000`, `2.5`, `3/4`, `50%` = 1/2), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        value = Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None
    tail = text[text.rfind(found[-1]) + len(found[-1]) :].lstrip()
    return value / 100 if tail.startswith("%") else value


def gold_of(answer: str) -> str:
    """The gold value of a GSM8K-style answer (`working ... #### 42` -> `42`)."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def equivalent(prediction: str, gold: str) -> bool:
    """Whether the final answer of `prediction` equals `gold` (numerically or symbolically)."""
    final = extract_final(prediction)
    p, g = to_number(final), to_number(gold)
    if g is not None and "\\" not in final:
        return p == g  # plain text against a numeric gold: the exact numeric check decides
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(final if "$" in final or "\\" in final else f"${final}$", parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))
