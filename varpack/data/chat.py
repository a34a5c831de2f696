"""Chat samples -> ``input_ids``, ``labels``, ``length`` with the tokenizer's chat template.

Supervision (which tokens get a label): every assistant turn of a conversation, all of them in a
multi-turn chat, and nothing else. For a turn, the supervised tokens are the assistant's content and the
template's end-of-turn token that follows it (ChatML: ``content<|im_end|>``; not the ``<|im_start|>
assistant\\n`` header and not the ``\\n`` after ``<|im_end|>``). This is the span a chat template's
``{% generation %}`` block marks in transformers' ``return_assistant_tokens_mask`` (which TRL's
``assistant_only_loss`` uses). LLaMA-Factory's ChatML templates also supervise the ``\\n`` after
``<|im_end|>``; varpack does not: generation stops at the end-of-turn token, the newline is layout.
``labels`` are aligned with ``input_ids`` (the model shifts them): ``labels[t] == input_ids[t]`` on
supervised tokens, ``-100`` elsewhere, and ``labels[0] == -100`` always, so a sample never predicts its
first token from the previous sample of a pack.

Two ways to find the assistant tokens, chosen per tokenizer:

* the chat template has ``{% generation %}`` markers and the tokenizer is fast: transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (a token is supervised when its
  character span overlaps a generation block);
* otherwise the prefix-difference method: the text of ``messages[:i]`` rendered with
  ``add_generation_prompt=True`` must be a prefix of ``messages[:i+1]``, which must be a prefix of the
  whole conversation; the characters in between, trailing whitespace removed, are turn ``i``'s reply
  (+ end-of-turn token), and tokens overlapping them are supervised (same overlap rule). A template that
  is not prefix-stable (e.g. one that rewrites earlier turns) raises instead of guessing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from varpack.schema import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "KNOWN_ROLES",
    "require_answers",
    "encode_chat",
    "encode_dataset",
    "load_chat_data",
    "locate_samples",
    "tokenizer_fingerprint",
    "validate_messages",
]

#: Roles a message may have.
KNOWN_ROLES = ("system", "user", "assistant", "tool")
#: keys that give an assistant turn something to supervise besides its content (tool calls, reasoning)
_ANSWER_KEYS = ("tool_calls", "reasoning_content", "thinking")


@functools.cache
def _encoder_version() -> str:
    """A hash of the source of the modules that turn a row into ``input_ids`` / ``labels`` (this one and
    :mod:`varpack.data.formats`): part of the encoded-data cache's fingerprint, so a change in how rows are
    checked or encoded never reads an Arrow cache written by the code before it."""
    from varpack.data import formats

    digest = hashlib.sha256()
    for module in (sys.modules[__name__], formats):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def _where(sample_id: Any) -> str:
    return f"sample {sample_id}" if sample_id is not None else "sample"


def _check_tool_calls(message: Mapping[str, Any], where: str) -> None:
    """An assistant turn's ``tool_calls``: a list of ``{"type": "function", "function": {"name", "arguments"}}``
    (or the flat ``{"name", "arguments"}``), each name a non-empty string and the arguments a dict or a JSON
    string, as chat templates read them.

    Raises:
        TypeError / ValueError: naming ``messages[i].tool_calls[j]`` and the field (``where`` is
            ``"sample N: messages[i]"``).
    """
    calls = message["tool_calls"]
    if message.get("role") != "assistant":
        raise ValueError(f"{where}.tool_calls is on a {message.get('role')!r} turn; only assistant turns call tools")
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
        raise TypeError(f"{where}.tool_calls must be a list of calls, got {type(calls).__name__} ({calls!r:.60})")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise TypeError(f"{at} must be a dict {{type, function: {{name, arguments}}}}, got {type(call).__name__}")
        fn, at = (call["function"], f"{at}.function") if call.get("function") is not None else (call, at)
        if not isinstance(fn, Mapping):
            raise TypeError(f"{at} must be a dict {{name, arguments}}, got {type(fn).__name__}")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ValueError(f"{at}.name is missing, null or empty (the name of the called function)")
        if not isinstance(fn.get("arguments"), (Mapping, str)):
            got = "missing or null" if fn.get("arguments") is None else f"a {type(fn['arguments']).__name__}"
            raise TypeError(f"{at}.arguments must be a dict or a JSON string, got {got}")


def validate_messages(messages: Any, sample_id: Any = None) -> list[dict[str, Any]]:
    """Check one conversation and return it as plain dicts (keys whose value is ``None`` dropped).

    Args:
        messages: a non-empty list of ``{"role": str, "content": str}``; roles in :data:`KNOWN_ROLES`;
            at least one ``assistant`` message (otherwise the sample would have nothing to learn), none of
            them empty (content blank, and no ``tool_calls`` / ``reasoning_content`` / ``thinking``).
            Extra keys are kept (the template may use them); ``None`` values are dropped (Arrow fills
            absent struct fields with ``None``). A turn with ``tool_calls`` may have ``content`` null or absent
            (OpenAI's format for a turn that only calls tools): it is passed to the template as ``""``. Each
            tool call is checked (a name, arguments as a dict or a JSON string; assistant turns only); OpenAI's
            legacy ``function_call`` becomes the one call of ``tool_calls``.
        sample_id: named in error messages.

    Returns:
        list of dicts, one per message.

    Raises:
        TypeError: ``messages`` not a list, a message not a mapping, a role/content not a ``str``
            (the error names ``messages[i].field`` and the sample).
        ValueError: empty conversation, unknown role, no assistant message, an empty assistant answer
            (``messages[i].content is empty``).
    """
    where = _where(sample_id)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: messages must be a list of {{role, content}}, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError(f"{where}: messages is empty")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"{where}: messages[{i}] must be a dict, got {type(message).__name__}")
        if message.get("function_call") is not None and message.get("tool_calls") is None:
            # OpenAI's legacy single call: the same call in the tool_calls form every template reads
            message = {k: v for k, v in message.items() if k != "function_call"}
            message["tool_calls"] = [{"type": "function", "function": messages[i]["function_call"]}]
        if message.get("tool_calls") is not None:
            _check_tool_calls(message, f"{where}: messages[{i}]")
        if message.get("content") is None and message.get("tool_calls"):
            message = {**message, "content": ""}  # a turn that only calls tools
        for field in ("role", "content"):
            if field not in message or message[field] is None:
                raise TypeError(f"{where}: messages[{i}].{field} is missing or null")
            if not isinstance(message[field], str):
                value = message[field]
                raise TypeError(
                    f"{where}: messages[{i}].{field} must be a str, got {type(value).__name__} ({value!r:.60})"
                )
        if message["role"] not in KNOWN_ROLES:
            raise ValueError(f"{where}: messages[{i}].role={message['role']!r} is not one of {KNOWN_ROLES}")
        require_answers([message], where, first=i, whole=False)
        out.append({k: v for k, v in message.items() if v is not None})
    require_answers(out, where)
    return out


def require_answers(
    messages: Sequence[Mapping[str, Any]], where: str, *, first: int = 0, whole: bool = True
) -> None:
    """Refuse a conversation with nothing to supervise: an assistant turn whose answer is empty (``content``
    blank or absent, an empty list of parts, and no ``tool_calls`` / ``reasoning_content`` / ``thinking``: it
    would train the end-of-turn token alone, as the other formats' empty answers, :mod:`varpack.data.formats`),
    or, with ``whole``, no assistant turn at all. Roles and content types are not checked here
    (:func:`validate_messages` does; the TRL drop-in leaves them to the chat template). ``first``: the index
    of ``messages[0]`` in its conversation (named in the error).

    Raises:
        ValueError: ``"{where}: messages[1].content is empty (an assistant answer with no text to supervise)
            ..."``; ``"{where}: no assistant message to supervise (roles: [...])"``.
    """
    for i, m in enumerate(messages, start=first):
        content = m.get("content")
        blank = content is None or (not content.strip() if isinstance(content, str) else not content)
        if m.get("role") == "assistant" and blank and not any(m.get(k) for k in _ANSWER_KEYS):
            raise ValueError(
                f"{where}: messages[{i}].content is empty (an assistant answer with no text to supervise); "
                "write the answer, or remove the turn or the row"
            )
    if whole and not any(m.get("role") == "assistant" for m in messages):
        roles = [m.get("role") for m in messages]
        raise ValueError(f"{where}: no assistant message to supervise (roles: {roles})")


def _chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    try:
        template = tokenizer.get_chat_template()
    except ValueError as e:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')!r}) has no chat "
            f"template; set tokenizer.chat_template or use varpack's embedded 'qwen3' tokenizer"
        ) from e
    return template


def _uses_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "is_fast", False)) and bool(_GENERATION_RE.search(_chat_template(tokenizer)))


def _labels(input_ids: list[int], mask: Sequence[int]) -> list[int]:
    labels = [tok if m else IGNORE_INDEX for tok, m in zip(input_ids, mask)]
    if labels:
        labels[0] = IGNORE_INDEX
    return labels


def _result(input_ids: list[int], mask: Sequence[int], sample_id: Any, method: str) -> dict[str, Any]:
    if not input_ids:
        raise ValueError(f"{_where(sample_id)}: the chat template rendered no tokens")
    labels = _labels(input_ids, mask)
    if all(label == IGNORE_INDEX for label in labels):
        raise ValueError(
            f"{_where(sample_id)}: no token is supervised ({method}); the chat template marks no assistant "
            f"tokens for this conversation"
        )
    return {"input_ids": input_ids, "labels": labels, "length": len(input_ids)}


def _encode_generation_marked(
    conversations: list[list[dict[str, Any]]], tokenizer: PreTrainedTokenizerBase, sample_ids: Sequence[Any]
) -> list[dict[str, Any]]:
    try:
        out = tokenizer.apply_chat_template(
            conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as exc:  # the template's own error (jinja2's, a raise_exception): named by sample
        if len(conversations) == 1:
            raise ValueError(f"{_where(sample_ids[0])}: chat template failed: {exc}") from exc
        # find the sample that breaks the template and name it
        results = []
        for conv, sid in zip(conversations, sample_ids):
            results.extend(_encode_generation_marked([conv], tokenizer, [sid]))
        return results
    return [
        _result(list(ids), mask, sid, "generation markers")
        for ids, mask, sid in zip(out["input_ids"], out["assistant_masks"], sample_ids)
    ]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], gen: bool, sample_id: Any = None
) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception as exc:  # the template's own error: named by sample
        raise ValueError(f"{_where(sample_id)}: chat template failed: {exc}") from exc


def _assistant_char_spans(
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, sample_id: Any
) -> tuple[str, list[tuple[int, int]]]:
    where = _where(sample_id)
    full = _render(tokenizer, messages, gen=False, sample_id=sample_id)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(
                f"{where}: messages[0] is an assistant turn; the prefix method (template without "
                f"{{% generation %}} markers) needs a prompt before it"
            )
        prompt = _render(tokenizer, messages[:i], gen=True, sample_id=sample_id)
        upto = _render(tokenizer, messages[: i + 1], gen=False, sample_id=sample_id)
        if not upto.startswith(prompt) or not full.startswith(upto):
            bad = f"messages[:{i}] + generation prompt is not a prefix of messages[:{i + 1}]"
            if upto.startswith(prompt):
                bad = f"messages[:{i + 1}] is not a prefix of the whole conversation"
            raise ValueError(
                f"{where}: the chat template is not prefix-stable at messages[{i}] ({bad}), so the "
                f"assistant tokens cannot be located; use a template with {{% generation %}} markers"
            )
        stop = len(upto.rstrip())
        if stop > len(prompt):
            spans.append((len(prompt), stop))
    return full, spans


def _encode_prefix(
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, sample_id: Any
) -> dict[str, Any]:
    full, spans = _assistant_char_spans(messages, tokenizer, sample_id)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        k = 0
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k == len(spans):
                break
            if end > spans[k][0]:
                mask[t] = 1
        return _result(ids, mask, sample_id, "prefix method")
    # Tokenizer without offsets: compare token ids of text prefixes. Tokens shared with the tokenization
    # of the text before the reply lie before it; the first differing token overlaps the reply (e.g. a
    # "\n\n\n" merging the header's newline with the reply's leading ones), so the reply starts there,
    # as with the overlap rule. The reply's end must fall on a token boundary (it does whenever the
    # end-of-turn marker is a special token).
    ids = tokenizer.encode(full, add_special_tokens=False)
    mask = [0] * len(ids)
    for start, stop in spans:
        a = tokenizer.encode(full[:start], add_special_tokens=False)
        b = tokenizer.encode(full[:stop], add_special_tokens=False)
        first = next((k for k, (x, y) in enumerate(zip(ids, a)) if x != y), min(len(a), len(ids)))
        if ids[: len(b)] != b:
            raise ValueError(
                f"{_where(sample_id)}: the assistant reply ending at character {stop} does not end on a token "
                f"boundary (token merges cross the end of the turn); use a fast tokenizer"
            )
        for t in range(first, len(b)):
            mask[t] = 1
    return _result(ids, mask, sample_id, "prefix method")


def unrendered_answer_field(messages: Sequence[Mapping[str, Any]], tokenizer: Any) -> tuple[int, str] | None:
    """``(i, key)`` of the first message whose answer field (:data:`_ANSWER_KEYS`: ``tool_calls``,
    ``reasoning_content``, ``thinking``) is set while the tokenizer's chat template never reads it (its name is
    not in the template's source), else ``None``. Such a field would be dropped by the template and the turn
    trained without it."""
    keys = [(i, k) for i, m in enumerate(messages) for k in _ANSWER_KEYS if m.get(k)]
    if not keys:
        return None
    template = _chat_template(tokenizer)
    return next(((i, k) for i, k in keys if k not in template), None)


def unrendered_message(tokenizer: Any, field: str, key: str) -> str:
    """The refusal of :func:`unrendered_answer_field`'s finding ``field`` (``messages[1]``) / ``key``."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return (
        f"{field}.{key} is set, but the chat template of {name!r} does not render {key} (the turn would be "
        f"trained without it); use the model's own tokenizer, whose template renders it, or move it into content"
    )


def _refuse_unrendered(
    conversations: list[list[dict[str, Any]]], tokenizer: PreTrainedTokenizerBase, sample_ids: Sequence[Any]
) -> None:
    """Raises ``ValueError`` ("sample N: messages[i].tool_calls is set, but the chat template ... does not
    render tool_calls ...") for the first conversation with an :func:`unrendered_answer_field`."""
    for conv, sid in zip(conversations, sample_ids):
        found = unrendered_answer_field(conv, tokenizer)
        if found is not None:
            raise ValueError(f"{_where(sid)}: {unrendered_message(tokenizer, f'messages[{found[0]}]', found[1])}")


def _encode_many(
    batch_messages: Sequence[Any], tokenizer: PreTrainedTokenizerBase, sample_ids: Sequence[Any]
) -> list[dict[str, Any]]:
    conversations = [validate_messages(m, sid) for m, sid in zip(batch_messages, sample_ids)]
    _refuse_unrendered(conversations, tokenizer, sample_ids)
    if _uses_generation_markers(tokenizer):
        return _encode_generation_marked(conversations, tokenizer, sample_ids)
    return [_encode_prefix(conv, tokenizer, sid) for conv, sid in zip(conversations, sample_ids)]


def encode_chat(
    messages: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, *, sample_id: Any = None
) -> dict[str, Any]:
    """Encode one conversation with the tokenizer's chat template; supervise assistant turns only.

    Args:
        messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``, non-empty,
            with at least one assistant message.
        tokenizer: any Hugging Face tokenizer with a chat template (e.g. ``load_tokenizer("qwen3")``).
        sample_id: the sample's id, named in every error.

    Returns:
        ``{"input_ids": list[int] (L,), "labels": list[int] (L,), "length": int L}``; ``labels`` is
        ``-100`` except on the assistant tokens (content + end-of-turn token of every assistant turn,
        see the module docstring), and ``labels[0] == -100``.

    Raises:
        TypeError: malformed messages (names ``messages[i].field``).
        ValueError: empty conversation, unknown role, no assistant message, an empty assistant answer, no
            chat template, a ``tool_calls`` / ``reasoning_content`` / ``thinking`` field the template does not
            render, a template that is not prefix-stable (when it has no ``{% generation %}`` markers), or
            nothing supervised.

    Example (embedded Qwen3 tokenizer; ``|`` marks supervised tokens)::

        <|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n|Hello|!|<|im_end|>|\\n

    Source: assistant-only loss as in transformers' ``return_assistant_tokens_mask`` / TRL's
    ``assistant_only_loss`` (``{% generation %}`` spans); the prefix method is the render-and-diff
    approach of template-agnostic SFT encoders (e.g. LLaMA-Factory encodes prompt/response pairs).
    """
    return _encode_many([messages], tokenizer, [sample_id])[0]


def load_chat_data(
    paths_or_rows: Any, *, cache_dir: str | os.PathLike[str] | None = None
) -> datasets.Dataset:
    """Load chat data as a Hugging Face ``datasets.Dataset`` (one row per conversation).

    Args:
        paths_or_rows: a path or a list of paths of JSON / JSON Lines (``.json``, ``.jsonl``,
            ``.ndjson``, optionally compressed ``.gz``/``.bz2``/``.xz``/``.zst``) or parquet files, all of
            one kind, read with ``datasets.load_dataset("json"|"parquet", data_files=...)`` (cached as
            Arrow; rows in file order; files whose columns or nested fields differ are read with
            ``datasets.Json()`` for the columns that differ, which needs datasets >= 4.7); or an in-memory
            list of dicts (validated and converted first so that a bad row is named); or a
            ``datasets.Dataset`` (returned as is). Rows may have any format of
            :mod:`varpack.data.formats` (``messages``, ShareGPT, Alpaca, TRL prompt-completion), mixed.
        cache_dir: ``datasets`` cache folder for files (default: HF_DATASETS_CACHE).

    Returns:
        ``datasets.Dataset`` with the input's columns (the union of the rows' fields for in-memory rows);
        the encoder converts each row to messages (:func:`varpack.data.formats.row_to_messages`).

    Raises:
        FileNotFoundError: a path does not exist.
        IsADirectoryError: a path is a directory (give its files).
        ValueError: unknown file type, mixed JSON and parquet, no rows, files with different columns on
            datasets < 4.7, a line that is not JSON or text that is not UTF-8 (names the file, line and
            sample, :mod:`varpack.data.jsonfile`), an in-memory row that is not a supported chat (names the row
            and field).
        TypeError: unsupported input type, an in-memory row with a field of the wrong type (named).
    """
    import datasets

    from varpack.data.jsonfile import require_file

    if isinstance(paths_or_rows, datasets.Dataset):
        return paths_or_rows
    if isinstance(paths_or_rows, (str, os.PathLike)):
        paths_or_rows = [paths_or_rows]
    if not isinstance(paths_or_rows, Sequence) or isinstance(paths_or_rows, bytes):
        raise TypeError(
            f"load_chat_data expects a path, a list of paths, a list of dicts or a datasets.Dataset, "
            f"got {type(paths_or_rows).__name__}"
        )
    items = list(paths_or_rows)
    if not items:
        raise ValueError("load_chat_data: no paths or rows given")
    if all(isinstance(x, Mapping) for x in items):
        from varpack.data.formats import row_to_messages

        for i, row in enumerate(items):
            validate_messages(row_to_messages(row, i)[0], i)
        return _dataset_from_rows(items)
    if not all(isinstance(x, (str, os.PathLike)) for x in items):
        kinds = sorted({type(x).__name__ for x in items})
        raise TypeError(f"load_chat_data: mix of paths and other objects ({kinds})")
    kinds = set()
    files = []
    for p in items:
        require_file(p)
        path = Path(p).expanduser()
        name = path.name.lower()
        for comp in _COMPRESSION_SUFFIXES:
            if name.endswith(comp):
                name = name[: -len(comp)]
                break
        if name.endswith(_JSON_SUFFIXES):
            kinds.add("json")
        elif name.endswith(".parquet"):
            kinds.add("parquet")
        else:
            raise ValueError(f"{os.fspath(p)!r}: unknown chat data type (use .json, .jsonl or .parquet)")
        if path.stat().st_size == 0 or (
            name.endswith(_JSON_SUFFIXES) and name == path.name.lower() and not path.read_bytes().strip()
        ):
            # datasets' JSON builder dies with a bare StopIteration on such a file
            raise ValueError(f"chat data file {os.fspath(p)!r} contains no rows (it is empty)")
        files.append(str(path.resolve()))
    if len(kinds) > 1:
        raise ValueError(
            f"load_chat_data: files mix JSON and parquet ({files}); one run reads files of one type: convert "
            "the parquet ones to JSON Lines first (python -c \"import datasets; datasets.Dataset.from_parquet("
            "'a.parquet').to_json('a.jsonl')\")"
        )
    kind = kinds.pop()
    names = dict(zip(files, (os.fspath(p) for p in items)))
    ds = _load_files(kind, files, None if cache_dir is None else str(cache_dir), names)
    if len(ds) == 0:
        raise ValueError(f"load_chat_data: {files} contain no rows")
    _check_utf8(ds, kind, files)
    # for error locations only: the files as read, and each named as the caller wrote it
    ds._varpack_files = (next(iter(_kinds_of(files))), files, names)
    return ds


def _dataset_from_rows(items: list[Mapping[str, Any]]) -> datasets.Dataset:
    """``Dataset.from_list`` over the union of the rows' fields (``from_list`` takes the columns of the first
    row only, which would drop the fields of rows of another format); fields that Arrow cannot type across
    rows (a ``prompt`` that is a string here and a list there) are stored as ``datasets.Json()``."""
    import datasets
    import pyarrow as pa

    keys = list(dict.fromkeys(k for row in items for k in row))
    rows = [{k: row.get(k) for k in keys} for row in items]
    try:
        return datasets.Dataset.from_list(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        if not hasattr(datasets, "Json"):
            raise
    # datasets.Json() reads a string that is itself JSON text back as the value it spells ("4" -> 4,
    # "\"Paris\"" -> "Paris", "true" -> True), also nested (a message's str content beside list contents):
    # every column that needs Json() anywhere is stored JSON-encoded as a whole, which Json() decodes back exactly
    ds = datasets.Dataset.from_list(rows, on_mixed_types="use_json")
    cols = [k for k in keys if _has_json_feature(ds.features[k])]
    if not cols:
        return ds
    features = datasets.Features({k: (datasets.Json() if k in cols else f) for k, f in ds.features.items()})
    encoded = [{k: (json.dumps(v) if k in cols and v is not None else v) for k, v in r.items()} for r in rows]
    return datasets.Dataset.from_list(encoded, features=features)


def _has_json_feature(features: Any) -> bool:
    """Whether ``features`` (a ``datasets.Features`` or a nested feature) holds a ``datasets.Json()``."""
    import datasets

    json_type = getattr(datasets, "Json", None)
    if json_type is None:
        return False
    if isinstance(features, json_type):
        return True
    if isinstance(features, dict):
        return any(_has_json_feature(f) for f in features.values())
    if isinstance(features, (list, tuple)):
        return any(_has_json_feature(f) for f in features)
    inner = getattr(features, "feature", None)  # datasets.List / Sequence / LargeList
    return inner is not None and _has_json_feature(inner)


def _read_json_rows(path: str, first_sample: int = 0, name: str | None = None) -> list[dict[str, Any]]:
    """The rows of one JSON / JSON Lines file (:func:`varpack.data.jsonfile.read_rows`), each a JSON object.

    Raises:
        ValueError: a line / document that is not UTF-8 text or not JSON, or a row that is not an object
            (named by file, line and sample).
    """
    from varpack.data.jsonfile import read_rows

    rows = []
    for i, (row, where) in enumerate(read_rows(path, first_sample=first_sample, name=name)):
        if not isinstance(row, dict):
            got = type(row).__name__
            raise ValueError(f"{where}: sample {first_sample + i}: a chat row must be a JSON object, got {got}")
        rows.append(row)
    return rows


def _read_files(files: list[str], names: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The rows of JSON / JSON Lines files, read with :mod:`json` (sample ids count across the files; errors
    name each file as ``names`` gives it, default its path)."""
    rows: list[dict[str, Any]] = []
    for f in files:
        rows += _read_json_rows(f, len(rows), (names or {}).get(f))
    return rows


@contextlib.contextmanager
def _quiet_json_builder() -> Iterator[None]:
    """datasets' JSON builder logs ``Failed to load JSON from file ...`` (an ERROR record) before it raises;
    varpack then reads the file itself and names the file, line and sample, so the record is only noise."""
    log = logging.getLogger("datasets.packaged_modules.json.json")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _load_files(
    kind: str, files: list[str], cache_dir: str | None, names: Mapping[str, str] | None = None
) -> datasets.Dataset:
    """``datasets.load_dataset(kind, data_files=files)``; when the files' columns or nested fields differ
    (``datasets`` then fails to write them into one table), each file is read alone to find the columns that
    differ, and the files are read together again with those columns typed ``datasets.Json()`` (missing
    columns are filled with ``None``). ``names``: each file as the caller wrote it, for errors."""
    import datasets

    try:
        with _quiet_json_builder():
            ds = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)
    except (datasets.exceptions.DatasetGenerationError, ValueError) as exc:
        # ValueError: pandas' JSON reader failing while datasets infers the features (rows whose fields mix
        # types, with a blank line among them: "Expected object or value", no file or line named)
        if kind == "json":
            # a line that is not JSON (datasets names no file or line), or fields typed differently across
            # files: read with json, which names the file, line and sample of a bad line
            return _dataset_from_rows(_read_files(files, names))
        if len(files) == 1 or not isinstance(exc, datasets.exceptions.DatasetGenerationError):
            raise
    else:
        if not (kind == "json" and _has_json_feature(ds.features)):
            return ds
        # rows that mix a plain string with messages in one field: datasets typed the field Json() and
        # would read a JSON-looking string back as the value it spells ("4" -> 4); read the rows ourselves
        return _dataset_from_rows(_read_files(files, names))
    per_file = [
        datasets.load_dataset(kind, data_files=[f], split="train", cache_dir=cache_dir).features for f in files
    ]
    names = list(dict.fromkeys(name for features in per_file for name in features))
    if not hasattr(datasets, "Json"):
        columns = {f: sorted(features) for f, features in zip(files, per_file)}
        raise ValueError(
            f"the data files have different columns or nested fields ({columns}); datasets >= 4.7 reads them "
            f"together (datasets.Json), or load them separately"
        )
    unified = {}
    for name in names:
        types = [features[name] for features in per_file if name in features]
        unified[name] = types[0] if all(t == types[0] for t in types) else datasets.Json()
    return datasets.load_dataset(
        kind, data_files=files, split="train", cache_dir=cache_dir, features=datasets.Features(unified)
    )


def _kinds_of(files: list[str]) -> set[str]:
    return {"parquet" if f.lower().endswith(".parquet") else "json" for f in files}


def _find_row(kind: str, files: list[str], row: int) -> tuple[str, int, int | None, bytes | None] | None:
    """``(file, index in the file, line number, raw line)`` of row ``row`` (0-based) of the concatenation of
    ``files`` as :func:`load_chat_data` reads them (line and raw line for JSON Lines only); ``None`` if it
    cannot be told. Error paths only (it reads the files again)."""
    import datasets

    from varpack.data.jsonfile import is_json_lines, iter_lines

    offset = 0
    for f in files:
        n = len(datasets.load_dataset(kind, data_files=[f], split="train"))
        if row < offset + n:
            k = row - offset
            if kind == "json" and is_json_lines(f):
                for sid, lineno, raw in iter_lines(f):
                    if sid == k:
                        return f, k, lineno, raw
            return f, k, None, None
        offset += n
    return None


def locate_row(kind: str, files: list[str], row: int, shown: Mapping[str, str] | None = None) -> str | None:
    """``"FILE:LINE"`` (JSON Lines) or ``"FILE row K"`` (K 0-based) for row ``row`` (0-based) of the
    concatenation of ``files`` as :func:`load_chat_data` reads them, each file named as ``shown`` maps it (the
    path the caller wrote); ``None`` if it cannot be told. Runs on error paths only (it reads the files
    again)."""
    found = _find_row(kind, files, row)
    if found is None:
        return None
    f, k, lineno, _ = found
    f = (shown or {}).get(f, f)
    return f"{f}:{lineno}" if lineno is not None else f"{f} row {k}"


def locate_samples(paths: Sequence[str | os.PathLike[str]], sample_ids: Any) -> dict[int, str]:
    """Where samples came from: ``{sample_id: "FILE:LINE"}`` for the rows of JSON Lines files, ``"FILE[i]"`` for
    a row of a JSON array (:func:`varpack.data.jsonfile.read_rows`), ``"FILE row K"`` for parquet; sample ``i``
    is row ``i`` of the files read one after the other, as :func:`load_chat_data` and
    :func:`varpack.data.multimodal.load_mm_rows` number them (blank lines are not rows). Each file is read at
    most once, and not past the last wanted row's file (for reports of a few samples: overlong, left out).

    Args:
        paths: the data files, in the order they were read.
        sample_ids: the ids to locate (any iterable of ints; ids beyond the files' rows are left out).

    Returns:
        ``{sample_id: location}`` for the ids found.
    """
    from varpack.data.jsonfile import is_json_lines, iter_lines, location, read_rows

    wanted = {int(i) for i in sample_ids}
    last = max(wanted, default=-1)
    out: dict[int, str] = {}
    offset = 0
    for p in paths:
        if offset > last:
            break
        shown = os.fspath(p)
        path = os.path.expanduser(shown)
        if _kinds_of([shown]) == {"parquet"}:
            import pyarrow.parquet as pq

            n = pq.ParquetFile(path).metadata.num_rows
            out.update({i: f"{shown} row {i - offset}" for i in wanted if offset <= i < offset + n})
        elif is_json_lines(shown):
            n = 0
            for k, lineno, _ in iter_lines(path):
                if offset + k in wanted:
                    out[offset + k] = location(shown, lineno)
                n = k + 1
        else:
            rows = read_rows(path)
            n = len(rows)
            out.update(
                {i: rows[i - offset][1].replace(path, shown, 1) for i in wanted if offset <= i < offset + n}
            )
        offset += n
    return out


def _check_utf8(ds: datasets.Dataset, kind: str, files: list[str]) -> None:
    """Refuse text that is not UTF-8 in a dataset read from ``files`` (Arrow's full validation; ``datasets``
    reads such bytes into string columns, and they fail later, unlocated, when a row is converted to Python).

    Raises:
        ValueError: naming the file, line (JSON Lines; else the row in the file) and sample of the first bad
            row, and for JSON Lines the byte (:func:`varpack.data.jsonfile.decode_text`).
    """
    import pyarrow as pa

    table = ds.data.table
    try:
        table.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    # the first bad row: blocks, then rows, each copied out (a slice shares its nested children's data)
    bad, block = None, 1024
    for lo in range(0, table.num_rows, block):
        hi = min(lo + block, table.num_rows)
        try:
            table.take(list(range(lo, hi))).validate(full=True)
        except pa.ArrowInvalid:
            for j in range(lo, hi):
                try:
                    table.take([j]).validate(full=True)
                except pa.ArrowInvalid as exc:
                    bad = (j, exc)
                    break
            break
    if bad is None:  # invalid for another reason than one row's bytes: Arrow's own words
        table.validate(full=True)
        return
    row, exc = bad
    found = _find_row(kind, files, row)
    if found is not None and found[3] is not None:
        from varpack.data.jsonfile import decode_text, location

        decode_text(found[3], location(found[0], found[2], row))  # raises, naming the byte
    where = locate_row(kind, files, row) or ", ".join(files)
    raise ValueError(
        f"{where}: sample {row}: not UTF-8 text ({exc}); varpack reads data files as UTF-8: convert the file"
    )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hash of everything that decides how a chat encodes: the tokenizer's serialized backend
    (vocabulary, merges, normalizer, pre-tokenizer, added tokens), class, special tokens, chat template.
    Used as part of the ``datasets`` fingerprint (hashing the tokenizer object with ``datasets``' pickler
    takes seconds)."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(sorted(tokenizer.special_tokens_map.items())).encode())
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def _encoder_from_bytes(payload: bytes) -> _EncodeBatch:
    return _EncodeBatch(pickle.loads(payload))


class _EncodeBatch:
    """``Dataset.map`` function (batched, with indices); a picklable class, not a closure.

    It reduces to the tokenizer pickled with the standard ``pickle`` (the workers of ``num_proc`` receive
    it through ``dill``, which is several times slower on a 150k-token tokenizer)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _encoder_from_bytes, (pickle.dumps(self.tokenizer, protocol=pickle.HIGHEST_PROTOCOL),)

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        from varpack.data.formats import row_to_messages

        messages = [row_to_messages({k: v[j] for k, v in batch.items()}, sid)[0] for j, sid in enumerate(indices)]
        results = _encode_many(messages, self.tokenizer, indices)
        return {
            "input_ids": [r["input_ids"] for r in results],
            "labels": [r["labels"] for r in results],
            "length": [r["length"] for r in results],
            "sample_id": list(indices),
        }


def encode_dataset(
    data: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_proc: int | None = None,
    desc: str = "encode",
    batch_size: int = 256,
    cache_dir: str | os.PathLike[str] | None = None,
) -> datasets.Dataset:
    """Encode every conversation once with ``Dataset.map`` and cache the result as Arrow.

    Args:
        data: anything :func:`load_chat_data` accepts (paths, rows, a ``datasets.Dataset``) in any format of
            :mod:`varpack.data.formats`; each row is converted to messages as it is encoded.
        tokenizer: any Hugging Face tokenizer with a chat template.
        num_proc: worker processes for ``Dataset.map`` (``None``: in this process).
        desc: label of the ``datasets`` progress bar.
        batch_size: conversations per ``map`` batch (tokenized together).
        cache_dir: where the Arrow cache of in-memory input is written (file-backed input is cached next
            to its ``datasets`` cache); default ``$VARPACK_CACHE/encoded`` (``~/.cache/varpack/encoded``).

    Returns:
        ``datasets.Dataset`` with columns ``input_ids`` (int32 lists), ``labels`` (int32 lists, -100
        outside assistant turns, first label -100), ``length`` (int64) and ``sample_id`` (int64, the row
        index in ``data``); other columns are dropped. Row i is sample i. The ``datasets`` fingerprint
        combines the input's fingerprint and :func:`tokenizer_fingerprint`, so a second call with the
        same data and tokenizer loads the cache instead of encoding again.

    Raises:
        ValueError / TypeError: a bad row (the error names its sample id and field, see
            :func:`encode_chat` and :func:`varpack.data.formats.row_to_messages`, and its ``FILE:LINE``
            for files), or a row of no supported format.
    """
    import datasets

    from varpack.data.tokenizer import varpack_cache_root

    ds = load_chat_data(data)
    if len(ds) == 0:
        raise ValueError("chat data has no rows")
    fingerprint = hashlib.sha256(
        f"varpack-encode-{_encoder_version()}-{ds._fingerprint}-{tokenizer_fingerprint(tokenizer)}".encode()
    ).hexdigest()[:32]
    cache_file_name = None
    if not ds.cache_files:  # in memory: datasets would not cache, so name an Arrow file ourselves
        root = Path(cache_dir).expanduser() if cache_dir is not None else varpack_cache_root() / "encoded"
        root.mkdir(parents=True, exist_ok=True)
        cache_file_name = str(root / f"encoded-{fingerprint}.arrow")
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "length": datasets.Value("int64"),
            "sample_id": datasets.Value("int64"),
        }
    )
    try:
        return _map_encode(ds, tokenizer, batch_size, features, num_proc, desc, fingerprint, cache_file_name)
    except (ValueError, TypeError) as exc:  # name the file and line of a bad row (error path only)
        located = locate_error(exc, ds)
        if located is exc:
            raise
        raise located from exc


def locate_error(exc: Exception, data: Any) -> Exception:
    """``exc`` with its message prefixed by ``FILE:LINE: `` (``FILE row K: `` for a JSON array / parquet row) when
    it starts with ``sample N:`` and ``data`` is a dataset read from files by :func:`load_chat_data`, the form
    every data error takes (a bad JSON line, a streamed row); otherwise ``exc`` itself. Runs on error paths
    only."""
    m = re.match(r"sample (\d+): ", str(exc))
    sources = getattr(data, "_varpack_files", None)
    where = locate_row(*sources[:2], int(m.group(1)), *sources[2:]) if (m and sources) else None
    if where is None:
        return exc
    return type(exc)(f"{where}: {exc}")


def _map_encode(ds, tokenizer, batch_size, features, num_proc, desc, fingerprint, cache_file_name):  # noqa: ANN001
    return ds.map(
        _EncodeBatch(tokenizer),
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
        num_proc=num_proc,
        desc=desc,
        new_fingerprint=fingerprint,
        cache_file_name=cache_file_name,
    )
