"""Reading a final answer out of the assistant's text: `\\boxed{...}` or `<answer>...</answer>`.

Only the prose counts: code blocks and tool calls are removed first, so `print("\\\\boxed{1}")`
inside a code block is not mistaken for an answer; so is reasoning (`<think>...</think>`), where a
reasoning model tries candidate answers before it checks them with a tool. The last answer wins,
as in MATH-style graders.
"""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(position, content) of every `\\boxed{...}` with balanced braces; unclosed ones are skipped.

    One pass with a brace stack, so adversarial text (thousands of unclosed boxes) stays linear.
    """
    box_at = {m.end() - 1: m.start() for m in _BOXED.finditer(text)}
    if not box_at:
        return []
    stack: list[tuple[int, int | None]] = []
    found: list[tuple[int, str]] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append((i, box_at.get(i)))
        elif ch == "}" and stack:
            open_at, box_start = stack.pop()
            if box_start is not None:
                found.append((box_start, text[open_at + 1 : i]))
    found.sort()
    return found


def find_boxed(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` with balanced braces; an unclosed one is ignored."""
    return [content for _, content in _boxed_spans(text)]


def strip_reasoning(text: str) -> str:
    """`text` without its reasoning: every `<think>...</think>` block, an unclosed `<think>` to the
    end (still thinking), and everything before a `</think>` whose `<think>` was in the prompt
    (templates that open the block in the generation prompt, as DeepSeek-R1's and Qwen3's can)."""
    close = text.rfind("</think>")
    if close >= 0 and "<think>" not in text[:close]:
        text = text[close + len("</think>") :]
    return _THINK.sub("", text)


def extract_final_answer(prose: str) -> str | None:
    """The last boxed or tagged answer in `prose` outside reasoning blocks, stripped; None when
    there is none."""
    prose = strip_reasoning(prose)
    candidates = [(m.start(), m.group(1)) for m in _ANSWER_TAG.finditer(prose)]
    candidates += _boxed_spans(prose)
    if not candidates:
        return None
    return max(candidates, key=lambda c: c[0])[1].strip()


def answer_from_solution(solution: str) -> str:
    """A dataset answer field may hold a whole worked solution (MATH): keep its boxed part."""
    boxed = find_boxed(solution)
    return boxed[-1].strip() if boxed else solution.strip()
