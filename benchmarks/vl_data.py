"""A vision-language SFT set for the VL step: real text chats with varpack's built-in image-caption chats mixed in.

A vision-language fine-tuning set mixes image chats and text-only chats; packs then hold both kinds, each image's
placeholder span expanded to its final count (``image_grid_thw.prod() // merge**2`` tokens per image). This writes
one: the chats of ``--text`` (JSON Lines of ``{"messages": [...]}``, e.g. ``code_alpaca.jsonl``) in their order,
with one image chat of :func:`varpack.data.vl_builtin.builtin_vl_chats` (the 17 sample images that scikit-image
and matplotlib ship, captions written for varpack; cycled) after every ``--image-every - 1`` text chats. Image
paths are absolute on the machine that runs this: write the file where it is trained on::

    python -m benchmarks.vl_data --text .gpu/data/code_alpaca.jsonl --out /tmp/vl_mix.jsonl
    varpack sft --model qwen3.5-vl-hybrid-shape --dtype bfloat16 --packing-length 8192 --data /tmp/vl_mix.jsonl

Prints one JSON line: chats written, image chats, text chats.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["mixed_chats", "main"]


def _text_chats(paths: Sequence[str]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    chat = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not JSON ({exc.msg})") from exc
                if not isinstance(chat, dict) or not isinstance(chat.get("messages"), list):
                    raise ValueError(f"{path}:{line_no}: expected an object with a 'messages' list")
                yield {"messages": chat["messages"]}


def _has_image(chat: dict[str, Any]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(part.get("type") == "image" for part in m["content"])
        for m in chat["messages"]
    )


def mixed_chats(text_files: Sequence[str], *, image_every: int, max_chats: int | None = None) -> list[dict[str, Any]]:
    """The text chats of ``text_files`` with one built-in image chat at every ``image_every``-th position.

    Args:
        text_files: JSON Lines files of ``{"messages": [...]}`` chats (other keys dropped).
        image_every: one chat in this many is an image chat (>= 1; 1: image chats only, cycled up to
            ``max_chats``).
        max_chats: stop after this many chats (default: when the text chats run out).

    Returns:
        Chats as ``{"messages": [...]}``; image chats carry absolute image paths.

    Raises:
        ValueError: ``image_every < 1``, ``max_chats < 1``, ``image_every == 1`` without ``max_chats``, a line
            that is not a chat (naming file and line), or a missing package image.
    """
    from varpack.data.vl_builtin import builtin_vl_chats

    if image_every < 1:
        raise ValueError(f"image_every must be >= 1, got {image_every}")
    if max_chats is not None and max_chats < 1:
        raise ValueError(f"max_chats must be >= 1, got {max_chats}")
    if image_every == 1 and max_chats is None:
        raise ValueError("image_every=1 writes image chats only: give max_chats")
    images = builtin_vl_chats(include_text=False)
    texts = _text_chats(text_files)
    out: list[dict[str, Any]] = []
    n_image = 0
    while max_chats is None or len(out) < max_chats:
        if (len(out) + 1) % image_every == 0:
            out.append(images[n_image % len(images)])
            n_image += 1
            continue
        chat = next(texts, None)
        if chat is None:
            break
        out.append(chat)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", nargs="+", required=True, help="JSON Lines text chats")
    p.add_argument("--out", required=True, help="JSON Lines file to write")
    p.add_argument("--image-every", type=int, default=4, help="one image chat in this many (default: %(default)s)")
    p.add_argument("--max-chats", type=int, default=None, help="at most this many chats (default: all text chats)")
    args = p.parse_args(argv)
    try:
        chats = mixed_chats(args.text, image_every=args.image_every, max_chats=args.max_chats)
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for chat in chats:
            fh.write(json.dumps(chat, ensure_ascii=False) + "\n")
    n_image = sum(_has_image(c) for c in chats)
    print(json.dumps({"out": str(out), "chats": len(chats), "image_chats": n_image, "text_chats": len(chats) - n_image}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
