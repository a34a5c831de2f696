"""Preference pairs (DPO): TRL's preference format -> two encoded samples per pair, labels on the completions.

Format (TRL's "preference" type, explicit prompt), one row per pair, conversational or plain:

* conversational: ``{"prompt": [{"role", "content"}, ...], "chosen": [{"role": "assistant", "content"}],
  "rejected": [{"role": "assistant", "content"}]}``; the prompt may hold earlier turns (system, user,
  assistant, tool) and ends with a turn that is not the assistant's;
* plain: ``{"prompt": str, "chosen": str, "rejected": str}``; varpack renders plain rows through the chat
  template too, as a user turn and an assistant turn (as it does for TRL prompt-completion rows in
  :mod:`varpack.data.formats`; TRL itself concatenates plain strings without a template and appends EOS).

Encoding (:func:`encode_pair`), as TRL's ``DPOTrainer`` tokenizes a conversational pair: the prompt rendered
with ``add_generation_prompt=True``, and ``prompt + chosen`` / ``prompt + rejected`` rendered whole; the
completion is every token after the prompt (for ChatML: the reply, ``<|im_end|>`` and the newline after it).
Each of chosen and rejected becomes one sample holding the full prompt: ``labels`` are ``-100`` on the prompt
tokens and equal ``input_ids`` on the completion tokens (``labels[0] == -100``, the encoded-sample contract of
docs/ARCHITECTURE.md). Pair ``k`` becomes samples ``2k`` (chosen) and ``2k + 1`` (rejected); the planner
keeps them in one pack (:func:`varpack.plan.plan_packs` ``groups``, :func:`pair_groups`).

Refused, naming the pair (its row index; ``FILE:LINE`` for files) and the field: a missing ``prompt`` (TRL's
implicit-prompt rows: split the shared prefix into ``prompt`` first), ``chosen`` / ``rejected`` missing or
empty, a plain prompt with conversational answers or the reverse, a message that is not ``{role, content}``
strings, answers with a non-assistant turn, a prompt ending with an assistant turn, and a chat template whose
rendered prompt is not a prefix of the rendered pair (the completion could not be located).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from varpack.schema import IGNORE_INDEX

__all__ = ["PREFERENCE_FIELDS", "builtin_pairs", "encode_pair", "encode_pairs", "load_pairs", "pair_groups"]

#: The fields of a preference row.
PREFERENCE_FIELDS: tuple[str, str, str] = ("prompt", "chosen", "rejected")
_ROLES = ("system", "user", "assistant", "tool")
_BUILTIN_ANSWER_CHARS = 1200  # answers of the built-in pairs stay short (a few hundred tokens)


def _messages(value: Any, field: str, where: str) -> list[dict[str, Any]]:
    """A list of ``{role, content}`` messages, checked (errors name ``field[i].key``)."""
    if len(value) == 0:
        raise ValueError(f"{where}: field {field!r} is an empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise TypeError(f"{where}: {field}[{i}] must be a dict {{role, content}}, got {type(m).__name__}")
        if m.get("tool_calls") is not None:  # checked as an SFT turn's; a turn that only calls tools: content ""
            from varpack.data.chat import _check_tool_calls

            _check_tool_calls(m, f"{where}: {field}[{i}]")
            m = {**m, "content": "" if m.get("content") is None else m["content"]}
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "is missing or null" if m.get(key) is None else f"must be a str, got a {type(m.get(key)).__name__}"
                raise TypeError(f"{where}: {field}[{i}].{key} {got}")
        if m["role"] not in _ROLES:
            raise ValueError(f"{where}: {field}[{i}].role={m['role']!r} is not one of {_ROLES}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def pair_messages(
    row: Any, pair_id: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(prompt, chosen, rejected)`` messages of one preference row, checked.

    Args:
        row: ``{"prompt", "chosen", "rejected"}``, all strings (plain) or all message lists (conversational).
        pair_id: named in errors (``pair 12: ...``).

    Returns:
        Three message lists; plain strings become ``[{"role": "user", ...}]`` and ``[{"role": "assistant",
        ...}]``.

    Raises:
        TypeError / ValueError: see the module docstring (the pair and field are named).
    """
    where = f"pair {pair_id}" if pair_id is not None else "pair"
    if not isinstance(row, Mapping):
        raise TypeError(
            f"{where}: a preference row must be a dict with {PREFERENCE_FIELDS}, got {type(row).__name__}"
        )
    if row.get("prompt") is None:
        if row.get("chosen") is not None:
            raise ValueError(
                f"{where}: field 'prompt' is missing; varpack needs an explicit prompt (TRL's implicit-prompt rows "
                f"hold it inside 'chosen'/'rejected': move the shared turns to 'prompt')"
            )
        raise ValueError(f"{where}: not a preference row (fields {PREFERENCE_FIELDS}; keys: {sorted(row)})")
    values = {}
    for field in PREFERENCE_FIELDS:
        value = row.get(field)
        if value is None:
            raise ValueError(f"{where}: field {field!r} is missing")
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(f"{where}: field {field!r} is empty")
        elif not isinstance(value, Sequence) or isinstance(value, bytes):
            raise TypeError(
                f"{where}: field {field!r} must be a str or a list of {{role, content}} messages, got "
                f"{type(value).__name__}"
            )
        values[field] = value
    plain = [f for f in PREFERENCE_FIELDS if isinstance(values[f], str)]
    if plain and len(plain) != 3:
        other = next(f for f in PREFERENCE_FIELDS if f not in plain)
        raise TypeError(
            f"{where}: field {plain[0]!r} is a str but field {other!r} is a list of messages; a pair is all plain "
            f"strings or all conversational"
        )
    if plain:
        return (
            [{"role": "user", "content": values["prompt"]}],
            [{"role": "assistant", "content": values["chosen"]}],
            [{"role": "assistant", "content": values["rejected"]}],
        )
    prompt = _messages(values["prompt"], "prompt", where)
    if prompt[-1]["role"] == "assistant":
        raise ValueError(
            f"{where}: prompt[{len(prompt) - 1}] is an assistant turn; the prompt must end with the turn the "
            f"answers reply to"
        )
    answers = []
    for field in ("chosen", "rejected"):
        msgs = _messages(values[field], field, where)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                raise ValueError(
                    f"{where}: {field}[{i}].role={m['role']!r}; an answer holds assistant turns only"
                )
        if not any(m["content"].strip() or m.get("tool_calls") for m in msgs):
            raise ValueError(f"{where}: field {field!r} is empty (no assistant content or tool call)")
        answers.append(msgs)
    return prompt, answers[0], answers[1]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _render(row: Any, tokenizer: Any, where: str, pair_id: Any) -> list[str]:
    """The three texts of a pair: prompt (with the generation prompt), prompt + chosen, prompt + rejected.

    Raises:
        ValueError: a template failure, or an answer field the template does not render
            (``pair 3: chosen[0].tool_calls is set, but the chat template ... does not render tool_calls``).
    """
    prompt, chosen, rejected = pair_messages(row, pair_id)
    from varpack.data.chat import unrendered_answer_field, unrendered_message

    for field, msgs in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        found = unrendered_answer_field(msgs, tokenizer)
        if found is not None:
            raise ValueError(f"{where}: {unrendered_message(tokenizer, f'{field}[{found[0]}]', found[1])}")
    try:
        return [
            tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
            tokenizer.apply_chat_template(prompt + chosen, tokenize=False),
            tokenizer.apply_chat_template(prompt + rejected, tokenize=False),
        ]
    except Exception as exc:
        raise ValueError(f"{where}: chat template failed: {exc}") from exc


