"""varpack.data.load_and_encode: the one load-and-encode entry of sft / plan / check / benchmarks."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("datasets")

from varpack.data import load_and_encode  # noqa: E402
from varpack.data.builtin import builtin_chats  # noqa: E402
from varpack.data.chat import encode_dataset  # noqa: E402
from varpack.data.multimodal import encode_any  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def _never(*_a, **_k):
    raise AssertionError("loader called")


def test_text_files_and_builtin_match_the_encoders(tmp_path, tok):
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_and_encode([str(path)], tok, rope_model=_never, formats=True)  # text: no model needed
    want = encode_dataset([str(path)], tok)
    assert not out.multimodal and out.paths == (str(path),) and out.source == str(path)
    assert out.formats == {"messages": 1, "sharegpt": 1}
    assert out.samples["input_ids"] == want["input_ids"] and out.samples["labels"] == want["labels"]
    assert out.lengths().tolist() == want["length"]
    builtin = load_and_encode(None, lambda: tok)
    assert builtin.source == "built-in chats" and builtin.paths == () and builtin.formats is None
    assert builtin.samples["input_ids"] == encode_dataset(builtin_chats(), tok)["input_ids"]


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson"])  # .ndjson is not read by the image-chat probe
def test_bad_row_is_reported_before_the_tokenizer_loads(tmp_path, suffix):
    path = tmp_path / f"bad{suffix}"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(ValueError, match="sample 0.*preference"):
        load_and_encode([str(path)], _never, formats=True)


def test_vl_builtin_routes_to_the_vision_language_encoder(tok):
    calls = []

    def rope_model():
        calls.append(1)
        return None  # no positions: the Qwen3-VL image values

    out = load_and_encode(None, tok, vl=True, rope_model=rope_model, with_pixels=False)
    assert out.multimodal and calls == [1] and out.source == "built-in image-caption chats"
    want = encode_any(list(out.paths), tok, with_pixels=False)
    assert [s["input_ids"] for s in out.samples] == [s["input_ids"] for s in want]
    assert any(1 in s["mm_token_type_ids"] for s in out.samples)
