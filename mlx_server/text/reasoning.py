"""Reasoning split: `<think>...</think>` (or the model's own markers) out of the content (feed/finish).

DeepSeek style, as llama.cpp's `--reasoning-format deepseek`: one reasoning block; text
before its opening tag stays content, text after its closing tag is content. The block's
surrounding whitespace is dropped (templates write `<think>\\n...\\n</think>\\n\\n`).
"""

from __future__ import annotations

_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Feed generated text; get back `(content, reasoning)` that can no longer change.

    `inside`: the prompt already opened the block (the template ended with `<think>`), so the
    output starts as reasoning. A tag cut across feeds is held until it is whole, never leaked.
    """

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end = start, end
        self._state = _INSIDE if inside else _BEFORE
        self._held = ""  # a possible partial tag
        self._skip_space = inside  # drop the whitespace that opens a section
        self._space = ""  # reasoning's trailing whitespace, kept only if more reasoning follows

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        content: list[str] = []
        reasoning: list[str] = []
        while buf:
            if self._state == _AFTER:
                content.append(self._open_section(buf))
                break
            tag = self.start if self._state == _BEFORE else self.end
            i = buf.find(tag)
            if i < 0:
                keep = partial_suffix(buf, tag)
                buf, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
            piece = buf if i < 0 else buf[:i]
            if self._state == _BEFORE:
                content.append(piece)
            else:
                reasoning.append(self._reasoning(piece))
            if i < 0:
                break
            buf = buf[i + len(tag) :]
            self._state = _INSIDE if self._state == _BEFORE else _AFTER
            self._skip_space, self._space = True, ""
        return "".join(content), "".join(reasoning)

    def finish(self) -> tuple[str, str]:
        """The end of the output: a held partial tag is plain text of the section it is in."""
        held, self._held = self._held, ""
        if self._state == _INSIDE:
            reasoning, self._space = self._reasoning(held), ""
            return "", reasoning
        return held, ""

    def _open_section(self, text: str) -> str:
        if self._skip_space:
            text = text.lstrip()
            self._skip_space = not text
        return text

    def _reasoning(self, piece: str) -> str:
        text = self._space + self._open_section(piece)
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept
