"""Data formats (varpack.data.formats): ShareGPT, Alpaca and TRL prompt-completion rows encode exactly like
the hand-written ``messages`` row (LLaMA-Factory's / ms-swift's field mapping); refused formats and bad fields
are errors naming the sample, the field and the file line; files of different formats mix."""

from __future__ import annotations

import json
import re

import datasets
import pytest

from varpack.cli.main import main
from varpack.data.chat import encode_chat, encode_dataset, load_chat_data
from varpack.data.formats import data_formats, detect_format, row_to_messages
from varpack.data.tokenizer import load_tokenizer


def _u(text):
    return {"role": "user", "content": text}


def _a(text):
    return {"role": "assistant", "content": text}


def _s(text):
    return {"role": "system", "content": text}


CALL = {"name": "weather", "arguments": {"city": "Paris"}}

# (format, row, the messages row a user would write by hand for it)
CASES = [
    (
        "sharegpt",
        {
            "conversations": [
                {"from": "human", "value": "Name a prime."},
                {"from": "gpt", "value": "7"},
                {"from": "human", "value": "Another?"},
                {"from": "gpt", "value": "11"},
            ],
            "system": "You are terse.",
        },
        [_s("You are terse."), _u("Name a prime."), _a("7"), _u("Another?"), _a("11")],
    ),
    (
        "sharegpt",  # the aliases ms-swift accepts, and a system turn inside the conversation
        {
            "conversations": [
                {"from": "system", "value": "Be kind."},
                {"from": "user", "value": "hi"},
                {"from": "model", "value": "hello"},
                {"from": "human", "value": "bye"},
                {"from": "bot", "value": "see you"},
            ]
        },
        [_s("Be kind."), _u("hi"), _a("hello"), _u("bye"), _a("see you")],
    ),
    (
        "sharegpt",  # LLaMA-Factory's tool turns
        {
            "conversations": [
                {"from": "human", "value": "Weather in Paris?"},
                {"from": "function_call", "value": json.dumps(CALL)},
                {"from": "observation", "value": '{"temp": 21}'},
                {"from": "gpt", "value": "21 °C."},
            ]
        },
        [
            _u("Weather in Paris?"),
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
            {"role": "tool", "content": '{"temp": 21}'},
            _a("21 °C."),
        ],
    ),
    (
        "sharegpt",  # the variant with role/content inside 'conversations'
        {"conversations": [_u("2+2?"), _a("4")]},
        [_u("2+2?"), _a("4")],
    ),
    (
        "alpaca",
        {"instruction": "Add the numbers.", "input": "1 2", "output": "3"},
        [_u("Add the numbers.\n1 2"), _a("3")],  # LLaMA-Factory / ms-swift: instruction + "\n" + input
    ),
    (
        "alpaca",  # empty input: the instruction alone (LLaMA-Factory joins the non-empty parts)
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        [_u("Say hi."), _a("hi")],
    ),
    (
        "alpaca",  # system and history pairs (LLaMA-Factory's optional columns)
        {
            "instruction": "And 3+3?",
            "output": "6",
            "system": "Math tutor.",
            "history": [["1+1?", "2"], ["2+2?", "4"]],
        },
        [_s("Math tutor."), _u("1+1?"), _a("2"), _u("2+2?"), _a("4"), _u("And 3+3?"), _a("6")],
    ),
    (
        "prompt-completion",  # TRL standard: plain strings
        {"prompt": "The capital of France is", "completion": " Paris."},
        [_u("The capital of France is"), _a(" Paris.")],
    ),
    (
        "prompt-completion",  # TRL conversational: message lists, concatenated
        {"prompt": [_s("Geography."), _u("Capital of France?")], "completion": [_a("Paris.")]},
        [_s("Geography."), _u("Capital of France?"), _a("Paris.")],
    ),
    (
        "messages",  # a top-level system (ms-swift's column) is the first message
        {"messages": [_u("hi"), _a("yo")], "system": "Short answers."},
        [_s("Short answers."), _u("hi"), _a("yo")],
    ),
]
IDS = [f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(("fmt", "row", "expected"), CASES, ids=IDS)
def test_row_converts_to_the_hand_written_messages(fmt, row, expected):
    assert detect_format(row) == fmt
    messages, got_fmt = row_to_messages(row, 0)
    assert got_fmt == fmt
    assert messages == expected


@pytest.mark.parametrize(("fmt", "row", "expected"), CASES, ids=IDS)
def test_file_of_each_format_encodes_like_messages(tmp_path, tok, fmt, row, expected):
    """Through a JSONL file (Arrow, datasets cache) and as in-memory rows: the same input_ids and labels as
    encode_chat on the hand-written messages, which have supervised tokens."""
    want = encode_chat(expected, tok)
    assert any(label != -100 for label in want["labels"])
    path = _write_jsonl(tmp_path / f"{fmt}.jsonl", [row, row])
    from_file = encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), tok)
    from_rows = encode_dataset([row], tok, cache_dir=tmp_path / "enc")
    for encoded in (from_file[0], from_file[1], from_rows[0]):
        assert encoded["input_ids"] == want["input_ids"]
        assert encoded["labels"] == want["labels"]
        assert encoded["length"] == want["length"]


def test_formats_mix_across_and_within_files(tmp_path, tok):
    """Each row is detected on its own: files with different columns (and different message fields) load
    together, and one file may mix formats; sample ids follow file order."""
    rows = [row for _, row, _ in CASES]
    expected = [messages for _, _, messages in CASES]
    a = _write_jsonl(tmp_path / "a.jsonl", [{"messages": expected[0], "source": "x"}])
    b = _write_jsonl(tmp_path / "b.jsonl", rows)  # all formats in one file
    c = _write_jsonl(tmp_path / "c.jsonl", [{"messages": [_u("hi"), {**_a("yo"), "name": "bot"}]}])
    ds = load_chat_data([a, b, c], cache_dir=tmp_path / "hf")
    assert len(ds) == 2 + len(rows)
    counts = data_formats(ds)
    assert counts == {"messages": 3, "sharegpt": 4, "alpaca": 3, "prompt-completion": 2}
    assert data_formats(rows) == {"messages": 1, "sharegpt": 4, "alpaca": 3, "prompt-completion": 2}
    encoded = encode_dataset(ds, tok)
    want = [expected[0], *expected, [_u("hi"), {**_a("yo"), "name": "bot"}]]
    assert encoded["sample_id"] == list(range(len(want)))
    for got, messages in zip(encoded, want):
        ref = encode_chat(messages, tok)
        assert (got["input_ids"], got["labels"]) == (ref["input_ids"], ref["labels"])


# strings that are themselves JSON text: datasets' Json() type would read them back as the value they spell
JSONISH = ["4", '"Paris"', "true", "null", "[1, 2]", '{"a": 1}', "3.50"]


@pytest.mark.parametrize("layout", ["one file", "two files", "rows"])
def test_mixed_field_types_keep_every_string_exactly(tmp_path, layout):
    """A field that is a plain string in some rows and messages in others (prompt / completion here, a
    message's content beside content parts in image chats) is kept exactly: "4" stays the string "4", not the
    number 4 (datasets.Json() alone turns such strings into the JSON value they spell). Negative control:
    datasets' own reading of the same file changes them."""
    plain = [{"prompt": f"Say {v}", "completion": v} for v in JSONISH]
    conv = [{"prompt": [_u("Q")], "completion": [_a("A")]}]
    nested = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]}, _a(v)]} for v in JSONISH]
    if layout == "one file":
        src = [_write_jsonl(tmp_path / "mixed.jsonl", plain + conv)]
    elif layout == "two files":
        src = [_write_jsonl(tmp_path / "p.jsonl", plain), _write_jsonl(tmp_path / "c.jsonl", conv)]
    else:
        src = plain + conv
    ds = load_chat_data(src, cache_dir=tmp_path / "hf")
    assert [r["completion"] for r in ds] == JSONISH + [[_a("A")]]
    assert all(isinstance(r["completion"], str) for r in list(ds)[: len(JSONISH)])
    from varpack.data.chat import _dataset_from_rows

    got = _dataset_from_rows(nested + [{"messages": [_u("Q"), _a("A")]}]).to_list()
    assert [r["messages"][1]["content"] for r in got] == JSONISH + ["A"]
    if layout == "one file" and hasattr(datasets, "Json"):  # negative control: datasets alone changes them
        raw = datasets.load_dataset("json", data_files=[str(p) for p in src], split="train", cache_dir=str(tmp_path / "hf2"))
        assert [r["completion"] for r in raw][: len(JSONISH)] != JSONISH


# (row, error type, regex on the message): every error names the sample and the field
BAD = [
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
        TypeError,
        r"conversations\[1\]\.value is missing",
    ),
    (
        {"conversations": [{"from": "narrator", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        ValueError,
        r"conversations\[0\]\.from='narrator' is not a ShareGPT role",
    ),
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},
        ValueError,
        r"conversations\[1\]\.value is empty",
    ),
    (
        {"conversations": [{"from": "human", "value": "hi"}]},
        ValueError,
        r"conversations has no assistant turn",
    ),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "f(x)"}]},
        ValueError,
        r"conversations\[1\]\.value of a function_call turn must be JSON",
    ),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "[]"}]},
        ValueError,
        r"conversations\[1\]\.value of a function_call turn holds no call",
    ),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y", "weight": 0}]},
        ValueError,
        r"conversations\[1\]\.weight=0 switches training on this turn off",
    ),
    ({"instruction": "Add.", "input": "1 2", "output": ""}, ValueError, r"output is empty"),
    ({"instruction": "Add.", "input": "1 2"}, TypeError, r"output is missing"),
    ({"instruction": "Add.", "output": 3}, TypeError, r"output must be a str, got int"),
    ({"instruction": "q", "output": "a", "history": [["q0"]]}, TypeError, r"history\[0\] must be a \[query"),
    ({"prompt": "hi", "completion": ""}, ValueError, r"completion is empty"),
    (
        {"prompt": "hi", "completion": [_a("yo")]},
        TypeError,
        r"prompt and completion must both be strings or both be message lists",
    ),
    (
        {"prompt": [_u("hi"), _a("yo"), _u("more")], "completion": [_a("ok")]},
        ValueError,
        r"prompt\[1\] is an assistant turn; TRL trains only on 'completion'",
    ),
    (
        {"prompt": "hi", "chosen": "good", "rejected": "bad"},
        ValueError,
        r"preference data \(fields 'chosen'/'rejected', as for DPO\) is not an SFT chat; plan and train it with "
        r"--objective dpo \('varpack plan --objective dpo', 'varpack sft --objective dpo'",
    ),
    ({"prompt": "hi", "completion": "yo", "label": False}, ValueError, r"unpaired preference data .* KTO"),
    ({"prompt": "hi"}, ValueError, r"prompt-only row"),
    ({"text": "Once upon a time"}, ValueError, r"language-modeling row \(field 'text'\)"),
    (
        {"question": "q", "answer": "a"},
        ValueError,
        r"row has none of the fields of a supported chat format \(keys: \['answer', 'question'\]\)",
    ),
    (
        {"messages": None},
        ValueError,
        r"row has none of the fields of a supported chat format \(no field holds a value\); 'messages' is null or absent "
        r"\(a 'messages' row needs a list of \{role, content\}\); supported:",
    ),
    (
        {"instruction": None, "output": None, "id": 7},
        ValueError,
        r"row has none of the fields of a supported chat format \(keys: \['id'\]\); ('messages', )?'instruction', "
        r"'output' are null or absent(; | \()",
    ),
    (
        {"messages": [_u("hi"), _a("yo")], "conversations": [_u("hi")]},
        ValueError,
        r"row has both 'messages' and 'conversations'",
    ),
    ({"messages": [_u("hi"), _a("yo")], "tools": [{"name": "f"}]}, ValueError, r"'tools' .* not passed"),
    (
        {"conversations": [_u("<image>hi"), _a("yo")], "images": ["a.png"]},
        ValueError,
        r"field 'images' .* not converted",
    ),
    (
        {"messages": [_s("b"), _u("hi"), _a("yo")], "system": "a"},
        ValueError,
        r"a top-level 'system' and a system turn that differs",
    ),
]
BAD_IDS = [f"bad-{i}" for i in range(len(BAD))]


