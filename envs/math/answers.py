"""Final-answer extraction and scoring for math tasks.

The model's answer is taken from its last `#### <answer>` line (GSM8K's format) or, failing that,
from its last `\\boxed{...}` (balanced braces, so `\\boxed{\\frac{1}{2}}` works). Answers are
compared exactly after a light normalisation (commas, dollar signs, spaces, a trailing period;
numbers compared as exact fractions, so `20`, `20.0` and `20.00` are equal), which is what the GSM8K
and chain-arithmetic golds need and what verl's and TRL's GSM8K rewards do.

math-verify (optional) compares symbolically. It times out with `signal.alarm`, which fails outside
a main thread, so it runs in a `ScorerPool` process with its own timeout; `math_verify_available()`
says whether it is installed.
"""

from __future__ import annotations

import importlib.util
import re
from fractions import Fraction

_HASH = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_hash_answer(text: str) -> str | None:
    """The text after the last `####` marker (GSM8K format), or None."""
    found = _HASH.findall(text)
    if not found:
        return None
    answer = found[-1].strip()
    return answer or None


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip() or None
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer: `####` first, then `\\boxed{}`; None if it gave neither."""
    answer = extract_hash_answer(text)
    return answer if answer is not None else extract_boxed_answer(text)


def normalize_answer(answer: str) -> str:
    """A canonical string for exact comparison: numbers as reduced fractions, else stripped text."""
    text = answer.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    if _NUMBER.fullmatch(text):
        value = Fraction(text)
        return str(value.numerator) if value.denominator == 1 else str(value)
    return text


def exact_match(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals `gold` after normalisation, else 0.0."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    return float(normalize_answer(answer) == normalize_answer(gold))


def math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def math_verify_match(completion: str, gold: str) -> float:
    """Symbolic equivalence with math-verify; run it in a `ScorerPool` (it uses signals).

    The boxed (or `####`) answer is verified when there is one, else the whole completion.
    """
    from math_verify import parse, verify

    answer = extract_answer(completion)
    target = parse(f"${gold}$" if not gold.startswith("$") else gold)
    predicted = parse(f"${answer}$" if answer is not None else completion)
    return float(bool(target) and bool(predicted) and verify(target, predicted))
