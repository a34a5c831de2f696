"""Chat data formats: detect a row's format and convert it to ``messages`` (``[{"role", "content"}, ...]``).

Every row is detected on its own (files and rows of different formats mix freely), from the fields it has
(a field whose value is ``None`` counts as absent: Arrow fills the columns of other rows' formats with
``None``):

==================== ========================================================== ===========================
format               fields                                                     becomes
==================== ========================================================== ===========================
``messages``         ``messages``: ``[{"role", "content"}, ...]`` (OpenAI, TRL   as is
                     conversational language modeling, HF chat templates)
``sharegpt``         ``conversations``: ``[{"from", "value"}, ...]`` or          one message per turn
                     ``[{"role", "content"}, ...]``; optional ``system``
``alpaca``           ``instruction``, optional ``input``, ``output``; optional   ``history`` pairs, then
                     ``system`` and ``history`` (``[[query, response], ...]``)  user ``instruction\\ninput``,
                                                                                assistant ``output``
``prompt-completion`` TRL's ``prompt`` + ``completion``, both strings or both    user ``prompt``, assistant
                     message lists                                              ``completion`` (or the lists
                                                                                concatenated)
==================== ========================================================== ===========================

ShareGPT roles (LLaMA-Factory's tags and ms-swift's aliases): ``human``/``user`` -> ``user``;
``gpt``/``assistant``/``model``/``bot`` -> ``assistant``; ``system`` -> ``system``; ``observation``/``tool``
-> ``tool`` (a tool result); ``function_call`` (value: JSON ``{"name", "arguments"}`` or a list of them) ->
an ``assistant`` message with ``content=""`` and ``tool_calls=[{"type": "function", "function": {"name",
"arguments"}}]`` (transformers' tool-call format). The Alpaca join is LLaMA-Factory's
(``AlpacaDatasetConverter``: the non-empty ones of ``instruction`` and ``input`` joined with ``"\\n"``; ms-swift's
``AlpacaPreprocessor`` also joins with ``"\\n"``); its ``history`` pairs come first, as user/assistant turns.
A top-level ``system`` string (any format) becomes a first ``system`` message. A row with ``messages`` is a
``messages`` row whatever else it holds (UltraChat's ``prompt``, UltraFeedback's ``chosen``/``rejected``).

Refused with an error that names the format and what to do (never converted silently): preference rows
(``chosen``/``rejected``, DPO), unpaired preference rows (``prompt``/``completion``/``label``, KTO),
prompt-only rows (``prompt``), language-modeling rows (``text``), a non-empty ``tools`` field (function
definitions are not passed to the chat template), LLaMA-Factory media fields (``images``/``videos``/
``audios``) outside the ``messages`` format, per-turn training weights that switch a turn off
(``weight: 0``, ``loss: false``: varpack supervises every assistant turn), and, for TRL conversational
prompt-completion rows, an assistant turn inside ``prompt`` (TRL trains only on ``completion``; varpack would
train on every assistant turn). Supervision after conversion is varpack's: every assistant turn
(``varpack.data.chat``).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "FORMAT_FIELDS",
    "SHAREGPT_ROLES",
    "SUPPORTED_FORMATS",
    "data_formats",
    "detect_format",
    "row_to_messages",
]

#: formats converted to ``messages`` (``messages`` itself included)
SUPPORTED_FORMATS: tuple[str, ...] = ("messages", "sharegpt", "alpaca", "prompt-completion")
#: ShareGPT ``from`` tag -> chat role (``function_call`` becomes an assistant tool call, see the module doc)
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",
}
#: the top-level fields that detection and conversion read (all other fields are left alone)
FORMAT_FIELDS: tuple[str, ...] = (
    "messages",
    "conversations",
    "system",
    "tools",
    "instruction",
    "input",
    "output",
    "history",
    "prompt",
    "completion",
    "chosen",
    "rejected",
    "label",
    "text",
    "images",
    "videos",
    "audios",
)
_MEDIA_FIELDS = ("images", "videos", "audios")
_WEIGHT_KEYS = ("weight", "loss", "train")  # per-turn training switches (Axolotl/OpenHermes, ms-swift)
_SUPPORTED_HELP = (
    "supported: {'messages': [{role, content}, ...]}, ShareGPT {'conversations': [{from, value}, ...]}, "
    "Alpaca {'instruction', 'input', 'output'}, TRL {'prompt', 'completion'}"
)


def _where(sample_id: Any) -> str:
    return f"sample {sample_id}" if sample_id is not None else "sample"


def _present(row: Mapping[str, Any]) -> set[str]:
    return {k for k in FORMAT_FIELDS if row.get(k) is not None}


def _detect(
    present: Collection[str],
    where: str,
    all_keys: Collection[str] | None = None,
    null_keys: Collection[str] = (),
) -> str:
    """The format of a row with the (non-``None``) fields ``present``; raises for refused / unknown rows
    (``null_keys``: the format fields the row holds as ``None``, named in the error of a row of no format)."""
    if "messages" in present:
        if "conversations" in present:
            raise ValueError(f"{where}: row has both 'messages' and 'conversations'; keep one of them")
        return "messages"
    if "chosen" in present or "rejected" in present:
        raise ValueError(
            f"{where}: preference data (fields 'chosen'/'rejected', as for DPO) is not an SFT chat; plan and train "
            f"it with --objective dpo ('varpack plan --objective dpo', 'varpack sft --objective dpo'; "
            f"varpack.data.preference), or to fine-tune on the preferred answers write {{'messages': prompt + "
            f"chosen}} rows"
        )
    if "conversations" in present:
        return "sharegpt"
    if "instruction" in present or "output" in present:
        return "alpaca"
    if "completion" in present:
        if "label" in present:
            raise ValueError(
                f"{where}: unpaired preference data (fields 'prompt', 'completion', 'label', as for KTO) is "
                f"not supported by varpack sft; keep the rows with label true as {{'prompt', 'completion'}}"
            )
        return "prompt-completion"
    if "prompt" in present:
        raise ValueError(
            f"{where}: prompt-only row (field 'prompt' without 'completion') has no answer to supervise; "
            f"add a 'completion' (TRL prompt-completion format)"
        )
    if "text" in present:
        raise ValueError(
            f"{where}: language-modeling row (field 'text') is not a chat: varpack sft supervises assistant "
            f"turns; write it as {{'messages': [{{'role': 'user', ...}}, {{'role': 'assistant', ...}}]}} or "
            f"{{'prompt': ..., 'completion': ...}}"
        )
    keys = sorted(all_keys) if all_keys is not None else sorted(present)
    nulls = [k for k in FORMAT_FIELDS if k in null_keys]
    null = ""
    if nulls:  # a field given as null (or, in an Arrow table, a column that this row lacks)
        named = ", ".join(repr(k) for k in nulls)
        null = f"; {named} {'is' if len(nulls) == 1 else 'are'} null or absent"
        if "messages" in nulls:
            null += " (a 'messages' row needs a list of {role, content})"
    held = f"keys: {keys}" if keys else "no field holds a value"
    raise ValueError(
        f"{where}: row has none of the fields of a supported chat format ({held}){null}; {_SUPPORTED_HELP}"
    )


def detect_format(row: Mapping[str, Any], sample_id: Any = None) -> str:
    """The format of one row: one of :data:`SUPPORTED_FORMATS`.

    Args:
        row: one data row (a mapping; fields whose value is ``None`` count as absent).
        sample_id: named in errors.

    Returns:
        ``"messages"``, ``"sharegpt"``, ``"alpaca"`` or ``"prompt-completion"``.

    Raises:
        TypeError: ``row`` is not a mapping.
        ValueError: a refused format (preference, KTO, prompt-only, ``text``; the error names it and says
            what to do) or no known field (a format field that is ``null``, ``{"messages": null}``, is named).
    """
    where = _where(sample_id)
    if not isinstance(row, Mapping):
        raise TypeError(f"{where}: a row must be a JSON object (dict), got {type(row).__name__}")
    keys = [k for k, v in row.items() if v is not None]
    return _detect(_present(row), where, keys, [k for k, v in row.items() if v is None])


def _str_field(value: Any, field: str, where: str, *, non_empty: bool = False) -> str:
    if value is None:
        raise TypeError(f"{where}: {field} is missing or null")
    if not isinstance(value, str):
        raise TypeError(f"{where}: {field} must be a str, got {type(value).__name__} ({value!r:.60})")
    if non_empty and not value.strip():
        raise ValueError(f"{where}: {field} is empty (an assistant answer with no text to supervise)")
    return value


def _check_weights(turn: Mapping[str, Any], field: str, where: str) -> None:
    for key in _WEIGHT_KEYS:
        value = turn.get(key)
        if value is not None and not (value is True or (not isinstance(value, str) and value == 1)):
            raise ValueError(
                f"{where}: {field}.{key}={value!r} switches training on this turn off; varpack supervises every "
                f"assistant turn and no others, so per-turn weights are not supported: remove the key, or drop "
                f"the turn"
            )


def _tool_calls(value: str, field: str, where: str) -> list[dict[str, Any]]:
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: {field} of a function_call turn must be JSON {{name, arguments}}: {exc}"
        ) from exc
    calls = calls if isinstance(calls, list) else [calls]
    if not calls:
        raise ValueError(f"{where}: {field} of a function_call turn holds no call (an empty list)")
    out = []
    for k, call in enumerate(calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            raise ValueError(
                f"{where}: {field} of a function_call turn must be JSON {{name, arguments}} (or a list of "
                f"them); call {k} is {call!r:.80}"
            )
        out.append(
            {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
        )
    return out


def _turns(turns: Any, field: str, where: str, *, check_empty: bool = True) -> list[dict[str, Any]]:
    """ShareGPT turns (``from``/``value``) or role/content messages -> messages (role/content items keep
    their other keys, as in the ``messages`` format). ``check_empty``: an assistant turn without text (and
    without tool calls) is an error."""
    if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
        raise TypeError(f"{where}: {field} must be a list of turns, got {type(turns).__name__}")
    if len(turns) == 0:
        raise ValueError(f"{where}: {field} is empty")
    out: list[dict[str, Any]] = []
    for j, turn in enumerate(turns):
        f = f"{field}[{j}]"
        if not isinstance(turn, Mapping):
            raise TypeError(f"{where}: {f} must be a dict, got {type(turn).__name__}")
        _check_weights(turn, f, where)
        if turn.get("from") is not None or (turn.get("role") is None and turn.get("value") is not None):
            tag = turn.get("from")
            if tag is None:
                raise TypeError(f"{where}: {f}.from is missing or null")
            if tag not in SHAREGPT_ROLES:
                raise ValueError(
                    f"{where}: {f}.from={tag!r} is not a ShareGPT role (known: {sorted(SHAREGPT_ROLES)})"
                )
            role = SHAREGPT_ROLES[tag]
            empty_ok = not check_empty or role != "assistant" or tag == "function_call"
            value = _str_field(turn.get("value"), f"{f}.value", where, non_empty=not empty_ok)
            if tag == "function_call":
                out.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": _tool_calls(value, f"{f}.value", where),
                    }
                )
            else:
                out.append({"role": role, "content": value})
            continue
        if turn.get("role") is None:
            keys = sorted(k for k, v in turn.items() if v is not None)
            raise TypeError(f"{where}: {f} has neither 'from' nor 'role' (keys: {keys})")
        message = {k: v for k, v in turn.items() if v is not None and k not in _WEIGHT_KEYS}
        role = message["role"]
        if isinstance(role, str) and role in SHAREGPT_ROLES and role != "function_call":
            message["role"] = SHAREGPT_ROLES[role]
        if (
            check_empty
            and message["role"] == "assistant"
            and isinstance(message.get("content"), str)
            and not (message.get("tool_calls"))
        ):
            _str_field(message["content"], f"{f}.content", where, non_empty=True)
        out.append(message)
    return out


def _has_assistant(messages: list[dict[str, Any]], field: str, where: str) -> None:
    if not any(m.get("role") == "assistant" for m in messages):
        roles = [m.get("role") for m in messages]
        raise ValueError(f"{where}: {field} has no assistant turn to supervise (roles: {roles})")


def _sharegpt(row: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    messages = _turns(row["conversations"], "conversations", where)
    _has_assistant(messages, "conversations", where)
    return messages


def _alpaca(row: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    history = row.get("history")
    if history is not None:
        if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
            raise TypeError(
                f"{where}: history must be a list of [query, response] pairs, got {type(history).__name__}"
            )
        for j, pair in enumerate(history):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(f"{where}: history[{j}] must be a [query, response] pair, got {pair!r:.80}")
            messages.append({"role": "user", "content": _str_field(pair[0], f"history[{j}][0]", where)})
            messages.append(
                {
                    "role": "assistant",
                    "content": _str_field(pair[1], f"history[{j}][1]", where, non_empty=True),
                }
            )
    parts = []
    for field in ("instruction", "input"):
        value = row.get(field)
        if value is not None:
            parts.append(_str_field(value, field, where))
    if not parts:
        raise TypeError(f"{where}: instruction is missing (Alpaca rows need 'instruction' and 'output')")
    output = _str_field(row.get("output"), "output", where, non_empty=True)
    messages.append({"role": "user", "content": "\n".join(p for p in parts if p)})
    messages.append({"role": "assistant", "content": output})
    return messages


def _prompt_completion(row: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    prompt, completion = row.get("prompt"), row.get("completion")
    if prompt is None:
        raise TypeError(
            f"{where}: prompt is missing (TRL prompt-completion rows need 'prompt' and 'completion')"
        )
    if isinstance(prompt, str) and isinstance(completion, str):
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _str_field(completion, "completion", where, non_empty=True)},
        ]
    if isinstance(prompt, str) or isinstance(completion, str):
        raise TypeError(
            f"{where}: prompt and completion must both be strings or both be message lists, got "
            f"{type(prompt).__name__} and {type(completion).__name__}"
        )
    prompt_messages = _turns(prompt, "prompt", where)
    completion_messages = _turns(completion, "completion", where)
    for j, m in enumerate(prompt_messages):
        if m.get("role") == "assistant":
            raise ValueError(
                f"{where}: prompt[{j}] is an assistant turn; TRL trains only on 'completion', varpack on every "
                f"assistant turn, so the result would differ: move the turns to be trained into 'completion' "
                f"and write the row as {{'messages': prompt + completion}}"
            )
    for j, m in enumerate(completion_messages):
        if m.get("role") != "assistant":
            raise ValueError(
                f"{where}: completion[{j}] has role {m.get('role')!r}; varpack supervises assistant turns only, "
                f"so a completion must hold assistant messages"
            )
    return prompt_messages + completion_messages


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip() in ("", "[]", "{}", "null")
    try:
        return len(value) == 0
    except TypeError:
        return False


def row_to_messages(row: Mapping[str, Any], sample_id: Any = None) -> tuple[list[Any], str]:
    """Convert one row of any supported format to a message list (see the module docstring).

    Args:
        row: one data row (fields whose value is ``None`` count as absent).
        sample_id: named in every error (``"sample {id}: field: ..."``).

    Returns:
        ``(messages, format)``: ``messages`` a list of ``{"role", "content", ...}`` dicts (for the
        ``messages`` format the row's own list, with ShareGPT-style ``from``/``value`` items converted and a
        top-level ``system`` prepended); ``format`` one of :data:`SUPPORTED_FORMATS`. Message contents are
        not type-checked for the ``messages`` format (image chats have part lists); the encoders validate them.

    Raises:
        TypeError: a missing field or one of the wrong type (named, e.g. ``conversations[1].value``).
        ValueError: a refused format or field (the error says which and what to do), an unknown ShareGPT
            role, an empty assistant answer (``output``, ``completion``, a ``gpt`` value), no assistant turn.
    """
    where = _where(sample_id)
    fmt = detect_format(row, sample_id)
    if not _is_empty(row.get("tools")):
        raise ValueError(
            f"{where}: 'tools' (function definitions) is not passed to the chat template by varpack; remove "
            f"the field, or put the definitions into the system message"
        )
    if fmt == "messages":
        messages = row["messages"]
        if (
            isinstance(messages, Sequence)
            and not isinstance(messages, (str, bytes))
            and any(
                isinstance(m, Mapping)
                and (m.get("from") is not None or any(m.get(k) is not None for k in _WEIGHT_KEYS))
                for m in messages
            )
        ):
            messages = _turns(messages, "messages", where, check_empty=False)
    else:
        for field in _MEDIA_FIELDS:
            if not _is_empty(row.get(field)):
                raise ValueError(
                    f"{where}: field '{field}' (LLaMA-Factory style media with <image> placeholders) is not "
                    f"converted; write image chats as 'messages' with content parts "
                    f"{{'type': 'image', 'image': PATH}}"
                )
        convert = {"sharegpt": _sharegpt, "alpaca": _alpaca, "prompt-completion": _prompt_completion}[fmt]
        messages = convert(row, where)
    system = row.get("system")
    if system is not None and isinstance(messages, list):  # (a malformed 'messages' is named by the encoder)
        system = _str_field(system, "system", where)
        first = messages[0] if messages else None
        if isinstance(first, Mapping) and first.get("role") == "system":
            if system and first.get("content") != system:
                raise ValueError(
                    f"{where}: a top-level 'system' and a system turn that differs from it; keep one of them"
                )
        elif system:
            messages = [{"role": "system", "content": system}, *messages]
    return messages, fmt


def data_formats(data: Any) -> dict[str, int]:
    """How many rows of ``data`` have each format, e.g. ``{"messages": 120, "sharegpt": 30}``.

    Args:
        data: a ``datasets.Dataset`` (read through Arrow's validity bitmaps: one pass per format column, no
            per-row Python) or a sequence of row dicts.

    Returns:
        ``{format: count}`` in :data:`SUPPORTED_FORMATS` order, formats with no rows left out.

    Raises:
        ValueError / TypeError: the first row of a refused or unknown format (as :func:`detect_format`).
    """
    counts: dict[str, int] = {}
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(data, datasets.Dataset):
        import numpy as np

        columns = [k for k in FORMAT_FIELDS if k in data.column_names]
        table = data.select_columns(columns).with_format("arrow")[:] if len(data) and columns else None
        signature = np.zeros(len(data), dtype=np.int64)
        if table is not None:
            for bit, name in enumerate(columns):
                valid = np.asarray(table.column(name).is_valid().to_numpy(zero_copy_only=False), dtype=bool)
                signature |= valid.astype(np.int64) << bit
        for sig in np.unique(signature):
            present = {name for bit, name in enumerate(columns) if (int(sig) >> bit) & 1}
            first = int(np.flatnonzero(signature == sig)[0])
            keys = [c for c in data.column_names if c in present or c not in columns]
            fmt = _detect(present, _where(first), keys, [c for c in columns if c not in present])
            counts[fmt] = counts.get(fmt, 0) + int((signature == sig).sum())
    else:
        for i, row in enumerate(data):
            fmt = detect_format(row, i)
            counts[fmt] = counts.get(fmt, 0) + 1
    return {f: counts[f] for f in SUPPORTED_FORMATS if f in counts}
