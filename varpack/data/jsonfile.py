"""Reading JSON / JSON Lines data files: the one reader of every varpack data path (chat files, image/video
chats, streams, preference pairs, and the error locations of the ``datasets`` loader).

A file is read as bytes, split on ``\\n`` only (U+2028 inside a JSON string is part of its row), each line
decoded as UTF-8 and parsed with :mod:`json`; blank lines are not rows. A UTF-8 byte order mark at the start of
a file (``EF BB BF``, written by some Windows editors and by ``utf-8-sig`` encoders) is skipped. Compressed
files (``.gz``, ``.bz2``, ``.xz``, ``.zst``, ...) are opened by their suffix (``fsspec``'s
``compression="infer"``). A line that is not
UTF-8 text or not JSON is a ``ValueError`` naming the file, the line and the sample (its index among the
rows of the files read together), one way for every reader::

    chats.jsonl:2: sample 1: not UTF-8 text: byte 0xe9 at byte 93 of the line (invalid continuation byte); ...
    chats.jsonl:3: sample 2: invalid JSON: Expecting ',' delimiter: line 1 column 95 (char 94)

A JSON document (an array of rows, or one object, in a ``.json`` file) is parsed whole; its errors name the
file and line (a row of an array has no line of its own: rows are then named ``FILE[i]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["decode_text", "is_json_lines", "iter_lines", "location", "parse_line", "read_rows", "require_file"]

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_DATA_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet")
_BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark


def location(path: str | os.PathLike[str], lineno: int, sample_id: int | None = None) -> str:
    """``"FILE:LINE"``, or ``"FILE:LINE: sample N"`` with a sample id: how every data error starts."""
    where = f"{os.fspath(path)}:{lineno}"
    return where if sample_id is None else f"{where}: sample {sample_id}"


def require_file(path: str | os.PathLike[str]) -> None:
    """Refuse a data path that is not a file (every reader of data files, and the CLI before its imports).

    Raises:
        IsADirectoryError: ``chat data path 'DIR' is a directory, not a file: give the data files in it (e.g.
            DIR/*.jsonl; it holds 3 .jsonl files)``: varpack reads the files it is given, not folders.
        FileNotFoundError: ``chat data file not found: 'PATH'``.
    """
    shown = os.fspath(path)
    full = os.path.expanduser(shown)
    if os.path.isfile(full):
        return
    if not os.path.isdir(full):
        raise FileNotFoundError(f"chat data file not found: {shown!r}")
    counts: dict[str, int] = {}
    try:
        names = os.listdir(full)
    except OSError:
        names = []
    for name in names:
        suffix = _suffix(name)
        if suffix in _DATA_SUFFIXES and os.path.isfile(os.path.join(full, name)):
            comp = next((c for c in _COMPRESSION_SUFFIXES if name.lower().endswith(c)), "")
            key = suffix + comp
            counts[key] = counts.get(key, 0) + 1
    if counts:
        top = max(counts, key=lambda k: counts[k])
        held = ", ".join(f"{n} {k} file{'s' if n > 1 else ''}" for k, n in sorted(counts.items()))
        hint = f"e.g. {os.path.join(shown, '*' + top)}; it holds {held}"
    else:
        hint = "it holds no .json / .jsonl / .ndjson / .parquet file"
    raise IsADirectoryError(
        f"chat data path {shown!r} is a directory, not a file: give the data files in it ({hint})"
    )


def decode_text(raw: bytes, where: str, *, document: bool = False) -> str:
    """``raw`` decoded as UTF-8.

    Args:
        raw: a line (or, with ``document``, a whole file) of a data file.
        where: how the error names it (:func:`location`; with ``document`` the file, the line of the bad
            byte is added).
        document: ``raw`` is a whole file.

    Raises:
        ValueError: ``WHERE: not UTF-8 text: byte 0xe9 at byte 93 of the line (invalid continuation byte);
            ...`` (line and byte of the line counted from 1).
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = raw.rfind(b"\n", 0, exc.start) + 1
        if document:  # name the line of the bad byte
            lineno = raw.count(b"\n", 0, exc.start) + 1
            where = f"{where}:{lineno}"
        column = exc.start - line_start + 1
        msg = (
            f"{where}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte {column} of the "
            f"line ({exc.reason}); varpack reads data files as UTF-8: convert the file (e.g. iconv -f <its "
            "encoding> -t utf-8)"
        )
        raise ValueError(msg) from None


def parse_line(raw: bytes | str, where: str) -> Any:
    """One line of a JSON Lines file, decoded (:func:`decode_text`) and parsed.

    Raises:
        ValueError: not UTF-8 text, or ``WHERE: invalid JSON: ...`` (the :class:`json.JSONDecodeError`'s text).
    """
    text = decode_text(raw, where) if isinstance(raw, bytes) else raw
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON: {exc}") from exc


def _open(path: str | os.PathLike[str]) -> Any:
    import fsspec

    return fsspec.open(os.fspath(path), "rb", compression="infer")


def iter_lines(path: str | os.PathLike[str], *, first_sample: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """``(sample_id, line number, raw bytes)`` of every non-blank line of ``path``, read lazily (a byte order
    mark at the start of the file skipped); sample ids count from ``first_sample`` (the rows of the files read
    before it)."""
    sample_id = first_sample
    with _open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if lineno == 1 and line.startswith(_BOM):
                line = line[len(_BOM) :]
            if line.strip():
                yield sample_id, lineno, line
                sample_id += 1


def _suffix(path: str) -> str:
    name = os.path.basename(path).lower()
    for comp in _COMPRESSION_SUFFIXES:
        if name.endswith(comp):
            name = name[: -len(comp)]
            break
    return os.path.splitext(name)[1]


def is_json_lines(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is named as JSON Lines (``.jsonl`` / ``.ndjson``, optionally compressed)."""
    return _suffix(os.fspath(path)) in (".jsonl", ".ndjson")


def read_rows(
    path: str | os.PathLike[str], *, first_sample: int = 0, name: str | None = None
) -> list[tuple[Any, str]]:
    """Every row of a JSON / JSON Lines file with where it is: ``[(row, "FILE:LINE"), ...]`` for JSON Lines,
    ``[(row, "FILE[i]"), ...]`` for a JSON array; a ``.json`` file holding one object is one row, and one
    holding one object per line is read as JSON Lines. Rows are not checked (any JSON value). A byte order
    mark at the start of the file is skipped.

    Args:
        path: the file (compressed as its suffix says).
        first_sample: sample id of its first row (the rows of the files read before it), named in errors.
        name: the file as the caller wrote it, for the locations (default: ``path``).

    Raises:
        ValueError: a line / the document that is not UTF-8 text or not JSON (file, line and, for JSON Lines,
            the sample named).
    """
    path = os.fspath(path)
    shown = path if name is None else name
    with _open(path) as fh:
        data = fh.read()
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    head = data.lstrip()[:1]
    if head == b"[" or (head == b"{" and _suffix(path) == ".json"):
        text = decode_text(data, shown, document=True)
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            if head == b"[" or not exc.msg.startswith("Extra data"):
                raise ValueError(f"{location(shown, exc.lineno)}: invalid JSON: {exc}") from exc
        else:
            items = doc if isinstance(doc, list) else [doc]
            return [(row, f"{shown}[{i}]") for i, row in enumerate(items)]
    rows = []
    sample_id = first_sample
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if line.strip():
            where = location(shown, lineno)
            rows.append((parse_line(line, f"{where}: sample {sample_id}"), where))
            sample_id += 1
    return rows
