"""A small built-in chat dataset of real text that needs no download.

Source: Python's own language reference as shipped in every CPython installation,
``pydoc_data.topics.topics`` (79 documents, e.g. "The "with" statement", "Special method names"; 0.2 to
62 thousand characters each; the text is the CPython documentation, PSF license). Each document is cut
into paragraphs (blank-line separated; code blocks and grammar rules stay whole) and its section headings
are recognised (a line underlined with ``=`` or ``-``). From every document :func:`builtin_chats` makes:

* an *overview*: a question about the topic, answered with its first 1-4 paragraphs;
* up to two *detail* questions about a section (or a passage), answered with 1-12 consecutive paragraphs;
* a *two-turn* conversation: a question answered with a passage, then "go on"-style follow-up answered
  with the passage after it (both assistant turns are supervised);
* for one document in three, a *long* answer with most of the document.

About a quarter of the conversations start with a system message. Answers are capped at
:data:`MAX_ANSWER_CHARS` characters (cut at a paragraph boundary), so every conversation stays well under
4,096 tokens with the Qwen3 tokenizer, while lengths still spread over two orders of magnitude (tens to
~3,000 tokens), like real SFT data. The result is deterministic for a given Python version (the choices
come from ``random.Random`` seeded with the topic name; the topic texts differ slightly between Python
releases).
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["MAX_ANSWER_CHARS", "builtin_chats", "topic_paragraphs"]

#: Longest answer text (characters) in one assistant turn.
MAX_ANSWER_CHARS = 9000

_SYSTEM_PROMPTS = (
    "You are a helpful assistant who knows the Python language reference well.",
    "Answer questions about Python precisely, quoting the language reference where useful.",
    "You are a concise Python tutor.",
)
_OVERVIEW_QUESTIONS = (
    "What is {title} in Python?",
    "Can you explain {title}?",
    "Give me a short introduction to {title}.",
    "What does the Python language reference say about {title}?",
)
_SECTION_QUESTIONS = (
    'In the context of {title}, explain "{section}".',
    'How does "{section}" work ({title})?',
    'I am reading about {title}. What does the section "{section}" say?',
)
_PASSAGE_QUESTIONS = (
    "Tell me more about {title}: what are the details?",
    "What else should I know about {title}?",
    "Explain the finer points of {title}.",
)
_FOLLOW_UPS = ("Go on.", "Please continue.", "And what comes next?", "Can you tell me more?")
_LONG_QUESTIONS = (
    "Give me the full reference documentation for {title}.",
    "Write out everything the language reference says about {title}.",
)


def _is_underline(line: str, char: str) -> bool:
    s = line.strip()
    return len(s) >= 3 and set(s) == {char}


def topic_paragraphs(text: str) -> tuple[str, list[tuple[str | None, str]]]:
    """Split one ``pydoc_data`` topic into its title and ``(section heading or None, paragraph)`` pairs.

    Args:
        text: a value of ``pydoc_data.topics.topics``.

    Returns:
        ``(title, paragraphs)``; the title is the first line (underlined with ``*``); headings and
        underlines are not paragraphs themselves, each paragraph carries the heading it falls under.
    """
    blocks = [b.strip("\n") for b in text.strip("\n").split("\n\n")]
    blocks = [b for b in blocks if b.strip()]
    title = blocks[0].splitlines()[0].strip() if blocks else ""
    paragraphs: list[tuple[str | None, str]] = []
    section: str | None = None
    for n, block in enumerate(blocks):
        lines = block.splitlines()
        if n == 0 and len(lines) >= 2 and _is_underline(lines[1], "*"):
            lines = lines[2:]  # the title
        if len(lines) >= 2 and (_is_underline(lines[1], "=") or _is_underline(lines[1], "-")):
            section = lines[0].strip()
            lines = lines[2:]
        body = "\n".join(lines).strip("\n")
        if body.strip():
            paragraphs.append((section, body))
    return title, paragraphs


def _answer(paragraphs: list[tuple[str | None, str]], start: int, count: int) -> tuple[str, int]:
    """Join ``count`` paragraphs from ``start`` (at least one, at most MAX_ANSWER_CHARS characters);
    return the text and the index after the last paragraph used."""
    parts: list[str] = []
    size = 0
    stop = start
    for _, body in paragraphs[start : start + max(count, 1)]:
        if parts and size + len(body) + 2 > MAX_ANSWER_CHARS:
            break
        if not parts and len(body) > MAX_ANSWER_CHARS:
            body = body[:MAX_ANSWER_CHARS].rsplit("\n", 1)[0]
        parts.append(body)
        size += len(body) + 2
        stop += 1
    return "\n\n".join(parts), stop


def _topic_title(title: str, key: str) -> str:
    return title if title else f'the "{key}" topic'


def builtin_chats() -> list[dict[str, Any]]:
    """The built-in chat dataset: a few hundred conversations made from ``pydoc_data.topics`` (see the
    module docstring for how).

    Returns:
        list of ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...],
        "source": "pydoc:<topic>:<kind>"}``, in a fixed order (topic order of ``pydoc_data``, then
        overview, details, two-turn, long). Every conversation has at least one assistant turn.
    """
    from pydoc_data.topics import topics

    chats: list[dict[str, Any]] = []
    for key, text in topics.items():
        rng = random.Random(f"varpack-builtin:{key}")
        title, paragraphs = topic_paragraphs(text)
        if not paragraphs:
            continue
        title = _topic_title(title, key)
        n = len(paragraphs)

        def chat(kind: str, turns: list[tuple[str, str]], rng: random.Random = rng, key: str = key) -> None:
            messages: list[dict[str, str]] = []
            if rng.random() < 0.25:
                messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
            for question, answer in turns:
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": answer})
            chats.append({"messages": messages, "source": f"pydoc:{key}:{kind}"})

        # overview
        answer, _ = _answer(paragraphs, 0, rng.randint(1, 4))
        chat("overview", [(rng.choice(_OVERVIEW_QUESTIONS).format(title=title), answer)])

        # details: a section (when the topic has headings) or a passage
        for _ in range(2 if n >= 4 else 1):
            start = rng.randrange(n)
            section = paragraphs[start][0]
            if section is not None:
                while start > 0 and paragraphs[start - 1][0] == section:
                    start -= 1
                question = rng.choice(_SECTION_QUESTIONS).format(title=title, section=section)
            else:
                question = rng.choice(_PASSAGE_QUESTIONS).format(title=title)
            answer, _ = _answer(paragraphs, start, int(rng.choice((1, 2, 3, 4, 6, 8, 12))))
            chat("detail", [(question, answer)])

        # two turns: a passage, then the passage after it
        if n >= 2:
            start = rng.randrange(max(n - 1, 1))
            first, after = _answer(paragraphs, start, rng.randint(1, 3))
            if after < n:
                second, _ = _answer(paragraphs, after, rng.randint(1, 5))
                q1 = rng.choice(_OVERVIEW_QUESTIONS + _PASSAGE_QUESTIONS).format(title=title)
                chat("two-turn", [(q1, first), (rng.choice(_FOLLOW_UPS), second)])

        # long: most of the document
        if rng.random() < 1 / 3 and n >= 3:
            answer, _ = _answer(paragraphs, 0, n)
            chat("long", [(rng.choice(_LONG_QUESTIONS).format(title=title), answer)])
    return chats