@pytest.mark.parametrize(("row", "exc", "pattern"), BAD, ids=BAD_IDS)
def test_bad_row_names_sample_and_field(tmp_path, tok, row, exc, pattern):
    good = {"messages": [_u("hi"), _a("yo")]}
    with pytest.raises(exc, match=r"^sample 1: " + pattern):
        load_chat_data([good, row])
    # from a file: the encoder names the sample, the field and FILE:LINE (the bad row is on line 3)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(exc, match=r"^\S*d\.jsonl:3: sample 1: " + pattern):
        encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), tok)


@pytest.mark.parametrize(
    ("fmt", "row", "expected"), [CASES[i] for i in (0, 4, 7, 8)], ids=[IDS[i] for i in (0, 4, 7, 8)]
)
def test_plan_cli_on_a_file_of_each_format(tmp_path, capsys, fmt, row, expected):
    """`varpack plan FILE` reports the format and plans the same tokens as the hand-written messages file."""
    converted = _write_jsonl(tmp_path / f"{fmt}.jsonl", [row] * 3)
    reference = _write_jsonl(tmp_path / "messages.jsonl", [{"messages": expected}] * 3)
    summaries = []
    for path in (converted, reference):
        assert main(["plan", str(path), "--packing-length", "512", "--json"]) == 0
        summaries.append(json.loads(capsys.readouterr().out))
    assert summaries[0]["formats"] == {fmt: 3} and summaries[1]["formats"] == {"messages": 3}
    assert summaries[0]["input_tokens"] == summaries[1]["input_tokens"] > 0
    assert summaries[0]["fingerprint"] == summaries[1]["fingerprint"]  # same lengths, same plan
    assert main(["plan", str(converted), "--packing-length", "512"]) == 0
    table = capsys.readouterr().out
    assert f"{fmt} (converted)" in table


def test_plan_cli_mixed_files_and_refused_preference_file(tmp_path, capsys):
    files = [_write_jsonl(tmp_path / f"f{i}.jsonl", [row]) for i, (_, row, _) in enumerate(CASES)]
    assert main(["plan", *map(str, files), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_samples"] == len(CASES)
    assert summary["formats"] == {"messages": 1, "sharegpt": 4, "alpaca": 3, "prompt-completion": 2}
    # TRL's conversational preference rows (as in ../shared/data/mt_bench_pairs.jsonl): refused, not converted
    pairs = _write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": [_u("hi")], "chosen": [_a("hello")], "rejected": [_a("go")]}]
    )
    assert main(["plan", str(pairs), "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "pairs.jsonl:1: sample 0: preference data" in captured.err


def test_refused_rows_in_parquet_name_the_file_row(tmp_path, capsys):
    """Parquet (no JSON line to name): the refusal still names the sample and its file row."""
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"text": "a"}, {"text": "b"}]).to_parquet(str(path))
    assert main(["plan", str(path), "--json"]) == 1
    err = capsys.readouterr().err
    assert "d.parquet row 0: sample 0: language-modeling row" in err


