"""Preference pairs (varpack.data.preference): TRL's preference format -> chosen / rejected samples with the full
prompt and labels on the completion only; bad rows named by pair and field (and FILE:LINE)."""

from __future__ import annotations

import json

import pytest

from varpack.data.preference import builtin_pairs, encode_pair, encode_pairs, load_pairs, pair_groups
from varpack.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def _completion(tok, sample):
    return tok.decode([t for t in sample["labels"] if t != -100])


def test_conversational_pair(tok):
    row = {
        "prompt": PROMPT,
        "chosen": [{"role": "assistant", "content": "6"}],
        "rejected": [{"role": "assistant", "content": "seven"}],
    }
    chosen, rejected = encode_pair(row, tok)
    prompt_text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    for sample, answer in ((chosen, "6"), (rejected, "seven")):
        full = tok.apply_chat_template(PROMPT + [{"role": "assistant", "content": answer}], tokenize=False)
        assert sample["input_ids"] == tok(full, add_special_tokens=False)["input_ids"]  # the full prompt
        assert sample["input_ids"][: len(prompt_ids)] == prompt_ids
        assert sample["length"] == len(sample["input_ids"]) == len(sample["labels"])
        # labels only on the completion (TRL: everything after the prompt), the prompt's own "4" is not
        assert all(t == -100 for t in sample["labels"][: len(prompt_ids)])
        assert sample["labels"][len(prompt_ids) :] == sample["input_ids"][len(prompt_ids) :]
        assert _completion(tok, sample) == full[len(prompt_text) :]
        assert sample["labels"][0] == -100


def test_plain_pair_goes_through_the_template(tok):
    chosen, rejected = encode_pair({"prompt": "hi", "chosen": "hello", "rejected": "go away"}, tok)
    assert _completion(tok, chosen) == "hello<|im_end|>\n"
    assert _completion(tok, rejected) == "go away<|im_end|>\n"
    assert tok.decode(chosen["input_ids"]).startswith("<|im_start|>user\nhi<|im_end|>")


def test_encode_pairs_order_and_groups(tok):
    rows = builtin_pairs()[:5]
    enc = encode_pairs(rows, tok, batch_size=2)  # several tokenizer batches
    assert len(enc) == 10
    for k, row in enumerate(rows):
        c, r = encode_pair(row, tok)
        assert enc[2 * k] == c and enc[2 * k + 1] == r
    assert pair_groups(10).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError, match="odd count 3"):
        pair_groups(3)


def test_builtin_pairs():
    pairs = builtin_pairs()
    assert len(pairs) >= 60
    for p in pairs:
        assert p["prompt"][-1]["role"] == "user"
        assert p["chosen"][0]["content"] != p["rejected"][0]["content"]
        assert len(p["chosen"][0]["content"]) <= 1200 and len(p["rejected"][0]["content"]) <= 1200


ASSISTANT = [{"role": "assistant", "content": "x"}]


@pytest.mark.parametrize(
    "row, exc, match",
    [
        (
            {"chosen": ASSISTANT, "rejected": ASSISTANT},
            ValueError,
            r"pair 0: field 'prompt' is missing.*implicit",
        ),
        ({"prompt": "hi", "chosen": "a"}, ValueError, r"pair 0: field 'rejected' is missing"),
        ({"prompt": "hi", "chosen": " ", "rejected": "b"}, ValueError, r"pair 0: field 'chosen' is empty"),
        (
            {"prompt": "hi", "chosen": ASSISTANT, "rejected": ASSISTANT},
            TypeError,
            r"pair 0: field 'prompt' is a str but field 'chosen' is a list",
        ),
        (
            {"prompt": PROMPT, "chosen": ASSISTANT, "rejected": [{"role": "user", "content": "x"}]},
            ValueError,
            r"pair 0: rejected\[0\].role='user'; an answer holds assistant turns only",
        ),
        (
            {"prompt": PROMPT[:3], "chosen": ASSISTANT, "rejected": ASSISTANT},
            ValueError,
            r"pair 0: prompt\[2\] is an assistant turn",
        ),
        (
            {"prompt": [{"role": "user", "content": 3}], "chosen": ASSISTANT, "rejected": ASSISTANT},
            TypeError,
            r"pair 0: prompt\[0\].content must be a str, got a int",
        ),
        (
            {"prompt": PROMPT, "chosen": ASSISTANT, "rejected": 5},
            TypeError,
            r"pair 0: field 'rejected' must be a str",
        ),
        (
            {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": ""}], "rejected": ASSISTANT},
            ValueError,
            r"pair 0: field 'chosen' is empty",
        ),
    ],
)
def test_bad_rows_named(tok, row, exc, match):
    with pytest.raises(exc, match=match):
        encode_pairs([row], tok)


def test_bad_row_in_file_names_line(tok, tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path.write_text(
        "\n".join(json.dumps(r) for r in [good, good, {"prompt": "q", "chosen": "a", "rejected": ""}])
    )
    rows = load_pairs(str(path))
    with pytest.raises(ValueError, match=r"pairs\.jsonl:3: pair 2: field 'rejected' is empty"):
        encode_pairs(rows, tok)


def test_template_not_prefix_stable_refused(tok):
    class Tok:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return (
                "PROMPT:" + messages[0]["content"] if add_generation_prompt else "P" + messages[-1]["content"]
            )

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

    with pytest.raises(
        ValueError, match="pair 0: the rendered prompt is not a prefix of the rendered prompt"
    ):
        encode_pairs([{"prompt": "q", "chosen": "a", "rejected": "b"}], Tok())


def test_a_pair_field_the_template_does_not_render_is_refused(tok):
    """A chosen answer's ``reasoning_content`` (which the embedded template has no block for) would be dropped
    from the pair: refused naming the pair and the field; the same pair without it encodes (the control)."""
    from varpack.data.preference import encode_pairs

    row = {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4", "reasoning_content": "two and two"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    with pytest.raises(ValueError, match=r"pair 0: chosen\[0\]\.reasoning_content is set, but the chat template"):
        encode_pairs([row], tok)
    del row["chosen"][0]["reasoning_content"]
    assert len(encode_pairs([row], tok)) == 2


def test_an_answer_that_only_calls_tools_is_a_pair(tok):
    """A chosen answer that only calls a tool (content "" or null, as SFT rows take it) is a preference answer,
    rendered with its call; a malformed call is named; a null content without a call is "missing or null"."""
    from varpack.data.preference import encode_pairs

    call = {"type": "function", "function": {"name": "w", "arguments": {"c": "P"}}}
    row = {
        "prompt": [{"role": "user", "content": "weather?"}],
        "chosen": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "rejected": [{"role": "assistant", "content": "no idea"}],
    }
    chosen, _ = encode_pairs([row], tok)
    assert '"name": "w"' in tok.decode([t for t, y in zip(chosen["input_ids"], chosen["labels"]) if y != -100])
    row["chosen"][0]["tool_calls"] = [{"function": {"arguments": {}}}]
    with pytest.raises(ValueError, match=r"pair 0: chosen\[0\]\.tool_calls\[0\]\.function\.name is missing"):
        encode_pairs([row], tok)
    row["chosen"] = [{"role": "assistant", "content": None}]
    with pytest.raises(TypeError, match=r"pair 0: chosen\[0\]\.content is missing or null"):
        encode_pairs([row], tok)
