"""How a math answer is found in a text and written canonically (docs/algorithm.md §7).

Shared by the data sources (GSM8K's and the tasks' gold answers are stored normalised) and the
reward (rl/rewards.py), so neither imports the other.

``extract_answer`` looks for the final answer in this order, the first rule that applies wins:
  1. the content of the LAST ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` works);
  2. else the text after the LAST explicit answer marker: "answer is", "answer:" or GSM8K's
     "####", up to the end of that sentence;
  3. else the LAST number in the text.

``normalize_answer`` turns an answer into a canonical string so that equal numbers compare equal
however they are written: "$1,200.00", "1200 dollars", "1200." and "\\text{1200}" all become
"1200"; fractions ("3/4", "\\frac{3}{4}") and decimals ("0.75") become the same exact rational,
printed as a decimal when it terminates ("0.75") and as "p/q" otherwise ("1/3"). Scientific
notation is not recognised. Answers without any number fall back to lower-cased,
whitespace-collapsed text.
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number as people write it: optional sign, digits with or without thousands separators,
# optional decimals ("1,234.5", "-3", ".5"), optionally followed by "/denominator".
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(rf"(?<![\w.])(-?)({_UNSIGNED})(?:\s*/\s*({_UNSIGNED}))?")

# "The answer is 18", "Final answer: 18", "#### 18"; the last one in a text counts.
_ANSWER_MARKER = re.compile(r"answer\s+is\s*:?|answer\s*:|####", re.IGNORECASE)
# A sentence ends at a period/!/? followed by whitespace or the end (not a decimal point).
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")

# LaTeX that wraps or decorates a number without changing it.
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\\%|\\\$|\$|%|~")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-"})


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), matching nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    while start >= 0:
        open_brace = text.index("{", start)
        depth = 0
        for i in range(open_brace, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[open_brace + 1:i]
        # Unclosed (e.g. a completion cut off at max length): try an earlier box.
        start = max(text.rfind("\\boxed{", 0, start), text.rfind("\\fbox{", 0, start))
    return None


def after_last_marker(text: str) -> str | None:
    """The sentence after the last "answer is" / "answer:" / "####", or None."""
    markers = list(_ANSWER_MARKER.finditer(text))
    if not markers:
        return None
    rest = text[markers[-1].end():].lstrip()
    end = _SENTENCE_END.search(rest)
    sentence = rest[:end.start()] if end else rest
    return sentence.strip() or None


def extract_answer(text: str) -> str | None:
    """The final answer stated in ``text`` (un-normalised), or None if it states none.

    Order: last ``\\boxed{}``; else the sentence after the last "answer is"/"answer:"/"####";
    else the last number.
    """
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    stated = after_last_marker(text)
    if stated is not None:
        return stated
    numbers = list(_NUMBER.finditer(text.translate(_MINUS_SIGNS)))
    return numbers[-1].group(0).strip() if numbers else None


def _to_fraction(sign: str, numerator: str, denominator: str | None) -> Fraction | None:
    value = Fraction(numerator.replace(",", ""))
    if denominator is not None:
        den = Fraction(denominator.replace(",", ""))
        if den == 0:
            return None
        value /= den
    return -value if sign else value


def _format_number(value: Fraction) -> str:
    """Canonical text of an exact rational: "12", "-0.75", or "1/3" when the decimal never ends."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:  # not a terminating decimal
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    whole, frac = divmod(abs(value.numerator) * 10**digits // value.denominator, 10**digits)
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{frac:0{digits}d}"


def normalize_answer(s: str | None) -> str | None:
    """Canonical form of an answer, so that equal answers compare equal as strings.

    If the answer contains a number, the result is that number as an exact rational (see
    ``_format_number``): thousands commas, "$", "%", units and LaTeX decoration are dropped, and
    "3/4", "\\frac{3}{4}", "0.75" all give "0.75". When the answer is an equation ("x = 5") the
    value after the last "=" counts; otherwise the first number does ("18 dollars a day" → "18").
    Without any number: lower-cased text with collapsed whitespace. Empty → None.
    """
    if s is None:
        return None
    text = s.translate(_MINUS_SIGNS)
    text = _LATEX_TEXT.sub(r" \1 ", text)
    text = _LATEX_FRAC.sub(r"(\1)/(\2)", text)
    text = _LATEX_NOISE.sub(" ", text)
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    # Parentheses around a lone number or fraction part ("(3)/(4)") carry no meaning here.
    text = re.sub(r"\(\s*(-?[\d.,]+)\s*\)", r"\1", text)
    match = _NUMBER.search(text)
    if match is not None:
        value = _to_fraction(*match.groups())
        if value is not None:
            return _format_number(value)
    words = " ".join(text.lower().split()).strip(" .")
    return words or None
