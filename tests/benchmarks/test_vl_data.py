"""benchmarks/vl_data.py: the vision-language SFT mix (text chats with the built-in image chats interleaved)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("skimage")

from benchmarks.vl_data import main, mixed_chats  # noqa: E402


def _write(path, n):
    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return str(path)


def _is_image(chat):
    content = chat["messages"][0]["content"]
    return isinstance(content, list) and content[0]["type"] == "image"


def test_every_kth_chat_is_an_image_chat_and_the_text_keeps_its_order(tmp_path):
    chats = mixed_chats([_write(tmp_path / "t.jsonl", 9)], image_every=4)
    kinds = [_is_image(c) for c in chats]
    assert kinds == [False, False, False, True] * 3  # 9 text chats, an image after every third
    texts = [c["messages"][0]["content"] for c in chats if not _is_image(c)]
    assert texts == [f"q{i}" for i in range(9)]
    images = [c["messages"][0]["content"][0]["image"] for c in chats if _is_image(c)]
    assert len(set(images)) == 3  # the built-in images in turn, not one repeated


def test_max_chats_and_image_only(tmp_path):
    text = _write(tmp_path / "t.jsonl", 50)
    assert len(mixed_chats([text], image_every=2, max_chats=7)) == 7
    only = mixed_chats([text], image_every=1, max_chats=20)
    assert len(only) == 20 and all(map(_is_image, only))  # cycled past the 17 built-in images
    with pytest.raises(ValueError, match="give max_chats"):
        mixed_chats([text], image_every=1)
    with pytest.raises(ValueError, match="image_every"):
        mixed_chats([text], image_every=0)


def test_a_bad_line_is_named_by_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"text": "no messages"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected an object with a 'messages' list"):
        mixed_chats([str(bad)], image_every=3)


def test_main_writes_the_file_and_its_counts(tmp_path, capsys):
    out = tmp_path / "vl.jsonl"
    assert main(["--text", _write(tmp_path / "t.jsonl", 6), "--out", str(out), "--image-every", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert report == {"out": str(out), "chats": 9, "image_chats": 3, "text_chats": 6} and len(lines) == 9