def test_null_messages_named_by_every_path(tmp_path, capsys):
    """``{"messages": null}`` was "row has none of the fields of a supported chat format (keys: [])": the
    field the row does hold went unnamed. Named on the Arrow path (data_formats over a Dataset read by
    datasets: .ndjson), the JSON reader (.jsonl, read first by the image-chat probe) and the CLI."""
    from varpack.data import load_and_encode

    good = {"messages": [_u("hi"), _a("yo")]}
    want = r"sample 1: .*; 'messages' is null or absent \(a 'messages' row needs a list of \{role, content\}\)"
    for name in ("d.ndjson", "d.jsonl"):
        path = tmp_path / name
        path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": None}) + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"^\S*" + name.replace(".", r"\.") + r":2: " + want):
            load_and_encode([str(path)], lambda: None, formats=True)
    with pytest.raises(ValueError, match=want):
        data_formats(datasets.Dataset.from_list([good, {"messages": None}]))
    assert main(["plan", str(tmp_path / "d.jsonl")]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert "Traceback" not in err and re.search(r"^varpack plan: error: \S*d\.jsonl:2: " + want, last), last
    assert "(no field holds a value)" in last and "keys: []" not in last


@pytest.mark.parametrize(
    "row, field",
    [
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]}, "conversations[1].value"),
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}, "conversations[1].value"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}, "messages[1].content"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]},
            "messages[1].content",
        ),
    ],
)
def test_null_or_absent_turn_field_says_both(row, field):
    """A turn's field given as null was reported as "missing" (the row has the key): the error says "missing or
    null" for both, naming the field (ShareGPT rows when converted, messages when validated)."""
    from varpack.data.chat import validate_messages

    with pytest.raises(TypeError, match=re.escape(field if "null" in field else f"{field} is missing or null")):
        validate_messages(row_to_messages(row)[0])


def test_a_turn_that_only_calls_tools_may_have_null_content(tok):
    """OpenAI's format writes ``"content": null`` for an assistant turn that only calls tools: it is encoded as
    the same turn with ``"content": ""`` (what chat templates render for it), from a file and in memory; a null
    content without tool calls is still refused (above)."""
    from varpack.data.chat import encode_chat, validate_messages

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turns = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    absent = [turns[0], {"role": "assistant", "tool_calls": [call]}, *turns[2:]]
    empty = [turns[0], {"role": "assistant", "content": "", "tool_calls": [call]}, *turns[2:]]
    assert validate_messages(turns)[1] == empty[1] == validate_messages(absent)[1]
    want = encode_chat(empty, tok)
    for messages in (turns, absent):
        got = encode_chat(messages, tok)
        assert got["input_ids"] == want["input_ids"] and got["labels"] == want["labels"]
    assert "get_weather" in tok.decode(want["input_ids"])  # the call itself is in the encoded text


def test_embedded_template_renders_tool_calls_as_qwen3_and_supervises_them(tok):
    """The embedded ChatML template writes an assistant turn's tool calls in Qwen3's layout, inside the
    supervised span (a call is what the model learns to emit); arguments given as a JSON string are kept as
    written. A turn without tool calls renders as before (the control)."""
    from varpack.data.chat import encode_chat

    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "f", "arguments": '{"x": 1}'}},
    ]
    turns = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    enc = encode_chat(turns, tok)
    reply = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
    )
    assert tok.decode(enc["input_ids"]) == (
        f"<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n{reply}\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n"
    )
    supervised = tok.decode([t for t, label in zip(enc["input_ids"], enc["labels"]) if label != -100])
    assert supervised == reply + "Sunny.<|im_end|>"
    plain = encode_chat([turns[0], {"role": "assistant", "content": "Checking."}], tok)
    assert tok.decode(plain["input_ids"]).endswith("<|im_start|>assistant\nChecking.<|im_end|>\n")


@pytest.mark.parametrize("key, value", [("tool_calls", [{"function": {"name": "f", "arguments": {}}}]),
                                        ("reasoning_content", "think first")])  # fmt: skip