def _samples(prompt_ids: list[int], full: list[list[int]], where: str) -> list[dict[str, Any]]:
    out = []
    for field, ids in zip(("chosen", "rejected"), full):
        ids = list(ids)
        n = _common_prefix(prompt_ids, ids)
        if n < len(prompt_ids) or n >= len(ids):
            raise ValueError(
                f"{where}: the rendered prompt is not a prefix of the rendered prompt + {field} "
                f"({n} of {len(prompt_ids)} prompt tokens shared, {len(ids)} tokens in all), so the {field} "
                f"completion cannot be located; use a chat template that renders the prompt the same way in both"
            )
        labels = [IGNORE_INDEX] * n + ids[n:]
        labels[0] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels, "length": len(ids)})
    return out


def encode_pair(row: Any, tokenizer: Any, *, pair_id: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Encode one preference row into its chosen and rejected samples.

    Args:
        row: a preference row (module docstring).
        tokenizer: a Hugging Face tokenizer with a chat template.
        pair_id: named in errors.

    Returns:
        ``(chosen, rejected)``, each ``{"input_ids": list[int] (L,), "labels": list[int] (L,), "length": L}``
        with the full prompt and labels on the completion tokens only (``labels[0] == -100``).

    Raises:
        TypeError / ValueError: a bad row (pair and field named) or a template whose rendered prompt is not a
            prefix of the rendered pair.
    """
    where = f"pair {pair_id}" if pair_id is not None else "pair"
    ids = tokenizer(_render(row, tokenizer, where, pair_id), add_special_tokens=False)["input_ids"]
    chosen, rejected = _samples(ids[0], ids[1:], where)
    return chosen, rejected


def encode_pairs(rows: Any, tokenizer: Any, *, batch_size: int = 256) -> list[dict[str, Any]]:
    """Encode preference rows: pair ``k`` -> samples ``2k`` (chosen), ``2k + 1`` (rejected).

    Args:
        rows: an iterable of preference rows (a list of dicts, a ``datasets.Dataset``, or what
            :func:`load_pairs` returns).
        tokenizer: a Hugging Face tokenizer with a chat template.
        batch_size: pairs tokenized in one call.

    Returns:
        ``list[dict]`` of ``2 * num_pairs`` encoded samples (:func:`encode_pair`).

    Raises:
        TypeError / ValueError: a bad row, naming the pair (row index), the field and, for rows read from
            files by :func:`load_pairs`, ``FILE:LINE``; no rows.
    """
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        first = len(out) // 2
        for j in range(0, len(ids), 3):
            k = first + j // 3
            try:
                out.extend(_samples(ids[j], ids[j + 1 : j + 3], f"pair {k}"))
            except ValueError as exc:
                raise ValueError(f"{_location(rows, k)}{exc}") from exc
        texts.clear()

    for k, row in enumerate(rows):
        try:
            texts.extend(_render(row, tokenizer, f"pair {k}", k))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{_location(rows, k)}{exc}") from exc
        if len(texts) >= 3 * batch_size:
            flush()
    flush()
    if not out:
        raise ValueError("preference data has no rows")
    return out


def _location(rows: Any, k: int) -> str:
    sources = getattr(rows, "_varpack_files", None)
    if not sources:
        return ""
    from varpack.data.chat import locate_row

    where = locate_row(*sources[:2], k, *sources[2:])
    return f"{where}: " if where else ""


def pair_groups(num_samples: int) -> np.ndarray:
    """``[num_samples]`` int64 group ids of :func:`encode_pairs`' samples (``0, 0, 1, 1, ...``): the ``groups``
    argument of :func:`varpack.plan.plan_packs` that keeps every pair in one pack.

    Raises:
        ValueError: an odd ``num_samples``.
    """
    if num_samples % 2:
        raise ValueError(f"preference samples come in pairs, got an odd count {num_samples}")
    return np.arange(num_samples, dtype=np.int64) // 2


def load_pairs(data: str | os.PathLike[str] | Sequence[Any] | None) -> Any:
    """Preference rows from JSON / JSONL / parquet files (:func:`varpack.data.chat.load_chat_data` reads them;
    rows are checked as they are encoded), an in-memory list of rows, or the built-in pairs (``None`` / empty).

    Returns:
        A ``datasets.Dataset`` (files) or a list of dicts.

    Raises:
        FileNotFoundError / ValueError: as :func:`varpack.data.chat.load_chat_data` for files.
    """
    if data is None or (not isinstance(data, (str, os.PathLike)) and len(data) == 0):
        return builtin_pairs()
    paths = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if all(isinstance(p, Mapping) for p in paths):
        return paths
    from varpack.data.chat import load_chat_data

    return load_chat_data(paths)


def _short(text: str) -> str:
    """``text`` cut at a paragraph boundary to at most ``_BUILTIN_ANSWER_CHARS`` characters (one paragraph,
    cut at a line, at least)."""
    parts, size = [], 0
    for para in text.split("\n\n"):
        if parts and size + len(para) > _BUILTIN_ANSWER_CHARS:
            break
        parts.append(para[:_BUILTIN_ANSWER_CHARS])
        size += len(para) + 2
    return "\n\n".join(parts)


def builtin_pairs() -> list[dict[str, Any]]:
    """A small built-in preference set derived from the built-in chats (:func:`varpack.data.builtin.builtin_chats`),
    for offline demos and tests: for every *overview* chat (one per ``pydoc`` topic, ~80), the prompt is the
    chat up to its answer (with its system message, if any), ``chosen`` its own answer and ``rejected`` the
    answer of the next topic's overview (an answer about something else); answers cut at a paragraph boundary
    to at most 1,200 characters. Conversational rows, deterministic.

    Returns:
        ``[{"prompt": [...], "chosen": [{"role": "assistant", ...}], "rejected": [...], "source": str}, ...]``
    """
    from varpack.data.builtin import builtin_chats

    overviews = [c for c in builtin_chats() if c["source"].endswith(":overview")]
    pairs = []
    for i, chat in enumerate(overviews):
        other = overviews[(i + 1) % len(overviews)]
        pairs.append(
            {
                "prompt": chat["messages"][:-1],
                "chosen": [{"role": "assistant", "content": _short(chat["messages"][-1]["content"])}],
                "rejected": [{"role": "assistant", "content": _short(other["messages"][-1]["content"])}],
                "source": chat["source"],
            }
        )
    return pairs