def test_an_answer_field_the_template_does_not_render_is_refused(tok, key, value):
    """A template that never reads ``tool_calls`` / ``reasoning_content`` would drop the field and train the
    turn without it: refused, naming the sample, the field and the tokenizer. The same row with a template that
    reads the field encodes (the control)."""
    import copy

    from varpack.data.chat import encode_chat

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", key: value}]
    blind = copy.deepcopy(tok)
    blind.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' %}{%- generation %}{{- m.content + '<|im_end|>' }}{%- endgeneration %}"
        "{%- else %}{{- m.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    )
    with pytest.raises(ValueError, match=rf"^sample 7: messages\[1\]\.{key} is set, but the chat template of .* does not render {key}"):
        encode_chat(turns, blind, sample_id=7)
    reads = copy.deepcopy(blind)
    reads.chat_template = blind.chat_template.replace("m.content + '<|im_end|>' }}{%- endgeneration",
                                                      f"m.content + (m.{key} | string) + '<|im_end|>' }}}}{{%- endgeneration")  # fmt: skip
    shown = "think first" if key == "reasoning_content" else "'name': 'f'"
    assert shown in tok.decode(encode_chat(turns, reads)["input_ids"])


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize(
    "turn, message",
    [
        ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"arguments": {}}}]},
         r"messages\[1\]\.tool_calls\[0\]\.function\.name is missing, null or empty"),
        ({"role": "assistant", "content": "", "tool_calls": "get_weather()"},
         r"messages\[1\]\.tool_calls must be a list of calls, got str"),
        ({"role": "assistant", "content": "", "tool_calls": ["x"]},
         r"messages\[1\]\.tool_calls\[0\] must be a dict"),
        ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
         r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a dict or a JSON string, got missing or null"),
        ({"role": "user", "content": "hi", "tool_calls": [{"function": CALL}]},
         r"messages\[1\]\.tool_calls is on a 'user' turn; only assistant turns call tools"),
    ],
)  # fmt: skip
def test_a_malformed_tool_call_is_named(turn, message):
    """A tool call the template cannot render (no name, not a list of dicts, no arguments) or on a turn that
    does not call tools: refused naming the field, before the template (which failed with jinja2's
    "'dict object' has no attribute 'name'", a traceback under --streaming)."""
    from varpack.data.chat import validate_messages

    first = {"role": "user", "content": "weather?"}
    last = {"role": "assistant", "content": "ok"}
    with pytest.raises((TypeError, ValueError), match=r"^sample 4: " + message):
        validate_messages([first, turn, last], 4)
    assert validate_messages([first, {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]}, last])


def test_openai_legacy_function_call_is_trained_as_a_tool_call(tok):
    """OpenAI's legacy ``function_call`` on an assistant turn (dropped by every template that reads
    ``tool_calls``) is encoded as the same turn with that one call in ``tool_calls``."""
    first = {"role": "user", "content": "weather?"}
    legacy = [first, {"role": "assistant", "content": None, "function_call": CALL}]
    modern = [first, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]}]
    got, want = encode_chat(legacy, tok), encode_chat(modern, tok)
    assert got == want and "get_weather" in tok.decode([t for t, y in zip(got["input_ids"], got["labels"]) if y != -100])


def test_a_template_failure_is_named_by_sample(tok):
    """A template's own error (here: ``raise_exception``) names the sample, also for one conversation (the
    streaming path encodes one row at a time)."""
    import copy

    strict = copy.deepcopy(tok)
    strict.chat_template = tok.chat_template.replace(
        "{%- for message in messages %}", "{%- for message in messages %}{%- if message.content == 'boom' %}"
        "{{ raise_exception('no boom here') }}{%- endif %}", 1
    )
    with pytest.raises(ValueError, match=r"^sample 9: chat template failed: no boom here"):
        encode_chat([{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}], strict, sample_id=9)


def test_rows_mixing_field_types_around_a_blank_line_load(tmp_path, tok):
    """A string prompt / completion row, a blank line, then a message-list row: datasets' JSON reader failed with
    pandas' "Expected object or value" (no file, no line); varpack's reader takes over and both rows load."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"prompt": "hi", "completion": "yo"}) + "\n\n"
        + json.dumps({"prompt": [_u("hi")], "completion": [_a("yo")]}) + "\n", encoding="utf-8",
    )  # fmt: skip
    rows = load_chat_data(str(path))
    assert len(rows) == 2
    enc = encode_dataset(rows, tok)
    assert enc[0]["input_ids"] == enc[1]["input_ids"]  # the same chat, written two ways
